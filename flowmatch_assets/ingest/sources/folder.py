"""An image folder with captions beside the images: ``a.jpg`` + ``a.txt`` (kohya, SimpleTuner)
and/or diffusers' ImageFolder ``metadata.jsonl`` (``{"file_name": "a.jpg", "text": "..."}``,
``file_name`` relative to the jsonl's folder), nested folders allowed.

A sample is an image file (its id is its path under the location, ``cats/a.jpg``), a caption
sidecar without an image (a failure: ``missing_image``), a metadata.jsonl line naming a file
(a missing one fails as ``not_found`` when the images are read) or a line that is not JSON
(``bad_metadata``). The sidecar is looked for when the partition's rows are listed, so a caption
written after registration is picked up by the next materialization.
"""

from __future__ import annotations

import functools
import json
import posixpath
from collections.abc import Iterable, Iterator

from flowmatch_assets.ingest.images import IngestError
from flowmatch_assets.ingest.sources.common import (
    decode_caption,
    failure,
    find_files,
    join,
    open_location,
    row,
)
from flowmatch_assets.ingest.sources.config import IMAGE_EXTS, SourceConfig, SourceError

JSONL = "metadata.jsonl"


def _stem(rel: str) -> str:
    return posixpath.splitext(rel)[0]


def _is_image(rel: str) -> bool:
    return posixpath.splitext(rel)[1].lower() in IMAGE_EXTS


def _jsonl_lines(fs, path: str) -> Iterator[tuple[int, dict | None, str]]:
    """``(line number, record or None, problem)`` of every non-empty line of a jsonl file."""
    text = fs.cat_file(path).decode("utf-8", errors="replace")
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            yield n, None, f"line {n} is not JSON: {e.msg}"
            continue
        if not isinstance(rec, dict) or not isinstance(rec.get("file_name"), str):
            yield n, None, f"line {n} has no file_name"
            continue
        yield n, rec, ""


def scan(cfg: SourceConfig, known: Iterable) -> list[tuple[str, int, int, list]]:
    """New partitions ``(unit, start, end, entries)`` for the samples under the location that
    no registered partition (``known`` manifests) holds, ``shard_size`` each, in path order."""
    fs, root = open_location(cfg)
    if not fs.isdir(root):
        raise SourceError(
            f"source location {cfg.location!r} is a file; a folder source needs a folder"
        )
    files = find_files(fs, root)
    images = [f for f in files if _is_image(f)]
    with_image = {_stem(f) for f in images}
    entries: dict[str, dict] = {}
    for img in images:
        entries[img] = {"id": img, "image": img}
    for f in files:
        if f.endswith(cfg.caption_extension) and _stem(f) not in with_image:
            entries[f] = {"id": f, "image": None}  # a caption with no image: missing_image
    for jl in (f for f in files if posixpath.basename(f) == JSONL):
        base = posixpath.dirname(jl)
        for n, rec, problem in _jsonl_lines(fs, join(root, jl)):
            if rec is None:
                entries[f"{jl}#L{n}"] = {"id": f"{jl}#L{n}", "image": None, "problem": problem}
                continue
            rel = posixpath.normpath(posixpath.join(base, rec["file_name"]))
            entries.setdefault(rel, {"id": rel, "image": rel})  # absent files: not_found later
    held = {e["id"] for m in known for e in m.entries}
    new = [entries[k] for k in sorted(entries) if k not in held]
    out = []
    for i in range(0, len(new), cfg.shard_size):
        chunk = new[i : i + cfg.shard_size]
        dirs = {posixpath.dirname(e["id"]) for e in chunk}
        unit = posixpath.commonpath(list(dirs)) if "" not in dirs else ""
        out.append((unit, 0, len(chunk), chunk))
    return out


@functools.lru_cache(maxsize=8)
def _jsonl_captions(fs, path: str, rel_dir: str, version: str, field: str) -> dict[str, object]:
    """``{image path under the location: caption value}`` of the metadata.jsonl at ``path``
    (in the folder ``rel_dir`` under the location), cached per file version: a partition's
    listing reads each file once."""
    out = {}
    for _n, rec, _problem in _jsonl_lines(fs, path):
        if rec is not None and field in rec:
            out[posixpath.normpath(posixpath.join(rel_dir, rec["file_name"]))] = rec[field]
    return out


def _captions_from_jsonl(fs, root: str, images: list[str], field: str) -> dict[str, object]:
    """Caption values for ``images`` (paths under ``root``) from every metadata.jsonl in their
    folders or above; a deeper file's line wins."""
    dirs = set()
    for img in images:
        d = posixpath.dirname(img)
        while True:
            dirs.add(d)
            if not d:
                break
            d = posixpath.dirname(d)
    out: dict[str, object] = {}
    for d in sorted(dirs, key=lambda x: (x.count("/"), x)):
        path = join(root, posixpath.join(d, JSONL) if d else JSONL)
        try:
            info = fs.info(path)
        except (FileNotFoundError, OSError):
            continue
        if info.get("type") != "file":
            continue
        version = f"{info.get('size')}-{info.get('mtime') or info.get('Last-Modified') or ''}"
        out.update(_jsonl_captions(fs, path, d, version, field))
    return out


def rows(cfg: SourceConfig, name: str, m) -> tuple[list[dict], list[dict]]:
    """The partition's samples as rows, and the failures of those that cannot be (module doc)."""
    fs, root = open_location(cfg)
    field = cfg.caption()
    images = [e["image"] for e in m.entries if e.get("image")]
    from_jsonl = _captions_from_jsonl(fs, root, images, field)
    out, failed = [], []
    for i, e in enumerate(m.entries):
        sid = e["id"]
        if e.get("problem"):
            failed.append(failure(sid, sid.split("#")[0], "bad_metadata", e["problem"]))
            continue
        if not e.get("image"):
            failed.append(
                failure(sid, sid, "missing_image", f"caption {sid} has no image beside it")
            )
            continue
        side = _stem(e["image"]) + cfg.caption_extension
        caption = None
        try:
            data = fs.cat_file(join(root, side))
        except (FileNotFoundError, IsADirectoryError):
            data = None
        if data is not None:
            caption = decode_caption(data)
            if caption is None:
                failed.append(failure(sid, e["image"], "bad_caption", f"{side} is not UTF-8 text"))
                continue
        elif e["image"] in from_jsonl and from_jsonl[e["image"]] is not None:
            caption = str(from_jsonl[e["image"]]).strip()
        if caption is None:
            failed.append(failure(sid, e["image"], "missing_caption",
                                  f"no {side} and no {JSONL} line with {field!r} for it"))  # fmt: skip
            continue
        out.append(row(cfg, name, sid, e["image"], caption, i))
    return out, failed


def images(
    cfg: SourceConfig, m, rows: list[dict], max_bytes: int
) -> Iterator[tuple[dict, bytes | IngestError]]:
    """The bytes of each row's image file, in order (``not_found``, ``too_large`` as failures)."""
    fs, root = open_location(cfg)
    for r in rows:
        path = join(root, r["url"])
        try:
            size = fs.size(path)
            if size is not None and size > max_bytes:
                yield r, IngestError("too_large", f"{size} bytes > max_bytes {max_bytes}")
                continue
            yield r, fs.cat_file(path)
        except (FileNotFoundError, IsADirectoryError):
            yield r, IngestError("not_found", f"{r['url']} is not in {cfg.location}")
        except OSError as e:
            yield r, IngestError("connection_error", f"{type(e).__name__}: {e}")
