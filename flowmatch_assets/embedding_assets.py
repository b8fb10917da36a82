"""Embedding assets: one pass over a partition's images_256 shard computes DC-AE latents, DINOv2
features and Gemma3 caption embeddings (any subset), each stored as one flowmatch store file.

The step runs in Dagster's ``gpu`` pool (at most as many at once as the pool allows: set it to
the GPU count) and takes a device lease (flowmatch_models.devices), so two partitions never
share a GPU; without CUDA it runs on the CPU.
"""

import time
from pathlib import Path

import dagster as dg
import numpy as np

from flowmatch_assets import catalog
from flowmatch_assets.catalog import MaterializationRecord, RowOutcome
from flowmatch_assets.data_assets import _run_id, images_256, run_partitions
from flowmatch_assets.deploy import ENCODER_TAGS
from flowmatch_assets.partitions import shard_partitions
from flowmatch_assets.resources import FlowmatchResource
from flowmatch_models.atomic import remove_stale_temps
from flowmatch_models.devices import lease_device
from flowmatch_models.image_shard import iter_image_batches, read_image_meta
from flowmatch_models.store import read_shard, write_shard

GROUP = "embeddings"
FP16 = 2

SPECS = {
    "vae_latents": "DC-AE f32c32 latents (32x8x8, unscaled fp16; the scaling factor is in the shard attrs).",
    "dino_features": "DINOv2 patch features pooled to the 8x8 latent grid (64x384) plus CLS: the REPA target.",
    "text_embeddings": "Gemma3 last hidden states of each caption: only the valid tokens (<=128) plus lengths.",
}
KINDS = {
    "vae_latents": {"pytorch", "diffusers"},
    "dino_features": {"pytorch", "transformers"},
    "text_embeddings": {"pytorch", "transformers"},
}


def _seed_bytes(asset: str, n: int, max_tokens: int) -> int:
    """What the seed stored for n samples: dense fp16, text padded to max_tokens (+ its mask)."""
    if asset == "vae_latents":
        return n * 32 * 8 * 8 * FP16
    if asset == "dino_features":
        return n * (64 + 1) * 384 * FP16
    return n * (max_tokens * 640 * FP16 + max_tokens)


