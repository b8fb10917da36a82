"""Train (or resume) a flow-matching DiT: ``python -m flowmatch_models.train --config run.yaml``.

A :class:`TrainRequest` (config, overrides, partitions, steps, run folder) goes in, a
:class:`TrainResult` (device, steps, samples, checkpoint, export, metrics) comes out; the
Dagster ``flow_model`` asset sends the request (its config validated in the Dagster process, as
a full ``TrainConfig`` dump) and receives the result through Dagster Pipes.
Hyperparameters are a :class:`~flowmatch_models.train.config.TrainConfig` (``configs/tiny.yaml``),
``--set key.sub=value`` overrides single entries. The run folder is ``run.out_dir``, else
``<data root>/runs/<run.name>`` (the folder ``flow_model`` uses), and holds:

    request.json                              the decided request (partitions, steps) of this session
    lineage.json                              a fine-tune's parent: run, step, weights, digest
    checkpoints/step0000100.ckpt, last.ckpt   model, EMA, optimizer, scheduler, data position
    checkpoints/trained_counts.json           samples trained per partition at the last save
    logs/segNNN/metrics.csv, metrics.csv      one CSV per (re)start, merged into metrics.csv
    wandb/offline-run-*                       W&B (online iff WANDB_API_KEY is set)
    loss_curve.png, samples/step*.png         pictures (also in wandb at the sample cadence)
    coverage.png                              partitions/samples available vs used per epoch
    pipeline/                                 ``SanaPipeline.from_pretrained`` (EMA transformer)
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException

from flowmatch_models.data.module import EmbeddingDataModule
from flowmatch_models.data.order import OrderChangedError
from flowmatch_models.data.source import PartitionChangedError
from flowmatch_models.figures.curves import merge_metrics, plot_coverage, plot_loss_curve
from flowmatch_models.inference.export import export_pipeline
from flowmatch_models.model.loss_terms import TERMS, TOTAL, VAL_LOSS, VAL_METRIC
from flowmatch_models.storage.atomic import atomic_write_text
from flowmatch_models.train import distributed, finetune, signals, wandb_run
from flowmatch_models.train.branches import retire_abandoned
from flowmatch_models.train.callbacks import (
    AtomicCheckpointIO,
    CheckpointPolicy,
    CheckpointWriteError,
    DiskFullError,
    ProgressPrinter,
    SampleGridCallback,
    SampleIdRecorder,
    disk_full_message,
    log_images,
)
from flowmatch_models.train.config import ConfigError, TrainConfig, load_config
from flowmatch_models.train.module import FlowMatchModule, NonFiniteStepsError
from flowmatch_models.train.quiet import quiet_libraries, quiet_wandb
from flowmatch_models.train.session import (
    TrainRequest,
    TrainResult,
    checkpoint_step,
    decide,
    select_sources,
)
from flowmatch_models.train.signals import EXIT_STOPPED, SignalStop, StoppedBySignal

# the boundary (train/session.py), imported from here too
__all__ = ["TrainRequest", "TrainResult", "decide", "main", "select_sources", "train"]

# --------------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------------


def train(request: TrainRequest, pipes=None, stop: SignalStop | None = None) -> TrainResult:
    """Run one training session; in the launcher first decide and publish the request.
    ``stop``: the process's signal handler (default: one installed for the session)."""
    published = distributed.published_request()
    if published is not None:  # a DDP rank: the launcher has decided
        request = TrainRequest.from_dict(json.loads(published.read_text()))
        cfg = load_config(request.config)
    else:
        request, cfg = decide(request)
        path = cfg.run_dir() / "request.json"
        atomic_write_text(path, json.dumps(request.to_dict(), indent=1))
        if request.resume == "none":  # a new run (or a restart): its parent, or none
            finetune.write_lineage(cfg.run_dir(), request.parent)
        start = checkpoint_step(request.resume) if request.resume != "none" else 0
        moved = retire_abandoned(cfg.run_dir() / "checkpoints", start, request.resume)
        if moved is not None:
            print(f"note: the checkpoints after step {start} (abandoned) moved to {moved}")
        distributed.publish_request(path)
        distributed.publish_rank_errors(cfg.run_dir() / ".rank_errors")
    return _fit(request, cfg, pipes, stop)


