"""DDP coordination: the launcher process decides, the ranks it starts read its decision.

Lightning's DDP launcher re-runs the same command line in one process per extra local rank
(``LOCAL_RANK`` set). Whatever must be identical on every rank (the partition list, the step
budget, the run folder, the log segment) is decided once by the launcher, written into the run
folder as the request (``request.json``) and found by the ranks through ``FLOWMATCH_REQUEST``.
"""

from __future__ import annotations

import os
from pathlib import Path

from flowmatch_models.train import lightning_compat
from flowmatch_models.train.signals import is_launcher  # noqa: F401 - its home is signals.py

REQUEST_ENV = "FLOWMATCH_REQUEST"


def published_request() -> Path | None:
    """The launcher's decided request, in a rank the launcher started; None in the launcher."""
    if is_launcher():
        return None
    path = os.environ.get(REQUEST_ENV)
    return Path(path) if path else None


def publish_request(path: Path) -> None:
    """Point the ranks this process will start at the decided request ``path``."""
    os.environ[REQUEST_ENV] = str(path)


def device_description(trainer) -> str:
    """What trained, measured from the trainer: ``cuda (NVIDIA H200) x 2, bf16-mixed``."""
    import torch

    dev = trainer.strategy.root_device
    name = dev.type
    if dev.type == "cuda":
        name = f"cuda ({torch.cuda.get_device_name(dev)})"
    world = int(trainer.world_size)
    return f"{name}{f' x {world}' if world > 1 else ''}, {trainer.precision}"


# --------------------------------------------------------------------------------------------
# a rank's one-line error reaches the launcher
# --------------------------------------------------------------------------------------------

#: the folder where a rank other than the launcher leaves its one-line error before it exits
RANK_ERRORS_ENV = "FLOWMATCH_RANK_ERRORS"


def publish_rank_errors(folder: Path) -> None:
    """In the launcher, before the ranks start: where they leave their one-line errors, and
    watch them (:func:`watch_ranks`)."""
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("rank*.json"):  # a previous session's
        old.unlink(missing_ok=True)
    os.environ[RANK_ERRORS_ENV] = str(folder)
    watch_ranks()


def record_rank_error(line: str, code: int, agreed: bool = False) -> None:
    """In a rank the launcher started: leave the one line and exit code for the launcher;
    ``agreed``: every rank stops with it (rank 0's write error, broadcast), so the launcher
    says it itself and its observer leaves it to."""
    folder = os.environ.get(RANK_ERRORS_ENV)
    if is_launcher() or not folder:
        return
    import json

    from flowmatch_models.storage.atomic import atomic_write_text

    rank = os.environ.get("RANK", os.environ.get("LOCAL_RANK", "?"))
    atomic_write_text(
        Path(folder) / f"rank{rank}.json",
        json.dumps({"line": line, "code": code, "agreed": agreed}),
    )


def rank_error(folder: Path) -> tuple[str, int] | None:
    """The first recorded rank error (lowest rank) in ``folder``: (line, exit code)."""
    import json

    for path in sorted(folder.glob("rank*.json")):
        try:
            got = json.loads(path.read_text())
            return str(got["line"]), int(got["code"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None


def _agreed(folder: str | None) -> bool:
    """Whether a rank left an error every rank stops with (:func:`record_rank_error`)."""
    import json

    for path in sorted(Path(folder).glob("rank*.json")) if folder else []:
        try:
            if json.loads(path.read_text()).get("agreed"):
                return True
        except (OSError, ValueError, AttributeError):
            continue
    return False


#: the rank processes this launcher started (Lightning's ``Popen`` objects), once started
_STARTED: list = []


def rank_failure(wait_s: float = 10.0) -> tuple[str, int] | None:
    """In the launcher, after its training raised: the one line and exit code a rank it
    started left (:func:`record_rank_error`), waiting up to ``wait_s`` for the ranks to exit;
    None when it started none or none left a line (the launcher's own failure). A rank's
    failure reaches the launcher as a broken collective (gloo: "Connection closed by peer")
    sooner than as a line."""
    import time

    folder = os.environ.get(RANK_ERRORS_ENV)
    if not _STARTED or not folder or not is_launcher():
        return None
    deadline = time.monotonic() + wait_s
    while any(p.poll() is None for p in _STARTED) and time.monotonic() < deadline:
        if rank_error(Path(folder)) is not None:
            break
        time.sleep(0.05)
    return rank_error(Path(folder))


def end_ranks_on_exit(stop) -> None:
    """A second signal (``stop``: a :class:`~flowmatch_models.train.signals.SignalStop`)
    exits this process at once: in the launcher, first SIGKILL the ranks it started (none is
    left waiting in a collective: NCCL would wait its 30-minute timeout); in a rank, first
    leave the line for the launcher (:func:`record_rank_error`), whose observer then ends
    every process with it."""

    def end(line: str, code: int) -> None:
        import signal

        if is_launcher():
            for p in _STARTED:
                if p.poll() is None:
                    p.send_signal(signal.SIGKILL)
        else:
            record_rank_error(line, code)

    stop.on_exit.append(end)


def watch_ranks() -> None:
    """Make Lightning's child-process observer report a rank's own error.

    When a rank the launcher started exits non-zero, Lightning's ``_ChildProcessObserver``
    SIGKILLs every process, the launcher included: the run ended with exit -9 and the rank's
    line lost among its traceback. Here the observer first reads the line the rank left
    (:func:`record_rank_error`), then kills the other ranks and exits the launcher with that
    line on stderr (and in ``$FLOWMATCH_ERROR_FILE``) and the rank's exit code. A rank that
    stopped on a signal (exit :data:`~flowmatch_models.train.signals.EXIT_STOPPED`) is not a
    failure: the ranks agreed to stop at the same step and the launcher stops by itself."""
    base = lightning_compat.child_process_observer()
    if base is None or getattr(base, "_flowmatch", False):
        return

    class RankObserver(base):  # type: ignore[misc, valid-type]
        _flowmatch = True

        def __init__(self, main_pid: int, child_processes: list, *a, **k) -> None:
            super().__init__(main_pid, child_processes, *a, **k)
            _STARTED[:] = child_processes

        def _run(self) -> bool:
            from flowmatch_models.train.signals import EXIT_STOPPED

            for proc in self._child_processes:
                proc.poll()
            codes = [p.returncode for p in self._child_processes]
            if all(c is not None and c in (0, EXIT_STOPPED) for c in codes):
                return True  # done, or stopped at the agreed step (the launcher stops too)
            if any(c not in (None, 0, EXIT_STOPPED) for c in codes):
                if _agreed(os.environ.get(RANK_ERRORS_ENV)):
                    return True  # every rank stops with it: the launcher says it, exits
                self._terminate_all()
                return True
            return False

        def _terminate_all(self) -> None:
            import signal
            import sys

            folder = os.environ.get(RANK_ERRORS_ENV)
            got = rank_error(Path(folder)) if folder else None
            for p in self._child_processes:
                if p.poll() is None:
                    p.send_signal(signal.SIGKILL)
            if got is None:  # a crash without a line (killed, segfault): Lightning's way
                super()._terminate_all()
                return
            line, code = got
            print(line, file=sys.stderr, flush=True)
            if os.environ.get("FLOWMATCH_ERROR_FILE"):
                from flowmatch_models.storage.atomic import atomic_write_text

                atomic_write_text(os.environ["FLOWMATCH_ERROR_FILE"], line)
            os._exit(code)

    lightning_compat.install_child_process_observer(RankObserver)
