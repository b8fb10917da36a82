"""Benchmark: what fingerprints cost per partition, against the stage they belong to.

Per partition of ``--samples`` rows, with the pipeline's own functions on synthetic files of
the real sizes (an images shard of ~15 KB JPEG-sized blobs, the three embedding shards with
their real shapes): the fingerprint work a materialization adds (``fingerprints.current`` /
``kind_fingerprint``, the catalog read of the upstream's fingerprint, the content id of the
data version) and the ``<asset>_fresh`` checks that run with it -- their bodies, and the one
Dagster step that evaluates them (an in-process run of the checks minus an empty run). Compared with the
stage's own time per partition: the image stage at ``--images-per-core-s`` (ARCHITECTURE.md's
measured 180 images/s per core; its cost is core-seconds) and the precalc at
``--precalc-pairs-s`` (1,100 pairs/s, the H200 target: the fastest stage, so the worst ratio).

Weight hashing runs once per model folder state and data root (remembered in
``<root>/catalog/weights_sha256.json``): measured as sha256 MB/s over ``--hash-mb`` and given
for the real weights' sizes (DC-AE f32c32 fp32, DINOv2-small fp32, Gemma3-270M bf16).

Run: ``flowmatch bench fingerprint`` (CPU, ~1 min). Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

#: Weight bytes of the real encoders (safetensors): DC-AE f32c32-sana-1.0 fp32 (~312M
#: parameters), DINOv2-small fp32 (22M), Gemma3-270M bf16 (268M).
REAL_WEIGHTS_MB = {"vae": 1250, "dino": 88, "text": 536}


def _timed(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _data_root(root: Path, n: int, rng: np.random.Generator) -> dict:
    """Synthetic shards of one partition ``000-00`` at real sizes, with catalog records."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from flowmatch_models.storage.store import write_shard

    ids = [f"{i:08d}" for i in range(n)]
    md = pa.table(
        {
            "id": ids,
            "url": [f"https://x/{i}.jpg" for i in ids],
            "hash": ids,
            "caption": ["a large red circle on a sandy background"] * n,
        }
    )
    (root / "metadata").mkdir(parents=True)
    pq.write_table(md, root / "metadata" / "000-00.parquet")
    blob = rng.integers(0, 255, 15_000, dtype=np.uint8).tobytes()
    images = md.append_column("image", pa.array([blob[i % 97 :] for i in range(n)], pa.binary()))
    images = images.append_column("md5", pa.array(ids))
    (root / "images").mkdir()
    pq.write_table(images, root / "images" / "000-00.parquet", row_group_size=512)
    tokens = 30
    arrays = {
        "vae_latents": {"latents": rng.standard_normal((n, 32, 8, 8)).astype(np.float16)},
        "dino_features": {
            "patch": rng.standard_normal((n, 64, 384)).astype(np.float16),
            "cls": rng.standard_normal((n, 384)).astype(np.float16),
        },
        "text_embeddings": {
            "tokens": rng.standard_normal((n * tokens, 640)).astype(np.float16),
            "lengths": np.full(n, tokens, np.int32),
            "null_tokens": np.zeros((1, 640), np.float16),
        },
    }
    for kind, a in arrays.items():
        write_shard(root / kind / "000-00.fms", a, ids, codec="none", attrs={})
    return {"bytes": {k: (root / k / "000-00.fms").stat().st_size for k in arrays}}


