"""The demo dataset: a small dataset in the exact PD12M metadata format, made procedurally.

Each good image is a coloured shape (circle, square, triangle, ...) on a textured background at a
PD12M-like size (long side 1,000-3,000 px); its caption names the shape, its colour, its size and
position and the background, so a text-to-image model trained on it has something to learn.
Mostly JPEG, some PNG, RGBA PNG and grayscale. A handful of deliberately bad rows exercise every
failure path: a missing file (404-like), a truncated JPEG, an HTML page saved as .jpg, a zero-byte
file, a tiny image whose metadata claims a large size, plus rows the metadata filters drop (a
small original, an extreme aspect ratio, an empty caption, a duplicate hash). And a few planted
near-duplicates (:data:`NEAR_COPIES`): re-encoded, resized, cropped and bordered copies of its
own images, with their own ids, files and hashes, appended after every other row of the last
metadata file, so the rest of the sample is the same with or without them.

Images are served as relative ``file:images/<id>.jpg`` URLs, resolved against the ingest's
allowed root (FLOWMATCH_FILE_ROOT, by default ``<data root>/sample``), so a data root can be moved.
No downloaded data: everything is drawn here, deterministically from a seed.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image, ImageDraw, ImageOps

from flowmatch_models.data.order import heldout_rows
from flowmatch_models.storage.atomic import atomic_path, atomic_write_bytes, atomic_write_text

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 70),
    "blue": (40, 80, 220),
    "yellow": (240, 210, 40),
    "purple": (140, 60, 190),
    "orange": (245, 140, 30),
    "white": (245, 245, 245),
    "black": (20, 20, 20),
}
BACKGROUNDS: dict[str, tuple[int, int, int]] = {
    "sandy": (214, 190, 150),
    "grey": (128, 128, 128),
    "sky blue": (135, 190, 235),
    "dark green": (30, 80, 45),
    "pale pink": (240, 200, 210),
    "navy": (25, 35, 90),
}
SHAPES = ("circle", "square", "triangle", "diamond", "star", "ring")
#: The second dataset's new shape (:func:`write_shapes2`): no caption of the first names it.
NEW_SHAPES = ("cross",)
CROSS_ARM = 0.3  # a cross's arms are 2 x 0.3 r wide
LICENSES = ("cc0-1.0", "public-domain-mark-1.0")
SOURCES = ("wikimedia", "smithsonian", "nasa", "met")
NAMESPACE = uuid.UUID("6f1c7f0e-3b9a-4c3e-9a43-0d6f1e5b7a10")
#: The planted near-duplicates: (metadata file, row) of a good row and how its copy is made
#: (:func:`near_copy`). Rows of the default sample (seed 0, 96 rows a file) that are colour
#: JPEGs, not held out by configs/tiny.yaml, and whose copies' pHashes at the stored 256 px lie
#: within 2 bits of the original's (about half the sample's crop and border copies lie 6 or more
#: bits away, as far as its closest unrelated pairs). A spec that does not draw every source
#: plants none (the tests' small samples stay as they were).
NEAR_COPIES: tuple[tuple[int, int, str], ...] = (
    (0, 11, "q40"),
    (0, 67, "half"),
    (1, 13, "crop4"),
    (1, 42, "border"),
    (2, 3, "crop4"),
)
#: The pHash bits the demo decides near duplicates at (`flowmatch catalog neardup --threshold`):
#: the planted copies lie within 2 bits of their originals, the sample's closest unrelated pairs
#: (the same shape, size and position in another colour: alike in grey) 6 to 10 bits apart, so
#: the default threshold (10) would remove 9 of its unrelated images too by the hash alone (the
#: colour check at its default tolerance keeps them: ``tests/test_demo_neardup.py``).
NEAR_THRESHOLD = 4


@dataclass
class SampleSpec:
    """How big a sample to write."""

    files: int = 3
    rows_per_file: int = 96
    seed: int = 0
    bad_rows: bool = True
    #: "crop": the demo's pictures, each shape inside the centre square the 256 px stage keeps;
    #: "sides": wider and taller pictures (1.3:1 to 2:1) whose left/right (top/bottom) shapes
    #: sit at the ends of the long side, where a centre square cuts them (draw_image), all
    #: colour JPEGs
    layout: str = "crop"
    #: append the copies of :data:`NEAR_COPIES` to the last file (when it draws all their sources)
    near_copies: bool = True


def _texture(rng: np.random.Generator, w: int, h: int, base: tuple[int, int, int]) -> Image.Image:
    """Low-frequency noise + a gradient around ``base``; cheap at any size (upsampled)."""
    lw, lh = max(8, w // 64), max(8, h // 64)
    noise = rng.normal(0, 18, size=(lh, lw, 3))
    grad = np.linspace(-20, 20, lw)[None, :, None] * rng.choice([-1, 1])
    small = np.clip(np.array(base)[None, None, :] + noise + grad, 0, 255).astype(np.uint8)
    img = Image.fromarray(small).resize((w, h), Image.BILINEAR)
    # fine grain from a child of ``rng`` (not Pillow's effect_noise, whose C rand() is process
    # state: a second sample in one process came out different); spawning leaves rng's own
    # stream where it was, so every other draw of the sample is the one before
    z = rng.spawn(1)[0].standard_normal((h, w), dtype=np.float32)
    z *= 40  # in place: the same float32 values as 128 + 40 * z, without three more
    z += 128  # full-size arrays (the sample's originals are up to 3,000 px a side)
    grain = np.clip(z, 0, 255, out=z).astype(np.uint8)
    fine = Image.fromarray(grain).convert("RGB")
    return Image.blend(img, fine, 0.06)


def _polygon(shape: str, cx: float, cy: float, r: float) -> list[tuple[float, float]]:
    if shape == "triangle":
        return [
            (cx + r * math.cos(a), cy + r * math.sin(a))
            for a in (-math.pi / 2, math.pi / 6, 5 * math.pi / 6)
        ]
    if shape == "diamond":
        return [(cx, cy - r), (cx + r, cy), (cx, cy + r), (cx - r, cy)]
    if shape == "cross":  # a plus sign: two bars of width 2 a r
        a = CROSS_ARM * r
        return [
            (cx - a, cy - r),
            (cx + a, cy - r),
            (cx + a, cy - a),
            (cx + r, cy - a),
            (cx + r, cy + a),
            (cx + a, cy + a),
            (cx + a, cy + r),
            (cx - a, cy + r),
            (cx - a, cy + a),
            (cx - r, cy + a),
            (cx - r, cy - a),
            (cx - a, cy - a),
        ]
    if shape == "star":
        pts = []
        for k in range(10):
            rr = r if k % 2 == 0 else r * 0.45
            a = -math.pi / 2 + k * math.pi / 5
            pts.append((cx + rr * math.cos(a), cy + rr * math.sin(a)))
        return pts
    raise ValueError(shape)


def draw_image(
    rng: np.random.Generator,
    shapes: tuple[str, ...] = SHAPES,
    long_sides: tuple[int, int] = (1000, 3001),
    layout: str = "crop",
) -> tuple[Image.Image, str]:
    """One procedural image and its caption (its shape one of ``shapes``, its long side in
    ``long_sides``; the defaults draw the demo sample, draw for draw). ``layout="sides"``:
    aspect 1.3-2.0, and a shape on the left/right (top/bottom) sits at that end of the long
    side, 0.05 of the short side from the edge, where the centre square does not reach."""
    if layout not in ("crop", "sides"):
        raise ValueError(f"layout {layout!r}: crop or sides")
    long_side = int(rng.integers(*long_sides))
    aspect = float(rng.uniform(1.0, 1.6) if layout == "crop" else rng.uniform(1.3, 2.0))
    short = int(long_side / aspect)
    w, h = (long_side, short) if rng.random() < 0.6 else (short, long_side)
    shape = shapes[rng.integers(len(shapes))]
    colour = list(COLOURS)[rng.integers(len(COLOURS))]
    bg = list(BACKGROUNDS)[rng.integers(len(BACKGROUNDS))]
    img = _texture(rng, w, h, BACKGROUNDS[bg])
    d = ImageDraw.Draw(img)
    m = min(w, h)
    big = rng.random() < 0.5
    r = m * (0.3 if big else 0.17)
    side = rng.choice(["left", "centre", "right"])
    if layout == "crop":  # keep the shape inside the centre crop that the 256px stage keeps
        off = {"left": -0.22, "centre": 0.0, "right": 0.22}[side] * m
    else:  # at the ends of the long side
        reach = max(w, h) / 2 - r - 0.05 * m
        off = {"left": -reach, "centre": 0.0, "right": reach}[side]
    cx, cy = w / 2 + off * (w >= h), h / 2 + off * (h > w)
    fill = COLOURS[colour]
    if shape == "circle":
        d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "ring":
        d.ellipse([cx - r, cy - r, cx + r, cy + r], outline=fill, width=int(r * 0.3))
    elif shape == "square":
        d.rectangle([cx - r, cy - r, cx + r, cy + r], fill=fill)
    else:
        d.polygon(_polygon(shape, cx, cy, r), fill=fill)
    where = {"left": "on the left", "centre": "in the centre", "right": "on the right"}[side]
    if h > w:
        where = {"left": "at the top", "centre": "in the centre", "right": "at the bottom"}[side]
    size_word = "large" if big else "small"
    caption = f"a {size_word} {colour} {shape} {where} of a textured {bg} background"
    return img, caption


def _encode(img: Image.Image, kind: str) -> tuple[bytes, str, str]:
    buf = io.BytesIO()
    if kind == "jpeg":
        img.save(buf, "JPEG", quality=90)
        return buf.getvalue(), "image/jpeg", ".jpg"
    if kind == "png":
        img.save(buf, "PNG", compress_level=1)
        return buf.getvalue(), "image/png", ".png"
    if kind == "rgba":
        rgba = img.convert("RGBA")
        a = Image.new("L", img.size, 255)
        ImageDraw.Draw(a).rectangle([0, 0, img.size[0] // 8, img.size[1]], fill=0)
        rgba.putalpha(a)
        rgba.save(buf, "PNG", compress_level=1)
        return buf.getvalue(), "image/png", ".png"
    if kind == "gray":
        img.convert("L").save(buf, "JPEG", quality=90)
        return buf.getvalue(), "image/jpeg", ".jpg"
    raise ValueError(kind)


def near_copy(img: Image.Image, how: str) -> Image.Image:
    """A near-duplicate of ``img``: ``q40`` re-encoded as JPEG at quality 40, ``half`` resized
    to half and back, ``crop4`` 2% cut from each side (4% of each dimension), ``border`` a
    10-px white frame added."""
    if how == "q40":
        buf = io.BytesIO()
        img.save(buf, "JPEG", quality=40)
        return Image.open(io.BytesIO(buf.getvalue())).convert("RGB")
    if how == "half":
        return img.resize((img.width // 2, img.height // 2)).resize(img.size)
    if how == "crop4":
        dx, dy = round(img.width * 0.02), round(img.height * 0.02)
        return img.crop((dx, dy, img.width - dx, img.height - dy))
    if how == "border":
        return ImageOps.expand(img, 10, fill=(255, 255, 255))
    raise ValueError(f"near copy {how!r}: q40, half, crop4 or border")


def _near_rows(img_dir: Path, sources: dict, seed: int, near: dict[str, str]) -> list[dict]:
    """The rows of the planted copies of ``sources`` (``(file, row) -> (image, row)``), in
    :data:`NEAR_COPIES` order; ``near`` gets copy id -> original id. A copy's id is one that no
    held-out fraction up to 0.5 holds out (``heldout_rows``), so the held-out set stays the
    sample's own."""
    rows = []
    for k, (fno, i, how) in enumerate(NEAR_COPIES):
        if (fno, i) not in sources:
            continue
        img, row = sources[fno, i]
        attempt = 0
        while True:
            rid = str(uuid.uuid5(NAMESPACE, f"{seed}-near-{k}-{attempt}"))
            if not len(heldout_rows([rid], 0.5, 1)):
                break
            attempt += 1
        copy = near_copy(img, how)
        if how == "q40":  # the file itself at quality 40
            buf = io.BytesIO()
            img.save(buf, "JPEG", quality=40)
            data, mime, ext = buf.getvalue(), "image/jpeg", ".jpg"
        else:
            data, mime, ext = _encode(copy, "jpeg")
        path = img_dir / f"{rid}{ext}"
        if not path.exists() or path.stat().st_size != len(data):
            atomic_write_bytes(path, data)
        source = SOURCES[(SOURCES.index(row["source"]) + 1) % len(SOURCES)]  # another scan
        rows.append(
            {
                **row,
                "id": rid,
                "url": _rel_url(path, img_dir.parent),
                "width": copy.size[0],
                "height": copy.size[1],
                "mime_type": mime,
                "hash": hashlib.md5(data).hexdigest(),
                "source": source,
            }
        )
        near[rid] = row["id"]
    return rows