def _kept(run_dir: Path) -> str | None:
    last = run_dir / "checkpoints" / "last.ckpt"
    return f"{last} (step {checkpoint_step(str(last))})" if last.is_file() else None


def _fit(
    request: TrainRequest, cfg: TrainConfig, pipes, stop: SignalStop | None = None
) -> TrainResult:
    run_dir = cfg.run_dir()
    ckpt_path = None if request.resume == "none" else request.resume
    L.seed_everything(cfg.run.seed, workers=True, verbose=False)
    d, t = cfg.data, cfg.trainer
    dm = EmbeddingDataModule(
        cfg.data.root,
        request.partitions,
        batch_size=d.batch_size,
        num_workers=d.num_workers,
        seed=cfg.run.seed,
        shuffle_window=d.shuffle_window,
        text_max_len=d.text_max_len,
        load_dino=cfg.flow.repa_lambda > 0,
        allow_order_change=d.allow_order_change,
        grow=d.grow,
        accumulate=t.accumulate_grad_batches,
        fixed_text_len=cfg.model.compile,
        heldout=(d.heldout_fraction, d.heldout_max_per_partition),
        exclude=d.skip_duplicates,
        bucket_chunk=d.bucket_chunk,
        loader=d.loader,
    )
    module = FlowMatchModule(cfg, widths=dm.source.widths)
    module.parent = request.parent
    if request.parent and ckpt_path is None:  # a fine-tune: the parent's weights and text_norm
        for note in finetune.load_parent(module, request.parent, dm.source.widths):
            print(
                f"init from {request.parent['run']} step {request.parent['step']} "
                f"({request.parent['weights']}): {note}",
                flush=True,
            )
        note = finetune.ema_warning(
            cfg.optim.ema_decay, module.ema_steps(), t.max_steps, request.parent
        )
        if note and distributed.is_launcher():
            print(note, flush=True)
    elif request.parent:  # a resume: the weights are its own; the same parts stay frozen
        finetune.freeze(module.model, request.parent.get("freeze") or [])
    elif cfg.model.text_norm and ckpt_path is None:  # a resume keeps its first session's
        module.model.set_text_stats(*dm.source.text_stats())
    module.flow.null_text = dm.source.null_text
    if cfg.model.compile:  # whole FlowDiT forward (REPA output included); fixed text width
        compile_per_bucket(module.model, len(dm.source.grids))
    cuda = torch.cuda.is_available() and t.accelerator in ("auto", "gpu", "cuda")
    precision = t.precision if t.precision != "auto" else ("bf16-mixed" if cuda else "32-true")
    coverage = {
        **request.coverage,
        "partitions": len(dm.partitions),
        "samples": int(dm.source.sizes.sum()),
    }
    loggers: list = [
        L.pytorch.loggers.CSVLogger(
            run_dir / "logs", name="", version=f"seg{request.log_segment:03d}"
        )
    ]
    if cfg.logging.wandb:
        quiet_wandb()
        loggers.append(
            wandb_run.make_logger(cfg, run_dir, distributed.is_launcher(), coverage, request.parent)
        )
    ckpt_io = AtomicCheckpointIO()
    own_stop = stop is None  # else the process's, installed at its start (__main__.py)
    stop = stop or SignalStop()  # a signal from here on is a stop with a full state saved
    stop.install()
    ckpt_cb = CheckpointPolicy(
        run_dir / "checkpoints",
        ckpt_io,
        t.checkpoint_every,
        t.full_every or t.checkpoint_every,
        t.keep_full,
        t.keep_ema,
        full_every_minutes=t.full_every_minutes,
        stop=stop,
    )
    grid_cb = SampleGridCallback(cfg, dm)
    callbacks = [ckpt_cb, ProgressPrinter(t.log_every, pipes), grid_cb]
    if cfg.logging.record_sample_ids:
        callbacks.append(SampleIdRecorder(run_dir))
    trainer = L.Trainer(
        accelerator=t.accelerator,
        devices=t.devices,
        num_nodes=t.num_nodes,
        strategy=t.strategy,
        precision=precision,
        max_steps=t.max_steps,
        max_epochs=-1,
        accumulate_grad_batches=t.accumulate_grad_batches,
        log_every_n_steps=t.log_every,  # gradients clipped by the module (with the skip check)
        logger=loggers,
        callbacks=callbacks,
        plugins=[ckpt_io],
        enable_checkpointing=False,
        use_distributed_sampler=False,
        enable_progress_bar=t.progress_bar,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        reload_dataloaders_every_n_epochs=1,  # one loader per epoch: its partitions decided at its start
    )
    samples_before = _samples_in(ckpt_path)
    t0 = time.perf_counter()
    if stop.requested and distributed.is_launcher():  # before any rank started: nothing new
        if own_stop:
            stop.restore()
        raise StoppedBySignal(stop.name, 0, None, _kept(run_dir))
    try:
        trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path)
    except SIGTERMException:  # Lightning's handler won before ours was installed: nothing new
        ckpt_cb.writer.wait()
        raise StoppedBySignal("SIGTERM", 0, None, _kept(run_dir)) from None
    finally:
        if own_stop:
            stop.restore()
        else:  # Lightning's teardown put back the handlers it found; ours stay till the end
            stop.install()
        ckpt_cb.writer.release()
    total = int(sum(dm.trained_counts.values()))
    result = TrainResult(
        run_dir=str(run_dir),
        is_global_zero=trainer.is_global_zero,
        device=distributed.device_description(trainer),
        step=int(trainer.global_step),
        start_step=checkpoint_step(ckpt_path) if ckpt_path else 0,
        samples_session=total - samples_before,
        samples_total=total,
        trained_counts=dict(dm.trained_counts),
        partitions=list(dm.partitions),
        data_position={"epoch": dm.epoch, "position": dm.position},
        metrics={
            k: float(v) if (v := trainer.callback_metrics.get(f"train/{k}")) is not None else None
            for k in (*TERMS, "samples_per_s", "lr")
        },
        wall_s=time.perf_counter() - t0,
        resumed_from=ckpt_path,
        skipped_steps=module.skipped_steps(),
        grad_norm_mean=module.grad_norm_mean(),
        parent=request.parent,
    )
    result.metrics[VAL_METRIC] = module.last_validation.get(VAL_LOSS)
    if ckpt_cb.stopped is None and (stop.requested or stop.agreed) and distributed.is_launcher():
        # the signal came after the last step boundary (the final state is saved): it is a stop
        last = run_dir / "checkpoints" / "last.ckpt"
        step = checkpoint_step(str(last)) if last.is_file() else int(trainer.global_step)
        ckpt_cb.stopped = StoppedBySignal(stop.name, step, str(last) if last.is_file() else None)
    if ckpt_cb.stopped is not None:  # a signal: the state is saved, quickly out (no export)
        result.stopped = str(ckpt_cb.stopped)
        result.checkpoint = ckpt_cb.stopped.checkpoint
        return result
    if not trainer.is_global_zero:
        return result
    _finish_outputs(result, cfg, trainer, module, dm, grid_cb, loggers)
    print(
        f"done: step {result.step} loss {result.metrics[TOTAL]} on {result.device} in "
        f"{result.wall_s:.0f}s; checkpoint {result.checkpoint}; export {result.export_dir}",
        flush=True,
    )
    return result


