"""The ``budget_report`` asset: the budget projection (flowmatch_assets.reports.budget) in the UI.

Non-partitioned and without ``deps``: it only reads the catalog, so materializing it never forces
any data asset to run; re-materialize it after new measurements to refresh the table.
(No ``from __future__ import annotations`` here: Dagster resolves the config annotation.)
"""

import math
from pathlib import Path

import dagster as dg

from flowmatch_assets.catalog import Catalog
from flowmatch_assets.defs.resources import FlowmatchResource, dagster_config
from flowmatch_assets.reports.budget import BudgetConfig, budget
from flowmatch_models.storage.atomic import atomic_write_text

BudgetSettings = dagster_config(BudgetConfig)


def rounded(v, digits: int = 4):
    """``v`` with every float rounded to ``digits`` significant digits (for UI metadata)."""
    if isinstance(v, float):
        return float(f"{v:.{digits}g}") if math.isfinite(v) else v
    if isinstance(v, dict):
        return {k: rounded(x, digits) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [rounded(x, digits) for x in v]
    return v


def report_path(data_root: str | Path) -> Path:
    """Where the markdown report is written: ``<data root>/reports/budget.md``."""
    return Path(data_root) / "reports" / "budget.md"


@dg.asset(
    group_name="reports",
    kinds={"duckdb"},
    description=(
        "Hours, cloud $, owned-box kWh/$ and disk for the whole PD12M and N gradient updates, "
        "projected from throughput measured in the catalog, beside the seeds' figures."
    ),
)
def budget_report(
    context: dg.AssetExecutionContext, config: BudgetSettings, flowmatch: FlowmatchResource
) -> dg.MaterializeResult:
    """Project from the catalog, write ``reports/budget.md`` atomically, show it as markdown."""
    md, data = budget(Catalog(flowmatch.data_root), config)
    out = report_path(flowmatch.data_root)
    atomic_write_text(out, md)
    context.log.info(md)
    measured = {s: len(data["measured"][s]) for s in ("images", "precalc", "training")}
    return dg.MaterializeResult(
        metadata={
            "report": dg.MetadataValue.md(md),
            "path": dg.MetadataValue.path(str(out)),
            "projection": dg.MetadataValue.json(rounded(data["projection"])),
            "disk": dg.MetadataValue.json(rounded(data["disk"])),
            "measured_devices": dg.MetadataValue.json(measured),
        }
    )
