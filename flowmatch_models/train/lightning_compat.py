"""Every private Lightning API flowmatch uses, in one place (as flowmatch_assets/compat.py is
for Dagster's), and the one torch optimizer internal beside them.

Each function here names the internal it reaches and why no public API does the job;
tests/test_lightning_compat.py checks each one against the installed Lightning (and the lowest
one allowed, through tests/test_lightning_floor.py) and fails with a message naming the internal
when a Lightning release moves it. Nothing else in flowmatch_models touches ``trainer._*``,
Lightning's checkpoint ``loops`` keys, ``_ChildProcessObserver`` or ``found_inf``.
"""

from __future__ import annotations

from typing import Any

import torch

# ------------------------------------------------------------------------------- checkpoints


def dump_checkpoint(trainer) -> dict:
    """The full training state as ``trainer.save_checkpoint`` would write it, as a dict (the
    background writer writes it; ``save_checkpoint`` would write it on the loop's thread).
    Internal: ``trainer._checkpoint_connector.dump_checkpoint``."""
    return trainer._checkpoint_connector.dump_checkpoint(weights_only=False)


def loaded_checkpoint(trainer) -> dict | None:
    """The checkpoint a resuming ``fit`` loaded and has not restored its loops from yet (the
    data module's ``load_state_dict`` edits it: :func:`close_epoch`), or None.
    Internal: ``trainer._checkpoint_connector._loaded_checkpoint``."""
    connector = getattr(trainer, "_checkpoint_connector", None)
    return getattr(connector, "_loaded_checkpoint", None) or None


#: The fit loop's progress entries in a checkpoint's ``loops`` that count inside an epoch.
FIT_LOOP = "fit_loop"
BATCH_PROGRESS = "epoch_loop.batch_progress"
IN_EPOCH_PROGRESS = (
    "epoch_loop.scheduler_progress",
    "epoch_loop.manual_optimization.optim_step_progress",
)
OPTIM_PROGRESS = "epoch_loop.automatic_optimization.optim_progress"
EPOCH_PROGRESS = "epoch_progress"


def close_epoch(checkpoint: dict | None) -> None:
    """Rewrite a checkpoint's Lightning loop state (before Lightning restores it) as if its
    epoch had ended: the in-epoch batch, scheduler and optimizer counters at 0 and the epoch
    counted complete. For a state saved inside Lightning's epoch whose data position moves to
    the next epoch on resume (the step that ended the data's epoch; a changed order): Lightning
    ends accumulation groups by its in-epoch batch counter, which would otherwise go on from
    mid-epoch into the data's new epoch (a group of 2 of 4 micro-batches, the rest shifted).
    Internal: the key layout of ``checkpoint["loops"]["fit_loop"]`` (Lightning's progress
    trackers' ``state_dict``)."""
    fit = ((checkpoint or {}).get("loops") or {}).get(FIT_LOOP)
    if not fit or BATCH_PROGRESS not in fit:
        return
    bp = fit[BATCH_PROGRESS]
    bp["current"] = {k: 0 for k in bp["current"]}
    bp["total"]["completed"] = bp["total"]["processed"]  # the last batch's end is behind it
    bp["is_last_batch"] = False
    for key in IN_EPOCH_PROGRESS:
        if key in fit:
            fit[key]["current"] = {k: 0 for k in fit[key]["current"]}
    opt = fit.get(OPTIM_PROGRESS, {}).get("optimizer", {})
    for part in opt.values():
        part["current"] = {k: 0 for k in part["current"]}
    ep = fit.get(EPOCH_PROGRESS)
    if ep:
        for c in (ep["total"], ep["current"]):
            c["ready"] = c["started"] = c["processed"] = c["completed"] = c["completed"] + 1


# ----------------------------------------------------------------------------------- signals


def forget_sigterm(trainer) -> None:
    """Clear the SIGTERM Lightning's own handler recorded before ours was installed (the stop
    is then handled once, by ours). ``trainer.received_sigterm`` is read-only.
    Internal: ``trainer._signal_connector.received_sigterm``."""
    trainer._signal_connector.received_sigterm = False


# ------------------------------------------------------------------- the DDP launcher's observer


def child_process_observer() -> Any:
    """Lightning's observer of the ranks a script launcher started (the class to subclass), or
    None on a Lightning without one. Internal:
    ``lightning.fabric.strategies.launchers.subprocess_script._ChildProcessObserver``: its
    ``__init__(main_pid, child_processes, ...)``, ``_child_processes``, ``_run()`` (True: stop
    watching) and ``_terminate_all()``, which train/distributed.py's subclass overrides."""
    try:
        from lightning.fabric.strategies.launchers import subprocess_script as sub
    except ImportError:  # pragma: no cover - Lightning without the launcher
        return None
    return getattr(sub, "_ChildProcessObserver", None)


def install_child_process_observer(cls: type) -> None:
    """Make the script launcher start ``cls`` (a subclass of :func:`child_process_observer`)."""
    from lightning.fabric.strategies.launchers import subprocess_script as sub

    sub._ChildProcessObserver = cls


# -------------------------------------------------------------------------------- optimizers


def attached_trainer(module) -> Any:
    """The trainer a LightningModule is attached to, or None (``module.trainer`` raises when
    there is none). Internal: ``LightningModule._trainer``."""
    return module._trainer


def plain_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside a ``LightningOptimizer`` (public: its ``optimizer``), or the
    optimizer itself."""
    from lightning.pytorch.core.optimizer import LightningOptimizer

    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def skip_step_if(optimizer: torch.optim.Optimizer, bad: torch.Tensor) -> None:
    """Make a fused Adam/AdamW's next ``step`` skip (parameters and moments untouched) where
    ``bad`` (a 0-dim bool tensor on the device) is true, with no host sync. Internal (torch's,
    not Lightning's): the ``found_inf`` attribute the fused step reads, as ``GradScaler`` sets
    it."""
    optimizer.found_inf = bad.float()
