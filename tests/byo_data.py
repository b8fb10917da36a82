"""The user's own images, made by the tests: scikit-image's bundled sample photos written as an
image folder (sidecars, metadata.jsonl, nested folders), Hugging Face-style parquet and
img2dataset WebDataset tars, each with a few broken entries. Every writer returns the expected
final outcome of every sample id: ``stored``, ``failed:<reason>`` or ``filtered:<reason>``.
Each kind encodes the photos at its own JPEG quality (folder 90, parquet 85, webdataset 80), so
the three hold different bytes (content dedupe works across sources: the same bytes in two
sources are one image)."""

from __future__ import annotations

import io
import json
import re
import shlex
import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

REPO = Path(__file__).resolve().parents[1]

#: (scikit-image sample, caption); all bundled with the wheel (no download)
PHOTOS = [
    ("astronaut", "an astronaut in a white space suit in front of a flag"),
    ("coffee", "a cup of coffee on a saucer seen from above"),
    ("chelsea", "a tabby cat looking to the side"),
    ("rocket", "a rocket on its launch pad under a blue sky"),
    ("immunohistochemistry", "a stained tissue sample under a microscope"),
    ("colorwheel", "a colour wheel on a white background"),
    ("camera", "a black and white photo of a man with a camera on a tripod"),
    ("moon", "a black and white photo of the surface of the moon"),
    ("coins", "old coins on a dark background"),
    ("brick", "a close-up of a brick wall"),
    ("grass", "a close-up of grass"),
    ("gravel", "a close-up of gravel"),
    ("clock", "a wall clock photographed while moving"),
    ("hubble_deep_field", "galaxies in the hubble deep field"),
]


def photo(name: str) -> Image.Image:
    from skimage import data

    a = getattr(data, name)()
    if a.dtype == bool:
        a = a.astype(np.uint8) * 255
    return Image.fromarray(a)


def encode(img: Image.Image, fmt: str = "JPEG", quality: int = 90) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **({"quality": quality} if fmt == "JPEG" else {}))
    return buf.getvalue()


def _bad_jpeg() -> bytes:
    return encode(photo("astronaut"))[:3000]  # truncated


HTML = b"<!DOCTYPE html><html><body>404 not found</body></html>"


