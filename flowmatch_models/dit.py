"""The denoiser: a narrowed SANA DiT (diffusers ``SanaTransformer2DModel``) plus a REPA head.

The transformer sees DC-AE latents ``[B, 32, 8, 8]`` as 64 tokens (patch size 1) plus a sin-cos
positional embedding (Sana's 256 px config sets ``use_pe``; on an 8x8 grid the Mix-FFN conv alone
carries too little position, see BENCHMARKS.md "Learning") and attends to Gemma3 caption hidden
states ``[B, L, 640]``. Weights are initialised as Sana does (:func:`sana_init_`).

REPA (Yu et al. 2024) aligns the output of block ``encoder_depth`` (counted from 1, as REPA's
``--encoder-depth``: index ``encoder_depth - 1``) with frozen DINOv2 patch features through a
small MLP; SANA does not return intermediate states, so a forward hook captures them (also under
gradient checkpointing). With REPA off no hook and no projector exist (DDP requires every
registered parameter to get a gradient).

Presets are plain ``name -> factory`` entries (DiT-style), each returning the
``SanaTransformer2DModel`` config for that size.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from diffusers import SanaTransformer2DModel
from torch import nn

LATENT_CHANNELS = 32
LATENT_SIZE = 8
TEXT_DIM = 640  # Gemma3-270M hidden size
DINO_DIM = 384  # DINOv2-small


# --------------------------------------------------------------------------------------------
# presets
# --------------------------------------------------------------------------------------------


def _sana_config(layers: int, heads: int, head_dim: int, cross_heads: int) -> dict:
    width = heads * head_dim
    return dict(
        in_channels=LATENT_CHANNELS,
        out_channels=LATENT_CHANNELS,
        num_attention_heads=heads,
        attention_head_dim=head_dim,
        num_layers=layers,
        num_cross_attention_heads=cross_heads,
        cross_attention_head_dim=width // cross_heads,
        cross_attention_dim=width,
        caption_channels=TEXT_DIM,
        mlp_ratio=2.5,
        sample_size=LATENT_SIZE,
        patch_size=1,
        interpolation_scale=1,  # sin-cos PE on the 8x8 grid (None: no PE, Sana 1.0 at 1024 px)
    )


def DiT_tiny() -> dict:
    """4 layers, width 64: CPU tests and the demo (forward ~25 ms on one core)."""
    return _sana_config(layers=4, heads=4, head_dim=16, cross_heads=4)


def DiT_demo() -> dict:
    """6 layers, width 128 (~2M): the demo's CPU run, big enough to draw the sample's shapes."""
    return _sana_config(layers=6, heads=4, head_dim=32, cross_heads=4)


def DiT_small() -> dict:
    """12 layers, width 384 (~35M): quick single-GPU experiments."""
    return _sana_config(layers=12, heads=12, head_dim=32, cross_heads=6)


def DiT_base() -> dict:
    """20 layers, width 768 (~190M): the real 256 px run (configs/base.yaml; cost in BENCHMARKS.md)."""
    return _sana_config(layers=20, heads=24, head_dim=32, cross_heads=12)


PRESETS: dict[str, Callable[[], dict]] = {
    "tiny": DiT_tiny,
    "demo": DiT_demo,
    "small": DiT_small,
    "base": DiT_base,
}

#: REPA projector hidden width per preset (the paper's 2048 except for the CPU-sized model).
PROJECTOR_HIDDEN: dict[str, int] = {"tiny": 256, "demo": 512, "small": 2048, "base": 2048}

#: REPA ``encoder_depth`` per preset: the block (counted from 1) whose output is aligned. REPA
#: uses 4 for its 12-layer SiT-B and 8 for 24/28 layers (about a third of the depth).
REPA_ENCODER_DEPTH: dict[str, int] = {"tiny": 2, "demo": 2, "small": 4, "base": 7}


def transformer_config(preset: str, **overrides) -> dict:
    """The ``SanaTransformer2DModel`` config of ``preset`` with ``overrides`` applied."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose one of {sorted(PRESETS)}")
    return {**PRESETS[preset](), **overrides}


# --------------------------------------------------------------------------------------------
# REPA head + wrapper
# --------------------------------------------------------------------------------------------


class REPAProjector(nn.Module):
    """MLP ``hidden -> h -> h -> 384`` with SiLU, mapping DiT tokens to DINOv2 feature space."""

    def __init__(self, in_dim: int, hidden: int = 2048, out_dim: int = DINO_DIM):
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


class FlowDiT(nn.Module):
    """``SanaTransformer2DModel`` + REPA projector on the output of block ``encoder_depth``.

    ``forward(x_t, t, text, mask)`` takes ``t`` in [0, 1] (SANA wants 0-1000) and returns the
    predicted velocity and, when ``return_repa`` is set, the projected block tokens
    ``[B, 64, 384]``. ``encoder_depth=None`` builds no REPA head at all.
    """

    def __init__(
        self,
        transformer: SanaTransformer2DModel,
        encoder_depth: int | None = None,
        projector_hidden: int = 2048,
    ):
        super().__init__()
        self.transformer = transformer
        depth = len(transformer.transformer_blocks)
        self.encoder_depth = encoder_depth
        self.projector: REPAProjector | None = None
        self._captured: torch.Tensor | None = None
        if encoder_depth is None:
            return
        if not 1 <= int(encoder_depth) <= depth:
            raise ValueError(
                f"model.repa_encoder_depth {encoder_depth} outside 1..{depth} (the model's blocks, "
                "counted from 1 as in REPA)"
            )
        width = transformer.config.num_attention_heads * transformer.config.attention_head_dim
        self.projector = REPAProjector(width, projector_hidden)
        transformer.transformer_blocks[int(encoder_depth) - 1].register_forward_hook(self._capture)

    def _capture(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        self._captured = output

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
        self._captured = None
        v = self.transformer(
            hidden_states=x_t,
            encoder_hidden_states=text,
            timestep=t * 1000.0,
            encoder_attention_mask=mask,
            return_dict=False,
        )[0]
        h = self._captured
        self._captured = None
        return v, (self.projector(h) if return_repa else None)


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
    **overrides,
) -> FlowDiT:
    """A freshly initialised :class:`FlowDiT` of the named preset.

    ``repa=False`` builds no REPA head; ``repa_encoder_depth`` defaults to the preset's
    (:data:`REPA_ENCODER_DEPTH`). ``pos_embed=False`` drops the sin-cos PE. ``init`` is
    ``"sana"`` (:func:`sana_init_`) or ``"default"`` (PyTorch's layer defaults).
    """
    if not pos_embed:
        overrides = {**overrides, "interpolation_scale": None}
    transformer = SanaTransformer2DModel(**transformer_config(preset, **overrides))
    if init == "sana":
        sana_init_(transformer)
    elif init != "default":
        raise ValueError(f"model.init {init!r}: use 'sana' or 'default'")
    depth = None
    if repa:
        depth = repa_encoder_depth or REPA_ENCODER_DEPTH.get(
            preset, max(1, len(transformer.transformer_blocks) // 3)
        )
    hidden = projector_hidden or PROJECTOR_HIDDEN.get(preset, 2048)
    return FlowDiT(transformer, encoder_depth=depth, projector_hidden=hidden)


def count_params(module: nn.Module) -> int:
    """Number of parameters of ``module``."""
    return sum(p.numel() for p in module.parameters())
