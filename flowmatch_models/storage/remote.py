"""A remote data root: an S3-compatible object store is the truth, the local data root is this
machine's cache of it (as MosaicML streaming and LitData keep a remote and a local cache).

``FLOWMATCH_REMOTE=s3://bucket/prefix`` turns it on; the endpoint and credentials come from the
standard AWS variables and files (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...), read by
the client and never written anywhere by flowmatch. The client is s3fs: fsspec, which the
sources already use, batching concurrent PUTs and GETs on aiobotocore. Every local-path file
of the project stays local-path code: the remote lives at two boundaries.

**Publish** (:meth:`Remote.publish`, called by a partition's transaction before its local
renames: ``flowmatch_models.storage.atomic``): each file of the partition (its shard, preview
and catalog records, written and fsynced but not renamed yet) is uploaded under a key of its
own publish (``data/<path>.<publish id>``: never overwritten), then the partition's marker
``commits/<asset>/<partition>.json`` (each file's key, size and sha256) and a journal entry
``journal/<time>-<publish id>.json`` with the same content. The marker is written last, so a
reader never sees half a publish; an upload that fails raises and the transaction publishes
nothing locally either. Objects of the publish a marker replaces are deleted after it.

**Read**: :meth:`Remote.sync` reads the journal after the last entry this machine saw (one
LIST when nothing changed) and folds it to each partition's newest publish (an older one's
objects are deleted: a machine that was away never asks for them), keeps each new marker
locally (``.remote/commits/``: what ``DataLayout.partitions_with`` counts as present) and
brings the small files (catalog records, previews, the sources registry); shards stay remote
until :func:`readable` fetches one, checks its size and sha256 and renames it into place. A cached file is trusted while its size,
mtime and inode are the ones recorded when it was verified; otherwise it is fetched again.
``cache_files`` / ``trim`` show and trim the cache (least recently used first).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
import uuid
from pathlib import Path

#: The environment variable that names the remote (``s3://bucket/prefix``).
REMOTE_ENV = "FLOWMATCH_REMOTE"
#: Under the local data root: the markers synced, the cache's stamps, the journal position.
STATE_DIR = ".remote"
#: How far before the last journal entry seen a sync lists again (clock skew between machines).
SKEW_S = 300
#: Journal entries read (and their files fetched) at a time by a sync.
SYNC_BATCH = 512
_CHUNK = 8 << 20


class RemoteError(RuntimeError):
    """The remote cannot be reached or holds something else than its marker says."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _stamp(path: Path) -> list[int]:
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def _write_json(path: Path, obj) -> None:
    """Write this machine's remote state (a marker, a cache stamp, the journal position)
    atomically, without an fsync each: it is a cache of the remote, and removing
    ``.remote/`` and syncing again rebuilds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{path.name}.{uuid.uuid4().hex[:8]}")
    tmp.write_text(json.dumps(obj, sort_keys=True))
    os.replace(tmp, path)


def _publish_id() -> str:
    """A publish's id: its time first, so journal keys sort in publish order."""
    return f"{time.time_ns():020d}-{uuid.uuid4().hex[:12]}"


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


