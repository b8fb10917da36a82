"""Hostile copies of the three source kinds (and PD12M rows pointing at non-public addresses),
as a dataset someone downloaded could be: links and ``../`` out of the location, a link to
``/dev/zero``, FIFOs, unreadable files, truncated and lying tars, a damaged parquet footer, a
container that breaks after registration, captions that are not text, odd file names, files
above the limits. Every writer returns the expected final outcome of each sample id
(``stored``, ``failed:<reason>``, ``filtered:<reason>``) and what it skipped at registration.

Everything secret lives outside the sources (``outside/``) or behind a loopback server, marked
with :data:`MARKERS`: none of those bytes may reach a shard, a caption or the catalog.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import struct
import tarfile
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

SECRET = "OUTSIDE-SECRET-9d1c"  # in every file outside the sources
TOKEN = "LOOPBACK-TOKEN-51ab"  # what a loopback service hands out
MARKERS = (SECRET.encode(), TOKEN.encode())
MAX_BYTES = 300_000  # ingest.max_bytes for these tests: an image above it is too_large


def jpeg(seed: int, size: tuple[int, int] = (320, 288), quality: int = 85) -> bytes:
    """A distinct picture (a gradient with noise) as JPEG bytes."""
    rng = np.random.default_rng(seed)
    w, h = size
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x * 255 / w, y * 255 / h, (x + y) * 127 / (w + h)], -1)
    a = np.clip(base + rng.normal(0, 20, base.shape) + rng.uniform(0, 80, 3), 0, 255)
    buf = io.BytesIO()
    Image.fromarray(a.astype(np.uint8)).save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def write_outside(tmp: Path) -> dict[str, Path]:
    """Files outside every source: a picture, its caption and a 'passwd', all secret."""
    out = tmp / "outside"
    out.mkdir(parents=True, exist_ok=True)
    (out / "secret.jpg").write_bytes(jpeg(999))
    (out / "secret.txt").write_text(f"{SECRET} a caption from outside\n")
    (out / "passwd").write_text(f"root:x:0:0:{SECRET}:/root:/bin/bash\n")
    t = pa.table({"image": [{"bytes": jpeg(998), "path": None}], "text": [SECRET]})
    pq.write_table(t, out / "secret.parquet")
    with tarfile.open(out / "secret.tar", "w") as tar:
        _add(tar, "s0.jpg", jpeg(997))
        _add(tar, "s0.txt", SECRET.encode())
    return {"image": out / "secret.jpg", "caption": out / "secret.txt"}


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def _pair(d: Path, name: str, seed: int, caption: str | bytes) -> None:
    (d / f"{name}.jpg").write_bytes(jpeg(seed))
    side = d / f"{name}.txt"
    side.write_bytes(caption if isinstance(caption, bytes) else caption.encode())


def write_folder(d: Path, outside: Path, unreadable: bool) -> dict[str, str]:
    """An image folder with sidecars and a metadata.jsonl, hostile in every way a folder can
    be. ``unreadable``: files the test process cannot read (its permissions are enforced)."""
    d.mkdir(parents=True)
    exp: dict[str, str] = {}
    for i, name in enumerate(["good1", "odd #1", "what?", "with space ünï"]):
        _pair(d, name, i, f"a good picture number {i}")
        exp[f"{name}.jpg"] = "stored"
    # links: out of the folder (image, caption, a device) and inside it
    os.symlink(outside / "secret.jpg", d / "link_out.jpg")
    (d / "link_out.txt").write_text("a link to a picture outside")
    exp["link_out.jpg"] = "failed:outside_source"
    (d / "cap_out.jpg").write_bytes(jpeg(10))
    os.symlink(outside / "secret.txt", d / "cap_out.txt")
    exp["cap_out.jpg"] = "failed:outside_source"
    os.symlink("/dev/zero", d / "zero.jpg")
    (d / "zero.txt").write_text("endless zeros")
    exp["zero.jpg"] = "failed:outside_source"
    os.symlink("good1.jpg", d / "link_in.jpg")  # inside: read (the same bytes as good1)
    (d / "link_in.txt").write_text("the first picture again, by a link")
    exp["link_in.jpg"] = "filtered:duplicate_content"
    # special files: a FIFO image, a FIFO caption
    os.mkfifo(d / "fifo.jpg")
    (d / "fifo.txt").write_text("a pipe, not a picture")
    exp["fifo.jpg"] = "failed:not_regular_file"
    (d / "fifocap.jpg").write_bytes(jpeg(11))
    os.mkfifo(d / "fifocap.txt")
    exp["fifocap.jpg"] = "failed:not_regular_file"
    # sizes past the limits (sparse: nothing is written), a caption that is not UTF-8
    with open(d / "big.jpg", "wb") as f:
        f.truncate(MAX_BYTES + 1)
    (d / "big.txt").write_text("a huge file")
    exp["big.jpg"] = "failed:too_large"
    (d / "bigcap.jpg").write_bytes(jpeg(12))
    with open(d / "bigcap.txt", "wb") as f:
        f.truncate((1 << 20) + 1)
    exp["bigcap.jpg"] = "failed:too_large"
    _pair(d, "latin1", 13, "caf\xe9 au lait".encode("latin-1"))
    exp["latin1.jpg"] = "failed:bad_caption"
    if unreadable:
        _pair(d, "locked", 14, "a picture nobody may read")
        os.chmod(d / "locked.jpg", 0)
        exp["locked.jpg"] = "failed:unreadable"
        _pair(d, "lockedcap", 15, "a caption nobody may read")
        os.chmod(d / "lockedcap.txt", 0)
        exp["lockedcap.jpg"] = "failed:unreadable"
    # metadata.jsonl: traversal, an absolute path, non-UTF-8, captions of other types
    m = d / "meta"
    m.mkdir()
    for n in (1, 5, 6, 7):
        (m / f"m{n}.jpg").write_bytes(jpeg(20 + n))
    lines = [
        json.dumps({"file_name": "m1.jpg", "text": "a caption from the jsonl"}).encode(),
        json.dumps({"file_name": "../../outside/secret.jpg", "text": "climbs out"}).encode(),
        json.dumps({"file_name": str(outside / "passwd"), "text": "absolute"}).encode(),
        b'{"file_name": "m4.jpg", "text": "caf\xe9"}',
        json.dumps({"file_name": "m5.jpg", "text": 42}).encode(),
        json.dumps({"file_name": "m6.jpg", "text": ["the first caption", "another"]}).encode(),
        json.dumps({"file_name": "m7.jpg", "text": {"en": "a mapping"}}).encode(),
    ]
    (m / "metadata.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    exp.update(
        {
            "meta/m1.jpg": "stored",
            "meta/metadata.jsonl#L2": "failed:outside_source",
            "meta/metadata.jsonl#L3": "failed:outside_source",
            "meta/metadata.jsonl#L4": "failed:bad_metadata",
            "meta/m5.jpg": "failed:bad_caption",
            "meta/m6.jpg": "stored",
            "meta/m7.jpg": "failed:bad_caption",
        }
    )
    return exp


def _hf(rows: list[dict], caption_type: pa.DataType) -> pa.Table:
    schema = pa.schema(
        [
            ("image", pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
            ("text", caption_type),
        ]
    )
    return pa.Table.from_pylist(rows, schema=schema)


def write_parquet(d: Path, outside: Path) -> tuple[dict[str, str], dict[str, str], Path]:
    """Parquet files with captions of every type, a damaged footer, a link out, and a file that
    will break after registration. Returns (expected outcomes, expected skipped reasons by
    file, the file to break later)."""
    d.mkdir(parents=True)
    img = lambda seed, path=None: {"bytes": jpeg(seed), "path": path}  # noqa: E731
    pq.write_table(
        _hf(
            [
                {"image": img(30), "text": "a plain caption"},
                {"image": img(31), "text": None},
                {
                    "image": {"bytes": None, "path": str(outside / "secret.jpg")},
                    "text": "kept elsewhere",
                },
            ],
            pa.string(),
        ),
        d / "strings #1 ?.parquet",
    )
    pq.write_table(
        _hf(
            [
                {"image": img(32), "text": b"a caption as UTF-8 bytes"},
                {"image": img(33), "text": "caf\xe9".encode("latin-1")},
            ],
            pa.binary(),
        ),
        d / "bytes.parquet",
    )
    pq.write_table(
        _hf(
            [
                {"image": img(34), "text": ["the first caption", "a second"]},
                {"image": img(35), "text": []},
            ],
            pa.list_(pa.string()),
        ),
        d / "lists.parquet",
    )
    pq.write_table(_hf([{"image": img(36), "text": 7}], pa.int64()), d / "ints.parquet")
    good = (d / "bytes.parquet").read_bytes()
    lie = (2**31 - 1).to_bytes(4, "little")  # the footer length points before the file
    (d / "corrupt.parquet").write_bytes(good[:-8] + lie + b"PAR1")
    os.symlink(outside / "secret.parquet", d / "link.parquet")
    later = d / "later.parquet"
    pq.write_table(
        _hf(
            [
                {"image": img(37), "text": "fine at first"},
                {"image": img(38), "text": "fine at first too"},
            ],
            pa.string(),
        ),
        later,
    )
    exp = {
        "strings #1 ?/0": "stored",
        "strings #1 ?/1": "failed:missing_caption",
        "strings #1 ?/2": "failed:missing_image",
        "bytes/0": "stored",
        "bytes/1": "failed:bad_caption",
        "lists/0": "stored",
        "lists/1": "failed:missing_caption",
        "ints/0": "failed:bad_caption",
        "later/0": "failed:corrupt_container",
        "later/1": "failed:corrupt_container",
    }
    skipped = {"corrupt.parquet": "corrupt_container", "link.parquet": "outside_source"}
    return exp, skipped, later


def _tar(path: Path, samples: list[dict[str, bytes]]) -> None:
    with tarfile.open(path, "w") as tar:
        for s in samples:
            for name, data in s.items():
                _add(tar, name, data)


def write_webdataset(d: Path, outside: Path) -> tuple[dict[str, str], dict[str, str], Path]:
    """WebDataset tars: odd names, captions that are not text, a caption member past the
    limit, a member name with ``../``, a truncated tar, a tar whose member lies about its size,
    a link out, and a tar that will be cut after registration. Returns (expected outcomes,
    expected skipped reasons by tar, the tar to cut later)."""
    d.mkdir(parents=True)
    _tar(
        d / "shard#1.tar",
        [
            {"k0.jpg": jpeg(40), "k0.txt": b"a plain caption"},
            {"k1.jpg": jpeg(41), "k1.txt": "caf\xe9".encode("latin-1")},
            {"k2.jpg": jpeg(42), "k2.json": json.dumps({"caption": 5}).encode()},
            {"k3.jpg": jpeg(43), "k3.txt": b"x" * ((1 << 20) + 1)},
            {"../../escape.jpg": jpeg(44), "../../escape.txt": b"a member named out of the tar"},
            {"k5.jpg": jpeg(45), "k5.json": b"\xff\xfe not json"},
        ],
    )
    whole = io.BytesIO()
    with tarfile.open(fileobj=whole, mode="w") as tar:
        for i in range(3):
            _add(tar, f"t{i}.jpg", jpeg(50 + i))
            _add(tar, f"t{i}.txt", b"a caption")
    raw = whole.getvalue()
    (d / "truncated.tar").write_bytes(raw[: len(raw) // 2])
    lying = bytearray(raw)  # the second member's header claims 10 GB (checksum fixed)
    info = tarfile.TarInfo("t0.txt")
    info.size = 10 * 1024**3
    hdr = info.tobuf(format=tarfile.GNU_FORMAT)
    first = raw.index(b"t0.txt")  # its header starts at its name
    lying[first : first + 512] = hdr[:512]
    (d / "lying.tar").write_bytes(bytes(lying))
    os.symlink(outside / "secret.tar", d / "link.tar")
    later = d / "cut_later.tar"
    _tar(later, [{f"c{i}.jpg": jpeg(60 + i), f"c{i}.txt": b"a caption"} for i in range(3)])
    exp = {
        "k0": "stored",
        "k1": "failed:bad_caption",
        "k2": "failed:bad_caption",
        "k3": "failed:too_large",
        "../../escape": "stored",
        "k5": "failed:bad_metadata",
        "c0": "stored",
        "c1": "failed:corrupt_container",
        "c2": "failed:corrupt_container",
    }
    skipped = {
        "truncated.tar": "corrupt_container",
        "lying.tar": "corrupt_container",
        "link.tar": "outside_source",
    }
    return exp, skipped, later


def cut(tar: Path) -> None:
    """Cut a tar in the middle of its second sample's image (after it was registered)."""
    raw = tar.read_bytes()
    at = raw.index(b"c1.jpg") + 512 + 100  # inside c1.jpg's data
    tar.write_bytes(raw[:at])


