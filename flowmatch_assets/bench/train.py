"""Training-step benchmark: steps/s, samples/s, FLOPs per step and MFU against a measured peak.

    flowmatch bench train --preset base --batch 256 --device cuda

One step = flow-matching + REPA forward, backward and AdamW update on random inputs of the
real shapes (latents 32x8x8, 128 caption tokens of width 640, DINOv2 patches 64x384), with the
training's model settings (``ModelConfig`` defaults: qk_norm, fp32 linear attention). FLOPs are
counted by ``torch.utils.flop_counter`` on a real forward+backward; the peak is a large matmul
timed in the same dtype in the same process. ``--compile`` times the eager model and then the
same model under ``torch.compile`` (as training compiles it: the whole FlowDiT forward) on the
same inputs and reports both and their ratio. Ends with one JSON line ``{"bench": "train", ...}``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Sequence

import torch
from torch.utils.flop_counter import FlopCounterMode

from flowmatch_models.model.dit import PRESETS, build_model, count_params
from flowmatch_models.model.flow import FlowMatching
from flowmatch_models.model.loss_terms import TOTAL
from flowmatch_models.train.config import ModelConfig


def _conv_backward_flop(
    grad_out_shape,
    x_shape,
    w_shape,
    _bias,
    _stride,
    _padding,
    _dilation,
    _transposed,
    _output_padding,
    _groups,
    output_mask,
    out_shape=None,
    **_,
) -> int:
    """``aten.convolution_backward`` FLOPs that respect ``groups``.

    torch's built-in formula (torch 2.13) prices the weight gradient of a grouped conv as a
    dense one, so SANA's depthwise 3x3 conv would count ~11x the whole model. Each gradient
    (input, weight) costs what the forward conv costs: ``2 * N * prod(w) * prod(out spatial)``.
    """
    fwd = 2 * grad_out_shape[0] * math.prod(w_shape) * math.prod(grad_out_shape[2:])
    return fwd * (int(output_mask[0]) + int(output_mask[1]))


FLOP_FORMULAS = {torch.ops.aten.convolution_backward: _conv_backward_flop}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak(device: torch.device, dtype: torch.dtype, n: int | None = None, reps: int = 10):
    """Achieved FLOP/s of an ``n x n`` matmul (the practical peak of this device and dtype)."""
    n = n or (8192 if device.type == "cuda" else 1024)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    _sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - t0)


def bench(
    preset: str = "tiny",
    batch: int = 32,
    device: str = "auto",
    steps: int = 10,
    warmup: int = 3,
    text_len: int = 128,
    compile: bool = False,
    gradient_checkpointing: bool = False,
) -> dict:
    """Run the benchmark and return its result dict."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    amp = dev.type == "cuda"
    dtype = torch.bfloat16 if amp else torch.float32
    if amp:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(0)
    m = ModelConfig()
    model = build_model(preset, qk_norm=m.qk_norm, fp32_attention=m.fp32_attention).to(dev)
    if gradient_checkpointing:
        model.transformer.enable_gradient_checkpointing()
    fm = FlowMatching(repa_lambda=0.5, caption_dropout=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=amp)
    x = torch.randn(batch, 32, 8, 8, device=dev)
    text = torch.randn(batch, text_len, 640, device=dev)
    mask = torch.ones(batch, text_len, dtype=torch.bool, device=dev)
    dino = torch.randn(batch, 64, 384, device=dev)

    def step() -> torch.Tensor:
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=amp):
            loss = fm.loss(model, x, text, mask, dino)[TOTAL]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(warmup):
        step()
    _sync(dev)
    counter = FlopCounterMode(display=False, custom_mapping=FLOP_FORMULAS)
    with counter:
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=amp):
            loss = fm.loss(model, x, text, mask, dino)[TOTAL]
        loss.backward()
    opt.zero_grad(set_to_none=True)
    flops = counter.get_total_flops()

    def timed() -> float:
        _sync(dev)
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        _sync(dev)
        return (time.perf_counter() - t0) / steps

    step_s = eager_s = timed()
    compiled: dict = {}
    if compile:
        model.compile()
        t0 = time.perf_counter()
        for _ in range(warmup):
            step()
        _sync(dev)
        warm_s = time.perf_counter() - t0
        step_s = timed()
        compiled = {
            "eager_step_s": round(eager_s, 5),
            "compiled_step_s": round(step_s, 5),
            "compile_speedup": round(eager_s / step_s, 3),
            "compile_warmup_s": round(warm_s, 1),
        }
    peak = matmul_peak(dev, dtype)
    achieved = flops / step_s
    return {
        "bench": "train",
        "preset": preset,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
        "dtype": "bf16-mixed" if amp else "fp32",
        "compile": compile,
        "batch": batch,
        "text_len": text_len,
        "params_M": round(count_params(model.transformer) / 1e6, 2),
        "flops_per_step": flops,
        "gflops_per_sample": round(flops / batch / 1e9, 3),
        "step_s": round(step_s, 5),
        "steps_per_s": round(1 / step_s, 3),
        "samples_per_s": round(batch / step_s, 1),
        "achieved_tflops": round(achieved / 1e12, 4),
        "matmul_peak_tflops": round(peak / 1e12, 4),
        "mfu": round(achieved / peak, 4),
        "updates_per_s_at_1024": round(batch / step_s / 1024, 4),
        "qk_norm": m.qk_norm,
        "fp32_attention": m.fp32_attention,
        **compiled,
    }


