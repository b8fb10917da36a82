"""Lightning module: flow matching + REPA on a :class:`FlowDiT`, AdamW + warmup, EMA, logging.

Hyperparameters (a :class:`~flowmatch_models.train.config.TrainConfig`) come from the run's YAML each time the module is built and are never frozen
into the checkpoint: on resume, :meth:`on_load_checkpoint` rewrites the restored optimizer and
scheduler learning rates, weight decay and betas with the current config, so an edited YAML
takes effect. Checkpoints hold only tensors and primitive containers (``weights_only=True``).

Randomness of a training step (t, noise, caption dropout) is drawn from a generator seeded by
``(seed, epoch, data position, rank)``: a resumed run draws exactly what the uninterrupted
run drew, independent of Lightning's RNG handling.

A non-finite step never reaches the weights: the gradient norm is computed once on the device
(it also clips), and a non-finite one sets the fused AdamW's ``found_inf`` (the mechanism
``GradScaler`` uses), so the update, the Adam moments and their step count are left untouched
on the device, and the EMA update of that step is weighted by zero. Under ``16-mixed`` the
gradients are unscaled first and the ``GradScaler`` makes the same decision from the same
gradients. Under DDP the gradients are all-reduced before this check, so every rank skips
together; strategies that shard gradients (FSDP, DeepSpeed) would see one rank's shard here
and are refused by the config (``trainer.strategy``). Skipped steps are counted on
the device and read at the logging cadence (no host sync per step); after
``trainer.max_skipped_steps`` consecutive ones the run stops with :class:`NonFiniteStepsError`.

The training step never waits on the device: the batch's bookkeeping (epoch, position, ids) is
taken off the batch before it is moved (:meth:`on_before_batch_transfer`), and the per-t-bin
losses are summed on the device over every micro-batch and read at the logging cadence.
"""

from __future__ import annotations

import copy
import json
import math
import time

import lightning as L
import numpy as np
import torch

from flowmatch_models.model.dit import (
    DEFAULT_REPA_DIM,
    DEFAULT_TEXT_DIM,
    FlowDiT,
    build_model,
    fold_text_norm,
)
from flowmatch_models.model.flow import FlowMatching
from flowmatch_models.model.loss_terms import (
    LOSS_TERMS,
    TOTAL,
    VAL_BIN,
    VAL_LOSS,
    VAL_SAMPLES,
    bucket_loss,
)
from flowmatch_models.storage.atomic import atomic_write_text
from flowmatch_models.train import lightning_compat
from flowmatch_models.train.config import TrainConfig


