"""Caption following of a trained model on the demo domain, scored against chance.

``evaluate_checkpoint`` draws prompts from the procedural sample's caption grammar
(:func:`flowmatch_assets.reports.caption_eval.prompts`), generates one image per prompt with the model's
EMA weights (fixed noise, Euler + CFG with the stored null caption), decodes them with the VAE
and scores them with the deterministic analyser (:func:`flowmatch_assets.reports.caption_eval.score`):
per attribute (colour, shape, size, position, background) the fraction right and the chance
level. ``evaluation_figure`` draws the images beside their prompts and the analyser's reading.

Only meaningful with a VAE that reconstructs the demo domain (the committed demo VAE, trained on
the synthetic sample) or a real DC-AE on real data; with the random zoo VAE scores sit at chance.
No Dagster here: the ``evaluation`` asset and ``flowmatch bench learning`` call these.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from flowmatch_assets.reports import caption_eval
from flowmatch_models.figures.grid import save_png

ATTRIBUTES = ("colour", "shape", "size", "position")  # what captions ask of the object


def checkpoints(run_dir: str | Path, which: str = "latest") -> list[tuple[int, Path]]:
    """``(step, path)`` of a run's checkpoints: ``latest`` (last.ckpt) or ``all`` (every
    saved step: its EMA-only snapshot ``stepN-ema.ckpt``, else its full ``stepN.ckpt``; plus
    last.ckpt if it is newer), ordered by step."""
    ckpt_dir = Path(run_dir) / "checkpoints"
    last = ckpt_dir / "last.ckpt"
    found: dict[int, Path] = {}
    if which == "all":
        for p in sorted(ckpt_dir.glob("step*.ckpt")):
            m = re.fullmatch(r"step(\d+)(-ema)?\.ckpt", p.name)
            if m and (m.group(2) or int(m.group(1)) not in found):
                found[int(m.group(1))] = p  # the EMA snapshot: a quarter of the bytes to read
    elif which != "latest":
        raise ValueError(f"checkpoints {which!r}: use 'latest' or 'all'")
    if last.is_file():
        found.setdefault(_last_step(ckpt_dir), last)
    return sorted(found.items())


def _last_step(ckpt_dir: Path) -> int:
    """The step ``last.ckpt`` holds: the ``stepN.ckpt`` it is a link to, else its
    ``global_step`` (memory-mapped: no tensor is read). Never ``trained_counts.json``: an EMA
    snapshot or a save still in flight writes it ahead of ``last.ckpt``."""
    last = ckpt_dir / "last.ckpt"
    for p in ckpt_dir.glob("step*.ckpt"):
        m = re.fullmatch(r"step(\d+)\.ckpt", p.name)
        if m and os.path.samefile(p, last):
            return int(m.group(1))
    import torch

    return int(torch.load(last, map_location="cpu", weights_only=True, mmap=True)["global_step"])


def evaluate_checkpoint(
    checkpoint: str | Path,
    text_encoder: str,
    vae: str,
    n_prompts: int = 48,
    seed: int = 0,
    steps: int = 20,
    cfg_scale: float = 4.0,
    prompt_shapes: tuple[str, ...] = caption_eval.SHAPES,
    analyser_shapes: tuple[str, ...] = caption_eval.SHAPES,
    size: tuple[int, int] | None = None,
) -> dict:
    """Score the EMA model of ``checkpoint`` on ``n_prompts`` grammar prompts (see module doc)
    whose shapes are ``prompt_shapes``, read back with templates of ``analyser_shapes`` (the
    second dataset's fine-tune: ``NEW_SHAPES``, and the demo's six plus ``cross``). ``size``
    ``(height, width)``: generate at that aspect-ratio bucket (flowmatch_models/data/buckets.py)
    instead of the square; a wide size takes landscape prompts only (left / centre / right), a
    tall one portrait prompts (top / centre / bottom).

    Returns :func:`caption_eval.score`'s dict plus ``images`` (uint8 ``[N, H, W, 3]``),
    ``step`` and ``settings``.
    """
    import torch

    from flowmatch_models.inference.export_format import prompt_max_tokens
    from flowmatch_models.inference.sample import generate, load_model

    model, meta = load_model(checkpoint=checkpoint)
    orientation = None
    if size is not None and size[0] != size[1]:
        orientation = "landscape" if size[1] > size[0] else "portrait"
    prompts = caption_eval.prompts(n_prompts, seed, prompt_shapes, orientation)
    text, mask = _prompt_embeddings(tuple(prompts), text_encoder, prompt_max_tokens(meta))
    with torch.inference_mode():
        images = generate(
            model,
            text,
            mask,
            float(meta["scaling_factor"]),
            _vae(vae),
            steps,
            cfg_scale,
            seed,
            float(meta.get("flow_shift", 1.0)),
            meta.get("null_text"),
            size,
        )
    result = caption_eval.score(prompts, images, shapes=analyser_shapes)
    # colour, shape, size and position all right, as one more attribute (chance: the product)
    result["accuracy"]["all_four"] = result["all_correct"]
    result["chance"]["all_four"] = float(np.prod([result["chance"][a] for a in ATTRIBUTES]))
    result["images"] = images
    result["step"] = int(meta.get("step", -1))
    result["settings"] = {
        "n_prompts": n_prompts,
        "seed": seed,
        "steps": steps,
        "cfg": cfg_scale,
        "size": list(images.shape[1:3]),
    }
    return result


@functools.lru_cache(maxsize=2)
def _prompt_embeddings(prompts: tuple[str, ...], text_encoder: str, max_tokens: int):
    """The prompts' text embeddings, encoded once per process for all checkpoints."""
    from flowmatch_models.inference.sample import prompt_embeddings

    text, mask, _ = prompt_embeddings(list(prompts), text_encoder, max_tokens)
    return text, mask