def break_parquet(path: Path) -> None:
    """Damage a parquet file (after it was registered): its footer is gone."""
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])


def write_pd12m(md_dir: Path, images: Path, urls: dict[str, str]) -> dict[str, str]:
    """A PD12M metadata file: three rows whose images are files under ``images`` (file_root)
    and one row per ``urls`` item (id -> URL). Returns the ids of the file rows."""
    md_dir.mkdir(parents=True)
    images.mkdir(parents=True)
    rows = []
    for i in range(3):
        (images / f"p{i}.jpg").write_bytes(jpeg(70 + i))
        rows.append({"id": f"p{i}", "url": f"file:p{i}.jpg", "caption": f"a PD12M picture {i}"})
    rows += [{"id": k, "url": u, "caption": f"a row pointing at {k}"} for k, u in urls.items()]
    for n, r in enumerate(rows):  # the file rows' hash is their md5, as PD12M's
        md5 = hashlib.md5(jpeg(70 + n)).hexdigest() if n < 3 else f"{n:032x}"
        r.update(
            width=1024, height=768, mime_type="image/jpeg", hash=md5, license="cc0", source="test"
        )
    pq.write_table(pa.Table.from_pylist(rows), md_dir / "pd12m.000.parquet")
    return {f"p{i}": "stored" for i in range(3)}


