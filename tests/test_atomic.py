"""Atomic writes and the deferred publish of files that belong together."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from flowmatch_models.storage.atomic import atomic_write_text, deferred, umask, written


def test_deferred_writes_are_renamed_together_in_order(tmp_path):
    a, b, c = tmp_path / "a.txt", tmp_path / "b.txt", tmp_path / "c.txt"
    a.write_text("old a")
    with deferred(lambda p: p.name in ("a.txt", "b.txt")) as tx:
        atomic_write_text(a, "new a")
        atomic_write_text(b, "new b")
        atomic_write_text(c, "c is not owned: written now")
        assert a.read_text() == "old a" and not b.exists()  # not published yet
        assert written(a).read_text() == "new a" and written(a) != a
        assert c.read_text() == "c is not owned: written now"
        assert list(tx.pending) == [a, b]
    assert a.read_text() == "new a" and b.read_text() == "new b"
    assert written(a) == a
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.txt", "c.txt"]


def test_a_failure_in_the_block_publishes_nothing(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("old a")
    with pytest.raises(RuntimeError), deferred(lambda p: True):
        atomic_write_text(a, "new a")
        atomic_write_text(b, "new b")
        raise RuntimeError("the preview could not be drawn")
    assert a.read_text() == "old a" and not b.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["a.txt"]  # no temp file left


def test_a_failed_rename_restores_what_was_renamed(tmp_path):
    a, blocked = tmp_path / "a.txt", tmp_path / "dir" / "b.txt"
    a.write_text("old a")
    blocked.parent.mkdir()
    with pytest.raises(OSError), deferred(lambda p: True) as tx:
        atomic_write_text(a, "new a")
        atomic_write_text(blocked, "new b")
        Path(blocked).mkdir()  # the rename onto a folder fails at commit
        assert len(tx.pending) == 2
    assert a.read_text() == "old a"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "dir"]
    assert [p.name for p in blocked.parent.iterdir()] == ["b.txt"]  # the folder, no temp


def test_a_before_hook_sees_every_pending_file_and_its_failure_publishes_nothing(tmp_path):
    """A transaction's ``before`` hook (a remote publish: storage/remote.py) gets every pending
    target with its written temp file, before any rename; when it raises (the remote is down),
    nothing is renamed and the temp files are gone: no local-only publish that looks complete."""
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("old a")
    seen: dict = {}

    def upload(files):
        seen.update({t: tmp.read_text() for t, tmp in files.items()})
        assert not b.exists()  # before any rename
        raise OSError("the remote is down")

    with pytest.raises(OSError, match="remote is down"):
        with deferred(lambda p: p.name in ("a.txt", "b.txt")) as tx:
            atomic_write_text(a, "new a")
            atomic_write_text(b, "new b")
            tx.before(upload)
    assert seen == {a: "new a", b: "new b"}
    assert a.read_text() == "old a" and not b.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]


def test_a_written_file_has_the_mode_a_plain_write_gives_and_the_umask_is_read_unchanged(tmp_path):
    old = os.umask(0o002)
    try:
        assert umask() == 0o002  # read from /proc/self/status: nothing set meanwhile
        atomic_write_text(tmp_path / "a.txt", "x")
        os.umask(0o077)
        atomic_write_text(tmp_path / "b.txt", "x")
    finally:
        os.umask(old)
    assert (tmp_path / "a.txt").stat().st_mode & 0o777 == 0o664
    assert (tmp_path / "b.txt").stat().st_mode & 0o777 == 0o600
