"""The embedding kinds' asset checks: per kind the blocking ``<kind>_valid`` (shapes, dtypes,
finite values, checksums, ids aligned with images) and one warning check per ``WarnRule``, as
check steps after a run of one partition, and their evaluations from a run of many partitions
(:func:`run_checks`, which ``encode_partitions`` yields once for the run's published partitions)."""

from collections.abc import Sequence

import dagster as dg

from flowmatch_assets.defs.resources import FlowmatchResource
from flowmatch_assets.defs.routine import run_partitions, shards_check_result
from flowmatch_models.embeddings.checks import shard_problems
from flowmatch_models.embeddings.kinds import KINDS, EmbeddingKind
from flowmatch_models.storage.image_shard import read_image_meta
from flowmatch_models.storage.store import read_shard


def check_shards(flowmatch: FlowmatchResource, asset: str, parts: list[str]) -> list[str]:
    """Problems of ``asset``'s shards: the kind's rules (shapes, dtypes, finiteness, rows,
    ragged lengths), checksums, and ids aligned with images."""
    layout, kind = flowmatch.layout, KINDS[asset]
    problems = []
    for p in parts:
        try:
            shard = read_shard(layout.asset_path(asset, p), verify=True)
        except Exception as e:  # noqa: BLE001 - every problem is reported, not raised
            problems.append(f"{p}: {e}")
            continue
        ids = read_image_meta(layout.asset_path("images", p)).column("id").to_pylist()
        problems += [f"{p}: {x}" for x in shard_problems(kind, shard, ids)]
    return problems


def _valid_check(kind: EmbeddingKind) -> dg.AssetChecksDefinition:
    @dg.asset_check(
        asset=kind.name,
        name=f"{kind.name}_valid",
        blocking=True,
        description=f"{kind.name}: shapes and dtypes, finite values, checksums, ids aligned with images.",
    )
    def _check(
        context: dg.AssetCheckExecutionContext, flowmatch: FlowmatchResource
    ) -> dg.AssetCheckResult:
        parts = run_partitions(context) or flowmatch.layout.partitions_with(kind.name)
        return shards_check_result(parts, check_shards(flowmatch, kind.name, parts))

    return _check


def _warn_check(kind: EmbeddingKind, rule) -> dg.AssetChecksDefinition:
    @dg.asset_check(asset=kind.name, name=f"{kind.name}_{rule.name}", description=rule.description)
    def _check(
        context: dg.AssetCheckExecutionContext, flowmatch: FlowmatchResource
    ) -> dg.AssetCheckResult:
        layout = flowmatch.layout
        per_part = {}
        for p in run_partitions(context) or layout.partitions_with(kind.name):
            try:
                attrs = read_shard(layout.asset_path(kind.name, p)).attrs
            except Exception:  # noqa: BLE001 - the validity check reports unreadable shards
                continue
            per_part[p] = int(attrs.get(rule.attr, 0))
        return warn_result(rule, per_part)

    return _check


def warn_result(rule, per_part: dict[str, int]) -> dg.AssetCheckResult:
    total = sum(per_part.values())
    return dg.AssetCheckResult(
        passed=total == 0,
        severity=dg.AssetCheckSeverity.WARN,
        metadata={
            f"{rule.attr}_values": total,
            "partitions": dg.MetadataValue.json({k: v for k, v in per_part.items() if v}),
        },
        description=None if total == 0 else f"{total} {rule.attr} values: {rule.fix}",
    )


def build_embedding_checks(kinds: Sequence[EmbeddingKind]) -> list[dg.AssetChecksDefinition]:
    """Per kind: the blocking validity check, then one warning check per WarnRule."""
    return [c for k in kinds for c in (_valid_check(k), *(_warn_check(k, w) for w in k.warnings))]


def run_checks(selected: list[EmbeddingKind], published: list):
    """``<kind>_valid`` and the warning checks over a run's published partitions (each with
    ``partition``, ``results``, ``problems`` and ``warnings`` per kind: embedding_assets'
    ``_Published``): one evaluation each (as a run of one partition records one)."""
    for k in selected:
        parts = [p for p in published if k.name in p.results]
        if not parts:
            continue
        problems = [x for p in parts for x in p.problems[k.name]]
        r = shards_check_result([p.partition for p in parts], problems)
        yield dg.AssetCheckEvaluation(
            asset_key=dg.AssetKey(k.name),
            check_name=f"{k.name}_valid",
            passed=r.passed,
            metadata=r.metadata,
            blocking=True,
        )
        for rule in k.warnings:
            per = {p.partition: p.warnings[k.name][rule.attr] for p in parts}
            w = warn_result(rule, per)
            yield dg.AssetCheckEvaluation(
                asset_key=dg.AssetKey(k.name),
                check_name=f"{k.name}_{rule.name}",
                passed=w.passed,
                metadata=w.metadata,
                description=w.description,
                severity=dg.AssetCheckSeverity.WARN,
            )
