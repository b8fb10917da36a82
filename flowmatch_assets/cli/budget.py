"""``flowmatch budget``: the budget projection for the catalog at the configured data root."""

from __future__ import annotations

import argparse
import json
import sys

from pydantic import ValidationError

from flowmatch_assets.catalog import Catalog
from flowmatch_assets.reports.budget import BudgetConfig, budget


def build_parser() -> argparse.ArgumentParser:
    """The argument parser; defaults come from BudgetConfig."""
    d = BudgetConfig()
    p = argparse.ArgumentParser(
        prog="flowmatch budget",
        description="Time, cost, energy and disk for PD12M and N gradient updates, projected "
        "from throughput measured in the catalog (FLOWMATCH_DATA_ROOT), beside the seeds'.",
    )
    p.add_argument("--pairs", type=int, default=d.dataset_pairs, help="dataset pairs")
    p.add_argument("--updates", type=int, default=d.updates, help="gradient updates")
    p.add_argument("--batch", type=int, default=d.effective_batch, help="effective batch")
    p.add_argument("--gpu-hour-usd", type=float, default=d.gpu_hour_usd, help="cloud $/GPU-h")
    p.add_argument("--gpus", type=int, default=d.gpus, help="GPUs billed for our GPU rates")
    p.add_argument("--cpu-hour-usd", type=float, default=d.cpu_hour_usd, help="cloud $/CPU-box h")
    p.add_argument("--watts", type=float, default=d.box_watts, help="owned box watts at load")
    p.add_argument("--kwh-usd", type=float, default=d.kwh_usd, help="electricity $/kWh")
    p.add_argument("--hardware-usd", type=float, default=None, help="owned box price (payback)")
    p.add_argument(
        "--ssd-tb",
        type=float,
        default=d.ssd_tb,
        help="the SSD for embeddings + checkpoints, TB (says whether they fit)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    return p


def main(argv: list[str] | None = None) -> int:
    """Print the report (markdown or ``--json``); 0 on success, 2 on invalid targets."""
    from flowmatch_assets.defs.resources import resource_from_env

    a = build_parser().parse_args(argv)
    try:
        cfg = BudgetConfig(
            dataset_pairs=a.pairs,
            updates=a.updates,
            effective_batch=a.batch,
            gpu_hour_usd=a.gpu_hour_usd,
            gpus=a.gpus,
            cpu_hour_usd=a.cpu_hour_usd,
            box_watts=a.watts,
            kwh_usd=a.kwh_usd,
            hardware_usd=a.hardware_usd,
            ssd_tb=a.ssd_tb,
        )
        cfg.validate_targets()
    except (ValueError, ValidationError) as e:
        print(f"flowmatch budget: {e}", file=sys.stderr)
        return 2
    md, data = budget(Catalog(resource_from_env().data_root), cfg)
    print(json.dumps(data, indent=1, default=str) if a.json else md)
    return 0
