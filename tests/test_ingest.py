"""The image ingest stage against a real loopback HTTP server and real files on disk."""

from __future__ import annotations

import hashlib
import io
import socket
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageFile, ImageOps

from flowmatch_assets.ingest import decode as ingest
from flowmatch_assets.ingest.batch import count_reasons, ingest_rows
from flowmatch_assets.ingest.decode import process_image, sniff_format
from flowmatch_assets.ingest.fetch import fetch_bytes
from flowmatch_assets.ingest.images import IngestConfig, IngestError
from tests.http_fixtures import LoopbackHTTPServer, Reply

MAX_BYTES = 300_000


# --------------------------------------------------------------------------------------------
# Test images
# --------------------------------------------------------------------------------------------


def _scene(w: int, h: int, seed: int = 0) -> Image.Image:
    """A photo-ish RGB image: gradients, shapes and mild noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    arr = np.stack([255 * x / w, 255 * y / h, 128 + 60 * np.sin(x / 37.0 + y / 53.0)], axis=-1)
    arr += rng.normal(0, 6, size=arr.shape)
    im = Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8), "RGB")
    d = ImageDraw.Draw(im)
    d.ellipse((w // 4, h // 4, w // 2, h // 2), fill=(220, 40, 40))
    d.rectangle((w // 2, h // 2, 3 * w // 4, 7 * h // 8), fill=(30, 30, 200))
    return im


def _enc(im: Image.Image, fmt: str, **kw: object) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def _exif_rotated_jpeg() -> bytes:
    """600x400 stored pixels, left half red / right half blue, EXIF orientation 6."""
    im = Image.new("RGB", (600, 400), (0, 0, 255))
    im.paste((255, 0, 0), (0, 0, 300, 400))
    exif = Image.Exif()
    exif[0x0112] = 6
    return _enc(im, "JPEG", quality=95, exif=exif.tobytes())


def _rgba_png() -> bytes:
    """Transparent everywhere except an opaque red centre."""
    im = Image.new("RGBA", (400, 400), (0, 255, 0, 0))
    im.paste((255, 0, 0, 255), (150, 150, 250, 250))
    return _enc(im, "PNG")


def _palette_png() -> bytes:
    """Palette image whose index 0 (most of it) is transparent; a red square is opaque."""
    im = Image.new("P", (300, 300), 0)
    im.putpalette([0, 255, 0, 255, 0, 0] + [0] * (256 * 3 - 6))
    ImageDraw.Draw(im).rectangle((100, 100, 200, 200), fill=1)
    return _enc(im, "PNG", transparency=0)


def _png16() -> bytes:
    """16-bit grayscale at half scale (32768): must come out mid-grey, not clipped white."""
    arr = np.full((300, 400), 32768, dtype=np.uint16)
    return _enc(Image.fromarray(arr), "PNG")


def _cmyk_jpeg() -> bytes:
    return _enc(_scene(400, 300).convert("CMYK"), "JPEG", quality=90)


def _bomb_png(w: int = 100_000, h: int = 100_000) -> bytes:
    """A tiny PNG whose header claims w x h pixels."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 64)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


