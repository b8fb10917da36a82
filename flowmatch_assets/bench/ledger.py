"""Benchmark: the cost of the training ledger against the training it records.

A checkpoint's ledger is a delta on the previous checkpoint: the samples trained in between,
reconstructed from the epoch's order (one permutation of the whole epoch, ``--partitions`` x
``--per-partition`` samples; PD12M: 1,240 x 10,000) and written to the catalog (parquet), as
the ``flow_model`` asset does after a session. Prints its seconds and, against the training time
of those ``--checkpoint-every`` x ``--global-batch`` samples at ``--train-rate`` samples/s, the
fraction. The training loop itself only extends one segment per batch.

    flowmatch bench ledger                      # PD12M scale, configs/base.yaml cadence
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Sequence


def run(
    partitions: int, per_partition: int, checkpoint_every: int, global_batch: int, train_rate: float
) -> dict:
    """One checkpoint's ledger (the samples of ``checkpoint_every`` steps, mid-epoch, as a delta
    on the previous checkpoint) against the training time of those steps."""
    from flowmatch_assets import catalog
    from flowmatch_models.train.ledger import delta, expand

    names = [f"{i // 100:03d}-{i % 100:02d}" for i in range(partitions)]
    n = partitions * per_partition
    span = checkpoint_every * global_batch
    seg = {
        "epoch": 3,
        "partitions": names,
        "sizes": [per_partition] * partitions,
        "seed": 0,
        "shuffle_window": 8,
        "global_batch": global_batch,
        "accumulate": 1,
        "pos_from": 0,
        "pos_to": span,
        "step_from": 3 * (n // global_batch),
        "available_partitions": partitions,
        "available_samples": n,
    }
    prev, now = [seg], [{**seg, "pos_to": 2 * span}]
    ids = {p: [f"{p}/{j}" for j in range(per_partition)] for p in names}
    t0 = time.perf_counter()
    rows = expand(delta(prev, now), ids.__getitem__)
    t1 = time.perf_counter()
    with tempfile.TemporaryDirectory() as root:
        catalog.record_ledger(root, "bench", 2 * checkpoint_every, rows, now, [1, 2])
    t2 = time.perf_counter()
    train_s = span / train_rate
    return {
        "bench": "ledger",
        "epoch_samples": n,
        "checkpoint_samples": span,
        "rows": len(rows["sample_id"]),
        "expand_s": round(t1 - t0, 2),
        "write_s": round(t2 - t1, 2),
        "ledger_s": round(t2 - t0, 2),
        "train_rate": train_rate,
        "train_s": round(train_s, 1),
        "fraction_of_training": round((t2 - t0) / train_s, 5),
    }


def main(argv: Sequence[str] | None = None) -> dict:
    """CLI: the result, printed last as one JSON line."""
    ap = argparse.ArgumentParser(
        prog="flowmatch bench ledger",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--partitions", type=int, default=1240, help="PD12M: 1,240 of 10,000")
    ap.add_argument("--per-partition", type=int, default=10_000)
    ap.add_argument("--checkpoint-every", type=int, default=2000, help="steps (configs/base.yaml)")
    ap.add_argument("--global-batch", type=int, default=1024)
    ap.add_argument(
        "--train-rate",
        type=float,
        default=3800.0,
        help="training samples/s to compare with (base, 40%% MFU on one H200)",
    )
    a = ap.parse_args(argv)
    out = run(a.partitions, a.per_partition, a.checkpoint_every, a.global_batch, a.train_rate)
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