def bench_loader(
    root: str | None = None,
    batch: int = 256,
    batches: int = 40,
    codec: str = "none",
    shards: int = 4,
    per_shard: int = 2000,
) -> dict:
    """Samples/s of the training loader (one process, page cache) over ``root``'s complete
    partitions, or over a synthetic store of ``shards x per_shard`` samples written with
    ``codec`` (caption lengths 8-64 tokens, PD12M-like)."""
    import tempfile

    import numpy as np

    from flowmatch_models.data.source import ShardSource
    from flowmatch_models.data.stream import BatchStream
    from flowmatch_models.storage.layout import DataLayout
    from flowmatch_models.storage.store import write_shard

    tmp = None
    if root is None:
        tmp = tempfile.TemporaryDirectory(prefix="bench-loader-")
        root, layout, rng = tmp.name, DataLayout(tmp.name), np.random.default_rng(0)
        for i in range(shards):
            p, ids = f"{i:03d}-00", [f"{i}/{j}" for j in range(per_shard)]
            lat = rng.standard_normal((per_shard, 32, 8, 8)).astype(np.float16)
            write_shard(
                layout.asset_path("vae_latents", p),
                {"latents": lat},
                ids,
                codec=codec,
                attrs={"scaling_factor": 0.41407},
            )
            patch = rng.standard_normal((per_shard, 64, 384)).astype(np.float16)
            cls = rng.standard_normal((per_shard, 384)).astype(np.float16)
            write_shard(
                layout.asset_path("dino_features", p),
                {"patch": patch, "cls": cls},
                ids,
                codec=codec,
            )
            lengths = rng.integers(8, 65, per_shard).astype(np.int32)
            tokens = rng.standard_normal((int(lengths.sum()), 640)).astype(np.float16)
            write_shard(
                layout.asset_path("text_embeddings", p),
                {"tokens": tokens, "lengths": lengths},
                ids,
                codec=codec,
            )
    try:
        partitions = DataLayout(root).complete_partitions()
        source = ShardSource(root, partitions, cache_shards=len(partitions))
        it = iter(BatchStream(source, batch))
        for _ in range(3):  # warm: the first window's shards opened (and decoded if compressed)
            next(it)
        t0, n = time.perf_counter(), 0
        for _ in range(batches):  # read and decoded on the host
            n += len(source.decode(next(it))["meta"]["ids"])
        dt = time.perf_counter() - t0
    finally:
        if tmp is not None:
            tmp.cleanup()
    return {
        "bench": "train_loader",
        "codec": codec,
        "batch": batch,
        "samples": n,
        "samples_per_s": round(n / dt, 1),
    }


def main(argv: Sequence[str] | None = None) -> dict:
    """CLI."""
    ap = argparse.ArgumentParser(prog="flowmatch bench train", description=__doc__)
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--text-len", type=int, default=128)
    ap.add_argument("--compile", action="store_true", help="eager, then compiled: both times")
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--loader", action="store_true", help="benchmark the data loader instead")
    ap.add_argument("--root", default=None, help="--loader: data root (default: synthetic)")
    ap.add_argument("--codec", default="none", help="--loader: codec of the synthetic store")
    args = ap.parse_args(argv)
    if args.loader:
        out = bench_loader(args.root, args.batch, codec=args.codec)
        print(json.dumps(out), flush=True)
        return out
    out = bench(
        args.preset,
        args.batch,
        args.device,
        args.steps,
        args.warmup,
        args.text_len,
        args.compile,
        args.gradient_checkpointing,
    )
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
