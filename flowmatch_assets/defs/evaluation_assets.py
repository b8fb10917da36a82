"""What a trained run shows: its sample grid (samples) and how well it follows captions (evaluation), from its checkpoints."""

from pathlib import Path

import dagster as dg
from pydantic import Field

from flowmatch_assets import catalog
from flowmatch_assets.defs.resources import FlowmatchResource
from flowmatch_assets.defs.training_assets import GROUP, flow_model


class SamplesConfig(dg.Config):
    """Fixed prompts rendered from the latest EMA export of a run."""

    run_name: str = Field(default="default", description="Run folder under <data root>/runs/.")
    prompts: list[str] = Field(
        default_factory=lambda: [
            "a large red circle in the centre of a textured sandy background",
            "a small blue square on the left of a textured grey background",
            "a large yellow star in the centre of a textured navy background",
            "a small green triangle on the right of a textured pale pink background",
        ],
        description="Captions to render (one image each).",
    )
    steps: int = Field(default=30, description="Euler steps.")
    cfg_scale: float = Field(default=4.0, description="Classifier-free guidance scale.")
    seed: int = Field(default=0, description="Noise seed (fixed so grids compare across runs).")
    sizes: list[str] = Field(
        default_factory=lambda: ["256x256"],
        description="Sizes (height x width, multiples of 32) to render at: the square and any "
        "aspect-ratio buckets, e.g. 224x320; one grid each (<run>.png, then <run>_<size>.png).",
    )


@dg.asset(
    deps=[flow_model],
    group_name=GROUP,
    kinds={"pytorch", "png"},
    description="A grid of images for fixed prompts from the latest flow_model (EMA weights).",
)
def samples(
    context: dg.AssetExecutionContext, config: SamplesConfig, flowmatch: FlowmatchResource
) -> dg.MaterializeResult:
    from PIL import Image

    from flowmatch_models.data.buckets import label, parse_sizes
    from flowmatch_models.figures.grid import markdown_image
    from flowmatch_models.inference.export_format import prompt_max_tokens
    from flowmatch_models.inference.sample import (
        load_model,
        load_vae,
        prompt_embeddings,
        sample_grid,
    )

    export = flowmatch.layout.run_dir(config.run_name) / "pipeline"
    if not export.exists():
        raise dg.Failure(f"no trained model at {export}; materialize flow_model first")
    try:
        sizes = parse_sizes(config.sizes)
    except ValueError as e:
        raise dg.Failure(f"samples {e}") from e
    model, meta = load_model(model_dir=export)
    enc = flowmatch.encoders
    text, mask, labels = prompt_embeddings(config.prompts, enc.text, prompt_max_tokens(meta))
    vae = load_vae(enc.vae)
    md: dict = {}
    for i, size in enumerate(sizes):
        name = config.run_name + ("" if i == 0 else f"_{label(size)}")
        out = Path(flowmatch.data_root) / "samples" / f"{name}.png"
        sample_grid(
            model,
            text,
            mask,
            out,
            scaling_factor=float(meta.get("scaling_factor", 1.0)),
            vae=vae,
            steps=config.steps,
            cfg_scale=config.cfg_scale,
            seed=config.seed,
            shift=float(meta.get("flow_shift", 1.0)),
            labels=labels,
            null_text=meta.get("null_text"),
            size=None if size == (256, 256) else size,
        )
        context.log.info(f"sample grid at {label(size)}: {out}")
        key = "grid" if i == 0 else f"grid_{label(size)}"
        md[f"{key}_png"] = dg.MetadataValue.path(str(out))
        md[key] = dg.MetadataValue.md(markdown_image(Image.open(out), "samples", max_side=640))
    return dg.MaterializeResult(
        metadata={
            **md,
            "prompts": dg.MetadataValue.json(config.prompts),
            "model": dg.MetadataValue.path(str(export)),
        }
    )


class EvaluationConfig(dg.Config):
    """Caption following of a run's checkpoints on prompts from the demo caption grammar."""

    run_name: str = Field(default="default", description="Run folder under <data root>/runs/.")
    checkpoints: str = Field(
        default="latest", description="latest (last.ckpt) or all (every saved step*.ckpt)."
    )
    n_prompts: int = Field(default=48, description="Prompts drawn from the caption grammar.")
    seed: int = Field(default=0, description="Prompt and noise seed (fixed: scores compare).")
    steps: int = Field(default=20, description="Euler steps.")
    cfg_scale: float = Field(default=4.0, description="Classifier-free guidance scale.")
    fd_samples: int = Field(default=256, description="Held-out samples FD-DINOv2 draws.")
    sizes: list[str] = Field(
        default_factory=lambda: ["256x256"],
        description="Sizes (height x width) to generate at: the square and any aspect-ratio "
        "buckets, e.g. 224x320 (wide: landscape prompts) and 320x224 (tall: portrait prompts); "
        "each scored, recorded with its size and drawn (step*_<size>.png); the first is the "
        "headline (metadata, step*.png). FD-DINOv2 is at 256x256.",
    )
    wandb_project: str = Field(default="flowmatch", description="The training run's W&B project.")


