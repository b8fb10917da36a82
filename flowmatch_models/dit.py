"""The denoiser: a narrowed SANA DiT (diffusers ``SanaTransformer2DModel``) plus a REPA head.

The transformer sees DC-AE latents ``[B, 32, 8, 8]`` as 64 tokens (patch size 1) and attends to
Gemma3 caption hidden states ``[B, L, 640]``. REPA (Yu et al. 2024) aligns the output of
``transformer_blocks[k]`` with frozen DINOv2 patch features through a small MLP; SANA does not
return intermediate states, so a forward hook captures them (also under gradient checkpointing).

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
    )


def DiT_tiny() -> dict:
    """4 layers, width 64: CPU tests and the demo (forward ~25 ms on one core)."""
    return _sana_config(layers=4, heads=4, head_dim=16, cross_heads=4)


def DiT_small() -> dict:
    """12 layers, width 384 (~35M): quick single-GPU experiments."""
    return _sana_config(layers=12, heads=12, head_dim=32, cross_heads=6)


def DiT_base() -> dict:
    """20 layers, width 768 (~190M): the budget run of ARCHITECTURE.md."""
    return _sana_config(layers=20, heads=24, head_dim=32, cross_heads=12)


PRESETS: dict[str, Callable[[], dict]] = {"tiny": DiT_tiny, "small": DiT_small, "base": DiT_base}

#: REPA projector hidden width per preset (the paper's 2048 except for the CPU-sized model).
PROJECTOR_HIDDEN: dict[str, int] = {"tiny": 256, "small": 2048, "base": 2048}


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
    """``SanaTransformer2DModel`` + REPA projector on the output of ``transformer_blocks[k]``.

    ``forward(x_t, t, text, mask)`` takes ``t`` in [0, 1] (SANA wants 0-1000) and returns the
    predicted velocity and, when ``return_repa`` is set, the projected block-``k`` tokens
    ``[B, 64, 384]``.
    """

    def __init__(
        self,
        transformer: SanaTransformer2DModel,
        repa_block: int | None = None,
        projector_hidden: int = 2048,
    ):
        super().__init__()
        self.transformer = transformer
        depth = len(transformer.transformer_blocks)
        self.repa_block = depth // 3 if repa_block is None else int(repa_block)
        if not 0 <= self.repa_block < depth:
            raise ValueError(f"repa_block {self.repa_block} outside the model's {depth} blocks")
        width = transformer.config.num_attention_heads * transformer.config.attention_head_dim
        self.projector = REPAProjector(width, projector_hidden)
        self._captured: torch.Tensor | None = None
        transformer.transformer_blocks[self.repa_block].register_forward_hook(self._capture)

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


def build_model(
    preset: str = "tiny",
    repa_block: int | None = None,
    projector_hidden: int | None = None,
    **overrides,
) -> FlowDiT:
    """A randomly initialised :class:`FlowDiT` of the named preset."""
    transformer = SanaTransformer2DModel(**transformer_config(preset, **overrides))
    hidden = projector_hidden or PROJECTOR_HIDDEN.get(preset, 2048)
    return FlowDiT(transformer, repa_block=repa_block, projector_hidden=hidden)


def count_params(module: nn.Module) -> int:
    """Number of parameters of ``module``."""
    return sum(p.numel() for p in module.parameters())
