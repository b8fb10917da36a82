"""Embedding assets: one step per partition computes every selected embedding kind
(flowmatch_models.embeddings: DC-AE latents, DINOv2 features, Gemma3 caption embeddings and any
kind registered since) from the partition's images shard, each stored as one store file.

Everything here is built from the registry: the multi-asset's specs, its validity checks and
the warning checks. The step runs in Dagster's ``gpu`` pool (at most as many at once as the pool
allows: set it to the GPU count) and takes a device lease (flowmatch_models.encoders.devices), so two
partitions never share a GPU; without CUDA it runs on the CPU.
"""

import os
import time
import traceback
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import dagster as dg
import numpy as np
import pyarrow.parquet as pq

from flowmatch_assets import compat
from flowmatch_assets.catalog import RowOutcome
from flowmatch_assets.defs.data_assets import images
from flowmatch_assets.defs.deploy import ENCODER_TAGS, GPU_POOL
from flowmatch_assets.defs.embedding_checks import check_shards, run_checks
from flowmatch_assets.defs.partitions import shard_partitions
from flowmatch_assets.defs.resources import FlowmatchResource
from flowmatch_assets.defs.routine import (
    PartitionOutput,
    human_bytes,
    pin_version,
)
from flowmatch_assets.freshness import fingerprints
from flowmatch_assets.freshness.fingerprints import fresh_result, staleness
from flowmatch_assets.freshness.fingerprints import stored as shard_fp
from flowmatch_models.embeddings.kinds import KINDS, EmbeddingKind
from flowmatch_models.embeddings.precalc import Ahead, encode_partition, read_ahead
from flowmatch_models.encoders.devices import lease_device
from flowmatch_models.storage import remote
from flowmatch_models.storage.fingerprint import ATTR as FINGERPRINT_ATTR
from flowmatch_models.storage.fingerprint import Fingerprint, weights_cache_file
from flowmatch_models.storage.store import read_shard, write_shard

GROUP = "embeddings"


#: Partitions one run of the embedding step encodes at most: a backfill over many partitions is
#: cut into runs of this many (``BackfillPolicy.multi_run``), each loading its encoders once
#: (``FLOWMATCH_EMBED_PARTITIONS_PER_RUN``; BENCHMARKS.md "Precompute").
PARTITIONS_PER_RUN = int(os.environ.get("FLOWMATCH_EMBED_PARTITIONS_PER_RUN", "64"))


def build_encode_embeddings(kinds: Sequence[EmbeddingKind]) -> dg.AssetsDefinition:
    """The ``encode_embeddings`` multi-asset: one asset per kind, any subset selectable."""

    @dg.multi_asset(
        specs=[
            dg.AssetSpec(
                k.name,
                deps=[images],
                description=k.description,
                group_name=GROUP,
                kinds=set(k.tags),
                skippable=True,
                code_version=k.code_version,
            )
            for k in kinds
        ],
        partitions_def=shard_partitions,
        can_subset=True,
        pool=GPU_POOL,
        op_tags=ENCODER_TAGS,
        name="encode_embeddings",
        backfill_policy=dg.BackfillPolicy.multi_run(max_partitions_per_run=PARTITIONS_PER_RUN),
    )
    def encode_embeddings(context: dg.AssetExecutionContext, flowmatch: FlowmatchResource):
        """Encode the run's partitions with the selected kinds; write and publish each kind's
        shard of each partition atomically, through one path for a run of one partition and a
        backfill's run of many (:func:`encode_partitions`)."""
        selected = [KINDS[k.to_user_string()] for k in context.selected_asset_keys]
        yield from encode_partitions(context, flowmatch, selected)

    return encode_embeddings


def _encode(
    context,
    flowmatch: FlowmatchResource,
    part: str,
    selected: list[EmbeddingKind],
    device: str,
    ahead: Ahead | None = None,
):
    """``(ids, {kind: Encoded})`` of one partition on the leased ``device`` (encoders shared
    across partitions; ``ahead``: this partition read ahead, :func:`_read_ahead`, closed here)."""
    try:
        # with a remote data root the images shard is fetched here (its marker came with the sync)
        src = remote.ensure(flowmatch.layout.asset_path("images", part))
        if ahead is None:  # the cheap refusals before any encoder loads
            if not src.exists():
                raise dg.Failure(
                    f"partition {part} has no images shard ({src}); materialize images first"
                )
            if pq.ParquetFile(src).metadata.num_rows == 0:
                raise _no_images(part, selected)
            ahead = _read_ahead(flowmatch, part, selected, device)
        return _encode_one(context, flowmatch, part, selected, device, ahead)
    finally:
        if ahead is not None:
            ahead.close()