@pytest.fixture(scope="module")
def images() -> dict[str, bytes]:
    jpeg = _enc(_scene(640, 480), "JPEG", quality=90)
    return {
        "jpeg": jpeg,
        "png": _enc(_scene(300, 500, 1), "PNG"),
        "webp": _enc(_scene(500, 300, 2), "WEBP", quality=90),
        "gif": _enc(_scene(320, 280, 3).convert("P"), "GIF"),
        "bmp": _enc(_scene(300, 300, 4), "BMP"),
        "tiff": _enc(_scene(200, 260, 5), "TIFF"),
        "rgba": _rgba_png(),
        "gray": _enc(_scene(400, 300, 6).convert("L"), "JPEG", quality=90),
        "cmyk": _cmyk_jpeg(),
        "png16": _png16(),
        "palette": _palette_png(),
        "exif6": _exif_rotated_jpeg(),
        "truncated": jpeg[: len(jpeg) * 6 // 10],
        "bomb": _bomb_png(),
        "small": _enc(_scene(50, 50), "JPEG"),
    }


def _cfg(**kw: object) -> IngestConfig:
    base: dict[str, object] = dict(
        threads=4,
        connect_timeout_s=1.0,
        read_timeout_s=0.3,
        retries=2,
        backoff_s=0.01,
        max_bytes=MAX_BYTES,
        allow_networks=["127.0.0.0/8"],  # the loopback test servers
    )
    base.update(kw)
    return IngestConfig(**base)


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _decode(data: bytes) -> Image.Image:
    im = Image.open(io.BytesIO(data))
    im.load()
    return im


# --------------------------------------------------------------------------------------------
# End to end: one shard's worth of good and bad rows
# --------------------------------------------------------------------------------------------

IMG = {"Content-Type": "image/jpeg"}

# name -> (expected outcome/reason, orig size or None)
EXPECTED: dict[str, tuple[str, tuple[int, int] | None]] = {
    "jpeg": ("stored", (640, 480)),
    "png": ("stored", (300, 500)),
    "webp": ("stored", (500, 300)),
    "gif": ("stored", (320, 280)),
    "bmp": ("stored", (300, 300)),
    "tiff": ("stored", (200, 260)),
    "rgba": ("stored", (400, 400)),
    "gray": ("stored", (400, 300)),
    "cmyk": ("stored", (400, 300)),
    "png16": ("stored", (400, 300)),
    "palette": ("stored", (300, 300)),
    "exif6": ("stored", (400, 600)),
    "flaky": ("stored", (640, 480)),
    "redirect_ok": ("stored", (640, 480)),
    "file_ok": ("stored", (640, 480)),
    "missing": ("http_404", None),
    "down": ("http_503", None),
    "slow": ("timeout", None),
    "stalled": ("timeout", None),
    "huge_declared": ("too_large", None),
    "huge_streamed": ("too_large", None),
    "html": ("not_image", None),
    "empty": ("not_image", None),
    "truncated": ("corrupt", None),
    "bomb": ("decompression_bomb", None),
    "small": ("too_small", None),
    "redirect_file": ("redirect_refused", None),
    "redirect_loop": ("redirect_refused", None),
    "file_outside": ("file_not_allowed", None),
    "file_dotdot": ("file_not_allowed", None),
    "file_missing": ("not_found", None),
    "refused": ("connection_error", None),
    "ftp": ("bad_url", None),
    "no_url": ("bad_url", None),
}


@pytest.fixture(scope="module")
def shard(images: dict[str, bytes], tmp_path_factory: pytest.TempPathFactory):
    """Serve every case, ingest them in one call, return (results by name, server, config)."""
    root = tmp_path_factory.mktemp("files")
    allowed = root / "allowed"
    allowed.mkdir()
    (allowed / "a.jpg").write_bytes(images["jpeg"])
    (root / "outside.jpg").write_bytes(images["jpeg"])
    cfg = _cfg(file_root=str(allowed))

    with LoopbackHTTPServer() as srv:
        urls: dict[str, str | None] = {}
        for name in EXPECTED:
            if name in images:
                urls[name] = srv.add(f"/{name}", Reply(body=images[name], headers=IMG))
        urls["flaky"] = srv.add(
            "/flaky",
            lambda n: (
                Reply(status=500, body=b"oops")
                if n == 1
                else Reply(body=images["jpeg"], headers=IMG)
            ),
        )
        urls["missing"] = srv.url("/nothing-here")
        urls["down"] = srv.add("/down", Reply(status=503, body=b"busy"))
        urls["slow"] = srv.add("/slow", Reply(body=images["jpeg"], headers=IMG, delay_s=0.8))
        urls["stalled"] = srv.add(
            "/stalled", Reply(body=images["jpeg"], headers=IMG, body_delay_s=0.8)
        )
        big = images["jpeg"] + b"\x00" * MAX_BYTES
        urls["huge_declared"] = srv.add("/huge_declared", Reply(body=big, headers=IMG))
        urls["huge_streamed"] = srv.add(
            "/huge_streamed", Reply(body=big, headers=IMG, content_length=-1)
        )
        urls["html"] = srv.add(
            "/html", Reply(body=b"<!DOCTYPE html><html><body>Not here</body></html>", headers=IMG)
        )
        urls["empty"] = srv.add("/empty", Reply(body=b"", headers=IMG))
        urls["redirect_ok"] = srv.add(
            "/redirect_ok", Reply(status=302, headers={"Location": "/r2"})
        )
        srv.add("/r2", Reply(status=301, headers={"Location": srv.url("/jpeg")}))
        urls["redirect_file"] = srv.add(
            "/redirect_file", Reply(status=302, headers={"Location": f"file://{allowed}/a.jpg"})
        )
        urls["redirect_loop"] = srv.add(
            "/redirect_loop", Reply(status=307, headers={"Location": "/redirect_loop"})
        )
        urls["file_ok"] = (allowed / "a.jpg").as_uri()
        urls["file_outside"] = (root / "outside.jpg").as_uri()
        urls["file_dotdot"] = f"file://{allowed}/../outside.jpg"
        urls["file_missing"] = (allowed / "nope.jpg").as_uri()
        urls["refused"] = f"http://127.0.0.1:{_free_port()}/x.jpg"
        urls["ftp"] = "ftp://example.com/a.jpg"
        urls["no_url"] = None

        rows = [{"id": name, "url": urls[name], "caption": "c"} for name in EXPECTED]
        calls: list[tuple[int, int]] = []
        results = ingest_rows(rows, cfg, progress=lambda d, t: calls.append((d, t)))
        yield {r.id: r for r in results}, results, srv, cfg, calls


def test_every_row_gets_its_outcome_and_reason(shard) -> None:
    by_id, results, _, _, _ = shard
    assert [r.id for r in results] == list(EXPECTED)  # input order, one result per row
    got = {name: (r.outcome if r.outcome == "stored" else r.reason) for name, r in by_id.items()}
    assert got == {name: exp for name, (exp, _) in EXPECTED.items()}
    for name, (exp, size) in EXPECTED.items():
        r = by_id[name]
        if exp == "stored":
            assert (r.orig_width, r.orig_height) == size, name
            im = _decode(r.image)
            assert (im.format, im.mode, im.size) == ("JPEG", "RGB", (256, 256)), name
            assert r.reason is None and r.detail is None
        else:
            assert r.image is None and r.md5 is None and r.detail, name


def test_counts_and_progress(shard) -> None:
    _, results, _, _, calls = shard
    counts = count_reasons(results)
    assert counts["stored"] == sum(1 for e, _ in EXPECTED.values() if e == "stored")
    assert sum(counts.values()) == len(EXPECTED)
    assert [d for d, _ in calls] == list(range(1, len(EXPECTED) + 1))
    assert {t for _, t in calls} == {len(EXPECTED)}


def test_md5_is_of_downloaded_bytes(shard, images) -> None:
    by_id = shard[0]
    assert by_id["jpeg"].md5 == hashlib.md5(images["jpeg"]).hexdigest()
    assert by_id["file_ok"].md5 == by_id["jpeg"].md5
    assert by_id["png"].md5 == hashlib.md5(images["png"]).hexdigest()


def test_retries_5xx_and_timeouts_but_not_4xx(shard) -> None:
    _, _, srv, cfg, _ = shard
    assert srv.hits("/flaky") == 2  # 500 then 200
    assert srv.hits("/down") == cfg.retries + 1
    assert srv.hits("/slow") == cfg.retries + 1
    assert srv.hits("/nothing-here") == 1
    assert srv.hits("/redirect_ok") == 1 and srv.hits("/r2") == 1
    assert srv.hits("/redirect_loop") == cfg.max_redirects + 1


def test_exif_orientation_is_applied(shard) -> None:
    """Orientation 6 (rotate 90 clockwise): the stored left half (red) becomes the top."""
    arr = np.asarray(_decode(shard[0]["exif6"].image)).astype(int)
    top, bottom = arr[:100].mean(axis=(0, 1)), arr[-100:].mean(axis=(0, 1))
    assert top[0] > 200 and top[2] < 60, top
    assert bottom[2] > 200 and bottom[0] < 60, bottom


@pytest.mark.parametrize("name", ["rgba", "palette"])
def test_transparency_composited_over_white(shard, name: str) -> None:
    arr = np.asarray(_decode(shard[0][name].image)).astype(int)
    assert (arr[:20, :20] > 245).all()  # transparent corner -> white, not black or green
    centre = arr[118:138, 118:138].mean(axis=(0, 1))
    assert centre[0] > 200 and centre[1] < 60 and centre[2] < 60, centre


def test_16bit_and_cmyk_colours(shard, images) -> None:
    grey = np.asarray(_decode(shard[0]["png16"].image)).astype(int)
    assert abs(grey.mean() - 128) < 3  # scaled 16 -> 8 bit, not clipped to 255
    cmyk = np.asarray(_decode(shard[0]["cmyk"].image)).astype(int)
    ref = np.asarray(
        ImageOps.fit(Image.open(io.BytesIO(images["cmyk"])).convert("RGB"), (256, 256))
    ).astype(int)
    assert np.abs(cmyk - ref).mean() < 12  # colours survive CMYK -> RGB


# --------------------------------------------------------------------------------------------
# Focused checks
# --------------------------------------------------------------------------------------------


def test_draft_decode_matches_full_decode() -> None:
    """The DCT-scaled fast path looks like full decode + LANCZOS resize + centre crop."""
    src = _enc(_scene(2400, 1500, 7), "JPEG", quality=90)
    fast, w, h = process_image(src, _cfg())
    assert (w, h) == (2400, 1500)
    full = Image.open(io.BytesIO(src)).convert("RGB")
    ref = ImageOps.fit(full, (256, 256), Image.Resampling.LANCZOS)
    diff = np.abs(np.asarray(_decode(fast)).astype(int) - np.asarray(ref).astype(int))
    assert diff.mean() < 4.0, diff.mean()


@pytest.mark.parametrize(("fmt", "pil"), [("webp", "WEBP"), ("png", "PNG"), ("jpeg", "JPEG")])
def test_output_formats(fmt: str, pil: str) -> None:
    out, _, _ = process_image(_enc(_scene(700, 300), "JPEG"), _cfg(image_format=fmt, size=64))
    im = _decode(out)
    assert (im.format, im.mode, im.size) == (pil, "RGB", (64, 64))


def test_bad_image_format_is_a_config_error() -> None:
    # refused when the settings are read (one list: ingest/images.py IMAGE_FORMATS) ...
    with pytest.raises(ValueError, match="image_format 'gif' is not supported; use jpeg, webp"):
        _cfg(image_format="gif")
    # ... and by the stage before any row, for a config changed after it was validated
    cfg = _cfg()
    cfg.image_format = "gif"
    with pytest.raises(ValueError, match="image_format 'gif' is not supported"):
        ingest_rows([{"id": "a", "url": "http://x/a"}], cfg)


def test_max_pixels_checked_before_decoding() -> None:
    data = _enc(_scene(1000, 800), "JPEG")
    with pytest.raises(IngestError) as e:
        process_image(data, _cfg(max_pixels=500_000))
    assert e.value.reason == "decompression_bomb"
    assert process_image(data, _cfg(max_pixels=800_000))[1:] == (1000, 800)


def test_truncated_images_are_never_accepted(monkeypatch, images) -> None:
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    with pytest.raises(RuntimeError, match="LOAD_TRUNCATED_IMAGES"):
        process_image(images["jpeg"], _cfg())


def test_small_upscaled_but_tiny_refused() -> None:
    out, w, h = process_image(_enc(_scene(100, 180), "PNG"), _cfg())
    assert (w, h) == (100, 180) and _decode(out).size == (256, 256)
    with pytest.raises(IngestError) as e:
        process_image(_enc(_scene(100, 63), "PNG"), _cfg())
    assert e.value.reason == "too_small"


@pytest.mark.parametrize(
    ("data", "fmt"),
    [
        (b"\xff\xd8\xff\xe0", "JPEG"),
        (b"\x89PNG\r\n\x1a\n", "PNG"),
        (b"RIFF\x00\x00\x00\x00WEBPVP8 ", "WEBP"),
        (b"GIF89a", "GIF"),
        (b"BM\x00\x00", "BMP"),
        (b"II*\x00", "TIFF"),
        (b"MM\x00*", "TIFF"),
        (b"<html>", None),
        (b"", None),
    ],
)
def test_sniff_format(data: bytes, fmt: str | None) -> None:
    assert sniff_format(data) == fmt


def test_fetch_bytes_without_pool_and_file_root_unset(tmp_path: Path, images) -> None:
    with LoopbackHTTPServer() as srv:
        url = srv.add("/a", Reply(body=images["png"]))
        assert fetch_bytes(url, _cfg()) == images["png"]
    p = tmp_path / "a.png"
    p.write_bytes(images["png"])
    with pytest.raises(IngestError) as e:
        fetch_bytes(p.as_uri(), _cfg())
    assert e.value.reason == "file_not_allowed" and "file_root" in e.value.detail


# --------------------------------------------------------------------------------------------
# simplejpeg (libjpeg-turbo M/8 scaling) fast path vs the Pillow draft path
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["jpeg", "gray", "exif6"])
def test_simplejpeg_path_matches_pillow_path(monkeypatch, images, name: str) -> None:
    pytest.importorskip("simplejpeg")
    fast, fw, fh = process_image(images[name], _cfg())
    monkeypatch.setattr(ingest, "simplejpeg", None)
    slow, sw, sh = process_image(images[name], _cfg())
    assert (fw, fh) == (sw, sh)
    a, b = _decode(fast), _decode(slow)
    assert a.mode == b.mode == "RGB" and a.size == b.size == (256, 256)
    diff = np.abs(np.asarray(a).astype(int) - np.asarray(b).astype(int))
    assert diff.mean() < 2.5, diff.mean()


