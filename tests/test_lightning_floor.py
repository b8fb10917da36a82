"""The lower bound of `lightning>=2.5` in pyproject.toml is tested, not assumed (issue 50): the
exact mid-epoch resume with gradient accumulation (tests/test_train.py) runs again under the
lowest Lightning allowed, which scripts/install.sh puts beside the venv's in
`.venv/lightning-floor` (Lightning 2.4.0 shifted the accumulation groups of such a resume)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FLOOR = REPO / ".venv" / "lightning-floor"


def _lowest_allowed() -> str:
    text = (REPO / "pyproject.toml").read_text()
    return re.search(r'"lightning>=([0-9.]+)', text).group(1)


@pytest.mark.slow
@pytest.mark.skipif(not (FLOOR / "lightning").is_dir(), reason="bash scripts/install.sh puts it")
def test_a_mid_epoch_resume_is_exact_on_the_lowest_lightning_allowed():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(FLOOR), str(REPO)])}
    version = subprocess.run(
        [sys.executable, "-c", "import lightning; print(lightning.__version__)"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert version.startswith(_lowest_allowed()), (version, _lowest_allowed())
    test = "tests/test_train.py::test_resume_is_exact_and_edited_yaml_wins[0]"
    p = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert p.returncode == 0, p.stdout[-4000:]
    assert "1 passed" in p.stdout


@pytest.mark.skipif(not (FLOOR / "lightning").is_dir(), reason="bash scripts/install.sh puts it")
def test_every_fenced_internal_holds_on_the_lowest_lightning_allowed():
    """tests/test_lightning_compat.py (each private Lightning API of
    flowmatch_models/train/lightning_compat.py) under the lowest Lightning allowed (~6 s)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(FLOOR), str(REPO)])}
    p = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        + ["tests/test_lightning_compat.py"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout[-4000:]
    assert re.search(r"\b8 passed", p.stdout), p.stdout[-2000:]
