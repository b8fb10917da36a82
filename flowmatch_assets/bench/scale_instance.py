"""The synthetic PD12M-sized instance that `flowmatch bench scale` times its verbs on: PD12M-format
metadata files, every partition's catalog records (written by the catalog's own writers, with
realistic outcomes and the fingerprints the current settings give) and tiny valid shard files,
hard-linked, and a Dagster instance with the partitions registered and one materialization per
partition and asset. :func:`build` makes it; :func:`instance_env` is its environment."""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Iterator
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


@contextlib.contextmanager
def environ(values: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``values`` set, each variable as it was afterwards (the in-process
    verbs and the build read the instance's settings from the environment)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def instance_env(root: Path, rows: int | None = None) -> dict[str, str]:
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
    env = instance_env(root, rows)
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
    with environ(env):
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
    cat = root / "data" / "catalog"
    size = sum(f.stat().st_size for f in cat.rglob("*.parquet"))
    return {
        "metadata_s": round(t_meta, 1),
        "records_s": round(t_records, 1),
        "dagster_s": round(t_dagster, 1),
        "catalog_bytes": size,
        "catalog_bytes_per_partition": size // max(n, 1),
    }
