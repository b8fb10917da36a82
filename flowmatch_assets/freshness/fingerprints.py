"""Fingerprints and exact staleness of every asset partition, and what Dagster sees of them.

Every partitioned asset records the fingerprint of what made it (flowmatch_models.storage.fingerprint):
the embedding kinds' comes from the registry (``kind_fingerprint``: model and weights, the
role's preprocessing, dtypes, codec, code version), the data assets' from their settings below.
Each also records the fingerprint hash of its upstream partition (``inputs``). It is stored in
the catalog record (``extra.fingerprint``; the ``fingerprints`` view), in the embedding shard's
attrs, in the materialization's metadata, and it is the Dagster data version
(``<fingerprint hash>-<content id>``) under the asset's ``code_version``.

**Stale** (:func:`staleness`): a materialized partition whose stored fields differ from the
fields the current settings would record (the reason names each field: ``max_tokens: 128 ->
64``), or whose upstream partition is stale, or was re-made with another fingerprint than the
one it was made from; a partition without a fingerprint (made before them) is stale as
``unknown``. ``flow_model`` (per run) is stale when a partition it trained on is stale or was
re-made since. Dagster's own partition staleness misses code-version bumps on partitioned
assets (its issues 22704, 22553, 18921) and cannot see a settings change before anything is
re-made, so the UI shows ours: the per-partition ``<asset>_fresh`` check (run with every
materialization, and reported by ``flowmatch stale``) fails naming the changed fields.
"""

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import dagster as dg

from flowmatch_assets import catalog, compat
from flowmatch_assets.freshness.settings import Settings
from flowmatch_assets.ingest.metadata import filter_fields
from flowmatch_assets.ingest.sources import SourceError, partition_source
from flowmatch_models.data.buckets import label
from flowmatch_models.embeddings.kinds import (
    KINDS,
    compute_agrees,
    kind_fingerprint,
)
from flowmatch_models.storage.fingerprint import (
    Fingerprint,
    as_resolved,
    diff,
    hash_of,
    weights_cache_file,
)
from flowmatch_models.storage.layout import PARTITIONED_ASSETS, source_of

#: Bump when the asset's code changes its output for the same settings (a fingerprint field).
#: Embedding kinds carry theirs in the registry (EmbeddingKind.code_version).
CODE_VERSIONS = {"metadata": "1", "images": "1"}
NO_FINGERPRINT = "no fingerprint recorded (made before fingerprints): unknown"
_NONE = object()  # an upstream partition with no record


def code_version(asset: str) -> str:
    return KINDS[asset].code_version if asset in KINDS else CODE_VERSIONS.get(asset, "1")


def upstream_of(asset: str) -> str | None:
    """The partitioned asset one partition of ``asset`` is made from (every embedding kind:
    images; an asset this module does not know: none)."""
    if asset in KINDS:
        return "images"
    return {"images": "metadata"}.get(asset)


def expected_fields(res: Settings, asset: str, partition: str | None = None) -> dict:
    """The fields a materialization of ``asset`` (for ``partition``: its source's settings
    matter to the rows stage) under ``res``'s settings records (a local model folder is hashed
    once per process, and remembered in the data root). A source's rows record its settings
    that change the rows (what a partition holds is fixed by its manifest when it is registered),
    the same for every partition of the source."""
    if asset == "metadata":  # the partition's source says what else its rows depend on
        return {
            "code_version": code_version(asset),
            **partition_source(res, partition).row_fields(),
            "filters": filter_fields(res.filters),
        }
    if asset == "images":
        ing = res.ingest
        return {
            "code_version": code_version(asset),
            "image_size": ing.size,
            "image_format": ing.image_format,
            "quality": ing.quality,
            "min_side": ing.min_side,
            "max_pixels": ing.max_pixels,
            # square shards (the default, and every shard before buckets) keep their fingerprint
            **(
                {"buckets": [label(b) for b in ing.bucket_list()]}
                if ing.buckets != "square"
                else {}
            ),
        }
    if asset not in KINDS:  # another asset publishing through the routine: its code only
        return {"code_version": code_version(asset)}
    cache = weights_cache_file(res.data_root)
    return kind_fingerprint(KINDS[asset], res.encoders, weights_cache=cache).fields


