"""Lightning callbacks of a training run: atomic checkpoints, progress lines, per-batch sample
ids, and the sample grid + loss curve at the sample cadence (to disk and to wandb)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import Callback

from flowmatch_models.atomic import atomic_path
from flowmatch_models.config import TrainConfig
from flowmatch_models.curves import loss_curve_now
from flowmatch_models.data import EmbeddingDataModule


class AtomicCheckpointIO(TorchCheckpointIO):
    """Checkpoints written by atomic rename and read with ``torch.load(weights_only=True)``."""

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        with atomic_path(path) as tmp:
            torch.save(checkpoint, tmp)

    def load_checkpoint(self, path, map_location=None, weights_only=None) -> dict:
        return torch.load(path, map_location=map_location or "cpu", weights_only=True)


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
        print(line, flush=True)
        if self.pipes is not None:
            self.pipes.log.info(line)


class SampleIdRecorder(Callback):
    """Appends ``{step, epoch, position, ids, loss}`` per batch to ``sample_ids/rank<r>.jsonl``."""

    def __init__(self, out_dir: Path):
        self.dir = out_dir / "sample_ids"

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        rec = {
            "step": trainer.global_step,
            "epoch": int(batch["epoch"]),
            "position": int(batch["position"]),
            "ids": list(batch["ids"]),
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
        from flowmatch_models.sample import load_vae, prompt_embeddings, store_captions

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
        from flowmatch_models.sample import sample_grid

        text, mask, labels = self._prepare()
        s = self.cfg.sample
        out = self.cfg.run_dir() / "samples" / f"step{trainer.global_step:07d}.png"
        self.last_path = sample_grid(
            pl_module.ema, text, mask, out, self.dm.scaling_factor, vae=self._vae,
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