def write_sample(dest: str | Path, spec: SampleSpec | None = None) -> dict:
    """Write the sample under ``dest`` (``metadata/pd12m.NNN.parquet`` and ``images/``).

    Returns a summary (paths, row counts, expected outcomes, ``near_copies``: planted copy id
    -> original id; the copies are ``stored`` until a near-duplicate decision). Idempotent: the
    same spec gives the same files; each file is written atomically.
    """
    spec = spec or SampleSpec()
    dest = Path(dest).expanduser().resolve()
    img_dir, md_dir = dest / "images", dest / "metadata"
    img_dir.mkdir(parents=True, exist_ok=True)
    md_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(spec.seed)
    expected: dict[str, str] = {}
    near: dict[str, str] = {}
    wanted = {(f, i) for f, i, _ in NEAR_COPIES}
    if not spec.near_copies or any(f >= spec.files or i >= spec.rows_per_file for f, i in wanted):
        wanted = set()  # all or nothing: the tests' small samples stay as they were
    sources: dict[tuple[int, int], tuple[Image.Image, dict]] = {}
    total = 0
    for fno in range(spec.files):
        rows = []
        for i in range(spec.rows_per_file):
            rid = str(uuid.uuid5(NAMESPACE, f"{spec.seed}-{fno}-{i}"))
            img, caption = draw_image(rng, layout=spec.layout)
            kind = rng.choice(["jpeg"] * 14 + ["png", "rgba", "gray"])
            if spec.layout == "sides":  # colour JPEGs only: what the crop keeps is the question
                kind = "jpeg"
            data, mime, ext = _encode(img, kind)
            path = img_dir / f"{rid}{ext}"
            if not path.exists() or path.stat().st_size != len(data):
                atomic_write_bytes(path, data)
            rows.append(
                {
                    "id": rid,
                    "url": _rel_url(path, img_dir.parent),
                    "caption": caption,
                    "width": img.size[0],
                    "height": img.size[1],
                    "mime_type": mime,
                    "hash": hashlib.md5(data).hexdigest(),
                    "license": LICENSES[i % len(LICENSES)],
                    "source": SOURCES[i % len(SOURCES)],
                }
            )
            expected[rid] = "stored"
            if (fno, i) in wanted:
                sources[fno, i] = (img, rows[-1])
        if spec.bad_rows and fno == 0:
            rows += _bad_rows(img_dir, rng, expected, spec.seed)
        if fno == spec.files - 1:  # after every other row: no row moves
            rows += _near_rows(img_dir, sources, spec.seed, near)
            expected.update(dict.fromkeys(near, "stored"))
        table = pa.Table.from_pylist(rows)
        with atomic_path(md_dir / f"pd12m.{fno:03d}.parquet") as tmp:
            pq.write_table(table, tmp, row_group_size=64)
        total += len(rows)
    summary = {
        "dest": str(dest),
        "metadata": str(md_dir),
        "files": spec.files,
        "rows": total,
        "expected_outcomes": expected,
        "near_copies": near,
    }
    atomic_write_text(dest / "expected.json", json.dumps(summary, indent=1))
    return summary


