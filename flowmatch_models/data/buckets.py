"""Aspect-ratio buckets: the (height, width) sizes images are stored and trained at.

A bucket is a ``(height, width)`` pair of multiples of ``grid`` (32: one DC-AE f32 latent cell)
whose area is within ``area_tolerance`` of ``size * size`` and whose aspect ratio is at most
``max_ratio`` either way. diffusers' PixArt/Sana pipelines carry the same kind of table
(``ASPECT_RATIO_256_BIN``: height/width ratio -> (height, width), on a 16-pixel grid, ratios
0.25-4); ours is derived on the 32-pixel grid so that every bucket is a whole latent grid:

    >>> [label(b) for b in buckets_for(256)]            # doctest: +NORMALIZE_WHITESPACE
    ['192x384', '192x352', '192x320', '224x320', '224x288', '224x256', '256x256',
     '256x224', '288x224', '320x224', '320x192', '352x192', '384x192']

(56-72 latent tokens, 64 at the square; height/width ratios 1:2 to 2:1, all within 12.5% of
256 x 256 pixels; of two sizes with nearly the same ratio, e.g. 224x256 and 256x288, the one
nearer the area stays, a tie the cheaper.) An image goes to the bucket nearest its aspect ratio (in
log ratio, so 2:1 and 1:2 are equally far from 1:1): resized to cover the bucket and
centre-cropped, which is the smallest crop of any bucket; :func:`kept_fraction` is the share of
the original's area the crop keeps (square mode: short side / long side).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

Bucket = tuple[int, int]  # (height, width) in pixels

#: The pixels of one latent cell (DC-AE f32: a 256 px side is 8 cells): every stored and
#: generated size is a multiple of it. The one definition; everything else imports it.
GRID = 32


@functools.lru_cache(maxsize=16)
def buckets_for(
    size: int = 256, grid: int = GRID, max_ratio: float = 2.0, area_tolerance: float = 0.125
) -> tuple[Bucket, ...]:
    """Every ``(height, width)`` on the ``grid`` with ``|h*w / size^2 - 1| <= area_tolerance``
    and ``1/max_ratio <= h/w <= max_ratio``, by height/width ratio (widest first). ``size``
    itself must be on the grid (the square is always a bucket)."""
    if size % grid:
        raise ValueError(f"image size {size} is not a multiple of the {grid}-pixel grid")
    area = size * size
    found = [
        (h, w)
        for h in range(grid, 4 * size + 1, grid)
        for w in range(grid, 4 * size + 1, grid)
        if abs(h * w / area - 1) <= area_tolerance + 1e-9
        and 1 / max_ratio - 1e-9 <= h / w <= max_ratio + 1e-9
    ]
    # of two buckets whose ratios are within 2% the one nearer the area (a tie: the smaller)
    # stays, so that neighbouring buckets differ in shape and not only in cost
    found.sort(key=lambda b: (abs(b[0] * b[1] / area - 1), b[0] * b[1]))
    out: list[Bucket] = []
    for b in found:
        if all(abs(math.log((b[0] / b[1]) / (o[0] / o[1]))) > 0.02 for o in out):
            out.append(b)
    return tuple(sorted(out, key=lambda b: b[0] / b[1]))


def square(size: int = 256) -> list[Bucket]:
    """The square-only mode's one bucket."""
    return [(size, size)]


def label(b: Bucket) -> str:
    """``"224x288"``: height x width."""
    return f"{b[0]}x{b[1]}"


def parse(text: str) -> Bucket:
    """:func:`label`'s inverse."""
    h, _, w = text.partition("x")
    return int(h), int(w)


def parse_sizes(texts: Sequence[str], grid: int = GRID) -> list[Bucket]:
    """Sizes to generate at (``["256x256", "224x320"]``): at least one, each on the ``grid``;
    a ValueError naming what is wrong otherwise."""
    try:
        sizes = [parse(t) for t in texts]
    except ValueError as e:
        raise ValueError(f"sizes {list(texts)}: {e}") from e
    if not sizes or any(h % grid or w % grid or h < grid or w < grid for h, w in sizes):
        raise ValueError(
            f"sizes {list(texts)}: give at least one height x width, each a multiple "
            f"of {grid} (a latent cell), e.g. ['256x256', '224x320']"
        )
    return sizes


def nearest(width: int, height: int, buckets: Sequence[Bucket]) -> Bucket:
    """The bucket whose aspect ratio is nearest the image's (log ratio; ties: the squarer)."""
    r = math.log(height / width)
    return min(buckets, key=lambda b: (abs(math.log(b[0] / b[1]) - r), abs(math.log(b[0] / b[1]))))


def kept_fraction(width: int, height: int, bucket: Bucket) -> float:
    """The share of a ``width x height`` original's area a cover-resize and centre crop to
    ``bucket`` keeps: the smaller of the two aspect ratios over the larger."""
    r, rb = height / width, bucket[0] / bucket[1]
    return min(r, rb) / max(r, rb)


def cover_box(
    width: int, height: int, out_width: int, out_height: int
) -> tuple[float, float, float, float]:
    """The source box (left, top, right, bottom) of a ``width x height`` image that a resize to
    cover ``out_width x out_height`` followed by a centred crop keeps (``Image.resize(box=)``).
    For a square output this is the short-side resize and centre crop of the square mode."""
    scale = max(out_width / width, out_height / height)
    rw, rh = max(out_width, round(width * scale)), max(out_height, round(height * scale))
    left, top = (rw - out_width) // 2, (rh - out_height) // 2
    return (
        left / scale,
        top / scale,
        (left + out_width) / scale,
        (top + out_height) / scale,
    )