def test_m8_scaled_decode_matches_full_decode() -> None:
    """A 3/8 DCT scale (short side 700 -> 263) still looks like full decode + LANCZOS."""
    pytest.importorskip("simplejpeg")
    src = _enc(_scene(1100, 700, 8), "JPEG", quality=90)
    fast, _, _ = process_image(src, _cfg())
    ref = ImageOps.fit(Image.open(io.BytesIO(src)).convert("RGB"), (256, 256), Image.LANCZOS)
    diff = np.abs(np.asarray(_decode(fast)).astype(int) - np.asarray(ref).astype(int))
    assert diff.mean() < 4.0, diff.mean()


@pytest.mark.parametrize("orientation", range(1, 9))
def test_jpeg_orientation_parser_matches_pillow(orientation: int) -> None:
    exif = Image.Exif()
    exif[0x0110] = "camera"  # another IFD0 entry before the orientation
    exif[0x0112] = orientation
    data = _enc(Image.new("RGB", (64, 32)), "JPEG", exif=exif.tobytes())
    assert Image.open(io.BytesIO(data)).getexif().get(0x0112, 1) == orientation
    assert ingest._jpeg_orientation(data) == orientation
    # Big-endian TIFF header, one SHORT entry.
    mm = b"MM\x00*" + struct.pack(">IH", 8, 1) + struct.pack(">HHIHH", 0x0112, 3, 1, orientation, 0)
    app1 = b"Exif\x00\x00" + mm + struct.pack(">I", 0)
    seg = b"\xff\xe1" + struct.pack(">H", len(app1) + 2) + app1
    plain = _enc(Image.new("RGB", (64, 32)), "JPEG")
    assert ingest._jpeg_orientation(plain) == 1
    assert ingest._jpeg_orientation(plain[:2] + seg + plain[2:]) == orientation


