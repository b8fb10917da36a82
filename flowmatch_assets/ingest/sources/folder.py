"""An image folder with captions beside the images: ``a.jpg`` + ``a.txt`` (kohya, SimpleTuner)
and/or diffusers' ImageFolder ``metadata.jsonl`` (``{"file_name": "a.jpg", "text": "..."}``,
``file_name`` relative to the jsonl's folder), nested folders allowed.

A sample is an image file (its id is its path under the location, ``cats/a.jpg``), a caption
sidecar without an image (a failure: ``missing_image``), a metadata.jsonl line naming a file
(a missing one fails as ``not_found`` when the images are read), a line that is not UTF-8 JSON
with a ``file_name`` (``bad_metadata``) or one whose ``file_name`` leaves the folder
(``outside_source``), or a metadata.jsonl that cannot be read itself (its reason). The sidecar is
looked for when the partition's rows are listed, so a caption written after registration is
picked up by the next materialization. Every read goes through :class:`Location` (confined,
regular files only, bounded).
"""

from __future__ import annotations

import functools
import json
import posixpath
from collections.abc import Iterator, Sequence

from flowmatch_assets.ingest.images import IngestError
from flowmatch_assets.ingest.sources.common import (
    CAPTION_MAX_BYTES,
    JSONL_LINE_MAX_BYTES,
    METADATA_MAX_BYTES,
    NotText,
    caption_text,
    failure,
    row,
)
from flowmatch_assets.ingest.sources.config import IMAGE_EXTS, SourceConfig, SourceError
from flowmatch_assets.ingest.sources.kind import (
    Found,
    ImageRead,
    ListedRow,
    Listing,
    Manifest,
    NewPartition,
    SourceKind,
)
from flowmatch_assets.ingest.sources.location import Location

JSONL = "metadata.jsonl"


def _stem(rel: str) -> str:
    return posixpath.splitext(rel)[0]


def _is_image(rel: str) -> bool:
    return posixpath.splitext(rel)[1].lower() in IMAGE_EXTS


def _jsonl_lines(loc: Location, jl: str) -> Iterator[tuple[int, dict | None, str]]:
    """``(line number, record or None, problem)`` of every non-empty line of the jsonl file
    ``jl``, streamed: its size is checked before anything is read (``too_large`` above
    METADATA_MAX_BYTES, raised), and a line above JSONL_LINE_MAX_BYTES is a problem of its own,
    skipped without being held (a 1 GiB one-line file took 3.2 GB). A line must be UTF-8 JSON,
    an object with a string ``file_name``."""
    with loc.open(jl, stream_ok=True) as f:
        size = loc.size(f)
        if size is not None and size > METADATA_MAX_BYTES:
            raise IngestError(
                "too_large", f"metadata file {jl} is {size} bytes, above {METADATA_MAX_BYTES}"
            )
        total = 0
        n = 0
        while True:
            raw = f.readline(JSONL_LINE_MAX_BYTES + 1)
            if not raw:
                return
            n += 1
            total += len(raw)
            if len(raw) > JSONL_LINE_MAX_BYTES and not raw.endswith(b"\n"):
                while raw and not raw.endswith(b"\n"):  # the rest of the line, unheld
                    raw = f.readline(1 << 20)
                    total += len(raw)
                    if total > METADATA_MAX_BYTES:
                        break
                yield n, None, f"line {n} is above {JSONL_LINE_MAX_BYTES} bytes"
                raw = b""
            if total > METADATA_MAX_BYTES:  # a stream longer than its size said
                raise IngestError(
                    "too_large", f"metadata file {jl} is above {METADATA_MAX_BYTES} bytes"
                )
            if len(raw) > JSONL_LINE_MAX_BYTES or not raw.strip():
                continue
            try:
                line = raw.decode("utf-8-sig" if n == 1 else "utf-8")
            except UnicodeDecodeError:
                yield n, None, f"line {n} is not UTF-8 text"
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


def _target(loc: Location, base: str, file_name: str) -> str:
    """The path under the location a jsonl line in folder ``base`` names (``outside_source``
    if it is absolute or climbs out of the location)."""
    if file_name.startswith("/"):
        raise IngestError("outside_source", f"file_name {file_name!r} is not a relative path")
    return loc.name_of(posixpath.join(base, file_name))


@functools.lru_cache(maxsize=8)
def _jsonl_captions(
    loc: Location, jl: str, rel_dir: str, version: str, field: str
) -> tuple[dict[str, object], IngestError | None]:
    """``({image path under the location: caption value}, None)`` of the metadata.jsonl
    ``jl`` (in the folder ``rel_dir``), cached per file version: a partition's listing reads
    each file once; ``({}, the error)`` when the file cannot be read."""
    out = {}
    try:
        for _n, rec, _problem in _jsonl_lines(loc, jl):
            if rec is not None and field in rec:
                try:
                    out[_target(loc, rel_dir, rec["file_name"])] = rec[field]
                except IngestError:
                    continue  # listed as its own failed row when registered
    except IngestError as e:
        return {}, e
    except OSError as e:
        return {}, IngestError("unreadable", f"{jl}: {e.strerror or type(e).__name__}")
    return out, None


