"""Every knob of the data pipeline, in typed config objects with defaults and descriptions.

They are pydantic models (``dg.Config``), so they work in plain Python too, and the Dagster
resource ``FlowmatchResource`` (resources.py) nests them so they can be edited in the launchpad.
"""

from __future__ import annotations

import dagster as dg
from pydantic import Field


class FilterConfig(dg.Config):
    """Row filters applied to PD12M metadata before any image is fetched (counted by reason)."""

    min_width: int = Field(default=256, description="Minimum original width in pixels.")
    min_height: int = Field(default=256, description="Minimum original height in pixels.")
    max_aspect_ratio: float = Field(
        default=3.0, description="Maximum long/short side ratio of the original image."
    )
    min_caption_chars: int = Field(
        default=1, description="Minimum caption length (characters, stripped)."
    )
    max_caption_chars: int = Field(
        default=4000, description="Maximum caption length (characters, stripped)."
    )
    licenses: list[str] | None = Field(
        default=None,
        description="License allow-list (exact strings); None keeps every license.",
    )
    drop_duplicate_hash: bool = Field(
        default=True, description="Keep only the first row of each md5 `hash` within a shard."
    )


class IngestConfig(dg.Config):
    """Download, decode, resize and encode settings of the images_256 stage."""

    size: int = Field(
        default=256, description="Output side: short side resized to this, centre crop."
    )
    threads: int = Field(default=16, description="Concurrent downloads+decodes per process.")
    connect_timeout_s: float = Field(default=5.0, description="TCP connect timeout (seconds).")
    read_timeout_s: float = Field(default=15.0, description="Read timeout (seconds).")
    retries: int = Field(
        default=3, description="Retries on 5xx, timeouts and connection errors (never on 4xx)."
    )
    backoff_s: float = Field(default=0.25, description="First retry delay; doubles each retry.")
    deadline_s: float = Field(
        default=60.0,
        gt=0,
        description="Total time one download may take, retries and redirects included; past it "
        "the row fails as timeout (a trickling or stalled server never holds a thread longer).",
    )
    max_bytes: int = Field(default=40_000_000, description="Largest body accepted (bytes).")
    max_redirects: int = Field(default=5, description="Most http(s) redirects followed.")
    max_pixels: int = Field(
        default=100_000_000, description="Decompression-bomb limit: refuse images above w*h."
    )
    min_side: int = Field(
        default=64, description="Decoded images with a shorter side fail as too_small."
    )
    file_root: str | None = Field(
        default=None,
        description="file:// URLs are allowed only under this folder (None: file:// refused).",
    )
    min_stored_fraction: float = Field(
        default=0.5,
        ge=0,
        le=1,
        description="An attempt that stores fewer than this fraction of the shard's kept rows "
        "fails and keeps the previous shard and its catalog records (its failures are recorded "
        "in the rejected_attempts view).",
    )
    image_format: str = Field(default="jpeg", description="jpeg, webp or png.")
    quality: int = Field(default=95, description="JPEG/WebP quality.")
    user_agent: str = Field(
        default="flowmatch/0.1 (+PD12M research)", description="HTTP User-Agent."
    )


class EncoderConfig(dg.Config):
    """Which pretrained encoders compute the embeddings, where, and how they are stored."""

    vae: str = Field(
        default="mit-han-lab/dc-ae-f32c32-sana-1.0-diffusers",
        description="DC-AE f32c32: hub id or local folder (diffusers AutoencoderDC).",
    )
    dino: str = Field(
        default="facebook/dinov2-small", description="DINOv2: hub id or local folder."
    )
    text: str = Field(
        default="google/gemma-3-270m",
        description="Gemma3-270M: hub id (gated: `huggingface-cli login`) or local folder.",
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
    max_tokens: int = Field(default=128, description="Caption truncation in tokens.")
    dino_pool: str = Field(
        default="avg2x2",
        description="avg2x2 (DINOv2 at 224 px, 16x16 patches 2x2-averaged to 8x8) or resize112.",
    )
    codec: str = Field(
        default="zstd", description="Store codec: none (mmap), zstd (byte-shuffled) or xz."
    )
    lossy_dino: str | None = Field(
        default=None, description="None (lossless), int8 or fp8: 1-byte DINO patch features."
    )
    lossy_text: str | None = Field(
        default=None, description="None (lossless), int8 or fp8: 1-byte caption hidden states."
    )
