"""The denoiser: a narrowed SANA DiT (diffusers ``SanaTransformer2DModel``) plus a REPA head.

The transformer sees DC-AE latents ``[B, 32, 8, 8]`` as 64 tokens (patch size 1) plus a sin-cos
positional embedding (Sana's 256 px config sets ``use_pe``; on an 8x8 grid the Mix-FFN conv alone
carries too little position, see BENCHMARKS.md "Learning") and attends to Gemma3 caption hidden
states ``[B, L, 640]``. Weights are initialised as Sana does (:func:`sana_init_`).

REPA (Yu et al. 2024) aligns the output of block ``encoder_depth`` (counted from 1, as REPA's
``--encoder-depth``: index ``encoder_depth - 1``) with frozen DINOv2 patch features through a
small MLP. SANA's forward returns no intermediate states, so :meth:`FlowDiT.forward` runs the
transformer's own modules in the same order as ``SanaTransformer2DModel.forward`` and returns
block ``k``'s output explicitly (no hook writing to the module from inside a compiled region:
``torch.compile`` traces it without graph breaks). With REPA off no projector exists (DDP
requires every registered parameter to get a gradient).

Stability at 256 px as SANA's config: ``qk_norm`` (RMSNorm of queries and keys across heads,
Sana 1.5's ``rms_norm_across_heads``) and the linear attention's two matmuls in fp32 with
autocast off (:class:`FP32LinearAttnProcessor`, SANA's ``LiteLA.attn_matmul``: "necessary for
NAN loss"; the diffusers processor's ``.float()`` is re-cast to bf16 by autocast).

A preset is one :class:`Preset` record per size (transformer shape, REPA projector width and
depth). The caption width and the REPA target width are not the preset's: they are the widths
of the arrays the run trains on (Gemma3-270M: 640, MiniLM-L6: 384; DINOv2-small: 384).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from diffusers import SanaTransformer2DModel
from diffusers.models.attention_processor import SanaLinearAttnProcessor2_0
from torch import nn

LATENT_CHANNELS = 32
LATENT_SIZE = 8
#: The widths of the default encoders' arrays (Gemma3-270M hidden 640, DINOv2-small 384): only
#: defaults for code that builds a model without data. A training run takes both from the shards
#: it trains on (``ShardSource.widths``: the registry's caption and REPA-target arrays) and
#: records them in the checkpoint (``flowmatch.widths``) and the export's ``flowmatch.json``.
DEFAULT_TEXT_DIM = 640
DEFAULT_REPA_DIM = 384
SANA_TIMESTEP_SCALE = 1000.0  # SanaTransformer2DModel takes t on a 0-1000 scale


def sana_timestep(t: torch.Tensor) -> torch.Tensor:
    """Flow time ``t`` in [0, 1] as the ``timestep`` SANA expects (0-1000)."""
    return t * SANA_TIMESTEP_SCALE


# --------------------------------------------------------------------------------------------
# presets: one record per size
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Preset:
    """Everything one model size fixes: the transformer's shape and its REPA head."""

    layers: int
    heads: int
    head_dim: int
    cross_heads: int
    #: REPA projector hidden width (the paper's 2048 except for the CPU-sized models)
    projector_hidden: int
    #: REPA ``encoder_depth``: the block (counted from 1) whose output is aligned; REPA uses 4
    #: for its 12-layer SiT-B and 8 for 24/28 layers (about a third of the depth)
    repa_depth: int
    about: str = ""

    @property
    def width(self) -> int:
        return self.heads * self.head_dim

    def transformer_config(self, text_dim: int = DEFAULT_TEXT_DIM) -> dict:
        """The ``SanaTransformer2DModel`` config for captions of width ``text_dim``."""
        return dict(
            in_channels=LATENT_CHANNELS,
            out_channels=LATENT_CHANNELS,
            num_attention_heads=self.heads,
            attention_head_dim=self.head_dim,
            num_layers=self.layers,
            num_cross_attention_heads=self.cross_heads,
            cross_attention_head_dim=self.width // self.cross_heads,
            cross_attention_dim=self.width,
            caption_channels=int(text_dim),
            mlp_ratio=2.5,
            sample_size=LATENT_SIZE,
            patch_size=1,
            interpolation_scale=1,  # sin-cos PE on the 8x8 grid (None: no PE, Sana 1.0 at 1024 px)
        )


