"""A session that starts from an older state than the newest files of its run folder (a
resume after a kill -9, whose EMA snapshots ran ahead of its last full state; ``--resume
PATH`` to an earlier step; a restart with ``--resume none``) abandons the steps after it.
Their files are moved to ``checkpoints/abandoned-after-stepS-<UTC time>/`` before the session
trains, so that nothing later takes them for this run's (retention keeps the newest
``keep_full``/``keep_ema`` by step number; a fine-tune's default parent is the newest step;
the evaluation labels ``last.ckpt``), and ``last.ckpt`` names the state resumed from."""

from __future__ import annotations

import os
import time
from pathlib import Path

from flowmatch_models.train.callbacks import CKPT_NAME, _link_atomic


def retire_abandoned(ckpt_dir: Path, start_step: int, resume: str | None) -> Path | None:
    """Move the checkpoints of steps after ``start_step`` (and ``last.ckpt`` when it names one
    of them) into an ``abandoned-after-step...`` folder; re-link ``last.ckpt`` to ``resume``
    when that file is in ``ckpt_dir``. Returns the folder (None when nothing was abandoned)."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return None
    later = [
        p
        for p in ckpt_dir.glob("step*.ckpt")
        if (m := CKPT_NAME.fullmatch(p.name)) and int(m.group(1)) > start_step
    ]
    if not later:
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dest = ckpt_dir / f"abandoned-after-step{start_step:07d}-{stamp}"
    dest.mkdir(exist_ok=True)
    last = ckpt_dir / "last.ckpt"
    last_abandoned = last.is_file() and any(os.path.samefile(last, p) for p in later)
    for p in later:
        os.replace(p, dest / p.name)
    src = Path(resume) if resume and resume != "none" else None
    if src is not None and src.parent.resolve() == ckpt_dir.resolve() and src.name != last.name:
        _link_atomic(src, last)
    elif last_abandoned:
        os.replace(last, dest / last.name)
    counts = ckpt_dir / "trained_counts.json"  # the abandoned newest save's counts
    if counts.is_file():
        os.replace(counts, dest / counts.name)
    return dest
