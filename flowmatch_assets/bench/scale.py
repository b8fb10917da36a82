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

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[2]
ASSETS = ("metadata", "images", "vae_latents", "dino_features", "text_embeddings")
KINDS = ASSETS[2:]
#: Outcomes of the synthetic rows: (stage, outcome, reason, share of the stage's input rows).
METADATA_OUTCOMES = [
    ("filtered", "small_original", 0.012),
    ("filtered", "aspect_ratio", 0.004),
    ("filtered", "caption_too_short", 0.002),
    ("filtered", "duplicate_hash", 0.01),
]
IMAGE_OUTCOMES = [
    ("failed", "http_404", 0.03),
    ("failed", "timeout", 0.01),
    ("failed", "decode_error", 0.004),
    ("filtered", "duplicate_content", 0.002),
]
LICENSES = ("cc0-1.0", "public-domain-mark-1.0")
SOURCES = ("wikimedia", "smithsonian", "nasa", "met", "loc")


def _env(root: Path, rows: int | None = None) -> dict[str, str]:
    """The environment of the instance at ``root`` (``rows``: its partitions' rows, recorded
    by :func:`build` in ``rows.txt``)."""
    if rows is None:
        rows = int((root / "rows.txt").read_text()) if (root / "rows.txt").exists() else 10_000
    return {
        "DAGSTER_HOME": str(root / "dagster_home"),
        "FLOWMATCH_DATA_ROOT": str(root / "data"),
        "FLOWMATCH_METADATA": str(root / "metadata"),
        "FLOWMATCH_SHARD_SIZE": str(rows),
        "HF_HUB_OFFLINE": "1",
        "DAGSTER_DISABLE_TELEMETRY": "1",
        "TQDM_DISABLE": "1",
    }


def keys_for(n: int) -> list[str]:
    """PD12M's first ``n`` partition keys (10 a metadata file)."""
    return [f"{i // 10:03d}-{i % 10:02d}" for i in range(n)]


# ------------------------------------------------------------------------------- the instance


def _metadata_file(path: Path, rows: int, rng: np.random.Generator) -> None:
    """One PD12M-format metadata file (one row group, as PD12M's files have)."""
    ids = [f"{i:08x}-5e1d-4c1f-9a7e-{i:012x}" for i in range(rows)]
    words = np.array(
        "a an the old red blue painting of portrait landscape river town map "
        "photograph drawing ship mountain flowers street bridge woman man".split()
    )
    n_words = rng.integers(4, 40, rows)
    caption = [" ".join(words[rng.integers(0, len(words), k)]) for k in n_words]
    w = rng.integers(200, 4000, rows)
    h = (w * rng.uniform(0.3, 1.6, rows)).astype(np.int64)
    hashes = [f"{a:016x}{b:016x}" for a, b in rng.integers(0, 2**63, (rows, 2))]  # md5-like
    table = pa.table(
        {
            "id": ids,
            "url": [f"https://pd12m.s3.us-west-2.amazonaws.com/images/{i}.jpeg" for i in ids],
            "caption": caption,
            "width": w,
            "height": h,
            "mime_type": ["image/jpeg"] * rows,
            "hash": hashes,
            "license": [LICENSES[i % 2] for i in range(rows)],
            "source": [SOURCES[i % len(SOURCES)] for i in range(rows)],
        }
    )
    pq.write_table(table, path, row_group_size=rows)


def _templates(root: Path) -> dict[str, Path]:
    """One tiny valid file per asset (hard-linked as every partition's)."""
    from flowmatch_models.storage.image_shard import write_image_shard
    from flowmatch_models.storage.store import write_shard

    t = root / "templates"
    t.mkdir(parents=True, exist_ok=True)
    out = {"metadata": t / "metadata.parquet", "images": t / "images.parquet"}
    pq.write_table(pa.table({"id": ["a", "b"], "url": ["u", "v"]}), out["metadata"])
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (256, 256), (90, 120, 30)).save(buf, "JPEG")
    row = {
        "id": "a",
        "caption": "c",
        "image": buf.getvalue(),
        "format": "jpeg",
        "orig_width": 512,
        "orig_height": 384,
        "md5": "0" * 32,
        "url": "u",
        "height": 256,
        "width": 256,
        "kept": 0.75,
    }
    write_image_shard(out["images"], [row])
    for kind in KINDS:
        out[kind] = t / f"{kind}.fms"
        write_shard(out[kind], {"x": np.zeros((2, 4), np.float16)}, ["a", "b"], codec="none")
    return out


