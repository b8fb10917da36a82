"""A training session's boundary: the :class:`TrainRequest` that goes in, the launcher's
decisions on it (:func:`decide`: config, run folder, partitions, checkpoint, step budget) and the
:class:`TrainResult` that comes out (train/run.py runs the session between them)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from flowmatch_models.storage.layout import DataLayout, source_of
from flowmatch_models.train import finetune
from flowmatch_models.train.config import ConfigError, TrainConfig, load_config

# --------------------------------------------------------------------------------------------
# the boundary: what goes in, what comes out
# --------------------------------------------------------------------------------------------


@dataclass
class TrainRequest:
    """One training session: which config, on which partitions, for how many steps, where."""

    #: a YAML path (read anew on each start) or a config dict; flow_model sends the full dump
    #: of the TrainConfig it validated (``TrainConfig.to_dict()``), nothing left to parse
    config: str | dict = "configs/tiny.yaml"
    overrides: list[str] = field(default_factory=list)  # ``key.sub=value`` items (the CLI's --set)
    partitions: list[str] | None = None  # None: every complete partition, decided at start
    max_steps: int | None = None  # total steps (None: the config's trainer.max_steps)
    extra_steps: int | None = None  # or: this many beyond the checkpoint resumed from
    run_dir: str | None = None  # None: the config's (run.out_dir or <data root>/runs/<name>)
    resume: str = "auto"  # auto (last.ckpt if any), none, or a checkpoint path
    coverage: dict = field(default_factory=dict)  # what the caller knew (logged to wandb)
    log_segment: int | None = None  # logs/segNNN of this session (decided by the launcher)
    parent: dict | None = None  # a fine-tune's parent (decided by the launcher: finetune.py)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TrainRequest:
        return cls(**d)


@dataclass
class TrainResult:
    """What a session did, measured (never guessed by the caller)."""

    run_dir: str
    is_global_zero: bool = True
    device: str = ""  # e.g. "cuda (NVIDIA H200) x 2, bf16-mixed", from the trainer
    step: int = 0
    start_step: int = 0
    samples_session: int = 0  # samples trained in this session (all ranks)
    samples_total: int = 0  # since the run began
    trained_counts: dict[str, int] = field(default_factory=dict)
    partitions: list[str] = field(default_factory=list)
    data_position: dict[str, int] = field(default_factory=dict)
    metrics: dict[str, float | None] = field(default_factory=dict)  # last logged train/*
    wall_s: float = 0.0
    resumed_from: str | None = None
    checkpoint: str | None = None
    export_dir: str | None = None  # the SanaPipeline folder
    metrics_csv: str | None = None
    loss_curve: str | None = None
    coverage_curve: str | None = None  # partitions/samples available vs used per epoch
    sample_grid: str | None = None
    wandb_dir: str | None = None
    skipped_steps: int = 0  # optimizer steps skipped for non-finite gradients, since the run began
    grad_norm_mean: float | None = None  # this session's mean grad norm (finite, pre-clip)
    disk_bytes: int = 0  # the run folder on disk (checkpoints, exports, logs), hard links once
    parent: dict | None = None  # a fine-tune's parent run, step and digest (finetune.py)
    stopped: str | None = None  # stopped by a signal: the line saying so (exit EXIT_STOPPED)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TrainResult:
        return cls(**d)

    def materialization_metadata(self) -> dict:
        """Scalars for a Dagster materialization (Pipes)."""
        keep = {
            "step": self.step,
            "device": self.device,
            "checkpoint": self.checkpoint,
            "samples_session": self.samples_session,
            "samples_total": self.samples_total,
            "wall_s": round(self.wall_s, 1),
            "export_dir": self.export_dir,
            "skipped_steps": self.skipped_steps,
            "disk_bytes": self.disk_bytes,
            "grad_norm_mean": self.grad_norm_mean,
            "wandb_dir": self.wandb_dir,
            **self.metrics,
        }
        if self.parent:
            keep["parent_run"], keep["parent_step"] = self.parent["run"], self.parent["step"]
        return {k: v for k, v in keep.items() if v is not None}


def checkpoint_step(path: str) -> int:
    """The global step of a checkpoint, read without loading its tensors (mmap)."""
    ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    return int(ckpt.get("global_step", 0))


def resolve_resume(resume: str | None, run_dir: Path) -> str | None:
    if resume in (None, "", "none"):
        return None
    if resume == "auto":
        last = run_dir / "checkpoints" / "last.ckpt"
        return str(last) if last.is_file() else None
    if not Path(resume).is_file():
        raise FileNotFoundError(f"--resume {resume}: no such checkpoint; use --resume auto")
    return resume


def decide(request: TrainRequest) -> tuple[TrainRequest, TrainConfig]:
    """The launcher's decisions, made once: the config, the run folder, the partitions, the
    checkpoint to resume and the step budget. Returns the decided request and its config."""
    cfg = load_config(request.config, request.overrides, request.max_steps)
    run_dir = Path(request.run_dir).expanduser().resolve() if request.run_dir else cfg.run_dir()
    cfg.run.out_dir, cfg.data.root = str(run_dir), str(cfg.data_root())
    resume = resolve_resume(request.resume, run_dir)
    if request.extra_steps is not None:
        cfg.trainer.max_steps = (checkpoint_step(resume) if resume else 0) + request.extra_steps
    partitions = request.partitions or cfg.data.partitions
    cfg.data.grow = cfg.data.grow and not (request.partitions is None and cfg.data.partitions)
    if not partitions:
        partitions = DataLayout(cfg.data.root).complete_partitions()
    partitions = select_sources(partitions, cfg)
    cfg.data.partitions = list(partitions)
    parent = finetune.read_lineage(run_dir) if resume else None
    if resume and cfg.init.on and parent is None:
        print(f"note: init is ignored: {run_dir.name} resumes from its own checkpoint", flush=True)
    if not resume and cfg.init.on:  # a fine-tune's first session: its parent's weights
        parent = finetune.resolve_parent(cfg.init, cfg.data_root(), run_dir)
    decided = dataclasses.replace(
        request,
        config=cfg.to_dict(),
        overrides=[],
        partitions=list(partitions),
        max_steps=cfg.trainer.max_steps,
        extra_steps=None,
        run_dir=str(run_dir),
        resume=resume or "none",
        log_segment=len(list((run_dir / "logs").glob("seg*"))),
        parent=parent,
    )
    return decided, cfg


def select_sources(partitions: Sequence[str], cfg: TrainConfig) -> list[str]:
    """``partitions`` of ``data.sources`` only (all when unset), each taken ``data.source_weights``
    times (a per-source weight: its samples drawn that many times as often); either one fixes
    the list for the session (``data.grow`` off: a resume picks up new partitions)."""
    d = cfg.data
    if not d.sources and not d.source_weights:
        return list(partitions)
    picked = [p for p in partitions if d.sources is None or source_of(p) in d.sources]
    if not picked:
        have = sorted({source_of(p) for p in partitions})
        raise ConfigError(
            f"data.sources {d.sources}: no complete partition of them (complete "
            f"partitions are of {have}); materialize their embeddings first"
        )
    d.grow = False
    return [p for p in picked for _ in range(d.source_weights.get(source_of(p), 1))]