def _captions_from_jsonl(
    loc: Location, images: list[str], field: str
) -> tuple[dict[str, object], dict[str, IngestError]]:
    """Caption values for ``images`` (paths under the location) from every metadata.jsonl in
    their folders or above (a deeper file's line wins), and the jsonl files that could not be
    read (by folder)."""
    dirs = set()
    for img in images:
        try:
            d = posixpath.dirname(loc.name_of(img))
        except IngestError:
            continue  # a name outside the location (an old manifest): it fails when read
        while True:
            dirs.add(d)
            if not d:
                break
            d = posixpath.dirname(d)
    out: dict[str, object] = {}
    broken: dict[str, IngestError] = {}
    for d in sorted(dirs, key=lambda x: (x.count("/"), x)):
        jl = posixpath.join(d, JSONL) if d else JSONL
        try:
            info = loc.fs.info(loc.path(jl))
        except (FileNotFoundError, OSError, IngestError):
            continue
        version = f"{info.get('size')}-{info.get('mtime') or info.get('Last-Modified') or ''}"
        captions, err = _jsonl_captions(loc, jl, d, version, field)
        if err is not None:
            broken[d] = err
        out.update(captions)
    return out, broken


def _broken_jsonl_of(img: str, broken: dict[str, IngestError]) -> IngestError | None:
    d = posixpath.dirname(img)
    while True:
        if d in broken:
            return broken[d]
        if not d:
            return None
        d = posixpath.dirname(d)


class FolderKind(SourceKind):
    """An image folder: images with caption sidecars and/or metadata.jsonl (module doc)."""

    name = "folder"

    def scan(self, cfg: SourceConfig, known: Sequence[Manifest]) -> Found:
        """New partitions ``(unit, start, end, entries)`` for the samples under the location that
        no registered partition (``known`` manifests) holds, ``shard_size`` each, in path order;
        and the units skipped (none: a folder's problems are its samples' rows)."""
        loc = Location(cfg)
        if loc.is_file:
            raise SourceError(
                f"source location {cfg.shown!r} is a file; a folder source needs a folder"
            )
        files = loc.files()
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
            found: dict[str, dict] = {}
            try:
                for n, rec, problem in _jsonl_lines(loc, jl):
                    sid = f"{jl}#L{n}"
                    if rec is None:
                        found[sid] = {"id": sid, "image": None, "problem": problem}
                        continue
                    try:
                        rel = _target(loc, base, rec["file_name"])
                    except IngestError as e:
                        found[sid] = {
                            "id": sid,
                            "image": None,
                            "reason": e.reason,
                            "problem": f"line {n}: {e.detail}",
                        }
                        continue
                    found.setdefault(
                        rel, {"id": rel, "image": rel}
                    )  # absent files: not_found later
            except IngestError as e:  # the whole file cannot be listed: one failed row says why
                entries[jl] = {"id": jl, "image": None, "problem": e.detail, "reason": e.reason}
                continue
            except OSError as e:
                what = f"{jl}: {e.strerror or type(e).__name__}"
                entries[jl] = {"id": jl, "image": None, "problem": what, "reason": "unreadable"}
                continue
            for k, v in found.items():
                if k.startswith(f"{jl}#L"):
                    entries[k] = v
                else:
                    entries.setdefault(k, v)
        held = {e["id"] for m in known for e in m.entries}
        new = [entries[k] for k in sorted(entries) if k not in held]
        out = []
        for i in range(0, len(new), cfg.shard_size):
            chunk = new[i : i + cfg.shard_size]
            dirs = {posixpath.dirname(e["id"]) for e in chunk}
            unit = posixpath.commonpath(list(dirs)) if "" not in dirs else ""
            out.append(NewPartition(unit, 0, len(chunk), chunk))
        return Found(out)

    def rows(self, cfg: SourceConfig, name: str, m: Manifest) -> Listing:
        """The partition's samples as rows, and the failures of those that cannot be (module doc)."""
        loc = Location(cfg)
        field = cfg.caption()
        images = [e["image"] for e in m.entries if e.get("image")]
        from_jsonl, broken = _captions_from_jsonl(loc, images, field)
        out, failed = [], []
        for i, e in enumerate(m.entries):
            sid = e["id"]
            if e.get("problem"):
                failed.append(
                    failure(sid, sid.split("#")[0], e.get("reason", "bad_metadata"), e["problem"])
                )
                continue
            if not e.get("image"):
                failed.append(
                    failure(sid, sid, "missing_image", f"caption {sid} has no image beside it")
                )
                continue
            img = e["image"]
            side = _stem(img) + cfg.caption_extension
            caption = None
            try:
                data = loc.read(side, CAPTION_MAX_BYTES, "caption file")
            except IngestError as err:
                if err.reason != "not_found":  # a link out, a FIFO, unreadable, too large
                    failed.append(failure(sid, img, err.reason, err.detail))
                    continue
                data = None
            try:
                if data is not None:
                    caption = caption_text(data)
                elif from_jsonl.get(img) is not None:
                    caption = caption_text(from_jsonl[img])
            except NotText as err:
                where = side if data is not None else f"its {JSONL} line's {field!r}"
                failed.append(failure(sid, img, "bad_caption", f"{where} is {err}"))
                continue
            if caption is None:
                bad = _broken_jsonl_of(img, broken)
                if bad is not None:
                    failed.append(failure(sid, img, bad.reason, f"no {side}, and {bad.detail}"))
                    continue
                failed.append(
                    failure(
                        sid,
                        img,
                        "missing_caption",
                        f"no {side} and no {JSONL} line with {field!r} for it",
                    )
                )
                continue
            out.append(row(cfg, name, sid, img, caption, i))
        return Listing(out, failed)

    def images(
        self, cfg: SourceConfig, m: Manifest, rows: Sequence[ListedRow], max_bytes: int
    ) -> Iterator[ImageRead]:
        """The bytes of each row's image file, in order (every refusal of :class:`Location`, and
        ``too_large``, as the row's failure)."""
        loc = Location(cfg)
        for r in rows:
            try:
                yield r, loc.read(r["url"], max_bytes, "image")
            except IngestError as e:
                yield r, e
