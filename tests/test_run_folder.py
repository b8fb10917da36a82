"""The run-folder rule (``<data root>/runs/<name>``, or ``run.out_dir``) is written once,
in ``DataLayout.run_dir`` (flowmatch_models/storage/layout.py): the training config, the
assets, the CLI and the benchmarks ask there. A second copy of the rule (a ``/ "runs" /``
join, an ``os.path.join(root, "runs", ...)``, an ``f"{root}/runs/..."``) fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from flowmatch_models.storage.layout import DataLayout, run_folder
from flowmatch_models.train.config import TrainConfig

REPO = Path(__file__).resolve().parents[1]
HOME = "flowmatch_models/storage/layout.py"
PLANTED = re.compile(r"""["']runs["']\s*[,)/]|/\s*["']runs["']|["'{}]/?runs/\{""")


def copies(text: str) -> list[str]:
    return [m.group(0) for m in PLANTED.finditer(text)]


@pytest.mark.parametrize(
    "line",
    [
        'return Path(flowmatch.data_root) / "runs" / name',
        'run = root / "runs" / "demo"',
        'os.path.join(root, "runs", name)',
        'Path(root, "runs")',
        'f"{root}/runs/{name}"',
    ],
)
def test_a_planted_run_folder_rule_is_caught(line: str) -> None:
    assert copies(line), line


def test_the_rule_is_written_once() -> None:
    found = {}
    for folder in ("flowmatch_models", "flowmatch_assets", "scripts", "examples"):
        for f in sorted((REPO / folder).rglob("*.py")):
            rel = f.relative_to(REPO).as_posix()
            if hits := copies(f.read_text()):
                found[rel] = hits
    assert found == {HOME: ['/ "runs"']}, (
        f"the run-folder rule written outside DataLayout.run_dir ({HOME}): ask it there: {found}"
    )
    # a Dagster UI address is not a run folder
    assert not copies('print(f"  {url}/runs/b/{bid}")')


def test_every_way_to_a_run_folder_agrees(tmp_path: Path) -> None:
    root = tmp_path / "data"
    assert DataLayout(root).run_dir("r1") == root.resolve() / "runs" / "r1"
    cfg = TrainConfig.model_validate({"data": {"root": str(root)}, "run": {"name": "r1"}})
    assert cfg.run_dir() == root.resolve() / "runs" / "r1"
    out = tmp_path / "elsewhere"
    moved = TrainConfig.model_validate(
        {"data": {"root": str(root)}, "run": {"name": "r1", "out_dir": str(out)}}
    )
    assert moved.run_dir() == out.resolve()  # run.out_dir wins
    assert run_folder("r1", root) == root.resolve() / "runs" / "r1"  # a name
    (out / "checkpoints").mkdir(parents=True)
    assert run_folder(str(out), root) == out.resolve()  # a folder holding checkpoints
    assert run_folder("missing-folder", root) == root.resolve() / "runs" / "missing-folder"
