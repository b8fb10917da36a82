"""The training configuration: one typed object, every knob with its default and meaning.

``load_config(path_or_dict, ["optim.lr=3e-4", ...])`` reads a YAML (``configs/tiny.yaml``),
applies ``--set key.sub=value`` overrides (values parsed as YAML) and validates: an unknown key
or a bad value raises :class:`ConfigError` naming it. ``settings={"optim": {"lr": 3e-4}}`` is
the typed form of the same (the Dagster assets validate theirs so before training starts);
``settings_from_items`` reads ``key.sub=value`` items into it at a command line. The YAML is read anew on every start and
never frozen into checkpoints, so resuming with an edited file uses the new values.

The run folder is ``run.out_dir`` if set, else ``<data.root>/runs/<run.name>``; ``data.root``
defaults to ``$FLOWMATCH_DATA_ROOT`` (else ``./data``), the same data root the Dagster assets
use, so a run started from the UI is found by ``python -m flowmatch_models.train --resume auto``
with the same ``run.name`` and the other way round.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)

from flowmatch_models.encoders.spec import DEFAULT_MAX_TOKENS
from flowmatch_models.model.flow_settings import LEGACY_KEYS, config_fields
from flowmatch_models.storage.layout import DataLayout


class ConfigError(ValueError):
    """A config key or value the training does not know; the message names it and the fix."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def default_data_root() -> Path:
    """``$FLOWMATCH_DATA_ROOT`` or ``./data``, absolute (the Dagster resource's rule)."""
    return Path(os.environ.get("FLOWMATCH_DATA_ROOT") or "data").expanduser().resolve()


class RunConfig(_Section):
    name: str = Field("default", description="Run name: the folder <data.root>/runs/<name>.")
    out_dir: str | None = Field(None, description="Run folder; null = <data.root>/runs/<name>.")
    seed: int = Field(0, description="Seeds the data order, t, noise and caption dropout.")


class ModelConfig(_Section):
    preset: Literal["tiny", "demo", "small", "base"] = Field(
        "tiny", description="Model size (flowmatch_models.model.dit.PRESETS)."
    )
    repa_encoder_depth: int | None = Field(
        None, ge=1, description="REPA aligns block k counted from 1; null = preset default."
    )
    projector_hidden: int | None = Field(None, ge=1, description="REPA MLP width; null = preset.")
    pos_embed: bool = Field(
        True,
        description=(
            "Sin-cos positional embedding on each bucket's token grid (diffusers' PatchEmbed "
            "computes it anew for a grid other than sample_size's)."
        ),
    )
    init: Literal["sana", "default"] = Field("sana", description="Sana init or PyTorch default.")
    qk_norm: bool = Field(
        True, description="RMSNorm on queries/keys across heads (SANA 256 px/Sana 1.5 qk_norm)."
    )
    fp32_attention: bool = Field(
        True, description="Linear-attention matmuls in fp32, autocast off (SANA: against NaN)."
    )
    text_norm: bool = Field(
        True,
        description="Standardise caption states per channel with the training shards' mean/std "
        "(Gemma's few huge channels otherwise dominate early; BENCHMARKS.md 'Real text'); "
        "folded into caption_projection.linear_1 for sampling and export (plain SANA).",
    )
    gradient_checkpointing: bool = Field(False, description="Recompute activations: less memory.")
    compile: bool = Field(
        False,
        description="torch.compile the model's forward (captions padded to data.text_max_len): "
        "one graph per aspect-ratio bucket, each compiled at its first batch (BENCHMARKS.md "
        "'Compiled buckets': the warm-up it costs).",
    )


class _FlowSection(_Section):
    """The base of ``FlowConfig``: the old ``shift`` key (``LEGACY_KEYS``) sets both shifts."""

    legacy_keys: ClassVar[dict[str, tuple[str, ...]]] = LEGACY_KEYS

    @model_validator(mode="before")
    @classmethod
    def _legacy_keys(cls, data: Any) -> Any:
        if isinstance(data, dict) and any(k in data for k in cls.legacy_keys):
            data = dict(data)
            for old, new in cls.legacy_keys.items():
                if old in data:
                    value = data.pop(old)
                    for key in new:
                        data.setdefault(key, value)
        return data


