"""`flowmatch bench scale`: every interactive verb at PD12M's size (issue 28).

Builds a synthetic instance of ``--partitions`` N partitions in a temporary folder, as the
assets would leave it, without downloading or encoding anything:

- PD12M-format metadata files of ``10 x --rows`` rows (one row group, as PD12M's; one file
  written and hard-linked under every file number: discovery and the hash index read them all);
- every partition's catalog records written by the catalog's own writers
  (``record_rows``, ``record_materialization``, ``record_content``, ``record_duplicates``,
  ``record_card_rows``) with ``--rows`` input rows, realistic outcomes (filtered, failed,
  duplicates), the fingerprints the current settings give, and its files (tiny valid shards,
  hard-linked: ``verify`` and ``--missing`` read their headers and checksums);
- a Dagster instance (the repo's ``dagster.yaml``, sqlite) with the partitions registered, one
  materialization per partition and asset (reported runless: what ``partition_states`` reads)
  and the ``<asset>_fresh`` checks evaluated (as the runs that made them would have).

Then each verb runs as its own process (``python -m flowmatch_assets.cli ...``, pinned to one
core), timed: wall and CPU seconds and peak RSS (``wait4``); a process over ``--mem-cap-gb``
or ``--timeout`` s is killed and reported so. ``--code DIR`` runs the verbs of another checkout
on the same instance (the old code's numbers beside the new ones); ``--keep DIR`` builds into
(or reuses) DIR instead of a temporary folder. Ends with one JSON line; BENCHMARKS.md "Scale".
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from flowmatch_assets.bench.scale_instance import REPO, build, environ, instance_env, keys_for

# ---------------------------------------------------------------------------------- the verbs

#: name -> (argv of `flowmatch`, extra env); a name starting with ``py:`` runs that code.
VIEWS_CODE = (
    "import os, time, json; from flowmatch_assets.catalog import Catalog, view_names; "
    "c = Catalog(os.environ['FLOWMATCH_DATA_ROOT']); t = {}\n"
    "for v in view_names():\n"
    "    t0 = time.perf_counter(); c.query(f'SELECT count(*) FROM {v}'); "
    "t[v] = round(time.perf_counter() - t0, 2)\n"
    "print(json.dumps(t))"
)


def verbs(root: Path) -> dict[str, tuple[list[str], dict]]:
    settings = root / "max_tokens_64.yaml"
    settings.write_text("encoders:\n  max_tokens: 64\n")
    changed = {"FLOWMATCH_SETTINGS": str(settings)}
    return {
        "catalog_build": (["catalog", "path"], {}),
        "catalog_views": (["py:" + VIEWS_CODE], {}),
        "catalog_coverage": (["catalog", "coverage", "--json"], {}),
        "catalog_summary": (["catalog", "summary"], {}),
        "catalog_failures": (["catalog", "failures"], {}),
        "catalog_compression": (["catalog", "compression"], {}),
        "catalog_throughput": (["catalog", "throughput"], {}),
        "data_card": (["data-card", "--no-refresh"], {}),
        "budget": (["budget"], {}),
        "materialize_missing": (["materialize", "--missing"], {}),
        "materialize_stale": (["materialize", "--stale"], {}),
        "stale": (["stale"], {}),
        "stale_changed": (["stale"], changed),
        "stale_restore": (["stale"], {}),  # reports the checks fresh again
        "stale_no_report": (["stale", "--no-report"], {}),
        "verify": (["verify"], {}),
        "partitions_list": (["partitions", "list"], {}),
        "sources_list": (["sources", "list"], {}),
    }


def _rss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _first_build(root: Path) -> None:
    """No catalog yet: the next catalog query builds ``catalog.duckdb`` and every summary."""
    data = Path(instance_env(root)["FLOWMATCH_DATA_ROOT"])
    (data / "catalog.duckdb").unlink(missing_ok=True)
    shutil.rmtree(data / "catalog" / "summary", ignore_errors=True)


def run_verb(
    argv: list[str],
    env: dict,
    code: Path,
    timeout: float,
    mem_cap_gb: float,
    core: int | None,
    keep_output: bool = False,
) -> dict:
    """Run one verb in its own process; wall and CPU seconds, peak RSS, exit code."""
    if argv[0].startswith("py:"):
        cmd = [sys.executable, "-c", argv[0][3:]]
    else:
        cmd = [sys.executable, "-m", "flowmatch_assets.cli", *argv]
    full_env = {**os.environ, **env, "PYTHONPATH": str(code)}

    def pin() -> None:
        import resource

        if core is not None:
            os.sched_setaffinity(0, {core})
        # a hard stop too (the RSS watch below samples): address space, 2x the cap
        limit = int(2 * mem_cap_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    out = tempfile.TemporaryFile()
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, env=full_env, cwd=str(code), stdout=out, stderr=subprocess.STDOUT, preexec_fn=pin
    )
    killed: list[str] = []

    def watch() -> None:
        cap = mem_cap_gb * 1e6
        while proc.returncode is None:
            if _rss_kb(proc.pid) > cap:
                killed.append(f"killed at {mem_cap_gb:g} GB")
                proc.kill()
                return
            if time.perf_counter() - t0 > timeout:
                killed.append(f"killed after {timeout:g} s")
                proc.kill()
                return
            time.sleep(0.05)

    w = threading.Thread(target=watch, daemon=True)
    w.start()
    _, status, ru = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    out.seek(0)
    text = out.read().decode(errors="replace")
    tail = text[-2000:]
    r = {
        "wall_s": round(wall, 2),
        "cpu_s": round(ru.ru_utime + ru.ru_stime, 2),
        "rss_mb": round(ru.ru_maxrss / 1024),
        "rc": proc.returncode,
    }
    if killed:
        r["killed"] = killed[0]
    if keep_output:
        r["output"] = text
    if argv[0].startswith("py:") and proc.returncode == 0:
        r["detail"] = json.loads(tail.strip().splitlines()[-1])
    elif proc.returncode not in (0, 1):
        r["tail"] = tail[-600:]
    return r


def time_in_process(root: Path, names: Sequence[str], repeat: int = 2) -> dict[str, dict]:
    """Each verb run ``repeat`` times in this process (``flowmatch_assets.cli.main``, output
    discarded); its CPU and wall seconds, the least of the runs (warm: imports and first-time
    caches are not counted, so what is left grows with the partitions or not at all)."""
    import contextlib
    import io

    from flowmatch_assets import cli

    todo = verbs(root)
    env = instance_env(root)
    out: dict[str, dict] = {}
    for name in (n for n in names if n != "metadata"):
        args, extra = todo[name]
        with environ({**env, **extra}):
            best = {"cpu_s": float("inf"), "wall_s": float("inf")}
            for _ in range(repeat):
                if name == "catalog_build":
                    _first_build(root)
                c0, w0 = time.process_time(), time.perf_counter()
                with (
                    contextlib.redirect_stdout(io.StringIO()),
                    contextlib.redirect_stderr(io.StringIO()),
                ):
                    if args[0].startswith("py:"):
                        exec(args[0][3:], {})  # noqa: S102 - our own code (VIEWS_CODE)
                        rc = 0
                    else:
                        rc = cli.main(list(args))
                best = {
                    "cpu_s": min(best["cpu_s"], time.process_time() - c0),
                    "wall_s": min(best["wall_s"], time.perf_counter() - w0),
                    "rc": rc,
                }
        out[name] = {k: round(v, 3) for k, v in best.items()}
    return out


def time_metadata(
    root: Path, code: Path, parts: int, timeout: float, mem_cap_gb: float, core: int | None
) -> dict:
    """``metadata`` for the first ``parts`` partitions of file 000, in one process, from
    no hash index: the first partition builds it over every metadata file; the others' wall
    seconds (each a whole Dagster run) are the per-partition cost."""
    import re
    import statistics

    shutil.rmtree(root / "data" / "dedupe", ignore_errors=True)
    argv = ["materialize", "-a", "metadata"]
    for k in keys_for(parts):
        argv += ["-p", k]
    r = run_verb(argv, instance_env(root), code, timeout, mem_cap_gb, core, keep_output=True)
    text = r.pop("output")
    secs = [float(x) for x in re.findall(r"metadata ok \(([0-9.]+)s\)", text)]
    r["partition_s"] = secs
    if len(secs) > 1:
        r["first_s"] = secs[0]
        r["per_partition_s"] = round(statistics.median(secs[1:]), 2)
    return r


def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="flowmatch bench scale", description=__doc__.split("\n\n")[0])
    p.add_argument("--partitions", type=int, default=100)
    p.add_argument("--rows", type=int, default=10_000, help="input rows a partition")
    p.add_argument("--keep", default=None, help="build into / reuse this folder")
    p.add_argument("--code", default=str(REPO), help="the checkout whose verbs are timed")
    p.add_argument("--verbs", default=None, help="comma-separated subset (default: every one)")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--mem-cap-gb", type=float, default=6.0)
    p.add_argument("--core", type=int, default=0, help="pin each verb to this core (-1: none)")
    p.add_argument(
        "--metadata-parts",
        type=int,
        default=5,
        help="partitions of metadata materialized for real (0: none)",
    )
    a = p.parse_args(argv)
    core = None if a.core < 0 else a.core
    tmp = None
    if a.keep:
        root = Path(a.keep).resolve()
    else:
        tmp = tempfile.mkdtemp(prefix="flowmatch-scale-")
        root = Path(tmp)
    try:
        out: dict = {
            "bench": "scale",
            "partitions": a.partitions,
            "rows": a.rows,
            "code": str(Path(a.code).resolve()),
        }
        if not (root / "built.json").exists():
            print(f"building {a.partitions} partitions of {a.rows} rows in {root} ...")
            built = build(root, a.partitions, a.rows, log=print)
            (root / "built.json").write_text(json.dumps(built))
        out["build"] = json.loads((root / "built.json").read_text())
        env = instance_env(root)
        todo = verbs(root)
        names = a.verbs.split(",") if a.verbs else [*todo, "metadata"]
        unknown = [n for n in names if n not in todo and n != "metadata"]
        if unknown:
            p.error(f"unknown verbs {unknown}; choose from {', '.join([*todo, 'metadata'])}")
        code = Path(a.code).resolve()
        for name in (n for n in names if n != "metadata"):
            args, extra = todo[name]
            if name == "catalog_build":
                _first_build(root)
            r = run_verb(args, {**env, **extra}, code, a.timeout, a.mem_cap_gb, core)
            r["per_partition_ms"] = round(r["cpu_s"] / a.partitions * 1000, 2)
            out[name] = r
            print(f"{name}: {json.dumps(r)}", flush=True)
        if a.metadata_parts and "metadata" in names:
            r = time_metadata(root, code, a.metadata_parts, a.timeout, a.mem_cap_gb, core)
            out["metadata"] = r
            print(f"metadata x{a.metadata_parts}: {json.dumps(r)}", flush=True)
        print(json.dumps(out))
        return out
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