def write_folder(dest: Path) -> dict[str, str]:
    """``dest/`` with sidecar captions, a nested folder, a metadata.jsonl, and broken entries:
    an HTML page saved as .jpg, a truncated JPEG, an image without caption, a caption without
    image, the same photo twice, a small original, a bad jsonl line and a jsonl line naming a
    file that is not there."""
    dest.mkdir(parents=True, exist_ok=True)
    exp: dict[str, str] = {}
    for i, (name, caption) in enumerate(PHOTOS[:8]):
        sub = dest if i < 4 else dest / "more" / "nested"
        sub.mkdir(parents=True, exist_ok=True)
        fmt = "PNG" if name == "colorwheel" else "JPEG"
        ext = ".png" if fmt == "PNG" else ".jpg"
        (sub / f"{name}{ext}").write_bytes(encode(photo(name), fmt))
        (sub / f"{name}.txt").write_text(caption + "\n")
        exp[(sub / f"{name}{ext}").relative_to(dest).as_posix()] = "stored"
    jl = dest / "jsonl"
    jl.mkdir()
    lines = []
    for name, caption in PHOTOS[8:11]:
        (jl / f"{name}.jpg").write_bytes(encode(photo(name)))
        lines.append(json.dumps({"file_name": f"{name}.jpg", "text": caption}))
        exp[f"jsonl/{name}.jpg"] = "stored"
    lines.append("{this is not json")
    exp["jsonl/metadata.jsonl#L4"] = "failed:bad_metadata"
    lines.append(json.dumps({"file_name": "gone.jpg", "text": "a photo that was deleted"}))
    exp["jsonl/gone.jpg"] = "failed:not_found"
    (jl / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    bad = dest / "bad"
    bad.mkdir()
    (bad / "html.jpg").write_bytes(HTML)
    (bad / "html.txt").write_text("an error page saved as a photo")
    exp["bad/html.jpg"] = "failed:not_image"
    (bad / "truncated.jpg").write_bytes(_bad_jpeg())
    (bad / "truncated.txt").write_text("a truncated photo")
    exp["bad/truncated.jpg"] = "failed:corrupt"
    (bad / "nocaption.jpg").write_bytes(encode(photo("clock")))
    exp["bad/nocaption.jpg"] = "failed:missing_caption"
    (bad / "orphan.txt").write_text("a caption whose photo is missing")
    exp["bad/orphan.txt"] = "failed:missing_image"
    (bad / "zz_copy.jpg").write_bytes((dest / "astronaut.jpg").read_bytes())  # same bytes
    (bad / "zz_copy.txt").write_text("the astronaut again")
    exp["bad/zz_copy.jpg"] = "filtered:duplicate_content"
    (bad / "page.png").write_bytes(encode(photo("text"), "PNG"))  # 448x172: small original
    (bad / "page.txt").write_text("a page of text")
    exp["bad/page.png"] = "filtered:small_original"
    return exp


def _hf_image(data: bytes | None, path: str | None) -> dict:
    return {"bytes": data, "path": path}


def write_parquet(dest: Path, files: int = 2, by_idx: bool = False) -> dict[str, str]:
    """``dest/data/train-0000N-of-0000F.parquet`` in the datasets layout (``image`` struct
    bytes/path, caption column ``caption``, an ``idx`` column), with a null caption (row 3), an
    image without bytes (4), an HTML page as bytes (10) and a duplicate of row 0 (13). The
    expected outcomes are keyed by the default ids (``<file stem>/<row>``), or ``by_idx``."""
    d = dest / "data"
    d.mkdir(parents=True, exist_ok=True)
    exp: dict[str, str] = {}
    schema = pa.schema(
        [
            ("image", pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
            ("caption", pa.string()),
            ("idx", pa.int64()),
        ]
    )
    broken = {
        3: (
            {"image": _hf_image(encode(photo("coins"), quality=85), "nocap.jpg"), "caption": None},
            "failed:missing_caption",
        ),
        4: (
            {"image": _hf_image(None, "elsewhere.jpg"), "caption": "an image kept elsewhere"},
            "failed:missing_image",
        ),
        10: (
            {"image": _hf_image(HTML, "error.jpg"), "caption": "an error page"},
            "failed:not_image",
        ),
    }
    good = iter(PHOTOS[:10])
    rows = []
    for i in range(13):
        if i in broken:
            rows.append(broken[i][0])
            exp[str(i)] = broken[i][1]
            continue
        name, caption = next(good)
        rows.append(
            {"image": _hf_image(encode(photo(name), quality=85), f"{name}.jpg"), "caption": caption}
        )
        exp[str(i)] = "stored"
    rows.append({"image": _hf_image(rows[0]["image"]["bytes"], "again.jpg"), "caption": "again"})
    exp["13"] = "filtered:duplicate_content"
    for i, r in enumerate(rows):
        r["idx"] = i
    per = -(-len(rows) // files)
    out = {}
    for f in range(files):
        part = rows[f * per : (f + 1) * per]
        stem = f"train-{f:05d}-of-{files:05d}"
        t = pa.Table.from_pylist([{**r} for r in part], schema=schema)
        pq.write_table(t, d / f"{stem}.parquet", row_group_size=4)
        for j, r in enumerate(part):  # without id_field a row's id is <file stem>/<row>
            out[str(r["idx"]) if by_idx else f"{stem}/{j}"] = exp[str(r["idx"])]
    return out


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def write_webdataset(dest: Path, tars: int = 2) -> dict[str, str]:
    """img2dataset's layout: ``dest/0000N.tar`` with ``NNNNNNNNN.jpg/.txt/.json`` per sample
    (keys ``{shard:05d}{index:04d}``), a sample whose caption is only in its .json, one without
    any caption, one without an image, a truncated JPEG and a duplicate of another's bytes."""
    dest.mkdir(parents=True, exist_ok=True)
    exp: dict[str, str] = {}
    samples = []
    for name, caption in PHOTOS[:9]:
        samples.append({"jpg": encode(photo(name), quality=80), "txt": caption, "name": name})
    samples.append(
        {
            "jpg": encode(photo("gravel"), quality=80),
            "json_caption": PHOTOS[11][1],
            "name": "gravel",
        }
    )
    samples.append({"jpg": encode(photo("clock"), quality=80), "name": "clock"})  # no caption
    samples.append({"txt": "a caption without its image", "name": "noimage"})
    samples.append({"jpg": _bad_jpeg(), "txt": "a truncated photo", "name": "truncated"})
    samples.append({"jpg": samples[1]["jpg"], "txt": "the coffee again", "name": "copy"})
    outcome = ["stored"] * 10 + [
        "failed:missing_caption",
        "failed:missing_image",
        "failed:corrupt",
        "filtered:duplicate_content",
    ]
    per = -(-len(samples) // tars)
    for s in range(tars):
        with tarfile.open(dest / f"{s:05d}.tar", "w") as tar:
            for j, sm in enumerate(samples[s * per : (s + 1) * per]):
                key = f"{s:05d}{j:04d}"
                exp[key] = outcome[s * per + j]
                meta = {
                    "url": f"https://example.org/{sm['name']}.jpg",
                    "key": key,
                    "status": "success",
                    "caption": sm.get("json_caption"),
                }
                if "jpg" in sm:
                    _add(tar, f"{key}.jpg", sm["jpg"])
                if "txt" in sm:
                    _add(tar, f"{key}.txt", sm["txt"].encode())
                _add(tar, f"{key}.json", json.dumps(meta).encode())
    return exp


def readme_commands(doc: str, marker: str) -> list[list[str]]:
    """The ``flowmatch`` commands of the bash block after ``<!-- marker -->`` in the guide
    ``doc`` (a path from the repo root, e.g. ``docs/own-images.md``)."""
    block = (REPO / doc).read_text().split(f"<!-- {marker} -->")[1]
    code = re.search(r"```bash\n(.*?)```", block, re.S).group(1)
    out = []
    for line in code.splitlines():
        words = shlex.split(line, comments=True)
        if words:
            assert words[0] == ".venv/bin/flowmatch", line
            out.append(words[1:])
    return out