#: The ``flow`` section: exactly the configurable ``FlowMatching`` fields, their defaults,
#: bounds and descriptions (``flowmatch_models.model.flow.config_fields``; one list).
FlowConfig = create_model(
    "FlowConfig", __base__=_FlowSection, __module__=__name__, **config_fields()
)


class OptimConfig(_Section):
    lr: float = Field(1e-4, gt=0, description="Peak learning rate (AdamW).")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay.")
    warmup_steps: int = Field(1000, ge=0, description="Linear warmup from lr/warmup_steps.")
    schedule: Literal["constant", "cosine"] = Field("constant", description="After warmup.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Cosine floor as a fraction of lr.")
    grad_clip: float = Field(1.0, ge=0, description="Gradient-norm clip; 0 = none.")
    ema_decay: float = Field(
        0.9999,
        ge=0,
        le=1,
        description="EMA decay per optimizer step, after a warm-up ramp (1+n)/(10+n) over the "
        "EMA's age n: the run's steps, plus the parent's step for a fine-tune (its EMA goes on "
        "from the parent's: choose the decay for the fine-tune's length).",
    )


class DataConfig(_Section):
    root: str | None = Field(None, description="Data root; null = $FLOWMATCH_DATA_ROOT or ./data.")
    partitions: list[str] | None = Field(
        None, description="Partition keys; null = every partition with all three embeddings."
    )
    batch_size: int = Field(64, ge=1, description="Per device.")
    num_workers: int = Field(
        2,
        ge=0,
        description="Loader threads (data.loader threads) or DataLoader worker processes "
        "(processes); 0: batches built in the training loop's thread.",
    )
    loader: Literal["threads", "processes"] = Field(
        "threads",
        description="How batches are built: threads of the training process (reads release "
        "the GIL; no per-batch hand-off between processes) or DataLoader worker processes (the "
        "loader before threads). The same batches in the same order either way.",
    )
    shuffle_window: int = Field(4, ge=1, description="Shards mixed in one shuffle window.")
    bucket_chunk: int = Field(
        256,
        ge=1,
        description="With aspect-ratio buckets: each window's samples of one bucket are cut in "
        "chunks of this many and every global batch (batch_size x devices) is cut from one, so "
        "it must divide this (resume with another global batch that divides it too).",
    )
    text_max_len: int = Field(128, ge=1, description="Caption tokens kept per sample.")
    heldout_fraction: float = Field(
        0.005,
        ge=0,
        le=0.5,
        description="Held out of every partition by id hash, never trained on (validation, "
        "FD); 0 = none. Changing it changes the data order (like run.seed).",
    )
    heldout_max_per_partition: int = Field(50, ge=0, description="Cap on held-out per partition.")
    skip_duplicates: bool = Field(
        True,
        description="Never train on the rows that lose to an earlier sample: the near duplicates "
        "(`flowmatch catalog neardup`) and stored content duplicates. The list's version is "
        "read at each epoch's start and recorded in the ledger; a resume finishes its epoch "
        "with the recorded one.",
    )
    allow_order_change: bool = Field(
        False, description="Resume although run.seed/shuffle_window changed (next epoch)."
    )
    grow: bool = Field(
        True,
        description="Unless partitions are listed: each epoch uses every partition complete at "
        "its start (a run started at low coverage picks up new partitions).",
    )
    sources: list[str] | None = Field(
        None,
        description="Train only on partitions of these sources (pd12m, or the names of your "
        "own image sources: the key prefix <name>-NNNNN); null = every source. The partitions "
        "are those complete when a session starts (a resume picks up new ones).",
    )
    source_weights: dict[str, int] = Field(
        default_factory=dict,
        description="Whole-number weight per source (default 1): each of its partitions is "
        "taken that many times per epoch, so its samples are drawn that many times as often "
        "as a weight-1 source's (and counted so in the ledger).",
    )

    @field_validator("partitions", mode="before")
    @classmethod
    def _keys_as_text(cls, v: Any) -> Any:
        return [str(p) for p in v] if isinstance(v, list) else v