def compile_per_bucket(model: torch.nn.Module, grids: int, backend: str = "inductor") -> None:
    """``torch.compile`` the model's forward with one static graph per latent grid (aspect-ratio
    bucket; captions are padded to ``data.text_max_len``, so nothing else changes shape): each
    bucket is compiled at its first batch, and never with dynamic shapes (Inductor's dynamic
    graph of this DiT fails to build: "cannot determine truth value of Relational"). Dynamo's
    recompile limit (8 graphs a function by default, then it silently runs eager) is raised to
    every bucket a run can meet: the default bucket list's and this run's, plus one.
    ``backend``: torch.compile's."""
    from torch._dynamo import config as dynamo

    from flowmatch_models.data.buckets import buckets_for

    dynamo.recompile_limit = max(dynamo.recompile_limit, len(buckets_for()) + 1, grids + 1)
    model.compile(dynamic=False, backend=backend)


def folder_bytes(folder: Path) -> int:
    """Bytes a folder takes on disk, each hard-linked file once (``last.ckpt`` is a link)."""
    seen, total = set(), 0
    for p in Path(folder).rglob("*"):
        try:
            st = p.lstat()
        except OSError:
            continue
        if p.is_file() and (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            total += st.st_size
    return total


def _samples_in(ckpt_path: str | None) -> int:
    """Samples trained up to a checkpoint (its data-module state), without its tensors."""
    if not ckpt_path:
        return 0
    ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=True, mmap=True)
    counts = (ckpt.get("EmbeddingDataModule") or {}).get("trained_counts") or {}
    return int(sum(counts.values()))


