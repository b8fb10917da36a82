"""The flow-matching knobs, torch-free: :class:`FlowSettings` is both ``FlowMatching``'s fields
(``flow.py``) and the training config's ``flow`` section (``train/config.py`` makes
``FlowConfig`` from :func:`config_fields`), so the two cannot drift and the budget report reads
the config without importing torch.

A field here is the YAML key ``flow.<name>``: its default, bounds and description are given once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Annotated, Any, Literal, get_type_hints

from pydantic import Field

#: The names of ``flow.T_SAMPLERS`` (``flow.py`` refuses to import when they differ).
TSampling = Literal["logit_normal", "uniform", "mode"]

#: The old single ``shift`` key (configs, requests and checkpoints from before the training and
#: the sampler's shifts were named apart): it sets both, unless they are given.
LEGACY_KEYS: dict[str, tuple[str, ...]] = {"shift": ("train_shift", "sample_shift")}


@dataclass
class FlowSettings:
    """How ``t`` is drawn and shifted, the loss weights and the sampler's shift."""

    t_sampling: Annotated[
        TSampling, Field(description="Timestep sampling by name (flow.T_SAMPLERS).")
    ] = "logit_normal"
    t_mean: Annotated[float, Field(description="logit_normal: t ~ sigmoid(N(t_mean, t_std)).")] = (
        0.0
    )
    t_std: Annotated[float, Field(gt=0, description="logit_normal: see t_mean.")] = 1.0
    mode_scale: Annotated[
        float,
        Field(
            ge=-1,
            le=2 / (math.pi - 2),
            description="mode: SD3's scale s (paper eq. 20; 1.29 in its rf/mode(1.29)); "
            "0 = uniform; -1 <= s <= 2/(pi-2) keeps the density positive.",
        ),
    ] = 1.29
    train_shift: Annotated[
        float,
        Field(gt=0, description="SD3 shift of the training t, s t / (1 + (s-1) t) (1 = none)."),
    ] = 1.0
    sample_shift: Annotated[
        float,
        Field(gt=0, description="Shift of the sampler's time grid and the exported scheduler."),
    ] = 1.0
    repa_lambda: Annotated[
        float, Field(ge=0, description="REPA loss weight; 0 = no REPA head.")
    ] = 0.5
    caption_dropout: Annotated[
        float, Field(ge=0, le=1, description="Null-caption fraction (CFG).")
    ] = 0.1
    n_bins: Annotated[int, Field(ge=1, description="Per-t-bin loss logging.")] = 10


def config_fields() -> dict[str, tuple[Any, Any]]:
    """``{name: (annotation, default)}`` of :class:`FlowSettings`: ``FlowConfig``'s fields."""
    hints = get_type_hints(FlowSettings, include_extras=True)
    return {f.name: (hints[f.name], f.default) for f in fields(FlowSettings)}