class InitConfig(_Section):
    """Start from another run's weights (a fine-tune) instead of a random initialisation."""

    from_run: str | None = Field(
        None, description="A run name under <data.root>/runs (or a run folder) to start from."
    )
    from_checkpoint: str | None = Field(
        None, description="Or a checkpoint file (.ckpt) to start from."
    )
    step: int | None = Field(
        None, ge=0, description="The parent's step; null = its latest checkpoint."
    )
    weights: Literal["ema", "raw"] = Field(
        "ema",
        description="ema: the parent's EMA weights (any checkpoint); raw: its training weights "
        "(a full stepN.ckpt).",
    )
    freeze: list[str] = Field(
        default_factory=list,
        description="Parameter-name prefixes of the model kept fixed, e.g. "
        "transformer.caption_projection, transformer.transformer_blocks.0 "
        "(flowmatch_models/train/module.py lists the top-level names on a mistake).",
    )

    @property
    def on(self) -> bool:
        return bool(self.from_run or self.from_checkpoint)


class TrainerConfig(_Section):
    max_steps: int = Field(1000, ge=0, description="Optimizer steps the run ends at.")
    accumulate_grad_batches: int = Field(1, ge=1, description="Micro-batches per step.")
    precision: str = Field("auto", description="auto = bf16-mixed on GPU, 32-true on CPU.")
    accelerator: str = Field("auto", description="auto, gpu or cpu (Lightning's).")
    devices: int | str = Field("auto", description="Devices per node (auto: every GPU).")
    strategy: str = Field(
        "auto", description="auto, ddp, ...: strategies that keep a whole model per device."
    )
    num_nodes: int = Field(1, ge=1, description="Machines (multi-node DDP).")
    log_every: int = Field(10, ge=1, description="Steps between logged metrics.")
    checkpoint_every: int = Field(
        500, ge=1, description="EMA-only snapshot stepN-ema.ckpt (evaluation, export) cadence."
    )
    full_every: int | None = Field(
        None,
        ge=1,
        description="Full resumable state stepN.ckpt (weights, Adam, EMA) cadence; null = "
        "checkpoint_every. Also at the end of every session.",
    )
    full_every_minutes: float | None = Field(
        30.0,
        ge=0,
        description="Also a full resumable state at the first step boundary this many minutes "
        "(wall clock) after the previous one: a crash or preemption loses at most this much "
        "(half on average; flowmatch budget); written in the background. null/0 = steps only.",
    )
    keep_full: int = Field(2, ge=1, description="Newest full states kept (last.ckpt links one).")
    keep_ema: int = Field(0, ge=0, description="Newest EMA snapshots kept; 0 = all.")
    val_every: int = Field(
        0,
        ge=0,
        description="Validation flow loss (EMA, held-out, fixed noise and t grid); 0 = off.",
    )
    val_max_samples: int = Field(256, ge=1, description="Held-out samples validation uses.")
    max_skipped_steps: int = Field(
        20, ge=1, description="Stop after this many consecutive non-finite (skipped) steps."
    )
    sample_every: int = Field(500, ge=0, description="Sample grid (and wandb images); 0 = off.")
    progress_bar: bool = Field(False, description="Lightning's bar (else one line a log).")

    @field_validator("strategy")
    @classmethod
    def _whole_model_per_device(cls, v: str) -> str:
        if any(s in v.lower() for s in ("fsdp", "deepspeed")):
            raise ValueError(
                "FSDP and DeepSpeed shard the gradients and weights: the gradient-norm clip, "
                "the non-finite skip and the EMA would see one rank's shard; use ddp (a whole "
                "model per GPU: base.yaml trains in ~14 GB)"
            )
        return v


