"""One command for the GPU: precalc, the ``base`` training step and the loader, in one JSON.

    bash scripts/gpu_check.sh [--out gpu_check.json]      (= flowmatch bench gpu)

On a CUDA machine, within ``--budget-s`` (default 540 s; a phase that would start past it is
recorded as skipped), it measures:

- ``matmul``: the achieved bf16 matmul FLOP/s (8192^3), the peak MFU is measured against;
- ``precalc``: pairs/s of the three full-size random encoders (DC-AE f32c32, DINOv2-small,
  Gemma3-270M; :mod:`flowmatch_assets.bench.precalc`) over a batch sweep with compile off, then
  compile on at the best batch; bf16, channels_last;
- ``train``: the ``base`` preset's training step (flow matching + REPA, AdamW, bf16 autocast;
  :mod:`flowmatch_assets.bench.train`) over a batch sweep with compile off, then compile on at
  the best batch: samples/s and MFU;
- ``loader``: samples/s of the training loader over a synthetic store (page cache);
- ``precompute``: a real backfill of the embedding kinds through ``dagster dev`` (4 partitions
  of 4,000 images), one partition a run against runs of many, with the real forward passes
  (:mod:`flowmatch_assets.bench.precompute` ``--real``);

with the peak GPU memory of each, and the fraction of the targets reached (ARCHITECTURE.md:
precalc >= 1,100 pairs/s and training >= 40% MFU on one H200). Without a CUDA GPU it says so and
exits 0. ``--smoke`` runs every phase on the CPU at toy sizes (the test suite does, so the script
works before anyone spends GPU time on it).
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from collections.abc import Callable, Sequence

import torch

from flowmatch_models.storage.atomic import atomic_write_text

TARGETS = {"precalc_pairs_per_s": 1100.0, "train_mfu": 0.40}


class Budget:
    """Wall-clock budget: phases that would start after ``limit_s`` are skipped, not started."""

    def __init__(self, limit_s: float):
        self.t0, self.limit_s = time.perf_counter(), limit_s

    def left(self) -> float:
        return self.limit_s - (time.perf_counter() - self.t0)


def _phase(budget: Budget, need_s: float, fn: Callable[[], dict], cuda: bool) -> dict:
    """Run one measurement with its peak memory; errors and skips are recorded, not raised."""
    if budget.left() < need_s:
        return {"skipped": f"time budget: {budget.left():.0f}s left, needs ~{need_s:.0f}s"}
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    try:
        out = fn()
    except Exception as e:  # an OOM at one batch must not lose the other measurements
        out = {"error": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
        traceback.print_exc()
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    if cuda:
        out["peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    print(json.dumps(out), flush=True)
    return out


def _best(runs: list[dict], key: str) -> dict | None:
    ok = [r for r in runs if key in r]
    return max(ok, key=lambda r: r[key]) if ok else None


def gpu_check(budget_s: float = 540.0, smoke: bool = False) -> dict:
    """Every measurement of the module docstring; returns the result dict."""
    from flowmatch_assets.bench import precalc as bench_precalc
    from flowmatch_assets.bench import train as bench_train

    cuda = torch.cuda.is_available() and not smoke
    budget = Budget(budget_s)
    dev = torch.device("cuda" if cuda else "cpu")
    result: dict = {
        "bench": "gpu",
        "device": torch.cuda.get_device_name(0) if cuda else "cpu (smoke)",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "targets": TARGETS,
    }
    peak = bench_train.matmul_peak(
        dev, torch.bfloat16 if cuda else torch.float32, n=None if cuda else 256
    )
    result["matmul_peak_tflops"] = round(peak / 1e12, 2)

    # precalc: batch sweep (compile off), then compile on at the best batch
    sweep = (128, 256, 512) if cuda else (2,)
    runs = []
    for b in sweep:
        runs.append(
            _phase(
                budget,
                60,
                lambda b=b: bench_precalc.run(
                    device=str(dev), batch=b, iters=10 if cuda else 1, quick=not cuda
                ),
                cuda,
            )
        )
    best = _best(runs, "pairs_per_s")
    if best and cuda:
        runs.append(
            _phase(
                budget,
                150,
                lambda: bench_precalc.run(
                    device="cuda", batch=best["batch"], iters=10, compile_models=True
                ),
                cuda,
            )
        )
    result["precalc"] = runs
    best = _best(runs, "pairs_per_s")

    # training step of the base preset: batch sweep (compile off), then compile on at the best
    preset, tsweep = ("base", (128, 256)) if cuda else ("tiny", (4,))
    truns = []
    for b in tsweep:
        truns.append(
            _phase(
                budget,
                60,
                lambda b=b: bench_train.bench(
                    preset,
                    batch=b,
                    device=str(dev),
                    steps=10 if cuda else 2,
                    warmup=3 if cuda else 1,
                ),
                cuda,
            )
        )
    tbest = _best(truns, "mfu")
    if tbest and cuda:
        truns.append(
            _phase(
                budget,
                180,
                lambda: bench_train.bench(
                    preset, batch=tbest["batch"], device="cuda", steps=10, compile=True
                ),
                cuda,
            )
        )
    result["train"] = truns
    tbest = _best(truns, "mfu")

    result["loader"] = _phase(
        budget,
        30,
        lambda: bench_train.bench_loader(
            batch=256 if cuda else 16, batches=40 if cuda else 4, per_shard=2000 if cuda else 64
        ),
        cuda,
    )

    if cuda:  # a real backfill of the embedding kinds with the real forward passes
        from flowmatch_assets.bench import precompute as bench_precompute

        result["precompute"] = _phase(
            budget,
            240,
            lambda: bench_precompute.main(["--real", "--partitions", "4", "--rows", "4000"]),
            cuda,
        )

    result["achieved"] = {
        "precalc_pairs_per_s": best["pairs_per_s"] if best else None,
        "precalc_fraction_of_target": round(best["pairs_per_s"] / TARGETS["precalc_pairs_per_s"], 3)
        if best
        else None,
        "train_samples_per_s": tbest["samples_per_s"] if tbest else None,
        "train_mfu": tbest["mfu"] if tbest else None,
        "train_fraction_of_target": round(tbest["mfu"] / TARGETS["train_mfu"], 3)
        if tbest
        else None,
    }
    result["wall_s"] = round(time.perf_counter() - budget.t0, 1)
    return result


def main(argv: Sequence[str] | None = None) -> dict:
    """CLI: the result dict, printed last as one JSON line (``{"bench": "gpu", ...}``)."""
    ap = argparse.ArgumentParser(
        prog="flowmatch bench gpu",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--out", default="gpu_check.json", help="where the JSON goes")
    ap.add_argument("--budget-s", type=float, default=540.0, help="wall-clock budget")
    ap.add_argument("--smoke", action="store_true", help="every phase on the CPU, toy sizes")
    args = ap.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print(
            f"gpu check: needs a CUDA GPU; none here (torch {torch.__version__}, "
            f"cuda available: False). Nothing measured."
        )
        result = {"bench": "gpu", "skipped": "no CUDA GPU"}
        print(json.dumps(result), flush=True)
        return result
    result = gpu_check(args.budget_s, args.smoke)
    atomic_write_text(args.out, json.dumps(result, indent=1))
    a = result["achieved"]
    print(
        f"gpu check: {result['device']}: precalc {a['precalc_pairs_per_s']} pairs/s "
        f"({a['precalc_fraction_of_target']} of 1,100), train MFU {a['train_mfu']} "
        f"({a['train_fraction_of_target']} of 0.40); {args.out}"
    )
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