def _encode_one(context, flowmatch, part: str, selected, device: str, ahead: Ahead):
    spec = flowmatch.encoders
    src = ahead.path
    ids = ahead.meta().column("id").to_pylist()  # the rows encoded (one version of the file)
    # what it was made from: that version's (pinned when it was mapped), never the record's now
    inputs = (
        ahead.version.inputs if ahead.version else fingerprints.inputs_of(flowmatch, "images", part)
    )
    if not ids:  # an empty shard never replaces a good one (nor is written at all)
        raise _no_images(part, selected)
    context.log.info(f"{part}: encoding {len(ids)} samples on {device}")
    encoded = encode_partition(
        src,
        selected,
        spec,
        device,
        log=_every(10.0, lambda m: context.log.info(f"{part}: {m}")),
        inputs=inputs,
        weights_cache=weights_cache_file(flowmatch.data_root),
        ahead=ahead,
    )
    return ids, encoded


def _no_images(part: str, selected) -> dg.Failure:
    return dg.Failure(
        f"partition {part}: images has 0 images, nothing to encode; the existing "
        f"{', '.join(k.name for k in selected)} shards (if any) are unchanged. "
        "Re-materialize images (see `flowmatch catalog failures`) first."
    )


def _every(seconds: float, log):
    """``log`` at most once per ``seconds`` (a progress line per batch would be an event in
    Dagster's storage per batch: ~160 a PD12M partition)."""
    last = [-float("inf")]

    def say(m: str) -> None:
        now = time.monotonic()
        if now - last[0] >= seconds:
            last[0] = now
            log(m)

    return say


def _read_ahead(flowmatch: FlowmatchResource, part: str, selected, device: str) -> Ahead | None:
    """``part``'s images shard read ahead (rows, tokens, first batches) while the one before it
    is encoded, pinned to the version it maps (its fingerprint and data version: what the shards
    made from it record, :func:`pin_version`); None when it has no shard (its encode says so)."""
    src = flowmatch.layout.asset_path("images", part)
    if not src.exists():
        return None
    return read_ahead(
        src,
        selected,
        flowmatch.encoders,
        device,
        weights_cache_file(flowmatch.data_root),
        pin=pin_version(flowmatch, "images", part),
    )


@dataclass
class _Published:
    """What the writer thread did with one partition: each kind's result or its error, and
    what the kind's checks found in its new shard."""

    partition: str
    results: dict[str, dg.MaterializeResult] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    problems: dict[str, list[str]] = field(default_factory=dict)
    warnings: dict[str, dict[str, int]] = field(default_factory=dict)
    fresh: dict[str, dg.AssetCheckResult] = field(default_factory=dict)


def _publish_partition(
    context, flowmatch: FlowmatchResource, part: str, ids, encoded, checks: bool = True
) -> _Published:
    """Fit, write and publish every kind of one partition, then (``checks``) run its kinds'
    checks on what was published (the writer thread's work: it overlaps the next partition's
    encoding). A kind that fails fails alone: its error is kept, the other kinds go on."""
    out = _Published(part)
    for name, e in encoded.items():
        try:
            out.results[name] = _store(context, flowmatch, e, ids, part)
        except Exception as exc:  # noqa: BLE001 - a kind that fails fails alone
            out.errors[name] = _error(exc)
            continue
        if not checks:
            continue
        try:  # published: its checks' verdicts (a check that cannot run is a problem)
            out.problems[name] = check_shards(flowmatch, name, [part])
            attrs = read_shard(flowmatch.layout.asset_path(name, part)).attrs
            out.warnings[name] = {w.attr: int(attrs.get(w.attr, 0)) for w in KINDS[name].warnings}
        except Exception as exc:  # noqa: BLE001
            out.problems[name] = [f"{part}: checking the shard failed: {_error(exc)[0]}"]
            out.warnings[name] = {w.attr: 0 for w in KINDS[name].warnings}
    done = list(out.results) if checks else []
    try:
        found = {st.asset: st for st in staleness(flowmatch, [part], done)} if done else {}
        for name in done:
            out.fresh[name] = fresh_result(part, found.get(name), shard_fp(flowmatch, name, part))
    except Exception as exc:  # noqa: BLE001 - reported as published; `flowmatch stale` re-checks
        context.log.warning(f"{part}: the freshness check could not run: {_error(exc)[0]}")
    return out