def _finish_outputs(result, cfg, trainer, module, dm, grid_cb, loggers) -> None:
    """Rank 0 after fit: checkpoint path, metrics + loss curve, last grid, export, wandb."""
    run_dir = cfg.run_dir()
    final = run_dir / "checkpoints" / "last.ckpt"
    result.checkpoint = str(final) if final.is_file() else None
    metrics = merge_metrics(run_dir)
    result.metrics_csv = str(metrics) if metrics else None
    if metrics:
        result.loss_curve = str(plot_loss_curve(metrics, run_dir / "loss_curve.png"))
    coverage = plot_coverage(dm.state_dict()["ledger"], run_dir / "coverage.png")
    result.coverage_curve = str(coverage) if coverage else None
    if cfg.trainer.sample_every > 0:
        if grid_cb.last_step != result.step:  # the end is off the cadence: one more grid
            grid_cb.render(trainer, module)
            curve = Path(result.loss_curve) if result.loss_curve else None
            log_images(trainer, result.step, samples=grid_cb.last_path, loss_curve=curve)
        result.sample_grid = str(grid_cb.last_path)
    try:
        result.export_dir = str(
            export_pipeline(
                module.sampling_transformer(),
                run_dir / "pipeline",
                scaling_factor=dm.scaling_factor,
                preset=cfg.model.preset,
                shift=cfg.flow.sample_shift,
                null_text=module.flow.null_text,
                vae=cfg.encoders.vae,
                text_encoder=cfg.encoders.text,
                max_tokens=cfg.encoders.max_tokens,
                parent=result.parent,
            )
        )
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        need = sum(p.numel() * p.element_size() for p in module.ema.parameters())
        raise DiskFullError(
            e.errno,
            disk_full_message(run_dir / "pipeline", need, final).replace(
                "nothing half-written was left", "the previous pipeline/ is unchanged"
            ),
        ) from None
    result.disk_bytes = folder_bytes(run_dir)
    result.wandb_dir = wandb_run.finish(loggers)


#: Lightning's and PyTorch's warnings about what this trainer does on purpose: the EMA copy and
#: the frozen parts are in eval mode; the module moves and decodes batches itself (the data
#: module's hooks are the default ones); Lightning's own pytree helper uses a deprecated torch
#: check. Matched at the start of the message, so any other warning still shows.
def _pipes():
    """Dagster Pipes when launched by Dagster (``DAGSTER_PIPES_CONTEXT``), in the launcher."""
    if os.environ.get("DAGSTER_PIPES_CONTEXT") and distributed.is_launcher():
        from dagster_pipes import open_dagster_pipes

        return open_dagster_pipes()
    return contextlib.nullcontext(None)


