"""Caption following on the procedural sample: does a 256 px image show what its caption says?

The embedded sample (:mod:`flowmatch_assets.demo.dataset`) captions every image with one sentence,

    "a {size} {colour} {shape} {where} of a textured {background} background"

e.g. "a large red star on the left of a textured navy background". This module inverts that
grammar (``parse_caption``), reads the same five attributes back from pixels (``analyse_image``)
and compares the two over a batch (``score``), so an ``evaluation`` asset can say how often a
text-to-image model draws the right colour, shape, size and position. ``prompts`` draws captions
from the same grammar. Pure functions: numpy and PIL only, deterministic.

Position words depend on the ORIGINAL image's orientation: ``draw_image`` moves the shape
along the long side, so a landscape image (w >= h) says "on the left" / "in the centre" /
"on the right", a portrait one (h > w) "at the top" / "in the centre" / "at the bottom". The
256 px centre crop keeps the shape, offset by 0.22 of the crop side from its centre. The
analyser sees only the crop, so it predicts one of five positions (left, centre, right, top,
bottom) from the shape's centroid; chance per caption is 1/3 (three words per orientation).

How the analyser reads an image (geometry in units of the crop side ``S``; the sample draws
shapes of radius 0.30 S (large) or 0.17 S (small), centred or 0.22 S off-centre):

1. background: a per-channel plane fitted robustly to the image border (the textured
   background is a smooth gradient plus low-frequency noise); its mean is matched to the six
   background colours.
2. shape pixels: every pixel goes to the nearest of nine colours, the eight palette colours and
   the local background; per palette colour, a morphological opening removes speckle and the
   largest connected blob is kept. The colour with the biggest blob wins (``unknown`` if no
   blob reaches ``min_area``).
3. shape kind: template match. Each of the six shapes is drawn at the blob's centroid with the
   radius that gives the blob's area, and the one with the best IoU wins (``unknown`` below
   ``min_iou``). A ring's hole, a square's full box and a star's points all show in the IoU.
4. size: that radius, split at the geometric mean of 0.30 S and 0.17 S.
5. position: the centroid's offset from the centre; ``centre`` within 0.11 S on both axes,
   otherwise the dominant axis gives left/right or top/bottom.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

from flowmatch_assets.demo.dataset import (
    BACKGROUNDS,
    COLOURS,
    CROSS_ARM,
    NEW_SHAPES,
    SHAPES,
    _polygon,
)

# --------------------------------------------------------------------------------------------
# The caption grammar (sample.draw_image)
# --------------------------------------------------------------------------------------------

SIZES = ("large", "small")
#: Position word -> phrase in the caption, as ``draw_image`` writes them.
POSITION_PHRASES: dict[str, str] = {
    "left": "on the left",
    "centre": "in the centre",
    "right": "on the right",
    "top": "at the top",
    "bottom": "at the bottom",
}
LANDSCAPE_POSITIONS = ("left", "centre", "right")  # w >= h: the shape moves horizontally
PORTRAIT_POSITIONS = ("top", "centre", "bottom")  # h > w: vertically
ATTRIBUTES = ("colour", "shape", "size", "position", "background")
#: Chance accuracy of a uniform guess per attribute (position: 3 words per orientation).
CHANCE: dict[str, float] = {
    "colour": 1 / len(COLOURS),
    "shape": 1 / len(SHAPES),
    "size": 1 / len(SIZES),
    "position": 1 / 3,
    "background": 1 / len(BACKGROUNDS),
}
UNKNOWN = "unknown"
LANDSCAPE_FRACTION = 0.6  # draw_image: P(w >= h)

_TEMPLATE = "a {size} {colour} {shape} {where} of a textured {background} background"


def _alt(words) -> str:
    return "|".join(re.escape(w) for w in sorted(words, key=len, reverse=True))


_CAPTION_RE = re.compile(
    rf"a (?P<size>{_alt(SIZES)}) (?P<colour>{_alt(COLOURS)}) (?P<shape>{_alt(SHAPES + NEW_SHAPES)}) "
    rf"(?P<where>{_alt(POSITION_PHRASES.values())}) "
    rf"of a textured (?P<background>{_alt(BACKGROUNDS)}) background"
)
_WHERE_TO_POSITION = {v: k for k, v in POSITION_PHRASES.items()}


def format_caption(colour: str, shape: str, size: str, position: str, background: str) -> str:
    """The caption ``draw_image`` writes for these attributes (inverse of ``parse_caption``)."""
    for name, value, allowed in (
        ("colour", colour, COLOURS),
        ("shape", shape, SHAPES + NEW_SHAPES),
        ("size", size, SIZES),
        ("position", position, POSITION_PHRASES),
        ("background", background, BACKGROUNDS),
    ):
        if value not in allowed:
            raise ValueError(f"{name} {value!r} is not one of {sorted(allowed)}")
    return _TEMPLATE.format(
        size=size,
        colour=colour,
        shape=shape,
        where=POSITION_PHRASES[position],
        background=background,
    )


def parse_caption(caption: str) -> dict[str, str]:
    """``{"colour", "shape", "size", "position", "background"}`` of a sample caption.

    Raises ``ValueError`` naming the grammar when ``caption`` is not one of its sentences.
    """
    m = _CAPTION_RE.fullmatch(caption.strip())
    if m is None:
        raise ValueError(
            f"caption {caption!r} is not in the sample grammar "
            f"{_TEMPLATE!r} (see flowmatch_assets.demo.dataset.draw_image)"
        )
    g = m.groupdict()
    return {
        "colour": g["colour"],
        "shape": g["shape"],
        "size": g["size"],
        "position": _WHERE_TO_POSITION[g["where"]],
        "background": g["background"],
    }


def prompts(
    n: int, seed: int = 0, shapes: tuple[str, ...] = SHAPES, orientation: str | None = None
) -> list[str]:
    """``n`` captions drawn from the sample grammar with ``draw_image``'s probabilities.

    Deterministic in ``seed``: landscape 60 % (left/centre/right), portrait 40 %
    (top/centre/bottom); shape (one of ``shapes``), colour, background, size and offset uniform.
    ``orientation`` ``"landscape"`` / ``"portrait"``: every caption of that orientation (for
    images generated wide or tall; the other draws stay those of the mixed set).
    """
    if orientation not in (None, "landscape", "portrait"):
        raise ValueError(f"orientation {orientation!r}: landscape, portrait or None")
    rng = np.random.default_rng(seed)
    colours, backgrounds = list(COLOURS), list(BACKGROUNDS)
    out = []
    for _ in range(n):
        landscape = rng.random() < LANDSCAPE_FRACTION
        if orientation is not None:
            landscape = orientation == "landscape"
        words = LANDSCAPE_POSITIONS if landscape else PORTRAIT_POSITIONS
        out.append(
            format_caption(
                colour=colours[rng.integers(len(colours))],
                shape=shapes[rng.integers(len(shapes))],
                size=SIZES[rng.integers(len(SIZES))],
                position=words[rng.integers(3)],
                background=backgrounds[rng.integers(len(backgrounds))],
            )
        )
    return out


# --------------------------------------------------------------------------------------------
# Reading an image
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AnalyserConfig:
    """Knobs of ``analyse_image``; lengths are fractions of the image's short side ``S``."""

    border: float = 0.02  # width of the border strip the background is fitted to
    large_radius: float = 0.30  # draw_image: r = 0.30 S (large) ...
    small_radius: float = 0.17  # ... or 0.17 S (small)
    centre_tolerance: float = 0.11  # half the 0.22 S offset of left/right/top/bottom
    min_area: float = 0.012  # smallest blob that counts as a shape (a small star is ~0.038 S^2)
    min_iou: float = 0.35  # best template IoU below this: shape "unknown"
    opening: int = 3  # MinFilter/MaxFilter size that removes background speckle


