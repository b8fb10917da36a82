"""Training assets: the flow-matching DiT checkpoint (trained in a subprocess through Dagster
Pipes, so DDP/torchrun work and metrics stream back) and the fine-tune from another run's
weights; what a run shows (samples, evaluation) is evaluation_assets.py."""

import json
import math
import os
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import dagster as dg
from pydantic import Field

from flowmatch_assets import catalog
from flowmatch_assets.defs.deploy import GPU_POOL, TRAIN_TAGS
from flowmatch_assets.defs.partitions import SHARDS
from flowmatch_assets.defs.resources import FlowmatchResource
from flowmatch_assets.defs.routine import human_bytes, publish_run
from flowmatch_assets.defs.training_pipes import TrainingStopped, record_stop, stop_line
from flowmatch_assets.freshness.training_runs import trained_on
from flowmatch_assets.reports.measured import logged_rates, steady_rate
from flowmatch_models.embeddings.kinds import TRAINING_INPUTS
from flowmatch_models.model.loss_terms import HEADLINE, METADATA, TOTAL, VAL_METRIC
from flowmatch_models.storage.layout import DataLayout, source_of
from flowmatch_models.train.config import (
    ConfigError,
    TrainConfig,
    load_config,
    merge_settings,
    settings_from_items,
)

if TYPE_CHECKING:  # the training package imports torch: at run time, in the functions
    from flowmatch_models.train.run import TrainRequest, TrainResult

GROUP = "training"

REPO = Path(__file__).resolve().parents[2]


class TrainRunConfig(dg.Config):
    """Launchpad config of a training run (hyperparameters live in the YAML, not here)."""

    config_file: str = Field(
        default=str(REPO / "configs" / "tiny.yaml"),
        description="Training YAML (read anew on every resume; never frozen into checkpoints).",
    )
    run_name: str = Field(default="default", description="Run folder under <data root>/runs/.")
    extra_steps: int | None = Field(
        default=None, description="Train this many steps beyond the latest checkpoint (resume)."
    )
    max_steps: int | None = Field(default=None, description="Total steps (overrides the YAML).")
    resume: str = Field(default="auto", description="auto (latest checkpoint), none, or a path.")
    min_coverage: float = Field(
        default=1.0,
        description="Fraction of registered partitions that must have every training input "
        "(the registered embedding kinds training waits for).",
    )
    settings: dict[str, Any] = Field(
        default_factory=dict,
        description="Training settings over the YAML, nested as in it: {data: {batch_size: 16}, "
        "trainer: {val_every: 100}}; checked against the training config before training "
        "starts (an unknown key or a bad value fails the run, naming it).",
    )
    overrides: list[str] = Field(
        default_factory=list,
        description="Deprecated (use settings): the old `key=value` items, still read so "
        "earlier run configs load; settings win over them.",
    )
    sources: list[str] | None = Field(
        default=None,
        description="Train on partitions of these sources only (pd12m, or your own sources' "
        "names); coverage counts their partitions. None: every source.",
    )
    source_weights: dict[str, int] = Field(
        default_factory=dict,
        description="Whole-number weight per source (default 1): its partitions are taken that "
        "many times per epoch (data.source_weights).",
    )


class FineTuneConfig(TrainRunConfig):
    """Launchpad config of a fine-tune: a new run that starts from another run's weights."""

    run_name: str = Field(default="finetune", description="The fine-tune's own run folder.")
    parent_run: str = Field(description="The run whose weights it starts from (runs/<name>).")
    parent_step: int | None = Field(
        default=None, description="The parent's checkpoint step (None: its latest)."
    )
    weights: str = Field(
        default="ema", description="ema (the parent's EMA weights) or raw (a full checkpoint's)."
    )
    freeze: list[str] = Field(
        default_factory=list,
        description="Parameter-name prefixes kept fixed (e.g. transformer.caption_projection).",
    )
    max_steps: int | None = Field(default=500, description="The fine-tune's total steps.")


def _preset(export_dir: str | None) -> str | None:
    """The model preset of a finished run (from its export's transformer/flowmatch.json)."""
    meta = Path(export_dir or "/nonexistent") / "transformer" / "flowmatch.json"
    return json.loads(meta.read_text()).get("preset") if meta.exists() else None


