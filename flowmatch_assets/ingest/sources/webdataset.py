"""WebDataset tar shards as img2dataset writes them: ``00000.tar`` holding, per sample,
``000000017.jpg`` + ``000000017.txt`` (the caption) + ``000000017.json`` (url, size, ...).

A sample is every member sharing a key (the member's path up to the first dot of its file name,
the WebDataset rule); its image is the member with an image extension, its caption the member
with extension ``caption_field`` (default ``txt``), else that key of its ``.json``, else the
``.json``'s ``caption`` (img2dataset writes it there too). Every
``*.tar`` under the location is a unit; one with more than ``shard_size`` samples becomes several
partitions. A tar is read front to back (a local or seekable one skips the image data when only
captions are wanted); members are never extracted to disk, so their names cannot reach a path.

A tar that cannot be read whole when it is registered (truncated, a damaged header, a member
declaring more bytes than the file has, a link out of the location) is skipped with its reason
(and registered once it is whole); one that breaks after registration fails the samples it no
longer holds as ``corrupt_container``, never the partition.
"""

from __future__ import annotations

import json
import posixpath
import re
import tarfile
import zlib
from collections.abc import Callable, Iterator, Sequence

from flowmatch_assets.ingest.images import IngestError
from flowmatch_assets.ingest.sources.common import (
    CAPTION_MAX_BYTES,
    NotText,
    caption_text,
    failure,
    row,
)
from flowmatch_assets.ingest.sources.config import IMAGE_EXTS, SourceConfig
from flowmatch_assets.ingest.sources.kind import (
    Found,
    ImageRead,
    ListedRow,
    Listing,
    Manifest,
    NewPartition,
    Skipped,
    SourceKind,
)
from flowmatch_assets.ingest.sources.location import Location

_KEY = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")  # WebDataset's base_plus_ext
#: What reading a broken tar raises (tarfile, the decompressors, short reads).
_BROKEN = (tarfile.TarError, EOFError, OSError, zlib.error, ValueError)


#: The largest GNU long-name or pax extended header read (a name, a few attributes): a bigger
#: one breaks its tar before it is read (``tarfile`` reads it whole: a 10.9 MB gzip tar whose
#: long name is 2.5 GB took 2.56 GB to register).
HEADER_MAX_BYTES = 1 << 20


class _BoundedTarInfo(tarfile.TarInfo):
    """``tarfile.TarInfo`` that refuses a long-name or pax header above HEADER_MAX_BYTES before
    reading it (``tarfile.open(tarinfo=...)``)."""

    def _proc_gnulong(self, tarfile_):
        self._bound()
        return super()._proc_gnulong(tarfile_)

    def _proc_pax(self, tarfile_):
        self._bound()
        return super()._proc_pax(tarfile_)

    def _bound(self) -> None:
        if self.size > HEADER_MAX_BYTES:
            raise tarfile.HeaderError(
                f"an extended header (long name or pax) of {self.size} bytes, above "
                f"{HEADER_MAX_BYTES}: not read"
            )


def split_name(name: str) -> tuple[str, str] | None:
    """``(key, extension)`` of a member name (``a/000017.seg.png`` -> ``a/000017``, ``seg.png``)."""
    m = _KEY.match(name)
    return (m.group(1), m.group(2).lower()) if m else None


def _broken(rel: str, e: BaseException, member: str | None = None) -> IngestError:
    """``corrupt_container``; ``member``: the member whose header was read when it broke (the
    samples before it are whole)."""
    msg = str(e).strip() or type(e).__name__
    if isinstance(e, UnicodeDecodeError):
        msg = "a member name is not text"
    err = IngestError("corrupt_container", f"{rel}: {msg}")
    err.member = member  # type: ignore[attr-defined]
    return err


def _open_at(f, span: list | None, size: int | None) -> tarfile.TarFile | None:
    """The uncompressed tar ``f`` read from ``span``'s first header (a partition's stretch),
    or None when there is no usable span (a compressed tar, a file shorter than it was)."""
    if not span or size is None or span[1] > size:
        return None
    try:
        f.seek(span[0])
        return tarfile.open(fileobj=f, mode="r:", tarinfo=_BoundedTarInfo)
    except _BROKEN:
        f.seek(0)
        return None


