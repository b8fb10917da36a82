"""Benchmark: the training loader at PD12M scale — host memory, samples/s per core, window
boundaries, bytes per sample.

Writes synthetic PD12M-sized partitions (``--partition-size`` 10,000 samples each, as many as
two shuffle windows need) to a work folder: caption states of the real Gemma3-270M on
PD12M-like captions (:func:`flowmatch_assets.bench.corpus.pd12m_like_captions`; encoded once and
cached, then tiled to size), DC-AE latents and DINOv2 patches as smooth synthetic fields (no real
weights offline), in the storage asked for (``default``: the pipeline's, see
``EncoderSpec``; ``lossless``: fp16, codec none; ``zstd``: fp16 byte-shuffled zstd, the old
default). Then runs the real :class:`~flowmatch_models.data.module.EmbeddingDataModule` with
``configs/base.yaml``'s loader settings (batch 64, 6 workers, shuffle window 8, 128 tokens,
held-out 0.5%) over two windows, consuming batches as the training loop does, once with each
loader (``data.loader``: ``processes``, the DataLoader's worker processes, the old loader;
``threads``, the default), alternated ``--repeats`` times on the same files in one run (so
the ratio is from one box at one time), and reports for each:

- peak host memory of the loader, summed over the main process and its workers: PSS (each
  shared page counted once over the processes), RSS and USS (private), sampled every 20 ms from
  ``/proc/<pid>/smaps_rollup``;
- samples/s per core in steady state: samples / CPU seconds of all loader processes (so the
  figure does not depend on how many cores the box has), and the wall-clock batches/s in the
  batches around the window boundary against the steady mean (a stall shows there);
- stored bytes per sample per kind and their PD12M projection (12.4M pairs);
- the device-side decode (codes -> float32 states) on this CPU, one thread, for scale.

Ends with one JSON line ``{"bench": "loader", ...}``. Run: ``flowmatch bench loader`` (needs
~9 GB of disk under ``--workdir`` and ~2 minutes the first time, for the Gemma states).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from flowmatch_assets.bench.proc_tree import TreeMonitor

PD12M_PAIRS = 12_400_000
STORAGES = ("default", "lossless", "zstd")


# --------------------------------------------------------------------------------------------
# PD12M-sized partitions
# --------------------------------------------------------------------------------------------


def gemma_states(n: int, workdir: Path, gemma: Path | None) -> tuple[np.ndarray, np.ndarray]:
    """Real Gemma3-270M states of ``n`` PD12M-like captions, encoded once and cached."""
    cache = workdir / f"gemma-states-{n}.npz"
    if cache.exists():
        z = np.load(cache)
        return z["tokens"], z["lengths"]
    from flowmatch_assets.bench.corpus import gemma_hidden_states, pd12m_like_captions
    from flowmatch_models.encoders.zoo import GEMMA_FOLDER, create_real_gemma

    folder = create_real_gemma(gemma or Path("data") / "zoo" / GEMMA_FOLDER)
    print(f"encoding {n} PD12M-like captions with the real Gemma3-270M ...", file=sys.stderr)
    tokens, lengths, _ = gemma_hidden_states(pd12m_like_captions(n), folder)
    workdir.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(".tmp.npz")
    np.savez(tmp, tokens=tokens, lengths=lengths)
    os.replace(tmp, cache)
    return tokens, lengths


def storage_options(storage: str) -> tuple[str, dict[str, str]]:
    """``(codec, lossy per kind)`` of a storage name."""
    from flowmatch_models.encoders.spec import EncoderSpec

    if storage == "default":
        spec = EncoderSpec()
        return spec.codec, dict(spec.lossy)
    if storage == "lossless":
        return "none", {}
    if storage == "zstd":
        return "zstd", {}
    raise ValueError(f"storage {storage!r}: choose one of {STORAGES}")


def partition_arrays(
    size: int, tokens: np.ndarray, lengths: np.ndarray, seed: int = 0
) -> dict[str, dict[str, np.ndarray]]:
    """One partition's arrays per kind: the base captions tiled to ``size`` samples."""
    from flowmatch_assets.bench.corpus import image_arrays
    from flowmatch_models.storage.store import ragged_offsets

    base = len(lengths)
    pick = np.arange(size) % base
    offsets = ragged_offsets(lengths)
    tok = np.concatenate([tokens[offsets[i] : offsets[i + 1]] for i in pick])
    img = image_arrays(min(size, 512), seed)
    ipick = np.arange(size) % len(img["latents"])
    null = tokens[:1]  # a one-token caption: the BOS state (what the encoded empty prompt is)
    return {
        "vae_latents": {"latents": img["latents"][ipick]},
        "dino_features": {"patch": img["patch"][ipick], "cls": img["cls"][ipick]},
        "text_embeddings": {"tokens": tok, "lengths": lengths[pick], "null_tokens": null},
    }