def _error(line: str, code: int, agreed: bool = False) -> int:
    """Print the one-line error; also into ``$FLOWMATCH_ERROR_FILE`` when the caller (the
    training assets) asked for it, so that the UI's failure names it. A stop's line
    (:data:`EXIT_STOPPED`) is then the caller's to say (the CLI's last line, the run's log)."""
    said_by_caller = code == EXIT_STOPPED and os.environ.get("FLOWMATCH_ERROR_FILE")
    if not said_by_caller and not (agreed and not distributed.is_launcher()):
        print(line, file=sys.stderr, flush=True)  # (an agreed error: the launcher's line only)
    distributed.record_rank_error(line, code, agreed)  # a rank's: the launcher says it
    if os.environ.get("FLOWMATCH_ERROR_FILE") and distributed.is_launcher():
        atomic_write_text(os.environ["FLOWMATCH_ERROR_FILE"], line)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: flags -> TrainRequest -> :func:`train` -> TrainResult (and Pipes, under Dagster).

    Exit codes: 0 done; 2 a mistake in the request (config, order change, missing file); 3 the
    run stopped itself (non-finite steps, full disk, a partition re-made mid-epoch);
    75 (:data:`~flowmatch_models.train.signals.EXIT_STOPPED`) stopped by SIGTERM, SIGINT or
    SIGUSR1 after saving a full state (resume with ``--resume auto``); 128 + N a second signal N
    (exited at once)."""
    ap = argparse.ArgumentParser(
        prog="python -m flowmatch_models.train",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--config", help="run YAML (see configs/tiny.yaml)")
    ap.add_argument("--resume", default="auto", help="auto (last.ckpt if any), none, or a path")
    ap.add_argument("--max-steps", type=int, default=None, help="total steps")
    ap.add_argument("--extra-steps", type=int, default=None, help="steps beyond the checkpoint")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument(
        "--pipes-request",
        action="store_true",
        help="read the TrainRequest from the Dagster Pipes extras (flow_model)",
    )
    ap.add_argument("--result-json", default=None, help="also write the TrainResult here")
    args = ap.parse_args(argv)
    stop = signals.EARLY or SignalStop()  # installed by __main__.py before the imports
    stop.install()
    distributed.end_ranks_on_exit(stop)
    try:
        return _main(args, stop)
    finally:
        stop.restore()
        stop.on_exit.clear()


def _main(args: argparse.Namespace, stop: SignalStop) -> int:
    quiet_libraries()
    with _pipes() as pipes:
        try:  # a user's mistake (bad key or value, changed order on resume): one line, exit 2
            if args.pipes_request:
                if pipes is None and distributed.published_request() is None:
                    raise ConfigError("--pipes-request needs a Dagster Pipes launch")
                extras = pipes.extras["train_request"] if pipes is not None else {}
                request = TrainRequest.from_dict(extras) if extras else TrainRequest()
            elif args.config:
                request = TrainRequest(
                    config=args.config,
                    overrides=list(args.set),
                    max_steps=args.max_steps,
                    extra_steps=args.extra_steps,
                    resume=args.resume,
                )
            else:
                raise ConfigError("pass --config run.yaml (see configs/tiny.yaml)")
            result = train(request, pipes, stop)
        except (ConfigError, OrderChangedError, FileNotFoundError) as e:
            return _error(f"error: {e}", 2)
        except (
            NonFiniteStepsError,
            DiskFullError,
            PartitionChangedError,
            CheckpointWriteError,
        ) as e:  # stopped itself
            agreed = isinstance(e, (DiskFullError, CheckpointWriteError))  # rank 0's, broadcast
            return _error(f"error: {e.strerror if isinstance(e, DiskFullError) else e}", 3, agreed)
        except StoppedBySignal as e:
            return _error(str(e), EXIT_STOPPED)
        except Exception:  # a rank the launcher started failed first: its line, its exit code
            got = distributed.rank_failure()
            if got is None:
                raise
            return _error(*got)
        if result.stopped:  # a signal: the full state is saved; one line (the launcher's), 75
            if pipes is not None and result.is_global_zero:
                pipes.report_custom_message({"train_result": result.to_dict()})
            if not distributed.is_launcher():
                return EXIT_STOPPED
            return _error(result.stopped, EXIT_STOPPED)
        if pipes is not None and result.is_global_zero:
            pipes.report_custom_message({"train_result": result.to_dict()})
            pipes.report_asset_materialization(metadata=result.materialization_metadata())
    if args.result_json and result.is_global_zero:
        atomic_write_text(args.result_json, json.dumps(result.to_dict(), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
