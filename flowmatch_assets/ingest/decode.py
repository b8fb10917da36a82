"""Decoding one image's bytes into the stored crop: format sniffing, size checks before decoding, DCT-scaled JPEG decode, resize, crop, EXIF orientation, encode.

Speed: JPEG (almost all of PD12M) is decoded with ``simplejpeg`` (libjpeg-turbo), whose DCT
scaling goes in eighths (1/8 ... 8/8): the smallest M/8 whose short side is still at least
``size`` (e.g. 3/8 where Pillow's draft mode can only pick 1/2), which skips most of the IDCT and
colour-conversion work; Huffman decoding of every coefficient remains and is the floor. The
header (size, colour space) and the EXIF orientation are read without Pillow, and the bomb and
size checks run before decoding. Strict mode: any libjpeg warning (truncation, bad data) sends
the file to the Pillow path, which decides whether it is ``corrupt``, so outcomes match the
Pillow path's; so do CMYK/YCCK JPEGs (Adobe inversion) and a missing ``simplejpeg``. Pillow's
path for JPEG is draft mode (1/2, 1/4, 1/8 scaling). Only the centre-crop box of the decoded
image is resampled (``Image.resize(box=...)``, antialiased BICUBIC: after DCT scaling the
remaining factor is below 2, where it matches LANCZOS to within JPEG noise at 3/4 of the cost).
The EXIF orientation is applied to the small output (a lossless transpose that commutes with
the centred crop) instead of to the full decoded image. The body is read with ``read1`` (one
socket read per call) so the row's total deadline is checked between reads. Decode, resize, encode and md5 release the GIL, so a
thread pool scales over cores.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import math
import threading
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageFile

from flowmatch_assets.ingest.images import IMAGE_FORMATS, IngestConfig, IngestError, pillow_format
from flowmatch_assets.ingest.jpeg_markers import (
    _EXIF_ORIENTATION_TAG,
    _jpeg_orientation,
    jpeg_scans,
)

try:  # libjpeg-turbo with M/8 DCT scaling; without it every JPEG takes the Pillow draft path
    import simplejpeg
except ImportError:  # pragma: no cover - simplejpeg is a declared dependency
    simplejpeg = None
from flowmatch_models.data.buckets import cover_box

ENCODERS = IMAGE_FORMATS  # the stored format -> Pillow encoder (ingest/images.py)

# Pillow allocates a large image in blocks (16 MB by default), which glibc serves from each
# thread's own heap once its mmap threshold has grown, and keeps there when freed: 6 threads
# decoding 100 Mpx PNGs one after the other held 1.6-2 GB. Blocks above the largest threshold
# (32 MB) are mapped, and given back when the image is freed (437 MB). Small images are one
# block of their own size, as before.
Image.core.set_block_size(64 << 20)

# Same mapping as PIL.ImageOps.exif_transpose.
_EXIF_TRANSPOSE = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}


def describe_bytes(data: bytes) -> str:
    """What a body that is not an image was, never what it held: its length, a coarse kind
    (HTML, text, binary) and a short md5 (failure details end up in the catalog; a body can be
    a secret a server handed out)."""
    if not data:
        return "empty body"
    head = bytes(data[:512]).lstrip().lower()
    if head.startswith((b"<!doctype html", b"<html", b"<head", b"<body")):
        kind = "HTML"
    elif head.startswith((b"<?xml", b"<svg")):
        kind = "XML/SVG"
    elif head.startswith((b"{", b"[")):
        kind = "JSON-like text"
    else:
        try:
            bytes(data[:512]).decode("utf-8")
            kind = "text"
        except UnicodeDecodeError:
            kind = "binary data"
    return f"{kind}, {len(data)} bytes (md5 {hashlib.md5(data).hexdigest()[:12]}), not an image"


def sniff_format(data: bytes) -> str | None:
    """The Pillow format name of ``data`` from its magic bytes, or None if not a known image."""
    head = data[:16]
    if head[:3] == b"\xff\xd8\xff":
        return "JPEG"
    if head[:8] == b"\x89PNG\r\n\x1a\n":
        return "PNG"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "WEBP"
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return "GIF"
    if head[:2] == b"BM":
        return "BMP"
    if head[:4] in (b"II*\x00", b"MM\x00*"):
        return "TIFF"
    return None


def _to_8bit_l(im: Image.Image, hi: float | None = None) -> Image.Image:
    """I;16*, I and F modes to L, scaling by the data's range rather than clipping at 255
    (``hi``: the largest value of the image this one was resampled from). I;16 is shifted in
    place; I and F come here resampled to the output size (:func:`crop_resize`), so no copy of
    the full image is ever float64 (a 100 Mpx float TIFF took 3 GB that way)."""
    if im.mode.startswith("I;16"):
        arr = np.array(im, dtype=np.uint16)  # one copy, 2 bytes a pixel
        np.right_shift(arr, 8, out=arr)
        return Image.fromarray(arr.astype(np.uint8), "L")
    a = np.asarray(im, dtype=np.float64)
    if hi is None:
        hi = float(a.max()) if a.size else 0.0
    if im.mode == "F" and hi <= 1.0:
        a = a * 255.0
    elif hi > 255.0:
        a = a / (257.0 if hi <= 65535.0 else hi / 255.0)
    out = np.clip(np.rint(a), 0, 255).astype(np.uint8)
    return Image.fromarray(out, "L")


def _composite_white(im: Image.Image) -> Image.Image:
    """RGBA/LA to RGB over a white background."""
    rgba = im.convert("RGBA") if im.mode != "RGBA" else im
    bg = Image.new("RGB", rgba.size, (255, 255, 255))
    bg.paste(rgba, mask=rgba.getchannel("A"))
    return bg


def _check_scans(data: bytes, cfg: IngestConfig) -> None:
    """``too_many_scans`` for a JPEG with more than ``cfg.max_jpeg_scans`` scans."""
    if cfg.max_jpeg_scans and jpeg_scans(data, cfg.max_jpeg_scans) > cfg.max_jpeg_scans:
        raise IngestError(
            "too_many_scans",
            f"a JPEG with more than max_jpeg_scans {cfg.max_jpeg_scans} scans (each one decodes "
            "the whole image again): not decoded",
        )


def _check_size(w: int, h: int, orientation: int, cfg: IngestConfig) -> tuple[int, int]:
    """Bomb and too-small checks on the header size; returns the size after EXIF orientation."""
    if w * h > cfg.max_pixels:
        raise IngestError("decompression_bomb", f"{w}x{h} > max_pixels {cfg.max_pixels}")
    ow, oh = (h, w) if orientation in (5, 6, 7, 8) else (w, h)
    if min(w, h) < cfg.min_side:
        raise IngestError("too_small", f"{ow}x{oh} has short side < min_side {cfg.min_side}")
    return ow, oh


def _decoded_target(ow: int, oh: int, orientation: int, cfg: IngestConfig) -> tuple[int, int]:
    """(width, height) to resample the decoded, not yet oriented image to: the bucket of the
    picture as shown (``ow x oh``, after orientation), turned back when the orientation turns
    the image (the transpose is applied to the small output)."""
    bh, bw = cfg.bucket_of(ow, oh)
    return (bh, bw) if orientation in (5, 6, 7, 8) else (bw, bh)


@dataclass(frozen=True)
class JpegPlan:
    """What the simplejpeg path decodes: the header's facts and the DCT-scaled size asked for."""

    width: int  # as stored, before EXIF orientation
    height: int
    orig_width: int  # after EXIF orientation
    orig_height: int
    orientation: int
    colorspace: str  # simplejpeg's target: "RGB" or "GRAY"
    min_width: int  # libjpeg-turbo picks the smallest M/8 scale at least this large
    min_height: int
    target: tuple[int, int]  # (width, height) the decoded image is resampled to, before orientation

    @property
    def transpose(self) -> Image.Transpose | None:
        """The lossless transpose that applies the EXIF orientation to the small output."""
        return _EXIF_TRANSPOSE.get(self.orientation)


