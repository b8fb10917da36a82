"""Lightning callbacks of a training run: atomic checkpoints with a retention policy, progress
lines, per-batch sample ids, and the sample grid + loss curve at the sample cadence (to disk
and to wandb)."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import time
from pathlib import Path

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import Callback

from flowmatch_models.data.module import EmbeddingDataModule
from flowmatch_models.figures.curves import loss_curve_now
from flowmatch_models.model.loss_terms import LOSS_TERMS
from flowmatch_models.storage.atomic import atomic_path
from flowmatch_models.train import lightning_compat
from flowmatch_models.train.config import TrainConfig
from flowmatch_models.train.signals import SignalStop, StoppedBySignal, signal_name
from flowmatch_models.train.state_writer import StateWriter


class DiskFullError(OSError):
    """No space left for a checkpoint or an export; the previous one is intact."""


class CheckpointWriteError(Exception):
    """A checkpoint write failed for another reason (an I/O error, a removed folder): one line,
    raised on every rank (the others would wait in the next collective); the newest complete
    full state is intact."""


def _is_disk_full(e: BaseException, folder: Path | None = None, need: int = 0) -> bool:
    """ENOSPC/EDQUOT, or -- ``torch.save`` on a full filesystem raises ``RuntimeError:
    basic_ios::clear: iostream error`` (seen on a real tmpfs) -- a write error in a folder
    with less free space than the write needed."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    if isinstance(e, (OSError, RuntimeError)) and folder is not None and folder.exists():
        return shutil.disk_usage(folder).free < need + (1 << 20)
    return False