class NonFiniteStepsError(RuntimeError):
    """``trainer.max_skipped_steps`` consecutive optimizer steps had non-finite gradients."""


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

    def __init__(
        self,
        config: TrainConfig,
        model: FlowDiT | None = None,
        widths: dict[str, int] | None = None,
    ):
        super().__init__()
        self.config = config
        m = config.model
        #: caption and REPA-target widths: the training shards' (ShardSource.widths)
        self.widths = {"text": DEFAULT_TEXT_DIM, "repa": DEFAULT_REPA_DIM, **(widths or {})}
        self.model = model or build_model(
            m.preset,
            repa_encoder_depth=m.repa_encoder_depth,
            projector_hidden=m.projector_hidden,
            repa=config.flow.repa_lambda > 0,  # no unused REPA head (DDP)
            pos_embed=m.pos_embed,
            init=m.init,
            qk_norm=m.qk_norm,
            fp32_attention=m.fp32_attention,
            text_dim=self.widths["text"],
            repa_dim=self.widths["repa"],
        )
        if m.gradient_checkpointing:
            self.model.transformer.enable_gradient_checkpointing()
        self.ema = copy.deepcopy(self.model.transformer).requires_grad_(False).eval()
        self.flow = FlowMatching(**config.flow.model_dump())
        self._ema_step = -1
        self._t_last: float | None = None
        self._grad_norm: torch.Tensor | None = None
        # this session's sum and count of finite gradient norms (on the device; grad_norm_mean)
        self._norm_sum: torch.Tensor | None = None
        self._norm_count: torch.Tensor | None = None
        self.batch_meta: dict = {}  # host-side bookkeeping of the current batch
        self.last_validation: dict[str, float] = {}  # the newest validation_losses()
        # device-side counters (read at the logging cadence): skipped steps, the current streak
        self._bad: torch.Tensor | None = None
        self._skipped: torch.Tensor | None = None
        self._streak: torch.Tensor | None = None
        self._streak_max: torch.Tensor | None = None
        self._streak_start: torch.Tensor | None = None
        self._skipped_before = 0  # restored from the checkpoint
        self._bin_sum: torch.Tensor | None = None
        self._bin_cnt: torch.Tensor | None = None
        #: a fine-tune's parent (run, step, digest, ...: flowmatch_models/train/finetune.py), or None
        self.parent: dict | None = None

    # ---------------------------------------------------------------------------- optimisation

    def configure_optimizers(self):
        o, max_steps = self.config.optim, self.config.trainer.max_steps
        trainable = [p for p in self.model.parameters() if p.requires_grad]  # init.freeze
        opt = torch.optim.AdamW(
            trainable,
            lr=o.lr,
            betas=o.betas,
            weight_decay=o.weight_decay,
            fused=True,  # honours found_inf: a non-finite step is skipped on the device
        )
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: lr_factor(s, o.warmup_steps, o.schedule, max_steps, o.min_lr_ratio)
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """Let the current YAML win over the optimizer/scheduler hyperparameters restored; the
        caption standardisation is the run's (from its first session; none before it existed)."""
        norm = checkpoint.get("flowmatch", {}).get("text_norm")
        width = self.model.text_shift.numel()
        if norm is None:
            norm = {"shift": torch.zeros(width), "scale": torch.ones(width)}
        self.model.text_shift.copy_(norm["shift"])
        self.model.text_scale.copy_(norm["scale"])
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
        self._skipped_before = int(checkpoint.get("flowmatch", {}).get("skipped_steps", 0))

    def on_before_optimizer_step(self, optimizer) -> None:
        """Gradient norm, clip and the skip decision, all on the device (no host sync).

        Under ``16-mixed`` the gradients arrive multiplied by the loss scale: the fused AdamW
        would divide it out in its step, so Lightning leaves them scaled. They are unscaled
        here first (``GradScaler.unscale_``: on the device, and it records the scaler's own
        non-finite check), so the norm logged, the clip and the update are the true ones; the
        scaler then skips a non-finite step itself and lowers its scale."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if not grads:
            return
        opt = lightning_compat.plain_optimizer(optimizer)
        scaler = self._grad_scaler()
        if scaler is not None:  # the fused AdamW unscales nothing after this
            scaler.unscale_(opt)
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)).float())
        bad = ~torch.isfinite(norm)
        clip = self.config.optim.grad_clip
        if clip > 0:
            scale = (clip / (norm + 1e-6)).clamp(max=1.0)
            torch._foreach_mul_(grads, torch.where(bad, torch.ones_like(scale), scale))
        if scaler is None:  # else the scaler sets it from its own check (the same gradients)
            lightning_compat.skip_step_if(opt, bad)
        self._grad_norm, self._bad = norm, bad
        if self._norm_sum is None:
            self._norm_sum = torch.zeros((), dtype=torch.float32, device=norm.device)
            self._norm_count = torch.zeros((), dtype=torch.long, device=norm.device)
        self._norm_sum += torch.where(bad, torch.zeros_like(norm), norm)
        self._norm_count += (~bad).long()
        self._count_skip(bad)

    def _grad_scaler(self) -> torch.amp.GradScaler | None:
        """The loss scaler of ``16-mixed`` (Lightning's precision plugin), else None."""
        if lightning_compat.attached_trainer(self) is None:
            return None
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        return scaler if scaler is not None and scaler.is_enabled() else None

    def _count_skip(self, bad: torch.Tensor) -> None:
        if self._skipped is None:
            zero = torch.zeros((), dtype=torch.long, device=bad.device)
            self._skipped, self._streak, self._streak_max = zero.clone(), zero.clone(), zero.clone()
            self._streak_start = zero.clone()
        b = bad.long()
        self._skipped += b
        self._streak = (self._streak + 1) * b
        self._streak_start = torch.where(
            self._streak == 1,
            torch.full_like(self._streak, self.global_step + 1),
            self._streak_start,
        )
        self._streak_max = torch.maximum(self._streak_max, self._streak)

    def grad_norm_mean(self) -> float | None:
        """The mean gradient norm (before clipping, unscaled) over this session's optimizer
        steps with finite gradients; None: no such step (a host sync: once, at the end)."""
        if self._norm_count is None or int(self._norm_count) == 0:
            return None
        return float(self._norm_sum) / int(self._norm_count)

    def skipped_steps(self) -> int:
        """Optimizer steps skipped since the run began (a host sync: at the logging cadence)."""
        return self._skipped_before + (int(self._skipped) if self._skipped is not None else 0)

    def _check_skips(self) -> None:
        """Stop after ``max_skipped_steps`` consecutive skipped steps (one sync per call)."""
        if self._streak_max is None:
            return
        limit = self.config.trainer.max_skipped_steps
        streak, start = int(self._streak_max), int(self._streak_start)
        if streak < limit:
            self._streak_max.zero_()
            return
        last = self.config.run_dir() / "checkpoints" / "last.ckpt"
        raise NonFiniteStepsError(
            f"step {self.global_step}: {streak} consecutive optimizer steps from step {start} had "
            f"non-finite gradients and were skipped (trainer.max_skipped_steps {limit}); "
            f"weights, Adam state and EMA are as at step {start - 1}; last good checkpoint: "
            f"{last if last.is_file() else 'none yet'}. Look at the data of those steps "
            "(logging.record_sample_ids) or lower optim.lr, then resume with --resume auto"
        )

    # ---------------------------------------------------------------------------- training

    def on_before_batch_transfer(self, batch: dict, dataloader_idx: int) -> dict:
        """Keep the bookkeeping on the host: only the model's tensors go to the device."""
        if "meta" in batch:
            self.batch_meta = batch.pop("meta")
        return batch

    def on_after_batch_transfer(self, batch: dict, dataloader_idx: int) -> dict:
        """Decode the stored batch where it now is (the GPU): codes -> float32 states."""
        dm = getattr(lightning_compat.attached_trainer(self), "datamodule", None)
        decode = getattr(dm, "decode_batch", None)
        return decode(batch, self.device) if decode is not None else batch

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        meta = self.batch_meta
        epoch, pos = meta.get("epoch", 0), meta.get("position", batch_idx)
        seed = _step_seed(self.config.run.seed, epoch, pos, self.global_rank)
        gen = torch.Generator(device=self.device).manual_seed(seed)
        x = batch["latents"].float()
        text = batch["text"].float()
        dino = batch.get("dino")
        out = self.flow.loss(self.model, x, text, batch["mask"], dino, generator=gen)
        b = x.shape[0]
        for term in LOSS_TERMS:
            self.log(term.logged, out[term.key], prog_bar=term.key == TOTAL, batch_size=b)
        dm = getattr(self.trainer, "datamodule", None)
        if len(getattr(getattr(dm, "source", None), "grids", ())) > 1:  # aspect-ratio buckets
            h, w = x.shape[-2:]  # one bucket a batch: its loss under the bucket's pixel size
            self.log(bucket_loss(h * 32, w * 32), out[TOTAL], batch_size=b)
        sums = out["bin_loss"].nan_to_num(0.0) * out["bin_count"]  # every micro-batch, on device
        if self._bin_sum is None:
            self._bin_sum, self._bin_cnt = torch.zeros_like(sums), torch.zeros_like(sums)
        self._bin_sum += sums
        self._bin_cnt += out["bin_count"]
        if dm is not None and hasattr(dm, "mark_consumed") and "global_batch" in meta:
            dm.mark_consumed(epoch, pos, meta["global_batch"])
        return out[TOTAL]

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
            n = self.batch_meta.get("global_batch", 0) * accum
            self.log("train/samples_per_s", n / max(now - self._t_last, 1e-9), batch_size=1)
        self._t_last = now
        self.log("train/lr", self.trainer.optimizers[0].param_groups[0]["lr"], batch_size=1)
        if self._grad_norm is not None:
            self.log("train/grad_norm", self._grad_norm, batch_size=1)
        t = self.config.trainer
        if step % t.log_every == 0 and self._bin_sum is not None:
            for i, v in enumerate(self._bin_sum / self._bin_cnt):  # NaN: no sample in the bin
                self.log(f"train_t/bin{i}", v, batch_size=1)
            self._bin_sum.zero_(), self._bin_cnt.zero_()
        if t.val_every and step % t.val_every == 0 and self.trainer.is_global_zero:
            vals = self.validation_losses()
            self.last_validation = vals or self.last_validation
            for logger in self.trainer.loggers if vals else []:  # this step only (CSV, wandb)
                logger.log_metrics(vals, step=step)
        if step % t.log_every == 0 or step % t.max_skipped_steps == 0:
            self.log("train/skipped_steps", float(self.skipped_steps()), batch_size=1)
            self._check_skips()

    @torch.no_grad()
    def validation_losses(self, chunk: int = 64) -> dict[str, float] | None:
        """Flow loss of the EMA model on the held-out samples (never trained on) at a fixed t
        grid (the centres of ``flow.n_bins`` bins, no shift) with fixed noise, without caption
        dropout: ``val/loss`` (mean over the grid) and ``val/t{k}`` per bin. The same inputs at
        every evaluation, so the curve moves only with the model. None without held-out data."""
        dm = getattr(self.trainer, "datamodule", None)
        source = getattr(dm, "source", None)
        if source is None:
            return None
        key = (id(source), self.config.trainer.val_max_samples)
        if getattr(self, "_val_key", None) != key:
            self._val_key = key
            held = source.heldout_batches(self.config.trainer.val_max_samples)
            self._val = [source.decode(b) for b in held]  # decoded on the host, once
        if not self._val:
            return None
        from flowmatch_models.model.flow import _velocity

        n_bins, dev = self.config.flow.n_bins, self.device
        gen = torch.Generator().manual_seed(20261203)  # the same noise at every evaluation
        was = self.ema.training
        self.ema.eval()
        sums, count = [0.0] * n_bins, 0
        for batch in self._val:  # one batch per bucket (latent grid)
            x = batch["latents"].float()
            noise = torch.randn((n_bins, *x.shape), generator=gen)
            for k in range(n_bins):
                t = (k + 0.5) / n_bins
                for i in range(0, len(x), chunk):
                    xb, e = x[i : i + chunk].to(dev), noise[k, i : i + chunk].to(dev)
                    text = batch["text"][i : i + chunk].float().to(dev)
                    mask = batch["mask"][i : i + chunk].to(dev)
                    tt = torch.full((len(xb),), t, device=dev)
                    text = self.model.normalize_text(text)  # the EMA transformer takes them so
                    v = _velocity(self.ema, (1 - t) * xb + t * e, tt, text, mask)
                    sums[k] += float(((v.float() - (e - xb)) ** 2).mean(dim=(1, 2, 3)).sum())
            count += len(x)
        self.ema.train(was)
        out: dict[str, float] = {f"{VAL_BIN}{k}": sums[k] / count for k in range(n_bins)}
        out[VAL_LOSS] = sum(out.values()) / n_bins
        out[VAL_SAMPLES] = float(count)
        return out

    @torch.no_grad()
    def sampling_transformer(self):
        """The EMA transformer taking raw caption states (the standardisation folded in): what
        the sample grids, the evaluation and the export run."""
        return fold_text_norm(self.ema, self.model.text_norm())

    def ema_steps(self) -> int:
        """Optimizer steps the EMA has averaged: this run's, plus its parent's for a fine-tune
        that took its parent's EMA (``init.weights=ema``: already ``parent["step"]`` steps
        old). An EMA taken from the parent's raw weights (``init.weights=raw``) has averaged
        nothing yet: its age starts at 0 (the warm-up ramp, as a new run's)."""
        p = self.parent
        old = int(p["step"]) if p and p.get("weights", "ema") == "ema" else 0
        return int(self.global_step) + old

    def update_ema(self) -> None:
        """``ema = d ema + (1 - d) w`` with ``d = min(decay, (1 + n) / (10 + n))``, ``n`` the
        EMA's age (:meth:`ema_steps`): the warm-up ramp keeps a young EMA from averaging in its
        random start; a fine-tune's continues its parent's instead of restarting (which put
        ~90% of the fine-tune's first weights into it). A skipped step (non-finite gradients)
        weighs 0, on the device."""
        n = self.ema_steps()
        d = min(self.config.optim.ema_decay, (1 + n) / (10 + n))
        ema = list(self.ema.parameters())
        src = [p.detach() for p in self.model.transformer.parameters()]
        if self._bad is None:
            torch._foreach_lerp_(ema, src, 1 - d)
            return
        w = (1 - d) * (~self._bad).to(ema[0].dtype)
        torch._foreach_lerp_(ema, src, [w] * len(ema))

    # ---------------------------------------------------------------------------- checkpoints

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        dm = getattr(self.trainer, "datamodule", None)
        info = {
            "preset": self.config.model.preset,
            "step": int(self.global_step),
            "flow_shift": self.config.flow.sample_shift,  # the sampler's (the old single shift)
            "skipped_steps": self.skipped_steps(),
            "encoders": {"vae": self.config.encoders.vae, "text": self.config.encoders.text},
            "max_tokens": self.config.encoders.max_tokens,  # export_format.prompt_max_tokens
            "widths": dict(self.widths),
            "text_norm": self.model.text_norm(),  # folded into the EMA for sampling / export
        }
        if self.parent:
            info["parent"] = dict(self.parent)  # a fine-tune's parent (finetune.py)
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
