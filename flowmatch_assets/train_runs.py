"""The training verbs' runs (``flowmatch train``, ``finetune``, ``evaluate`` and the demo):
each materializes its assets through :func:`flowmatch_assets.runs.run_assets`; a run stopped by
a signal says so in one line (:class:`TrainOutcome`)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from flowmatch_assets.runs import ORIGIN_TAG, _print_steps, instance, run_assets


def train(
    steps: int | None = None,
    run_name: str = "default",
    config_file: str | None = None,
    settings: dict | None = None,
    with_samples: bool = True,
    res=None,
    sources: list[str] | None = None,
    min_coverage: float | None = None,
) -> TrainOutcome:
    """Materialize flow_model (and samples); training itself runs as a Pipes subprocess (its
    progress lines go to this process's output); ``settings``: nested training settings over
    the YAML (``{"data": {"batch_size": 16}}``); ``sources``: only their partitions."""
    run_cfg: dict = {"run_name": run_name, "settings": dict(settings or {})}
    if sources:
        run_cfg["sources"] = list(sources)
    if min_coverage is not None:
        run_cfg["min_coverage"] = min_coverage
    if steps is not None:
        run_cfg["max_steps"] = steps
    if config_file:
        run_cfg["config_file"] = str(Path(config_file).resolve())
    ops = {"flow_model": {"config": run_cfg}}
    if with_samples:
        ops["samples"] = {"config": {"run_name": run_name}}
    tags = {ORIGIN_TAG: "train", "flowmatch/run": run_name}
    return _training_run("training", list(ops), {"ops": ops}, tags, res)


class TrainOutcome:
    """A training verb's outcome: true when the run succeeded; ``stopped``: the one line of a
    run stopped by a signal (its state saved, or why not: the CLI exits 75 with it)."""

    def __init__(self, ok: bool, stopped: str | None = None):
        self.ok, self.stopped = ok, stopped

    def __bool__(self) -> bool:
        return self.ok


def _training_run(what: str, selection: list[str], config: dict, tags: dict, res) -> TrainOutcome:
    """Run a training selection; its last line says how it ended: ``training ok (48s)``, or a
    stop's one line (training_pipes.py; the run is CANCELED), or ``training FAILED``."""
    from flowmatch_assets.defs.training_pipes import STOPPED_LINE_TAG

    t0 = time.perf_counter()
    inst = instance()
    result = run_assets(
        selection, config=config, tags=tags, res=res, dagster_instance=inst, steps=False
    )
    run = inst.get_run_by_id(result.run_id) if not result.success else None
    stopped = run.tags.get(STOPPED_LINE_TAG) if run is not None else None
    if not stopped:
        _print_steps(result)
    else:
        print(stopped, file=sys.stderr, flush=True)
        return TrainOutcome(False, stopped)
    print(f"{what} {'ok' if result.success else 'FAILED'} ({time.perf_counter() - t0:.0f}s)")
    return TrainOutcome(result.success)


def finetune(
    run_name: str,
    parent: str,
    steps: int | None = None,
    parent_step: int | None = None,
    weights: str = "ema",
    freeze: list[str] | None = None,
    sources: list[str] | None = None,
    source_weights: dict[str, int] | None = None,
    config_file: str | None = None,
    settings: dict | None = None,
    min_coverage: float = 1.0,
    with_samples: bool = True,
    res=None,
) -> TrainOutcome:
    """Materialize ``fine_tune`` (and ``samples``): a new run ``run_name`` from ``parent``'s
    weights (flowmatch_models/train/finetune.py) on ``sources`` (default every source), weighted."""
    cfg: dict = {
        "run_name": run_name,
        "parent_run": parent,
        "parent_step": parent_step,
        "weights": weights,
        "freeze": list(freeze or []),
        "sources": sources,
        "source_weights": dict(source_weights or {}),
        "settings": dict(settings or {}),
        "min_coverage": min_coverage,
        "max_steps": steps,
    }
    cfg = {k: v for k, v in cfg.items() if v is not None}  # the launchpad's defaults
    if config_file:
        cfg["config_file"] = str(Path(config_file).resolve())
    ops = {"fine_tune": {"config": cfg}}
    if with_samples:
        ops["samples"] = {"config": {"run_name": run_name}}
    tags = {ORIGIN_TAG: "finetune", "flowmatch/run": run_name, "flowmatch/parent": parent}
    return _training_run("fine-tune", list(ops), {"ops": ops}, tags, res)


def evaluate(
    run_name: str = "default",
    which: str = "latest",
    n_prompts: int = 48,
    res=None,
    sizes: list[str] | None = None,
) -> bool:
    """Materialize ``evaluation``: caption following of the run's checkpoint(s) (at ``sizes``,
    height x width; default the square)."""
    cfg: dict = {"run_name": run_name, "checkpoints": which, "n_prompts": n_prompts}
    if sizes:
        cfg["sizes"] = list(sizes)
    tags = {ORIGIN_TAG: "evaluate", "flowmatch/run": run_name}
    return run_assets(
        ["evaluation"], config={"ops": {"evaluation": {"config": cfg}}}, tags=tags, res=res
    ).success
