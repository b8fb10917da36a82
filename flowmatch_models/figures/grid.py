"""Image grids (shard previews, sample grids) as PNG."""

from __future__ import annotations

import base64
import io
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image

from flowmatch_models.storage.atomic import atomic_write_bytes


def make_grid(
    images: Sequence[np.ndarray | Image.Image],
    cols: int | None = None,
    cell: int = 128,
    pad: int = 2,
) -> Image.Image:
    """Tile ``images`` (uint8 HxWx3 arrays or PIL images) into one RGB image, ``cell`` px each
    (a non-square image fits its cell with its aspect ratio kept, centred on white)."""
    n = len(images)
    if n == 0:
        return Image.new("RGB", (cell, cell), (255, 255, 255))
    cols = cols or math.ceil(math.sqrt(n))
    rows = math.ceil(n / cols)
    grid = Image.new("RGB", (cols * (cell + pad) + pad, rows * (cell + pad) + pad), (255, 255, 255))
    for i, im in enumerate(images):
        if not isinstance(im, Image.Image):
            im = Image.fromarray(np.asarray(im, dtype=np.uint8))
        scale = cell / max(im.size)
        w, h = max(1, round(im.width * scale)), max(1, round(im.height * scale))
        im = im.convert("RGB").resize((w, h), Image.BICUBIC)
        r, c = divmod(i, cols)
        grid.paste(
            im, (pad + c * (cell + pad) + (cell - w) // 2, pad + r * (cell + pad) + (cell - h) // 2)
        )
    return grid


def save_png(img: Image.Image, path: str | Path) -> Path:
    """Save ``img`` as PNG atomically."""
    buf = io.BytesIO()
    img.save(buf, "PNG")
    atomic_write_bytes(path, buf.getvalue())
    return Path(path)


def markdown_image(img: Image.Image, alt: str = "preview", max_side: int = 512) -> str:
    """A small inline JPEG as markdown (shows in the Dagster UI's metadata)."""
    im = img.convert("RGB")  # e.g. matplotlib's RGBA PNGs
    im.thumbnail((max_side, max_side))
    buf = io.BytesIO()
    im.save(buf, "JPEG", quality=80)
    return f"![{alt}](data:image/jpeg;base64,{base64.b64encode(buf.getvalue()).decode()})"
