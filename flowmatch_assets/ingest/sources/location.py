"""Where a source's bytes come from, confined: every read stays inside the source's location.

A dataset someone downloads is untrusted input. :class:`Location` is the only way a source kind
reaches its files, and it holds every read to these rules:

- A name that is absolute or climbs out with ``..`` (a metadata.jsonl ``file_name``, a manifest
  written elsewhere) is ``outside_source`` before anything is opened.
- On a local filesystem links are resolved first: a file whose real path leaves the location is
  ``outside_source`` unless the source sets ``follow_links: true`` (an explicit opt-in, off by
  default). Listing follows a linked folder only when it stays inside (each real folder once).
- Only regular files are read: a FIFO, a device such as ``/dev/zero``, a socket or a folder is
  ``not_regular_file``, decided by ``stat`` before it is opened (a FIFO never blocks, a device is
  never opened) and checked again on the opened descriptor.
- A read takes at most ``limit + 1`` bytes, whatever the file's size claims (``too_large``); a file
  that cannot be read (permissions, I/O errors) is ``unreadable``; one that is gone ``not_found``.

Remote locations (any other fsspec filesystem: http, s3, ...) have no links: their names are
confined by construction (relative to the location) and their reads bounded in bytes. Every
refusal is an :class:`~flowmatch_assets.ingest.images.IngestError` whose detail names the file and
what it is, never what it holds.
"""

from __future__ import annotations

import errno
import io
import os
import posixpath
import stat

import fsspec
from fsspec.implementations.local import LocalFileSystem

from flowmatch_assets.ingest.images import IngestError
from flowmatch_assets.ingest.sources.config import SourceConfig, SourceError

_CHUNK = 1 << 20


def hidden(rel: str) -> bool:
    """A path with a part that starts with a dot (``.git``, ``.DS_Store``, temp files)."""
    return any(p.startswith(".") or p == "__pycache__" for p in rel.split("/"))


