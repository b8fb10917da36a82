"""What the samples training skips would have cost: the budget's "removed samples" rows.

The removed rows are the exclusion list training skips (``flowmatch_models/data/exclude.py``:
the near duplicates ``flowmatch catalog neardup`` decided plus the content duplicates that
stayed stored). Each would have cost a precalc pair (the encoders' seconds per pair) and its
share of the configured training run: a run of ``updates x effective_batch`` samples over
``dataset_pairs`` trains every sample ``updates x effective_batch / dataset_pairs`` times, each
at the run's seconds per sample. So per stage::

    hours     = rows removed x seconds per row / 3600
    GPU-hours = hours x the GPUs billed (the budget's ``gpus``; the seed's 2 for its rates)
    cloud $   = GPU-hours x gpu_hour_usd

for the rows removed in this catalog, and for PD12M (``dataset_pairs`` times the fraction of
the stored rows removed here). Only GPU-measured rates count (a CPU rate is no GPU-hour); with
none, the seed's published rates (labelled so).
"""

from __future__ import annotations

from flowmatch_assets.catalog import Catalog
from flowmatch_models.data import exclude as exclusions


def removed_rows(catalog: Catalog) -> tuple[int, int]:
    """``(rows training skips, rows stored in the images shards)`` of this catalog."""
    stored = catalog.query(
        "SELECT coalesce(sum(samples), 0) AS n FROM materializations WHERE asset = 'images'"
    )
    return len(exclusions.read(catalog.layout.root)), int(stored[0]["n"])


def removed_cost(
    rates: list[tuple[str, str, str, float, int]], cfg, removed: int, stored: int
) -> dict:
    """The removed rows and, per stage and rate (``(stage, source, device, samples/s, GPUs
    billed)``: the budget's GPU-measured rates, else the seed's), what they would have cost."""
    fraction = removed / stored if stored else 0.0
    visits = cfg.updates * cfg.effective_batch / cfg.dataset_pairs  # times a sample is trained
    rows = []
    for stage, source, device, per_s, gpus in rates:
        s_per_row = (1.0 if stage == "precalc" else visits) / per_s
        for scope, n in (("here", removed), ("dataset", fraction * cfg.dataset_pairs)):
            hours = n * s_per_row / 3600
            rows.append(
                {
                    "stage": stage,
                    "scope": scope,
                    "source": source,
                    "device": device,
                    "rows": n,
                    "seconds_per_row": s_per_row,
                    "hours": hours,
                    "gpu_hours": hours * gpus,
                    "cloud_usd": hours * gpus * cfg.gpu_hour_usd,
                }
            )
    return {"removed": removed, "stored": stored, "fraction": fraction, "rows": rows}


def render_removed(r: dict, dataset_pairs: int) -> str:
    """The report's section: the removed rows and their GPU-hours per stage."""
    head = (
        f"\n## Removed samples\n\n{r['removed']:,} of {r['stored']:,} stored rows "
        f"({100 * r['fraction']:.2f}%) are never trained on (near duplicates and stored content "
        "duplicates: `flowmatch catalog neardup`). What they would have cost, here and at that "
        f"fraction of {dataset_pairs:,} pairs:\n\n"
    )
    lines = ["| stage | rows | rate from | s/row | GPU-hours | cloud $ |", "|---" * 6 + "|"]
    for x in r["rows"]:
        what = "here" if x["scope"] == "here" else f"{dataset_pairs:,} pairs"
        lines.append(
            f"| {x['stage']} ({what}) | {x['rows']:,.0f} | {x['source']}, {x['device']} | "
            f"{x['seconds_per_row']:.4g} | {x['gpu_hours']:,.4g} | ${x['cloud_usd']:,.4g} |"
        )
    return head + "\n".join(lines) + "\n"