def payload_bytes(obj) -> int:
    """Bytes of the tensors in a (nested) checkpoint dict: what a save needs on disk."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(payload_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(payload_bytes(v) for v in obj)
    return 0


def disk_full_message(path: Path, need: int, keep: Path | None) -> str:
    """One line: which folder, how much was needed and is free, what is intact, the fix."""
    free = shutil.disk_usage(path.parent).free if path.parent.exists() else 0
    kept = f"the previous checkpoint {keep} is intact" if keep else "no earlier checkpoint"
    return (
        f"no space left writing {path.name} in {path.parent} (needs ~{need / 1e9:.2f} GB, "
        f"{free / 1e9:.2f} GB free); nothing half-written was left and {kept}. Free space "
        "there (or set run.out_dir on a bigger disk, or lower trainer.keep_full/keep_ema), "
        "then resume with --resume auto"
    )


def write_error_message(path: Path | None, error: BaseException, keep: Path | None) -> str:
    """One line: which write failed and why, what is intact, the fix."""
    kept = f"the newest complete full state {keep} is intact" if keep else "no earlier checkpoint"
    what = f"{path.name} in {path.parent}" if path is not None else "a checkpoint"
    return (
        f"writing {what} failed: {type(error).__name__}: {error}; nothing half-written was "
        f"left and {kept}. Fix the folder, then resume with --resume auto"
    )


class AtomicCheckpointIO(TorchCheckpointIO):
    """Checkpoints written by atomic rename and read with ``torch.load(weights_only=True)``.

    A full disk never raises on one rank alone (under DDP the others would wait forever): the
    error is kept in :attr:`disk_full` for :class:`CheckpointPolicy`, which tells every rank."""

    def __init__(self):
        super().__init__()
        self.disk_full: str | None = None

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        try:
            with atomic_path(path) as tmp:
                torch.save(checkpoint, tmp)
        except (OSError, RuntimeError) as e:
            need = payload_bytes(checkpoint)
            if not _is_disk_full(e, Path(path).parent, need):
                raise
            self.disk_full = disk_full_message(Path(path), need, None)

    def load_checkpoint(self, path, map_location=None, weights_only=None) -> dict:
        return torch.load(path, map_location=map_location or "cpu", weights_only=True)


CKPT_NAME = re.compile(r"step(\d+)(-ema)?\.ckpt")


def ema_snapshot(trainer, pl_module) -> dict:
    """What evaluation, export and the ledger need of a step: the EMA transformer (``ema.*``,
    as in a full checkpoint), the run's ``flowmatch`` info and the data module's state (its
    ledger) -- no optimizer, no training weights (a quarter of a full state)."""
    ckpt: dict = {
        "global_step": int(trainer.global_step),
        "epoch": int(trainer.current_epoch),
        "kind": "ema",
        "state_dict": {f"ema.{k}": v.detach().cpu() for k, v in pl_module.ema.state_dict().items()},
    }
    dm = getattr(trainer, "datamodule", None)
    if dm is not None and hasattr(dm, "state_dict"):
        ckpt[type(dm).__qualname__] = dm.state_dict()
    pl_module.on_save_checkpoint(ckpt)
    return ckpt


class CheckpointPolicy(Callback):
    """Checkpoints sized for a long run (``trainer.*`` in the config):

    - every ``checkpoint_every`` steps an EMA-only snapshot ``stepN-ema.ckpt`` (evaluation,
      export, the ledger), the newest ``keep_ema`` kept (0 = all);
    - the full resumable state ``stepN.ckpt`` (weights, Adam, EMA, scheduler, data position)
      every ``full_every`` steps, and at the first step boundary after ``full_every_minutes``
      of wall-clock time since the previous one (so a fault loses at most that much), on a
      signal (:mod:`~flowmatch_models.train.signals`) and at the end; the newest ``keep_full``
      kept. The training loop waits only for a host copy: the write runs in the background
      (:class:`~flowmatch_models.train.state_writer.StateWriter`), one at a time;
    - ``last.ckpt`` a hard link to the newest complete full state (no second copy), replaced
      atomically once the state is in place.

    Under DDP every decision is taken at the same optimizer-step boundary on every rank: rank 0
    decides the wall-clock one, any rank's signal counts (one all-reduce per optimizer step).
    Every write is atomic; a full disk leaves the previous files intact and stops the run on
    every rank with one line (:class:`DiskFullError`)."""

    def __init__(
        self,
        ckpt_dir: Path,
        io: AtomicCheckpointIO,
        every: int,
        full_every: int,
        keep_full: int,
        keep_ema: int,
        full_every_minutes: float | None = None,
        background: bool = True,
        stop: SignalStop | None = None,
    ):
        self.dir, self.io = Path(ckpt_dir), io
        self.every, self.full_every = every, full_every
        self.keep_full, self.keep_ema = max(1, keep_full), keep_ema
        self.interval_s = 60.0 * full_every_minutes if full_every_minutes else None
        self.writer = StateWriter(background=background)
        self.stop = stop if stop is not None else SignalStop()
        self.stopped: StoppedBySignal | None = None
        self.stalls: list[float] = []  # the training loop's wait per full state
        self._boundary = -1  # the optimizer step whose boundary was handled last
        self._full_step = -1  # the step of the newest full state (written or in flight)
        self._t_full = time.monotonic()
        self._need = 0  # bytes of the full state in flight (a disk-full message says it)

    @property
    def last(self) -> Path:
        return self.dir / "last.ckpt"

    def on_train_start(self, trainer, pl_module) -> None:
        self._boundary = trainer.global_step  # a resume does not re-save its own step
        self._t_full = time.monotonic()
        self.stop.install()  # replaces Lightning's SIGTERM handler (installed by fit)
        if trainer.received_sigterm:  # Lightning's handler saw one first: it is ours now
            lightning_compat.forget_sigterm(trainer)
            self.stop.signum = self.stop.signum or signal.SIGTERM
        if trainer.is_global_zero:  # what a killed write left behind takes disk space
            for p in self.dir.glob(".tmp-step*.ckpt.*"):
                p.unlink(missing_ok=True)

    def _agree(self, trainer) -> tuple[int, bool]:
        """(signal number or 0, wall-clock interval due): the same on every rank."""
        due = bool(
            self.interval_s
            and trainer.is_global_zero
            and time.monotonic() - self._t_full >= self.interval_s
        )
        sig = int(self.stop.signum or 0)
        if trainer.world_size > 1:
            import torch.distributed as dist

            flags = torch.tensor([sig, int(due)], device=trainer.strategy.root_device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            sig, due = (int(x) for x in flags.tolist())
        return sig, bool(due)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step == self._boundary:  # inside an accumulation group
            return
        self._boundary = step
        sig, due = self._agree(trainer)
        if step % self.every == 0:
            self.save_ema(trainer, pl_module)
        if step % self.full_every == 0 or due or sig:
            self.save_full(trainer)
        if sig:  # agreed by every rank; a rank's own signal count is left as it is (signals.py)
            self.stop.agreed = self.stop.agreed or sig
            self.finish(trainer)  # the state is complete before the run says so
            path = self.dir / self.full_name(trainer)
            name = self.stop.name if self.stop.signum else signal_name(sig)
            self.stopped = StoppedBySignal(name, step, str(path))
            trainer.should_stop = True

    def on_train_end(self, trainer, pl_module) -> None:
        if self._full_step != trainer.global_step:
            if not (self.dir / self.ema_name(trainer)).is_file():
                self.save_ema(trainer, pl_module)
            self.save_full(trainer)
        self.finish(trainer)

    def on_exception(self, trainer, pl_module, exception) -> None:
        self.writer.wait()  # a state being written is completed (and linked), never cut

    def finish(self, trainer) -> None:
        """Wait for the write in flight; a full disk there stops every rank."""
        self._raise_if_full(trainer, self._written(self.writer.wait()))

    @staticmethod
    def full_name(trainer) -> str:
        return f"step{trainer.global_step:07d}.ckpt"

    @staticmethod
    def ema_name(trainer) -> str:
        return f"step{trainer.global_step:07d}-ema.ckpt"

    def _raise_if_full(self, trainer, msg: tuple[str, str] | None) -> None:
        """Every rank raises rank 0's write error ``(kind, line)``: a full disk or another."""
        if trainer.world_size > 1:
            msg = trainer.strategy.broadcast(msg, src=0)
        if msg and msg[0] == "full":
            raise DiskFullError(errno.ENOSPC, msg[1])
        if msg:
            raise CheckpointWriteError(msg[1])

    def _written(self, error: BaseException | None) -> tuple[str, str] | None:
        """The one-line message of an error in the previous write: ("full", line) for a full
        disk, ("error", line) for any other."""
        if error is None:
            return None
        path = self.writer.failed_path
        keep = self.last if self.last.is_file() else None
        if path is not None and _is_disk_full(error, path.parent, self._need):
            return "full", disk_full_message(path, self._need, keep)
        return "error", write_error_message(path, error, keep)

    def save_full(self, trainer) -> None:
        """The full state of this step: dumped on every rank, written by rank 0 (in the
        background); the previous write is waited for (and its disk-full error raised) first."""
        self.finish(trainer)
        path = self.dir / self.full_name(trainer)
        t0 = time.perf_counter()
        ckpt, msg = None, None
        try:  # rank 0 also writes trained_counts.json here (the module's on_save_checkpoint)
            ckpt = lightning_compat.dump_checkpoint(trainer)
        except (OSError, RuntimeError) as e:
            if not trainer.is_global_zero:
                raise
            keep = self.last if self.last.is_file() else None
            full = _is_disk_full(e, self.dir, 1 << 20)
            msg = ("full", disk_full_message(path, 1 << 20, keep)) if full else None
            msg = msg or ("error", write_error_message(path, e, keep))
        if trainer.world_size > 1 or msg:  # every rank raises rank 0's error, or none does
            self._raise_if_full(trainer, msg)
        if trainer.is_global_zero:
            self._need = payload_bytes(ckpt)
            self.writer.save(ckpt, path, self._link_and_prune)
            self.stalls.append(time.perf_counter() - t0)
        self._full_step = trainer.global_step
        self._t_full = time.monotonic()
        if not self.writer.background:
            self.finish(trainer)

    def _link_and_prune(self, path: Path) -> None:
        """On the writer's thread once ``path`` is in place: ``last.ckpt`` -> it, old pruned."""
        _link_atomic(path, self.last)
        self._prune(full=True)

    def save_ema(self, trainer, pl_module) -> None:
        msg = None
        if trainer.is_global_zero:
            ckpt: dict = {}
            path = self.dir / self.ema_name(trainer)
            keep = self.last if self.last.is_file() else None
            try:
                ckpt = ema_snapshot(trainer, pl_module)  # (writes trained_counts.json too)
                with atomic_path(path) as tmp:
                    torch.save(ckpt, tmp)
            except (OSError, RuntimeError) as e:
                need = payload_bytes(ckpt)
                if _is_disk_full(e, path.parent, need):
                    msg = ("full", disk_full_message(path, need, keep))
                else:
                    msg = ("error", write_error_message(path, e, keep))
            else:
                self._prune(full=False)
        self._raise_if_full(trainer, msg)

    def _prune(self, full: bool) -> None:
        keep = self.keep_full if full else self.keep_ema
        if keep <= 0:
            return
        found = sorted(
            (int(m.group(1)), p)
            for p in self.dir.glob("step*.ckpt")
            if (m := CKPT_NAME.fullmatch(p.name)) and (m.group(2) is None) == full
        )
        for _, p in found[:-keep]:
            p.unlink(missing_ok=True)