def _members(
    loc: Location, rel: str, read: Callable | None = None, span: list | None = None
) -> Iterator[tuple[tarfile.TarInfo, bytes | None]]:
    """Every regular member of the tar ``rel`` and, where ``read(member)`` says so, its bytes;
    with a ``span`` (a partition's stretch of an uncompressed tar, recorded when it was
    registered) only the members in it. Raises IngestError: the location's refusals, or
    ``corrupt_container`` when the tar breaks (a member that claims more bytes than the file
    has breaks it before it is yielded)."""
    with loc.open(rel, stream_ok=True) as f:
        size = loc.size(f)
        seekable = getattr(f, "seekable", lambda: False)()
        tf = _open_at(f, span, size) if seekable else None
        end = span[1] if tf is not None else None
        try:
            if tf is None:
                mode = "r:*" if seekable else "r|*"
                tf = tarfile.open(fileobj=f, mode=mode, tarinfo=_BoundedTarInfo)
        except _BROKEN as e:
            raise _broken(rel, e) from None
        with tf:
            it = iter(tf)
            while True:
                try:
                    info = next(it)
                except StopIteration:
                    return
                except _BROKEN as e:
                    raise _broken(rel, e) from None
                if end is not None and info.offset >= end:
                    return
                # offsets are in the file only for a plain tar read from it (a gzip tar's
                # are in its decompressed stream: a cut member is caught by its read below)
                if size is not None and tf.fileobj is f and info.offset_data + info.size > size:
                    what = f"member {info.name!r} declares {info.size} bytes, past the end of "
                    raise _broken(rel, ValueError(f"{what}the file ({size} bytes)"), info.name)
                if not info.isfile():
                    continue
                data = None
                if read is not None and read(info):
                    try:
                        fh = tf.extractfile(info)
                        data = fh.read() if fh is not None else b""
                    except _BROKEN as e:
                        raise _broken(rel, e, info.name) from None
                    if len(data) != info.size:
                        cut = ValueError(f"member {info.name!r} is cut short")
                        raise _broken(rel, cut, info.name)
                yield info, data


def _uncompressed(loc: Location, rel: str) -> bool:
    """Whether the tar ``rel`` is a plain (uncompressed) tar in a local file: its members'
    offsets are offsets in the file, so a partition can seek to its own (issue: 200
    partitions of one tar read it 200 times)."""
    if not loc.local:
        return False
    try:
        with loc.open(rel) as f:
            head = f.read(262)
    except (IngestError, OSError):
        return False
    return len(head) == 262 and head[257:262] == b"ustar"


def _tars(loc: Location) -> list[str]:
    """The name of every tar under the location (or of the location, if it is one)."""
    return [f for f in loc.files() if f.endswith(".tar")]