def write_partitions(
    root: Path, partitions: int, size: int, storage: str, tokens, lengths
) -> dict[str, int]:
    """``partitions`` partitions of ``size`` samples under the data root ``root`` (the first
    written, the others copies of it); returns stored bytes per kind of one partition."""
    from flowmatch_models.embeddings.kinds import KINDS
    from flowmatch_models.storage.layout import DataLayout
    from flowmatch_models.storage.store import write_shard

    layout = DataLayout(root)
    codec, lossy = storage_options(storage)
    arrays = partition_arrays(size, tokens, lengths)
    ids = [f"{i:09d}" for i in range(size)]
    first = "000-00"
    out = {}
    for kind, arrs in arrays.items():
        path = layout.asset_path(kind, first)
        path.parent.mkdir(parents=True, exist_ok=True)
        mode = lossy.get(kind)
        lossy_arrays = dict.fromkeys(KINDS[kind].lossy, mode) if mode else None
        attrs = {"scaling_factor": 0.41407} if kind == "vae_latents" else {}
        t = time.perf_counter()
        stats = write_shard(path, arrs, ids, codec=codec, attrs=attrs, lossy=lossy_arrays)
        print(
            f"{kind}: {stats.stored_bytes / size:,.0f} B/sample in {time.perf_counter() - t:.1f}s",
            file=sys.stderr,
        )
        out[kind] = stats.stored_bytes
        for p in range(1, partitions):
            shutil.copyfile(path, layout.asset_path(kind, f"{p:03d}-00"))
    return out


# --------------------------------------------------------------------------------------------
# the measurement
# --------------------------------------------------------------------------------------------