def _kind_of(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


class Location:
    """A source's location, opened once: its filesystem and root, and confined reads under it
    (see the module doc). Raises SourceError when the location does not exist or cannot be
    reached."""

    def __init__(self, cfg: SourceConfig):
        self.cfg = cfg
        self.fs, root = fsspec.core.url_to_fs(cfg.location)
        self.root = root.rstrip("/") or "/"
        self.local = isinstance(self.fs, LocalFileSystem)
        self.follow_links = bool(getattr(cfg, "follow_links", False))
        try:
            ok = self.fs.exists(self.root)
            # a remote folder answers like a file (an HTML listing): there only a container's
            # name says the location is one file
            named = self.local or self.root.endswith((".parquet", ".tar"))
            self.is_file = bool(ok and named and self.fs.isfile(self.root))
        except Exception as e:  # noqa: BLE001 - a remote that cannot be reached: say which
            raise SourceError(
                f"source location {cfg.location!r} cannot be reached: {type(e).__name__}: {e}"
            ) from None
        if not ok:
            raise SourceError(
                f"source location {cfg.location!r} does not exist; fix `location` in the sources "
                "file (flowmatch sources list) or create it"
            )
        #: local: the real path everything must stay under (the location's own file, or folder)
        self.real_root = os.path.realpath(self.root) if self.local else self.root

    # ------------------------------------------------------------------------------ names

    def name_of(self, rel: str) -> str:
        """``rel`` normalised; ``outside_source`` if it is absolute or climbs out."""
        if not isinstance(rel, str) or not rel:
            raise IngestError("outside_source", f"{rel!r} is not a file name under the source")
        norm = posixpath.normpath(rel)
        if norm.startswith("/") or norm == ".." or norm.startswith("../") or "\x00" in norm:
            raise IngestError("outside_source", f"{rel!r} is not inside the source's location")
        return norm

    def path(self, rel: str) -> str:
        """The filesystem path of ``rel`` (a name under the location; for a location that is
        one file, that file's name)."""
        if self.is_file:
            if self.name_of(rel) != posixpath.basename(self.root):
                raise IngestError("outside_source", f"{rel!r} is not the source's file")
            return self.root
        rel = self.name_of(rel)
        return f"{self.root}/{rel}" if self.root != "/" else f"/{rel}"

    # ------------------------------------------------------------------------------ listing

    def files(self) -> list[str]:
        """Every entry under the location that is not a folder (relative names, sorted; hidden
        ones left out): regular files, links and special files alike, the reads decide. A
        location that is one file lists its name."""
        if self.is_file:
            return [posixpath.basename(self.root)]
        if not self.local:
            return sorted(r for p in self.fs.find(self.root) if not hidden(r := self._rel(p)))
        out: list[str] = []
        self._walk(self.real_root, "", {self._dir_id(self.real_root)}, out)
        return sorted(out)

    def _rel(self, path: str) -> str:
        path = path.rstrip("/")
        if "://" in path and "://" not in self.root:  # some filesystems return full URLs
            path = path.split("://", 1)[1]
        r = self.root if self.root.endswith("/") else self.root + "/"
        return path[len(r) :] if path.startswith(r) else posixpath.basename(path)

    @staticmethod
    def _dir_id(path: str) -> tuple[int, int]:
        st = os.stat(path)
        return st.st_dev, st.st_ino

    def _walk(self, real_dir: str, rel_dir: str, seen: set, out: list[str]) -> None:
        try:
            entries = sorted(os.scandir(real_dir), key=lambda e: e.name)
        except OSError:
            return  # an unreadable folder: its files cannot be listed (nothing to fail)
        for e in entries:
            rel = f"{rel_dir}/{e.name}" if rel_dir else e.name
            if hidden(e.name):
                continue
            try:
                is_link = e.is_symlink()
                is_dir = e.is_dir(follow_symlinks=False)
            except OSError:
                continue
            if is_dir:
                self._walk(e.path, rel, seen, out)
                continue
            if is_link:
                real = os.path.realpath(e.path)
                if os.path.isdir(real):  # a linked folder: followed inside (or opted in), once
                    if not (self.follow_links or _inside(real, self.real_root)):
                        continue
                    key = self._dir_id(real)
                    if key not in seen:
                        seen.add(key)
                        self._walk(real, rel, seen, out)
                    continue
            out.append(rel)

    # ------------------------------------------------------------------------------ reading

    def _local_fd(self, rel: str) -> tuple[int, os.stat_result]:
        """A read-only descriptor of ``rel``'s regular file, confined (module doc)."""
        path = self.path(rel)
        real = os.path.realpath(path)
        if not self.follow_links and not _inside(real, self.real_root):
            raise IngestError(
                "outside_source",
                f"{rel} is a link that leaves the source's location (follow_links is off)",
            )
        try:
            st = os.stat(real)
        except FileNotFoundError:
            raise IngestError("not_found", f"{rel} is not in the source any more") from None
        except OSError as e:
            raise IngestError("unreadable", f"{rel}: {e.strerror or type(e).__name__}") from None
        if not stat.S_ISREG(st.st_mode):
            raise IngestError("not_regular_file", f"{rel} is {_kind_of(st.st_mode)}")
        flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
        try:
            fd = os.open(real, flags)
        except FileNotFoundError:
            raise IngestError("not_found", f"{rel} is not in the source any more") from None
        except OSError as e:
            if e.errno == errno.ELOOP:  # replaced by a link since it was resolved
                raise IngestError("outside_source", f"{rel} became a link") from None
            raise IngestError("unreadable", f"{rel}: {e.strerror or type(e).__name__}") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # swapped since the stat above
            os.close(fd)
            raise IngestError("not_regular_file", f"{rel} is {_kind_of(st.st_mode)}")
        os.set_blocking(fd, True)
        return fd, st

    def read(self, rel: str, limit: int, what: str = "file") -> bytes:
        """The bytes of ``rel``: at most ``limit`` (``too_large`` past it, whatever the size
        claims), from a regular file inside the location (module doc)."""
        if self.local:
            fd, _ = self._local_fd(rel)
            with os.fdopen(fd, "rb", buffering=0) as f:
                return _read_bounded(f, rel, limit, what)
        path = self.path(rel)
        try:
            with self._open_remote(path, stream=True) as f:
                return _read_bounded(f, rel, limit, what)
        except FileNotFoundError:
            raise IngestError("not_found", f"{rel} is not in the source any more") from None
        except IngestError:
            raise
        except OSError as e:
            raise IngestError("unreadable", f"{rel}: {type(e).__name__}: {e}") from None

    def open(self, rel: str, stream_ok: bool = False):
        """A binary file object of ``rel`` (a container: a parquet file, a tar), confined and
        checked like :meth:`read`; remote: random access where the server offers it, else a
        stream (``stream_ok``: a tar is read front to back) or the whole file read once."""
        if self.local:
            fd, _ = self._local_fd(rel)
            return os.fdopen(fd, "rb")
        path = self.path(rel)
        try:
            return self._open_remote(path, stream=False, stream_ok=stream_ok)
        except FileNotFoundError:
            raise IngestError("not_found", f"{rel} is not in the source any more") from None

    def size(self, f) -> int | None:
        """The size of an opened container, where known (a tar's members are checked
        against it)."""
        try:
            if hasattr(f, "fileno"):
                return os.fstat(f.fileno()).st_size
        except (OSError, io.UnsupportedOperation):
            pass
        size = getattr(f, "size", None)
        return int(size) if isinstance(size, int) else None

    def _open_remote(self, path: str, stream: bool, stream_ok: bool = False):
        fs = self.fs
        if "http" not in fs.protocol:
            return fs.open(path, "rb")
        if stream:
            return fs.open(path, "rb", block_size=0)
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
            s = fs.open(path, "rb", block_size=0)
            s.seekable = lambda: False  # it says True, but cannot seek
            return s
        return io.BytesIO(fs.cat_file(path))


def _read_bounded(f, rel: str, limit: int, what: str) -> bytes:
    chunks: list[bytes] = []
    total = 0
    while total <= limit:
        chunk = f.read(min(_CHUNK, limit + 1 - total))
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    if total > limit:
        raise IngestError("too_large", f"{what} {rel} is above {limit} bytes")
    return b"".join(chunks)
