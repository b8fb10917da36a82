"""``flowmatch stale``'s report to Dagster: the ``<asset>_fresh`` checks (and the training
runs' ``flow_model_fresh`` / ``fine_tune_fresh``) made to agree with what is stale now."""

from collections.abc import Sequence

import dagster as dg

from flowmatch_assets import compat
from flowmatch_assets.freshness.fingerprints import (
    Stale,
    fresh_check_name,
    fresh_result,
    fresh_status,
    recorded_fingerprints,
)
from flowmatch_assets.freshness.settings import Settings
from flowmatch_assets.freshness.training_runs import finetuned_runs, has_runs, model_check_results


def report(
    instance: dg.DagsterInstance,
    res: Settings,
    found: Sequence[Stale],
    partitions: Sequence[str],
    assets: Sequence[str],
    run_config: dict | None = None,
    models: Sequence[Stale] | None = None,
) -> int:
    """Make the ``<asset>_fresh`` checks in ``instance`` agree with ``found`` for every
    materialized (asset, partition) asked about (and, given the stale training runs
    ``models``, ``flow_model_fresh`` and ``fine_tune_fresh``: a fine-tune whose parent was
    re-trained outside Dagster shows in the UI too): an evaluation is recorded where the latest
    one says otherwise, all in one run tagged ``flowmatch/cli=stale``. Returns how many.

    (Why a run and not ``report_runless_asset_event``: Dagster 1.13 keys check executions by
    (check, run id, partition), so a second runless evaluation of one partition's check fails
    its UNIQUE constraint.)"""
    bad = {(s.asset, s.partition): s for s in found}
    recs = recorded_fingerprints(res, list(assets), list(partitions))
    evaluations = []
    for a in assets:
        latest = fresh_status(instance, a)
        for p in partitions:
            if (a, p) not in recs:
                continue
            s = bad.get((a, p))
            if latest.get(p) == ("FAILED" if s else "SUCCEEDED"):
                continue
            r = fresh_result(p, s, recs[(a, p)])
            evaluations.append(
                dg.AssetCheckEvaluation(
                    asset_key=dg.AssetKey(a),
                    check_name=fresh_check_name(a),
                    passed=r.passed,
                    partition=p,
                    metadata=r.metadata,
                    description=r.description,
                )
            )
    results = model_check_results(res, models) if models is not None else {}
    has = {"flow_model": has_runs(res), "fine_tune": bool(finetuned_runs(res))}
    for check, (asset, passed, desc, runs) in results.items():
        key = dg.AssetCheckKey(dg.AssetKey(asset), check)
        if not has[asset]:  # no run of that kind: nothing for the check to say
            continue
        if compat.check_status(instance, key) == ("SUCCEEDED" if passed else "FAILED"):
            continue
        evaluations.append(
            dg.AssetCheckEvaluation(
                asset_key=dg.AssetKey(asset),
                check_name=check,
                passed=passed,
                description=desc,
                metadata={"stale_runs": runs},
            )
        )
    if evaluations:
        compat.report_check_evaluations(
            instance,
            evaluations,
            (
                "flowmatch_stale_report",
                "`flowmatch stale` reporting its checks.",
                "report_fresh_checks",
            ),
            tags={"flowmatch/cli": "stale"},
            run_config=run_config,
        )
    return len(evaluations)
