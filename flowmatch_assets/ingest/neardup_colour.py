"""Near-duplicates, the colour check: a pHash match counts only where the two images' colours
agree too.

The pHash (:mod:`.neardup`) reads the image in grey, so two unrelated pictures with the same
shape at the same place in other colours (a white ring and a yellow ring on the same navy
background) can fall within its threshold: the demo sample (288 images and 5 planted copies)
holds 10 such pairs within 10 bits (6-10 bits), as close as 4% crops of one picture (up to
8-12 bits), and at 10 bits the hash alone removes 9 unrelated demo images (the check: none,
and still the 5 copies; ``tests/test_demo_neardup.py``).

**The signature**: the image, trimmed of its flat frame as the pHash trims it, resized to a
4x4 grid (box filter), each cell's mean chroma (YCbCr Cb and Cr): 32 bytes (uint8) a row.
**The check**: two rows agree when the mean of their :data:`TOP` largest per-cell Cb/Cr
differences is within the tolerance (:data:`DEFAULT_TOLERANCE`). A shape in another colour
moves the cells it covers a lot; a crop moves the cells along its shifted edges a little (one
cell's maximum alone let the crops' worst cell come within 2x of the closest unrelated pair).
Measured at the stored 256 px: every RGB row of the demo sample and its four copies
(quality-40 re-encode, 0.5x and back, 4% crop, 10-px border) within 10 bits: 6.2 at most
(crops; re-encodes and resizes 1, borders 3); the unrelated pairs within 10 bits: 19 to 82;
those within 16 bits in other colours: 15.5 and up, but for pairs of two near-grey pictures
(a grey JPEG and a white shape on grey: no chroma to compare). The tolerance, 10, sits between
(``tests/test_neardup.py``).

A grey copy of a colour picture has neutral chroma, so it is not a near duplicate of its
original under the check (the pHash alone would call it one).
"""

from __future__ import annotations

import numpy as np
from PIL import Image

#: The grid the chroma is averaged over (GRID x GRID cells, 2 channels).
GRID = 4
#: Bytes of a signature.
SIGNATURE_BYTES = GRID * GRID * 2
#: The differences averaged: the largest 4 of the 32 (a shape in another colour covers a few
#: cells; a crop's shifted edges move single cells a little).
TOP = 4
#: The largest mean of the :data:`TOP` largest Cb/Cr differences (0-255) of two rows that agree.
DEFAULT_TOLERANCE = 10


def colour_signature(trimmed: Image.Image) -> np.ndarray:
    """The uint8 ``[SIGNATURE_BYTES]`` signature of an image trimmed of its flat frame."""
    ycc = trimmed.convert("RGB").convert("YCbCr").resize((GRID, GRID), Image.BOX)
    return np.ascontiguousarray(np.asarray(ycc, np.uint8)[..., 1:].reshape(SIGNATURE_BYTES))


def _diff(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = np.asarray(a, np.uint8), np.asarray(b, np.uint8)
    return np.maximum(a, b) - np.minimum(a, b)  # per cell and channel, 0-255


def _top_sum(diff: np.ndarray) -> np.ndarray:
    top = np.partition(diff, SIGNATURE_BYTES - TOP, axis=-1)[..., SIGNATURE_BYTES - TOP :]
    return top.sum(axis=-1, dtype=np.int32)


def colour_difference(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """How far apart signatures ``a`` and ``b`` are (``[..., 32]`` uint8, broadcast): the mean
    of their :data:`TOP` largest per-cell Cb/Cr differences (0-255, float)."""
    return _top_sum(_diff(a, b)) / TOP


def colours_agree(a: np.ndarray, b: np.ndarray, tolerance: int) -> np.ndarray:
    """Whether signatures ``a`` and ``b`` are within ``tolerance`` (broadcast)."""
    diff = _diff(a, b)
    flat = diff.reshape(-1, SIGNATURE_BYTES)
    most = flat.max(axis=-1)
    # the largest difference bounds the mean of the TOP largest: <= it, >= it / TOP
    agree = most <= tolerance
    open_ = (most > tolerance) & (most <= TOP * tolerance)
    agree[open_] = _top_sum(flat[open_]) <= TOP * tolerance
    return agree.reshape(diff.shape[:-1])


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
