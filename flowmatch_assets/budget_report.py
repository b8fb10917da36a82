"""The seeds' cost arithmetic, automated: from throughput measured in the catalog, what the whole
PD12M and N gradient updates cost in hours, money, energy and disk.

Rates come from the ``materializations`` records (samples and seconds per asset and partition,
and the device each ran on); nothing is invented: a stage that was never measured says so.
Rates measured on a CPU are CPU rates — the table says which device each number is from.
"""

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import dagster as dg
from pydantic import Field

from flowmatch_assets.catalog import PD12M_PAIRS, Catalog, format_table
from flowmatch_assets.resources import FlowmatchResource
from flowmatch_models.atomic import atomic_write_text
from flowmatch_models.layout import EMBEDDING_ASSETS

#: The seeds' published figures (context/seed-flow-matching-on-a-budget.txt).
SEED_PRECALC_PAIRS_S = 200.0  # 2x RTX 3090
SEED_UPDATES_S = 0.39  # 2x RTX 3090, effective batch 1024
REPA_UPDATES_S = 5.4  # 8x H100
REPA_GPUS = 8
SEED_BOX_WATTS = 1000.0


class BudgetConfig(dg.Config):
    """Prices and targets for the projection."""

    dataset_pairs: int = Field(default=PD12M_PAIRS, description="Pairs to prepare (PD12M: 12.4M).")
    updates: int = Field(default=300_000, description="Gradient updates of a run (REPA: 200-400k).")
    effective_batch: int = Field(default=1024, description="Samples per gradient update.")
    gpus: int = Field(default=1, description="GPUs the measured rates are multiplied across.")
    gpu_hour_usd: float = Field(
        default=2.76, description="Cloud price per GPU-hour (seed: Lambda H100)."
    )
    cpu_hour_usd: float = Field(default=0.10, description="Cloud price per hour of a CPU box.")
    box_watts: float = Field(default=1000.0, description="Owned box power at load (seed: ~1 kW).")
    kwh_usd: float = Field(default=0.32, description="Electricity price per kWh (seed: 0.25 GBP).")


@dataclass
class Rate:
    """A measured rate of one stage."""

    per_s: float
    device: str
    samples: int
    seconds: float


def measure(catalog: Catalog) -> dict[str, Rate | None]:
    """Measured rates: images/s, precalc pairs/s (the three encoders' summed seconds, since one
    step runs them in turn), training samples/s; None where a stage has no record."""

    def one(where: str, note: str = "NULL") -> Rate | None:
        r = catalog.query(
            f"""SELECT sum(samples) AS n, sum(seconds) AS s, string_agg(DISTINCT device, ', ') AS d,
                       string_agg(DISTINCT {note}, ', ') AS note
                FROM materializations WHERE {where}"""
        )[0]
        if not r["n"] or not r["s"]:
            return None
        device = (r["d"] or "?") + (f" ({r['note']})" if r["note"] else "")
        return Rate(r["n"] / r["s"], device, int(r["n"]), float(r["s"]))

    emb = ", ".join(f"'{a}'" for a in EMBEDDING_ASSETS)
    pre = catalog.query(
        f"""SELECT partition, min(samples) AS n, sum(seconds) AS s,
                   string_agg(DISTINCT device, ', ') AS d, count(*) AS k,
                   bool_or(json_extract(extra, '$.random_weights')::BOOLEAN) AS zoo
            FROM materializations WHERE asset IN ({emb}) GROUP BY partition"""
    )
    full = [r for r in pre if r["k"] == len(EMBEDDING_ASSETS) and r["s"]]
    precalc = None
    if full:
        n, s = sum(r["n"] for r in full), sum(r["s"] for r in full)
        device = ", ".join(sorted({r["d"] or "?" for r in full}))
        if any(r["zoo"] for r in full):
            device += " (tiny random zoo encoders, not the real models' FLOPs)"
        precalc = Rate(n / s, device, n, s)
    return {
        "images": one("asset = 'images_256'"),
        "precalc": precalc,
        "training": one(
            "asset = 'flow_model'", "'preset ' || json_extract_string(extra, '$.preset')"
        ),
    }


def _gpu(device: str) -> bool:
    return "cuda" in device.lower() or "gpu" in device.lower()


