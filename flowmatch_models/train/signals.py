"""Stop on a signal with a full state saved: SIGTERM (cloud preemption, Kubernetes, SLURM,
Dagster's Terminate through Pipes), SIGINT (Ctrl-C) and SIGUSR1 (SLURM's warning before its
time limit, ``--signal=B:USR1@120``); docs/training.md "Stopping and resuming".

The first signal only records the request; :class:`~flowmatch_models.train.callbacks.CheckpointPolicy`
sees it at the next optimizer-step boundary (every rank agrees: any rank's signal counts), all
ranks save a full state and the run stops with one line and exit code :data:`EXIT_STOPPED`.
A second signal exits at once with ``128 + signal`` (the shell's convention), saving nothing
more: the newest complete full state (``last.ckpt``) is what a resume starts from; in the DDP
launcher it first kills the ranks it started (none is left waiting in a collective).

Only what a process itself received counts toward a second signal. A signal sent to a whole
job (Ctrl-C in a terminal, ``kill -- -PGID``, SLURM's ``scancel``, a supervisor) reaches the
training process twice: directly, and forwarded by its parent (Dagster's Pipes client:
``flowmatch_assets/defs/training_pipes.py``). The parent writes how many signals it forwarded
into the file ``$FLOWMATCH_FORWARDED_SIGNALS`` before it forwards one; the launcher counts a
user's stops as the larger of the forwarded ones and its own direct ones, so the two copies of
one Ctrl-C are one stop. The ranks' agreement to stop (the all-reduce) never counts either.

Lightning installs its own SIGTERM handler when ``fit`` starts (``_SignalConnector``: on SIGTERM
it sets ``received_sigterm`` and raises ``SIGTERMException`` at a batch or epoch end, saving
nothing); :meth:`SignalStop.install` is called again at ``on_train_start`` and replaces it.
``python -m flowmatch_models.train`` installs the handlers before it imports anything heavy
(``__main__.py``: :data:`EARLY`), so a signal during start-up is a stop too.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

#: exit code of a run stopped by a signal (BSD's EX_TEMPFAIL: "try again later" -- resume
#: with ``--resume auto``; a scheduler requeues on it); docs/training.md
EXIT_STOPPED = 75


def is_launcher() -> bool:
    """True in the process the user (or Dagster) started: local rank 0 of node 0 (the DDP
    launcher; ``distributed.py`` reads it from here)."""
    return os.environ.get("LOCAL_RANK", "0") == "0" and os.environ.get("NODE_RANK", "0") == "0"


SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)

#: the file where a parent that forwards signals to this process counts them (one integer)
FORWARDED_ENV = "FLOWMATCH_FORWARDED_SIGNALS"
#: where the process notes each signal it handled (:meth:`SignalStop._acknowledge`), for a caller
ACK_ENV = "FLOWMATCH_STOP_ACK"

#: the :class:`SignalStop` that ``python -m flowmatch_models.train`` installed at start-up
EARLY: SignalStop | None = None


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def read_count(path: str | os.PathLike | None) -> int:
    """The integer in ``path`` (0 when unset, missing or not yet written)."""
    if not path:
        return 0
    try:
        return int(Path(path).read_text().strip() or 0)
    except (OSError, ValueError):
        return 0


class SignalStop:
    """Records the first of :data:`SIGNALS`; a second stop exits the process at once.

    :attr:`signum` is the first signal this process received (never the one the ranks agreed
    on: that is :attr:`agreed`); :meth:`stops` the number of stops a user asked for."""

    def __init__(self, forwarded: str | None = None):
        self.signum: int | None = None
        self.agreed: int | None = None  # the signal every rank stopped on (any rank's)
        self.received = 0  # deliveries of SIGNALS to this process
        self._forwarded = forwarded
        self._previous: dict[int, object] = {}
        self.on_exit: list = []  # fn(line, code) before a second signal's exit (the DDP ranks)

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        sig = self.signum or self.agreed
        return signal_name(sig) if sig else ""

    def forwarded(self) -> int:
        """Signals the parent forwarded to this process (the launcher only: the ranks it
        starts inherit the environment, not the forwarded copies)."""
        path = self._forwarded if self._forwarded is not None else os.environ.get(FORWARDED_ENV)
        return read_count(path) if is_launcher() else 0

    def stops(self) -> int:
        """How many stops were asked for: a forwarded copy and a direct copy of one job-wide
        signal are one."""
        fwd = self.forwarded()
        return max(fwd, self.received - fwd, 1 if self.received else 0)

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
        self.received += 1
        name = signal_name(signum)
        self._acknowledge(name)
        if self.signum is not None:
            if self.stops() < 2:  # the other copy of a job-wide signal already taken
                return
            line = (
                f"{name} again: exiting now without saving; the newest complete full state "
                "(checkpoints/last.ckpt) is kept"
            )
            print(line, file=sys.stderr, flush=True)
            for fn in self.on_exit:
                try:
                    fn(line, 128 + signum)
                except Exception:  # noqa: BLE001 - exiting anyway
                    pass
            os._exit(128 + signum)
        self.signum = signum
        print(
            f"{name}: saving a full state at the next step boundary, then stopping "
            f"(send it again to exit at once)",
            flush=True,
        )

    def _acknowledge(self, name: str) -> None:
        """``$FLOWMATCH_STOP_ACK`` (when set: a caller that waits for it, the tests) says
        what this process has handled: ``SIGINT received=2 forwarded=1``."""
        ack = os.environ.get(ACK_ENV)
        if ack:
            try:
                Path(ack).write_text(
                    f"{name} received={self.received} forwarded={self.forwarded()}"
                )
            except OSError:
                pass


def stopped_line(name: str, step: int, checkpoint: str | None, kept: str | None = None) -> str:
    """The one line of a run stopped by signal ``name``: where its full state is, or (none
    could be saved) which complete state is kept; and how to resume."""
    if checkpoint:
        where = f"stopped at step {step} by {name}: full state saved at {checkpoint}"
    else:
        have = f"the newest complete full state {kept} is kept" if kept else "no full state yet"
        where = f"stopped by {name} before a full state could be saved: {have}"
    return f"{where}; resume with --resume auto (flowmatch train again, or materialize the asset)"


class StoppedBySignal(Exception):
    """A run stopped on a signal (exit :data:`EXIT_STOPPED`): its full state saved at
    ``checkpoint``, or none could be (``kept``: the newest complete one, if any)."""

    def __init__(self, name: str, step: int, checkpoint: str | None, kept: str | None = None):
        self.name, self.step, self.checkpoint = name, step, checkpoint
        super().__init__(stopped_line(name, step, checkpoint, kept))