class Remote:
    """The object store at ``url`` (``s3://bucket/prefix``) for the data root ``root``."""

    def __init__(self, url: str, root: str | Path):
        if not url.startswith("s3://") or len(url) <= 5:
            raise RemoteError(f"{REMOTE_ENV}={url!r}: give it as s3://bucket/prefix")
        self.url = url.rstrip("/")
        self.base = self.url[5:]
        self.root = Path(root).expanduser().resolve()
        self.state = self.root / STATE_DIR
        self._fs = None

    @property
    def endpoint(self) -> str:
        return os.environ.get("AWS_ENDPOINT_URL") or "the AWS default endpoint"

    @property
    def fs(self):
        if self._fs is None:
            import s3fs

            self._fs = s3fs.S3FileSystem(skip_instance_cache=True)
        return self._fs

    def _fail(self, what: str, e: BaseException) -> RemoteError:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        return RemoteError(
            f"remote {self.url} ({self.endpoint}): {what} failed: {type(e).__name__}: {first}"
        )

    def key(self, *parts: str) -> str:
        return "/".join([self.base, *parts])

    # -------------------------------------------------------------------------------- publish

    def publish(self, files: dict[Path, Path], asset: str, partition: str) -> dict:
        """Upload ``files`` (target -> its written temp file) as one publish of ``asset``'s
        ``partition``, then its marker and journal entry (module doc); returns the marker."""
        pub = _publish_id()
        described, uploads = self._describe(files, "data", pub)
        entry: dict = {
            "kind": "partition",
            "asset": asset,
            "partition": partition,
            "publish": pub,
            "host": socket.gethostname(),
            "time": time.time(),
            "files": described,
        }
        marker_key = self.key("commits", asset, f"{partition}.json")
        try:
            old = self._marker(marker_key)
            if uploads:
                self.fs.put(list(uploads), list(uploads.values()))
            body = json.dumps(entry, sort_keys=True).encode()
            self.fs.pipe(marker_key, body)  # the commit: readers see this publish from here on
            self.fs.pipe(self.key("journal", f"{pub}.json"), body)
        except Exception as e:  # noqa: BLE001 - any client error: one line naming the remote
            self._forget(uploads.values())
            raise self._fail(f"publishing {asset} {partition}", e) from None
        if old:
            keep = {f["key"] for f in entry["files"].values()}
            self._forget(f["key"] for f in old.get("files", {}).values() if f["key"] not in keep)
        # this machine's own copy of the marker, and the stamps of the files it now caches
        self._keep_marker(entry, files)
        return entry

    def _describe(
        self, files: dict[Path, Path], folder: str, pub: str
    ) -> tuple[dict[str, dict], dict[str, str]]:
        """``({path under the root: {key, size, sha256}}, {local file: key})`` of ``files``
        (target -> the file holding its content) as publish ``pub`` under ``folder/``."""
        described, uploads = {}, {}
        for target, src in files.items():
            rel = Path(os.path.abspath(target)).relative_to(self.root).as_posix()
            key = self.key(folder, f"{rel}.{pub}")
            described[rel] = {"key": key, "size": os.path.getsize(src), "sha256": sha256_file(src)}
            uploads[str(src)] = key
        return described, uploads

    def _keep_marker(self, entry: dict, files: dict[Path, Path] | None = None) -> None:
        for target, tmp in (files or {}).items():
            rel = Path(os.path.abspath(target)).relative_to(self.root).as_posix()
            info = entry["files"][rel]
            _write_json(self.state / "cached" / f"{rel}.json", {**info, "stamp": _stamp(tmp)})
        _write_json(self.marker_path(entry["asset"], entry["partition"]), entry)

    def _marker(self, key: str) -> dict | None:
        try:
            return json.loads(self.fs.cat(key))
        except FileNotFoundError:
            return None

    def _forget(self, keys) -> None:
        keys = list(keys)
        if keys:
            try:
                self.fs.rm(keys)
            except Exception:  # noqa: BLE001, S110 - retired objects: a later publish retries
                pass

    def push_files(self, paths: list[Path]) -> None:
        """Mirror small shared files (the sources registry) to ``files/``, with one journal
        entry naming them, so other machines' syncs bring them."""
        pub = _publish_id()
        described, uploads = self._describe(
            {p: p for p in paths if Path(p).is_file()}, "files", pub
        )
        if not uploads:
            return
        entry = {"kind": "files", "publish": pub, "time": time.time(), "files": described}
        try:
            self.fs.put(list(uploads), list(uploads.values()))
            self.fs.pipe(self.key("journal", f"{pub}.json"), json.dumps(entry).encode())
        except Exception as e:  # noqa: BLE001
            raise self._fail("publishing the sources registry", e) from None

    # ----------------------------------------------------------------------------------- read

    def marker_path(self, asset: str, partition: str) -> Path:
        return self.state / "commits" / asset / f"{partition}.json"

    def sync(self) -> int:
        """Apply the journal entries this machine has not seen; returns how many.

        The new entries are folded before anything is fetched (:meth:`_fold`): only each
        partition's newest publish is applied, and each shared file's. An older publish of a
        partition is never applied: its objects were deleted when the newer one replaced it,
        and a machine that was away (or is new) would ask for them in vain. What the fold keeps
        is applied in journal order, ``SYNC_BATCH`` at a time (:meth:`_apply_many`), and the
        position (``journal.json``) is written after each batch: it covers every new entry up to
        the last one applied (an older publish whose newer one is still ahead is covered by
        that one). A sync that fails midway keeps what it applied; the next one reads the
        journal from there and skips a partition whose marker here is as new."""
        pos = _read_json(self.state / "journal.json") or {}
        last = pos.get("last", "")
        seen = set(pos.get("recent", []))
        after = ""
        if last:
            ns = max(0, int(last.split("-", 1)[0]) - SKEW_S * 10**9)
            after = self.key("journal", f"{ns:020d}")
        try:  # the new entries' names, in journal (publish) order: the listing's
            keys = self._list_after(self.key("journal") + "/", after)
            names = (k.rsplit("/", 1)[1].removesuffix(".json") for k in keys)
            new = [n for n in names if n not in seen]
        except Exception as e:  # noqa: BLE001
            raise self._fail("reading its journal", e) from None
        todo = self._fold(new)
        done = 0  # new[:done] are covered by what is applied
        for i in range(0, len(todo), SYNC_BATCH):
            batch = todo[i : i + SYNC_BATCH]
            self._apply_many(batch)
            upto, covered = batch[-1][0], done
            while done < len(new) and new[done] <= upto:
                done += 1
            last, seen = self._keep_position(last, seen, new[covered:done])
        if done < len(new):  # (the newest entry is always applied, unless it names no file)
            self._keep_position(last, seen, new[done:])
        return len(new)

    def _keep_position(self, last: str, seen: set[str], names: list[str]) -> tuple[str, set[str]]:
        """Write the position after ``names`` (journal order) are applied: the last entry seen
        and the ones seen near it (what a listing from ``SKEW_S`` before it returns again)."""
        if names:
            last = max(last, names[-1])
        horizon = int(last.split("-", 1)[0]) - 2 * SKEW_S * 10**9
        recent = {x for x in (*seen, *names) if int(x.split("-", 1)[0]) >= horizon}
        _write_json(self.state / "journal.json", {"last": last, "recent": sorted(recent)})
        return last, recent

    def _fold(self, names: list[str]) -> list[tuple[str, bytes | str, dict | None]]:
        """What the journal entries ``names`` (journal order) leave to apply, in journal order:
        ``(name, the entry's body, None)`` for each partition's newest publish, ``(name, path,
        its info)`` for each shared file's newest publish. The bodies are read ``SYNC_BATCH``
        at a time (s3fs runs the GETs concurrently); memory: one body per partition, not per
        publish."""
        parts: dict[tuple[str, str], tuple[str, bytes]] = {}
        shared: dict[str, tuple[str, dict]] = {}
        for i in range(0, len(names), SYNC_BATCH):
            batch = names[i : i + SYNC_BATCH]
            keys = [self.key("journal", f"{n}.json") for n in batch]
            try:
                bodies = self.fs.cat(keys)
            except Exception as e:  # noqa: BLE001
                raise self._fail("reading its journal", e) from None
            for name, key in zip(batch, keys, strict=True):
                entry = json.loads(bodies[key])
                if entry.get("kind") == "files":
                    shared.update({rel: (name, info) for rel, info in entry["files"].items()})
                else:  # a later name is a newer publish
                    parts[(entry["asset"], entry["partition"])] = (name, bodies[key])
            del bodies
        todo = [(n, body, None) for n, body in parts.values()]
        todo += [(n, rel, info) for rel, (n, info) in shared.items()]
        return sorted(todo, key=lambda t: t[0])

    def _list_after(self, prefix: str, after: str):
        """The keys under ``prefix`` after ``after``, in order, a page (1,000) at a time."""
        bucket, _, key_prefix = prefix.partition("/")
        token = None
        while True:
            kw = {"Bucket": bucket, "Prefix": key_prefix}
            if token:
                kw["ContinuationToken"] = token
            elif after:
                kw["StartAfter"] = after.partition("/")[2]
            r = self.fs.call_s3("list_objects_v2", **kw)
            yield from (f"{bucket}/{o['Key']}" for o in r.get("Contents", []))
            token = r.get("NextContinuationToken")
            if not token:
                return

    def _apply_many(self, todo: list[tuple[str, bytes | str, dict | None]]) -> None:
        """Apply ``todo`` (:meth:`_fold`'s): bring each partition's files (its records and
        preview, not its shard) and each shared file, then keep each partition's marker; a
        partition whose marker here is as new (this machine's own publish, or one applied
        before a failed sync) is skipped."""
        wanted: dict[Path, dict] = {}
        markers = []
        for _name, what, info in todo:
            if info is not None:
                wanted[self.root / what] = info
                continue
            entry = json.loads(what)
            mine = _read_json(self.marker_path(entry["asset"], entry["partition"]))
            if mine and mine.get("publish", "") >= entry["publish"]:
                continue
            shard = self._shard_rel(entry)
            wanted.update({self.root / r: info for r, info in entry["files"].items() if r != shard})
            markers.append(entry)
        self._fetch_many(wanted)
        for entry in markers:
            _write_json(self.marker_path(entry["asset"], entry["partition"]), entry)

    @staticmethod
    def _shard_rel(entry: dict) -> str | None:
        """The marker's shard (the asset's own file), by its folder."""
        return next((r for r in entry["files"] if r.split("/", 1)[0] == entry["asset"]), None)

    def _fetch(self, info: dict, dest: Path) -> None:
        """Download ``info``'s object to ``dest``, checked (size and sha256) before it is
        renamed into place; its stamp kept for later reads."""
        self._fetch_many({dest: info})

    def _fetch_many(self, wanted: dict[Path, dict]) -> None:
        """Download each ``dest: info`` (concurrently), check each against its marker (size and
        sha256) and rename it into place; a file that does not match is never placed."""
        if not wanted:
            return
        temps: dict[Path, Path] = {}
        try:
            for dest in wanted:
                dest.parent.mkdir(parents=True, exist_ok=True)
                temps[dest] = dest.with_name(f".tmp-{dest.name}.{uuid.uuid4().hex[:8]}")
            try:
                self.fs.get([wanted[d]["key"] for d in temps], [str(t) for t in temps.values()])
            except Exception as e:  # noqa: BLE001
                raise self._fail(f"fetching {len(temps)} files", e) from None
            for dest, tmp in temps.items():
                info = wanted[dest]
                size, digest = os.path.getsize(tmp), sha256_file(tmp)
                if (size, digest) != (info["size"], info["sha256"]):
                    raise RemoteError(
                        f"remote {self.url}: {info['key']} is {size} bytes, sha256 "
                        f"{digest[:12]}; its marker says {info['size']} bytes, "
                        f"{info['sha256'][:12]}: not used"
                    )
            for dest, tmp in temps.items():
                os.replace(tmp, dest)
                rel = dest.relative_to(self.root).as_posix()
                _write_json(
                    self.state / "cached" / f"{rel}.json", {**wanted[dest], "stamp": _stamp(dest)}
                )
        finally:
            for tmp in temps.values():
                tmp.unlink(missing_ok=True)

    def readable(self, asset: str, partition: str, path: Path) -> Path:
        """``path`` (the partition's shard of ``asset``) in this machine's cache, fetched and
        verified when the marker names a file that is not here or not as it was verified."""
        entry = _read_json(self.marker_path(asset, partition))
        if not entry:
            return path
        rel = Path(os.path.abspath(path)).relative_to(self.root).as_posix()
        info = entry["files"].get(rel)
        if info is None:
            return path
        kept = _read_json(self.state / "cached" / f"{rel}.json") or {}
        try:
            fresh = kept.get("sha256") == info["sha256"] and kept.get("stamp") == _stamp(path)
        except OSError:
            fresh = False
        if not fresh:
            self._fetch(info, path)
        return path

    # ---------------------------------------------------------------------------------- cache

    def cache_files(self) -> list[dict]:
        """The cached shards the remote holds (removable: fetched again on use), newest use
        first: ``{path, size, atime}``."""
        out = []
        for m in (self.state / "commits").glob("*/*.json"):
            entry = _read_json(m) or {}
            rel = self._shard_rel(entry) if entry else None
            p = self.root / rel if rel else None
            if p is not None and p.is_file():
                st = p.stat()
                out.append({"path": p, "size": st.st_size, "atime": st.st_atime})
        return sorted(out, key=lambda f: f["atime"], reverse=True)

    def trim(self, max_bytes: int) -> list[Path]:
        """Remove the least recently used cached shards until the rest fit ``max_bytes``."""
        files = self.cache_files()
        total = sum(f["size"] for f in files)
        gone = []
        for f in reversed(files):
            if total <= max_bytes:
                break
            f["path"].unlink(missing_ok=True)
            total -= f["size"]
            gone.append(f["path"])
        return gone


