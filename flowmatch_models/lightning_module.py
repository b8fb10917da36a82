"""Lightning module: flow matching + REPA on a :class:`FlowDiT`, AdamW + warmup, EMA, logging.

Hyperparameters (a :class:`~flowmatch_models.config.TrainConfig`) come from the run's YAML each time the module is built and are never frozen
into the checkpoint: on resume, :meth:`on_load_checkpoint` rewrites the restored optimizer and
scheduler learning rates, weight decay and betas with the current config, so an edited YAML
takes effect. Checkpoints hold only tensors and primitive containers (``weights_only=True``).

Randomness of a training step (t, noise, caption dropout) is drawn from a generator seeded by
``(seed, epoch, data position, rank)``: a resumed run draws exactly what the uninterrupted
run drew, independent of Lightning's RNG handling.
"""

from __future__ import annotations

import copy
import json
import math
import time

import lightning as L
import numpy as np
import torch

from flowmatch_models.atomic import atomic_write_text
from flowmatch_models.config import TrainConfig
from flowmatch_models.dit import FlowDiT, build_model
from flowmatch_models.flow import FlowMatching


def _step_seed(*parts: int) -> int:
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0])


def lr_factor(step: int, warmup_steps: int, schedule: str, max_steps: int, min_ratio: float):
    """Multiplier of the base lr at optimizer step ``step``: linear warmup, then const/cosine."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":
        frac = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * frac))
    raise ValueError(f"unknown optim.schedule {schedule!r}; use 'constant' or 'cosine'")


class FlowMatchModule(L.LightningModule):
    """Trains a :class:`FlowDiT` with :class:`FlowMatching`; keeps an EMA of the transformer."""

    def __init__(self, config: TrainConfig, model: FlowDiT | None = None):
        super().__init__()
        self.config = config
        m = config.model
        self.model = model or build_model(
            m.preset,
            repa_encoder_depth=m.repa_encoder_depth,
            projector_hidden=m.projector_hidden,
            repa=config.flow.repa_lambda > 0,  # no unused REPA head (DDP)
            pos_embed=m.pos_embed,
            init=m.init,
        )
        if m.gradient_checkpointing:
            self.model.transformer.enable_gradient_checkpointing()
        self.ema = copy.deepcopy(self.model.transformer).requires_grad_(False).eval()
        self.flow = FlowMatching(**config.flow.model_dump())
        self._ema_step = -1
        self._t_last: float | None = None
        self._grad_norm: torch.Tensor | None = None

    # ---------------------------------------------------------------------------- optimisation

    def configure_optimizers(self):
        o, max_steps = self.config.optim, self.config.trainer.max_steps
        opt = torch.optim.AdamW(
            self.model.parameters(), lr=o.lr, betas=o.betas, weight_decay=o.weight_decay
        )
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: lr_factor(s, o.warmup_steps, o.schedule, max_steps, o.min_lr_ratio)
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """Let the current YAML win over the optimizer/scheduler hyperparameters restored."""
        o, lr = self.config.optim, self.config.optim.lr
        scheds = checkpoint.get("lr_schedulers", [])
        last = int(scheds[0]["last_epoch"]) if scheds else int(checkpoint.get("global_step", 0))
        factor = lr_factor(
            last, o.warmup_steps, o.schedule, self.config.trainer.max_steps, o.min_lr_ratio
        )
        for state in checkpoint.get("optimizer_states", []):
            for group in state["param_groups"]:
                group["initial_lr"] = lr
                group["lr"] = lr * factor  # the first resumed step already uses the new value
                group["weight_decay"] = o.weight_decay
                group["betas"] = tuple(o.betas)
        for state in checkpoint.get("lr_schedulers", []):
            state["base_lrs"] = [lr for _ in state["base_lrs"]]

    def on_before_optimizer_step(self, optimizer) -> None:
        grads = [
            p.grad.detach().float().norm() for p in self.model.parameters() if p.grad is not None
        ]
        self._grad_norm = torch.stack(grads).norm() if grads else None

    # ---------------------------------------------------------------------------- training

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        epoch, pos = int(batch["epoch"]), int(batch["position"])
        seed = _step_seed(self.config.run.seed, epoch, pos, self.global_rank)
        gen = torch.Generator(device=self.device).manual_seed(seed)
        x = batch["latents"].float()
        text = batch["text"].float()
        dino = batch.get("dino")
        out = self.flow.loss(self.model, x, text, batch["mask"], dino, generator=gen)
        b = x.shape[0]
        self.log("train/loss", out["loss"], prog_bar=True, batch_size=b)
        self.log("train/fm", out["fm"], batch_size=b)
        self.log("train/repa", out["repa"], batch_size=b)
        if self.global_step % self.config.trainer.log_every == 0:
            for i, (v, c) in enumerate(zip(out["bin_loss"].tolist(), out["bin_count"].tolist())):
                if c > 0:
                    self.log(f"train_t/bin{i}", v, batch_size=int(c))
        dm = getattr(self.trainer, "datamodule", None)
        if dm is not None and hasattr(dm, "mark_consumed"):
            dm.mark_consumed(epoch, pos, int(batch["global_batch"]))
        return out["loss"]

    def optimizer_step(self, *args, **kwargs) -> None:
        super().optimizer_step(*args, **kwargs)
        self.update_ema()  # before any callback (e.g. a checkpoint) sees this step

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        step = self.global_step
        if step == self._ema_step:
            return  # still accumulating
        self._ema_step = step
        now = time.perf_counter()
        if self._t_last is not None:
            accum = self.trainer.accumulate_grad_batches
            n = int(batch["global_batch"]) * accum
            self.log("train/samples_per_s", n / max(now - self._t_last, 1e-9), batch_size=1)
        self._t_last = now
        self.log("train/lr", self.trainer.optimizers[0].param_groups[0]["lr"], batch_size=1)
        if self._grad_norm is not None:
            self.log("train/grad_norm", self._grad_norm, batch_size=1)

    @torch.no_grad()
    def update_ema(self) -> None:
        """``ema = d ema + (1 - d) w`` with ``d = min(decay, (1 + step) / (10 + step))``."""
        d = min(self.config.optim.ema_decay, (1 + self.global_step) / (10 + self.global_step))
        ema = list(self.ema.parameters())
        src = list(self.model.transformer.parameters())
        torch._foreach_lerp_(ema, [p.detach() for p in src], 1 - d)

    # ---------------------------------------------------------------------------- checkpoints

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        dm = getattr(self.trainer, "datamodule", None)
        info = {
            "preset": self.config.model.preset,
            "step": int(self.global_step),
            "flow_shift": self.config.flow.shift,
            "encoders": {"vae": self.config.encoders.vae, "text": self.config.encoders.text},
        }
        cfg = self.model.transformer.config
        info["transformer_config"] = {k: v for k, v in cfg.items() if not k.startswith("_")}
        if self.flow.null_text is not None:
            info["null_text"] = self.flow.null_text.detach().cpu().clone()
        if dm is not None and hasattr(dm, "state_dict"):
            info["scaling_factor"] = float(dm.scaling_factor)
            state = dm.state_dict()
            info["trained_counts"] = state["trained_counts"]
            if self.trainer.is_global_zero:
                ckpt_dir = self.config.run_dir() / "checkpoints"
                atomic_write_text(
                    ckpt_dir / "trained_counts.json",
                    json.dumps({"step": int(self.global_step), **state}, indent=1, sort_keys=True),
                )
        checkpoint["flowmatch"] = info
