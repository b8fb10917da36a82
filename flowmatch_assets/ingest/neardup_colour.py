"""Near-duplicates, the colour check: a pHash match counts only where the two images' colours
agree too.

The pHash (:mod:`.neardup`) reads the image in grey, so two unrelated pictures with the same
shape at the same place in other colours (a white ring and a yellow ring on the same navy
background) can fall within its threshold. On the demo sample (288 images) 9 such pairs lie
within 10 bits (6-10 bits), the same distances as 4% crops of a picture (up to 8-12 bits).

**The signature**: the image, trimmed of its flat frame as the pHash trims it, resized to a
4x4 grid (box filter), each cell's mean chroma (YCbCr Cb and Cr): 32 bytes (uint8) a row.
**The check**: two rows agree when no cell's Cb or Cr differs by more than the tolerance
(:data:`DEFAULT_TOLERANCE`). Measured on the demo sample at the stored 256 px, every row and
its four copies (quality-40 re-encode, 0.5x and back, 4% crop, 10-px border): a copy differs
by 10 at most (crops; re-encodes and resizes by 1); the 9 unrelated pairs within 10 bits by 32
to 91. The tolerance sits between (``tests/test_neardup.py``).

A grey copy of a colour picture has neutral chroma, so it is not a near duplicate of its
original here (the pHash alone would call it one).
"""

from __future__ import annotations

import numpy as np
from PIL import Image

#: The grid the chroma is averaged over (GRID x GRID cells, 2 channels).
GRID = 4
#: Bytes of a signature.
SIGNATURE_BYTES = GRID * GRID * 2
#: The largest difference of one cell's Cb or Cr (0-255) between two rows that agree.
DEFAULT_TOLERANCE = 20


def colour_signature(trimmed: Image.Image) -> np.ndarray:
    """The uint8 ``[SIGNATURE_BYTES]`` signature of an image trimmed of its flat frame."""
    ycc = trimmed.convert("RGB").convert("YCbCr").resize((GRID, GRID), Image.BOX)
    return np.ascontiguousarray(np.asarray(ycc, np.uint8)[..., 1:].reshape(SIGNATURE_BYTES))


def colour_difference(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The largest per-cell Cb/Cr difference between signatures ``a`` and ``b`` (``[..., 32]``
    uint8, broadcast): uint8 of the leading shape."""
    a, b = np.asarray(a, np.uint8), np.asarray(b, np.uint8)
    return (np.maximum(a, b) - np.minimum(a, b)).max(axis=-1)


def colours_agree(a: np.ndarray, b: np.ndarray, tolerance: int) -> np.ndarray:
    """Whether signatures ``a`` and ``b`` are within ``tolerance`` (broadcast)."""
    return colour_difference(a, b) <= tolerance


def pairs_agree(
    a: np.ndarray, ia: np.ndarray, b: np.ndarray, ib: np.ndarray, tolerance: int
) -> np.ndarray:
    """Whether ``a[ia[k]]`` and ``b[ib[k]]`` agree, for each pair ``k`` (in slices of 65,536
    pairs: a loose threshold may make every pair a hash match)."""
    out = np.zeros(len(ia), bool)
    for s in range(0, len(ia), 1 << 16):
        e = s + (1 << 16)
        out[s:e] = colours_agree(a[ia[s:e]], b[ib[s:e]], tolerance)
    return out


def check_tolerance(tolerance: int) -> int:
    """``tolerance`` as an int in 0..255 (255: every pair agrees, the colour check off)."""
    t = int(tolerance)
    if not 0 <= t <= 255 or t != tolerance:
        raise ValueError(f"colour tolerance {tolerance!r}: an integer from 0 to 255")
    return t
