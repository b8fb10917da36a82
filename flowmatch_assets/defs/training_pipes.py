"""The training process under Dagster Pipes, stopped the way it saves: a signal to the run's
process (Ctrl-C in a terminal, SIGTERM from Kubernetes, SLURM or ``timeout``, SIGUSR1, the UI's
Terminate) is forwarded to the training process, which saves a full state at its next step
boundary and exits 75 (flowmatch_models/train/signals.py); this process waits for it (up to
``FLOWMATCH_STOP_TIMEOUT_S``) instead of tearing it down, and the run ends CANCELED with the
step, the checkpoint and the one line in its tags (:func:`record_stop`).

Dagster's own Pipes client forwards only SIGINT, and a second time when the training process
had the signal already (a signal to the whole process group reaches both): the training process
took it as a second signal and exited without saving. :class:`SignalRelay` forwards the signal
it received and counts it in ``$FLOWMATCH_FORWARDED_SIGNALS`` first, so the two copies of one
job-wide signal are one stop to the training process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import dagster as dg

from flowmatch_assets.defs.pipes_messages import WholeLinesMessageReader
from flowmatch_models.storage.atomic import atomic_write_text
from flowmatch_models.train.signals import EXIT_STOPPED, FORWARDED_ENV, SIGNALS, signal_name

#: How long a stopped training run may take to save its full state before this process gives
#: up on it (and kills it): a large model's state (weights, AdamW, EMA) takes minutes to write;
#: FLOWMATCH_STOP_TIMEOUT_S sets it (Kubernetes' terminationGracePeriodSeconds must be longer).
STOP_TIMEOUT_ENV = "FLOWMATCH_STOP_TIMEOUT_S"
STOP_TIMEOUT_S = 600.0


def stop_timeout_s() -> float:
    """Seconds to wait for a stopped training process (FLOWMATCH_STOP_TIMEOUT_S, default 600)."""
    raw = os.environ.get(STOP_TIMEOUT_ENV)
    try:
        return float(raw) if raw else STOP_TIMEOUT_S
    except ValueError:
        raise ValueError(f"{STOP_TIMEOUT_ENV}={raw!r} is not a number of seconds") from None


class SignalRelay:
    """While installed (the main thread), each of :data:`SIGNALS` this process receives is
    counted into ``count_file`` and then sent on to ``process``; nothing is raised here."""

    def __init__(self, process: subprocess.Popen, count_file: Path):
        self.process, self.count_file = process, count_file
        self.count = 0
        self.first: int | None = None  # the first signal forwarded
        self.first_at: float | None = None  # its time.monotonic()
        self._previous: dict[int, object] = {}

    def install(self) -> bool:
        if threading.current_thread() is not threading.main_thread():
            return False
        for s in SIGNALS:
            self._previous[s] = signal.signal(s, self._handle)
        return True

    def restore(self) -> None:
        for s, old in self._previous.items():
            signal.signal(s, old if old is not None else signal.SIG_DFL)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        self.forward(signum)

    def forward(self, signum: int) -> None:
        self.count += 1
        if self.first is None:
            self.first, self.first_at = signum, time.monotonic()
        atomic_write_text(self.count_file, str(self.count))  # counted before it arrives
        if self.process.poll() is None:
            self.process.send_signal(signum)


class TrainingStopped(Exception):
    """The training process stopped on a signal (exit 75, or 128 + N on a second signal, or
    killed after the stop timeout)."""

    def __init__(self, returncode: int, signame: str | None, timed_out: bool):
        self.returncode, self.signame, self.timed_out = returncode, signame, timed_out
        super().__init__(f"training stopped by {signame or 'a signal'} (exit {returncode})")


class TrainingPipesClient(dg.PipesSubprocessClient):
    """Dagster's subprocess Pipes client, with the stop of :class:`SignalRelay`: a signal is
    forwarded (once per signal received), the process is waited for up to
    ``termination_timeout_seconds`` after the first one, then killed; a stopped process raises
    :class:`TrainingStopped` (the asset records it and ends the run CANCELED). Messages are
    read whole (:class:`~flowmatch_assets.defs.pipes_messages.WholeLinesMessageReader`)."""

    def __init__(self, *, message_reader: dg.PipesMessageReader | None = None, **kwargs):
        super().__init__(message_reader=message_reader or WholeLinesMessageReader(), **kwargs)

    def run(  # type: ignore[override]
        self,
        *,
        context,
        extras=None,
        command,
        env=None,
        cwd=None,
    ) -> dg.PipesClientCompletedInvocation:
        with dg.open_pipes_session(
            context=context,
            context_injector=self.context_injector,
            message_reader=self.message_reader,
            extras=extras,
        ) as session:
            count_file = Path(tempfile.gettempdir()) / (
                f"flowmatch-forwarded-{os.getpid()}-{time.monotonic_ns()}"
            )
            process = subprocess.Popen(
                command,
                cwd=cwd or self.cwd,
                env={
                    **os.environ,
                    **self.env,
                    **(env or {}),
                    **session.get_bootstrap_env_vars(),
                    FORWARDED_ENV: str(count_file),
                },
                stdout=None if self.forward_stdio else subprocess.PIPE,
                stderr=None if self.forward_stdio else subprocess.PIPE,
            )
            relay = SignalRelay(process, count_file)
            relay.install()
            try:
                rc, timed_out = self._wait(process, relay)
            finally:
                relay.restore()
                count_file.unlink(missing_ok=True)
            stopped = rc == EXIT_STOPPED or (rc != 0 and relay.count > 0)
            if stopped:
                name = signal_name(relay.first) if relay.first else None
                raise TrainingStopped(rc, name, timed_out)
            if rc != 0:
                raise dg.Failure(description=f"the training process failed with exit code {rc}")
        return dg.PipesClientCompletedInvocation(session)

    def _wait(self, process: subprocess.Popen, relay: SignalRelay) -> tuple[int, bool]:
        """The process's exit code, and whether it was killed after the stop timeout."""
        while True:
            try:
                return process.wait(timeout=0.5), False
            except subprocess.TimeoutExpired:
                pass
            except dg.DagsterExecutionInterruptedError:  # no relay installed (not the main
                relay.forward(signal.SIGINT)  # thread): Dagster's interrupt is the signal
            since = relay.first_at
            if since is not None and time.monotonic() - since > self.termination_timeout_seconds:
                process.kill()
                return process.wait(), True