def stored(res: Settings, asset: str, partition: str) -> Fingerprint | None:
    """The fingerprint in the partition's catalog record (None: no record or none recorded)."""
    rec = catalog.read_materialization(res.data_root, asset, partition)
    return _from_record(rec) if rec else None


def _from_record(rec: dict) -> Fingerprint | None:
    return Fingerprint.from_json(json.loads(rec.get("extra") or "{}").get("fingerprint"))


def inputs_of(res: Settings, asset: str, partition: str) -> dict[str, str]:
    """``{upstream: its stored fingerprint hash}`` for a materialization of ``asset`` now."""
    up = upstream_of(asset)
    return {up: hash_of(stored(res, up, partition))} if up else {}


def current(res: Settings, asset: str, partition: str) -> Fingerprint:
    """The fingerprint a materialization of ``asset``'s ``partition`` records now."""
    return Fingerprint(expected_fields(res, asset, partition), inputs_of(res, asset, partition))


def content_id(path) -> str:
    """A cheap identity of a partition file's content: the store footer's header hash (which
    covers every array's checksum), or for parquet an xxh3 of its id, md5/hash, caption and
    image columns (the images shard is still in the page cache when it is published).
    ``path``: a path, or an open pyarrow file (a memory map: the version it maps)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import xxhash

    if isinstance(path, pa.NativeFile):
        if path.read_at(4, 0) != b"PAR1":
            return path.read_at(32, path.size() - 32)[16:24].hex()
    else:
        with open(path, "rb") as f:  # by content: a file being published has its temp name
            if f.read(4) != b"PAR1":
                f.seek(-32, 2)
                return f.read(32)[16:24].hex()
    names = pq.read_schema(path).names
    cols = [c for c in ("id", "md5", "hash", "caption", "image") if c in names]
    t = pq.read_table(path, columns=cols)
    h = xxhash.xxh3_64(str(t.num_rows).encode())
    for c in cols:
        for chunk in t.column(c).chunks:
            for buf in chunk.buffers():
                if buf is not None:
                    h.update(memoryview(buf))
    return h.hexdigest()


def data_version(fp: Fingerprint, path: Path) -> dg.DataVersion:
    """The Dagster data version of a partition: what made it, and a content id. A re-run that
    changes the rows (a retry that recovers images) or the fingerprint makes the downstream
    partitions stale in the UI; one that made exactly the same shard does not."""
    return dg.DataVersion(f"{fp.hash}-{content_id(path)}")


def metadata(fp: Fingerprint) -> dict:
    """What the materialization shows of its fingerprint."""
    return {
        "fingerprint_hash": fp.hash,
        "fingerprint": dg.MetadataValue.json(fp.to_json()),
    }


# ------------------------------------------------------------------------------ staleness


@dataclass(frozen=True)
class Stale:
    """One stale asset partition (``flow_model``: its partition is the run name) and why."""

    asset: str
    partition: str
    reasons: tuple[str, ...]

    @property
    def reason(self) -> str:
        return "; ".join(self.reasons)


def recorded_fingerprints(
    res: Settings, assets: Sequence[str], partitions: Sequence[str] | None
) -> dict[tuple[str, str], Fingerprint | None]:
    """``(asset, partition) -> stored fingerprint`` of every materialized one asked for (a few
    partitions: their record files; otherwise one catalog query)."""
    if partitions is not None and len(partitions) * len(assets) <= 64:
        out = {}
        for a in assets:
            for p in partitions:
                rec = catalog.read_materialization(res.data_root, a, p)
                if rec is not None:
                    out[(a, p)] = _from_record(rec)
        return out
    rows = catalog.Catalog(res.data_root).query(
        "SELECT asset, partition, fingerprint_json FROM fingerprints "
        "WHERE asset IN (SELECT unnest(?))",
        [list(assets)],
    )
    want = set(partitions) if partitions is not None else None
    parsed: dict[str | None, Fingerprint | None] = {}  # most partitions share a fingerprint
    out = {}
    for r in rows:
        if want is None or r["partition"] in want:
            j = r["fingerprint_json"]
            if j not in parsed:
                parsed[j] = Fingerprint.from_json(j)
            out[(r["asset"], r["partition"])] = parsed[j]
    return out


def staleness(
    res: Settings,
    partitions: Sequence[str] | None = None,
    assets: Sequence[str] | None = None,
) -> list[Stale]:
    """Stale partitions of ``assets`` (default: every partitioned asset) among ``partitions``
    (default: every materialized one), in partition then lineage order. A partition that is not
    materialized is missing, not stale (`--missing` handles it)."""
    lineage = list(PARTITIONED_ASSETS)
    wanted = set(assets or lineage)
    # an asset's staleness needs its upstream chain's
    need = [a for a in lineage if any(_feeds(a, w) for w in wanted)]
    recs = recorded_fingerprints(res, need, partitions)
    expected: dict[str, dict] = {}
    diffs: dict[tuple, list[str]] = {}  # (fingerprint, expectation) -> the fields that differ
    parts = sorted({p for _, p in recs}) if partitions is None else list(partitions)
    out = []
    for p in parts:
        stale: dict[str, tuple[str, ...]] = {}
        row_stale: dict[str, tuple[str, ...]] = {}  # stale in a way that changes the rows
        for a in need:
            if (a, p) not in recs:
                continue
            fp = recs[(a, p)]
            if fp is None:
                reasons = [NO_FINGERPRINT]
                row_reasons = list(reasons)
            else:
                # a source's rows depend on its settings; everything else on the asset's
                key = (a, source_of(p)) if a == "metadata" else a
                if key not in expected:
                    try:
                        expected[key] = expected_fields(res, a, p)
                    except SourceError as e:  # the source was removed, or its manifest
                        expected[key] = {"source": f"unavailable ({str(e).split(';')[0]})"}
                if (id(fp), key) not in diffs:
                    diffs[(id(fp), key)] = diff(_compared(res, a, fp, expected[key]), expected[key])
                changed = diffs[(id(fp), key)]
                links = _upstream_reasons(
                    a,
                    fp,
                    recs.get((up, p), _NONE) if (up := upstream_of(a)) else _NONE,
                    stale,
                    row_stale,
                )
                reasons = [*changed, *links]
                keep = ROW_FIELDS.get(a)
                row_reasons = [r for r in changed if keep is None or _field(r) in keep] + links
            if reasons:
                stale[a] = tuple(reasons)
                if row_reasons:
                    row_stale[a] = tuple(row_reasons)
                if a in wanted:
                    out.append(Stale(a, p, tuple(reasons)))
    return out


def _compared(res: Settings, asset: str, fp: Fingerprint, expected: dict) -> dict:
    """A kind's stored fields as compared with the ``expected`` ones: one recorded before the
    resolved compute dtype as what ``auto`` resolves to here (``as_resolved``), and a compute
    dtype and device that the settings make where it was made (``compute_agrees``) as agreeing."""
    if asset not in KINDS:
        return fp.fields
    fields = as_resolved(fp).fields  # type: ignore[union-attr]
    if compute_agrees(KINDS[asset], res.encoders, fields):
        fields = {
            **fields,
            **{k: expected[k] for k in ("compute_dtype", "device") if k in expected},
        }
    return fields


#: An asset's fingerprint fields that change which rows it holds (an images setting such as the
#: JPEG quality changes the pixels, not the rows): only these reach a caption kind, which reads
#: the rows' ids and captions alone. An asset not named here: every field.
ROW_FIELDS = {"images": ("code_version", "min_side", "max_pixels")}


def _field(reason: str) -> str:
    """The top-level field a ``diff`` line names (``filters.min_width: 0 -> 64``: filters)."""
    return reason.split(":", 1)[0].split(".", 1)[0]


def _upstream_reasons(
    asset: str,
    fp: Fingerprint,
    upfp: Fingerprint | None | object,
    stale: dict[str, tuple[str, ...]],
    row_stale: dict[str, tuple[str, ...]],
) -> list[str]:
    """Why ``asset``'s partition (fingerprint ``fp``) is stale through its upstream partition
    (``upfp``: its record's fingerprint; ``_NONE``: no record): the upstream is stale, or was
    re-made with another fingerprint, or holds other rows than ``fp`` was made from. A kind made
    from exactly the rows it reads (a caption kind: ``rows`` and no upstream fingerprint in its
    inputs, flowmatch_models.embeddings.kinds.kind_inputs) follows only the upstream changes
    that change those rows; a fingerprint from before exact inputs reads as it always did."""
    up = upstream_of(asset)
    if up is None:
        return []
    out = []
    if asset in KINDS and fp.rows and up not in fp.inputs:
        if up in row_stale:
            out.append(f"upstream {up} will hold other rows ({row_stale[up][0]})")
    elif up in stale:
        out.append(f"upstream {up} is stale ({stale[up][0]})")
    elif upfp is not _NONE and hash_of(upfp) != fp.inputs.get(up):  # type: ignore[arg-type]
        out.append(
            f"{up} was re-made with another fingerprint since "
            f"({fp.inputs.get(up)} -> {hash_of(upfp)})"  # type: ignore[arg-type]
        )
    now = upfp.rows if isinstance(upfp, Fingerprint) else {}
    for what, digest in fp.rows.items():  # the rows it was made from, against the rows now
        if asset in KINDS and now.get(what) not in (None, digest):
            out.append(f"{up} holds other {what} since ({digest} -> {now[what]})")
    return out


def _feeds(a: str, b: str) -> bool:
    """``a`` is ``b`` or upstream of it."""
    while b is not None:
        if a == b:
            return True
        b = upstream_of(b)
    return False


# --------------------------------------------------------------------------- Dagster view


def fresh_check_name(asset: str) -> str:
    return f"{asset}_fresh"


def fresh_result(
    partition: str, stale: Stale | None, fp: Fingerprint | None
) -> dg.AssetCheckResult:
    return dg.AssetCheckResult(
        passed=stale is None,
        description=f"{partition} stale: {stale.reason}" if stale else f"{partition} fresh",
        metadata={
            "partition": partition,
            "fingerprint_hash": hash_of(fp),
            "changed": dg.MetadataValue.json(list(stale.reasons) if stale else []),
        },
    )


def fresh_status(instance: dg.DagsterInstance, asset: str) -> dict[str, str]:
    """``{partition: SUCCEEDED | FAILED | ...}``: the latest ``<asset>_fresh`` evaluation."""
    key = dg.AssetCheckKey(dg.AssetKey(asset), fresh_check_name(asset))
    return compat.check_partition_status(instance, key)


def stale_groups(found: Sequence[Stale]) -> list[tuple[list[str], list[str]]]:
    """``found`` (partitioned assets only) as ``(assets in lineage order, partitions)`` groups:
    each partition with exactly its stale assets, partitions with the same set together (one
    backfill each: a backfill runs every selected asset on every selected partition)."""
    per: dict[str, set[str]] = {}
    for s in found:
        if s.asset in PARTITIONED_ASSETS:
            per.setdefault(s.partition, set()).add(s.asset)
    groups: dict[tuple[str, ...], list[str]] = {}
    for p, assets in sorted(per.items()):
        groups.setdefault(tuple(a for a in PARTITIONED_ASSETS if a in assets), []).append(p)
    return [(list(a), parts) for a, parts in groups.items()]