@dg.asset(
    deps=[flow_model],
    group_name=GROUP,
    kinds={"pytorch", "duckdb"},
    description="Caption following (colour, shape, size, position vs chance) of a run's checkpoints, "
    "scored by a deterministic image analyser; into the catalog's `evaluations` view.",
)
def evaluation(
    context: dg.AssetExecutionContext, config: EvaluationConfig, flowmatch: FlowmatchResource
) -> dg.MaterializeResult:
    from PIL import Image

    from flowmatch_assets.reports.evaluation import (
        checkpoints,
        evaluate_checkpoint,
        evaluation_figure,
        fd_dinov2,
        heldout_set,
        log_to_wandb,
        rows_for_catalog,
        summary_line,
    )
    from flowmatch_models.data.buckets import label, parse_sizes
    from flowmatch_models.figures.grid import markdown_image

    out = flowmatch.layout.run_dir(config.run_name)
    found = checkpoints(out, config.checkpoints)
    if not found:
        raise dg.Failure(f"no checkpoint under {out / 'checkpoints'}; materialize flow_model first")
    enc = flowmatch.encoders
    md: dict = {}
    scored = []
    try:
        sizes = parse_sizes(config.sizes)
    except ValueError as e:
        raise dg.Failure(f"evaluation {e}") from e
    held = heldout_set(flowmatch.data_root, found[-1][1], config.fd_samples)  # one set for all
    for step, path in found:
        by_size = {}
        for size in sizes:
            by_size[size] = evaluate_checkpoint(
                path,
                enc.text,
                enc.vae,
                config.n_prompts,
                config.seed,
                config.steps,
                config.cfg_scale,
                size=None if size == (256, 256) else size,
            )
        result = by_size[sizes[0]]
        fd = fd_dinov2(
            path,
            flowmatch.data_root,
            enc.vae,
            enc.dino,
            held,
            config.steps,
            config.cfg_scale,
            config.seed,
        )
        result["fd_dinov2"], result["fd"] = fd["fd_dinov2"], fd
        catalog.record_evaluation(
            flowmatch.data_root,
            config.run_name,
            step,
            [
                row
                for size, r in by_size.items()
                for row in rows_for_catalog(r, config.run_name, path, label(size))
            ],
        )
        fig = evaluation_figure(result, out / "evaluation" / f"step{step:07d}.png")
        for size, r in list(by_size.items())[1:]:
            evaluation_figure(r, out / "evaluation" / f"step{step:07d}_{label(size)}.png")
        if fd["fd_dinov2"] is not None:
            catalog.record_fd(
                flowmatch.data_root,
                config.run_name,
                step,
                {
                    "checkpoint": str(path),
                    "fd_dinov2": fd["fd_dinov2"],
                    "n": fd["n"],
                    "dino": fd["dino"],
                    "dino_weights": fd["dino_weights"],
                },
            )
        fd_line = (
            f"FD-DINOv2 {fd['fd_dinov2']:.2f} on {fd['n']} held-out"
            if fd["fd_dinov2"] is not None
            else f"no FD-DINOv2 ({fd['reason']})"
        )
        if fd["dino_weights"]:
            fd_line += f" [{fd['dino_weights']}]"
        context.log.info(f"{config.run_name} step {step}: {summary_line(result)}; {fd_line}")
        scored.append((step, result, fig))
        md = {
            "step": step,
            **{f"{a}_accuracy": round(v, 3) for a, v in result["accuracy"].items()},
            **{f"{a}_chance": round(v, 3) for a, v in result["chance"].items()},
            **{
                f"{label(z)}_{a}_accuracy": round(v, 3)
                for z, r in list(by_size.items())[1:]
                for a, v in r["accuracy"].items()
            },
            "prompts": result["n"],
            "fd_dinov2": fd["fd_dinov2"],
            "fd_heldout_samples": fd["n"],
            "fd_dino_weights": fd["dino_weights"] or "real",
            "figure_png": dg.MetadataValue.path(str(fig)),
            "figure": dg.MetadataValue.md(markdown_image(Image.open(fig), "evaluation", 800)),
        }
    md["checkpoints_evaluated"] = dg.MetadataValue.json([s for s, _ in found])
    # every step's figure (its pages, _p2 ..., and size variants too): the UI shows the last
    # step's first page above; the others are reachable from here
    for step, _, fig in scored[:-1]:
        md[f"figure_step{step}_png"] = dg.MetadataValue.path(str(fig))
    steps = {f"step{s:07d}" for s, _, _ in scored}
    md["figures"] = dg.MetadataValue.json(
        sorted(str(f) for f in (out / "evaluation").glob("step*.png") if f.stem[:11] in steps)
    )
    wandb_dir = log_to_wandb(out, scored, config.wandb_project)
    if wandb_dir:
        md["wandb_dir"] = dg.MetadataValue.path(wandb_dir)
    md["vae"] = enc.vae
    return dg.MaterializeResult(metadata=md)
