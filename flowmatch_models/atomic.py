"""Atomic file writes: write to a temp file beside the target, fsync, rename.

A killed process leaves at most a ``.tmp-*`` file that readers never look at; the target is
either the old complete file or the new complete file.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


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
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the file the usual mode
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        with open(tmp_path, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp_path, target)
    finally:
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

    Call it only where one writer owns ``target`` (a partition's materialization)."""
    target = Path(target)
    n = 0
    for p in target.parent.glob(f".tmp-{target.name}.*"):
        p.unlink(missing_ok=True)
        n += 1
    return n
