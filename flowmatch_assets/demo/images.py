"""The sample's images as the ``images`` stage stores them, made in memory (no files).

``sample_images(seed, n)`` draws ``n`` images with :func:`flowmatch_assets.demo.dataset.draw_image`
(one seeded generator), encodes each as the sample writes most rows (JPEG, quality 90) and runs
the bytes through the stage's own :func:`flowmatch_assets.ingest.decode.process_image` (decode with DCT
scaling, short side to 256, centre crop, JPEG q95), so the pixels are exactly what the pipeline
would store. For the demo VAE's training data and the caption analyser's ground truth.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from flowmatch_assets.demo.dataset import draw_image
from flowmatch_assets.ingest.decode import process_image
from flowmatch_assets.ingest.images import IngestConfig


def sample_images(
    seed: int, n: int, progress: bool = False, cfg: IngestConfig | None = None
) -> tuple[np.ndarray, list[str]]:
    """``n`` images-stage images (uint8 ``[n, size, size, 3]``) and their captions."""
    cfg = cfg or IngestConfig()
    rng = np.random.default_rng(seed)
    out = np.empty((n, cfg.size, cfg.size, 3), np.uint8)
    captions = []
    for i in range(n):
        img, caption = draw_image(rng)
        buf = io.BytesIO()
        img.save(buf, "JPEG", quality=90)  # what sample.py writes for most rows
        data, _, _ = process_image(buf.getvalue(), cfg)
        out[i] = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
        captions.append(caption)
        if progress and (i + 1) % 100 == 0:
            print(f"  drew {i + 1}/{n} images", flush=True)
    return out, captions