@functools.lru_cache(maxsize=1)
def _vae(path: str):
    """The decoder, loaded once per process for all checkpoints."""
    from flowmatch_models.inference.sample import load_vae

    return load_vae(path)


def summary_line(result: dict) -> str:
    """``colour 0.81 (chance 0.12), shape ...`` for logs and the demo."""
    acc, chance = result["accuracy"], result["chance"]
    parts = [f"{a} {acc[a]:.2f} (chance {chance[a]:.2f})" for a in ATTRIBUTES]
    return ", ".join(parts) + f"; all four right {result['all_correct']:.2f}"


#: One page of the evaluation figure: COLS x ROWS generated images of CELL px with their labels
#: in FONT_PX type. A page is at most ~800 px a side, the size the Dagster UI shows an image at
#: (the evaluation asset's ``figure``, shrunk to 800 px), so the labels are read there at 1:1.
COLS, ROWS, CELL, FONT_PX = 6, 4, 108, 13
_RIGHT, _WRONG, _TEXT = (0, 120, 0), (200, 0, 0), (0, 0, 0)


def _wrap(words: list[tuple[str, tuple]], font, width: float) -> list[list[tuple[str, tuple]]]:
    """``(word, colour)`` pairs wrapped into lines of at most ``width`` px."""
    lines: list[list[tuple[str, tuple]]] = [[]]
    used = 0.0
    space = font.getlength(" ")
    for word, colour in words:
        w = font.getlength(word)
        if lines[-1] and used + space + w > width:
            lines.append([])
            used = 0.0
        used += (space if lines[-1] else 0) + w
        lines[-1].append((word, colour))
    return lines


def _cell_lines(item: dict, font, width: float) -> list[list[tuple[str, tuple]]]:
    """A prompt's labels: what it asked (size colour shape; position, background) in black,
    then what the analyser read in the same order, green where right, red where wrong (``?``:
    nothing read)."""
    t = item["truth"]
    read = [
        (
            "?" if item["pred"][a] == caption_eval.UNKNOWN else str(item["pred"][a]),
            _RIGHT if item["correct"][a] else _WRONG,
        )
        for a in ("size", "colour", "shape", "position")
    ]
    return [
        *_wrap(
            [(w, _TEXT) for w in f"{t['size']} {t['colour']} {t['shape']}".split()], font, width
        ),
        *_wrap([(w, _TEXT) for w in f"{t['position']}, {t['background']}".split()], font, width),
        *_wrap([("seen:", _TEXT), *read], font, width),
    ]