class WebDatasetKind(SourceKind):
    """WebDataset tars, img2dataset's output (module doc)."""

    name = "webdataset"

    def scan(self, cfg: SourceConfig, known: Sequence[Manifest]) -> Found:
        """New partitions ``(tar, start, end, sample keys)`` for every tar not registered yet, and
        the tars skipped (``(tar, reason, detail)``: they cannot be read whole)."""
        loc = Location(cfg)
        held = {m.unit for m in known}
        out, skipped = [], []
        for rel in _tars(loc):
            if rel in held:
                continue
            keys: list[str] = []
            first: dict[str, int] = {}  # key -> its first member's header offset
            last: dict[str, int] = {}  # key -> the end of its last member's data
            plain = _uncompressed(loc, rel)
            try:
                for info, _ in _members(loc, rel):
                    kx = split_name(info.name)
                    if kx is None or posixpath.basename(info.name).startswith("."):
                        continue
                    if kx[0] not in first:
                        first[kx[0]] = info.offset
                        keys.append(kx[0])
                    last[kx[0]] = info.offset_data + info.size
            except IngestError as e:
                skipped.append(Skipped(rel, e.reason, e.detail))
                continue
            for k in range(0, len(keys), cfg.shard_size):  # an empty tar: no partition
                chunk = keys[k : k + cfg.shard_size]
                span = [first[chunk[0]], max(last[c] for c in chunk)] if plain else None
                out.append(NewPartition(rel, k, k + len(chunk), chunk, span))
        return Found(out, skipped)

    def rows(self, cfg: SourceConfig, name: str, m: Manifest) -> Listing:
        """The partition's samples as rows (their caption members read, images skipped)."""
        loc = Location(cfg)
        field = cfg.caption()
        wanted = set(m.entries)
        found: dict[str, dict] = {
            k: {"exts": [], "caption": None, "json": None, "big": []} for k in m.entries
        }

        def small(info: tarfile.TarInfo) -> bool:
            kx = split_name(info.name)
            return (
                kx is not None
                and kx[0] in wanted
                and kx[1] in (field, "json")
                and info.size <= CAPTION_MAX_BYTES
            )

        broke: IngestError | None = None
        last = None  # the key being read when the tar broke: its members may be cut off
        try:
            for info, data in _members(loc, m.unit, small, getattr(m, "span", None)):
                kx = split_name(info.name)
                if kx is None or kx[0] not in wanted:
                    continue
                last = kx[0]
                s = found[kx[0]]
                s["exts"].append(kx[1])
                if kx[1] in (field, "json") and info.size > CAPTION_MAX_BYTES:
                    s["big"].append(f"{info.name} ({info.size} bytes)")
                elif data is not None and kx[1] == field:
                    s["caption"] = data
                elif data is not None and kx[1] == "json":
                    s["json"] = data
        except IngestError as e:
            broke = e
        complete = set()  # keys whose members all came before the break
        if broke is not None:
            at = getattr(broke, "member", None)
            at_key = (split_name(at) or (None,))[0] if at else None
            for k in m.entries:  # the last key read is whole if the break came at another's member
                if found[k]["exts"] and (k != last or (at_key is not None and at_key != last)):
                    complete.add(k)
        out, failed = [], []
        for i, key in enumerate(m.entries):
            s = found[key]
            img = next((e for e in s["exts"] if "." + e in IMAGE_EXTS), None)
            url = f"{m.unit}#{key}.{img}" if img else f"{m.unit}#{key}"
            if broke is not None and key not in complete:
                failed.append(failure(key, url, broke.reason, broke.detail))
                continue
            if img is None:
                what = f"members {', '.join(s['exts'])}" if s["exts"] else "no members any more"
                failed.append(
                    failure(key, url, "missing_image", f"sample {key} has no image ({what})")
                )
                continue
            if s["big"]:
                failed.append(
                    failure(
                        key, url, "too_large", f"{s['big'][0]} is above {CAPTION_MAX_BYTES} bytes"
                    )
                )
                continue
            caption = None
            try:
                if s["caption"] is not None:
                    caption = caption_text(s["caption"])
                elif s["json"] is not None:
                    try:
                        meta = json.loads(s["json"].decode("utf-8"))
                    except (json.JSONDecodeError, UnicodeDecodeError) as e:
                        what = e.msg if isinstance(e, json.JSONDecodeError) else "not UTF-8"
                        failed.append(
                            failure(key, url, "bad_metadata", f"{key}.json is not JSON: {what}")
                        )
                        continue
                    if isinstance(meta, dict):
                        key_ = field if meta.get(field) is not None else "caption"
                        caption = caption_text(meta.get(key_))
            except NotText as e:
                where = f"{key}.{field}" if s["caption"] is not None else f"{key}.json's caption"
                failed.append(failure(key, url, "bad_caption", f"{where} is {e}"))
                continue
            if caption is None:
                failed.append(
                    failure(
                        key,
                        url,
                        "missing_caption",
                        f"sample {key} has no .{field} member and no {field!r} in its .json",
                    )
                )
                continue
            out.append(row(cfg, name, key, url, caption, i))
        return Listing(out, failed)

    def images(
        self, cfg: SourceConfig, m: Manifest, rows: Sequence[ListedRow], max_bytes: int
    ) -> Iterator[ImageRead]:
        """Each row's image member (the first member of its key with an image extension, as the
        listing chose), read in one pass through the tar (rows in tar order). Rows are found by
        their key (the row id), so names with ``#`` or ``?`` need no parsing; if the tar breaks,
        the rows not read yet fail as ``corrupt_container``."""
        loc = Location(cfg)
        want = {r["id"]: r for r in rows}
        done: set[str] = set()

        def image_of(info: tarfile.TarInfo) -> str | None:
            kx = split_name(info.name)
            if kx is None or kx[0] not in want or kx[0] in done or "." + kx[1] not in IMAGE_EXTS:
                return None
            return kx[0]

        broke: IngestError | None = None
        try:
            span = getattr(m, "span", None)
            for info, data in _members(
                loc, m.unit, lambda i: image_of(i) and i.size <= max_bytes, span
            ):
                key = image_of(info)
                if key is None:
                    continue
                done.add(key)
                r = want.pop(key)
                if data is None:
                    yield r, IngestError("too_large", f"{info.size} bytes > max_bytes {max_bytes}")
                else:
                    yield r, data
        except IngestError as e:
            broke = e
        for key, r in want.items():
            if broke is not None:
                yield r, broke
            else:
                yield r, IngestError("not_found", f"{key} is not in {m.unit} any more")
