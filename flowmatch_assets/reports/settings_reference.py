"""docs/settings.md, made from the settings' own classes: every key a run's YAML and the
pipeline's settings take, with its default and what it means (each field's ``description``).

A newcomer looks here before adding a setting: the one they want may exist. The file is
generated (``python -m flowmatch_assets.reports.settings_reference > docs/settings.md``) and
tests/test_settings_reference.py fails when it is not current or a field has no description.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Literal, get_args, get_origin

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

HEADER = """# Every setting

Generated from the settings' classes by
`python -m flowmatch_assets.reports.settings_reference > docs/settings.md`
(`tests/test_settings_reference.py` fails when this file is not current). Look here before
adding a setting: the one you want may exist. Where a new one goes: docs/DESIGN.md,
"Where a change goes".
"""

TRAINING = """## A training run's YAML (`configs/tiny.yaml`, `flowmatch train --config`)

Each section is a key of the YAML; a dotted `--set section.key=value` on `flowmatch train`
overrides one (docs/training.md). Class: `TrainConfig` in `flowmatch_models/train/config.py`.
"""

PIPELINE = """## The pipeline's settings (the `flowmatch` resource)

Set in the launchpad's `resources.flowmatch.config`, or in the YAML that `FLOWMATCH_SETTINGS`
names (the standing settings, read per run); the top-level ones also from their `FLOWMATCH_*`
variables (docs/command-line.md, Settings). Class: `FlowmatchResource` in
`flowmatch_assets/defs/resources.py`; a source of your own images is `sources.<name>`.
"""


REPO = Path(__file__).resolve().parents[2]
#: the default of a field that has none (the settings must give it)
REQUIRED = object()


ASSETS = """## Each asset's run config (the launchpad's `ops.<asset>.config`)

What one materialization of the asset takes, beside the settings above: in the UI's launchpad,
or from the command line (`flowmatch train`, `evaluate`, `retry`, ... set these for you;
docs/cli.md). The classes are in `flowmatch_assets/defs/`. A key here is the asset's name and
the field: `flow_model.max_steps` is `ops: {flow_model: {config: {max_steps: ...}}}`.
"""


def fields(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, object, str]]:
    """``(dotted key, default, description)`` of every leaf field of ``model``."""
    for name, info in model.model_fields.items():
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from fields(ann, f"{prefix}{name}.")
            continue
        if info.default_factory is not None:
            default = info.default_factory()
        else:
            default = REQUIRED if info.default is PydanticUndefined else info.default
        what = info.description or ""
        if what and get_origin(ann) is Literal:  # an undescribed one stays empty (undescribed)
            what += " One of: " + ", ".join(str(a) for a in get_args(ann)) + "."
        yield prefix + name, default, what.strip()


def _default(value: object) -> str:
    if value is REQUIRED:
        return "(required)"
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    try:
        text = json.dumps(value)
    except TypeError:
        text = str(value)
    text = text.replace(f"{REPO}/", "")  # a path in the checkout: as the repository spells it
    text = text.replace("|", "\\|")
    return f"`{text}`" if len(text) <= 60 else f"`{text[:57]}...`"


def _table(rows: list[tuple[str, object, str]]) -> list[str]:
    out = ["| key | default | what it is |", "|---|---|---|"]
    for key, default, what in rows:
        what = what.replace("|", "/").replace("<", "&lt;").replace(">", "&gt;")
        out.append(f"| `{key}` | {_default(default)} | {what} |")
    return out


def _sections(rows: list[tuple[str, object, str]], title) -> list[str]:
    """One table per first key part (``run``, ``model``, ...), in the classes' order."""
    out, groups = [], {}
    for row in rows:
        groups.setdefault(title(row[0]), []).append(row)
    for name, group in groups.items():
        out += ["", f"### {name}", "", *_table(group)]
    return out


def training_rows() -> list[tuple[str, object, str]]:
    from flowmatch_models.train.config import TrainConfig

    return list(fields(TrainConfig))


def pipeline_rows() -> list[tuple[str, object, str]]:
    from flowmatch_assets.defs.resources import FlowmatchResource, SourceConfig

    return [*fields(FlowmatchResource), *fields(SourceConfig, "sources.<name>.")]


def asset_configs() -> dict[str, type[BaseModel]]:
    """Each asset's run config (the launchpad's ``ops.<asset>.config``) by asset."""
    from flowmatch_assets.defs.data_assets import ImagesConfig
    from flowmatch_assets.defs.evaluation_assets import EvaluationConfig, SamplesConfig
    from flowmatch_assets.defs.training_assets import FineTuneConfig, TrainRunConfig

    return {
        "images": ImagesConfig,
        "flow_model": TrainRunConfig,
        "fine_tune": FineTuneConfig,
        "samples": SamplesConfig,
        "evaluation": EvaluationConfig,
    }


def asset_rows() -> list[tuple[str, object, str]]:
    return [row for a, c in asset_configs().items() for row in fields(c, f"{a}.")]


def undescribed() -> list[str]:
    """The keys whose field has no description (the test requires none)."""
    rows = training_rows() + pipeline_rows() + asset_rows()
    return [key for key, _, what in rows if not what.strip()]


def render() -> str:
    def first(key: str) -> str:
        return f"`{key.split('.')[0]}`"

    def pipeline(key: str) -> str:
        if key.startswith("sources."):
            return "`sources.<name>` (a source of your own images)"
        return first(key) if "." in key else "top level"

    lines = [HEADER, TRAINING.rstrip(), *_sections(training_rows(), first)]
    lines += ["", PIPELINE.rstrip(), *_sections(pipeline_rows(), pipeline)]
    lines += ["", ASSETS.rstrip(), *_sections(asset_rows(), first)]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render(), end="")
