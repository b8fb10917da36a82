"""The code is laid out by the formatter CI checks, not packed by hand: `ruff format --check` and
`ruff check` pass on the whole tree, and `# fmt: skip` / `# fmt: off` are rare exceptions."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUFF = [sys.executable, "-m", "ruff"]
MAX_MARKERS = 20


def _ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*RUFF, *args], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_the_tree_is_as_the_formatter_lays_it_out():
    done = _ruff("format", "--check", ".")
    assert done.returncode == 0, f"run `ruff format .`:\n{done.stdout}{done.stderr}"


def test_the_linter_passes():
    done = _ruff("check", ".")
    assert done.returncode == 0, done.stdout + done.stderr


def test_formatter_exceptions_stay_few():
    tracked = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    markers = {}
    for name in tracked:
        text = (REPO / name).read_text()
        count = text.count("# fmt: skip") + text.count("# fmt: off")
        if count:
            markers[name] = count
    # this file names the markers in its own text
    markers.pop("tests/test_format.py", None)
    assert sum(markers.values()) <= MAX_MARKERS, markers