def encode_partitions(context, flowmatch: FlowmatchResource, selected: list[EmbeddingKind]):
    """The one publish path of a run's partitions, one or a backfill's many: the encoders load
    once (for the whole run) on one leased device held until the last partition is written,
    and while partition i+1 is encoded, partition i is fitted, written and published on a
    writer thread (:func:`_publish_partition`). Each partition is published atomically on its
    own (``PartitionOutput``). A partition, or a kind of one, that fails fails alone: the
    others are published, each error is logged with its traceback when it happens, and the run
    fails at the end naming every failed partition and kind.

    What Dagster hears is the one difference. A run of one partition yields each kind's
    result as its output (the steps after it in the run, the kinds' checks among them, take
    it). A run of many reports each partition as its own materialization, with its checks'
    evaluations: ``<kind>_fresh`` per partition, ``<kind>_valid`` and the warnings once for
    the run's partitions (yielded: a failed ``_valid`` fails the run, as it blocks a run of
    one). A partition published before the run is stopped or crashes is still reported."""
    keys = list(context.partition_keys)
    t0, n = time.perf_counter(), len(keys)
    single = n == 1  # its results are the step's outputs, its checks the steps after it
    outputs: list[dg.MaterializeResult] = []
    failed: dict[str, list[str]] = {}  # partition -> "kind: why" (or why, for all its kinds)
    published: list[_Published] = []
    pending: tuple[str, Future] | None = None

    def fail(part: str, what: str, err: tuple[str, str]) -> None:
        failed.setdefault(part, []).append(f"{what}{err[0]}")
        context.log.error(f"{part}: {what}{err[0]}\n{err[1]}")

    def report(part: str, fut: Future, as_outputs: bool = False) -> None:
        try:
            got = fut.result()
        except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
            fail(part, "", _error(exc))
            return
        for name, r in got.results.items():
            if as_outputs:
                outputs.append(r)
                continue
            context.log_event(_materialization(context, flowmatch, name, part, r))
            if name in got.fresh:
                f = got.fresh[name]
                context.log_event(
                    dg.AssetCheckEvaluation(
                        asset_key=dg.AssetKey(name),
                        check_name=fingerprints.fresh_check_name(name),
                        passed=f.passed,
                        partition=part,
                        metadata=f.metadata,
                        description=f.description,
                    )
                )
        for name, err in got.errors.items():
            fail(part, f"{name}: ", err)
        published.append(got)

    with lease_device(flowmatch.encoders.device) as device:
        with ThreadPoolExecutor(1, thread_name_prefix="flowmatch-publish") as writer:
            ahead: Ahead | None = None  # the next partition, read while this one encodes
            finished = False
            try:
                for i, part in enumerate(keys):
                    cur, ahead = ahead, None
                    try:
                        if i + 1 < n:
                            try:
                                ahead = _read_ahead(flowmatch, keys[i + 1], selected, device)
                            except Exception:  # noqa: BLE001 - that partition's encode says why
                                ahead = None
                        ids, encoded = _encode(context, flowmatch, part, selected, device, cur)
                    except Exception as exc:  # noqa: BLE001 - this partition fails alone
                        fail(part, "", _error(exc))
                        encoded = None
                    if pending is not None:
                        report(*pending)
                        pending = None
                    if encoded is not None:
                        fut = writer.submit(
                            _publish_partition, context, flowmatch, part, ids, encoded, not single
                        )
                        pending = (part, fut)
                        del ids, encoded  # the writer holds them now
                    rate = (i + 1) / max(time.perf_counter() - t0, 1e-9)
                    context.log.info(
                        f"[{i + 1}/{n}] {part} encoded ({rate * 60:.1f} partitions/min)"
                    )
                finished = True
            finally:  # stopped, crashed or done: what was published is reported
                if ahead is not None:
                    ahead.close()
                if pending is not None:  # a stopped run of one logs it: no output follows
                    report(*pending, as_outputs=single and finished)
    yield from outputs if single else run_checks(selected, published)
    if failed:
        lines = [f"{p}: {'; '.join(why)}" for p, why in failed.items()]
        ok = sum(1 for p in published if p.results)
        raise dg.Failure(
            description=f"{len(failed)} of {n} partitions failed ({ok} published): "
            + "; ".join(lines[:5])
            + (f" ... and {len(lines) - 5} more (see the run's log)" if len(lines) > 5 else ""),
            metadata={"failed": dg.MetadataValue.json(failed), "published": ok},
        )


def _materialization(context, flowmatch, name: str, part: str, r: dg.MaterializeResult):
    """One partition's materialization event, as Dagster would record its output's."""
    tags = compat.partition_materialization_tags(
        context.instance, r.data_version, KINDS[name].code_version, [("images", part)]
    )
    backfill = context.run.tags.get("dagster/backfill") if context.run else None
    return dg.AssetMaterialization(
        asset_key=name,
        partition=part,
        metadata=r.metadata,
        tags={**tags, **(r.tags or {}), **({"dagster/backfill": backfill} if backfill else {})},
    )


