"""Full training states written without stopping the training loop for the write.

A save takes a host copy of the state (every tensor copied into a reusable host buffer: pinned
memory for CUDA tensors, plain memory for CPU ones, which training keeps changing in place),
then ``torch.save`` runs on a background thread into a temporary file renamed into place when
complete (``storage/atomic.py``): a state half-written when the process dies is never the one
resumed. One write at a time: the next save first waits for the previous one. The training
loop stalls for the copy only (``flowmatch bench checkpoint``; BENCHMARKS.md "Checkpoint").
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from flowmatch_models.storage.atomic import atomic_path


class StateWriter:
    """Writes one state at a time on a background thread, from reusable host buffers.

    ``save(state, path, after)`` copies ``state`` to the host (the stall), starts the write and
    returns; ``after(path)`` runs on the writer thread once ``path`` is in place (the
    ``last.ckpt`` link, pruning). :meth:`wait` joins the write in flight and returns its error
    (``None`` when it succeeded); a save waits for the previous write first. With
    ``background=False`` the write happens in ``save`` (the synchronous writer before this
    one, kept for ``flowmatch bench checkpoint``)."""

    def __init__(self, background: bool = True):
        self.background = background
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.failed_path: Path | None = None  # the file the newest failed write was for
        self.last_stall_s = 0.0  # the training loop's wait in the newest save
        self.last_write_s = 0.0  # the newest write (background or not), copy excluded

    def host_copy(self, obj, key: tuple = ()):
        """``obj`` (nested dicts/lists/tuples of tensors and plain values) with every tensor
        copied into this writer's host buffer for its place in the nest (allocated at the
        first save, reused after: no fresh pages per save)."""
        if isinstance(obj, torch.Tensor):
            t = obj.detach()
            buf = self._buffers.get(key)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
                self._buffers[key] = buf
            buf.copy_(t, non_blocking=t.is_cuda)
            return buf
        if isinstance(obj, dict):
            return {k: self.host_copy(v, (*key, k)) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            out = [self.host_copy(v, (*key, i)) for i, v in enumerate(obj)]
            return out if isinstance(obj, list) else tuple(out)
        return obj

    def save(self, state: dict, path: Path, after: Callable[[Path], None] | None = None) -> None:
        t0 = time.perf_counter()
        error = self.wait()  # one write at a time; the buffers are free again
        if error is not None:
            raise error
        if not self.background:  # its error, as a background one's, comes from wait()
            self._run(state, Path(path), after)
            self.last_stall_s = time.perf_counter() - t0
            return
        copy = self.host_copy(state)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # the non-blocking device-to-host copies are complete
        self._thread = threading.Thread(
            target=self._run,
            args=(copy, Path(path), after),
            name="flowmatch-state-writer",
            daemon=True,
        )
        self._thread.start()
        self.last_stall_s = time.perf_counter() - t0

    def _run(self, state: dict, path: Path, after) -> None:
        try:
            self._write(state, path, after)
        except BaseException as e:  # handed to the training thread by wait()
            self._error, self.failed_path = e, path

    def _write(self, state: dict, path: Path, after) -> None:
        t0 = time.perf_counter()
        with atomic_path(path) as tmp:
            torch.save(state, tmp)
        self.last_write_s = time.perf_counter() - t0
        if after is not None:
            after(path)

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> BaseException | None:
        """Join the write in flight (if any); its error, or None."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        return error

    def release(self) -> None:
        """Join, and free the host buffers (the end of a session)."""
        self.wait()
        self._buffers.clear()