def run(samples: int, hash_mb: int, repeat: int, images_per_core_s: float, pairs_s: float) -> dict:
    import dagster as dg

    from flowmatch_assets import catalog
    from flowmatch_assets.catalog import MaterializationRecord
    from flowmatch_assets.defs.checks import build_fresh_checks
    from flowmatch_assets.defs.definitions import resources_for
    from flowmatch_assets.defs.partitions import shard_partitions
    from flowmatch_assets.defs.resources import FlowmatchResource
    from flowmatch_assets.freshness import fingerprints
    from flowmatch_models.encoders.spec import EncoderSpec
    from flowmatch_models.storage import fingerprint as fpmod

    rng = np.random.default_rng(0)
    out: dict = {"bench": "fingerprint", "samples": samples}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        # weights: sha256 rate on a real folder, then a second process (disk cache, no memo)
        model = tmp / "model"
        model.mkdir()
        (model / "model.safetensors").write_bytes(rng.bytes(hash_mb << 20))
        cache = tmp / "weights_sha256.json"
        t0 = time.perf_counter()
        fpmod.folder_sha256(model, cache)
        cold = time.perf_counter() - t0
        fpmod._memo.clear()
        warm = _timed(lambda: (fpmod._memo.clear(), fpmod.folder_sha256(model, cache)), repeat)
        rate = hash_mb / cold
        out["weights"] = {
            "sha256_mb_per_s": round(rate, 1),
            "first_hash_s_real_sizes": {
                k: round(mb / rate, 2) for k, mb in REAL_WEIGHTS_MB.items()
            },
            "later_process_s": round(warm, 5),
        }
        # one partition's files and records; the encoders are three model folders
        root = tmp / "data"
        out["shard_bytes"] = _data_root(root, samples, rng)["bytes"]
        folders = {}
        for role in ("vae", "dino", "text"):
            folders[role] = tmp / role
            folders[role].mkdir()
            (folders[role] / "config.json").write_text("{}")
            (folders[role] / "model.safetensors").write_bytes(rng.bytes(1 << 20))
        res = FlowmatchResource(
            data_root=str(root),
            metadata_source=str(tmp),
            encoders=EncoderSpec(**{k: str(v) for k, v in folders.items()}),
        )
        data, kinds = ["metadata", "images"], list(fingerprints.KINDS)
        for a in [*data, *kinds]:  # warm: the weights are hashed once per process anyway
            fp = fingerprints.current(res, a, "000-00")
            catalog.record_materialization(
                root,
                MaterializationRecord(a, "000-00", samples, extra={"fingerprint": fp.to_json()}),
            )
        path = res.layout.asset_path

        def publish_work(a: str) -> None:
            fp = fingerprints.current(res, a, "000-00")
            fingerprints.data_version(fp, path(a, "000-00"))
            fingerprints.metadata(fp)

        per = {a: _timed(lambda a=a: publish_work(a), repeat) for a in [*data, *kinds]}
        body = {
            a: _timed(lambda a=a: fingerprints.staleness(res, ["000-00"], [a]), repeat)
            for a in [*data, *kinds]
        }
        # the five checks as Dagster runs them (one in-process run), minus an empty run
        checks = [build_fresh_checks(shard_partitions)]
        with dg.instance_for_test() as instance:
            instance.add_dynamic_partitions(shard_partitions.name, ["000-00"])
            defs = dg.Definitions(
                assets=[dg.AssetSpec(a, partitions_def=shard_partitions) for a in [*data, *kinds]],
                asset_checks=checks,
                jobs=[dg.define_asset_job("fresh", dg.AssetSelection.all_asset_checks())],
                resources=resources_for(res),
            )

            @dg.op
            def nothing() -> None:
                pass

            @dg.job
            def empty() -> None:
                nothing()

            job = defs.resolve_job_def("fresh")
            tags = {"dagster/partition": "000-00"}
            run_s = _timed(lambda: job.execute_in_process(instance=instance, tags=tags), repeat)
            empty_s = _timed(lambda: empty.execute_in_process(instance=instance), repeat)
        step = max(0.0, run_s - empty_s - sum(body.values()))  # one step, every check
        images_stage = samples / images_per_core_s
        precalc_stage = samples / pairs_s
        # the fingerprint work itself, then with Dagster recording the checks' evaluations
        # (per evaluation: ``step`` is for all five, a run records those of its assets)
        per_eval = step / len(body)
        data_fp = sum(per[a] + body[a] for a in data)
        kind_fp = sum(per[a] + body[a] for a in kinds)
        data_all, kind_all = data_fp + per_eval * len(data), kind_fp + per_eval * len(kinds)
        out.update(
            {
                "publish_s": {a: round(v, 5) for a, v in per.items()},
                "fresh_check_body_s": {a: round(v, 5) for a, v in body.items()},
                "check_recording_s_per_evaluation": round(per_eval, 4),
                "images_stage_core_s": round(images_stage, 2),
                "precalc_stage_s": round(precalc_stage, 2),
                "images_stage_fingerprint_s": round(data_fp, 4),
                "images_stage_fingerprint_pct": round(100 * data_fp / images_stage, 3),
                "images_stage_with_checks_pct": round(100 * data_all / images_stage, 3),
                "precalc_fingerprint_s": round(kind_fp, 4),
                "precalc_fingerprint_pct": round(100 * kind_fp / precalc_stage, 3),
                "precalc_with_checks_pct": round(100 * kind_all / precalc_stage, 3),
            }
        )
    return out


def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="flowmatch bench fingerprint", description=__doc__)
    p.add_argument("--samples", type=int, default=10_000, help="rows of the partition")
    p.add_argument("--hash-mb", type=int, default=256, help="bytes hashed to measure sha256")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--images-per-core-s", type=float, default=180.0)
    p.add_argument("--precalc-pairs-s", type=float, default=1100.0)
    a = p.parse_args(argv)
    r = run(a.samples, a.hash_mb, a.repeat, a.images_per_core_s, a.precalc_pairs_s)
    print(
        f"images stage: fingerprints +{r['images_stage_fingerprint_s'] * 1e3:.0f} ms on "
        f"{r['images_stage_core_s']:.0f} core-s per partition "
        f"({r['images_stage_fingerprint_pct']:.2f}%; with the checks recorded "
        f"{r['images_stage_with_checks_pct']:.2f}%)\n"
        f"precalc:      fingerprints +{r['precalc_fingerprint_s'] * 1e3:.0f} ms on "
        f"{r['precalc_stage_s']:.1f} s per partition ({r['precalc_fingerprint_pct']:.2f}%; "
        f"with the checks recorded {r['precalc_with_checks_pct']:.2f}%)\n"
        f"Dagster records one check evaluation in {r['check_recording_s_per_evaluation']:.3f} s\n"
        f"weights: sha256 {r['weights']['sha256_mb_per_s']:.0f} MB/s, first hash of the real "
        f"weights {r['weights']['first_hash_s_real_sizes']} s (once per data root), later "
        f"processes {r['weights']['later_process_s'] * 1e3:.1f} ms",
        file=sys.stderr,
    )
    print(json.dumps(r))
    return r


if __name__ == "__main__":
    main()