class _Partition:
    """One partition's synthetic rows: ids, outcomes per stage, the card's facts."""

    def __init__(self, key: str, rows: int, rng: np.random.Generator):
        self.key = key
        f = int(key[:3]) * 10 + int(key[4:])
        self.ids = [f"{f:05d}{i:05d}-4c1f-9a7e-{i:012x}" for i in range(rows)]
        self.urls = [f"https://pd12m.s3.us-west-2.amazonaws.com/images/{i}.jpeg" for i in self.ids]
        self.meta = self._draw(rng, rows, METADATA_OUTCOMES, np.ones(rows, bool))
        self.images = self._draw(rng, rows, IMAGE_OUTCOMES, self.meta == "stored")
        self.stored = [i for i, o in enumerate(self.images) if o == "stored"]
        self.rng = rng

    @staticmethod
    def _draw(rng, rows, outcomes, eligible) -> np.ndarray:
        out = np.where(eligible, "stored", "").astype(object)
        u = rng.uniform(0, 1, rows)
        lo = 0.0
        for outcome, reason, share in outcomes:
            out[eligible & (u >= lo) & (u < lo + share)] = f"{outcome}:{reason}"
            lo += share
        return out

    def outcomes(self, stage: np.ndarray, RowOutcome) -> list:
        out = []
        for i, o in enumerate(stage):
            if not o:
                continue
            if o == "stored":
                out.append(RowOutcome(self.ids[i], self.urls[i], "stored"))
            else:
                outcome, reason = o.split(":")
                out.append(
                    RowOutcome(
                        self.ids[i], self.urls[i], outcome, reason, f"{reason} for {self.urls[i]}"
                    )
                )
        return out