DEFAULT_CONFIG = AnalyserConfig()
_PALETTE = np.array(list(COLOURS.values()), np.float32)  # [8, 3]
_BG_PALETTE = np.array(list(BACKGROUNDS.values()), np.float32)  # [6, 3]
# area of each shape as drawn by draw_image, in units of r^2 (ring: outline 0.3 r wide)
_AREA_PER_R2 = {
    "circle": math.pi,
    "ring": math.pi * (1 - 0.7**2),
    "square": 4.0,
    "diamond": 2.0,
    "triangle": 3 * math.sqrt(3) / 4,
    "star": 10 * 0.5 * 0.45 * math.sin(math.pi / 5),
    "cross": 8 * CROSS_ARM - 4 * CROSS_ARM**2,  # two 2r x 2ar bars, their overlap once
}


def _background_plane(img: np.ndarray, width: int) -> np.ndarray:
    """Per-pixel background [H, W, 3]: a plane per channel, fitted to the border, twice."""
    h, w, _ = img.shape
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    edge = np.zeros((h, w), bool)
    edge[:width], edge[-width:], edge[:, :width], edge[:, -width:] = True, True, True, True
    design = np.stack([np.ones(h * w, np.float32), xx.ravel() / w - 0.5, yy.ravel() / h - 0.5], 1)
    a, y = design[edge.ravel()], img.reshape(-1, 3)[edge.ravel()].astype(np.float32)
    keep = np.ones(len(a), bool)
    for _ in range(2):  # refit without border pixels far from the fit (a shape at the edge)
        coef, *_ = np.linalg.lstsq(a[keep], y[keep], rcond=None)
        resid = np.linalg.norm(y - a @ coef, axis=1)
        keep = resid <= max(3.0 * float(np.median(resid)), 12.0)
        if keep.sum() < 8:
            keep[:] = True
    return (design @ coef).reshape(h, w, 3)


