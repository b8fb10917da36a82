"""Checkpoints say the step they hold, and an abandoned branch is retired (issue 50): after a
kill -9 the EMA snapshots (and ``trained_counts.json``) have run ahead of the newest full
state; the evaluation labels ``last.ckpt`` with the step it holds, and the resume moves the
dead session's later files apart, so a fine-tune's default parent is the resumed branch's."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from test_faults import Run
from test_train import make_store, tiny_config

from flowmatch_assets.reports.evaluation import _last_step
from flowmatch_models.train.finetune import checkpoint_for


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return make_store(tmp_path_factory.mktemp("bookkeeping_store"))


def test_a_resume_after_a_kill_labels_and_retires_the_abandoned_steps(store, tmp_path) -> None:
    over = dict(
        trainer__max_steps=100_000,
        trainer__log_every=1,
        trainer__full_every=4,
        trainer__checkpoint_every=1,
        trainer__keep_full=5,
        trainer__keep_ema=0,
    )
    cut = tmp_path / "cut"
    ck = cut / "checkpoints"
    run = Run(tmp_path, tiny_config(store, cut, **over), "cut")
    run.wait_step(6)
    while not (ck / "step0000006-ema.ckpt").exists():  # (a few ms after the progress line)
        time.sleep(0.001)
    os.killpg(run.proc.pid, signal.SIGKILL)
    assert run.finish() == -signal.SIGKILL
    held = torch.load(ck / "last.ckpt", weights_only=True, mmap=True)["global_step"]
    ahead = json.loads((ck / "trained_counts.json").read_text())["step"]
    assert held % 4 == 0 and ahead > held  # what the old label said: ahead
    assert _last_step(ck) == held  # the step last.ckpt holds
    newest = max(int(p.name[4:11]) for p in ck.glob("step*.ckpt"))
    assert newest > held + 1  # the dead session's EMA snapshots
    total = held + 1
    resumed = Run(tmp_path, tiny_config(store, cut, **over), "resume", "--max-steps", str(total))
    assert resumed.finish() == 0, resumed.err
    note = f"note: the checkpoints after step {held} (abandoned) moved to "
    assert note in "".join(resumed.lines)
    (gone,) = ck.glob(f"abandoned-after-step{held:07d}-*")
    assert f"step{newest:07d}-ema.ckpt" in {p.name for p in gone.iterdir()}
    assert sorted(p.name for p in ck.glob("step*.ckpt"))[-1] == f"step{total:07d}.ckpt"
    assert _last_step(ck) == total
    path, step = checkpoint_for(cut, None, "ema")  # a fine-tune's default parent
    assert step == total and path.parent == ck
