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

- A local path is opened component by component, each relative to the folder's descriptor
  and never following a link (links are resolved by hand), so a folder swapped for a link while
  it is read cannot lead out; nothing on a pseudo-filesystem (procfs, sysfs, ...) is read.

Remote locations (any other fsspec filesystem: http, s3, ...) have no links: their names are
confined by construction (relative to the location), their listings never leave the location's
path, and their reads are bounded in bytes. An http(s) location is read behind the downloads'
address policy (``network.guarded_http``; an ``s3://`` one ``guarded_s3``): every connection to a public address (or
``ingest.allow_networks``), no redirect off the location's host. A password in the location
is redacted from every detail (``config.redact``). Every
refusal is an :class:`~flowmatch_assets.ingest.images.IngestError` whose detail names the file and
what it is, never what it holds.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import posixpath
import stat

import fsspec
from fsspec.implementations.local import LocalFileSystem

from flowmatch_assets.ingest.images import IngestError
from flowmatch_assets.ingest.sources.config import SourceConfig, SourceError, redact
from flowmatch_assets.ingest.sources.network import guarded_http, guarded_s3

_CHUNK = 1 << 20
#: The endings of a remote location that is one file (a container, a URL list: urls.py)
ONE_FILE = (".parquet", ".tar", ".csv", ".tsv", ".tsv.gz", ".jsonl")


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


#: Filesystems whose "files" are the kernel's or a process's state (procfs: /proc/self/environ
#: holds the environment, and says its size is 0), never a dataset's.
PSEUDO_FILESYSTEMS = frozenset(
    """proc sysfs devtmpfs devpts debugfs tracefs securityfs cgroup cgroup2 configfs bpf pstore
    efivarfs fusectl hugetlbfs mqueue autofs binfmt_misc rpc_pipefs nsfs selinuxfs
    nfsd""".split()
)
_FS_OF_DEV: dict[int, str] = {}


def _mount_types() -> dict[int, str]:
    """Device number -> filesystem type of every mount (/proc/self/mountinfo)."""
    out = {}
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                major, _, minor = left.split()[2].partition(":")
                out[os.makedev(int(major), int(minor))] = right.split()[0]
    except (OSError, ValueError, IndexError):
        pass
    return out


def pseudo_filesystem(dev: int) -> str | None:
    """The pseudo-filesystem type (``proc``, ``sysfs``, ...) the device ``dev`` is, or None
    for an ordinary one (or where the mount table cannot be read)."""
    if dev not in _FS_OF_DEV:
        _FS_OF_DEV.update(_mount_types())
    fs = _FS_OF_DEV.setdefault(dev, "")
    return fs if fs in PSEUDO_FILESYSTEMS else None


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