def round_meta(v, digits: int = 4):
    """Floats (raw or as FloatMetadataValue) to ``digits`` significant digits, for the UI."""
    raw = v.value if isinstance(v, dg.FloatMetadataValue) else v
    if isinstance(raw, float) and math.isfinite(raw) and raw != 0:
        return float(f"{raw:.{digits}g}")
    return v


def _session_rates(out: Path) -> list[float]:
    """This session's logged samples/s windows (the newest ``logs/seg*/metrics.csv``)."""
    segs = sorted((out / "logs").glob("seg*/metrics.csv"))
    return logged_rates(segs[-1]) if segs else []


def write_ledgers(data_root: str | Path, run_name: str, run: Path) -> list[int]:
    """The catalog's ledger of every checkpoint of a run that has none yet (or an older one):
    the deltas are the library's (``ledger.checkpoint_ledgers``), the records the catalog's.
    Returns the steps written."""
    from flowmatch_models.data import exclude as exclusions
    from flowmatch_models.data.rows import sample_grids
    from flowmatch_models.embeddings.kinds import model_inputs
    from flowmatch_models.storage.store import read_shard
    from flowmatch_models.train import ledger

    layout = DataLayout(data_root)
    latents = model_inputs()["latents"].name
    ids: dict[str, list[str]] = {}

    def ids_of(p: str) -> list[str]:
        if p not in ids:
            ids[p] = read_shard(layout.asset_path(latents, p)).ids
        return ids[p]

    def grids_of(p: str):
        return sample_grids(read_shard(layout.asset_path(latents, p)))

    def is_recorded(step: int, ckpt: Path) -> bool:
        target = catalog.ledger_path(data_root, run_name, step, "ledger_chain")
        return target.exists() and target.stat().st_mtime >= ckpt.stat().st_mtime

    recorded = {
        int(f.stem[4:]): catalog.read_ledger_segments(data_root, run_name, int(f.stem[4:]))
        for f in catalog.record_path(layout, "ledger_chain", run_name).glob("step*.parquet")
    }
    done = []
    for step, rows, segs, chain in ledger.checkpoint_ledgers(
        run, recorded, ids_of, grids_of, is_recorded, partial(exclusions.recorded, data_root)
    ):
        catalog.record_ledger(data_root, run_name, step, rows, segs, chain)
        done.append(step)
    return done


#: Run tags of a training run: its name and parent (a fine-tune's); a stopped run's are
#: training_pipes.py's
RUN_TAG, PARENT_TAG = "flowmatch/run", "flowmatch/parent"


def coverage_or_fail(
    flowmatch: FlowmatchResource,
    known: list[str],
    min_coverage: float,
    sources: list[str] | None = None,
) -> tuple[list[str], float]:
    """Partitions with every training input (TRAINING_INPUTS) (of ``sources`` only, when
    given); raises dg.Failure naming what is missing when the covered fraction of ``known``
    partitions is below ``min_coverage``."""
    layout = flowmatch.layout
    complete = layout.complete_partitions()
    if sources:
        known = [p for p in known if source_of(p) in sources]
        complete = [p for p in complete if source_of(p) in sources]
    known = sorted(set(known) | set(complete))
    frac = len(complete) / len(known) if known else 0.0
    if not complete or frac < min_coverage:
        missing = {
            p: [a for a in TRAINING_INPUTS if not layout.asset_path(a, p).exists()]
            for p in known
            if p not in complete
        }
        lines = [f"  {p}: missing {', '.join(a)}" for p, a in list(missing.items())[:20]]
        more = f"\n  ... and {len(missing) - 20} more" if len(missing) > 20 else ""
        raise dg.Failure(
            description=(
                f"training needs {min_coverage:.0%} of {len(known)} partitions with all of "
                f"{', '.join(TRAINING_INPUTS)}; only {len(complete)} ({frac:.0%}) have them:\n"
                + "\n".join(lines)
                + more
                + "\nMaterialize the missing embeddings (backfill 'missing only') or lower min_coverage."
            ),
            metadata={"missing": dg.MetadataValue.json(missing)},
        )
    return complete, frac