_ACTIVE: dict[tuple[str, str], Remote] = {}


def active(root: str | Path) -> Remote | None:
    """The remote of data root ``root`` (``FLOWMATCH_REMOTE``), or None when there is none."""
    url = os.environ.get(REMOTE_ENV, "").strip()
    if not url:
        return None
    key = (url, str(Path(root).expanduser().resolve()))
    if key not in _ACTIVE:
        _ACTIVE[key] = Remote(url, root)
    return _ACTIVE[key]


def readable(root: str | Path, asset: str, partition: str, path: Path) -> Path:
    """``path`` ready to read: with a remote, fetched into the cache first where needed."""
    r = active(root)
    return r.readable(asset, partition, Path(path)) if r is not None else Path(path)


def ensure(path):
    """A partition file ``<root>/<asset>/<partition>.<suffix>`` ready to read, whoever asks
    (``read_shard``, the image shard readers): with a remote, fetched into the cache first
    where a synced marker names it; a no-op without one (one environment lookup), and for
    what is not a path (an open or memory-mapped file is read as it is)."""
    if not isinstance(path, str | os.PathLike) or not os.environ.get(REMOTE_ENV, "").strip():
        return path
    path = Path(path)
    root, asset = path.parent.parent, path.parent.name
    partition = path.name.split(".", 1)[0]
    if not (root / STATE_DIR / "commits" / asset / f"{partition}.json").is_file():
        return path
    return readable(root, asset, partition, path)