PRESETS: dict[str, Preset] = {
    "tiny": Preset(4, 4, 16, 4, 256, 2, "width 64: CPU tests (forward ~25 ms on one core)"),
    "demo": Preset(6, 4, 32, 4, 512, 2, "width 128 (~2M): the demo, big enough for its shapes"),
    "small": Preset(12, 12, 32, 6, 2048, 4, "width 384 (~35M): quick single-GPU experiments"),
    "base": Preset(20, 24, 32, 12, 2048, 7, "width 768 (~190M): the real 256 px run"),
}


def preset_of(name: str) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]


def transformer_config(preset: str, text_dim: int = DEFAULT_TEXT_DIM, **overrides) -> dict:
    """The ``SanaTransformer2DModel`` config of ``preset`` with ``overrides`` applied."""
    return {**preset_of(preset).transformer_config(text_dim), **overrides}


# --------------------------------------------------------------------------------------------
# REPA head + wrapper
# --------------------------------------------------------------------------------------------


class REPAProjector(nn.Module):
    """MLP ``hidden -> h -> h -> D`` with SiLU, mapping DiT tokens to the REPA target's feature
    space (``D``: the target's width, 384 for DINOv2-small)."""

    def __init__(self, in_dim: int, hidden: int = 2048, out_dim: int = DEFAULT_REPA_DIM):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(in_dim, hidden),
            nn.SiLU(),
            nn.Linear(hidden, hidden),
            nn.SiLU(),
            nn.Linear(hidden, out_dim),
        )

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.net(h)


class FP32LinearAttnProcessor(SanaLinearAttnProcessor2_0):
    """SANA's linear self-attention with its two matmuls in fp32 and autocast off (SANA's
    ``LiteLA.attn_matmul``); projections stay in the autocast dtype. Same maths as diffusers'
    ``SanaLinearAttnProcessor2_0``, which only casts to fp32 (undone by autocast)."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None):
        dtype = hidden_states.dtype
        kv = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        query, key, value = attn.to_q(hidden_states), attn.to_k(kv), attn.to_v(kv)
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        query = F.relu(query.transpose(1, 2).unflatten(1, (attn.heads, -1)))
        key = F.relu(key.transpose(1, 2).unflatten(1, (attn.heads, -1)).transpose(2, 3))
        value = value.transpose(1, 2).unflatten(1, (attn.heads, -1))
        with torch.autocast(device_type=hidden_states.device.type, enabled=False):
            value = F.pad(value.float(), (0, 0, 0, 1), mode="constant", value=1.0)
            out = torch.matmul(torch.matmul(value, key.float()), query.float())
            out = out[:, :, :-1] / (out[:, :, -1:] + 1e-15)
        out = out.flatten(1, 2).transpose(1, 2).to(dtype)
        out = attn.to_out[1](attn.to_out[0](out))
        if dtype == torch.float16:
            out = out.clip(-65504, 65504)
        return out


def use_fp32_attention(transformer: SanaTransformer2DModel) -> None:
    """Every block's linear self-attention through :class:`FP32LinearAttnProcessor`."""
    for block in transformer.transformer_blocks:
        block.attn1.set_processor(FP32LinearAttnProcessor())