def jpeg_plan(data: bytes, cfg: IngestConfig) -> JpegPlan | None:
    """Header, EXIF orientation, bomb/size checks and the DCT scale of a JPEG, without decoding.

    None when this JPEG should take the Pillow path (no simplejpeg, CMYK/YCCK, an unreadable
    header). Raises ``IngestError`` for ``decompression_bomb`` / ``too_small``.
    """
    if simplejpeg is None:
        return None
    try:
        h, w, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    except Exception:  # noqa: BLE001 - Pillow reports what is wrong with this file
        return None
    if colorspace in ("YCbCr", "RGB"):
        target = "RGB"
    elif colorspace == "Gray":
        target = "GRAY"
    else:
        return None  # CMYK / YCCK (Adobe inversion): Pillow
    if Image.MAX_IMAGE_PIXELS and w * h > 2 * Image.MAX_IMAGE_PIXELS:
        return None  # Pillow raises its DecompressionBombError for these
    orientation = _jpeg_orientation(data)
    ow, oh = _check_size(w, h, orientation, cfg)
    tw, th = _decoded_target(ow, oh, orientation, cfg)
    scale = max(tw / w, th / h)
    return JpegPlan(
        w,
        h,
        ow,
        oh,
        orientation,
        target,
        max(1, math.ceil(w * scale)),
        max(1, math.ceil(h * scale)),
        (tw, th),
    )