class Location:
    """A source's location, opened once: its filesystem and root, and confined reads under it
    (see the module doc). Raises SourceError when the location does not exist or cannot be
    reached."""

    def __init__(self, cfg: SourceConfig):
        self.cfg = cfg
        scheme = cfg.location.split("://", 1)[0].lower() if "://" in cfg.location else ""
        if scheme in ("http", "https"):
            self.fs, root = guarded_http(cfg), cfg.location
        elif scheme == "s3":
            self.fs, root = guarded_s3(cfg), cfg.location.split("://", 1)[1]
        else:
            self.fs, root = fsspec.core.url_to_fs(cfg.location)
        self.root = root.rstrip("/") or "/"
        self.local = isinstance(self.fs, LocalFileSystem)
        self.follow_links = bool(getattr(cfg, "follow_links", False))
        try:
            ok = self.fs.exists(self.root)
            # a remote folder answers like a file (an HTML listing): there only a container's
            # (or a URL list's) name says the location is one file
            named = self.local or self.root.endswith(ONE_FILE)
            self.is_file = bool(ok and named and self.fs.isfile(self.root))
        except Exception as e:  # noqa: BLE001 - a remote that cannot be reached: say which
            raise SourceError(
                redact(
                    f"source location {cfg.shown!r} cannot be reached: {type(e).__name__}: {e}",
                    cfg.location,
                )
            ) from None
        if not ok:
            raise SourceError(
                f"source location {cfg.shown!r} does not exist; fix `location` in the sources "
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
            return self._remote_files()
        out: list[str] = []
        self._walk(self.real_root, "", {self._dir_id(self.real_root)}, out)
        return sorted(out)

    def _remote_files(self) -> list[str]:
        """The files under a remote location, listed folder by folder: an entry whose name
        leaves the location's path (a ``../../`` link in an HTML listing, another host's URL)
        is neither listed nor looked into."""
        out, todo, seen = [], [self.root], {self.root.rstrip("/")}
        prefix = self.root.rstrip("/") + "/"
        while todo:
            for e in self.fs.ls(todo.pop(), detail=True):
                name = str(e["name"])
                if not name.startswith(prefix):
                    continue
                try:
                    rel = self.name_of(self._rel(name))
                except IngestError:
                    continue
                if e.get("type") == "directory":
                    key = name.rstrip("/")
                    if key not in seen:
                        seen.add(key)
                        todo.append(name)
                elif not hidden(rel):
                    out.append(rel)
        return sorted(set(out))

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
        """List ``real_dir`` (as ``rel_dir``) into ``out``. A linked folder is followed when it
        leads outside (with ``follow_links`` on) or to a folder inside that is not listed by
        its own name (under a hidden one); each real folder once, none on a pseudo-filesystem
        (procfs, sysfs, ...)."""
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
                with contextlib.suppress(OSError):
                    seen.add(self._dir_id(e.path))
                self._walk(e.path, rel, seen, out)
                continue
            if is_link:
                try:
                    real = os.path.realpath(e.path)
                    linked_dir = os.path.isdir(real)
                except (OSError, ValueError):
                    continue
                if linked_dir:
                    inside = _inside(real, self.real_root)
                    if not (self.follow_links or inside):
                        continue
                    if inside and not hidden(posixpath.relpath(real, self.real_root)):
                        continue  # listed under its own name already: not twice
                    try:
                        key = self._dir_id(real)
                    except OSError:
                        continue
                    if key not in seen and pseudo_filesystem(key[0]) is None:
                        seen.add(key)
                        self._walk(real, rel, seen, out)
                    continue
            out.append(rel)

    # ------------------------------------------------------------------------------ reading

    def _local_fd(self, rel: str) -> tuple[int, os.stat_result]:
        """A read-only descriptor of ``rel``'s regular file, confined (module doc): opened one
        path component at a time, each relative to the descriptor of the folder before it and
        never following a link (links are resolved here, by hand), so a folder swapped for a
        link while this runs cannot lead the read out; with ``follow_links`` on, a link out is
        opened by its real path. Files on pseudo-filesystems (procfs, sysfs, ...) are refused
        either way."""
        if self.is_file:
            self.path(rel)  # outside_source for any other name
            fd = self._open_at(None, self.real_root, rel, last=True)
        elif self.follow_links:
            fd = self._open_followed(rel)
        else:
            fd = self._open_walk(rel)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise IngestError("not_regular_file", f"{rel} is {_kind_of(st.st_mode)}")
            fs = pseudo_filesystem(st.st_dev)
            if fs is not None:
                raise IngestError(
                    "not_regular_file", f"{rel} is on a {fs} pseudo-filesystem, not a file"
                )
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        return fd, st

    def _open_at(self, dir_fd: int | None, name: str, rel: str, last: bool) -> int:
        """``open(name)`` (relative to ``dir_fd``) without following a link: a folder unless
        ``last``; anything but a regular file (a FIFO, a device, a socket) is refused by
        ``stat`` before it is opened."""
        try:
            if last:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                if not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
                    raise IngestError("not_regular_file", f"{rel} is {_kind_of(st.st_mode)}")
            flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW
            flags |= os.O_NONBLOCK if last else os.O_DIRECTORY
            return os.open(name, flags, dir_fd=dir_fd)
        except FileNotFoundError:
            raise IngestError("not_found", f"{rel} is not in the source any more") from None
        except OSError as e:
            if e.errno == errno.ELOOP:  # turned into a link since it was looked at
                raise IngestError("outside_source", f"{rel} became a link") from None
            if e.errno == errno.ENOTDIR:
                raise IngestError("not_found", f"{rel}: a folder on its path is not one") from None
            raise IngestError("unreadable", f"{rel}: {e.strerror or type(e).__name__}") from None

    def _open_walk(self, rel: str) -> int:
        """:meth:`_local_fd`'s walk from the location's folder: ``..`` and links resolved
        component by component against descriptors held open, ``outside_source`` the moment
        the path leaves the location."""
        todo = self.name_of(rel).split("/")
        try:
            fds = [os.open(self.real_root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)]
        except OSError as e:
            raise IngestError("unreadable", f"{rel}: the source's folder: {e.strerror}") from None
        hops = 0
        try:
            while todo:
                part = todo.pop(0)
                if part in ("", "."):
                    continue
                if part == "..":
                    if len(fds) == 1:
                        raise IngestError("outside_source", f"{rel} leads out of the source")
                    os.close(fds.pop())
                    continue
                try:
                    st = os.stat(part, dir_fd=fds[-1], follow_symlinks=False)
                except FileNotFoundError:
                    raise IngestError("not_found", f"{rel} is not in the source any more") from None
                except OSError as e:
                    raise IngestError("unreadable", f"{rel}: {e.strerror}") from None
                if stat.S_ISLNK(st.st_mode):
                    hops += 1
                    if hops > 40:
                        raise IngestError("unreadable", f"{rel}: too many levels of links")
                    try:
                        target = os.readlink(part, dir_fd=fds[-1])
                    except FileNotFoundError:
                        raise IngestError(
                            "not_found", f"{rel} is not in the source any more"
                        ) from None
                    except OSError as e:  # swapped since the stat: looked at again
                        if e.errno != errno.EINVAL:
                            raise IngestError("unreadable", f"{rel}: {e.strerror}") from None
                        todo.insert(0, part)
                        continue
                    if target.startswith("/"):
                        target = posixpath.normpath(target)
                        if not _inside(target, self.real_root):  # by another path to it?
                            with contextlib.suppress(OSError, ValueError):
                                target = os.path.realpath(target)
                        if not _inside(target, self.real_root):
                            raise IngestError(
                                "outside_source",
                                f"{rel} is a link that leaves the source's location "
                                "(follow_links is off)",
                            )
                        while len(fds) > 1:
                            os.close(fds.pop())
                        target = posixpath.relpath(target, self.real_root)
                    todo[:0] = target.split("/")
                    continue
                fds.append(self._open_at(fds[-1], part, rel, last=not todo))
            if len(fds) == 1:
                raise IngestError("not_regular_file", f"{rel} is a folder")
            return fds.pop()
        finally:
            for fd in fds:
                os.close(fd)

    def _open_followed(self, rel: str) -> int:
        """:meth:`_local_fd` with ``follow_links`` on: the real path opened (its last component
        without following a link)."""
        try:
            real = os.path.realpath(self.path(rel))
        except (OSError, ValueError) as e:
            raise IngestError("unreadable", f"{rel}: {getattr(e, 'strerror', None) or e}") from None
        return self._open_at(None, real, rel, last=True)

    def _remote_failure(self, e: BaseException, rel: str) -> IngestError:
        """The IngestError of a remote read that failed: the address guard's or redirect's
        refusal where one is behind it (fsspec wraps them), else not_found / unreadable."""
        seen: BaseException | None = e
        for _ in range(8):
            if seen is None:
                break
            if isinstance(seen, IngestError):
                return IngestError(seen.reason, redact(f"{rel}: {seen.detail}", self.cfg.location))
            seen = seen.__cause__ or seen.__context__ or getattr(seen, "os_error", None)
        if isinstance(e, FileNotFoundError):
            return IngestError("not_found", f"{rel} is not in the source any more")
        detail = redact(f"{rel}: {type(e).__name__}: {e}", self.cfg.location)
        return IngestError("unreadable", detail)

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
        except IngestError as e:
            if e.reason == "too_large":
                raise
            raise self._remote_failure(e, rel) from None
        except Exception as e:  # noqa: BLE001 - fsspec/aiohttp raise many kinds; mapped
            raise self._remote_failure(e, rel) from None

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
        except IngestError as e:
            raise self._remote_failure(e, rel) from None
        except Exception as e:  # noqa: BLE001 - fsspec/aiohttp raise many kinds; mapped
            raise self._remote_failure(e, rel) from None

    def size(self, f) -> int | None:
        """The size of an opened container, where known (a tar's members are checked
        against it)."""
        if isinstance(f, io.BytesIO):  # a remote file read whole
            return f.getbuffer().nbytes
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