def _largest_blob(mask: np.ndarray) -> np.ndarray:
    """The largest 4-connected component of ``mask`` (a Python flood fill; masks are small)."""
    h, w = mask.shape
    labels = np.zeros((h, w), np.int32)
    best, best_size, current = 0, 0, 0
    ys, xs = np.nonzero(mask)
    flat = mask.ravel()
    lab = labels.ravel()
    for start in (ys * w + xs).tolist():
        if lab[start]:
            continue
        current += 1
        lab[start] = current
        stack, size = [start], 0
        while stack:
            p = stack.pop()
            size += 1
            y, x = divmod(p, w)
            for q, ok in ((p - w, y > 0), (p + w, y < h - 1), (p - 1, x > 0), (p + 1, x < w - 1)):
                if ok and flat[q] and not lab[q]:
                    lab[q] = current
                    stack.append(q)
        if size > best_size:
            best, best_size = current, size
    return labels == best if best else np.zeros_like(mask)


def _open(mask: np.ndarray, size: int) -> np.ndarray:
    im = Image.fromarray(mask.astype(np.uint8) * 255)
    im = im.filter(ImageFilter.MinFilter(size)).filter(ImageFilter.MaxFilter(size))
    return np.asarray(im) > 127


def _template(shape: str, h: int, w: int, cx: float, cy: float, r: float) -> np.ndarray:
    """``shape`` drawn as ``draw_image`` draws it, at (cx, cy) with radius r, as a bool mask."""
    im = Image.new("L", (w, h), 0)
    d = ImageDraw.Draw(im)
    box = [cx - r, cy - r, cx + r, cy + r]
    if shape == "circle":
        d.ellipse(box, fill=255)
    elif shape == "ring":
        d.ellipse(box, outline=255, width=max(1, int(round(r * 0.3))))
    elif shape == "square":
        d.rectangle(box, fill=255)
    else:
        d.polygon(_polygon(shape, cx, cy, r), fill=255)
    return np.asarray(im) > 127


def _unknown(background: str, note: str) -> dict:
    return {
        "colour": UNKNOWN,
        "shape": UNKNOWN,
        "size": UNKNOWN,
        "position": UNKNOWN,
        "background": background,
        "area": 0.0,
        "iou": 0.0,
        "note": note,
    }