@dg.multi_asset(
    specs=[
        dg.AssetSpec(
            name,
            deps=[images_256],
            description=desc,
            group_name=GROUP,
            kinds=KINDS[name],
            skippable=True,
        )
        for name, desc in SPECS.items()
    ],
    partitions_def=shard_partitions,
    can_subset=True,
    pool="gpu",
    op_tags=ENCODER_TAGS,
    name="encode_embeddings",
)
def encode_embeddings(context: dg.AssetExecutionContext, flowmatch: FlowmatchResource):
    """Encode one partition with the selected encoders; write each asset's shard atomically."""
    part = context.partition_key
    layout, cfg = flowmatch.layout, flowmatch.encoders
    selected = [k.to_user_string() for k in context.selected_asset_keys]
    src = layout.asset_path("images_256", part)
    if not src.exists():
        raise dg.Failure(
            f"partition {part} has no images_256 shard ({src}); materialize images_256 first"
        )
    meta = read_image_meta(src)
    ids = meta.column("id").to_pylist()
    if not ids:  # an empty shard never replaces a good one (nor is written at all)
        raise dg.Failure(
            f"partition {part}: images_256 has 0 images, nothing to encode; the existing "
            f"{', '.join(selected)} shards (if any) are unchanged. Re-materialize images_256 "
            "(see `flowmatch catalog failures`) first."
        )

    from flowmatch_models.encoders import Encoders, EncoderSpec  # torch: only where it runs

    with lease_device(cfg.device) as device:
        enc = Encoders(
            EncoderSpec(
                vae=cfg.vae,
                dino=cfg.dino,
                text=cfg.text,
                device=device,
                dtype=cfg.dtype,
                text_dtype=cfg.text_dtype,
                max_tokens=cfg.max_tokens,
                dino_pool=cfg.dino_pool,
                batch_size=cfg.batch_size,
            )
        )
        context.log.info(f"{part}: encoding {len(ids)} samples for {selected} on {device}")
        random = enc.random_weights
        timings: dict[str, float] = dict.fromkeys(selected, 0.0)
        outs: dict[str, dict[str, list[np.ndarray]]] = {n: {} for n in selected}

        def add(name: str, key: str, arr: np.ndarray) -> None:
            outs[name].setdefault(key, []).append(arr)

        if {"vae_latents", "dino_features"} & set(selected):
            done = 0
            for _, _, imgs in iter_image_batches(src, batch_size=cfg.batch_size):
                if "vae_latents" in selected:
                    t0 = time.perf_counter()
                    add("vae_latents", "latents", enc.encode_vae(imgs))
                    timings["vae_latents"] += time.perf_counter() - t0
                if "dino_features" in selected:
                    t0 = time.perf_counter()
                    patch, cls = enc.encode_dino(imgs)
                    add("dino_features", "patch", patch)
                    add("dino_features", "cls", cls)
                    timings["dino_features"] += time.perf_counter() - t0
                done += len(imgs)
                context.log.info(f"{part}: images {done}/{len(ids)}")
        if "text_embeddings" in selected:
            t0 = time.perf_counter()
            captions = meta.column("caption").to_pylist()
            for i in range(0, len(captions), cfg.batch_size):
                tokens, lengths = enc.encode_text(captions[i : i + cfg.batch_size])
                add("text_embeddings", "tokens", tokens)
                add("text_embeddings", "lengths", lengths)
            timings["text_embeddings"] = time.perf_counter() - t0
            saturated = enc.text_saturated
            add("text_embeddings", "null_tokens", enc.encode_null())

        model_of = {"vae_latents": cfg.vae, "dino_features": cfg.dino, "text_embeddings": cfg.text}
        enc_of = {"vae_latents": "vae", "dino_features": "dino", "text_embeddings": "text"}
        lossy_of = {
            "dino_features": {"patch": cfg.lossy_dino},
            "text_embeddings": {"tokens": cfg.lossy_text},
        }
        for name in selected:
            # an empty shard still gets well-formed, empty arrays
            arrays = {**_empty(name), **{k: np.concatenate(v) for k, v in outs[name].items()}}
            attrs = {
                "model": model_of[name],
                "weights": _weights_label(model_of[name]),
                "random_weights": random[enc_of[name]],
                "device": device,
                "dtype": str(enc.dtype),
                "source": f"images_256/{part}",
            }
            if name == "vae_latents":
                attrs["scaling_factor"] = enc.scaling_factor
            if name == "dino_features":
                attrs["dino_pool"] = cfg.dino_pool
            if name == "text_embeddings":
                attrs["max_tokens"] = cfg.max_tokens
                attrs["text_dtype"] = str(enc.text_dtype)
                attrs["fp16_saturated"] = saturated
            lossy = {k: v for k, v in lossy_of.get(name, {}).items() if v}
            out = layout.asset_path(name, part)
            remove_stale_temps(out)
            stats = write_shard(out, arrays, ids, codec=cfg.codec, attrs=attrs, lossy=lossy or None)
            errs = [a["lossy"] for a in stats.arrays.values() if "lossy" in a]
            seed = _seed_bytes(name, len(ids), cfg.max_tokens)
            secs = timings[name]
            catalog.record_rows(
                flowmatch.data_root, name, part, [RowOutcome(i, None, "stored") for i in ids]
            )
            catalog.record_materialization(
                flowmatch.data_root,
                MaterializationRecord(
                    asset=name,
                    partition=part,
                    samples=len(ids),
                    raw_bytes=seed,
                    stored_bytes=stats.stored_bytes,
                    seconds=secs,
                    codec=cfg.codec
                    + (f"+{'/'.join(sorted({e['mode'] for e in errs}))}" if errs else ""),
                    device=device,
                    lossy_min_cosine=min((e["min_cosine"] for e in errs), default=None),
                    lossy_rel_rms=max((e["rel_rms"] for e in errs), default=None),
                    run_id=_run_id(context),
                    extra={
                        "model": model_of[name],
                        "random_weights": attrs["random_weights"],
                        "array_bytes": stats.raw_bytes,
                        **({"fp16_saturated": saturated} if name == "text_embeddings" else {}),
                    },
                ),
            )
            label = f" ({attrs['weights']})" if attrs["weights"] else ""
            context.log.info(f"{part}: {name} {len(ids)} samples, {stats.stored_bytes} B{label}")
            yield dg.MaterializeResult(
                asset_key=name,
                metadata={
                    "samples": len(ids),
                    "raw_bytes_seed_equivalent": seed,
                    "array_bytes": stats.raw_bytes,
                    "stored_bytes": stats.stored_bytes,
                    "ratio_vs_seed": round(seed / stats.stored_bytes, 3)
                    if stats.stored_bytes
                    else 0.0,
                    "codec": cfg.codec,
                    "lossy": dg.MetadataValue.json(errs),
                    "samples_per_s": round(len(ids) / secs, 2) if secs else 0.0,
                    "device": device,
                    "model": model_of[name] + label,
                    "random_weights": bool(attrs["random_weights"]),
                    **({"fp16_saturated_values": saturated} if name == "text_embeddings" else {}),
                    "path": dg.MetadataValue.path(str(out)),
                },
            )