def _cost_row(stage: str, source: str, rate_txt: str, device: str, hours: float | None,
              gpus: int, cfg: BudgetConfig) -> dict:  # fmt: skip
    if hours is None:
        return {"stage": stage, "source": source, "rate": rate_txt, "device": device,
                "hours": None, "cloud_usd": None, "box_kwh": None, "box_usd": None}  # fmt: skip
    price = cfg.gpu_hour_usd * gpus if _gpu(device) else cfg.cpu_hour_usd
    kwh = hours * cfg.box_watts / 1000
    return {
        "stage": stage,
        "source": source,
        "rate": rate_txt,
        "device": device,
        "hours": hours,
        "cloud_usd": hours * price,
        "box_kwh": kwh,
        "box_usd": kwh * cfg.kwh_usd,
    }


def project(measured: dict[str, Rate | None], cfg: BudgetConfig) -> list[dict]:
    """One row per stage: ours (measured) and the seeds' references, for the same targets."""
    P, U, B, G = cfg.dataset_pairs, cfg.updates, cfg.effective_batch, cfg.gpus
    rows = []
    for stage, key, unit in (
        (f"images_256: {P:,} images", "images", "images/s"),
        (f"precalc: {P:,} pairs", "precalc", "pairs/s"),
    ):
        r = measured[key]
        if r is None:
            rows.append(_cost_row(stage, "ours", "not measured yet", "-", None, G, cfg))
        else:
            rate = r.per_s * G
            rows.append(
                _cost_row(stage, "ours", f"{rate:,.1f} {unit}", r.device, P / rate / 3600, G, cfg)
            )
    stage = f"training: {U:,} updates x {B}"
    r = measured["training"]
    if r is None:
        rows.append(_cost_row(stage, "ours", "not measured yet", "-", None, G, cfg))
    else:
        ups = r.per_s * G / B
        rows.append(
            _cost_row(stage, "ours", f"{ups:.4g} updates/s", r.device, U / ups / 3600, G, cfg)
        )
    seed_box = BudgetConfig(**{**cfg.model_dump(), "box_watts": SEED_BOX_WATTS})
    rows.append(_cost_row(f"precalc: {P:,} pairs", "seed (2x RTX 3090)", f"{SEED_PRECALC_PAIRS_S:g} pairs/s",
                          "cuda (2x RTX 3090)", P / SEED_PRECALC_PAIRS_S / 3600, 2, seed_box))  # fmt: skip
    rows.append(_cost_row(stage, "seed (2x RTX 3090)", f"{SEED_UPDATES_S:g} updates/s",
                          "cuda (2x RTX 3090)", U / SEED_UPDATES_S / 3600, 2, seed_box))  # fmt: skip
    repa = _cost_row(stage, "REPA paper (8x H100)", f"{REPA_UPDATES_S:g} updates/s",
                     "cuda (8x H100)", U / REPA_UPDATES_S / 3600, REPA_GPUS, cfg)  # fmt: skip
    repa["box_kwh"] = repa["box_usd"] = None  # not an owned box
    rows.append(repa)
    return rows


def disk(catalog: Catalog, cfg: BudgetConfig) -> list[dict]:
    """Projected disk for the whole dataset from measured stored bytes per sample."""
    rows = catalog.query("SELECT asset, stored_bytes_per_sample FROM compression")
    per = {r["asset"]: r["stored_bytes_per_sample"] for r in rows}
    out = []
    for label, assets in (
        ("images (HDD)", ["images_256"]),
        ("embeddings (SSD)", list(EMBEDDING_ASSETS)),
    ):
        have = [a for a in assets if per.get(a)]
        if len(have) < len(assets):
            out.append({"what": label, "bytes_per_sample": None, "projected_gb": None,
                        "note": f"not measured: {', '.join(sorted(set(assets) - set(have)))}"})  # fmt: skip
            continue
        b = sum(per[a] for a in assets)
        out.append(
            {
                "what": label,
                "bytes_per_sample": b,
                "projected_gb": b * cfg.dataset_pairs / 1e9,
                "note": "",
            }
        )
    out.append({"what": "seed's embeddings (reference)", "bytes_per_sample": 700e9 / 12.4e6,
                "projected_gb": 700.0, "note": "xz per tensor, padded text"})  # fmt: skip
    return out


