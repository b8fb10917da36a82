"""`flowmatch bench precompute`: how busy a backfill of the embedding assets keeps the GPU.

A SIMULATION of the GPU, everything else real. It writes N images shards of R real JPEGs each
(a data root as the ``images`` asset leaves it), saves the three full-size encoder
architectures with random weights (DC-AE f32c32, DINOv2-small, Gemma3-270M: the configs of
:mod:`flowmatch_assets.bench.precalc`) as local folders, starts ``dagster dev`` on a fresh
sqlite instance and launches a backfill of ``vae_latents``, ``dino_features`` and
``text_embeddings`` over the N partitions through GraphQL, as the UI and ``flowmatch backfill``
do. The run workers load the encoders through ``from_pretrained``, read and decode the JPEGs,
tokenize the captions, fit and write the shards, publish the catalog records and Dagster's
events for real; only the encoders' forward passes are replaced by a stand-in that sleeps the
time the target GPU would take (``FLOWMATCH_SIMULATE_GPU_PAIRS_PER_S``: its share of a pair's
time per encoder, by FLOPs) and returns arrays of the real shapes.

Both paths in one run, for each simulated rate (default 100 pairs/s, one RTX 3090, and
1,100 pairs/s, the H200 target):

- ``old``: one run per partition (``FLOWMATCH_EMBED_PARTITIONS_PER_RUN=1``), as every backfill
  ran before: a run worker's start and imports, the encoders' loads, the partition, its writes;
- ``new``: runs of many partitions (the default ``BackfillPolicy.multi_run``): the encoders load
  once per run, the next image batch decodes while one is encoded, partition i is written
  while i+1 is encoded.

It reports, per path and rate: the backfill's wall time (first run start to last run end), the
simulated GPU seconds (pairs / rate), the GPU-busy fraction (their ratio) and the fixed seconds
per partition (wall minus GPU time, over N). Targets (issue 35): new path >= 97% busy at
1,100 pairs/s and >= 99.5% at 100 pairs/s. Ends with one JSON line ``{"bench": "precompute"}``.

    flowmatch bench precompute --partitions 4 --rows 2000 [--rates 100,1100] [--quick]

``--quick`` shrinks Gemma's vocabulary (embedding rows only; the load is then cheaper than the
real one). With a CUDA GPU, ``--real`` runs the real forward passes (no stand-in, no rate).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import dagster as dg
import numpy as np

from flowmatch_assets.cli.devserver import dagster_dev, make_dagster_home
from flowmatch_assets.defs.partitions import SHARDS
from flowmatch_assets.freshness import backfill
from flowmatch_models.storage.atomic import atomic_write_text

KINDS = ["vae_latents", "dino_features", "text_embeddings"]
TARGETS = {100.0: 0.995, 1100.0: 0.97}


def write_images(root: Path, partitions: int, rows: int, seed: int = 0) -> list[str]:
    """``partitions`` images shards of ``rows`` 256 px JPEGs each (drawn shapes, real captions
    of the demo's grammar), as the ``images`` asset writes them; returns the partition keys."""
    from PIL import Image

    from flowmatch_assets.demo.dataset import draw_image
    from flowmatch_models.storage.image_shard import write_image_shard
    from flowmatch_models.storage.layout import DataLayout

    rng = np.random.default_rng(seed)
    pool = []  # 64 distinct images, reused (decoding cost is per image, not per distinct one)
    for _ in range(64):
        im, caption = draw_image(rng)
        im = im.convert("RGB").resize((256, 256), Image.BILINEAR)
        buf = io.BytesIO()
        im.save(buf, "JPEG", quality=95)
        pool.append((buf.getvalue(), caption))
    layout, keys = DataLayout(root), []
    for p in range(partitions):
        key = f"{p // 10:03d}-{p % 10:02d}"
        shard = []
        for i in range(rows):
            data, caption = pool[(p * rows + i) % len(pool)]
            shard.append(
                {
                    "id": f"{key}-{i:06d}",
                    "caption": f"{caption} ({i})",
                    "image": data,
                    "format": "jpeg",
                    "orig_width": 1024,
                    "orig_height": 1024,
                    "md5": "",
                    "url": "",
                    "height": 256,
                    "width": 256,
                    "kept": 1.0,
                }
            )
        write_image_shard(layout.asset_path("images", key), shard)
        keys.append(key)
    return keys


def save_encoders(dest: Path, quick: bool) -> dict[str, str]:
    """The full-size random encoders saved as local folders (bf16, zoo-marked as random)."""
    import torch

    from flowmatch_assets.bench.precalc import build_models
    from flowmatch_models.encoders.zoo import _mark, build_tokenizer

    vae, dino, text = build_models(quick)
    out = {}
    for name, model in (("vae", vae), ("dino", dino), ("text", text)):
        folder = dest / name
        model.to(torch.bfloat16).save_pretrained(folder)
        _mark(folder, f"full-size {type(model).__name__} (random)", {})
        out[name] = str(folder)
    build_tokenizer().save_pretrained(dest / "text")
    return out


def _runs(instance: dg.DagsterInstance, backfill_id: str) -> list:
    return instance.get_run_records(dg.RunsFilter(tags={"dagster/backfill": backfill_id}))


def _timeline(instance: dg.DagsterInstance, record) -> dict:
    """When a run's partitions were encoded (its ``[i/n] <key> encoded`` lines), from its start."""
    start, end = record.start_time, record.end_time
    times = [
        e.timestamp
        for e in instance.all_logs(record.dagster_run.run_id)
        if e.user_message and "] " in e.user_message and e.user_message.endswith("partitions/min)")
    ]
    times.sort()
    return {
        "first_encoded_s": (times[0] - start) if times else None,
        "between_s": [b - a for a, b in zip(times, times[1:])],
        "tail_s": (end - times[-1]) if times else end - start,
    }


def one_backfill(
    tmp: Path,
    keys: list[str],
    encoders: dict,
    rows: int,
    rate: float | None,
    per_run: int,
    label: str,
    settings: Path | None = None,
) -> dict:
    """One path at one simulated rate: a fresh data root copy's embeddings backfilled."""
    import shutil

    data = tmp / f"data-{label}"
    shutil.copytree(tmp / "images-root", data)
    home = make_dagster_home(tmp / f"home-{label}")
    (tmp / "empty").mkdir(exist_ok=True)
    with dg.DagsterInstance.from_config(str(home)) as instance:
        instance.add_dynamic_partitions(SHARDS, keys)
    env = {
        "FLOWMATCH_DATA_ROOT": str(data),
        "FLOWMATCH_METADATA": str(tmp / "empty"),
        "FLOWMATCH_VAE": encoders["vae"],
        "FLOWMATCH_DINO": encoders["dino"],
        "FLOWMATCH_TEXT": encoders["text"],
        "FLOWMATCH_EMBED_PARTITIONS_PER_RUN": str(per_run),
        **({"FLOWMATCH_SETTINGS": str(settings)} if settings else {}),
        **({"FLOWMATCH_SIMULATE_GPU_PAIRS_PER_S": str(rate)} if rate else {}),
    }
    with dagster_dev(home, env, tmp / f"dagster-{label}.log", ready_asset="vae_latents") as dev:
        launched = backfill.launch_backfill(dev.url, keys, KINDS)
        st = backfill.wait_backfill(dev.url, launched, timeout=7200, poll=2.0)
        with dg.DagsterInstance.from_config(str(home)) as instance:
            runs = _runs(instance, launched)
            statuses = sorted({r.dagster_run.status.value for r in runs})
            start = min(r.start_time for r in runs if r.start_time)
            end = max(r.end_time for r in runs if r.end_time)
            done = {
                (k, p) for k in KINDS for p in instance.get_materialized_partitions(dg.AssetKey(k))
            }
            timeline = [_timeline(instance, r) for r in runs]
    wall = end - start
    pairs = rows * len(keys)
    gpu = pairs / rate if rate else None
    out = {
        "path": label.split("-")[0],
        "partitions_per_run": per_run,
        "runs": len(runs),
        "run_statuses": statuses,
        "backfill_status": st["status"],
        "materialized": len(done),
        "expected": len(KINDS) * len(keys),
        "wall_s": round(wall, 2),
    }
    if gpu is not None:
        g = gpu / len(keys)  # one partition's GPU seconds
        # a run: its start to its first partition encoded, less that partition's GPU time (the
        # process, imports, model loads); between partitions encoded (steady state); after the
        # last (its write and publish, not overlapped)
        start_s = [t["first_encoded_s"] - g for t in timeline if t["first_encoded_s"] is not None]
        steps = [x for t in timeline for x in t["between_s"]]
        tails = [t["tail_s"] for t in timeline]
        out |= {
            "simulated_pairs_per_s": rate,
            "gpu_s": round(gpu, 2),
            "gpu_busy": round(gpu / wall, 4),
            "fixed_s_per_partition": round((wall - gpu) / len(keys), 2),
            "run_start_s": round(float(np.median(start_s)), 2) if start_s else None,
            "between_partitions_s": round(float(np.median(steps)), 2) if steps else None,
            "run_tail_s": round(float(np.median(tails)), 2),
        }
        if steps and start_s:  # a run of per_run partitions, from these parts
            m = per_run
            run = (
                float(np.median(start_s))
                + g
                + (m - 1) * float(np.median(steps))
                + float(np.median(tails))
            )
            out["projected_gpu_busy_at_partitions_per_run"] = {str(m): round(m * g / run, 4)}
    else:
        out["pairs_per_s"] = round(pairs / wall, 1)
    return out


def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        prog="flowmatch bench precompute", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--partitions", type=int, default=4)
    p.add_argument("--rows", type=int, default=2000, help="images a partition (PD12M: 10,000)")
    p.add_argument("--rates", default="100,1100", help="simulated GPU pairs/s, comma-separated")
    p.add_argument("--per-run", type=int, default=64, help="the new path's partitions per run")
    p.add_argument("--quick", action="store_true", help="Gemma with an 8k vocabulary")
    p.add_argument("--real", action="store_true", help="the real forward passes (CUDA)")
    p.add_argument(
        "--storage",
        choices=("default", "lossless"),
        default="default",
        help="the shards' storage: the default (caption and DINO states transform-coded: their "
        "fit runs on the encoders' device, the CPU here) or lossless zstd",
    )
    p.add_argument("--out", default=None, help="also write the JSON here")
    a = p.parse_args(argv)
    rates: list[float | None] = [None] if a.real else [float(r) for r in a.rates.split(",")]
    result: dict = {
        "bench": "precompute",
        "simulation": None
        if a.real
        else (
            "SIMULATED GPU: the encoders' forward passes replaced by a sleep of pairs/rate (split "
            "by FLOPs) returning arrays of the real shapes; model loads, JPEG decoding, "
            "tokenizing, fitting, writing, catalog and Dagster all real"
        ),
        "partitions": a.partitions,
        "rows_per_partition": a.rows,
        "storage": a.storage,
        "cpu_count": os.cpu_count(),
        "results": [],
    }
    with tempfile.TemporaryDirectory(prefix="flowmatch-bench-precompute-") as tmp:
        tmp = Path(tmp)
        t0 = time.perf_counter()
        keys = write_images(tmp / "images-root", a.partitions, a.rows)
        encoders = save_encoders(tmp / "encoders", a.quick)
        print(
            f"{len(keys)} partitions of {a.rows} images and the encoders written in "
            f"{time.perf_counter() - t0:.0f}s",
            flush=True,
        )
        settings = None
        if a.storage == "lossless":
            settings = tmp / "lossless.yaml"
            settings.write_text("encoders:\n  codec: zstd\n  lossy: {}\n")
        for rate in rates:
            for path, per_run in (("old", 1), ("new", a.per_run)):
                label = f"{path}-{rate or 'real'}"
                r = one_backfill(tmp, keys, encoders, a.rows, rate, per_run, label, settings)
                result["results"].append(r)
                busy = f"GPU busy {r['gpu_busy']:.1%}, " if "gpu_busy" in r else ""
                print(
                    f"{label:>10}: {r['runs']} runs, wall {r['wall_s']:.1f}s, {busy}"
                    f"fixed {r.get('fixed_s_per_partition', '-')} s/partition, "
                    f"{r['materialized']}/{r['expected']} materialized",
                    flush=True,
                )
    for rate, target in TARGETS.items():
        new = [
            r
            for r in result["results"]
            if r["path"] == "new" and r.get("simulated_pairs_per_s") == rate
        ]
        if new:
            result[f"target_{int(rate)}"] = {
                "gpu_busy_at_least": target,
                "met": new[0]["gpu_busy"] >= target,
            }
    line = json.dumps(result)
    if a.out:
        atomic_write_text(a.out, line + "\n")
    print(line)
    return result


if __name__ == "__main__":
    main()