def jpeg_decode_scaled(data: bytes, plan: JpegPlan) -> np.ndarray | None:
    """simplejpeg (libjpeg-turbo) decode at the smallest M/8 scale covering ``plan``'s size;
    None on any libjpeg error or warning (strict: Pillow then decides what is corrupt)."""
    try:
        return simplejpeg.decode_jpeg(
            data,
            colorspace=plan.colorspace,
            min_width=plan.min_width,
            min_height=plan.min_height,
            strict=True,
        )
    except Exception:  # noqa: BLE001 - truncated/damaged: Pillow decides (and says corrupt)
        return None


def to_pillow(arr: np.ndarray, plan: JpegPlan) -> Image.Image:
    """The decoded array as an RGB or L Pillow image (one copy)."""
    if plan.colorspace == "GRAY":
        return Image.fromarray(arr[:, :, 0], "L")
    return Image.fromarray(arr, "RGB")


def _decode_jpeg_scaled(data: bytes, cfg: IngestConfig) -> tuple[Image.Image, int, int, int] | None:
    """simplejpeg (libjpeg-turbo) decode straight to the smallest M/8 scale >= the resize target.

    Returns ``(image, orig_width, orig_height, orientation)`` with an RGB or L image, or None
    when this JPEG should take the Pillow path instead (no simplejpeg, CMYK/YCCK, a header or
    data error of any kind, even a warning: strict mode, so Pillow decides what is corrupt).
    Raises ``IngestError`` for ``decompression_bomb`` / ``too_small``, before decoding.
    """
    plan = jpeg_plan(data, cfg)
    if plan is None:
        return None
    arr = jpeg_decode_scaled(data, plan)
    if arr is None:
        return None
    return to_pillow(arr, plan), plan.orig_width, plan.orig_height, plan.orientation


