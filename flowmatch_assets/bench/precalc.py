"""Benchmark: precalc throughput (image/caption pairs per second) with full-size random encoders.

Builds, randomly initialised from their configs (no download), the three encoders of the real
pipeline and runs them through :class:`flowmatch_models.encoders.frozen.Encoders` (the code path of the
embedding assets: uint8 images and caption strings on the host in, fp16 numpy arrays out):

- DC-AE f32c32-sana-1.0 (diffusers ``AutoencoderDC``). Config source: diffusers
  ``scripts/convert_dcae_to_diffusers.py`` (``convert_ae``, the ``dc-ae-f32c32-sana-1.0`` case):
  block types ResBlock x3 + EfficientViTBlock x3, channels (128, 256, 512, 512, 1024, 1024),
  encoder layers (2, 2, 2, 3, 3, 3), decoder layers 3 x6, qkv multiscale (5,) on the ViT
  stages, conv down-sampling, interpolate up-sampling, rms_norm/silu, scaling 0.41407.
- DINOv2-small (``facebook/dinov2-small`` config.json: hidden 384, 12 layers, 6 heads,
  mlp_ratio 4, patch 14, image_size 518), run at 224 px and 2x2-pooled to 8x8.
- Gemma3-270M (``google/gemma-3-270m`` config.json: hidden 640, 18 layers, 4 heads, 1 KV head,
  head_dim 256, intermediate 2048, vocab 262144, sliding window 512, 5 local : 1 global).
  ``--quick`` shrinks only the vocabulary (embedding rows: no FLOPs change).
  Captions are long enough to fill ``max_tokens`` = 128 tokens (the worst case) using the zoo's
  offline tokenizer (random model, so token ids only need to be in range).

FLOPs per pair come from ``torch.utils.flop_counter.FlopCounterMode`` on one real batch;
throughput is timed end to end over ``--iters`` batches after a warm-up batch, in bf16 +
channels_last (+ ``--compile``) on CUDA, fp32 on CPU. Ends with one JSON line
``{"bench": "precalc", ...}``.

Run: ``flowmatch bench precalc --quick`` (CPU, < 2 min) or
``flowmatch bench precalc --device cuda --batch 256 --compile``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.flop_counter import FlopCounterMode

from flowmatch_models.encoders.frozen import Encoders
from flowmatch_models.encoders.spec import EncoderSpec
from flowmatch_models.encoders.zoo import DCAE_F32C32_SANA_1_0, build_tokenizer, caption_corpus

DINOV2_SMALL: dict = {
    "hidden_size": 384,
    "num_hidden_layers": 12,
    "num_attention_heads": 6,
    "mlp_ratio": 4,
    "patch_size": 14,
    "image_size": 518,
    "layerscale_value": 1.0,
}
GEMMA3_270M: dict = {
    "vocab_size": 262144,
    "hidden_size": 640,
    "intermediate_size": 2048,
    "num_hidden_layers": 18,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "query_pre_attn_scalar": 256,
    "max_position_embeddings": 32768,
    "sliding_window": 512,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 3,
    "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    },
    "pad_token_id": 0,
    "eos_token_id": 1,
    "bos_token_id": 2,
}
QUICK_VOCAB = 8192


def build_models(quick: bool, seed: int = 0) -> tuple:
    """Full-size randomly initialised DC-AE, DINOv2-small and Gemma3-270M (vocab cut if quick)."""
    from diffusers import AutoencoderDC
    from transformers import AutoModel, Dinov2Config, Dinov2Model, Gemma3TextConfig

    torch.manual_seed(seed)
    vae = AutoencoderDC(**DCAE_F32C32_SANA_1_0)
    dino = Dinov2Model(Dinov2Config(**DINOV2_SMALL))
    cfg = dict(GEMMA3_270M, layer_types=list(GEMMA3_270M["layer_types"]))
    if quick:
        cfg["vocab_size"] = QUICK_VOCAB
    text = AutoModel.from_config(Gemma3TextConfig(**cfg))
    return vae, dino, text


def make_inputs(n: int, seed: int = 0) -> tuple[np.ndarray, list[str]]:
    """Smooth uint8 images [n, 256, 256, 3] and captions long enough for 128 tokens."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:256, 0:256].astype(np.float32) / 256
    freq = rng.uniform(1, 6, (n, 3, 2)).astype(np.float32)
    img = np.sin(freq[..., 0, None, None] * 6.28 * xx + freq[..., 1, None, None] * 3.1 * yy)
    images = ((img.transpose(0, 2, 3, 1) + 1) * 127.5).astype(np.uint8)
    corpus = caption_corpus()
    captions = [" ".join(rng.choice(corpus, size=12)) for _ in range(n)]
    return images, captions