def _weights_label(source: str) -> str:
    """The zoo's / demo VAE's label for a local model folder; "" for a real model."""
    from flowmatch_models.zoo import weights_label  # imports torch: only where it runs

    return weights_label(source) if Path(source).expanduser().is_dir() else ""


def _empty(name: str) -> dict[str, np.ndarray]:
    if name == "vae_latents":
        return {"latents": np.zeros((0, 32, 8, 8), np.float16)}
    if name == "dino_features":
        return {"patch": np.zeros((0, 64, 384), np.float16), "cls": np.zeros((0, 384), np.float16)}
    return {
        "tokens": np.zeros((0, 640), np.float16),
        "lengths": np.zeros((0,), np.int32),
        "null_tokens": np.zeros((1, 640), np.float16),
    }


EXPECTED = {
    "vae_latents": {"latents": (32, 8, 8)},
    "dino_features": {"patch": (64, 384), "cls": (384,)},
    "text_embeddings": {"tokens": (640,)},
}


def check_shards(flowmatch: FlowmatchResource, asset: str, parts: list[str]) -> list[str]:
    """Problems of ``asset``'s shards: shapes, dtypes, finiteness, counts and ids vs images_256."""
    layout = flowmatch.layout
    problems = []
    for p in parts:
        try:
            shard = read_shard(layout.asset_path(asset, p), verify=True)
        except Exception as e:  # noqa: BLE001 - every problem is reported, not raised
            problems.append(f"{p}: {e}")
            continue
        img_ids = read_image_meta(layout.asset_path("images_256", p)).column("id").to_pylist()
        if list(shard.ids) != img_ids:
            problems.append(f"{p}: {len(shard.ids)} ids do not match images_256's {len(img_ids)}")
        for key, tail in EXPECTED[asset].items():
            a = shard[key]
            if a.shape[1:] != tail or a.dtype != np.float16:
                problems.append(
                    f"{p}: {key} has shape {a.shape} dtype {a.dtype}, expected (N, *{tail}) float16"
                )
            elif not np.isfinite(a).all():
                problems.append(f"{p}: {key} has non-finite values")
        if asset == "text_embeddings":
            lengths = shard["lengths"]
            if (
                len(lengths) != len(shard.ids)
                or int(lengths.sum()) != shard["tokens"].shape[0]
                or (lengths < 1).any()
            ):
                problems.append(f"{p}: lengths do not add up to the tokens")
        elif shard[next(iter(EXPECTED[asset]))].shape[0] != len(shard.ids):
            problems.append(f"{p}: array rows != ids")
    return problems


def _make_check(asset: str):
    @dg.asset_check(
        asset=asset,
        name=f"{asset}_valid",
        blocking=True,
        description=f"{asset}: shapes and dtypes, finite values, checksums, ids aligned with images_256.",
    )
    def _check(
        context: dg.AssetCheckExecutionContext, flowmatch: FlowmatchResource
    ) -> dg.AssetCheckResult:
        parts = run_partitions(context) or flowmatch.layout.partitions_with(asset)
        problems = check_shards(flowmatch, asset, parts)
        return dg.AssetCheckResult(
            passed=not problems,
            metadata={
                "partitions_checked": len(parts),
                "problems": dg.MetadataValue.json(problems[:20]),
            },
        )

    return _check


@dg.asset_check(
    asset="text_embeddings",
    name="text_embeddings_fp16_saturation",
    description="Caption hidden-state values clamped to the fp16 range when stored (warns above 0).",
)
def text_saturation_check(
    context: dg.AssetCheckExecutionContext, flowmatch: FlowmatchResource
) -> dg.AssetCheckResult:
    parts = run_partitions(context) or flowmatch.layout.partitions_with("text_embeddings")
    per_part = {}
    for p in parts:
        try:
            attrs = read_shard(flowmatch.layout.asset_path("text_embeddings", p)).attrs
        except Exception:  # noqa: BLE001 - the validity check reports unreadable shards
            continue
        per_part[p] = int(attrs.get("fp16_saturated", 0))
    total = sum(per_part.values())
    return dg.AssetCheckResult(
        passed=total == 0,
        severity=dg.AssetCheckSeverity.WARN,
        metadata={
            "saturated_values": total,
            "partitions": dg.MetadataValue.json({k: v for k, v in per_part.items() if v}),
        },
        description=None
        if total == 0
        else f"{total} caption values exceeded fp16 and were clamped: compute the text encoder "
        "in fp32, or check the captions of the listed partitions",
    )


EMBEDDING_CHECKS = [*(_make_check(a) for a in SPECS), text_saturation_check]
