"""The DiT presets' parameter counts, recorded so that ``flowmatch budget`` needs no torch (the
checkpoint and fault rows of :mod:`.budget` price a run's states with them)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from flowmatch_models.storage.atomic import atomic_write_text

#: Parameter counts of the DiT presets (flowmatch_models/model/dit.py), recorded so that the budget
#: needs no torch: ``{"key": <dit.py + diffusers>, "counts": {"<preset>/<projector_hidden>":
#: [params, transformer params]}}``. Re-record: ``python -m flowmatch_assets.reports.param_counts``
#: (tests/test_budget.py fails when it is out of date; a stale table is computed at run time).
PARAM_COUNTS = Path(__file__).with_name("param_counts.json")


def _param_key() -> str:
    """What the presets' parameter counts depend on: dit.py's source and diffusers' version."""
    import hashlib
    import importlib.metadata
    import importlib.util

    origin = importlib.util.find_spec("flowmatch_models.model.dit").origin
    h = hashlib.sha256(Path(origin).read_bytes())
    h.update(importlib.metadata.version("diffusers").encode())
    return h.hexdigest()[:16]


def count_params_of(preset: str, projector_hidden: int | None) -> tuple[int, int]:
    """(every parameter, the transformer's) of a freshly built ``preset`` (on the meta device)."""
    import torch

    from flowmatch_models.model.dit import build_model, count_params

    with torch.device("meta"):
        model = build_model(preset, projector_hidden=projector_hidden)
    return count_params(model), count_params(model.transformer)


def param_counts(preset: str, projector_hidden: int | None) -> tuple[int, int]:
    """The recorded counts (:data:`PARAM_COUNTS`) when they are current, else computed."""
    try:
        table = json.loads(PARAM_COUNTS.read_text())
        if table["key"] == _param_key():
            return tuple(table["counts"][f"{preset}/{projector_hidden}"])  # type: ignore[return-value]
    except (OSError, ValueError, KeyError):
        pass
    return count_params_of(preset, projector_hidden)


def record_param_counts(configs: Sequence[str | Path] = ()) -> dict:
    """Write :data:`PARAM_COUNTS` for the model of every config in ``configs`` (default every
    ``configs/*.yaml``)."""
    from flowmatch_models.train.config import load_config

    paths = list(configs) or sorted(
        (Path(__file__).resolve().parents[2] / "configs").glob("*.yaml")
    )
    counts = {}
    for p in paths:
        m = load_config(p).model
        counts[f"{m.preset}/{m.projector_hidden}"] = list(
            count_params_of(m.preset, m.projector_hidden)
        )
    table = {"key": _param_key(), "counts": dict(sorted(counts.items()))}
    atomic_write_text(PARAM_COUNTS, json.dumps(table, indent=1) + "\n")
    return table


if __name__ == "__main__":
    print(json.dumps(record_param_counts(), indent=1))