def render_markdown(rows: list[dict], disk_rows: list[dict], cfg: BudgetConfig) -> str:
    def money(v):
        return None if v is None else f"${v:,.0f}"

    table = [
        {
            "stage": r["stage"],
            "source": r["source"],
            "rate": r["rate"],
            "measured on": r["device"],
            "hours": None if r["hours"] is None else f"{r['hours']:,.1f}",
            "cloud": money(r["cloud_usd"]),
            "owned box kWh": None if r["box_kwh"] is None else f"{r['box_kwh']:,.0f}",
            "owned box": money(r["box_usd"]),
        }
        for r in rows
    ]
    dtable = [
        {
            "storage": d["what"],
            "bytes/sample": None
            if d["bytes_per_sample"] is None
            else f"{d['bytes_per_sample']:,.0f}",
            f"for {cfg.dataset_pairs:,} pairs": None
            if d["projected_gb"] is None
            else f"{d['projected_gb']:,.0f} GB",
            "note": d["note"],
        }
        for d in disk_rows
    ]
    return (
        f"# Budget: PD12M ({cfg.dataset_pairs:,} pairs) and {cfg.updates:,} updates at batch "
        f"{cfg.effective_batch}\n\n"
        f"Prices: ${cfg.gpu_hour_usd}/GPU-hour x {cfg.gpus} GPU(s) in a cloud (${cfg.cpu_hour_usd}/hour "
        f"for CPU-measured rates); owned box {cfg.box_watts:g} W at ${cfg.kwh_usd}/kWh. Our rates are "
        "measured by this pipeline on the device named (a CPU rate is not a GPU rate).\n\n"
        + format_table(table)
        + "\n\n## Disk\n\n"
        + format_table(dtable)
        + "\n"
    )


def budget(data_root: str | Path, cfg: BudgetConfig) -> tuple[str, dict]:
    cat = Catalog(data_root)
    measured = measure(cat)
    rows, drows = project(measured, cfg), disk(cat, cfg)
    md = render_markdown(rows, drows, cfg)
    data = {
        "measured": {k: (None if v is None else vars(v)) for k, v in measured.items()},
        "projection": rows,
        "disk": drows,
        "config": cfg.model_dump(),
    }
    return md, data


@dg.asset(
    group_name="reports",
    kinds={"duckdb"},
    description="Time, money, energy and disk for the whole PD12M and N updates, from measured throughput.",
)
def budget_report(
    context: dg.AssetExecutionContext, config: BudgetConfig, flowmatch: FlowmatchResource
) -> dg.MaterializeResult:
    md, data = budget(flowmatch.data_root, config)
    out = Path(flowmatch.data_root) / "reports" / "budget.md"
    atomic_write_text(out, md)
    context.log.info(md)
    return dg.MaterializeResult(
        metadata={
            "report": dg.MetadataValue.md(md),
            "path": dg.MetadataValue.path(str(out)),
            "projection": dg.MetadataValue.json(data["projection"]),
        }  # fmt: skip
    )


def main(argv: list[str] | None = None) -> int:
    """`flowmatch budget`: the projection for the catalog at FLOWMATCH_DATA_ROOT."""
    from flowmatch_assets.resources import resource_from_env

    d = BudgetConfig()
    p = argparse.ArgumentParser(prog="flowmatch budget", description=main.__doc__)
    p.add_argument("--pairs", type=int, default=d.dataset_pairs)
    p.add_argument("--updates", type=int, default=d.updates)
    p.add_argument("--batch", type=int, default=d.effective_batch)
    p.add_argument("--gpus", type=int, default=d.gpus)
    p.add_argument("--gpu-hour-usd", type=float, default=d.gpu_hour_usd)
    p.add_argument("--cpu-hour-usd", type=float, default=d.cpu_hour_usd)
    p.add_argument("--watts", type=float, default=d.box_watts)
    p.add_argument("--kwh-usd", type=float, default=d.kwh_usd)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    cfg = BudgetConfig(
        dataset_pairs=a.pairs, updates=a.updates, effective_batch=a.batch, gpus=a.gpus,
        gpu_hour_usd=a.gpu_hour_usd, cpu_hour_usd=a.cpu_hour_usd, box_watts=a.watts, kwh_usd=a.kwh_usd,
    )  # fmt: skip
    md, data = budget(resource_from_env().data_root, cfg)
    print(json.dumps(data, default=str, indent=1) if a.json else md)
    return 0