def test_damaged_jpeg_is_corrupt_on_both_paths(monkeypatch, images) -> None:
    jpeg = images["jpeg"]
    garbled = bytearray(jpeg)
    garbled[len(jpeg) // 2 : len(jpeg) // 2 + 64] = b"\x00" * 64
    cut = jpeg[: len(jpeg) - 200]
    for lib in ("present", None):
        if lib is None:
            monkeypatch.setattr(ingest, "simplejpeg", None)
        for data in (cut, images["truncated"]):
            with pytest.raises(IngestError) as e:
                process_image(data, _cfg())
            assert e.value.reason == "corrupt"
        try:  # libjpeg may resync past zeroed bytes: then it must at least be a valid image
            out, _, _ = process_image(bytes(garbled), _cfg())
            assert _decode(out).size == (256, 256)
        except IngestError as err:
            assert err.reason == "corrupt"


def test_header_checks_run_before_the_fast_decode(monkeypatch) -> None:
    sj = pytest.importorskip("simplejpeg")
    calls: list[int] = []
    monkeypatch.setattr(sj, "decode_jpeg", lambda *a, **k: calls.append(1))
    with pytest.raises(IngestError) as e:
        process_image(_enc(_scene(1000, 800), "JPEG"), _cfg(max_pixels=500_000))
    assert e.value.reason == "decompression_bomb" and not calls


def test_total_deadline_bounds_trickling_and_stalled_servers(images) -> None:
    """A server that trickles a byte every 0.2 s forever, or stalls before its headers, holds a
    row at most ``deadline_s`` (retries included); the other rows of the shard are unaffected."""
    import time

    cfg = _cfg(deadline_s=2.0, read_timeout_s=1.0, retries=3)
    with LoopbackHTTPServer() as srv:
        rows = [
            {
                "id": "trickle",
                "url": srv.add("/t", Reply(body=b"\xff\xd8\xff", trickle_s=0.2, content_length=-1)),
            },
            {
                "id": "trickle_len",
                "url": srv.add(
                    "/tl", Reply(body=b"\xff\xd8\xff", trickle_s=0.2, content_length=1000)
                ),
            },
            {"id": "stall", "url": srv.add("/s", Reply(body=images["jpeg"], delay_s=30))},
            {"id": "good", "url": srv.add("/g", Reply(body=images["jpeg"], headers=IMG))},
        ]
        t0 = time.monotonic()
        results = ingest_rows(rows, cfg)
        wall = time.monotonic() - t0
    by_id = {r.id: r for r in results}
    assert [by_id[k].reason for k in ("trickle", "trickle_len", "stall")] == ["timeout"] * 3
    assert "deadline 2s" in by_id["trickle"].detail
    assert by_id["good"].outcome == "stored"
    assert by_id["good"].bytes_downloaded == len(images["jpeg"])
    assert wall < 2.0 + 0.7, wall  # the deadline, plus one socket read at most


def test_relative_file_url_resolves_against_file_root(tmp_path: Path, images) -> None:
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "a.jpg").write_bytes(images["jpeg"])
    cfg = _cfg(file_root=str(tmp_path))
    assert fetch_bytes("file:images/a.jpg", cfg) == images["jpeg"]
    with pytest.raises(IngestError) as e:
        fetch_bytes("file:../a.jpg", cfg)
    assert e.value.reason == "file_not_allowed"