def prefetch(root: str | Path, wanted, threads: int = 8) -> int:
    """Fetch the shards ``wanted`` (``(asset, partition, path)``) that this machine's cache
    lacks, ``threads`` at a time (a training start: its embeddings, ahead of the loader);
    returns how many were checked. A no-op without a remote."""
    from concurrent.futures import ThreadPoolExecutor

    store = active(root)
    if store is None:
        return 0
    todo = [(a, p, Path(f)) for a, p, f in wanted if p in published(root, a)]
    with ThreadPoolExecutor(threads, thread_name_prefix="flowmatch-prefetch") as pool:
        list(pool.map(lambda apf: store.readable(*apf), todo))
    return len(todo)


def published(root: str | Path, asset: str) -> set[str]:
    """Partitions of ``asset`` a synced marker says are published (on any machine)."""
    d = Path(root).expanduser().resolve() / STATE_DIR / "commits" / asset
    try:
        stamp = d.stat().st_mtime_ns
    except OSError:
        return set()
    got = _PUBLISHED.get(d)
    if got is None or got[0] != stamp:  # listed again only when a marker came or went
        got = (stamp, frozenset(p.name[:-5] for p in d.iterdir() if p.name.endswith(".json")))
        _PUBLISHED[d] = got
    return set(got[1])


_PUBLISHED: dict[Path, tuple[int, frozenset[str]]] = {}