class FlowDiT(nn.Module):
    """``SanaTransformer2DModel`` + REPA projector on the output of block ``encoder_depth``.

    ``forward(x_t, t, text, mask)`` takes ``t`` in [0, 1] (SANA wants 0-1000) and returns the
    predicted velocity and, when ``return_repa`` is set, the projected block tokens
    ``[B, 64, 384]``. ``encoder_depth=None`` builds no REPA head at all. The velocity equals
    ``transformer(...)``'s exactly (tested): the forward is SANA's, block by block.
    """

    def __init__(
        self,
        transformer: SanaTransformer2DModel,
        encoder_depth: int | None = None,
        projector_hidden: int = 2048,
        repa_dim: int = DEFAULT_REPA_DIM,
    ):
        super().__init__()
        self.transformer = transformer
        # per-channel standardisation of the caption states, (text - shift) * scale: identity
        # until set_text_stats; not in the state dict (the checkpoint's ``flowmatch.text_norm``
        # carries it), folded into caption_projection.linear_1 for sampling and export
        width = int(transformer.config.caption_channels)
        self.register_buffer("text_shift", torch.zeros(width), persistent=False)
        self.register_buffer("text_scale", torch.ones(width), persistent=False)
        depth = len(transformer.transformer_blocks)
        self.encoder_depth = encoder_depth
        self.projector: REPAProjector | None = None
        if encoder_depth is None:
            return
        if not 1 <= int(encoder_depth) <= depth:
            raise ValueError(
                f"model.repa_encoder_depth {encoder_depth} outside 1..{depth} (the model's blocks, "
                "counted from 1 as in REPA)"
            )
        width = transformer.config.num_attention_heads * transformer.config.attention_head_dim
        self.projector = REPAProjector(width, projector_hidden, int(repa_dim))

    def set_text_stats(self, mean: torch.Tensor, std: torch.Tensor, floor: float = 1e-2) -> None:
        """Standardise caption states with these per-channel statistics from now on."""
        self.text_shift.copy_(mean.to(self.text_shift))
        self.text_scale.copy_(1.0 / std.to(self.text_scale).clamp_min(floor))

    def text_norm(self) -> dict[str, torch.Tensor]:
        """The caption standardisation as tensors (``shift``, ``scale``), for the checkpoint."""
        return {"shift": self.text_shift.detach().cpu(), "scale": self.text_scale.detach().cpu()}

    def normalize_text(self, text: torch.Tensor) -> torch.Tensor:
        return (text - self.text_shift.to(text.dtype)) * self.text_scale.to(text.dtype)

    def forward(
        self,
        x_t: torch.Tensor,
        t: torch.Tensor,
        text: torch.Tensor,
        mask: torch.Tensor | None = None,
        return_repa: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if return_repa and self.projector is None:
            raise ValueError("this model was built without a REPA head (repa_encoder_depth null)")
        tr = self.transformer
        b, _, height, width = x_t.shape
        p = tr.config.patch_size
        hp, wp = height // p, width // p
        bias = None
        if mask is not None:  # keep = 0, pad = -10000, as SANA's forward
            bias = ((1 - mask.to(x_t.dtype)) * -10000.0).unsqueeze(1)
        text = self.normalize_text(text)
        h = tr.patch_embed(x_t)
        temb, embedded_t = tr.time_embed(sana_timestep(t), batch_size=b, hidden_dtype=h.dtype)
        cap = tr.caption_norm(tr.caption_projection(text).view(b, -1, h.shape[-1]))
        checkpointing = torch.is_grad_enabled() and tr.gradient_checkpointing
        repa_h = None
        for i, block in enumerate(tr.transformer_blocks):
            args = (h, None, cap, bias, temb, hp, wp)
            h = tr._gradient_checkpointing_func(block, *args) if checkpointing else block(*args)
            if i + 1 == self.encoder_depth:
                repa_h = h
        h = tr.proj_out(tr.norm_out(h, embedded_t, tr.scale_shift_table))
        h = h.reshape(b, hp, wp, p, p, -1).permute(0, 5, 1, 3, 2, 4)
        v = h.reshape(b, -1, hp * p, wp * p)
        return v, (self.projector(repa_h) if return_repa else None)


@torch.no_grad()
def fold_text_norm(
    transformer: SanaTransformer2DModel, norm: dict[str, torch.Tensor] | None
) -> SanaTransformer2DModel:
    """A copy of ``transformer`` that takes raw caption states: the standardisation
    ``(x - shift) * scale`` folded into ``caption_projection.linear_1`` (``W' = W diag(scale)``,
    ``b' = b - W' shift``), so that a plain ``SanaTransformer2DModel`` (an export, SanaPipeline)
    computes exactly what the training model computes. ``norm`` None: ``transformer`` itself."""
    if norm is None:
        return transformer
    out = copy.deepcopy(transformer)
    lin = out.caption_projection.linear_1
    w = lin.weight.float() * norm["scale"].to(lin.weight.device).float()[None, :]
    lin.bias.copy_(lin.bias.float() - w @ norm["shift"].to(lin.weight.device).float())
    lin.weight.copy_(w)
    return out


# --------------------------------------------------------------------------------------------
# initialisation (as Sana's ``initialize_weights``)
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def sana_init_(transformer: SanaTransformer2DModel, caption_norm_scale: float = 0.01) -> None:
    """Sana's initialisation, in place: xavier-uniform linears (zero bias), the patch embedding
    like a linear, N(0, 0.02) for the timestep and caption MLPs, the caption RMSNorm weight at
    ``caption_norm_scale`` (Sana's ``y_norm_scale_factor``: Gemma states are large), and
    zero-initialised cross-attention outputs and output projection (the network starts as the
    identity on its residual stream and predicts 0)."""
    for m in transformer.modules():
        if isinstance(m, nn.Linear):
            nn.init.xavier_uniform_(m.weight)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
    w = transformer.patch_embed.proj.weight
    nn.init.xavier_uniform_(w.view(w.shape[0], -1))
    te = transformer.time_embed
    nn.init.normal_(te.emb.timestep_embedder.linear_1.weight, std=0.02)
    nn.init.normal_(te.emb.timestep_embedder.linear_2.weight, std=0.02)
    nn.init.normal_(te.linear.weight, std=0.02)
    nn.init.normal_(transformer.caption_projection.linear_1.weight, std=0.02)
    nn.init.normal_(transformer.caption_projection.linear_2.weight, std=0.02)
    transformer.caption_norm.weight.fill_(caption_norm_scale)
    for block in transformer.transformer_blocks:
        nn.init.zeros_(block.attn2.to_out[0].weight)
        nn.init.zeros_(block.attn2.to_out[0].bias)
    nn.init.zeros_(transformer.proj_out.weight)
    nn.init.zeros_(transformer.proj_out.bias)


def build_model(
    preset: str = "tiny",
    repa_encoder_depth: int | None = None,
    projector_hidden: int | None = None,
    repa: bool = True,
    pos_embed: bool = True,
    init: str = "sana",
    qk_norm: bool = False,
    fp32_attention: bool = False,
    text_dim: int = DEFAULT_TEXT_DIM,
    repa_dim: int = DEFAULT_REPA_DIM,
    **overrides,
) -> FlowDiT:
    """A freshly initialised :class:`FlowDiT` of the named preset.

    ``repa=False`` builds no REPA head; ``repa_encoder_depth`` defaults to the preset's
    (:class:`Preset`). ``text_dim``/``repa_dim``: the widths of the caption states and of the
    REPA target (a run passes its shards'). ``pos_embed=False`` drops the sin-cos PE. ``init`` is
    ``"sana"`` (:func:`sana_init_`) or ``"default"`` (PyTorch's layer defaults). ``qk_norm``
    adds RMSNorm on queries and keys (across heads, Sana 1.5); ``fp32_attention`` runs the
    linear attention's matmuls in fp32 with autocast off (:class:`FP32LinearAttnProcessor`).
    """
    if not pos_embed:
        overrides = {**overrides, "interpolation_scale": None}
    if qk_norm:
        overrides = {**overrides, "qk_norm": "rms_norm_across_heads"}
    record = preset_of(preset)
    transformer = SanaTransformer2DModel(**transformer_config(preset, text_dim, **overrides))
    if fp32_attention:
        use_fp32_attention(transformer)
    if init == "sana":
        sana_init_(transformer)
    elif init != "default":
        raise ValueError(f"model.init {init!r}: use 'sana' or 'default'")
    depth = None
    if repa:
        depth = repa_encoder_depth or record.repa_depth
    hidden = projector_hidden or record.projector_hidden
    return FlowDiT(transformer, encoder_depth=depth, projector_hidden=hidden, repa_dim=repa_dim)


def count_params(module: nn.Module) -> int:
    """Number of parameters of ``module``."""
    return sum(p.numel() for p in module.parameters())
