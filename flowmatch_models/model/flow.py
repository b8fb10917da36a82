"""Rectified flow / flow matching with REPA, minRF-style: one class, two verbs.

    x_t = (1 - t) x + t e,   e ~ N(0, I),   target v = e - x,   t ~ shift(T_SAMPLERS[t_sampling])
    loss = |v_theta(x_t, t, c) - v|^2  +  lambda * mean_tokens(-cos(proj(h_k), dino))

Timestep sampling is chosen by name (``t_sampling``, one function each in ``T_SAMPLERS``, as in
diffusers' ``compute_density_for_timestep_sampling``): ``logit_normal`` (SD3's
``sigmoid(N(t_mean, t_std))``, the default), ``uniform``, and SD3's ``mode``
(``t = 1 - u - mode_scale (cos^2(pi u / 2) - 1 + u)``, u uniform: SD3 paper eq. 20). Then
``train_shift`` (SD3's ``s t / (1 + (s - 1) t)``) moves the drawn t; ``sample_shift`` spaces the
sampler's time grid (the exported scheduler's ``shift``). Both were one key, ``shift``, which
old configs may still use: it sets both.

Sampling integrates dx/dt = v from t = 1 (noise) to t = 0 (data) with Euler steps and
classifier-free guidance ``v = v_null + s (v_cond - v_null)``.

Null caption (for CFG): the text encoder's hidden states of the empty prompt (for Gemma: the BOS
token), which is what SanaPipeline feeds as its default negative prompt. The embedding step
stores it once per text encoder in every text_embeddings shard (array ``null_tokens``); caption
dropout replaces a caption by exactly this, and sampling uses it as the unconditional input.
Without a stored one (shards from before it was stored) a single all-zero token stands in.
Latents are in scaled space (``latents * scaling_factor``, unit-ish variance) throughout.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, get_args

import torch
import torch.nn.functional as F
from diffusers import SanaTransformer2DModel

from flowmatch_models.model.dit import DEFAULT_TEXT_DIM, FlowDiT, sana_timestep
from flowmatch_models.model.flow_settings import FlowSettings, TSampling
from flowmatch_models.model.loss_terms import FM, REPA, TOTAL


def null_caption(
    batch: int,
    text_dim: int = DEFAULT_TEXT_DIM,
    device: torch.device | str = "cpu",
    tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The unconditional caption ``(text [B, L0, D], mask ones [B, L0])``: the encoded empty
    prompt ``tokens [L0, D]`` repeated, or one all-zero token when ``tokens`` is None."""
    if tokens is None:
        tokens = torch.zeros(1, text_dim)
    text = tokens.to(device=device, dtype=torch.float32)[None].expand(batch, -1, -1).clone()
    return text, torch.ones(batch, tokens.shape[0], dtype=torch.bool, device=device)


def shift_t(t: torch.Tensor, shift: float) -> torch.Tensor:
    """SD3 timestep shift ``s t / (1 + (s - 1) t)``; ``shift > 1`` moves mass toward noise."""
    return shift * t / (1 + (shift - 1) * t)


def logit_normal(fm: FlowMatching, n: int, generator, device) -> torch.Tensor:
    """SD3's logit-normal ``sigmoid(N(t_mean, t_std))`` (``rf/lognorm(t_mean, t_std)``)."""
    z = torch.randn(n, generator=generator, device=device) * fm.t_std + fm.t_mean
    return torch.sigmoid(z)


def uniform(fm: FlowMatching, n: int, generator, device) -> torch.Tensor:
    """``t ~ U[0, 1)``: every noise level equally often (minRF, plain rectified flow)."""
    return torch.rand(n, generator=generator, device=device)


def mode(fm: FlowMatching, n: int, generator, device) -> torch.Tensor:
    """SD3's mode sampling (paper eq. 20): ``f_mode(u; s) = 1 - u - s (cos^2(pi u / 2) - 1 + u)``
    for ``u ~ U[0, 1)``, ``s = mode_scale``; s = 0 is uniform, s > 0 puts mass on the middle
    (``mode_scale`` 1.29 is the paper's ``rf/mode(1.29)``). Defined for -1 <= s <= 2 / (pi - 2)."""
    u = torch.rand(n, generator=generator, device=device)
    return 1 - u - fm.mode_scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)


#: Timestep sampling by name (``flow.t_sampling``): t in [0, 1] before ``train_shift``. A new
#: schedule is one function here, its name in ``TSampling`` and its parameters (if any) as
#: ``FlowSettings`` fields, both in ``flowmatch_models/model/flow_settings.py``.
T_SAMPLERS: dict[str, Callable[[FlowMatching, int, Any, Any], torch.Tensor]] = {
    "logit_normal": logit_normal,
    "uniform": uniform,
    "mode": mode,
}