def analyse_image(
    img: np.ndarray, config: AnalyserConfig = DEFAULT_CONFIG, shapes: tuple[str, ...] = SHAPES
) -> dict:
    """Colour, shape, size, position and background of the one shape in ``img`` (HxWx3 uint8).

    Returns those five words (each ``"unknown"`` when the image shows no palette-coloured
    shape; ``background`` is always the nearest background colour) plus diagnostics:
    ``area`` (blob area / S^2), ``iou`` (best template IoU), ``radius`` (/ S),
    ``centroid`` ((x, y) / S), ``ious`` (per shape) and ``note``.
    """
    arr = np.asarray(img)
    if arr.ndim != 3 or arr.shape[2] != 3 or arr.shape[0] < 16 or arr.shape[1] < 16:
        raise ValueError(f"analyse_image needs an HxWx3 image (H, W >= 16), got {arr.shape}")
    if arr.dtype != np.uint8:
        raise ValueError(f"analyse_image needs uint8 pixels (0-255), got {arr.dtype}")
    h, w, _ = arr.shape
    s = min(h, w)
    pix = arr.astype(np.float32)
    bg = _background_plane(pix, max(2, int(round(config.border * s))))
    bg_mean = bg.reshape(-1, 3).mean(0)
    background = list(BACKGROUNDS)[int(np.argmin(((_BG_PALETTE - bg_mean) ** 2).sum(1)))]

    # nearest of nine colours: eight palette colours (0-7) or the local background (8)
    d_pal = ((pix[:, :, None, :] - _PALETTE[None, None]) ** 2).sum(-1)  # [H, W, 8]
    d_bg = ((pix - bg) ** 2).sum(-1)
    nearest = np.argmin(d_pal, -1)
    nearest[d_pal.min(-1) >= d_bg] = len(_PALETTE)
    blobs: dict[int, np.ndarray] = {}
    for k in np.unique(nearest).tolist():
        if k == len(_PALETTE) or (nearest == k).sum() < config.min_area * s * s:
            continue
        blob = _largest_blob(_open(nearest == k, config.opening))
        if blob.sum() >= config.min_area * s * s:
            blobs[k] = blob
    if not blobs:
        return _unknown(background, "no palette-coloured blob")
    k = max(blobs, key=lambda j: int(blobs[j].sum()))
    mask = blobs[k]
    colour = list(COLOURS)[k]
    area = float(mask.sum())
    ys, xs = np.nonzero(mask)
    cx, cy = float(xs.mean()) + 0.5, float(ys.mean()) + 0.5

    ious, radii = {}, {}
    for shape in shapes:  # the templates: the demo's six, or with NEW_SHAPES the second set's
        r = math.sqrt(area / _AREA_PER_R2[shape])
        t = _template(shape, h, w, cx, cy, r)
        ious[shape] = float((t & mask).sum() / max(1, (t | mask).sum()))
        radii[shape] = r
    best = max(ious, key=ious.get)
    shape = best if ious[best] >= config.min_iou else UNKNOWN
    # size from the best shape's radius (a circle's if the shape is unknown)
    r = radii[best if shape != UNKNOWN else "circle"] / s
    size = "large" if r >= math.sqrt(config.large_radius * config.small_radius) else "small"
    dx, dy = (cx - w / 2) / s, (cy - h / 2) / s
    if max(abs(dx), abs(dy)) < config.centre_tolerance:
        position = "centre"
    elif abs(dx) >= abs(dy):
        position = "left" if dx < 0 else "right"
    else:
        position = "top" if dy < 0 else "bottom"
    return {
        "colour": colour,
        "shape": shape,
        "size": size,
        "position": position,
        "background": background,
        "area": area / (s * s),
        "iou": ious[best],
        "radius": r,
        "centroid": (cx / s, cy / s),
        "ious": ious,
        "note": "",
    }


# --------------------------------------------------------------------------------------------
# Scoring a batch
# --------------------------------------------------------------------------------------------


def score(
    captions: Sequence[str],
    images: Sequence[np.ndarray] | np.ndarray,
    config: AnalyserConfig = DEFAULT_CONFIG,
    shapes: tuple[str, ...] = SHAPES,
) -> dict:
    """How often each image shows what its caption says.

    Returns ``{"n", "accuracy": {attr: float}, "chance": {attr: float}, "all_correct",
    "unknown": {attr: count}, "items": [{"caption", "truth", "pred", "correct"}]}`` over
    ``ATTRIBUTES`` (colour, shape, size, position, background). An ``unknown`` prediction
    counts as wrong. ``all_correct`` is the fraction with colour, shape, size and position
    all right (background excluded: a model may ignore it and still follow the object).
    """
    if len(captions) != len(images):
        raise ValueError(f"{len(captions)} captions but {len(images)} images")
    items = []
    for caption, img in zip(captions, images, strict=True):
        truth = parse_caption(caption)
        pred = analyse_image(img, config, shapes)
        correct = {a: pred[a] == truth[a] for a in ATTRIBUTES}
        items.append(
            {
                "caption": caption,
                "truth": truth,
                "pred": {a: pred[a] for a in ATTRIBUTES},
                "correct": correct,
            }
        )
    n = len(items)
    acc = {a: (sum(it["correct"][a] for it in items) / n if n else 0.0) for a in ATTRIBUTES}
    main = ("colour", "shape", "size", "position")
    return {
        "n": n,
        "accuracy": acc,
        "chance": {**CHANCE, "shape": 1 / len(shapes)},
        "all_correct": (sum(all(it["correct"][a] for a in main) for it in items) / n) if n else 0.0,
        "unknown": {a: sum(it["pred"][a] == UNKNOWN for it in items) for a in ATTRIBUTES},
        "items": items,
    }
