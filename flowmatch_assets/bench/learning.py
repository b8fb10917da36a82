"""`flowmatch bench learning`: does the model learn to follow captions, and what do REPA and the
positional embedding do for it, on the user's own (demo) data?

For each variant of {REPA on, off} x {PE on, off} (and ``repa+pe-nostab``: SANA's qk_norm and
fp32 linear attention off) it trains the demo's DiT from scratch with the
same data, seed and schedule (``configs/tiny.yaml``, the demo's), saves a checkpoint every ``--eval-every``
steps and scores each with the caption-following evaluation (flowmatch_assets.reports.evaluation):
colour / shape / size / position accuracy of generated images against the chance level.

Needs a data root whose partitions have every training input, made with a VAE that reconstructs
the domain (``flowmatch demo`` does this with the committed demo VAE). Writes
``<out>/learning.json`` and ``<out>/learning.png`` and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import yaml

from flowmatch_assets.demo import DEMO_VAE
from flowmatch_assets.reports.evaluation import checkpoints, evaluate_checkpoint
from flowmatch_models.storage.atomic import atomic_path, atomic_write_text

REPO = Path(__file__).resolve().parents[2]
VARIANTS = {
    "repa+pe": {"flow.repa_lambda": 0.5, "model.pos_embed": True},
    "repa": {"flow.repa_lambda": 0.5, "model.pos_embed": False},
    "pe": {"flow.repa_lambda": 0.0, "model.pos_embed": True},
    "none": {"flow.repa_lambda": 0.0, "model.pos_embed": False},
    # the caption standardisation (model.text_norm, default on) off, REPA + PE on
    "repa+pe-notextnorm": {
        "flow.repa_lambda": 0.5,
        "model.pos_embed": True,
        "model.text_norm": False,
    },
    # SANA's stability settings (qk_norm, fp32 linear attention; defaults) off, REPA + PE on
    "repa+pe-nostab": {
        "flow.repa_lambda": 0.5,
        "model.pos_embed": True,
        "model.qk_norm": False,
        "model.fp32_attention": False,
    },
}
ATTRS = ("colour", "shape", "size", "position", "all_four")


def run_variant(
    name: str,
    data_root: Path,
    out: Path,
    steps: int,
    eval_every: int,
    encoders: dict[str, str],
    n_prompts: int,
    config: Path,
    extra: list[str] = (),
) -> list[dict]:
    """Train one variant from scratch and score every saved checkpoint."""
    from flowmatch_models.train.run import TrainRequest, train

    run = out / name
    sets = {
        **VARIANTS[name],
        "run.out_dir": str(run),
        "data.root": str(data_root),
        "trainer.max_steps": steps,
        "trainer.checkpoint_every": eval_every,
        "trainer.keep_ema": 0,
        "trainer.sample_every": 0,
        "logging.wandb": False,
    }
    t0 = time.perf_counter()
    overrides = [f"{k}={json.dumps(v)}" for k, v in sets.items()] + list(extra)
    train(TrainRequest(config=str(config), overrides=overrides, resume="none"))
    train_s = time.perf_counter() - t0
    curve = []
    for step, path in checkpoints(run, "all"):
        r = evaluate_checkpoint(path, encoders["text"], encoders["vae"], n_prompts)
        curve.append({"step": step, **{a: round(r["accuracy"][a], 3) for a in ATTRS}})
        print(f"  {name} step {step}: " + ", ".join(f"{a} {curve[-1][a]:.2f}" for a in ATTRS))
    curve[-1]["train_s"] = round(train_s, 1)
    return curve


def toy_position(pos_embed: bool, steps: int = 400, seed: int = 0) -> dict[str, float]:
    """Class-conditional toy in the 32x8x8 latent space whose per-class means vary by position:
    ``mse``, the mean squared distance of samples to their class mean (sigma^2 = 0.09 for
    perfect samples), and ``mean_mse``, that of the samples' average (0 for perfect samples)."""
    import torch

    from flowmatch_models.model.dit import build_model
    from flowmatch_models.model.flow import FlowMatching
    from flowmatch_models.model.loss_terms import TOTAL

    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    n_cls, sigma = 4, 0.3
    mu = torch.randn(n_cls, 32, 8, 8, generator=g)  # a different pattern at every position
    text = torch.randn(n_cls, 4, 640, generator=g)
    mask = torch.ones(n_cls, 4, dtype=torch.bool)
    model = build_model("tiny", repa=False, pos_embed=pos_embed)
    fm = FlowMatching(repa_lambda=0.0, caption_dropout=0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    for _ in range(steps):
        c = torch.randint(0, n_cls, (32,), generator=g)
        x = mu[c] + sigma * torch.randn(32, 32, 8, 8, generator=g)
        loss = fm.loss(model, x, text[c], mask[c], generator=g)[TOTAL]
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    mse, mean_mse = [], []
    for c in range(n_cls):
        z = fm.sample(
            model,
            text[c : c + 1].expand(32, -1, -1),
            mask[c : c + 1].expand(32, -1),
            steps=20,
            cfg_scale=1.0,
            generator=g,
        )
        mse.append(((z - mu[c]) ** 2).mean().item())
        mean_mse.append(((z.mean(0) - mu[c]) ** 2).mean().item())
    return {"mse": sum(mse) / n_cls, "mean_mse": sum(mean_mse) / n_cls}


def plot(results: dict[str, list[dict]], chance: dict[str, float], out_png: Path) -> Path:
    """Accuracy vs step per variant, one panel per attribute, chance dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(ATTRS), figsize=(4 * len(ATTRS), 3.2), sharex=True)
    for ax, a in zip(axes, ATTRS):
        for name, curve in results.items():
            ax.plot([c["step"] for c in curve], [c[a] for c in curve], marker="o", label=name)
        ax.axhline(chance[a], ls="--", color="grey", label="chance")
        ax.set_title(a)
        ax.set_xlabel("step")
        ax.set_ylim(0, 1)
    axes[0].set_ylabel("accuracy")
    axes[-1].legend(fontsize=8)
    fig.tight_layout()
    with atomic_path(out_png, suffix=".png") as tmp:
        fig.savefig(tmp, dpi=90, format="png")
    plt.close(fig)
    return out_png


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="flowmatch bench learning", description=__doc__)
    p.add_argument("--data-root", default=os.environ.get("FLOWMATCH_DATA_ROOT", "data"))
    p.add_argument("--config", default=str(REPO / "configs" / "tiny.yaml"))
    p.add_argument("--steps", type=int, default=None, help="default: the config's max_steps")
    p.add_argument("--eval-every", type=int, default=None, help="default: steps / 4")
    p.add_argument("--prompts", type=int, default=48)
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset")
    p.add_argument("--out", default=".bench/learning")
    p.add_argument(
        "--toy-steps", type=int, default=400, help="steps of the positional toy (0: skip it)"
    )
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="for all")
    a = p.parse_args(argv)
    toy = {}
    if a.toy_steps:
        toy = {
            "pe": {k: round(v, 4) for k, v in toy_position(True, a.toy_steps).items()},
            "no_pe": {k: round(v, 4) for k, v in toy_position(False, a.toy_steps).items()},
            "sigma2": 0.09,
        }
        print(f"positional toy (sample-to-class-mean MSE; perfect: mse 0.09, mean_mse 0): {toy}")
    from flowmatch_assets.reports import caption_eval
    from flowmatch_models.storage.layout import DataLayout

    root = Path(a.data_root).resolve()
    if not DataLayout(root).complete_partitions():
        raise SystemExit(
            f"no partition under {root} has every training input; run `flowmatch demo "
            "--train-steps 0` first (or pass --data-root)"
        )
    cfg = yaml.safe_load(Path(a.config).read_text())
    steps = a.steps or int(cfg["trainer"]["max_steps"])
    every = a.eval_every or max(1, steps // 4)
    from flowmatch_models.encoders.zoo import GEMMA_FOLDER, is_real_gemma

    # the prompts must be encoded by the text encoder the data's captions were: the demo's
    # real Gemma where it made one, else the zoo's random one (as resource_from_env decides)
    text = root / "zoo" / (GEMMA_FOLDER if is_real_gemma(root / "zoo" / GEMMA_FOLDER) else "text")
    encoders = {
        "vae": os.environ.get("FLOWMATCH_VAE", str(DEMO_VAE)),
        "text": os.environ.get("FLOWMATCH_TEXT", str(text)),
    }
    out = Path(a.out).resolve()
    results = {}
    for name in a.variants.split(","):
        if name not in VARIANTS:
            raise SystemExit(f"unknown variant {name!r}; choose from {', '.join(VARIANTS)}")
        print(f"{name}: {steps} steps, evaluating every {every} ...", flush=True)
        results[name] = run_variant(
            name, root, out, steps, every, encoders, a.prompts, Path(a.config), a.set
        )
    chance = dict(caption_eval.CHANCE)
    chance["all_four"] = chance["colour"] * chance["shape"] * chance["size"] * chance["position"]
    summary = {
        "bench": "learning",
        "steps": steps,
        "eval_every": every,
        "prompts": a.prompts,
        "toy_position_mse": toy,
        "chance": {k: round(v, 3) for k, v in chance.items() if k in ATTRS},
        "variants": results,
        "plot": str(plot(results, chance, out / "learning.png")),
    }
    atomic_write_text(out / "learning.json", json.dumps(summary, indent=1))
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