def _rel_url(path: Path, root: Path) -> str:
    """``file:<path relative to root>``: resolved against the ingest's file_root when fetched."""
    return "file:" + path.relative_to(root).as_posix()


def _bad_rows(img_dir: Path, rng: np.random.Generator, expected: dict, seed: int) -> list[dict]:
    """Deliberately bad rows; ``expected`` gets each one's outcome as ``failed:<reason>``."""
    out = []

    def row(name: str, path: Path, caption: str, w=1600, h=1200, mime="image/jpeg", h_=None):
        rid = str(uuid.uuid5(NAMESPACE, f"{seed}-bad-{name}"))
        out.append(
            {
                "id": rid,
                "url": _rel_url(path, img_dir.parent),
                "caption": caption,
                "width": w,
                "height": h,
                "mime_type": mime,
                "hash": h_ or hashlib.md5(name.encode()).hexdigest(),
                "license": LICENSES[0],
                "source": SOURCES[0],
            }
        )
        return rid

    good, _ = draw_image(rng)
    jpeg, _, _ = _encode(good, "jpeg")
    atomic_write_bytes(img_dir / "bad-truncated.jpg", jpeg[: len(jpeg) // 3])
    atomic_write_bytes(
        img_dir / "bad-html.jpg",
        b"<!DOCTYPE html><html><head><title>404 Not Found</title></head><body>gone</body></html>",
    )
    atomic_write_bytes(img_dir / "bad-empty.jpg", b"")
    tiny = io.BytesIO()
    good.resize((24, 18)).save(tiny, "JPEG")
    atomic_write_bytes(img_dir / "bad-tiny.jpg", tiny.getvalue())
    expected[row("missing", img_dir / "bad-missing.jpg", "a red circle that was deleted")] = (
        "failed:not_found"
    )
    expected[row("truncated", img_dir / "bad-truncated.jpg", "a truncated picture")] = (
        "failed:corrupt"
    )
    expected[row("html", img_dir / "bad-html.jpg", "an error page saved as a picture")] = (
        "failed:not_image"
    )
    expected[row("empty", img_dir / "bad-empty.jpg", "an empty download")] = "failed:not_image"
    expected[row("tiny", img_dir / "bad-tiny.jpg", "a thumbnail that claims to be large")] = (
        "failed:too_small"
    )
    # rows the metadata filters drop before any download
    expected[row("small", img_dir / "bad-tiny.jpg", "a small original", w=120, h=90)] = (
        "filtered:small_original"
    )
    expected[row("wide", img_dir / "bad-tiny.jpg", "a panorama strip", w=3000, h=300)] = (
        "filtered:aspect_ratio"
    )
    expected[row("nocaption", img_dir / "bad-tiny.jpg", "   ")] = "filtered:caption_too_short"
    dup_hash = hashlib.md5(b"duplicate").hexdigest()
    row("dup-a", img_dir / "bad-tiny.jpg", "the first copy of a tiny picture", h_=dup_hash)
    expected[out[-1]["id"]] = "failed:too_small"
    expected[row("dup-b", img_dir / "bad-tiny.jpg", "the second copy", h_=dup_hash)] = (
        "filtered:duplicate_hash"
    )
    return out


def write_shapes2(dest: str | Path, n: int = 192, seed: int = 1, new_fraction: float = 0.5) -> dict:
    """The second procedural dataset, as a user's image folder (``a.jpg`` + ``a.txt``, two
    sub-folders): the demo's caption grammar with a shape the demo never saw, ``cross``, in
    ``new_fraction`` of the images, the demo's six shapes in the rest; long side 600-1,000 px.
    Plus two broken entries: an image without its caption and a truncated JPEG (their outcomes
    in ``expected``). Idempotent. Returns ``{dest, images, expected}``."""
    dest = Path(dest).expanduser().resolve()
    rng = np.random.default_rng(seed)
    expected: dict[str, str] = {}
    for i in range(n):
        sub = dest / ("part_a" if i < n // 2 else "part_b")
        new = rng.random() < new_fraction
        img, caption = draw_image(rng, NEW_SHAPES if new else SHAPES, (600, 1001))
        data, _, ext = _encode(img, "jpeg")
        name = f"{i:04d}"
        if not (sub / f"{name}{ext}").exists():
            atomic_write_bytes(sub / f"{name}{ext}", data)
        atomic_write_text(sub / f"{name}.txt", caption + "\n")
        expected[f"{sub.name}/{name}{ext}"] = "stored"
    img, _ = draw_image(rng, NEW_SHAPES, (600, 1001))
    data, _, _ = _encode(img, "jpeg")
    atomic_write_bytes(dest / "part_b" / "zz-nocaption.jpg", data)
    expected["part_b/zz-nocaption.jpg"] = "failed:missing_caption"
    atomic_write_bytes(dest / "part_b" / "zz-truncated.jpg", data[: len(data) // 3])
    atomic_write_text(dest / "part_b" / "zz-truncated.txt", "a truncated picture\n")
    expected["part_b/zz-truncated.jpg"] = "failed:corrupt"
    return {"dest": str(dest), "images": n + 2, "expected": expected}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="flowmatch demo-data", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "dest", nargs="?", default="data/sample", help="folder to write (default data/sample)"
    )
    p.add_argument(
        "--files",
        type=int,
        default=SampleSpec.files,
        help="metadata files (partitions at 10k rows/shard)",
    )
    p.add_argument("--rows-per-file", type=int, default=SampleSpec.rows_per_file)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--shapes2",
        action="store_true",
        help="write the second dataset instead: an image folder whose captions name a new "
        "shape, cross (write_shapes2; add it with `flowmatch sources add ... --kind folder`)",
    )
    p.add_argument("--images", type=int, default=192, help="--shapes2: how many images")
    a = p.parse_args(argv)
    if a.shapes2:
        s = write_shapes2(a.dest, a.images, seed=a.seed + 1)
        print(f"wrote {s['images']} images with .txt captions under {s['dest']}")
        return s
    s = write_sample(a.dest, SampleSpec(files=a.files, rows_per_file=a.rows_per_file, seed=a.seed))
    print(f"wrote {s['rows']} rows in {s['files']} metadata files under {s['metadata']}")
    return s


if __name__ == "__main__":
    main()