def _error(exc: BaseException) -> tuple[str, str]:
    """``(its first line, its traceback)``."""
    text = getattr(exc, "description", None) or str(exc) or type(exc).__name__
    return text.strip().splitlines()[0][:500], "".join(traceback.format_exception(exc))


def _store(
    context, flowmatch: FlowmatchResource, e, ids: list[str], part: str
) -> dg.MaterializeResult:
    """Write one kind's shard and publish it (catalog rows + record, metadata), together."""
    with PartitionOutput(context, flowmatch, e.kind.name, part) as out:
        return _publish_kind(context, flowmatch, e, ids, out)


def _publish_kind(
    context, flowmatch: FlowmatchResource, e, ids: list[str], out: PartitionOutput
) -> dg.MaterializeResult:
    kind, spec = e.kind, flowmatch.encoders
    mode = spec.lossy.get(kind.name)
    lossy = dict.fromkeys(kind.lossy, mode) if mode else None
    stats = write_shard(
        out.path,
        e.arrays,
        ids,
        codec=spec.codec,
        attrs=e.attrs,
        lossy=lossy,
        fit_device=e.attrs["device"],
    )
    errs = [a["lossy"] for a in stats.arrays.values() if "lossy" in a]
    modes = sorted({x["mode"] for x in errs})
    storage = ", ".join(
        [
            *(f"lossy {m}" for m in modes),
            "no byte codec" if spec.codec == "none" else f"{spec.codec} codec",
        ]
    )
    seed = kind.seed_format_bytes(len(ids), spec, e.arrays)
    counts = {w.attr: e.attrs[w.attr] for w in kind.warnings}
    ragged = {}  # a kind with token rows: how many, and the bytes of one (the SSD projection)
    for a in kind.arrays:
        if a.rows == "token" and "lengths" in e.arrays:
            tokens = int(np.asarray(e.arrays["lengths"]).sum())
            st = stats.arrays[a.name]
            ragged = {
                "tokens": tokens,
                "token_row_bytes": st.get("row_bytes") or st["stored_bytes"] / max(tokens, 1),
            }
    label = f" ({e.attrs['weights']})" if e.attrs["weights"] else ""
    context.log.info(
        f"{out.partition}: {kind.name} {len(ids)} samples, {stats.stored_bytes} B{label}"
    )
    return out.publish(
        samples=len(ids),
        rows=[RowOutcome(i, None, "stored") for i in ids],
        seconds=e.seconds,
        raw_bytes=seed,
        stored_bytes=stats.stored_bytes,
        fingerprint=Fingerprint.from_json(e.attrs[FINGERPRINT_ATTR]),
        # the images version read, not whichever is latest when Dagster handles the output
        tags=e.version.tags(context.instance) if e.version is not None else None,
        codec=spec.codec + (f"+{'/'.join(modes)}" if modes else ""),
        device=e.attrs["device"],
        lossy_min_cosine=min((x["min_cosine"] for x in errs), default=None),
        lossy_rel_rms=max((x["rel_rms"] for x in errs), default=None),
        extra={
            "model": e.attrs["model"],
            "random_weights": e.attrs["random_weights"],
            "weights": e.attrs["weights"],  # its label: random, demo VAE, real Gemma, or ""
            "array_bytes": stats.raw_bytes,
            **counts,
            **ragged,
        },
        metadata={
            "samples": len(ids),
            "stored_bytes": stats.stored_bytes,
            "stored_size": human_bytes(stats.stored_bytes),
            # one label: the byte codec, then the lossy encoding of the arrays that have one
            "storage": storage,
            "lossy_error": dg.MetadataValue.json(errs),
            "array_bytes": stats.raw_bytes,  # the arrays as fp16/int, before any codec
            # the seed pipeline's format (per-sample xz of padded fp32 tensors, what the
            # project grew from: docs/catalog.md) for these samples, and this shard against it
            "seed_format_bytes": seed,
            "vs_seed_format": _vs_seed(seed, stats.stored_bytes),
            "samples_per_s": round(len(ids) / e.seconds, 2) if e.seconds else 0.0,
            "device": e.attrs["device"],
            "model": e.attrs["model"] + label,
            "random_weights": bool(e.attrs["random_weights"]),
            **{f"{a}_values": v for a, v in counts.items()},
        },
    )


def _vs_seed(seed: int, stored: int) -> str:
    """This shard against the seed pipeline's format: ``12.9x smaller (...)`` or, where the
    seed's format is the smaller one, ``1.01x larger (...)`` -- never "smaller" for larger."""
    if not stored or not seed:
        return "-"
    sizes = f"{human_bytes(seed)} in the seed's per-sample xz format -> {human_bytes(stored)} here"
    if stored <= seed:
        return f"{seed / stored:.1f}x smaller ({sizes})"
    return f"{stored / seed:.2f}x larger ({sizes})"