@dg.asset(
    deps=list(TRAINING_INPUTS),
    group_name=GROUP,
    kinds={"pytorch", "lightning", "wandb"},
    pool=GPU_POOL,
    op_tags=TRAIN_TAGS,
    description="The flow-matching SANA DiT (+REPA) checkpoint, trained or resumed on every covered partition.",
)
def flow_model(
    context: dg.AssetExecutionContext,
    config: TrainRunConfig,
    flowmatch: FlowmatchResource,
    pipes_subprocess_client: dg.PipesSubprocessClient,
) -> dg.MaterializeResult:
    """Decides the partitions once, sends a TrainRequest through Pipes, records the TrainResult."""
    return train_run(context, config, flowmatch, pipes_subprocess_client)


@dg.asset(
    deps=[flow_model, *TRAINING_INPUTS],
    group_name=GROUP,
    kinds={"pytorch", "lightning", "wandb"},
    pool=GPU_POOL,
    op_tags=TRAIN_TAGS,
    description="A fine-tune: a new run that starts from another run's weights (EMA or raw, "
    "optionally frozen parts) with a fresh optimizer and schedule, on partitions of any source "
    "(or a weighted mix); stale when its parent is re-trained.",
)
def fine_tune(
    context: dg.AssetExecutionContext,
    config: FineTuneConfig,
    flowmatch: FlowmatchResource,
    pipes_subprocess_client: dg.PipesSubprocessClient,
) -> dg.MaterializeResult:
    """flow_model's training with ``init`` set from the launchpad (flowmatch_models/train/finetune.py);
    recorded as a run like any other (catalog, ledger, wandb), with its parent."""
    init = {"from_run": config.parent_run, "weights": config.weights, "freeze": config.freeze}
    if config.parent_step is not None:
        init["step"] = config.parent_step
    return train_run(context, config, flowmatch, pipes_subprocess_client, {"init": init})


def train_run(
    context: dg.AssetExecutionContext,
    config: TrainRunConfig,
    flowmatch: FlowmatchResource,
    pipes_subprocess_client: dg.PipesSubprocessClient,
    init: dict | None = None,
) -> dg.MaterializeResult:
    """One training session through Pipes (flow_model, fine_tune): validate the settings and
    decide the partitions once, send a TrainRequest with the validated config, publish the
    TrainResult (catalog run record, validation, ledger; metadata)."""
    cfg = train_config(config, flowmatch, init or {})  # a bad setting fails here, at once
    known = list(context.instance.get_dynamic_partitions(SHARDS))
    parts, frac = coverage_or_fail(flowmatch, known, config.min_coverage, config.sources)
    request = train_request(config, cfg, known, parts, frac)
    context.log.info(f"training {config.run_name} on {len(parts)} partitions ({frac:.0%} coverage)")
    tags = {RUN_TAG: config.run_name}
    if getattr(config, "parent_run", None):
        tags[PARENT_TAG] = config.parent_run
    context.instance.add_run_tags(context.run_id, tags)  # launched from the UI too
    run = cfg.run_dir()  # the training process's own folder: run.out_dir when the YAML sets one
    invocation = run_training(context, pipes_subprocess_client, request, run)
    return publish_training(context, config, flowmatch, invocation, frac)


def train_settings(config: TrainRunConfig, flowmatch: FlowmatchResource, init: dict) -> dict:
    """What a launch sets over the training YAML, nested as in it: the resource's data root and
    encoders, the run name, the sources (and their weights), a fine-tune's ``init``; then the
    launchpad's ``overrides`` (the old ``key=value`` items) and ``settings``, which win."""
    data: dict[str, Any] = {"root": flowmatch.data_root}
    if config.sources:
        data["sources"] = list(config.sources)
    if config.source_weights:
        data["source_weights"] = dict(config.source_weights)
    enc = flowmatch.encoders
    own = {
        "data": data,
        "run": {"name": config.run_name},
        "encoders": {"vae": enc.vae, "text": enc.text, "max_tokens": enc.max_tokens},
        **init,
    }
    return merge_settings(own, settings_from_items(config.overrides), config.settings)