def evaluation_figure(
    result: dict, out: str | Path, cols: int = COLS, rows: int = ROWS, cell: int = CELL
) -> Path:
    """The generated images with their prompts and what the analyser read (each attribute
    green where right, red where wrong), ``cols`` x ``rows`` a page: the first page at ``out``
    (the one the UI shows), the next ones beside it as ``<stem>_p2.png``, ... Returns ``out``."""
    items, images = result["items"], result["images"]
    per_page = cols * rows
    pages = max(1, -(-len(items) // per_page))
    out = Path(out)
    for page in range(pages):
        lo, hi = page * per_page, min(len(items), (page + 1) * per_page)
        path = out if page == 0 else out.with_name(f"{out.stem}_p{page + 1}{out.suffix}")
        title = f"step {result.get('step')}: prompts {lo + 1}-{hi} of {len(items)}"
        if pages > 1:
            title += (
                f" (page {page + 1} of {pages}: {out.stem}{'' if page == 0 else f'_p{page + 1}'})"
            )
        _figure_page(title, summary_line(result), items[lo:hi], images[lo:hi], path, cols, cell)
    return out


def _figure_page(
    title: str, summary: str, items: list, images: list, out: Path, cols: int, cell: int
) -> Path:
    font = ImageFont.load_default(size=FONT_PX)
    line_h, gap = FONT_PX + 3, 8
    col_w = cell + 16
    w = cols * (col_w + gap) + gap
    header = [[(title, _TEXT)], *_wrap([(x, _TEXT) for x in summary.split()], font, w - 2 * gap)]
    labels = [_cell_lines(it, font, col_w) for it in items]
    n_rows = (len(items) + cols - 1) // cols
    row_h = [
        cell + 4 + line_h * max(len(lab) for lab in labels[r * cols : (r + 1) * cols]) + gap
        for r in range(n_rows)
    ]
    top = gap + line_h * len(header) + gap
    fig = Image.new("RGB", (w, top + sum(row_h)), (255, 255, 255))
    d = ImageDraw.Draw(fig)
    _draw_lines(d, header, (gap, gap), font, line_h)
    for i, (lab, img) in enumerate(zip(labels, images)):
        r, c = divmod(i, cols)
        x, y = gap + c * (col_w + gap), top + sum(row_h[:r])
        im = Image.fromarray(np.asarray(img))
        scale = cell / max(im.size)  # a wide or tall image keeps its shape in its cell
        im = im.resize((round(im.width * scale), round(im.height * scale)), Image.LANCZOS)
        fig.paste(im, (x + (col_w - im.width) // 2, y + (cell - im.height) // 2))
        _draw_lines(d, lab, (x, y + cell + 4), font, line_h)
    return save_png(fig, out)


def _draw_lines(d, lines, at: tuple[int, int], font, line_h: int) -> None:
    x0, y = at
    space = font.getlength(" ")
    for line in lines:
        x = x0
        for word, colour in line:
            d.text((x, y), word, fill=colour, font=font)
            x += font.getlength(word) + space
        y += line_h


def rows_for_catalog(result: dict, run: str, checkpoint: str, size: str = "256x256") -> list[dict]:
    """One catalog row per attribute (see the ``evaluations`` view) of images generated at
    ``size`` (height x width)."""
    return [
        {
            "run": run,
            "step": int(result["step"]),
            "checkpoint": str(checkpoint),
            "size": size,
            "attribute": a,
            "accuracy": float(acc),
            "chance": float(result["chance"][a]),
            "n": int(result["n"]),
            "unknown": int(result["unknown"].get(a, 0)),
        }
        for a, acc in result["accuracy"].items()
    ]


def log_to_wandb(run_dir: str | Path, scored: list[tuple[int, dict, Path]], project: str) -> str:
    """Log evaluation scores (and figures) into the training run's wandb run (same id, from
    ``<run>/wandb_run_id.txt``), against their own x-axis ``eval/step`` so that checkpoints
    scored after training still land (wandb drops history below the run's current step).
    Offline unless ``WANDB_API_KEY`` is set, like training. Returns the local run folder, or ""
    when the run logged no wandb (no id file)."""
    import os

    id_file = Path(run_dir) / "wandb_run_id.txt"
    if not id_file.is_file():
        return ""
    import wandb

    run = wandb.init(
        project=project,
        id=id_file.read_text().strip(),
        resume="allow",
        dir=str(run_dir),
        mode="online" if os.environ.get("WANDB_API_KEY") else "offline",
        settings=wandb.Settings(silent=True),
    )
    run.define_metric("eval/step")
    run.define_metric("eval/*", step_metric="eval/step")
    for step, result, figure in scored:
        row = {f"eval/{a}": float(v) for a, v in result["accuracy"].items()}
        if result.get("fd_dinov2") is not None:
            row["eval/fd_dinov2"] = float(result["fd_dinov2"])
        row.update({f"eval/{a}_chance": float(v) for a, v in result["chance"].items()})
        row["eval/step"] = int(step)
        row["eval/figure"] = wandb.Image(str(figure), caption=f"step {step}")
        run.log(row)
    local = str(Path(run.dir).parent)
    run.finish()
    return local


# --------------------------------------------------------------------------------------------
# FD-DINOv2 on the held-out split
# --------------------------------------------------------------------------------------------


def frechet_distance(a: np.ndarray, b: np.ndarray) -> float:
    """Frechet distance between Gaussians fitted to feature rows ``a [N, D]`` and ``b [M, D]``:
    ``|mu_a - mu_b|^2 + tr(S_a) + tr(S_b) - 2 tr((S_a^1/2 S_b S_a^1/2)^1/2)`` in float64, the
    matrix roots by symmetric eigendecomposition (exact for the PSD covariances; no scipy)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    mu = a.mean(0) - b.mean(0)
    sa, sb = np.atleast_2d(np.cov(a, rowvar=False)), np.atleast_2d(np.cov(b, rowvar=False))
    w, v = np.linalg.eigh(sa)
    root = (v * np.sqrt(np.clip(w, 0, None))) @ v.T
    m = root @ sb @ root
    tr_sqrt = np.sqrt(np.clip(np.linalg.eigvalsh((m + m.T) / 2), 0, None)).sum()
    return float(mu @ mu + np.trace(sa) + np.trace(sb) - 2 * tr_sqrt)


def heldout_set(data_root: str | Path, checkpoint: str | Path, max_samples: int = 256) -> dict:
    """The held-out samples of the run that wrote ``checkpoint`` (its data state names the
    partitions and the held-out rule): caption embeddings ``text``/``mask`` (the prompts), the
    stored DINOv2 CLS features ``cls [N, D]`` of the same images, and their ``ids``. Empty
    (``n`` 0) when the run holds nothing out."""
    import torch

    from flowmatch_models.data.source import ShardSource
    from flowmatch_models.storage.layout import DataLayout
    from flowmatch_models.storage.store import read_shard

    state = torch.load(checkpoint, map_location="cpu", weights_only=True, mmap=True)
    data = state.get("EmbeddingDataModule") or {}
    rule = tuple(data.get("heldout") or (0.0, 0))
    if not rule[0] or not data.get("partitions"):
        return {"n": 0, "rule": rule}
    src = ShardSource(data_root, data["partitions"], load_dino=False, heldout=rule)
    batch = src.heldout_batch(max_samples, latents=False)  # captions: any buckets
    if batch is None:
        return {"n": 0, "rule": rule}
    batch = src.decode(batch)
    layout, cls = DataLayout(data_root), []
    left = max_samples
    for p, rows in zip(src.partitions, src.heldout_rows):
        if len(rows) and left > 0:
            rows = rows[:left]
            cls.append(np.asarray(read_shard(layout.asset_path("dino_features", p))["cls"])[rows])
            left -= len(rows)
    return {
        "n": len(batch["ids"]),
        "rule": rule,
        "ids": batch["ids"],
        "text": batch["text"].float(),
        "mask": batch["mask"],
        "cls": np.concatenate(cls).astype(np.float32),
    }


def fd_dinov2(
    checkpoint: str | Path,
    data_root: str | Path,
    vae: str,
    dino: str,
    held: dict | None = None,
    steps: int = 20,
    cfg_scale: float = 4.0,
    seed: int = 0,
) -> dict:
    """FD-DINOv2 of a checkpoint: the EMA model draws one image per held-out caption (fixed
    noise), the VAE decodes them, DINOv2 gives their CLS features, and the Frechet distance to
    the stored CLS features of the held-out images themselves is returned (no extra pass over
    real images). ``fd_dinov2`` None (with ``reason``) when the run holds nothing out. The
    label says whether the DINOv2 weights are real (:func:`flowmatch_models.encoders.zoo.weights_label`)."""
    import torch

    from flowmatch_models.encoders.zoo import weights_label
    from flowmatch_models.inference.sample import generate, load_model

    held = held if held is not None else heldout_set(data_root, checkpoint)
    label = weights_label(dino)
    if held["n"] < 2:
        return {
            "fd_dinov2": None,
            "n": held["n"],
            "dino": dino,
            "dino_weights": label,
            "reason": "fewer than 2 held-out samples (data.heldout_fraction)",
        }
    model, meta = load_model(checkpoint=checkpoint)
    with torch.inference_mode():
        images = generate(
            model,
            held["text"],
            held["mask"],
            float(meta["scaling_factor"]),
            _vae(vae),
            steps,
            cfg_scale,
            seed,
            float(meta.get("flow_shift", 1.0)),
            meta.get("null_text"),
        )
    _, cls = _dino(dino).encode_dino(images)
    return {
        "fd_dinov2": frechet_distance(cls.astype(np.float32), held["cls"]),
        "n": held["n"],
        "step": int(meta.get("step", -1)),
        "dino": dino,
        "dino_weights": label,
    }


@functools.lru_cache(maxsize=1)
def _dino(path: str):
    """The DINOv2 encoder, loaded once per process for all checkpoints."""
    from flowmatch_models.encoders.frozen import Encoders
    from flowmatch_models.encoders.spec import EncoderSpec

    return Encoders(EncoderSpec(dino=path))