def _write_partition(root: str, p: _Partition, fps: dict, tmpl: dict, layout) -> None:
    from flowmatch_assets import catalog
    from flowmatch_assets.catalog import MaterializationRecord, RowOutcome

    rng = p.rng
    n_rows = len(p.ids)
    n_kept = int((p.meta == "stored").sum())
    n_stored = len(p.stored)
    catalog.record_rows(root, "metadata", p.key, p.outcomes(p.meta, RowOutcome))
    dups = [
        {"id": p.ids[i], "hash": f"{i:032x}", "kept_partition": "000-00", "kept_id": p.ids[0]}
        for i in np.flatnonzero(p.meta == "filtered:duplicate_hash")
    ]
    catalog.record_duplicates(root, "metadata", p.key, "hash", dups)
    catalog.record_rows(root, "images", p.key, p.outcomes(p.images, RowOutcome))
    md5 = rng.integers(0, 2**63, (n_stored, 2))
    catalog.record_content(
        root,
        p.key,
        [
            {"id": p.ids[i], "position": int(p.key[4:]) * n_rows + i, "md5": f"{a:016x}{b:016x}"}
            for i, (a, b) in zip(p.stored, md5)
        ],
    )
    cdups = [
        {"id": p.ids[i], "hash": "f" * 32, "kept_partition": p.key, "kept_id": p.ids[0]}
        for i in np.flatnonzero(p.images == "filtered:duplicate_content")
    ]
    catalog.record_duplicates(root, "images", p.key, "content", cdups)
    for kind in KINDS:
        catalog.record_rows(
            root, kind, p.key, [RowOutcome(p.ids[i], None, "stored") for i in p.stored]
        )
    tokens = rng.integers(5, 160, n_rows)
    w = rng.integers(200, 4000, n_rows)
    h = (w * rng.uniform(0.3, 1.6, n_rows)).astype(np.int64)
    stored = set(p.stored)
    catalog.record_card_rows(
        root,
        p.key,
        [
            {
                "id": p.ids[i],
                "caption_chars": int(tokens[i] * 4.6),
                "caption_tokens": int(tokens[i]),
                "max_tokens": 128,
                "width": int(w[i]),
                "height": int(h[i]),
                "orig_width": int(w[i]) if i in stored else None,
                "orig_height": int(h[i]) if i in stored else None,
                "bucket": "256x256" if i in stored else None,
                "kept": float(min(w[i], h[i]) / max(w[i], h[i])) if i in stored else None,
                "license": LICENSES[i % 2],
                "source": SOURCES[i % len(SOURCES)],
            }
            for i in range(n_rows)
        ],
    )
    common = {"partition": p.key, "run_id": "synthetic"}
    extra_meta = {
        "source_file": "pd12m",
        "row_start": 0,
        "row_end": n_rows,
        "filtered": {"small_original": 1},
        "failed": {},
    }
    recs = [
        MaterializationRecord(
            "metadata",
            samples=n_kept,
            input_rows=n_rows,
            raw_bytes=n_kept * 400,
            stored_bytes=n_kept * 200,
            seconds=0.6,
            extra={**extra_meta, "fingerprint": fps["metadata"]},
            **common,
        ),
        MaterializationRecord(
            "images",
            samples=n_stored,
            input_rows=n_kept,
            raw_bytes=n_stored * 196_608,
            stored_bytes=n_stored * 15_000,
            seconds=n_kept / 180,
            codec="jpeg",
            device="cpu",
            extra={"downloaded_bytes": n_kept * 440_000, "fingerprint": fps["images"]},
            **common,
        ),
    ]
    for kind, b in zip(KINDS, (4096, 12_288, 36_000)):
        extra = {
            "model": kind,
            "random_weights": False,
            "weights": "",
            "array_bytes": b * n_stored,
            "fingerprint": fps[kind],
        }
        if kind == "text_embeddings":
            extra |= {"fp16_saturated": 0, "tokens": 30 * n_stored, "token_row_bytes": 359}
        recs.append(
            MaterializationRecord(
                kind,
                samples=n_stored,
                raw_bytes=b * 4 * n_stored,
                stored_bytes=b * n_stored,
                seconds=n_stored / 1100,
                codec="none",
                device="cuda (NVIDIA H200)",
                extra=extra,
                **common,
            )
        )
    for r in recs:
        catalog.record_materialization(root, r)
    for a in ASSETS:
        dest = layout.asset_path(a, p.key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        if not dest.exists():
            os.link(tmpl[a], dest)


def build(
    root: Path,
    n: int,
    rows: int,
    seed: int = 0,
    log=print,
    records_only: bool = False,
    checks: bool = True,
) -> dict:
    """Write the synthetic instance of ``n`` partitions under ``root`` (see the module doc);
    returns what it took (seconds per part, bytes of catalog records). ``records_only``: write
    the catalog records again (this code's writers), keep the metadata and Dagster; ``checks``:
    record the ``<asset>_fresh`` evaluations too (half of Dagster's writes)."""
    import dagster as dg

    from flowmatch_assets import compat, runs
    from flowmatch_assets.cli.devserver import make_dagster_home
    from flowmatch_assets.defs.partitions import register_partitions
    from flowmatch_assets.freshness import fingerprints
    from flowmatch_models.storage.fingerprint import Fingerprint

    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    (root / "rows.txt").write_text(str(rows))
    env = _env(root, rows)
    t0 = time.perf_counter()
    md = Path(env["FLOWMATCH_METADATA"])
    md.mkdir(parents=True, exist_ok=True)
    files = (n + 9) // 10
    one = md / "pd12m.000.parquet"
    if not records_only:
        _metadata_file(one, 10 * rows, rng)
        for f in range(1, files):
            os.link(one, md / f"pd12m.{f:03d}.parquet")
        make_dagster_home(Path(env["DAGSTER_HOME"]))
    else:
        rng.random()  # (not the same draws as the first build: only the writers matter)
        shutil.rmtree(root / "data" / "catalog", ignore_errors=True)
        (root / "data" / "catalog.duckdb").unlink(missing_ok=True)
    t_meta = time.perf_counter() - t0
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        res = runs.resource()
        inst = runs.instance()
        register_partitions(inst, res)  # every partition of the metadata files
        keys = keys_for(n)
        layout = res.layout
        tmpl = _templates(root)
        # the fingerprints the current settings give (the same for every PD12M partition)
        fps: dict = {}
        for a in ASSETS:  # lineage order: each one's inputs are its upstream's hash
            up = fingerprints.upstream_of(a)
            fields = fingerprints.expected_fields(res, a, keys[0])
            fps[a] = Fingerprint(fields, {up: fps[up]["hash"]} if up else {}).to_json()
        t1 = time.perf_counter()
        for i, k in enumerate(keys, 1):
            _write_partition(res.data_root, _Partition(k, rows, rng), fps, tmpl, layout)
            if i % 200 == 0:
                log(f"  records: {i}/{n} partitions ({time.perf_counter() - t1:.0f}s)")
        t_records = time.perf_counter() - t1
        t2 = time.perf_counter()
        evaluations = []
        if records_only:
            keys = []
        for k in keys:
            for a in ASSETS:
                inst.report_runless_asset_event(dg.AssetMaterialization(asset_key=a, partition=k))
                if not checks:
                    continue
                evaluations.append(
                    dg.AssetCheckEvaluation(
                        asset_key=dg.AssetKey(a),
                        check_name=fingerprints.fresh_check_name(a),
                        passed=True,
                        partition=k,
                        metadata={"partition": k},
                    )
                )
        if evaluations:
            with runs.quiet_console():
                compat.report_check_evaluations(
                    inst,
                    evaluations,
                    ("synthetic_fresh", "bench scale", "fresh"),
                    {},
                    runs.log_config(),
                )
        t_dagster = time.perf_counter() - t2
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    cat = root / "data" / "catalog"
    size = sum(f.stat().st_size for f in cat.rglob("*.parquet"))
    return {
        "metadata_s": round(t_meta, 1),
        "records_s": round(t_records, 1),
        "dagster_s": round(t_dagster, 1),
        "catalog_bytes": size,
        "catalog_bytes_per_partition": size // max(n, 1),
    }


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
    data = Path(_env(root)["FLOWMATCH_DATA_ROOT"])
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
    env = _env(root)
    saved = {k: os.environ.get(k) for k in env}
    out: dict[str, dict] = {}
    try:
        for name in (n for n in names if n != "metadata"):
            args, extra = todo[name]
            os.environ.update({**env, **extra})
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
            for k in extra:
                os.environ.pop(k, None)
            out[name] = {k: round(v, 3) for k, v in best.items()}
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
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
    r = run_verb(argv, _env(root), code, timeout, mem_cap_gb, core, keep_output=True)
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
        env = _env(root)
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
