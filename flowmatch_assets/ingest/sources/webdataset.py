"""WebDataset tar shards as img2dataset writes them: ``00000.tar`` holding, per sample,
``000000017.jpg`` + ``000000017.txt`` (the caption) + ``000000017.json`` (url, size, ...).

A sample is every member sharing a key (the member's path up to the first dot of its file name,
the WebDataset rule); its image is the member with an image extension, its caption the member
with extension ``caption_field`` (default ``txt``), else that key of its ``.json``, else the
``.json``'s ``caption`` (img2dataset writes it there too). Every
``*.tar`` under the location is a unit; one with more than ``shard_size`` samples becomes several
partitions. A tar is read front to back (a local or seekable one skips the image data when only
captions are wanted).
"""

from __future__ import annotations

import json
import posixpath
import re
import tarfile
from collections.abc import Callable, Iterable, Iterator

from flowmatch_assets.ingest.images import IngestError
from flowmatch_assets.ingest.sources.common import (
    decode_caption,
    failure,
    find_files,
    join,
    open_file,
    open_location,
    row,
)
from flowmatch_assets.ingest.sources.config import IMAGE_EXTS, SourceConfig, SourceError

_KEY = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")  # WebDataset's base_plus_ext


def split_name(name: str) -> tuple[str, str] | None:
    """``(key, extension)`` of a member name (``a/000017.seg.png`` -> ``a/000017``, ``seg.png``)."""
    m = _KEY.match(name)
    return (m.group(1), m.group(2).lower()) if m else None


def _members(
    fs, path: str, read: Callable | None = None
) -> Iterator[tuple[tarfile.TarInfo, bytes | None]]:
    """Every regular member of a tar and, where ``read(member)`` says so, its bytes."""
    with open_file(fs, path, stream_ok=True) as f:
        seekable = getattr(f, "seekable", lambda: False)()
        try:
            tf = tarfile.open(fileobj=f, mode="r:*" if seekable else "r|*")
        except tarfile.TarError as e:
            raise SourceError(f"{path} is not a readable tar: {e}") from None
        with tf:
            for info in tf:
                if not info.isfile():
                    continue
                data = None
                if read is not None and read(info):
                    fh = tf.extractfile(info)
                    data = fh.read() if fh is not None else b""
                yield info, data


def _tars(fs, root: str) -> list[tuple[str, str]]:
    """``(path, relative name)`` of every tar under ``root`` (or ``root`` if it is one)."""
    if root.endswith(".tar") and fs.isfile(root):
        return [(root, posixpath.basename(root))]
    return [(join(root, f), f) for f in find_files(fs, root) if f.endswith(".tar")]


def scan(cfg: SourceConfig, known: Iterable) -> list[tuple[str, int, int, list]]:
    """New partitions ``(tar, start, end, sample keys)`` for every tar not registered yet."""
    fs, root = open_location(cfg)
    held = {m.unit for m in known}
    out = []
    for path, rel in _tars(fs, root):
        if rel in held:
            continue
        keys: list[str] = []
        seen: set[str] = set()
        for info, _ in _members(fs, path):
            kx = split_name(info.name)
            if kx is None or posixpath.basename(info.name).startswith("."):
                continue
            if kx[0] not in seen:
                seen.add(kx[0])
                keys.append(kx[0])
        for k in range(0, len(keys), cfg.shard_size):  # an empty tar: no partition
            chunk = keys[k : k + cfg.shard_size]
            out.append((rel, k, k + len(chunk), chunk))
    return out


def _path(fs, root: str, unit: str) -> str:
    return root if root.endswith(".tar") and fs.isfile(root) else join(root, unit)


def rows(cfg: SourceConfig, name: str, m) -> tuple[list[dict], list[dict]]:
    """The partition's samples as rows (their caption members read, images skipped)."""
    fs, root = open_location(cfg)
    field = cfg.caption()
    wanted = set(m.entries)
    found: dict[str, dict] = {k: {"exts": [], "caption": None, "json": None} for k in m.entries}

    def small(info: tarfile.TarInfo) -> bool:
        kx = split_name(info.name)
        return kx is not None and kx[0] in wanted and kx[1] in (field, "json")

    for info, data in _members(fs, _path(fs, root, m.unit), small):
        kx = split_name(info.name)
        if kx is None or kx[0] not in wanted:
            continue
        s = found[kx[0]]
        s["exts"].append(kx[1])
        if data is not None and kx[1] == field:
            s["caption"] = data
        elif data is not None and kx[1] == "json":
            s["json"] = data
    out, failed = [], []
    for i, key in enumerate(m.entries):
        s = found[key]
        img = next((e for e in s["exts"] if "." + e in IMAGE_EXTS), None)
        url = f"{m.unit}#{key}.{img}" if img else f"{m.unit}#{key}"
        if img is None:
            what = f"members {', '.join(s['exts'])}" if s["exts"] else "no members any more"
            failed.append(failure(key, url, "missing_image", f"sample {key} has no image ({what})"))
            continue
        caption = None
        if s["caption"] is not None:
            caption = decode_caption(s["caption"])
            if caption is None:
                failed.append(failure(key, url, "bad_caption", f"{key}.{field} is not UTF-8 text"))
                continue
        elif s["json"] is not None:
            try:
                meta = json.loads(s["json"])
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                failed.append(failure(key, url, "bad_metadata", f"{key}.json is not JSON: {e}"))
                continue
            key_ = field if isinstance(meta, dict) and meta.get(field) is not None else "caption"
            if isinstance(meta, dict) and meta.get(key_) is not None:
                caption = str(meta[key_]).strip()
        if caption is None:
            failed.append(failure(key, url, "missing_caption",
                                  f"sample {key} has no .{field} member and no {field!r} in its .json"))  # fmt: skip
            continue
        out.append(row(cfg, name, key, url, caption, i))
    return out, failed


def images(
    cfg: SourceConfig, m, rows: list[dict], max_bytes: int
) -> Iterator[tuple[dict, bytes | IngestError]]:
    """Each row's image member, read in one pass through the tar (rows in tar order)."""
    fs, root = open_location(cfg)
    want = {r["url"].split("#", 1)[1]: r for r in rows}

    def wanted(info: tarfile.TarInfo) -> bool:
        return info.name in want and info.size <= max_bytes

    for info, data in _members(fs, _path(fs, root, m.unit), wanted):
        if info.name not in want:
            continue
        r = want.pop(info.name)
        if data is None:
            yield r, IngestError("too_large", f"{info.size} bytes > max_bytes {max_bytes}")
        else:
            yield r, data
    for name, r in want.items():
        yield r, IngestError("not_found", f"{name} is not in {m.unit} any more")