if set(T_SAMPLERS) != set(get_args(TSampling)):  # the config's names (flow_settings.py)
    raise ImportError(f"T_SAMPLERS {sorted(T_SAMPLERS)} != TSampling {get_args(TSampling)}")


@dataclass
class FlowMatching(FlowSettings):
    """Flow-matching loss (``loss``) and Euler CFG sampler (``sample``) for a :class:`FlowDiT`.

    Its knobs are :class:`FlowSettings`' fields, which are also the training config's ``flow``
    section; ``null_text`` is set by the run, not configured.
    """

    null_text: torch.Tensor | None = None  # encoded empty prompt [L0, D]; None: a zero token

    def __post_init__(self) -> None:
        if self.t_sampling not in T_SAMPLERS:
            raise ValueError(f"unknown t_sampling {self.t_sampling!r}; known: {sorted(T_SAMPLERS)}")

    def sample_t(self, n: int, generator: torch.Generator | None = None, device="cpu"):
        """``t`` by ``t_sampling``, then SD3's ``train_shift``."""
        return shift_t(T_SAMPLERS[self.t_sampling](self, n, generator, device), self.train_shift)

    def drop_captions(
        self,
        text: torch.Tensor,
        mask: torch.Tensor,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Replace a ``caption_dropout`` fraction of captions by the null caption."""
        if self.caption_dropout <= 0:
            return text, mask
        drop = torch.rand(text.shape[0], generator=generator, device=text.device)
        drop = drop < self.caption_dropout
        null_text, null_mask = null_caption(
            text.shape[0], text.shape[-1], text.device, self.null_text
        )
        width = max(text.shape[1], null_text.shape[1])
        text, mask = _pad_to(text, width), _pad_to(mask, width)
        null_text, null_mask = _pad_to(null_text.to(text.dtype), width), _pad_to(null_mask, width)
        text = torch.where(drop[:, None, None], null_text, text)
        mask = torch.where(drop[:, None], null_mask, mask)
        return text, mask

    def loss(
        self,
        model: FlowDiT,
        x: torch.Tensor,
        text: torch.Tensor,
        mask: torch.Tensor,
        dino: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> dict[str, torch.Tensor]:
        """Loss terms for clean scaled latents ``x [B, 32, 8, 8]``.

        Returns ``loss`` (total), ``fm``, ``repa`` (0 when ``repa_lambda`` is 0 or no ``dino``),
        ``bin_loss [n_bins]`` (mean FM loss per t-bin, NaN if empty) and ``bin_count``.
        All randomness (t, noise, dropout) comes from ``generator`` for reproducibility.
        """
        b = x.shape[0]
        t = self.sample_t(b, generator, x.device).to(x.dtype)
        e = torch.randn(x.shape, generator=generator, device=x.device, dtype=x.dtype)
        text, mask = self.drop_captions(text, mask, generator)
        texp = t.view(b, 1, 1, 1)
        x_t = (1 - texp) * x + texp * e
        use_repa = self.repa_lambda > 0 and dino is not None
        v, z = model(x_t, t, text, mask, return_repa=use_repa)
        per_sample = ((v.float() - (e - x).float()) ** 2).mean(dim=(1, 2, 3))
        fm = per_sample.mean()
        if use_repa:
            repa = -F.cosine_similarity(z.float(), dino.float(), dim=-1).mean()
            total = fm + self.repa_lambda * repa
        else:
            repa = torch.zeros((), device=x.device)
            total = fm
        with torch.no_grad():
            idx = (t.float() * self.n_bins).long().clamp_(0, self.n_bins - 1)
            count = torch.bincount(idx, minlength=self.n_bins).float()
            sums = torch.zeros(self.n_bins, device=x.device).index_add_(0, idx, per_sample.detach())
            bin_loss = sums / count.clamp(min=1)
            bin_loss[count == 0] = float("nan")
        return {TOTAL: total, FM: fm, REPA: repa, "bin_loss": bin_loss, "bin_count": count}

    @torch.no_grad()
    def sample(
        self,
        model: FlowDiT,
        text: torch.Tensor,
        mask: torch.Tensor,
        steps: int = 50,
        cfg_scale: float = 4.0,
        generator: torch.Generator | None = None,
        noise: torch.Tensor | None = None,
        latent_size: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """Scaled latents ``[B, 32, h, w]`` (default the model's square, 8 x 8) for captions
        ``text [B, L, D]`` (see :func:`sample`)."""
        null = null_caption(text.shape[0], text.shape[-1], text.device, self.null_text)
        return sample(
            model,
            text,
            mask,
            null,
            steps,
            cfg_scale,
            generator,
            noise,
            self.sample_shift,
            latent_size,
        )


@torch.no_grad()
def sample(
    model: FlowDiT | SanaTransformer2DModel,
    cond: torch.Tensor,
    mask: torch.Tensor,
    null_cond: tuple[torch.Tensor, torch.Tensor] | None = None,
    steps: int = 50,
    cfg_scale: float = 4.0,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
    shift: float = 1.0,
    latent_size: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Euler integration of ``dx/dt = v`` from ``t = 1`` to ``0`` with classifier-free guidance.

    ``null_cond`` is ``(text [B, L0, D], mask [B, L0])`` (see :func:`null_caption`; pass the
    encoded empty prompt the model was trained with); default one all-zero token.
    ``cfg_scale = 1`` disables guidance (one forward per step). ``shift`` spaces the time grid
    like training (SD3 shift); the grid is :func:`sampling_sigmas`, the exported pipeline's
    scheduler's, so this sampler and ``SanaPipeline`` take the same steps. ``latent_size``
    ``(h, w)``: the latent grid to draw (an aspect-ratio bucket's, e.g. 7 x 10 for 224 x 320
    pixels; the sin-cos PE and the Mix-FFN take any grid); default the model's square. Returns
    scaled latents.
    """
    b, device = cond.shape[0], cond.device
    cfg = model.transformer.config if isinstance(model, FlowDiT) else model.config
    lh, lw = latent_size or (cfg.sample_size, cfg.sample_size)
    shape = (b, cfg.in_channels, lh, lw)
    if noise is not None and latent_size is not None and tuple(noise.shape[-2:]) != (lh, lw):
        raise ValueError(f"noise of grid {tuple(noise.shape[-2:])} for latent_size {(lh, lw)}")
    x = noise if noise is not None else torch.randn(shape, generator=generator, device=device)
    x = x.to(device=device, dtype=cond.dtype)
    if cfg_scale != 1.0:
        null_text, null_mask = (
            null_cond if null_cond is not None else null_caption(b, cond.shape[-1])
        )
        null_text = null_text.to(device=device, dtype=cond.dtype)
        null_mask = null_mask.to(device)
        width = max(cond.shape[1], null_text.shape[1])
        text = torch.cat([_pad_to(cond, width), _pad_to(null_text, width)])
        tmask = torch.cat([_pad_to(mask, width), _pad_to(null_mask, width)])
    ts = sampling_sigmas(steps, shift).to(device)
    for i in range(steps):
        t, dt = ts[i], ts[i + 1] - ts[i]
        if cfg_scale == 1.0:
            v = _velocity(model, x, t.expand(b).to(x.dtype), cond, mask)
        else:
            v2 = _velocity(model, torch.cat([x, x]), t.expand(2 * b).to(x.dtype), text, tmask)
            v_c, v_u = v2.chunk(2)
            v = v_u + cfg_scale * (v_c - v_u)
        x = x + dt * v
    return x


def sampling_sigmas(steps: int, shift: float = 1.0) -> torch.Tensor:
    """The ``steps + 1`` times (1 -> 0) of diffusers' ``FlowMatchEulerDiscreteScheduler(shift=
    shift)`` after ``set_timesteps(steps)``: the scheduler the export ships (one definition)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    scheduler.set_timesteps(steps)
    return scheduler.sigmas.float()


def _velocity(model, x: torch.Tensor, t: torch.Tensor, text: torch.Tensor, mask: torch.Tensor):
    """Velocity from a :class:`FlowDiT` or a bare ``SanaTransformer2DModel`` (e.g. the EMA)."""
    if isinstance(model, FlowDiT):
        return model(x, t, text, mask)[0]
    return model(
        hidden_states=x,
        encoder_hidden_states=text,
        timestep=sana_timestep(t),
        encoder_attention_mask=mask,
        return_dict=False,
    )[0]


def _pad_to(a: torch.Tensor, length: int) -> torch.Tensor:
    """Zero-pad dim 1 of ``a`` to ``length`` (masks pad with False)."""
    if a.shape[1] == length:
        return a
    pad = a.new_zeros((a.shape[0], length - a.shape[1], *a.shape[2:]))
    return torch.cat([a, pad], dim=1)
