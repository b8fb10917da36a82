"""Sample a grid of images from a trained model: fixed prompts -> Euler/CFG -> DC-AE -> PNG.

    python -m flowmatch_models.inference.sample --model runs/x/pipeline --text-encoder TEXT \\
        --vae VAE --prompts "a red car" "a cat" --out grid.png
    python -m flowmatch_models.inference.sample --checkpoint runs/x/checkpoints/last.ckpt ...
    python -m flowmatch_models.inference.sample ... --height 224 --width 320    # a wide bucket

Without ``--vae`` the grid shows the latents themselves (channels 0-2, per-image normalised).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from diffusers import SanaTransformer2DModel

from flowmatch_models.data.buckets import GRID, buckets_for, label
from flowmatch_models.figures.grid import make_grid, save_png
from flowmatch_models.inference.export_format import META_FILE, NULL_FILE, prompt_max_tokens
from flowmatch_models.model.dit import fold_text_norm, transformer_config
from flowmatch_models.model.flow import null_caption, sample


def load_model(
    checkpoint: str | Path | None = None, model_dir: str | Path | None = None
) -> tuple[SanaTransformer2DModel, dict]:
    """The EMA transformer and its metadata (``scaling_factor``, ``preset``, ``null_text`` when
    stored) from either a training checkpoint (``weights_only`` load) or an export (the
    ``pipeline`` folder of a run, or its ``transformer`` subfolder)."""
    if (checkpoint is None) == (model_dir is None):
        raise ValueError("pass exactly one of checkpoint= (a .ckpt) or model_dir= (an export)")
    if model_dir is not None:
        model_dir = Path(model_dir)
        if (model_dir / "transformer" / "config.json").is_file():
            model_dir = model_dir / "transformer"
        model = SanaTransformer2DModel.from_pretrained(model_dir)
        meta_path = model_dir / META_FILE
        meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
        if (model_dir / NULL_FILE).is_file():
            from safetensors.torch import load_file

            meta["null_text"] = load_file(model_dir / NULL_FILE)["null_text"]
        return model.eval(), meta
    ckpt = torch.load(checkpoint, map_location="cpu", weights_only=True)
    meta = ckpt.get("flowmatch", {})
    if "preset" not in meta:
        raise ValueError(f"{checkpoint}: not a flowmatch training checkpoint (no 'flowmatch' info)")
    model = SanaTransformer2DModel(
        **meta.get("transformer_config") or transformer_config(meta["preset"])
    )
    state = {k[4:]: v for k, v in ckpt["state_dict"].items() if k.startswith("ema.")}
    model.load_state_dict(state)
    model = fold_text_norm(model, meta.get("text_norm"))  # takes raw caption states, as exports
    return model.eval(), meta


def load_vae(path: str):
    """The DC-AE (``AutoencoderDC.from_pretrained``, encoder and decoder) via the project's
    encoder loader; the sampler decodes with it."""
    from flowmatch_models.encoders.frozen import Encoders
    from flowmatch_models.encoders.spec import EncoderSpec

    return Encoders(EncoderSpec(vae=path)).vae


def prompt_embeddings(
    prompts: Sequence[str], text_encoder: str, max_tokens: int
) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """Gemma3 hidden states of ``prompts``, padded: ``(text [N, L, 640], mask [N, L], labels)``;
    each cut to ``max_tokens`` as the model's training captions were (a model's own:
    ``export_format.prompt_max_tokens(meta)``)."""
    from flowmatch_models.encoders.frozen import Encoders
    from flowmatch_models.encoders.spec import EncoderSpec
    from flowmatch_models.storage.store import pad_ragged

    spec = EncoderSpec(text=text_encoder, max_tokens=max_tokens)
    tokens, lengths = Encoders(spec).encode_text(list(prompts))
    text, mask = pad_ragged(tokens, lengths, np.arange(len(prompts)))
    return torch.from_numpy(text).float(), torch.from_numpy(mask), list(prompts)


def store_captions(source, n: int) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """The first ``n`` stored caption embeddings of the first partition (no text encoder needed)."""
    rows = np.arange(min(n, int(source.sizes[0])))
    b = source.decode(source.gather(np.zeros(len(rows), np.int64), rows, latents=False))
    return b["text"].float(), b["mask"], b["ids"]


def latents_to_images(latents: torch.Tensor, scaling_factor: float, vae=None) -> np.ndarray:
    """Scaled latents -> uint8 ``[N, H, W, 3]``: VAE-decoded, or latent channels 0-2 if no VAE."""
    if vae is not None:
        from flowmatch_models.encoders.frozen import decode_latents

        return decode_latents(vae, latents / scaling_factor)
    z = latents[:, :3].float()
    lo = z.amin(dim=(1, 2, 3), keepdim=True)
    hi = z.amax(dim=(1, 2, 3), keepdim=True)
    z = ((z - lo) / (hi - lo).clamp(min=1e-6) * 255).round().to(torch.uint8)
    return z.permute(0, 2, 3, 1).repeat_interleave(16, 1).repeat_interleave(16, 2).numpy()


def latent_grid(size: tuple[int, int] | None) -> tuple[int, int] | None:
    """``(height, width)`` in pixels -> the DC-AE f32 latent grid; ValueError off the 32 grid."""
    if size is None:
        return None
    h, w = (int(v) for v in size)
    if h % GRID or w % GRID or h <= 0 or w <= 0:
        raise ValueError(
            f"image size {h}x{w}: height and width must be positive multiples of {GRID} "
            f"(one latent cell); the buckets at 256 px: {', '.join(map(label, buckets_for(256)))}"
        )
    return h // GRID, w // GRID


@torch.no_grad()
def generate(
    model,
    text: torch.Tensor,
    mask: torch.Tensor,
    scaling_factor: float,
    vae=None,
    steps: int = 30,
    cfg_scale: float = 4.0,
    seed: int = 0,
    shift: float = 1.0,
    null_text: torch.Tensor | None = None,
    size: tuple[int, int] | None = None,
) -> np.ndarray:
    """One uint8 image ``[N, H, W, 3]`` per caption embedding: Euler/CFG from seeded noise,
    decoded by ``vae`` (latent channels 0-2 without one). ``size``: ``(height, width)`` in
    pixels, multiples of 32 (an aspect-ratio bucket, flowmatch_models/data/buckets.py); default the
    model's square (256 x 256).

    ``null_text [L0, D]`` is the unconditional caption for CFG (the encoded empty prompt the
    model was trained with; see :func:`flowmatch_models.model.flow.null_caption`)."""
    param = next(model.parameters())
    gen = torch.Generator(device=param.device).manual_seed(seed)
    was_training = model.training
    model.eval()
    null = null_caption(len(text), text.shape[-1], param.device, null_text)
    z = sample(
        model,
        text.to(param.device, param.dtype),
        mask.to(param.device),
        null_cond=null,
        steps=steps,
        cfg_scale=cfg_scale,
        generator=gen,
        shift=shift,
        latent_size=latent_grid(size),
    )
    model.train(was_training)
    return latents_to_images(z.cpu(), scaling_factor, vae)


def sample_grid(
    model,
    text: torch.Tensor,
    mask: torch.Tensor,
    out: str | Path,
    scaling_factor: float,
    vae=None,
    steps: int = 30,
    cfg_scale: float = 4.0,
    seed: int = 0,
    shift: float = 1.0,
    labels: Sequence[str] | None = None,
    null_text: torch.Tensor | None = None,
    size: tuple[int, int] | None = None,
) -> Path:
    """:func:`generate` one image per caption and save the grid PNG atomically; returns ``out``."""
    images = generate(
        model, text, mask, scaling_factor, vae, steps, cfg_scale, seed, shift, null_text, size
    )
    return save_png(make_grid(list(images), cell=128), out)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI."""
    ap = argparse.ArgumentParser(
        prog="python -m flowmatch_models.inference.sample", description=__doc__
    )
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="training checkpoint (.ckpt); uses its EMA weights")
    src.add_argument("--model", help="exported folder (run_dir/pipeline)")
    ap.add_argument("--prompts", nargs="+", required=True)
    ap.add_argument("--text-encoder", required=True, help="Gemma3 folder or hub id")
    ap.add_argument("--vae", default=None, help="DC-AE folder or hub id (omit: show latents)")
    ap.add_argument("--scaling-factor", type=float, default=None)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--cfg-scale", type=float, default=4.0)
    ap.add_argument("--shift", type=float, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--height", type=int, default=None, help="pixels, a multiple of 32")
    ap.add_argument("--width", type=int, default=None, help="pixels, a multiple of 32")
    ap.add_argument("--out", default="grid.png")
    args = ap.parse_args(argv)
    model, meta = load_model(args.checkpoint, args.model)
    size = None
    if args.height is not None or args.width is not None:
        side = model.config.sample_size * GRID  # the model's square (256 px)
        size = (
            side if args.height is None else args.height,
            side if args.width is None else args.width,
        )
        try:
            latent_grid(size)
        except ValueError as e:
            raise SystemExit(str(e)) from None
    sf = args.scaling_factor or meta.get("scaling_factor")
    if sf is None:
        raise SystemExit("no scaling factor in the model metadata; pass --scaling-factor")
    shift = args.shift if args.shift is not None else float(meta.get("flow_shift", 1.0))
    text, mask, labels = prompt_embeddings(args.prompts, args.text_encoder, prompt_max_tokens(meta))
    vae = load_vae(args.vae) if args.vae else None
    out = sample_grid(
        model,
        text,
        mask,
        args.out,
        float(sf),
        vae,
        args.steps,
        args.cfg_scale,
        args.seed,
        shift,
        labels,
        meta.get("null_text"),
        size,
    )
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