def crop_resize(
    im: Image.Image, transpose: Image.Transpose | None, target: tuple[int, int]
) -> Image.Image:
    """Mode to RGB/L(A), resample the centred crop box to ``target`` (width, height, before
    orientation), composite alpha over white, to RGB, orient: the image that is encoded."""
    mode = im.mode
    alpha = mode in ("RGBA", "LA", "PA") or (mode == "P" and "transparency" in im.info)
    wide_hi = None  # I and F: resampled as they are, to 8 bits at the output size
    if mode == "P" or mode == "PA":
        im = im.convert("RGBA" if alpha else "RGB")
    elif mode in ("I", "F"):
        wide_hi = float(im.getextrema()[1] or 0)
    elif mode.startswith("I;16"):
        im = _to_8bit_l(im)
    elif mode == "L" and "transparency" in im.info:
        im = im.convert("LA")
        alpha = True
    elif mode not in ("RGB", "RGBA", "L", "LA"):
        im = im.convert("RGB")  # CMYK, YCbCr, 1, RGBX, ...
    elif mode == "RGB" and "transparency" in im.info:
        im = im.convert("RGBA")
        alpha = True
    dw, dh = im.size  # after DCT scaling
    tw, th = target
    out = im.resize(
        (tw, th), Image.Resampling.BICUBIC, box=cover_box(dw, dh, tw, th), reducing_gap=3.0
    )
    if wide_hi is not None:
        out = _to_8bit_l(out, wide_hi)
    if alpha:
        out = _composite_white(out)
    elif out.mode != "RGB":
        out = out.convert("RGB")
    if transpose is not None:
        out = out.transpose(transpose)
    return out


def _out_of_memory(size: tuple[int, int] | None = None) -> IngestError:
    """``out_of_memory``: the process was short of memory, the file may be fine (retryable)."""
    what = f"a {size[0]}x{size[1]} image" if size else "the image"
    return IngestError("out_of_memory", f"decoding {what} ran out of memory")


def encode(out: Image.Image, cfg: IngestConfig, encoder: str) -> bytes:
    """The stored bytes of the output image (``encoder``: a Pillow format of ``ENCODERS``)."""
    buf = io.BytesIO()
    if encoder == "PNG":
        out.save(buf, encoder)
    else:
        out.save(buf, encoder, quality=cfg.quality)
    return buf.getvalue()


def process_image(data: bytes, cfg: IngestConfig) -> tuple[bytes, int, int]:
    """Decode ``data``, resize it to cover its bucket (``cfg.bucket_of``: a size x size square,
    or the nearest aspect-ratio bucket), centre-crop, encode.

    Returns ``(encoded, orig_width, orig_height)``, the original size after EXIF orientation
    (the stored size is ``cfg.bucket_of(orig_width, orig_height)``).
    Raises ``IngestError`` (``not_image``, ``corrupt``, ``decompression_bomb``, ``too_small``,
    ``too_many_scans``).
    """
    if ImageFile.LOAD_TRUNCATED_IMAGES:
        raise RuntimeError(
            "PIL.ImageFile.LOAD_TRUNCATED_IMAGES is True somewhere in this process; truncated "
            "images would be stored silently. Leave it False."
        )
    encoder = pillow_format(cfg.image_format)
    fmt = sniff_format(data)
    if fmt is None:
        raise IngestError("not_image", describe_bytes(data))
    if fmt == "JPEG":
        _check_scans(data, cfg)  # before either decoder: their time grows with the scans
    plan = jpeg_plan(data, cfg) if fmt == "JPEG" else None
    if plan is not None:
        with DECODE_MEMORY.hold(_jpeg_bytes(plan), cfg.decode_memory_bytes):
            arr = jpeg_decode_scaled(data, plan)
            if arr is not None:
                im = to_pillow(arr, plan)
                del arr
                return _finish(
                    im, plan.orig_width, plan.orig_height, plan.orientation, cfg, encoder
                )
    try:
        im = Image.open(io.BytesIO(data), formats=[fmt])
        w, h = im.size
        if w * h > cfg.max_pixels:  # before getexif: bombs are refused unparsed
            raise IngestError("decompression_bomb", f"{w}x{h} > max_pixels {cfg.max_pixels}")
        if fmt == "JPEG":  # its EXIF is in the header; draft mode decodes less
            orientation = im.getexif().get(_EXIF_ORIENTATION_TAG, 1)
            ow, oh = _check_size(w, h, orientation, cfg)
            tw, th = _decoded_target(ow, oh, orientation, cfg)
            scale = max(tw / w, th / h)
            need = (max(1, math.ceil(w * scale)), max(1, math.ceil(h * scale)))
            im.draft("RGB", need)
    except IngestError:
        raise
    except Image.DecompressionBombError as e:
        raise IngestError("decompression_bomb", str(e)) from None
    except Exception as e:  # noqa: BLE001 - PIL raises many types for damaged data
        raise IngestError("corrupt", f"{type(e).__name__}: {e}") from None
    with DECODE_MEMORY.hold(_pillow_bytes(im), cfg.decode_memory_bytes):
        try:
            if fmt != "JPEG":  # a PNG's getexif decodes the whole image (an eXIf after IDAT)
                orientation = im.getexif().get(_EXIF_ORIENTATION_TAG, 1)
                ow, oh = _check_size(w, h, orientation, cfg)
            im.load()
        except IngestError:
            raise
        except Image.DecompressionBombError as e:
            raise IngestError("decompression_bomb", str(e)) from None
        except MemoryError:
            raise _out_of_memory(im.size) from None
        except Exception as e:  # noqa: BLE001 - PIL raises many types for damaged data
            raise IngestError("corrupt", f"{type(e).__name__}: {e}") from None
        return _finish(im, ow, oh, orientation, cfg, encoder)


