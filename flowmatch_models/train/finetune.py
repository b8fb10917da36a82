"""Fine-tuning: a run that starts from another run's weights, and the record of where it started.

``init.from_run: demo`` (or ``init.from_checkpoint: path``) in a run's config makes its first
session load the parent's weights instead of a random initialisation -- the EMA weights of any
checkpoint (``init.weights: ema``, default) or the training weights of a full ``stepN.ckpt``
(``raw``) at ``init.step`` (default the parent's latest) -- with the parent's caption
standardisation (``model.text_norm``: the model's input layer was trained on it), a fresh
optimizer, learning-rate schedule and data order, its own run folder, ledger and wandb run.
Its EMA goes on from the parent's: the EMA's warm-up ramp counts the parent's steps
(``FlowMatchModule.ema_steps``), so ``optim.ema_decay`` holds from the first step.
``init.freeze`` keeps parameters fixed by name prefix.

The parent is decided once by the launcher (:func:`resolve_parent`) and recorded as a small
dict -- run, run folder, checkpoint, step, weights, freeze and ``digest``, an xxh3 of the
parent's EMA tensors at that step -- in ``<run>/lineage.json``, in the request, in every
checkpoint (``flowmatch.parent``), in the export's ``flowmatch.json``, in the wandb config and
in the catalog's run record. A resume keeps it (the run's weights come from its own checkpoint).
A fine-tune is stale when its parent is re-trained: :func:`parent_changed` finds the parent's
checkpoint at that step again and compares the digest (flowmatch_assets/freshness/fingerprints.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
import xxhash

from flowmatch_models.storage.atomic import atomic_write_text
from flowmatch_models.storage.layout import run_folder
from flowmatch_models.train.config import ConfigError, InitConfig

LINEAGE_FILE = "lineage.json"
_CKPT = re.compile(r"step(\d+)(-ema)?\.ckpt")


def _load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def checkpoints_at(run_dir: Path) -> dict[int, dict[str, Path]]:
    """``{step: {"ema": path, "full": path}}`` of a run's checkpoint files (last.ckpt by its
    step)."""
    out: dict[int, dict[str, Path]] = {}
    d = Path(run_dir) / "checkpoints"
    for p in sorted(d.glob("step*.ckpt")) if d.is_dir() else []:
        m = _CKPT.fullmatch(p.name)
        if m:
            out.setdefault(int(m.group(1)), {})["ema" if m.group(2) else "full"] = p
    return out


def checkpoint_for(run_dir: Path, step: int | None, weights: str) -> tuple[Path, int]:
    """The parent checkpoint of ``weights`` (ema: an EMA snapshot or a full state; raw: a full
    state) at ``step`` (None: the latest); ConfigError naming what there is otherwise."""
    have = checkpoints_at(run_dir)
    ok = {s: f for s, f in have.items() if (weights == "raw" and "full" in f) or weights == "ema"}
    if not ok:
        raise ConfigError(
            f"init: run folder {run_dir} has no {'full ' if weights == 'raw' else ''}checkpoint"
            + (
                " (init.weights=raw needs a full stepN.ckpt; use init.weights=ema)"
                if have
                else "; train it first or point init.from_run/from_checkpoint elsewhere"
            )
        )
    s = max(ok) if step is None else step
    if s not in ok:
        raise ConfigError(
            f"init.step {step}: {run_dir.name} has no {weights} checkpoint at that step; it has "
            f"{sorted(ok)}" + (" (EMA snapshots: init.weights=ema)" if weights == "raw" else "")
        )
    f = ok[s]
    return (f.get("ema") or f["full"]) if weights == "ema" else f["full"], s


def ema_digest(path: Path) -> str:
    """An xxh3-128 of a checkpoint's EMA tensors (names, dtypes, shapes and bytes): the same
    for an EMA snapshot and the full state of the same step."""
    state = _load(path)["state_dict"]
    h = xxhash.xxh3_128()
    for k in sorted(k for k in state if k.startswith("ema.")):
        t = state[k].contiguous()
        h.update(f"{k}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def resolve_parent(init: InitConfig, data_root: Path, run_dir: Path) -> dict:
    """The parent of a run starting now from ``init`` (see the module doc)."""
    if init.from_run and init.from_checkpoint:
        raise ConfigError("init: set from_run or from_checkpoint, not both")
    if init.from_checkpoint:
        ckpt = Path(init.from_checkpoint).expanduser().resolve()
        if not ckpt.is_file():
            raise ConfigError(f"init.from_checkpoint {ckpt}: no such checkpoint")
        state = _load(ckpt)
        if init.weights == "raw" and state.get("kind") == "ema":
            raise ConfigError(
                f"init.weights=raw: {ckpt.name} is an EMA-only snapshot; pass a "
                "full stepN.ckpt or use init.weights=ema"
            )
        step = int(state.get("global_step", 0))
        parent_dir = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else ckpt.parent
    else:
        parent_dir = run_folder(init.from_run, data_root)
        if not parent_dir.is_dir():
            raise ConfigError(f"init.from_run {init.from_run!r}: no run folder {parent_dir}")
        ckpt, step = checkpoint_for(parent_dir, init.step, init.weights)
    if parent_dir.resolve() == Path(run_dir).resolve():
        raise ConfigError("init: a run cannot start from its own weights; resume it instead")
    return {
        "run": parent_dir.name,
        "run_dir": str(parent_dir.resolve()),
        "checkpoint": str(ckpt),
        "step": step,
        "weights": init.weights,
        "freeze": list(init.freeze),
        "digest": ema_digest(ckpt),
    }


def read_lineage(run_dir: Path) -> dict | None:
    p = Path(run_dir) / LINEAGE_FILE
    return json.loads(p.read_text()) if p.is_file() else None


def write_lineage(run_dir: Path, parent: dict | None) -> None:
    """``<run>/lineage.json`` (the parent), or none for a run from scratch."""
    p = Path(run_dir) / LINEAGE_FILE
    if parent is None:
        p.unlink(missing_ok=True)
    else:
        atomic_write_text(p, json.dumps(parent, indent=1))


def parent_changed(parent: dict, cache: dict | None = None) -> str | None:
    """Why the weights a fine-tune started from are not its parent's any more (re-trained,
    or the checkpoint is gone), or None."""
    run_dir = Path(parent["run_dir"])
    found = checkpoints_at(run_dir).get(int(parent["step"]), {})
    path = found.get("ema") or found.get("full")
    if path is None:
        return (
            f"its parent {parent['run']} has no checkpoint at step {parent['step']} any "
            "more (re-trained, or pruned): the weights it started from are unknown"
        )
    key = (str(path), path.stat().st_mtime_ns, path.stat().st_size)
    if cache is not None and key in cache:
        digest = cache[key]
    else:
        digest = ema_digest(path)
        if cache is not None:
            cache[key] = digest
    if digest != parent["digest"]:
        return (
            f"its parent {parent['run']} was re-trained: its step-{parent['step']} weights "
            f"changed ({parent['digest'][:12]} -> {digest[:12]})"
        )
    return None


# ---------------------------------------------------------------------------- loading the weights


def _strip(state: dict, prefix: str) -> dict:
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}


def load_parent(module, parent: dict, widths: dict[str, int]) -> list[str]:
    """Load ``parent``'s weights into a fresh :class:`FlowMatchModule` (transformer, its EMA
    copy, the REPA projector when the parent's full state has one that fits, the caption
    standardisation) and freeze ``parent["freeze"]``. Returns notes for the log."""
    ckpt = _load(Path(parent["checkpoint"]))
    info = ckpt.get("flowmatch", {})
    theirs = info.get("transformer_config") or {}
    ours = {k: v for k, v in module.model.transformer.config.items() if not k.startswith("_")}
    differ = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))
    if theirs and differ:
        raise ConfigError(
            f"init: the parent {parent['run']} is a {info.get('preset')!r} model that differs "
            f"from this run's in {', '.join(f'{k} ({theirs.get(k)} vs {ours.get(k)})' for k in differ[:4])}; "
            f"set model.preset={info.get('preset')} and the parent's model.* settings"
        )
    pw = info.get("widths") or {}
    if pw.get("text") not in (None, widths.get("text")):
        raise ConfigError(
            f"init: the parent {parent['run']} reads {pw['text']}-wide captions, these partitions "
            f"hold {widths.get('text')}-wide ones (another text encoder); fine-tune on text "
            "embeddings made by the parent's encoder"
        )
    state = ckpt["state_dict"]
    notes = []
    if parent["weights"] == "raw":
        weights = _strip(state, "model.transformer.")
    else:
        weights = _strip(state, "ema.")
    module.model.transformer.load_state_dict(weights)
    module.ema.load_state_dict(weights)
    proj = _strip(state, "model.projector.")
    if module.model.projector is not None:
        if not proj and parent["weights"] == "ema":  # an EMA snapshot: its step's full state?
            full = checkpoints_at(Path(parent["run_dir"])).get(int(parent["step"]), {})
            if "full" in full:
                proj = _strip(_load(full["full"])["state_dict"], "model.projector.")
        try:
            if proj:
                module.model.projector.load_state_dict(proj)
            notes.append("REPA projector: the parent's" if proj else "REPA projector: new")
        except RuntimeError:  # another REPA target width (another DINOv2): a new head
            notes.append("REPA projector: new (the parent's has another width)")
    norm = info.get("text_norm")
    if norm is not None:
        module.model.text_shift.copy_(norm["shift"])
        module.model.text_scale.copy_(norm["scale"])
    frozen = freeze(module.model, parent.get("freeze") or [])
    if frozen:
        notes.append(f"frozen: {frozen} parameters ({', '.join(parent['freeze'])})")
    return notes


def freeze(model: torch.nn.Module, prefixes: list[str]) -> int:
    """``requires_grad_(False)`` on every parameter whose name starts with one of ``prefixes``;
    ConfigError naming the top-level names when a prefix matches none. Returns how many
    parameters (elements) are frozen."""
    names = dict(model.named_parameters())
    n = 0
    for pre in prefixes:
        hit = [k for k in names if k == pre or k.startswith(pre.rstrip(".") + ".")]
        if not hit:
            top = sorted({".".join(k.split(".")[:2]) for k in names})
            raise ConfigError(
                f"init.freeze {pre!r} matches no parameter; names start with: {', '.join(top)}"
            )
        for k in hit:
            if names[k].requires_grad:
                names[k].requires_grad_(False)
                n += names[k].numel()
    return n


def ema_start_share(decay: float, age: int, steps: int) -> float:
    """The share of an EMA's value at the start of ``steps`` updates still in it at their end,
    with ``d = min(decay, (1 + n) / (10 + n))`` at age ``n`` from ``age`` on (FlowMatchModule's
    update_ema): ~0 for a new EMA (the ramp), ``decay ** steps`` for an old one."""
    import numpy as np

    n = np.arange(age, age + max(0, steps), dtype=np.float64)
    d = np.minimum(decay, (1 + n) / (10 + n))
    return float(np.exp(np.log(d).sum())) if len(d) else 1.0


def ema_warning(decay: float, age: int, steps: int, parent: dict | None) -> str | None:
    """A note when the run is too short for its EMA: over 10% of the EMA at the end is still
    what it started from (a fine-tune's parent EMA, averaged over ~1/(1-decay) steps)."""
    share = ema_start_share(decay, age, steps)
    if share <= 0.1 or steps <= 0:
        return None
    start = f"{parent['run']}'s EMA (init.weights=ema)" if parent else "its start"
    fix = max(0.0, 1 - 5 / steps)
    return (
        f"note: optim.ema_decay {decay} averages over ~{1 / max(1 - decay, 1e-12):,.0f} steps; "
        f"after this run's {steps:,} steps {share:.0%} of its EMA is still {start}: set "
        f"optim.ema_decay <= {fix:.4g} for a run this long"
        + (", or init.weights=raw (a new EMA from the parent's weights)" if parent else "")
    )