def scan_bomb(size: tuple[int, int], scans: int) -> bytes:
    """A progressive JPEG of ``size`` (flat grey, a few KB per 1,000 scans) whose last scan is
    repeated until it has ``scans``: each one makes a decoder go over the whole image again."""
    from flowmatch_assets.ingest.jpeg_markers import _MARKER_IN_SCAN

    buf = io.BytesIO()
    Image.new("L", size, 128).save(buf, "JPEG", progressive=True, quality=90)
    data = buf.getvalue()
    starts, i = [], 2
    while data[i + 1] != 0xD9:  # split at each SOS: header, scans, EOI
        seg_end = i + 2 + int.from_bytes(data[i + 2 : i + 4], "big")
        if data[i + 1] == 0xDA:
            starts.append(i)
            seg_end = _MARKER_IN_SCAN.search(data, seg_end).start()
        i = seg_end
    last = data[starts[-1] : i]
    return data[: starts[-1]] + last * (scans - len(starts) + 1) + data[i:]


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def flat_png(w: int, h: int, colour: int = 2, depth: int = 8) -> bytes:
    """A PNG of ``w x h`` zeros (``colour`` 2: RGB, 0: grey; ``depth`` 8 or 16), compressed
    row by row without holding the pixels: 10000 x 9999 RGB is 290 KB and 300 MB decoded."""
    channels = {0: 1, 2: 3}[colour]
    row = b"\x00" * (1 + w * channels * depth // 8)
    z = zlib.compressobj(9)
    rows = row * 256
    idat = [z.compress(rows) for _ in range(h // 256)] + [z.compress(row * (h % 256)), z.flush()]
    ihdr = struct.pack(">IIBBBBB", w, h, depth, colour, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", ihdr)
        + _png_chunk(b"IDAT", b"".join(idat))
        + _png_chunk(b"IEND", b"")
    )


def float_tiff(w: int, h: int, rows_per_strip: int = 64) -> bytes:
    """A float32 greyscale TIFF of ``w x h`` zeros, deflate strips that all share one
    compressed strip: 10000 x 9999 is under 1 MB and 400 MB decoded."""
    strips = -(-h // rows_per_strip)
    data = zlib.compress(b"\x00" * (w * 4 * rows_per_strip), 9)
    tags = [
        (256, 4, 1, w),
        (257, 4, 1, h),
        (258, 3, 1, 32),
        (259, 3, 1, 8),
        (262, 3, 1, 1),
        (273, 4, strips, None),
        (277, 3, 1, 1),
        (278, 4, 1, rows_per_strip),
        (279, 4, strips, None),
        (339, 3, 1, 3),
    ]
    ifd_at = 8
    ifd_len = 2 + 12 * len(tags) + 4
    offsets_at = ifd_at + ifd_len
    counts_at = offsets_at + 4 * strips
    data_at = counts_at + 4 * strips
    out = [b"II*\x00", struct.pack("<I", ifd_at), struct.pack("<H", len(tags))]
    for tag, typ, count, value in tags:
        if tag == 273:
            value = offsets_at
        elif tag == 279:
            value = counts_at
        out.append(
            struct.pack("<HHII", tag, typ, count, value)
            if typ == 4
            else struct.pack("<HHIHH", tag, typ, count, value, 0)
        )
    out.append(struct.pack("<I", 0))
    out.append(struct.pack(f"<{strips}I", *[data_at] * strips))
    out.append(struct.pack(f"<{strips}I", *[len(data)] * strips))
    out.append(data)
    return b"".join(out)


def long_header_tar(path: Path, kind: bytes, claimed: int, real: bool) -> None:
    """A gzip tar whose first header is a GNU long name (``kind`` b"L") or a pax header (b"x")
    of ``claimed`` bytes, then a healthy sample. ``real``: the header's bytes are there (gzip
    members of 16 MiB of zeros, one compressed copy repeated: 2.5 GB is ~2.6 MB); else cut."""
    head = tarfile.TarInfo("././@LongLink")
    head.type, head.size = kind, claimed
    block = head.tobuf(format=tarfile.GNU_FORMAT)
    chunk = 16 << 20
    zeros = gzip.compress(b"\x00" * chunk, 9)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tf:
        _add(tf, "s0.jpg", jpeg(5))
        _add(tf, "s0.txt", b"a picture after the header")
    with open(path, "wb") as f:
        f.write(gzip.compress(block, 1))
        if real:
            for _ in range(claimed // chunk):
                f.write(zeros)
            rest = claimed - (claimed // chunk) * chunk
            f.write(gzip.compress(b"\x00" * (rest + (-claimed) % 512), 1))
            f.write(gzip.compress(buf.getvalue(), 1))