class LoggingConfig(_Section):
    wandb: bool = Field(True, description="Log to wandb (offline without a key).")
    wandb_project: str = Field("flowmatch", description="The wandb project.")
    wandb_mode: Literal["auto", "online", "offline"] = Field(
        "auto", description="auto = online iff WANDB_API_KEY is set, else offline."
    )
    record_sample_ids: bool = Field(False, description="Per-rank JSONL of each batch's ids.")


class SampleConfig(_Section):
    prompts: list[str] = Field(
        [
            "a photograph of a lighthouse on a cliff at sunset",
            "an oil painting of a bowl of fruit",
            "a black and white photo of a city street",
            "a watercolor of mountains and a lake",
        ],
        description="The captions of the sample grids, one image each.",
    )
    steps: int = Field(30, ge=1, description="Sampler (Euler) steps of a grid.")
    cfg_scale: float = Field(4.0, description="Classifier-free guidance scale.")
    seed: int = Field(0, description="Noise seed of the grids.")


class EncodersConfig(_Section):
    vae: str | None = Field(None, description="DC-AE folder/hub id (decode grids; export).")
    text: str | None = Field(None, description="Gemma3 folder/hub id (encode prompts; export).")
    max_tokens: int = Field(
        DEFAULT_MAX_TOKENS,
        ge=1,
        description="Prompts (grids, export) are cut to this many tokens, as the captions of "
        "the text embeddings were (the resource's encoders.max_tokens; the assets set it).",
    )


class TrainConfig(_Section):
    """Every hyperparameter of a training run (``configs/tiny.yaml`` shows them all)."""

    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    flow: FlowConfig = Field(default_factory=FlowConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    sample: SampleConfig = Field(default_factory=SampleConfig)
    encoders: EncodersConfig = Field(default_factory=EncodersConfig)
    init: InitConfig = Field(default_factory=InitConfig)

    def data_root(self) -> Path:
        return (
            Path(self.data.root).expanduser().resolve() if self.data.root else default_data_root()
        )

    def run_dir(self) -> Path:
        """``run.out_dir``, else ``<data root>/runs/<run.name>`` (absolute)."""
        if self.run.out_dir:
            return Path(self.run.out_dir).expanduser().resolve()
        return DataLayout(self.data_root()).run_dir(self.run.name)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (wandb config, TrainRequest files)."""
        return self.model_dump(mode="json")


def _error_line(e: ValidationError, where: str = "") -> str:
    err = e.errors()[0]
    key = ".".join(str(p) for p in err["loc"])
    if err["type"] == "extra_forbidden":
        section = err["loc"][:-1]
        node: Any = TrainConfig
        for p in section:
            node = node.model_fields[p].annotation
        known = sorted(node.model_fields)
        return f"{where}unknown config key '{key}'; known: {known} (see configs/tiny.yaml)"
    return f"{where}{key}: {err['msg']} (got {err.get('input')!r})"


def settings_from_items(items: Sequence[str]) -> dict[str, Any]:
    """``["optim.lr=3e-4", "data.sources=[a]"]`` -> ``{"optim": {"lr": 0.0003}, "data":
    {"sources": ["a"]}}`` (values parsed as YAML): a command line's ``--set`` items as the
    nested settings ``load_config`` validates."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected key.sub=value")
        *sections, name = key.split(".")
        node = out
        for p in sections:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {key}: '{p}' is a value, not a section")
        node[name] = yaml.safe_load(value)
    return out


def merge_settings(*layers: Mapping[str, Any]) -> dict[str, Any]:
    """Nested settings merged key by key, a later layer's value winning (sections merge)."""
    out: dict[str, Any] = {}
    for layer in layers:
        for k, v in layer.items():
            if isinstance(v, Mapping) and isinstance(out.get(k), dict):
                out[k] = merge_settings(out[k], v)
            else:
                out[k] = dict(v) if isinstance(v, Mapping) else v
    return out


