"""What the budget projects from: the rates and bytes measured in the catalog (images/s,
precalc pairs/s, training samples/s per device; bytes per sample per asset). The honesty
rules they follow are :mod:`.budget`'s docstring."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from flowmatch_assets.catalog import Catalog
from flowmatch_models.embeddings.kinds import EMBEDDING_ASSETS


@dataclass(frozen=True)
class Rate:
    """One measured rate: ``per_s`` samples (images, pairs, training samples) per second."""

    stage: str
    per_s: float
    device: str
    samples: int
    seconds: float
    count: int  # partitions (images, precalc) or runs (training)
    note: str = ""


def is_gpu(device: str) -> bool:
    """Whether a device label names a GPU (``cuda``, ``cuda:0``, ``cuda (NVIDIA H200)``...)."""
    d = device.lower()
    return "cuda" in d or "gpu" in d or "rocm" in d


def _images(catalog: Catalog) -> list[Rate]:
    rows = catalog.query(
        """SELECT coalesce(device, 'unknown device') AS d, sum(samples) AS n,
                  sum(seconds) AS s, count(*) AS k
           FROM materializations WHERE asset = 'images' AND seconds > 0
           GROUP BY 1 HAVING sum(samples) > 0 ORDER BY 1"""
    )
    return [
        Rate("images", r["n"] / r["s"], r["d"], int(r["n"]), float(r["s"]), int(r["k"]))
        for r in rows
    ]


def _precalc(catalog: Catalog) -> list[Rate]:
    emb = ", ".join(f"'{a}'" for a in EMBEDDING_ASSETS)
    rows = catalog.query(
        f"""WITH p AS (
              SELECT partition, coalesce(any_value(device), 'unknown device') AS d,
                     min(samples) AS n, sum(seconds) AS s, count(DISTINCT asset) AS k,
                     bool_or(coalesce(TRY_CAST(json_extract(extra, '$.random_weights')
                                               AS BOOLEAN), false)) AS zoo
              FROM materializations WHERE asset IN ({emb}) GROUP BY partition)
            SELECT d, sum(n) AS n, sum(s) AS s, count(*) AS k, bool_or(zoo) AS zoo
            FROM p WHERE k = {len(EMBEDDING_ASSETS)} AND s > 0 AND n > 0
            GROUP BY d ORDER BY d"""
    )
    kinds = catalog.query(
        f"""SELECT coalesce(device, 'unknown device') AS d, asset, sum(samples) AS n,
                  sum(seconds) AS s,
                  bool_or(coalesce(TRY_CAST(json_extract(extra, '$.random_weights')
                                            AS BOOLEAN), false)) AS zoo,
                  any_value(coalesce(json_extract_string(extra, '$.weights'), '')) AS weights
           FROM materializations WHERE asset IN ({emb}) AND seconds > 0 AND samples > 0
           GROUP BY d, asset ORDER BY d, asset"""
    )
    out = []
    for r in rows:
        note = f"sum of the {len(EMBEDDING_ASSETS)} encoders' seconds"
        if r["zoo"]:
            note += "; RANDOM-WEIGHT zoo encoders, not the real models' cost"
        per = [
            f"{k['asset']} {k['n'] / k['s']:,.1f}/s"
            + (f" ({k['weights'].split(':')[0]})" if k["weights"] else "")
            for k in kinds
            if k["d"] == r["d"]
        ]
        if per:  # each encoder's own rate: a real model's is a real cost on this device
            note += "; per encoder on " + r["d"] + ": " + ", ".join(per)
        out.append(
            Rate("precalc", r["n"] / r["s"], r["d"], int(r["n"]), float(r["s"]), int(r["k"]), note)
        )
    return out


def steady_rate(rates: list[float]) -> float | None:
    """The median of a run's logged samples/s windows, without the first (start-up, compile,
    first batches) and, from 3 windows on, the last (it often holds the final checkpoint and
    sample grid): one slow window moves a median by at most one rank. None without windows."""
    xs = [float(x) for x in rates if x is not None and float(x) > 0]
    if len(xs) >= 3:
        xs = xs[1:-1]
    elif len(xs) == 2:
        xs = xs[1:]
    if not xs:
        return None
    xs.sort()
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def logged_rates(metrics_csv: str | Path) -> list[float]:
    """The ``train/samples_per_s`` column of a Lightning CSVLogger ``metrics.csv``, in order."""
    import csv

    out = []
    with open(metrics_csv, newline="") as f:
        for r in csv.DictReader(f):
            v = r.get("train/samples_per_s")
            if v not in (None, ""):
                out.append(float(v))
    return out


def _training(catalog: Catalog) -> list[Rate]:
    rows = catalog.query(
        """SELECT coalesce(device, 'unknown device') AS d,
                  coalesce(json_extract_string(extra, '$.preset'), '?') AS preset,
                  partition, samples, seconds,
                  TRY_CAST(json_extract(extra, '$.samples_per_s') AS DOUBLE) AS sps, written_at
           FROM materializations WHERE asset = 'flow_model' ORDER BY written_at"""
    )
    latest: dict[tuple[str, str], dict] = {}
    runs: dict[tuple[str, str], int] = {}
    for r in rows:
        key = (r["d"], r["preset"])
        runs[key] = runs.get(key, 0) + 1
        latest[key] = r  # ordered by written_at: the last one wins
    out = []
    for (device, preset), r in sorted(latest.items()):
        n, s = int(r["samples"] or 0), float(r["seconds"] or 0.0)
        if r["sps"] and r["sps"] > 0:
            per_s, how = float(r["sps"]), "median samples/s over the run's steady logged windows"
        elif n > 0 and s > 0:
            per_s, how = n / s, "samples / wall s (incl. startup; too high if resumed)"
        else:
            continue
        note = f"run {r['partition']}, preset {preset}; {how}"
        out.append(Rate("training", per_s, device, n, s, runs[(device, preset)], note))
    return out


def _bytes_per_sample(catalog: Catalog) -> dict[str, dict]:
    rows = catalog.query(
        "SELECT asset, codec, samples, stored_bytes_per_sample AS b, tokens, token_row_bytes "
        "FROM compression"
    )
    return {
        r["asset"]: {
            "bytes": float(r["b"]),
            "codec": r["codec"],
            "samples": int(r["samples"]),
            "tokens": r["tokens"],
            "token_row_bytes": r["token_row_bytes"],
        }
        for r in rows
        if r["b"]
    }


def measure(catalog: Catalog) -> dict:
    """Everything measured: ``{"images"|"precalc"|"training": [Rate, ...], "bytes": {...}}``.

    One Rate per device (training: per device and preset, latest run); an empty list where a
    stage was never measured. ``bytes`` maps asset -> stored bytes per sample and codec.
    """
    return {
        "images": _images(catalog),
        "precalc": _precalc(catalog),
        "training": _training(catalog),
        "bytes": _bytes_per_sample(catalog),
    }
