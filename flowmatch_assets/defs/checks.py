"""The freshness checks: ``<asset>_fresh`` per partitioned asset, ``flow_model_fresh`` and
``fine_tune_fresh``.

What stale means is :mod:`flowmatch_assets.freshness.fingerprints`; these only carry its verdict
into the UI. (Each asset's shard checks live beside it: ``images_complete`` in
``data_assets.py``, the embedding kinds' in ``embedding_assets.py``.)
"""

import warnings

import dagster as dg

from flowmatch_assets.defs.resources import FlowmatchResource
from flowmatch_assets.freshness.fingerprints import (
    fresh_check_name,
    fresh_result,
    staleness,
    stored,
)
from flowmatch_assets.freshness.training_runs import model_check_results, model_staleness
from flowmatch_models.storage.layout import PARTITIONED_ASSETS


def build_fresh_checks(partitions_def) -> dg.AssetChecksDefinition:
    """``<asset>_fresh`` for every partitioned asset (the kinds as registered now): per
    partition, fails naming the fingerprint fields that changed (or the stale upstream) against
    the run's settings. One step evaluates the checks of every asset the run selected (a step
    per check would cost more than the fingerprints themselves: BENCHMARKS.md)."""
    with warnings.catch_warnings():  # partitioned checks are "preview" in Dagster 1.13
        warnings.simplefilter("ignore", dg.PreviewWarning)
        specs = [
            dg.AssetCheckSpec(
                fresh_check_name(a),
                asset=a,
                partitions_def=partitions_def,
                description=f"{a}: made with the current settings (fingerprint), from a fresh "
                "upstream partition; fails naming what changed. `flowmatch stale` lists them all.",
            )
            for a in PARTITIONED_ASSETS
        ]

        @dg.multi_asset_check(specs=specs, can_subset=True, name="fingerprints_fresh")
        def _checks(context: dg.AssetCheckExecutionContext, flowmatch: FlowmatchResource):
            part = context.partition_key
            keys = sorted(context.selected_asset_check_keys, key=lambda k: k.name)
            assets = [k.asset_key.to_user_string() for k in keys]
            found = {s.asset: s for s in staleness(flowmatch, [part], assets)}
            for key, a in zip(keys, assets):
                r = fresh_result(part, found.get(a), stored(flowmatch, a, part))
                yield dg.AssetCheckResult(
                    asset_key=key.asset_key,
                    check_name=key.name,
                    passed=r.passed,
                    description=r.description,
                    metadata=r.metadata,
                )

    return _checks


@dg.asset_check(
    asset="flow_model",
    name="flow_model_fresh",
    description="Every training run trained only on partitions that are fresh and unchanged "
    "since (and every fine-tune's parent is unchanged); fails naming the runs and why.",
)
def flow_model_fresh(flowmatch: FlowmatchResource) -> dg.AssetCheckResult:
    return _model_check(flowmatch, "flow_model_fresh")


@dg.asset_check(
    asset="fine_tune",
    name="fine_tune_fresh",
    description="Every fine-tune starts from weights its parent still has (the parent was not "
    "re-trained since) and trained on fresh partitions; fails naming the runs and why.",
)
def fine_tune_fresh(flowmatch: FlowmatchResource) -> dg.AssetCheckResult:
    return _model_check(flowmatch, "fine_tune_fresh")


def _model_check(flowmatch: FlowmatchResource, check: str) -> dg.AssetCheckResult:
    """The verdict `flowmatch stale` reports too (freshness.training_runs.model_check_results)."""
    _, passed, desc, runs = model_check_results(flowmatch, model_staleness(flowmatch))[check]
    return dg.AssetCheckResult(
        passed=passed, description=desc, metadata={"stale_runs": dg.MetadataValue.json(runs)}
    )
