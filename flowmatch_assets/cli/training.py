"""The training verbs: train, finetune, evaluate, export, ledger."""

from __future__ import annotations

from pathlib import Path

from flowmatch_assets import train_runs
from flowmatch_assets.cli.common import CliError, flowmatch_resource
from flowmatch_models.storage.layout import run_folder


def cmd_evaluate(
    run_name: str, checkpoints: str, prompts: int, sizes: list[str] | None = None
) -> int:
    from flowmatch_assets.catalog import Catalog, format_table

    ok = train_runs.evaluate(run_name, checkpoints, prompts, sizes=sizes)
    rows = Catalog(flowmatch_resource().data_root).query(
        "SELECT step, coalesce(size, '256x256') AS size, attribute, round(accuracy, 3) AS "
        "accuracy, round(chance, 3) AS chance, round(x_chance, 1) AS x_chance FROM evaluations "
        "WHERE run = ? ORDER BY step, size, attribute",
        [run_name],
    )
    print(format_table(rows))
    return 0 if ok else 1


def _run_dir(run: str) -> Path:
    """A run name (under <data root>/runs) or a run folder."""
    return run_folder(run, flowmatch_resource().data_root)


def cmd_export(
    run: str, out: str, checkpoint: str | None, vae: str | None, text: str | None
) -> int:
    """`flowmatch export RUN OUT`: a checkpoint's EMA weights as a SanaPipeline folder."""
    from flowmatch_models.inference.export import export_checkpoint

    ckpt = Path(checkpoint) if checkpoint else _run_dir(run) / "checkpoints" / "last.ckpt"
    if not ckpt.is_file():
        raise CliError(
            f"no checkpoint {ckpt}; train first (flowmatch train --run-name {run}) "
            "or pass --checkpoint PATH"
        )
    enc = flowmatch_resource().encoders
    folder = export_checkpoint(ckpt, out, vae, text, default_vae=enc.vae, default_text=enc.text)
    print(
        f"exported {ckpt} -> {folder}; SanaPipeline.from_pretrained({str(folder)!r}) "
        "(docs/training.md: Use the model)"
    )
    return 0


def cmd_ledger(run: str) -> int:
    """`flowmatch ledger RUN`: the catalog ledger of every checkpoint of a run (per sample)."""
    from flowmatch_assets.catalog import Catalog, format_table
    from flowmatch_assets.defs.training_assets import write_ledgers

    res = flowmatch_resource()
    name = Path(run).name
    steps = write_ledgers(res.data_root, name, _run_dir(run))
    rows = Catalog(res.data_root).query(
        "SELECT checkpoint_step, partition, samples_seen, samples_trained, partition_size, "
        "round(epochs, 2) AS epochs, first_step, last_step FROM ledger_partitions WHERE run = ? "
        "ORDER BY checkpoint_step, partition",
        [name],
    )
    print(f"ledger of {name}: {len(steps)} checkpoint(s) written")
    print(format_table(rows))
    return 0


def _settings(items: list[str]) -> dict:
    """``--set key.sub=value`` items (values read as YAML) as the nested training settings the
    launchpad's ``settings`` takes; flow_model validates them before training starts."""
    from flowmatch_models.train.config import ConfigError, settings_from_items

    try:
        return settings_from_items(items)
    except ConfigError as e:
        raise CliError(str(e)) from None


def cmd_train(
    steps: int | None,
    run_name: str,
    config: str | None,
    overrides: list[str],
    no_samples: bool,
    source: list[str],
    min_coverage: float,
) -> int:
    ok = train_runs.train(
        steps,
        run_name,
        config,
        _settings(overrides),
        not no_samples,
        sources=source or None,
        min_coverage=min_coverage,
    )
    return _exit_code(ok)


def _exit_code(outcome) -> int:
    """0 done; 75 stopped by a signal (the state saved or said: resume with the same verb,
    a scheduler requeues on it; flowmatch_models/train/signals.py EXIT_STOPPED); 1 failed."""
    from flowmatch_models.train.signals import EXIT_STOPPED

    return 0 if outcome else (EXIT_STOPPED if getattr(outcome, "stopped", None) else 1)


def cmd_finetune(
    run: str,
    parent: str,
    step: int | None,
    weights: str,
    freeze: list[str],
    source: list[str],
    weight: list[str],
    steps: int | None,
    config: str | None,
    overrides: list[str],
    min_coverage: float,
    no_samples: bool,
) -> int:
    """`flowmatch finetune RUN --from PARENT`: a new run from PARENT's weights (fine_tune)."""
    weights_by = {}
    for w in weight:
        name, sep, value = w.partition("=")
        if not sep or not value.isdigit() or int(value) < 1:
            raise CliError(f"--weight {w!r}: expected SOURCE=N with a whole number N >= 1")
        weights_by[name] = int(value)
    ok = train_runs.finetune(
        run,
        parent,
        steps,
        step,
        weights,
        freeze,
        source or None,
        weights_by,
        config,
        _settings(overrides),
        min_coverage,
        not no_samples,
    )
    return _exit_code(ok)
