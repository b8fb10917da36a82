"""Atomic file writes: write to a temp file beside the target, fsync, rename.

A killed process leaves at most a ``.tmp-*`` file that readers never look at; the target is
either the old complete file or the new complete file.

Several files that belong together (a partition's shard, its catalog records, its preview) are
published together with :func:`deferred`: inside it, :func:`atomic_path` writes the temp files
of the targets the transaction owns but renames none of them; at the end of the block they are
renamed in the order they were written, or, if the block raised (a full disk, a bug), removed,
so the old files all stay. The window in which a kill can leave some renamed and some not is
the renames alone (microseconds); the last file renamed is the one readers take as the commit.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path


class Transaction:
    """Targets whose renames wait for one commit (see the module doc). ``owns(path)`` says which
    targets it defers; every other write is immediate."""

    def __init__(self, owns: Callable[[Path], bool]):
        self._owns = owns
        self.pending: dict[Path, Path] = {}  # target -> its written temp file, in write order
        self.open = True
        self._after: list[Callable[[], object]] = []
        self._before: list[Callable[[dict[Path, Path]], object]] = []

    def owns(self, target: Path) -> bool:
        return self.open and self._owns(target)

    def add(self, target: Path, tmp: Path) -> None:
        old = self.pending.pop(target, None)
        if old is not None and old != tmp:
            old.unlink(missing_ok=True)
        self.pending[target] = tmp

    def before(self, fn: Callable[[dict[Path, Path]], object]) -> None:
        """Run ``fn(pending)`` (target -> its written temp file) before anything is renamed;
        if it raises, nothing is renamed (e.g. publish the files to a remote first: the local
        rename then follows a complete remote publish, never precedes it)."""
        self._before.append(fn)

    def after(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` once everything is renamed (e.g. remove a file the commit supersedes)."""
        self._after.append(fn)

    def path(self, target: str | os.PathLike) -> Path:
        """Where ``target``'s content is now: its pending temp file, or the target itself."""
        return self.pending.get(Path(target), Path(target))

    def commit(self) -> None:
        """Rename every pending temp file onto its target, in write order. If a rename fails,
        the targets renamed so far get their previous files back (kept as hard links until all
        renames succeeded) and the error is raised."""
        self.open = False
        done: list[tuple[Path, Path | None]] = []
        try:
            before, self._before = self._before, []
            for fn in before:
                fn(dict(self.pending))
            for target, tmp in self.pending.items():
                backup = None
                if target.exists():
                    backup = target.with_name(f".tmp-{target.name}.backup")
                    backup.unlink(missing_ok=True)
                    try:
                        os.link(target, backup)
                    except OSError:
                        backup = None
                os.replace(tmp, target)
                done.append((target, backup))
        except BaseException:
            for target, backup in reversed(done):
                if backup is not None:
                    os.replace(backup, target)
                else:
                    target.unlink(missing_ok=True)
            self.discard()
            raise
        for _, backup in done:
            if backup is not None:
                backup.unlink(missing_ok=True)
        self.pending.clear()
        after, self._after = self._after, []
        for fn in after:
            fn()

    def discard(self) -> None:
        """Remove every pending temp file (nothing is renamed) and defer nothing more."""
        self.open = False
        for tmp in self.pending.values():
            tmp.unlink(missing_ok=True)
        self.pending.clear()
        self._after.clear()
        self._before.clear()


_ACTIVE: contextvars.ContextVar[Transaction | None] = contextvars.ContextVar(
    "flowmatch_atomic_transaction", default=None
)


@contextlib.contextmanager
def deferred(owns: Callable[[Path], bool]) -> Iterator[Transaction]:
    """A :class:`Transaction` for the block: the writes of targets ``owns`` accepts are
    renamed when the block ends without an error, and removed when it raises."""
    tx = Transaction(owns)
    token = _ACTIVE.set(tx)
    try:
        yield tx
    except BaseException:
        tx.discard()
        raise
    else:
        tx.commit()
    finally:
        _ACTIVE.reset(token)


def written(target: str | os.PathLike) -> Path:
    """The file that holds ``target``'s newest content: inside a :func:`deferred` block that
    wrote it, the pending temp file; otherwise the target."""
    tx = _ACTIVE.get()
    return tx.path(target) if tx is not None else Path(target)


def umask() -> int:
    """This process's umask: from /proc/self/status where Linux says it (nothing changes), else
    set and put back (a moment in which another thread's new file would get mode 0666)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0)
    os.umask(mask)
    return mask


def usual_mode(path: str | os.PathLike, directory: bool = False) -> None:
    """Give a file or folder that tempfile made (0600 / 0700: its owner's alone) the mode a
    plain ``open`` or ``mkdir`` would, so that a group sharing the data root (``umask 002``)
    can read it as every other file of the root."""
    os.chmod(path, (0o777 if directory else 0o666) & ~umask())


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path beside ``target``; on success rename it onto ``target``.

    The temporary name starts with ``.tmp-`` and ends in ``suffix`` (default ``.tmp``), so globs
    such as ``*.parquet`` (DuckDB views, shard listings) never see a half-written file; pass a
    suffix only where a writer infers the format from the extension (e.g. ``.png``).
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(
        prefix=f".tmp-{target.name}.", suffix=suffix or ".tmp", dir=target.parent
    )
    usual_mode(tmp)  # mkstemp makes 0600
    os.close(fd)
    tmp_path = Path(tmp)
    tx = _ACTIVE.get()
    tx = tx if tx is not None and tx.owns(target) else None
    try:
        yield tmp_path
        with open(tmp_path, "rb+") as f:
            os.fsync(f.fileno())
        if tx is not None:  # renamed when the transaction commits
            tx.add(target, tmp_path)
            return
        os.replace(tmp_path, target)
    finally:
        if tx is None or target not in tx.pending or tx.pending[target] != tmp_path:
            if tmp_path.exists():
                tmp_path.unlink()


def atomic_write_bytes(target: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``target`` atomically."""
    with atomic_path(target) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(target: str | os.PathLike, text: str) -> None:
    """Write ``text`` (utf-8) to ``target`` atomically."""
    atomic_write_bytes(target, text.encode("utf-8"))


def remove_stale_temps(target: str | os.PathLike) -> int:
    """Delete temp files that a killed writer of ``target`` left behind; returns how many.

    Call it only where one writer owns ``target`` (a partition's materialization, under its
    lock)."""
    target = Path(target)
    n = 0
    for p in target.parent.glob(f".tmp-{target.name}.*"):
        p.unlink(missing_ok=True)
        n += 1
    return n


def write_parquet(table, path: str | os.PathLike, **kw) -> None:
    """``pq.write_table(table, path, **kw)`` through a file this process opens and always
    closes: when a write fails (a full disk), pyarrow's own handle stays open as long as the
    exception is referenced, holding the deleted temp file's space and its filesystem busy."""
    import pyarrow.parquet as pq

    with open(path, "wb") as f:
        pq.write_table(table, f, **kw)
