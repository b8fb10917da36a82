"""Stop on a signal with a full state saved: SIGTERM (cloud preemption, Kubernetes, SLURM,
Dagster's Terminate through Pipes), SIGINT (Ctrl-C) and SIGUSR1 (SLURM's warning before its
time limit, ``--signal=USR1@120``).

The first signal only records the request; :class:`~flowmatch_models.train.callbacks.CheckpointPolicy`
sees it at the next optimizer-step boundary (every rank agrees: any rank's signal counts), all
ranks save a full state and the run stops with one line and exit code :data:`EXIT_STOPPED`.
A second signal exits at once with ``128 + signal`` (the shell's convention), saving nothing
more: the newest complete full state (``last.ckpt``) is what a resume starts from.

Lightning installs its own SIGTERM handler when ``fit`` starts (``_SignalConnector``: on SIGTERM
it sets ``received_sigterm`` and raises ``SIGTERMException`` at a batch or epoch end, saving
nothing); :meth:`SignalStop.install` is called again at ``on_train_start`` and replaces it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

#: exit code of a run stopped by a signal after saving its full state (BSD's EX_TEMPFAIL:
#: "try again later" -- resume with ``--resume auto``); docs/training.md
EXIT_STOPPED = 75

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class SignalStop:
    """Records the first of :data:`SIGNALS`; the second exits the process at once."""

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    def install(self) -> None:
        """Make this the handler of :data:`SIGNALS` (main thread only; a no-op elsewhere)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for s in SIGNALS:
            old = signal.signal(s, self._handle)
            self._previous.setdefault(s, old)

    def restore(self) -> None:
        """The handlers from before the first :meth:`install`."""
        if threading.current_thread() is not threading.main_thread():
            return
        for s, old in self._previous.items():
            signal.signal(s, old if old is not None else signal.SIG_DFL)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None:
            print(
                f"{name} again: exiting now without saving; the newest complete full state "
                "(checkpoints/last.ckpt) is kept",
                file=sys.stderr,
                flush=True,
            )
            os._exit(128 + signum)
        self.signum = signum
        print(
            f"{name}: saving a full state at the next step boundary, then stopping "
            f"(send it again to exit at once)",
            flush=True,
        )


class StoppedBySignal(Exception):
    """A run stopped on a signal after saving its full state (exit :data:`EXIT_STOPPED`)."""

    def __init__(self, name: str, step: int, checkpoint: str | None):
        self.name, self.step, self.checkpoint = name, step, checkpoint
        where = (
            f"full state saved at step {step}: {checkpoint}"
            if checkpoint
            else ("no full state could be saved")
        )
        super().__init__(
            f"stopped by {name}: {where}; resume with --resume auto "
            f"(flowmatch resume, or materialize flow_model again)"
        )
