"""Memory and CPU of a process tree (a process and its descendants), read from ``/proc``: the
loader bench samples its loader's PSS/RSS/USS every 20 ms and sums CPU seconds over the tree."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np

# --------------------------------------------------------------------------------------------
# memory and CPU of a process tree
# --------------------------------------------------------------------------------------------


def _tree(pid: int) -> list[int]:
    """``pid`` and its live descendants (DataLoader workers)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            kids = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            kids = []
        todo += [int(k) for k in kids]
    return out


def _rollup(pid: int) -> dict[str, int] | None:
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return None
    kb = {}
    for line in text.splitlines()[1:]:
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[-1] == "kB":
            kb[key] = int(parts[0]) * 1024
    return {
        "rss": kb.get("Rss", 0),
        "pss": kb.get("Pss", 0),
        "uss": kb.get("Private_Clean", 0) + kb.get("Private_Dirty", 0),
    }


def _cpu_seconds(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class TreeMonitor:
    """Samples the memory (summed over the process tree of ``pid``) and its CPU time every
    ``interval`` s in a thread of *this* process (so the sampling is not counted): ``peak``,
    ``cpu()`` (seconds, the last seen of each process, so exited workers still count) and
    ``timeline`` of ``(time.time(), cpu seconds)``."""

    def __init__(self, pid: int, interval: float = 0.05):
        self.interval, self.pid = interval, pid
        self.peak = {"rss": 0, "pss": 0, "uss": 0}
        self.peak_processes = 0
        self.timeline: list[tuple[float, float]] = []
        self._cpu: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        total = {"rss": 0, "pss": 0, "uss": 0}
        pids = _tree(self.pid)
        for p in pids:
            r = _rollup(p)
            if r:
                for k in total:
                    total[k] += r[k]
            c = _cpu_seconds(p)
            if c is not None:
                self._cpu[p] = c
        for k in total:
            self.peak[k] = max(self.peak[k], total[k])
        self.peak_processes = max(self.peak_processes, len(pids))
        self.timeline.append((time.time(), sum(self._cpu.values())))

    def cpu_at(self, t: float) -> float:
        """CPU seconds of the tree at wall time ``t`` (linear between samples)."""
        ts, cs = zip(*self.timeline)
        return float(np.interp(t, ts, cs))

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval)

    def cpu(self) -> float:
        self._sample()
        return sum(self._cpu.values())

    def __enter__(self) -> TreeMonitor:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