def _link_atomic(src: Path, dst: Path) -> None:
    """``dst`` becomes another name of ``src`` (a hard link, renamed into place; a copy where
    the filesystem has no hard links)."""
    tmp = dst.with_name(f".tmp-{dst.name}.link")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError as e:
        if _is_disk_full(e) or e.errno not in (
            errno.EPERM,
            errno.EXDEV,
            errno.EOPNOTSUPP,
            errno.EMLINK,
        ):
            raise
        shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


class ProgressPrinter(Callback):
    """Prints a progress line (and a Dagster Pipes log line) every ``log_every`` steps."""

    def __init__(self, every: int, pipes=None):
        self.every, self.pipes, self.t0 = max(1, every), pipes, time.perf_counter()
        self._last = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if not trainer.is_global_zero or step % self.every or step == self._last:
            return
        self._last = step
        m = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
        nan = float("nan")
        terms = " ".join(f"{t.key} {m.get(t.logged, nan):.4f}" for t in LOSS_TERMS)
        line = (
            f"step {step}/{trainer.max_steps} {terms} "
            f"lr {m.get('train/lr', nan):.2e} {m.get('train/samples_per_s', nan):.0f} samples/s "
            f"({time.perf_counter() - self.t0:.0f}s)"
        )
        if m.get("train/skipped_steps", 0) > 0:
            line += f" skipped {m['train/skipped_steps']:.0f} non-finite steps"
        print(line, flush=True)
        if self.pipes is not None:
            self.pipes.log.info(line)