# --------------------------------------------------------------------------------------------
# what a stopped run records
# --------------------------------------------------------------------------------------------

#: Run tags of a stopped training run: the step and file of its full state, and its one line
STOPPED_STEP_TAG, STOPPED_CHECKPOINT_TAG = "flowmatch/stopped_at_step", "flowmatch/checkpoint"
STOPPED_LINE_TAG = "flowmatch/stopped"


def saved_state(run: Path, since: float) -> tuple[int, Path] | None:
    """``(step, file)`` of the full state ``checkpoints/last.ckpt`` points to, when it was
    written at or after ``since`` (a time.time()); None when this session saved none."""
    ck = run / "checkpoints"
    last = ck / "last.ckpt"
    if not last.exists() or last.stat().st_mtime < since:
        return None
    for f in sorted(ck.glob("step*.ckpt"), reverse=True):
        if f.stem[4:].isdigit() and os.path.samefile(f, last):
            return int(f.stem[4:]), f
    return None


def stop_line(stopped: TrainingStopped, error_file: Path, run: Path, since: float) -> str:
    """The one line of a stopped run: the training process's own (``$FLOWMATCH_ERROR_FILE``),
    else one made here from what it left (a second signal, a kill after the stop timeout)."""
    if error_file.is_file() and error_file.read_text().strip():
        line = error_file.read_text().strip()
        if "again: exiting now" not in line:
            return line
    from flowmatch_models.train.signals import stopped_line

    saved = saved_state(run, since)
    last = run / "checkpoints" / "last.ckpt"
    why = stopped.signame or "a signal"
    if stopped.timed_out:
        why += f" (killed after {STOP_TIMEOUT_ENV}={stop_timeout_s():g} s)"
    elif stopped.returncode > 128:
        why += " twice (exited at once)"
    if saved is not None:
        return stopped_line(why, saved[0], str(saved[1]))
    return stopped_line(why, 0, None, str(last) if last.is_file() else None)


def record_stop(context: dg.AssetExecutionContext, run: Path, since: float, line: str) -> None:
    """A training run stopped by a signal: the step and the file of the full state it saved
    (if any) and its one line, as run tags, an observation of the asset and a log line; the
    run is marked canceling, so that Dagster ends it CANCELED (as the UI's Terminate does)."""
    tags = {STOPPED_LINE_TAG: line}
    saved = saved_state(run, since)
    if saved is not None:
        step, path = saved
        tags.update({STOPPED_STEP_TAG: str(step), STOPPED_CHECKPOINT_TAG: str(path)})
        context.log_event(
            dg.AssetObservation(
                asset_key=context.asset_key,
                metadata={
                    "stopped_at_step": dg.MetadataValue.int(step),
                    "checkpoint": dg.MetadataValue.path(str(path)),
                    "resume": "materialize this asset again (resume: auto), or `flowmatch train`",
                },
            )
        )
    context.instance.add_run_tags(context.run_id, tags)
    context.log.warning(line)
    run_now = context.instance.get_run_by_id(context.run_id)
    if run_now is not None and run_now.status == dg.DagsterRunStatus.STARTED:
        context.instance.report_run_canceling(run_now, message=line)
