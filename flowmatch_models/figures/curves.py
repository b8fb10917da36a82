"""The run's metrics: ``logs/seg*/metrics.csv`` (one per start) merged, and the loss-curve PNG."""

from __future__ import annotations

import csv
from pathlib import Path

from flowmatch_models.model.loss_terms import LOSS_TERMS, VAL_LOSS
from flowmatch_models.storage.atomic import atomic_path


def merge_metrics(out_dir: Path) -> Path | None:
    """Merge ``logs/seg*/metrics.csv`` into ``metrics.csv``; a later segment wins its steps."""
    segs = sorted((out_dir / "logs").glob("seg*/metrics.csv"))
    if not segs:
        return None
    tables = []
    for p in segs:
        with open(p, newline="") as f:
            tables.append(list(csv.DictReader(f)))
    rows: list[dict] = []
    for i, table in enumerate(tables):
        later = [int(r["step"]) for t in tables[i + 1 :] for r in t if r.get("step")]
        cut = min(later) if later else None
        rows += [r for r in table if cut is None or int(r["step"]) < cut]
    keys = sorted({k for r in rows for k in r}, key=lambda k: (k != "step", k))
    target = out_dir / "metrics.csv"
    with atomic_path(target) as tmp, open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    return target


def plot_loss_curve(metrics_csv: Path, out_png: Path) -> Path:
    """Loss / FM / REPA (and the held-out validation loss) against step from a ``metrics.csv``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(metrics_csv, newline="") as f:
        rows = list(csv.DictReader(f))
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.5))
    # the flow-matching term on a log axis; the total (fm + lambda * -cos) goes negative with
    # REPA, so it is drawn only when it stays positive (REPA off: it equals fm); REPA apart
    for term in LOSS_TERMS:
        pts = [(int(r["step"]), float(r[term.logged])) for r in rows if r.get(term.logged)]
        if pts and (not term.positive or min(v for _, v in pts) > 0):
            ax[term.panel].plot(*zip(*pts), label=term.label)
    pts = [(int(r["step"]), float(r[VAL_LOSS])) for r in rows if r.get(VAL_LOSS)]
    if pts:  # held-out, EMA, fixed noise and t grid: the curve to judge a run by
        ax[0].plot(*zip(*pts), "o-", label="validation (held-out, EMA)", color="C3")
    for a in ax:
        a.set_xlabel("step")
        if a.lines:
            a.legend()
    ax[0].set_yscale("log")
    ax[0].set_title("flow-matching loss (falls as it learns)")
    ax[0].set_ylabel("velocity MSE (log)")
    ax[1].set_title("REPA alignment (lower: closer to DINOv2)")
    ax[1].set_ylabel("-cosine")
    fig.tight_layout()
    with atomic_path(out_png, suffix=".png") as tmp:
        fig.savefig(tmp, dpi=100, format="png")
    plt.close(fig)
    return out_png


def loss_curve_now(out_dir: Path, trainer) -> Path | None:
    """Flush the CSV logger, merge the segments and redraw ``loss_curve.png`` (rank 0)."""
    for lg in trainer.loggers:
        if lg.__class__.__name__ == "CSVLogger":
            lg.save()
    merged = merge_metrics(out_dir)
    return plot_loss_curve(merged, out_dir / "loss_curve.png") if merged else None


def plot_coverage(ledger: list[dict], out_png: Path) -> Path | None:
    """Per epoch, partitions and samples available (complete at the epoch's start) vs used,
    from the data state's ledger segments (the first segment of each epoch)."""
    per_epoch: dict[int, dict] = {}
    for seg in ledger:
        per_epoch.setdefault(int(seg["epoch"]), seg)
    if not per_epoch:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = sorted(per_epoch)
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.2))
    for a, what in zip(ax, ("partitions", "samples")):
        used = [
            len(per_epoch[e]["partitions"]) if what == "partitions" else sum(per_epoch[e]["sizes"])
            for e in epochs
        ]
        avail = [per_epoch[e].get(f"available_{what}", u) for e, u in zip(epochs, used)]
        a.step(epochs, used, where="post", label="used", color="C0", lw=3)
        a.step(epochs, avail, where="post", label="available (complete)", color="C1", ls="--")
        a.set_xlabel("epoch")
        a.set_ylabel(what)
        a.set_ylim(bottom=0)
        a.legend()
    fig.suptitle("training coverage per epoch")
    fig.tight_layout()
    with atomic_path(out_png, suffix=".png") as tmp:
        fig.savefig(tmp, dpi=100, format="png")
    plt.close(fig)
    return out_png
