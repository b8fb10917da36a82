"""Lightning callbacks of a training run: atomic checkpoints with a retention policy, progress
lines, per-batch sample ids, and the sample grid + loss curve at the sample cadence (to disk
and to wandb)."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import time
from pathlib import Path

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import Callback

from flowmatch_models.data.module import EmbeddingDataModule
from flowmatch_models.figures.curves import loss_curve_now
from flowmatch_models.storage.atomic import atomic_path
from flowmatch_models.train.config import TrainConfig


class DiskFullError(OSError):
    """No space left for a checkpoint or an export; the previous one is intact."""


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
    - every ``full_every`` steps (and at the end) the full resumable state ``stepN.ckpt``
      (weights, Adam, EMA, scheduler, data position), the newest ``keep_full`` kept;
    - ``last.ckpt`` a hard link to the newest full state (no second copy), replaced atomically.

    Every write is atomic; a full disk leaves the previous files intact and stops the run on
    every rank with one line (:class:`DiskFullError`)."""

    def __init__(self, ckpt_dir: Path, io: AtomicCheckpointIO, every: int, full_every: int,
                 keep_full: int, keep_ema: int):  # fmt: skip
        self.dir, self.io = Path(ckpt_dir), io
        self.every, self.full_every = every, full_every
        self.keep_full, self.keep_ema = max(1, keep_full), keep_ema
        self._last_step = -1

    @property
    def last(self) -> Path:
        return self.dir / "last.ckpt"

    def on_train_start(self, trainer, pl_module) -> None:
        self._last_step = trainer.global_step  # a resume does not re-save its own step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step == self._last_step or step % min(self.every, self.full_every):
            return
        self._last_step = step
        if step % self.every == 0:
            self.save_ema(trainer, pl_module)
        if step % self.full_every == 0:
            self.save_full(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        if (
            self._last_step == trainer.global_step
            and (self.dir / self.full_name(trainer)).is_file()
        ):
            return
        self._last_step = trainer.global_step
        if not (self.dir / self.ema_name(trainer)).is_file():
            self.save_ema(trainer, pl_module)
        self.save_full(trainer)

    @staticmethod
    def full_name(trainer) -> str:
        return f"step{trainer.global_step:07d}.ckpt"

    @staticmethod
    def ema_name(trainer) -> str:
        return f"step{trainer.global_step:07d}-ema.ckpt"

    def _raise_if_full(self, trainer, msg: str | None) -> None:
        if trainer.world_size > 1:
            msg = trainer.strategy.broadcast(msg, src=0)
        if msg:
            raise DiskFullError(errno.ENOSPC, msg)

    def save_full(self, trainer) -> None:
        path = self.dir / self.full_name(trainer)
        self.io.disk_full = None
        trainer.save_checkpoint(path, weights_only=False)  # the full resumable state
        msg = self.io.disk_full
        if msg and self.last.is_file():
            msg = msg.replace(
                "no earlier checkpoint", f"the previous checkpoint {self.last} is intact"
            )
        if trainer.is_global_zero and not msg:
            try:
                _link_atomic(path, self.last)
            except OSError as e:
                if not _is_disk_full(e):
                    raise
                msg = disk_full_message(self.last, 0, path)
            self._prune(full=True)
        self._raise_if_full(trainer, msg)

    def save_ema(self, trainer, pl_module) -> None:
        msg = None
        if trainer.is_global_zero:
            ckpt = ema_snapshot(trainer, pl_module)
            path = self.dir / self.ema_name(trainer)
            try:
                with atomic_path(path) as tmp:
                    torch.save(ckpt, tmp)
            except (OSError, RuntimeError) as e:
                need = payload_bytes(ckpt)
                if not _is_disk_full(e, path.parent, need):
                    raise
                msg = disk_full_message(path, need, self.last if self.last.is_file() else None)
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
        line = (
            f"step {step}/{trainer.max_steps} loss {m.get('train/loss', nan):.4f} "
            f"fm {m.get('train/fm', nan):.4f} repa {m.get('train/repa', nan):.4f} "
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
                self._prompts = prompt_embeddings(self.cfg.sample.prompts, enc.text)
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
            pl_module.sampling_transformer(), text, mask, out, self.dm.scaling_factor, vae=self._vae,
            steps=s.steps, cfg_scale=s.cfg_scale, seed=s.seed, shift=self.cfg.flow.shift,
            labels=labels, null_text=pl_module.flow.null_text,
        )  # fmt: skip
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