def measure(
    root: Path,
    batch_size: int = 64,
    num_workers: int = 6,
    shuffle_window: int = 8,
    text_max_len: int = 128,
    heldout: tuple[float, int] = (0.005, 50),
    max_batches: int | None = None,
    loader: str = "threads",
) -> dict:
    """Run the real data module's loader (``loader``: ``data.loader``) over one epoch (or
    ``max_batches``) of ``root`` and measure memory, CPU and batch times as the module doc
    says."""
    import torch

    from flowmatch_models.data.module import EmbeddingDataModule

    torch.set_num_threads(1)
    dm = EmbeddingDataModule(
        root,
        batch_size=batch_size,
        num_workers=num_workers,
        shuffle_window=shuffle_window,
        text_max_len=text_max_len,
        heldout=heldout,
        load_dino=True,
        loader=loader,
    )
    sizes = dm.source.sizes
    per_window = int(sizes[:shuffle_window].sum())
    boundary = per_window // batch_size  # the first batch that reaches the second window
    times, samples, steady = [], 0, None
    total = int(sizes.sum()) // batch_size
    # steady state from here (workers started, queues full)
    warm = min(2 * num_workers + 8, (min(total, max_batches or total)) // 2)
    for k, batch in enumerate(dm.train_dataloader()):
        times.append(time.time())
        samples += len(batch["latents"])
        if k == warm:
            steady = (times[-1], samples)
        if max_batches and k + 1 >= max_batches:
            break
    times_a = np.asarray(times)
    gaps = np.diff(times_a)
    around = slice(max(boundary - 64, warm), min(boundary + 64, len(gaps)))
    steady_gap = float(np.mean(gaps[warm:]))
    window_gap = float(np.mean(gaps[around])) if len(gaps[around]) else float("nan")
    return {
        "batches": len(times),
        "samples": samples,
        "start": times[0],
        "steady_start": steady[0],
        "steady_samples": samples - steady[1],
        "end": times[-1],
        "window_boundary_batch": boundary,
        "batches_per_s_steady": 1 / steady_gap,
        "batches_per_s_at_window_boundary": 1 / window_gap,
        "boundary_vs_steady": steady_gap / window_gap,
        "slowest_batch_gap_s": float(gaps[warm:].max()),
        # batches/s per block of 64 batches: a cold window or a stall shows as a dip
        "batches_per_s_by_64": [
            round(64 / float(gaps[i : i + 64].sum()), 1) for i in range(0, len(gaps) - 63, 64)
        ],
        "partition_samples": int(sizes[0]),
    }


def measure_in_subprocess(
    root: Path,
    batch_size: int,
    num_workers: int,
    shuffle_window: int,
    max_batches: int | None,
    loader: str = "threads",
) -> dict:
    """:func:`measure` in a fresh Python process: what it measures is the loader alone, not
    the memory this process used to write the partitions."""
    import subprocess

    args = {
        "root": str(root),
        "batch_size": batch_size,
        "num_workers": num_workers,
        "shuffle_window": shuffle_window,
        "max_batches": max_batches,
        "loader": loader,
    }
    code = (
        "import json, sys; from pathlib import Path; from flowmatch_assets.bench.loader import "
        "measure; a = json.loads(sys.argv[1]); a['root'] = Path(a['root']); "
        "print(json.dumps(measure(**a)))"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, json.dumps(args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    with TreeMonitor(proc.pid) as mon:
        out, err = proc.communicate()
    if proc.returncode:
        raise RuntimeError(f"the loader measurement failed:\n{err[-3000:]}")
    m = json.loads(out.strip().splitlines()[-1])
    cpu = mon.cpu_at(m["end"]) - mon.cpu_at(m["steady_start"])
    wall = m["end"] - m["steady_start"]
    return {
        **m,
        "processes": mon.peak_processes,
        "peak_pss_gb": mon.peak["pss"] / 1e9,
        "peak_rss_gb": mon.peak["rss"] / 1e9,
        "peak_uss_gb": mon.peak["uss"] / 1e9,
        "steady_cpu_seconds": cpu,
        "samples_per_s_per_core": m["steady_samples"] / max(cpu, 1e-9),
        "samples_per_s_wall": m["steady_samples"] / max(wall, 1e-9),
    }


def device_decode_rate(root: Path, batch_size: int = 64, batches: int = 8) -> dict:
    """Decode of stored batches to float32 on this CPU (one thread): samples/s."""
    import torch

    from flowmatch_models.data.module import EmbeddingDataModule
    from flowmatch_models.data.stream import BatchStream

    torch.set_num_threads(1)
    dm = EmbeddingDataModule(
        root, batch_size=batch_size, num_workers=0, shuffle_window=8, heldout=(0.005, 50)
    )
    stream = iter(BatchStream(dm.source, batch_size))
    stored = [next(stream) for _ in range(batches)]
    t = time.perf_counter()
    for b in stored:
        dm.decode_batch(b, "cpu")
    s = time.perf_counter() - t
    return {"cpu_1_thread_samples_per_s": batch_size * batches / s}


def run(
    storage: str = "default",
    workdir: Path = Path(".bench/loader"),
    partition_size: int = 10_000,
    partitions: int | None = None,
    num_workers: int = 6,
    batch_size: int = 64,
    shuffle_window: int = 8,
    captions: int = 256,
    gemma: Path | None = None,
    max_batches: int | None = None,
    keep: bool = False,
    loaders: Sequence[str] = ("processes", "threads"),
    repeats: int = 1,
) -> dict:
    """Write the partitions, measure each of ``loaders`` ``repeats`` times (alternated), report
    (also printed): the top-level figures are the last loader's (its median run by samples/s
    per core), ``loaders`` holds each one's, ``ratio_per_core`` the last over the first."""
    workdir = Path(workdir)
    tokens, lengths = gemma_states(captions, workdir, gemma)
    partitions = partitions or 2 * shuffle_window
    root = workdir / f"data-{storage}-{partition_size}"
    if root.exists():
        shutil.rmtree(root)
    try:
        per_kind = write_partitions(root, partitions, partition_size, storage, tokens, lengths)
        runs: dict[str, list[dict]] = {name: [] for name in loaders}
        for _ in range(repeats):
            for name in loaders:
                runs[name].append(
                    measure_in_subprocess(
                        root, batch_size, num_workers, shuffle_window, max_batches, name
                    )
                )
        dec = device_decode_rate(root, batch_size) if storage == "default" else {}
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
    per_sample = {k: v / partition_size for k, v in per_kind.items()}
    total = sum(per_sample.values())
    by_loader = {}
    for name, ms in runs.items():
        rates = sorted(m["samples_per_s_per_core"] for m in ms)
        median = sorted(ms, key=lambda m: m["samples_per_s_per_core"])[(len(ms) - 1) // 2]
        by_loader[name] = {
            **median,
            "samples_per_s_per_core_runs": rates,
            "boundary_vs_steady_runs": [m["boundary_vs_steady"] for m in ms],
        }
    m = by_loader[loaders[-1]]
    stored = np.minimum(lengths, 128)
    return {
        "bench": "loader",
        "storage": storage,
        "storage_options": dict(zip(("codec", "lossy"), storage_options(storage))),
        "settings": {
            "batch_size": batch_size,
            "num_workers": num_workers,
            "shuffle_window": shuffle_window,
            "text_max_len": 128,
            "partitions": partitions,
            "partition_size": partition_size,
        },
        "text": f"real Gemma3-270M states of {captions} PD12M-like captions, tiled; "
        f"tokens stored mean {stored.mean():.1f}",
        "bytes_per_sample": {k: round(v) for k, v in per_sample.items()},
        "bytes_per_sample_total": round(total),
        "pd12m_gb": {
            **{k: round(v * PD12M_PAIRS / 1e9, 1) for k, v in per_sample.items()},
            "total": round(total * PD12M_PAIRS / 1e9, 1),
        },
        "loader": loaders[-1],
        **m,
        "loaders": by_loader,
        "ratio_per_core": m["samples_per_s_per_core"]
        / by_loader[loaders[0]]["samples_per_s_per_core"],
        "repeats": repeats,
        "device_decode": dec,
        "cpu": os.cpu_count(),
    }


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="flowmatch bench loader")
    parser.add_argument("--storage", choices=STORAGES, default="default")
    parser.add_argument("--workdir", type=Path, default=Path(".bench/loader"))
    parser.add_argument("--partition-size", type=int, default=10_000)
    parser.add_argument("--partitions", type=int, default=None, help="default: two shuffle windows")
    parser.add_argument("--workers", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--shuffle-window", type=int, default=8)
    parser.add_argument("--captions", type=int, default=256, help="real Gemma captions to tile")
    parser.add_argument("--gemma", type=Path, default=None)
    parser.add_argument("--max-batches", type=int, default=None)
    parser.add_argument("--keep", action="store_true", help="keep the written partitions")
    parser.add_argument(
        "--loaders",
        default="processes,threads",
        help="data.loader values to measure, in this order (the last is reported "
        "on top; the ratio is the last over the first)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="measure each loader this many times, alternated (median kept)",
    )
    a = parser.parse_args(argv)
    r = run(
        a.storage,
        a.workdir,
        a.partition_size,
        a.partitions,
        a.workers,
        a.batch_size,
        a.shuffle_window,
        a.captions,
        a.gemma,
        a.max_batches,
        a.keep,
        tuple(a.loaders.split(",")),
        a.repeats,
    )
    for name, m in r["loaders"].items():
        print(
            f"loader {name} ({r['storage']}, {a.workers} workers): peak PSS "
            f"{m['peak_pss_gb']:.2f} GB (RSS {m['peak_rss_gb']:.2f}, USS {m['peak_uss_gb']:.2f}) "
            f"over {m['processes']} processes; {m['samples_per_s_per_core']:,.0f} samples/s per "
            f"core ({m['samples_per_s_wall']:,.0f}/s wall on {r['cpu']} cores); window boundary "
            f"{m['boundary_vs_steady']:.2f}x steady batches/s",
            file=sys.stderr,
        )
    print(
        f"{r['loader']} / {next(iter(r['loaders']))}: {r['ratio_per_core']:.2f}x samples/s per "
        f"core; {r['bytes_per_sample_total']:,} B/sample -> PD12M {r['pd12m_gb']['total']:.0f} GB",
        file=sys.stderr,
    )
    print(json.dumps(r))
    return r


if __name__ == "__main__":
    main()
