"""What a run's checkpoints and faults cost, for the budget report: the checkpoints' disk
(configs/base.yaml's retention, the presets' recorded parameter counts) and one fault's lost
GPU-hours and the checkpoint writer's stall per hour. ``cfg`` is the report's
:class:`~flowmatch_assets.reports.budget.BudgetConfig` (not imported: budget imports this)."""

from __future__ import annotations

import json
from pathlib import Path

from flowmatch_assets.reports.measured import is_gpu
from flowmatch_assets.reports.param_counts import param_counts


def checkpoint_row(cfg) -> dict:
    """Checkpoints of a run of ``updates`` steps with configs/base.yaml's retention (full
    states + EMA snapshots, the arithmetic of
    :func:`flowmatch_models.train.config.checkpoint_disk_plan`), priced with the base preset's
    real parameter counts (:func:`param_counts`: no torch import when they are recorded)."""
    from flowmatch_models.train.config import checkpoint_disk_plan, load_config

    base = load_config(Path(__file__).resolve().parents[2] / "configs" / "base.yaml")
    base.trainer.max_steps = cfg.updates
    params, transformer = param_counts(base.model.preset, base.model.projector_hidden)
    plan = checkpoint_disk_plan(base, params, transformer)
    t = base.trainer
    note = (
        f"base.yaml: {plan['ema_snapshots_kept']} EMA snapshots (every {t.checkpoint_every:,}) "
        f"x {plan['ema_snapshot_bytes'] / 1e9:.2f} GB + {plan['full_states_kept']} full states "
        f"x {plan['full_state_bytes'] / 1e9:.2f} GB; last.ckpt a link"
    )
    return {
        "what": f"checkpoints (SSD, {cfg.updates:,} updates)",
        "bytes_per_sample": None,
        "gb": plan["total_bytes"] / 1e9,
        "note": note,
    }


#: ``flowmatch bench checkpoint``'s raw numbers (the stall per full state, old and new writer)
CHECKPOINT_BENCH = Path(__file__).resolve().parents[2] / "docs" / "benchmarks" / "checkpoint.json"


def fault_row(measured: dict, cfg, seed_updates_s: float) -> dict:
    """What one fault (a crash, a power cut, a preemption without warning) costs the configured
    run (configs/base.yaml): the work since the newest full state, on average half the interval
    between full states and at worst all of it, on every GPU of the run; and the training
    loop's stall per hour for writing them (:mod:`flowmatch_models.train.state_writer`, the
    stall per state measured by ``flowmatch bench checkpoint``). A signal (SIGTERM, SIGUSR1)
    loses nothing: the state is saved at the next step (docs/training.md). Without a GPU
    run measured, the rate is ``seed_updates_s`` (the seed's)."""
    from flowmatch_models.train.config import load_config

    base = load_config(Path(__file__).resolve().parents[2] / "configs" / "base.yaml")
    t = base.trainer
    gpus = int(t.devices) * int(t.num_nodes) if str(t.devices).isdigit() else 1
    gpu_rates = [r for r in measured["training"] if is_gpu(r.device)]
    if gpu_rates:
        r = max(gpu_rates, key=lambda r: r.per_s)
        ups, rate_src = r.per_s / cfg.effective_batch, f"measured on {r.device}"
    else:
        ups, rate_src = seed_updates_s, "the seed's 2x RTX 3090 rate (no GPU run measured)"
    step_s = (t.full_every / ups) if t.full_every else float("inf")
    clock_s = 60.0 * t.full_every_minutes if t.full_every_minutes else float("inf")
    interval_s = min(step_s, clock_s)
    stall = old = None
    if CHECKPOINT_BENCH.is_file():
        bench = json.loads(CHECKPOINT_BENCH.read_text())
        stall, old = bench["new"]["stall_s"], bench["old"]["stall_s"]
    per_hour = 3600.0 / interval_s if interval_s < float("inf") else 0.0
    return {
        "interval_minutes": interval_s / 60,
        "interval_from": "full_every_minutes" if clock_s <= step_s else "full_every steps",
        "updates_per_s": ups,
        "rate_source": rate_src,
        "gpus": gpus,
        "expected_lost_gpu_hours": gpus * interval_s / 2 / 3600,
        "worst_lost_gpu_hours": gpus * interval_s / 3600,
        "states_per_hour": per_hour,
        "stall_s_per_state": stall,
        "stall_s_per_hour": None if stall is None else stall * per_hour,
        "old_stall_s_per_hour": None if old is None else old * per_hour,
    }


def render_faults(f: dict) -> str:
    """The fault section of the report: lost GPU time per fault and the checkpoint stall."""
    stall = (
        f"{f['stall_s_per_hour']:.1f} s of stall per hour ({f['states_per_hour']:.1f} full "
        f"states x {f['stall_s_per_state']:.2f} s; the synchronous writer before: "
        f"{f['old_stall_s_per_hour']:.0f} s)"
        if f["stall_s_per_hour"] is not None
        else "stall per state not measured (flowmatch bench checkpoint)"
    )
    return (
        f"\n## Faults\n\nconfigs/base.yaml saves a full state every "
        f"{f['interval_minutes']:.0f} minutes ({f['interval_from']}; {f['updates_per_s']:.3g} "
        f"updates/s, {f['rate_source']}). One fault (crash, power cut, preemption without "
        f"warning) loses {f['expected_lost_gpu_hours']:.2f} GPU-hours expected, "
        f"{f['worst_lost_gpu_hours']:.2f} at worst ({f['gpus']} GPUs x half / all of the "
        f"interval); a signal (SIGTERM, SIGINT, SIGUSR1) loses nothing. Checkpoint stall: "
        f"{stall}.\n"
    )