def train_config(config: TrainRunConfig, flowmatch: FlowmatchResource, init: dict) -> TrainConfig:
    """The session's TrainConfig (the YAML, read anew, with ``train_settings`` over it),
    validated in this process before any training process starts: an unknown key or a bad
    value fails the run with the one line that names it."""
    try:
        settings = train_settings(config, flowmatch, init)
        return load_config(config.config_file, settings=settings, max_steps=config.max_steps)
    except (ConfigError, FileNotFoundError) as e:
        raise dg.Failure(description=f"error: {e}") from None


def train_request(
    config: TrainRunConfig, cfg: TrainConfig, known: list[str], parts: list[str], frac: float
) -> "TrainRequest":
    """The TrainRequest the training process receives: the validated config as a full dump (no
    ``key=value`` items left to parse), the partitions, the steps, the resume."""
    from flowmatch_models.train.run import TrainRequest

    coverage = {"partitions_known": len(set(known) | set(parts)), "coverage": round(frac, 4)}
    return TrainRequest(
        config=cfg.to_dict(),
        partitions=parts,
        extra_steps=config.extra_steps,
        resume=config.resume,
        coverage=coverage,
    )


def run_training(
    context: dg.AssetExecutionContext,
    pipes_subprocess_client: dg.PipesSubprocessClient,
    request: "TrainRequest",
    run: Path,
) -> dg.PipesClientCompletedInvocation:
    """``python -m flowmatch_models.train --pipes-request`` with ``request`` in the Pipes extras.
    A stop (a signal to this process, forwarded, or to the training process: it saves a full
    state and exits 75; training_pipes.py) is recorded (record_stop) and ends the run CANCELED;
    a failed process's one-line error ($FLOWMATCH_ERROR_FILE) is the dg.Failure."""
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="flowmatch-train-") as tmp:
        error_file = Path(tmp) / "error.txt"  # the process's one-line error (a bad init, ...)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "FLOWMATCH_ERROR_FILE": str(error_file)}
        try:
            return pipes_subprocess_client.run(
                command=[sys.executable, "-m", "flowmatch_models.train", "--pipes-request"],
                context=context,
                extras={"train_request": request.to_dict()},
                env=env,
                cwd=str(REPO),
            )
        except TrainingStopped as e:  # saved (or said why not): the run ends CANCELED
            record_stop(context, run, started, stop_line(e, error_file, run, started))
            raise dg.DagsterExecutionInterruptedError() from None
        except dg.DagsterExecutionInterruptedError:  # Dagster's own client: "Terminate"
            record_stop(
                context,
                run,
                started,
                stop_line(TrainingStopped(-2, "SIGINT", False), error_file, run, started),
            )
            raise
        except Exception as e:  # noqa: BLE001 - a failed training process: say why in one line
            if not error_file.is_file():
                raise
            raise dg.Failure(description=error_file.read_text().strip()) from e