def _finish(
    im: Image.Image, ow: int, oh: int, orientation: int, cfg: IngestConfig, encoder: str
) -> tuple[bytes, int, int]:
    """The decoded image cropped, resized and encoded: :func:`process_image`'s result."""
    try:
        target = _decoded_target(ow, oh, orientation, cfg)
        out = crop_resize(im, _EXIF_TRANSPOSE.get(orientation), target)
        return encode(out, cfg, encoder), ow, oh
    except MemoryError:
        raise _out_of_memory(im.size) from None
    except Exception as e:  # noqa: BLE001 - lazily-decoded frames can still fail here
        raise IngestError("corrupt", f"{type(e).__name__}: {e}") from None


class DecodeMemory:
    """The decoded pixels every decode thread of the process holds at once, against one budget
    (``ingest.decode_memory_bytes``): a decode waits until its estimate fits beside the others'
    (or runs alone when it is bigger), so 16 threads each decoding a 100 Mpx PNG of 290 KB hold
    one or two such images, never 16."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self.used = 0
        self.peak = 0

    @contextlib.contextmanager
    def hold(self, nbytes: int, budget: int):
        with self._cv:
            while self.used and self.used + nbytes > budget:
                self._cv.wait()
            self.used += nbytes
            self.peak = max(self.peak, self.used)
        try:
            yield
        finally:
            with self._cv:
                self.used -= nbytes
                self._cv.notify_all()


DECODE_MEMORY = DecodeMemory()


def _jpeg_bytes(plan: JpegPlan) -> int:
    """What a DCT-scaled decode holds: the decoded array (at most one eighth per side above the
    size asked for, 3 bytes a pixel) and its Pillow copy."""
    w = plan.min_width + plan.width // 8 + 1
    h = plan.min_height + plan.height // 8 + 1
    return w * h * 3 * 2


def _pillow_bytes(im: Image.Image) -> int:
    """What Pillow's decode holds: the image (4 bytes a pixel for RGB, RGBA, I, F, ...; 1 for L
    and P; 2 for I;16) and one converted copy (P to RGBA, CMYK to RGB: 4 bytes a pixel)."""
    w, h = im.size
    mode = im.mode
    per = 1 if mode in ("1", "L", "P") else 2 if mode.startswith("I;16") else 4
    return w * h * (per + 4)