def _new_keys(model: Any, settings: Mapping[str, Any]) -> dict[str, Any]:
    """``settings`` with a section's legacy keys as the keys they set (``flow.shift``: both
    shifts, over the YAML's), so that a merge over a full config sets them."""
    fields = getattr(model, "model_fields", {})
    legacy = getattr(model, "legacy_keys", {})
    out: dict[str, Any] = {}
    for k, v in settings.items():
        if k in legacy:
            out.update(dict.fromkeys(legacy[k], v))
        elif k in fields and isinstance(v, Mapping):
            out[k] = _new_keys(fields[k].annotation, v)
        else:
            out[k] = v
    return out


def load_config(
    config: TrainConfig | dict | str | os.PathLike,
    overrides: Sequence[str] = (),
    max_steps: int | None = None,
    settings: Mapping[str, Any] | None = None,
) -> TrainConfig:
    """Defaults <- YAML (path or dict) <- ``settings`` (nested, typed) <- ``key.sub=value``
    overrides (values parsed as YAML) <- ``max_steps``."""
    if isinstance(config, TrainConfig):
        raw: dict = config.to_dict()
    elif isinstance(config, dict):
        raw = config
    else:
        path = Path(config)
        if not path.is_file():
            raise FileNotFoundError(f"config {path} not found; start from configs/tiny.yaml")
        raw = yaml.safe_load(path.read_text()) or {}
    try:
        cfg = TrainConfig.model_validate(raw)
        if settings:
            cfg = TrainConfig.model_validate(
                merge_settings(cfg.to_dict(), _new_keys(TrainConfig, settings))
            )
    except ValidationError as e:
        raise ConfigError(_error_line(e)) from None
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set {item!r}: expected key.sub=value")
        parts = key.split(".")
        node: Any = cfg
        for i, p in enumerate(parts):
            fields = type(node).model_fields
            legacy = getattr(type(node), "legacy_keys", {})
            if i == len(parts) - 1 and p in legacy:  # e.g. flow.shift: sets both shifts
                parts[-1:] = [legacy[p][0]]
                extra = legacy[p][1:]
                break
            if p not in fields:
                what = "config key" if i == len(parts) - 1 else "config section"
                raise ConfigError(f"--set {key}: unknown {what}; known: {sorted(fields)}")
            if i < len(parts) - 1:
                node = getattr(node, p)
                if not isinstance(node, BaseModel):
                    raise ConfigError(f"--set {key}: '{p}' is a value, not a section")
        else:
            extra = ()
        try:
            for name in (parts[-1], *extra):
                setattr(node, name, yaml.safe_load(value))
        except ValidationError as e:
            err = e.errors()[0]
            raise ConfigError(f"--set {key}: {err['msg']} (got {value!r})") from None
    if max_steps is not None:
        cfg.trainer.max_steps = int(max_steps)
    return cfg


def checkpoint_disk_plan(cfg: TrainConfig, params: int, transformer_params: int) -> dict:
    """Bytes a run of ``trainer.max_steps`` keeps on disk under
    :class:`~flowmatch_models.train.callbacks.CheckpointPolicy` (torch-free: the budget report
    prices it without importing the trainer):
    a full state is fp32 weights + Adam moments (3 x 4 bytes per trained parameter) + the fp32
    EMA transformer; an EMA snapshot is the EMA alone; ``last.ckpt`` is a link (0 bytes)."""
    t = cfg.trainer
    full_every = t.full_every or t.checkpoint_every
    full = 12 * params + 4 * transformer_params
    ema = 4 * transformer_params
    n_ema = t.max_steps // t.checkpoint_every
    kept_ema = n_ema if t.keep_ema == 0 else min(n_ema, t.keep_ema)
    kept_full = min(max(1, t.max_steps // full_every), t.keep_full)
    if t.full_every_minutes:  # states on the clock too: as many as the retention keeps
        kept_full = t.keep_full
    return {
        "full_state_bytes": full,
        "ema_snapshot_bytes": ema,
        "full_states_kept": kept_full,
        "ema_snapshots_kept": kept_ema,
        "total_bytes": kept_full * full + kept_ema * ema,
        # while a full state is written its temporary file sits beside the kept ones
        "peak_bytes": (kept_full + 1) * full + kept_ema * ema,
        "without_retention_bytes": (t.max_steps // t.checkpoint_every) * full + full,
    }