def publish_training(
    context: dg.AssetExecutionContext,
    config: TrainRunConfig,
    flowmatch: FlowmatchResource,
    invocation: dg.PipesClientCompletedInvocation,
    frac: float,
) -> dg.MaterializeResult:
    """The session's TrainResult into the catalog (validation curve, checkpoint ledgers, then
    the run's materialization record through ``publish_run``) and the asset's metadata."""
    from flowmatch_models.train.run import TrainResult

    results = [m["train_result"] for m in invocation.get_custom_messages() if "train_result" in m]
    if not results:
        raise dg.Failure("the training process ended without reporting a TrainResult")
    result = TrainResult.from_dict(results[-1])
    out = Path(result.run_dir)
    # one training speed everywhere (catalog throughput, this metadata, the budget): the median
    # over this session's steady logged windows, not the last window (which holds the final
    # checkpoint and sample grid)
    windows = _session_rates(out)
    rate = steady_rate(windows)
    if rate is None:
        rate = result.metrics.get("samples_per_s")
    if result.metrics_csv:  # the held-out validation curve (catalog `validation` view)
        catalog.record_validation(
            flowmatch.data_root,
            config.run_name,
            catalog.validation_rows(result.metrics_csv, config.run_name),
        )
    t0 = time.perf_counter()
    ledgers = write_ledgers(flowmatch.data_root, config.run_name, out)
    ledger_s = time.perf_counter() - t0
    context.log.info(f"ledger of checkpoints {ledgers} in {ledger_s:.1f}s")
    facts = {
        "run_name": config.run_name,
        "coverage": round(frac, 3),
        "run_dir": dg.MetadataValue.path(str(out)),
        "ledger_checkpoints": dg.MetadataValue.json(ledgers),
        "ledger_s": round(ledger_s, 2),
    }
    reported = invocation.get_materialize_result().metadata or {}
    return publish_run(
        context,
        flowmatch,
        "flow_model",
        config.run_name,
        samples=result.samples_session,
        seconds=result.wall_s,
        device=result.device,
        rate=rate,
        extra=run_record(flowmatch, result, rate, windows),
        metadata=training_metadata(reported, result, rate, facts),
    )


def run_record(
    flowmatch: FlowmatchResource, result: "TrainResult", rate: float | None, windows: list[float]
) -> dict:
    """The ``extra`` of a training run's catalog record (``flowmatch budget``, ``flowmatch
    stale``, reports and finetune.py read it)."""
    return {
        "step": result.step,
        "partitions": result.partitions,
        "trained_counts": result.trained_counts,
        "samples_total": result.samples_total,
        "samples_per_s": rate,
        "samples_per_s_last_window": result.metrics.get("samples_per_s"),
        "rate_windows": len(windows),
        **{k: result.metrics.get(k) for k in (TOTAL, VAL_METRIC)},
        "skipped_steps": result.skipped_steps,  # non-finite steps, since the run began
        "grad_norm_mean": result.grad_norm_mean,  # this session's, finite steps, before clipping
        "disk_bytes": result.disk_bytes,  # the run folder (checkpoints, exports, logs)
        "preset": _preset(result.export_dir),
        # what it trained on: {kind: {fingerprint hash: [partitions]}} (`flowmatch stale`)
        "input_fingerprints": trained_on(flowmatch, sorted(set(result.partitions))),
        "sources": sorted({source_of(p) for p in result.partitions}),
        # a fine-tune: the run and step it started from (`flowmatch stale`, finetune.py)
        "parent": result.parent,
    }


def training_metadata(
    reported: dict, result: "TrainResult", rate: float | None, facts: dict
) -> dict:
    """The asset's metadata: the losses first, what the process reported through Pipes, the
    run's ``facts`` (name, coverage, folder, ledger), its export, parent and pictures."""
    md = {k: round_meta(v) for k, v in reported.items()}
    # the headline: the flow-matching loss (what falls as it learns), the REPA term apart (a
    # negative cosine, so their weighted sum can be negative), the held-out loss
    md = {METADATA.get(k, k): v for k, v in md.items()}
    md = {k: md[k] for k in HEADLINE if k in md} | md
    if result.disk_bytes:
        md["disk_size"] = human_bytes(result.disk_bytes)
    md["samples_per_s"] = round_meta(rate) if rate is not None else 0.0
    md["samples_per_s_note"] = "median over steady logged windows (the budget's rate)"
    md["partitions_used"] = dg.MetadataValue.json(result.partitions)
    md.update(facts)
    if result.export_dir:
        md["pipeline"] = dg.MetadataValue.path(result.export_dir)
    if result.parent:
        md["parent"] = dg.MetadataValue.json(result.parent)
    for key, label in (
        ("loss_curve", "loss curve"),
        ("coverage_curve", "coverage per epoch"),
        ("sample_grid", "samples"),
    ):
        p = getattr(result, key)
        if p and Path(p).exists():
            from PIL import Image

            from flowmatch_models.figures.grid import markdown_image

            md[f"{key}_png"] = dg.MetadataValue.path(p)
            md[key] = dg.MetadataValue.md(markdown_image(Image.open(p), label, max_side=640))
    return md
