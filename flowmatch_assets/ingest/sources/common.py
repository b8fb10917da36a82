"""What the three source kinds share: opening a location, and the rows and failures they list.

A source kind lists a partition's samples as rows in the PD12M metadata columns (so the filters,
dedupe, the images stage and the data card treat them as they treat PD12M's): ``id``; ``url``
the sample's place in the source (``cats/a.jpg``, ``train-0.parquet#17``, ``00000.tar#000000017.jpg``);
``caption``; ``width``/``height`` unknown before decoding (the images stage checks the decoded
size against the same filters); ``mime_type`` from the extension; ``hash`` none (duplicates are
found by the bytes' md5 after reading, as ``duplicate_content``); ``license`` the source's;
``source`` the source's name; ``row_index`` the sample's position in the partition. A sample
that cannot become a row is a failure ``{id, url, reason, detail}`` with one of:

``missing_caption``  no caption where the source says captions are (no sidecar, no jsonl line,
                     a null column value, no ``.txt`` member or ``.json`` key)
``missing_image``    a caption without an image (an orphan sidecar, a tar sample without an
                     image member, a parquet row whose image has no bytes)
``bad_caption``      a caption file that is not UTF-8 text
``bad_metadata``     a metadata.jsonl line (or a tar sample's ``.json``) that is not a JSON object
``duplicate_id``     a second sample with an id the partition has already (a parquet ``id_field``)
"""

from __future__ import annotations

import io
import mimetypes
import posixpath

import fsspec

from flowmatch_assets.ingest.sources.config import SourceConfig, SourceError

#: Failure reasons of the listing (the images stage adds its own: ingest/images.py).
LISTING_REASONS = (
    "missing_caption", "missing_image", "bad_caption", "bad_metadata", "duplicate_id",
)  # fmt: skip


def open_location(cfg: SourceConfig):
    """``(filesystem, root path)`` of the source's location; SourceError if it is not there."""
    fs, root = fsspec.core.url_to_fs(cfg.location)
    root = root.rstrip("/") or "/"
    try:
        ok = fs.exists(root)
    except Exception as e:  # noqa: BLE001 - a remote that cannot be reached: say which
        raise SourceError(f"source location {cfg.location!r} cannot be reached: {e}") from None
    if not ok:
        raise SourceError(
            f"source location {cfg.location!r} does not exist; fix `location` in the sources "
            "file (flowmatch sources list) or create it"
        )
    return fs, root


def relative(root: str, path: str) -> str:
    """``path`` relative to ``root`` (posix)."""
    path = path.rstrip("/")
    if "://" in path and "://" not in root:  # some filesystems return full URLs from find()
        path = path.split("://", 1)[1]
    r = root if root.endswith("/") else root + "/"
    return path[len(r) :] if path.startswith(r) else posixpath.basename(path)


def join(root: str, rel: str) -> str:
    return f"{root.rstrip('/')}/{rel}" if root != "/" else f"/{rel}"


def hidden(rel: str) -> bool:
    """A path with a part that starts with a dot (``.git``, ``.DS_Store``, temp files)."""
    return any(p.startswith(".") or p == "__pycache__" for p in rel.split("/"))


def find_files(fs, root: str) -> list[str]:
    """Every file under ``root`` (relative, sorted), hidden ones left out."""
    return sorted(r for p in fs.find(root) if not hidden(r := relative(root, p)))


def open_file(fs, path: str, stream_ok: bool = False):
    """A binary file object of ``path``: random access where the filesystem offers it; on an
    HTTP server without range requests (or without a size), a stream (``stream_ok``: a tar is
    read front to back) or else the whole file read once into memory (a parquet file's footer
    is at its end)."""
    if "http" not in fs.protocol:
        return fs.open(path, "rb")
    f = fs.open(path, "rb")
    try:
        if not getattr(f, "size", None):
            raise ValueError("no size: a streaming file")
        f.seek(f.size - 8)
        f.read(8)
        f.seek(0)
        return f
    except ValueError:  # "doesn't appear to support range requests", or a stream
        f.close()
    if stream_ok:
        stream = fs.open(path, "rb", block_size=0)
        stream.seekable = lambda: False  # it says True, but cannot seek
        return stream
    return io.BytesIO(fs.cat_file(path))


def mime_of(name: str) -> str | None:
    return mimetypes.guess_type(name)[0]


def row(cfg: SourceConfig, name: str, sid: str, url: str, caption: str, index: int) -> dict:
    """One listed sample in the PD12M metadata columns (see the module doc)."""
    return {
        "id": sid,
        "url": url,
        "caption": caption,
        "width": None,
        "height": None,
        "mime_type": mime_of(url.rsplit("#", 1)[-1]),
        "hash": None,
        "license": cfg.license,
        "source": name,
        "row_index": index,
    }


def failure(sid: str, url: str | None, reason: str, detail: str) -> dict:
    return {"id": sid, "url": url, "reason": reason, "detail": detail}


def decode_caption(data: bytes) -> str | None:
    """A caption file's text (UTF-8, a BOM dropped, stripped), or None if it is not UTF-8."""
    try:
        return data.decode("utf-8-sig").strip()
    except UnicodeDecodeError:
        return None
