"""`flowmatch bench finetune`: does fine-tuning the demo's run learn a new attribute in fewer
steps than training from scratch, and does it keep the old ones?

The second procedural dataset (:func:`flowmatch_assets.demo.dataset.write_shapes2`: the demo's
caption grammar with a shape the demo never saw, ``cross``, in half of its images) is written as
an image folder with ``.txt`` captions, added as the source ``shapes2`` of the demo's data root,
registered and materialized through the pipeline (``images`` and the three embeddings, with
the demo's encoders). Then, with the same config (``configs/tiny.yaml``), data, seed and
schedule, on the ``shapes2`` partitions only:

- ``scratch``: a new model;
- ``finetune``: ``init.from_run`` the demo's run (its EMA weights at its last step);
- ``finetune-mix`` (``--variants``): the same on ``shapes2`` and the demo's PD12M-format
  partitions, ``shapes2`` weighted 2 (``data.source_weights``).

Every ``--eval-every`` steps each checkpoint is scored twice with the caption-following
evaluation (flowmatch_assets.reports.evaluation), the analyser knowing all seven shapes: on
``--prompts`` prompts of the new shape (the new attribute: the fraction drawn as a cross;
chance 1/7) and on the demo's own prompts (colour, shape, size, position: do they collapse?).
The parent's own checkpoint is step 0 of the fine-tunes. Needs a data root where ``flowmatch
demo`` trained its run (``--data-root``, default ``$FLOWMATCH_DATA_ROOT`` or ``data``) and the
Dagster instance at ``DAGSTER_HOME``. Writes ``<out>/finetune.json`` and ``finetune.png`` and ends
with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from flowmatch_assets.demo.dataset import NEW_SHAPES, SHAPES, write_shapes2
from flowmatch_assets.reports.evaluation import checkpoints, evaluate_checkpoint
from flowmatch_models.storage.atomic import atomic_path, atomic_write_text
from flowmatch_models.storage.layout import DataLayout

REPO = Path(__file__).resolve().parents[2]
SOURCE = "shapes2"
OLD = ("colour", "shape", "size", "position")
VARIANTS = {
    "scratch": {"init": False, "sources": [SOURCE], "weights": {}},
    "finetune": {"init": True, "sources": [SOURCE], "weights": {}},
    "finetune-mix": {"init": True, "sources": [SOURCE, "pd12m"], "weights": {SOURCE: 2}},
}


def prepare(root: Path, images: int) -> dict:
    """``shapes2`` written, added as a folder source of ``root``, registered and materialized
    (``flowmatch sources add``, ``partitions register --source``, ``materialize --source``)."""
    from flowmatch_assets import runs
    from flowmatch_assets.defs.resources import resource_from_env
    from flowmatch_assets.ingest.sources import SourceConfig, sources_file, write_source

    info = write_shapes2(root / SOURCE, images)
    env = {**os.environ, "FLOWMATCH_DATA_ROOT": str(root)}
    path = sources_file(root, env)
    write_source(path, SOURCE, SourceConfig(kind="folder", location=info["dest"], shard_size=100))
    res = resource_from_env(env)
    t0 = time.perf_counter()
    ok = runs.materialize(sources=[SOURCE], res=res, missing_only=True)
    if not all(ok.values()):
        raise SystemExit(f"materializing {SOURCE} failed: {ok}")
    return {
        **info,
        "materialize_s": round(time.perf_counter() - t0, 1),
        "encoders": {"vae": res.encoders.vae, "text": res.encoders.text},
    }


def score(path: Path, encoders: dict, n_prompts: int) -> dict:
    """The new attribute (prompts of the new shape) and the old ones (the demo's prompts)."""
    all_shapes = SHAPES + NEW_SHAPES
    new = evaluate_checkpoint(
        path,
        encoders["text"],
        encoders["vae"],
        n_prompts,
        prompt_shapes=NEW_SHAPES,
        analyser_shapes=all_shapes,
    )
    old = evaluate_checkpoint(
        path,
        encoders["text"],
        encoders["vae"],
        n_prompts,
        prompt_shapes=SHAPES,
        analyser_shapes=all_shapes,
    )
    return {
        "new_shape": round(new["accuracy"]["shape"], 3),
        "new_all_four": round(new["accuracy"]["all_four"], 3),
        **{f"old_{a}": round(old["accuracy"][a], 3) for a in OLD},
    }


def run_variant(
    name: str,
    root: Path,
    out: Path,
    parent: Path,
    steps: int,
    every: int,
    encoders: dict,
    n_prompts: int,
    config: Path,
    extra: list[str],
) -> list[dict]:
    """Train one variant and score each checkpoint (the parent's as step 0 of a fine-tune)."""
    from flowmatch_models.train.run import TrainRequest, train

    v = VARIANTS[name]
    run = out / name
    sets = {
        "run.out_dir": str(run),
        "data.root": str(root),
        "trainer.max_steps": steps,
        "trainer.checkpoint_every": every,
        "trainer.keep_ema": 0,
        "trainer.sample_every": 0,
        "logging.wandb": False,
        "data.sources": v["sources"],
        "data.source_weights": v["weights"],
        "encoders.vae": encoders["vae"],
        "encoders.text": encoders["text"],
    }
    if v["init"]:
        sets["init.from_run"] = str(parent)
    overrides = [f"{k}={json.dumps(x)}" for k, x in sets.items()] + list(extra)
    t0 = time.perf_counter()
    train(TrainRequest(config=str(config), overrides=overrides, resume="none"))
    train_s = time.perf_counter() - t0
    curve = []
    if v["init"]:
        (_, last), *_ = reversed(checkpoints(parent, "latest"))
        curve.append({"step": 0, **score(last, encoders, n_prompts)})
    for step, path in checkpoints(run, "all"):
        curve.append({"step": step, **score(path, encoders, n_prompts)})
        print(
            f"  {name} step {step}: "
            + ", ".join(f"{k} {x:.2f}" for k, x in curve[-1].items() if k != "step"),
            flush=True,
        )
    curve[-1]["train_s"] = round(train_s, 1)
    return curve


def steps_to(curve: list[dict], key: str, floor: float) -> int | None:
    """The first evaluated step at which ``key`` reaches ``floor`` (None: never)."""
    return next((c["step"] for c in curve if c["step"] > 0 and c[key] >= floor), None)


def plot(results: dict[str, list[dict]], floor: float, out_png: Path) -> Path:
    """The new shape's accuracy and the old attributes' mean vs step, per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    for name, curve in results.items():
        x = [c["step"] for c in curve]
        axes[0].plot(x, [c["new_shape"] for c in curve], marker="o", label=name)
        axes[1].plot(
            x, [sum(c[f"old_{a}"] for a in OLD) / len(OLD) for c in curve], marker="o", label=name
        )
    axes[0].axhline(floor, ls=":", color="k", label=f"floor {floor}")
    axes[0].axhline(1 / 7, ls="--", color="grey", label="chance")
    axes[0].set_title("new attribute: prompts of a cross drawn as one")
    axes[1].set_title("old attributes: mean of colour/shape/size/position")
    for ax in axes:
        ax.set_xlabel("step")
        ax.set_ylim(0, 1)
    axes[0].set_ylabel("accuracy")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    with atomic_path(out_png, suffix=".png") as tmp:
        fig.savefig(tmp, dpi=90, format="png")
    plt.close(fig)
    return out_png


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        prog="flowmatch bench finetune",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--data-root", default=os.environ.get("FLOWMATCH_DATA_ROOT", "data"))
    p.add_argument("--parent", default="demo", help="the run to fine-tune (under runs/)")
    p.add_argument("--config", default=str(REPO / "configs" / "tiny.yaml"))
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--prompts", type=int, default=48)
    p.add_argument("--images", type=int, default=192, help="shapes2 images")
    p.add_argument("--floor", type=float, default=0.4, help="the new attribute's floor")
    p.add_argument("--variants", default="finetune,scratch", help="comma-separated subset")
    p.add_argument("--out", default=".bench/finetune")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="for all")
    a = p.parse_args(argv)
    root = Path(a.data_root).resolve()
    parent = DataLayout(root).run_dir(a.parent)
    if not (parent / "checkpoints" / "last.ckpt").is_file():
        raise SystemExit(f"no trained run {parent}; run `flowmatch demo` first (or --parent)")
    data = prepare(root, a.images)
    print(
        f"{SOURCE}: {data['images']} images in {data['dest']}, materialized in "
        f"{data['materialize_s']} s",
        flush=True,
    )
    out = Path(a.out).resolve()
    results = {}
    for name in a.variants.split(","):
        if name not in VARIANTS:
            raise SystemExit(f"unknown variant {name!r}; choose from {', '.join(VARIANTS)}")
        print(f"{name}: {a.steps} steps, evaluating every {a.eval_every} ...", flush=True)
        results[name] = run_variant(
            name,
            root,
            out,
            parent,
            a.steps,
            a.eval_every,
            data["encoders"],
            a.prompts,
            Path(a.config),
            a.set,
        )
    summary = {
        "bench": "finetune",
        "parent": str(parent),
        "steps": a.steps,
        "eval_every": a.eval_every,
        "prompts": a.prompts,
        "floor": a.floor,
        "chance_new_shape": round(1 / len(SHAPES + NEW_SHAPES), 3),
        "steps_to_floor": {n: steps_to(c, "new_shape", a.floor) for n, c in results.items()},
        "final": {
            n: {k: x for k, x in c[-1].items() if k != "train_s"} for n, c in results.items()
        },
        "variants": results,
        "plot": str(plot(results, a.floor, out / "finetune.png")),
    }
    atomic_write_text(out / "finetune.json", json.dumps(summary, indent=1))
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