class SampleIdRecorder(Callback):
    """Appends ``{step, epoch, position, ids, loss}`` per batch to ``sample_ids/rank<r>.jsonl``."""

    def __init__(self, out_dir: Path):
        self.dir = out_dir / "sample_ids"

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        meta = pl_module.batch_meta
        rec = {
            "step": trainer.global_step,
            "epoch": meta["epoch"],
            "position": meta["position"],
            "ids": list(meta["ids"]),
            "loss": float(outputs["loss"]) if isinstance(outputs, dict) else float(outputs),
        }
        with open(self.dir / f"rank{trainer.global_rank}.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")


class SampleGridCallback(Callback):
    """Every ``trainer.sample_every`` steps (rank 0): EMA samples of the fixed prompts ->
    ``samples/stepN.png``, the loss curve redrawn, and both logged to wandb as images."""

    def __init__(self, cfg: TrainConfig, datamodule: EmbeddingDataModule):
        self.cfg, self.dm, self.every = cfg, datamodule, cfg.trainer.sample_every
        self._prompts = None
        self._vae = None
        self.last_step = -1
        self.last_path: Path | None = None

    def _prepare(self):
        from flowmatch_models.inference.sample import load_vae, prompt_embeddings, store_captions

        enc = self.cfg.encoders
        if self._prompts is None:
            if enc.text:
                self._prompts = prompt_embeddings(self.cfg.sample.prompts, enc.text, enc.max_tokens)
            else:
                self._prompts = store_captions(self.dm.source, len(self.cfg.sample.prompts))
            if enc.vae:
                self._vae = load_vae(enc.vae)
        return self._prompts

    def render(self, trainer, pl_module) -> Path:
        from flowmatch_models.inference.sample import sample_grid

        text, mask, labels = self._prepare()
        s = self.cfg.sample
        out = self.cfg.run_dir() / "samples" / f"step{trainer.global_step:07d}.png"
        self.last_path = sample_grid(
            pl_module.sampling_transformer(),
            text,
            mask,
            out,
            self.dm.scaling_factor,
            vae=self._vae,
            steps=s.steps,
            cfg_scale=s.cfg_scale,
            seed=s.seed,
            shift=self.cfg.flow.sample_shift,
            labels=labels,
            null_text=pl_module.flow.null_text,
        )
        self.last_step = trainer.global_step
        return self.last_path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if not trainer.is_global_zero or self.every <= 0 or step % self.every:
            return
        if step == self.last_step:
            return
        grid = self.render(trainer, pl_module)
        curve = loss_curve_now(self.cfg.run_dir(), trainer)
        log_images(trainer, step, samples=grid, loss_curve=curve)


def log_images(trainer, step: int, **images: Path | None) -> None:
    """``key=png`` images into the run's wandb logger (if any), at ``trainer/global_step``."""
    for lg in trainer.loggers:
        if lg.__class__.__name__ == "WandbLogger":
            import wandb

            row = {k: wandb.Image(str(p), caption=f"step {step}") for k, p in images.items() if p}
            lg.log_metrics(row, step=step)
