"""Train the demo's tiny AutoencoderDC on the procedural sample, so demo samples are pictures.

The demo's zoo VAE is randomly initialised, so everything decoded through it is noise. This
script trains a small diffusers ``AutoencoderDC`` (the real class, 5 down-sampling stages like
DC-AE f32c32: 256 px -> 32 x 8 x 8 latents) on images made exactly as the ``images`` stage
makes them from ``flowmatch_assets.demo.dataset.draw_image`` (``flowmatch_assets.demo.images.sample_images``), on
the CPU, with a fixed seed. It writes

    flowmatch_assets/demo/vae/                 save_pretrained folder (config.json, fp16 weights)
    flowmatch_assets/demo/vae/FLOWMATCH_DEMO_VAE  what it is, seed, steps, PSNR, the command
    docs/demo_vae_reconstructions.png          held-out originals (top) over reconstructions

``scaling_factor`` in the config is 1 / std of the latents over training images, so scaled
latents have unit variance (the role 0.41407 plays for the real DC-AE). The weights are
trained on the synthetic sample only: this is not the real DC-AE and knows nothing else.

    PYTHONPATH=. python scripts/train_demo_vae.py            # ~15-20 min on 2 CPU cores
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch
from diffusers import AutoencoderDC
from PIL import Image

from flowmatch_assets.demo import DEMO_VAE
from flowmatch_assets.demo.images import sample_images
from flowmatch_assets.reports.caption_eval import score
from flowmatch_models.encoders.zoo import DCAE_F32C32_SANA_1_0, DEMO_WEIGHTS_MARKER

REPO = Path(__file__).resolve().parent.parent

# The real f32c32 block types and down-sampling; narrow, one layer per stage, and no layers at
# full resolution (stage 0 is the stride-2 conv_in / interpolating conv_out, as DC-AE allows).
DEMO_VAE_CONFIG: dict = {
    **DCAE_F32C32_SANA_1_0,
    "attention_head_dim": 16,
    "encoder_block_out_channels": (16, 16, 32, 64, 128, 128),
    "decoder_block_out_channels": (16, 16, 32, 64, 128, 128),
    "encoder_layers_per_block": (0, 1, 1, 1, 1, 1),
    "decoder_layers_per_block": (0, 1, 1, 1, 1, 1),
}


def _chunk(args: tuple[int, int]) -> tuple[np.ndarray, list[str]]:
    return sample_images(*args)


def make_images(seed: int, n: int, workers: int, chunk: int = 100) -> tuple[np.ndarray, list]:
    """``n`` images images from seeds ``seed * 1000 + i`` per chunk of ``chunk`` (parallel)."""
    jobs = [(seed * 1000 + i, min(chunk, n - i * chunk)) for i in range(math.ceil(n / chunk))]
    with ProcessPoolExecutor(workers) as ex:
        parts = list(ex.map(_chunk, jobs))
    return np.concatenate([p[0] for p in parts]), [c for p in parts for c in p[1]]


def to_tensor(x: np.ndarray) -> torch.Tensor:
    """uint8 NHWC -> float NCHW in [-1, 1] (the VAE's input range)."""
    return torch.from_numpy(x).permute(0, 3, 1, 2).float().div(127.5).sub(1.0)


def to_uint8(x: torch.Tensor) -> np.ndarray:
    """float NCHW in [-1, 1] -> uint8 NHWC."""
    return ((x.clamp(-1, 1) + 1) * 127.5).round().byte().permute(0, 2, 3, 1).numpy()


@torch.no_grad()
def reconstruct(vae: AutoencoderDC, x: np.ndarray, batch: int = 16) -> np.ndarray:
    """Encode and decode uint8 NHWC images; uint8 NHWC out."""
    out = []
    for i in range(0, len(x), batch):
        xb = to_tensor(x[i : i + batch]).to(vae.dtype)
        out.append(to_uint8(vae.decode(vae.encode(xb).latent).sample.float()))
    return np.concatenate(out)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(((a.astype(np.float64) - b.astype(np.float64)) ** 2).mean())
    return 10 * math.log10(255.0**2 / max(mse, 1e-10))


def figure(orig: np.ndarray, recon: np.ndarray, path: Path, thumb: int = 160) -> None:
    """Originals (top row) over reconstructions (bottom row), ``thumb`` px each."""
    n = len(orig)
    grid = Image.new("RGB", (n * thumb + (n + 1) * 4, 2 * thumb + 12), (255, 255, 255))
    for i in range(n):
        for row, src in enumerate((orig, recon)):
            im = Image.fromarray(src[i]).resize((thumb, thumb), Image.Resampling.LANCZOS)
            grid.paste(im, (4 + i * (thumb + 4), 4 + row * (thumb + 4)))
    path.parent.mkdir(parents=True, exist_ok=True)
    grid.save(path, optimize=True)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEMO_VAE)
    p.add_argument("--figure", type=Path, default=REPO / "docs/demo_vae_reconstructions.png")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-images", type=int, default=1200)
    p.add_argument("--heldout-images", type=int, default=64)
    p.add_argument("--steps", type=int, default=1600)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--l1", type=float, default=0.1, help="weight of the L1 term next to MSE")
    p.add_argument(
        "--latent-l2", type=float, default=1e-5, help="weight of a tiny latent L2 penalty"
    )
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads (2 on a busy 2-core box is 5x slower)"
    )
    p.add_argument("--cache", type=Path, default=None, help="npz cache of the training images")
    a = p.parse_args(argv)
    torch.manual_seed(a.seed)
    torch.set_num_threads(a.threads)
    torch.use_deterministic_algorithms(True)

    t0 = time.time()
    if a.cache is not None and a.cache.exists():
        z = np.load(a.cache)
        train = z["images"]
    else:
        train, _ = make_images(a.seed, a.train_images, a.threads)
        if a.cache is not None:
            np.savez(a.cache, images=train)
    held, held_caps = make_images(a.seed + 1, a.heldout_images, a.threads)
    print(f"{len(train)} training + {len(held)} held-out images in {time.time() - t0:.0f} s")

    vae = AutoencoderDC(**DEMO_VAE_CONFIG).train()
    n_params = sum(q.numel() for q in vae.parameters())
    print(f"AutoencoderDC {n_params / 1e6:.2f} M parameters")
    opt = torch.optim.AdamW(vae.parameters(), lr=a.lr, weight_decay=0.0)
    warmup = max(1, a.steps // 50)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: (
            min(1.0, (s + 1) / warmup)
            * (0.5 * (1 + math.cos(math.pi * min(1.0, s / a.steps))) * 0.95 + 0.05)
        ),
    )
    gen = torch.Generator().manual_seed(a.seed)
    t1, ema = time.time(), None
    for step in range(a.steps):
        idx = torch.randint(len(train), (a.batch,), generator=gen)
        x = to_tensor(train[idx.numpy()])
        flip = torch.rand(a.batch, generator=gen) < 0.5  # left <-> right stays in the grammar
        x = torch.where(flip[:, None, None, None], x.flip(-1), x)
        z = vae.encode(x).latent
        y = vae.decode(z).sample
        loss = torch.nn.functional.mse_loss(y, x) + a.l1 * (y - x).abs().mean()
        loss = loss + a.latent_l2 * z.pow(2).mean()  # keeps latents O(1-10), fp16-friendly
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        sched.step()
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        if step % 50 == 0 or step == a.steps - 1:
            el = time.time() - t1
            print(f"step {step}/{a.steps} loss {ema:.4f} {el:.0f}s ({el / (step + 1):.2f} s/step)")
    train_s = time.time() - t1

    vae.eval()
    with torch.no_grad():
        lat = torch.cat(
            [
                vae.encode(to_tensor(train[i : i + 32])).latent
                for i in range(0, min(512, len(train)), 32)
            ]
        )
    std = float(lat.std())
    vae.register_to_config(scaling_factor=1.0 / std)
    a.out.mkdir(parents=True, exist_ok=True)
    vae.to(torch.float16).save_pretrained(a.out, safe_serialization=True)

    loaded = AutoencoderDC.from_pretrained(a.out).float().eval()  # what users will load
    recon = reconstruct(loaded, held)
    val_psnr = psnr(held, recon)
    s_rec, s_gt = score(held_caps, recon), score(held_caps, held)
    figure(held[:8], recon[:8], a.figure)
    weights = a.out / "diffusion_pytorch_model.safetensors"
    info = {
        "what": (
            "a tiny diffusers AutoencoderDC trained on the synthetic procedural sample "
            "(flowmatch_assets/demo/dataset.py), NOT the real DC-AE: it reconstructs coloured shapes "
            "on textured backgrounds at 256 px (-> 32x8x8 latents) and nothing else"
        ),
        "seed": a.seed,
        "steps": a.steps,
        "batch": a.batch,
        "train_images": len(train),
        "train_seconds": round(train_s),
        "final_loss_ema": round(ema, 5),
        "parameters": n_params,
        "weights_bytes": weights.stat().st_size,
        "scaling_factor": 1.0 / std,
        "latent_std": std,
        "heldout_images": len(held),
        "heldout_psnr_db": round(val_psnr, 2),
        "heldout_caption_eval_reconstructions": s_rec["accuracy"],
        "heldout_caption_eval_originals": s_gt["accuracy"],
        "command": "PYTHONPATH=. python scripts/train_demo_vae.py "
        + shlex.join(argv if argv is not None else sys.argv[1:]),
        "torch": torch.__version__,
    }
    (a.out / DEMO_WEIGHTS_MARKER).write_text(json.dumps(info, indent=1) + "\n")
    print(json.dumps(info, indent=1))
    return info


if __name__ == "__main__":
    main()