def encode_pairs(enc: Encoders, images: np.ndarray, captions: list[str]) -> int:
    """One precalc step as the assets do it; returns the number of pairs."""
    enc.encode_vae(images)
    enc.encode_dino(images)
    enc.encode_text(captions)
    return len(captions)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run(
    device: str = "auto",
    batch: int | None = None,
    iters: int | None = None,
    quick: bool = False,
    compile_models: bool = False,
    peak_tflops: float | None = None,
) -> dict:
    """Build the encoders, count FLOPs per pair, time ``iters`` batches; returns the result."""
    t_build = time.perf_counter()
    spec = EncoderSpec(device=device, compile=compile_models, max_tokens=128)
    dev = "cuda" if (device == "auto" and torch.cuda.is_available()) else device
    on_cuda = dev.startswith("cuda")
    batch = batch or (256 if on_cuda else 2)
    iters = iters or (20 if on_cuda else 1)
    spec.batch_size = batch
    if on_cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = True
    vae, dino, text = build_models(quick)
    with tempfile.TemporaryDirectory() as tmp:
        tok = build_tokenizer()
        tok.save_pretrained(Path(tmp))  # round trip: the same loading path as a real folder
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tmp)
    enc = Encoders.from_models(spec, vae=vae, dino=dino, text=text, tokenizer=tok)
    del vae, dino, text
    build_s = time.perf_counter() - t_build

    images, captions = make_inputs(batch)
    lengths = [len(x) for x in enc.tokenize(captions)]

    # FLOPs per pair, per encoder, on one real batch (eager: the counter needs dispatch)
    flops = {}
    for name, fn in (
        ("vae", lambda: enc.encode_vae(images)),
        ("dino", lambda: enc.encode_dino(images)),
        ("text", lambda: enc.encode_text(captions)),
    ):
        counter = FlopCounterMode(display=False)
        with counter:
            fn()
        flops[name] = counter.get_total_flops() / batch
    total_flops = sum(flops.values())

    if on_cuda:  # warm-up (compile, cudnn autotune); on CPU the counted batch was the warm-up
        encode_pairs(enc, images, captions)
    _sync(dev)
    t = time.perf_counter()
    pairs = 0
    for _ in range(iters):
        pairs += encode_pairs(enc, images, captions)
    _sync(dev)
    seconds = time.perf_counter() - t
    pairs_per_s = pairs / seconds
    achieved = pairs_per_s * total_flops / 1e12
    result = {
        "bench": "precalc",
        "device": torch.cuda.get_device_name()
        if on_cuda
        else f"cpu ({torch.get_num_threads()} threads)",
        "dtype": str(enc.dtype).replace("torch.", ""),
        "quick": quick,
        "compile": compile_models and on_cuda,
        "batch": batch,
        "iters": iters,
        "tokens_per_caption": float(np.mean(lengths)),
        "gflops_per_pair": {k: round(v / 1e9, 2) for k, v in flops.items()},
        "gflops_per_pair_total": round(total_flops / 1e9, 2),
        "pairs_per_s": round(pairs_per_s, 3),
        "achieved_tflops": round(achieved, 4),
        "build_s": round(build_s, 1),
        "timed_s": round(seconds, 2),
    }
    if peak_tflops:
        result["peak_tflops"] = peak_tflops
        result["fraction_of_peak"] = round(achieved / peak_tflops, 4)
    return result


def main(argv: Sequence[str] | None = None) -> dict:
    """CLI entry point: prints one JSON line."""
    parser = argparse.ArgumentParser(prog="flowmatch bench precalc")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    parser.add_argument("--batch", type=int, default=None, help="pairs per batch")
    parser.add_argument("--iters", type=int, default=None, help="timed batches")
    parser.add_argument("--quick", action="store_true", help="small vocab, CPU-friendly sizes")
    parser.add_argument("--compile", action="store_true", help="torch.compile VAE + DINO (CUDA)")
    parser.add_argument(
        "--peak-tflops", type=float, default=None, help="device peak (default 790 on CUDA)"
    )
    args = parser.parse_args(argv)
    on_cuda = args.device.startswith("cuda") or (
        args.device == "auto" and torch.cuda.is_available()
    )
    peak = args.peak_tflops if args.peak_tflops is not None else (790.0 if on_cuda else None)
    r = run(args.device, args.batch, args.iters, args.quick, args.compile, peak)
    print(json.dumps(r))
    return r


if __name__ == "__main__":
    main()
