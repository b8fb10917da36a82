"""The training runs' freshness: what a run trained on (its record's input fingerprints), which
runs are stale now (a partition they trained on is stale or was re-made since; a fine-tune's
parent re-trained or stale), and the verdicts of ``flow_model_fresh`` / ``fine_tune_fresh``.
The partitions' own staleness is fingerprints.py's."""

import json
from collections.abc import Iterable, Sequence

from flowmatch_assets import catalog
from flowmatch_assets.freshness.fingerprints import (
    Stale,
    fresh_check_name,
    recorded_fingerprints,
    staleness,
)
from flowmatch_assets.freshness.settings import Settings
from flowmatch_models.embeddings.kinds import TRAINING_INPUTS
from flowmatch_models.storage.fingerprint import UNKNOWN, Fingerprint, hash_of


def trained_on(res: Settings, partitions: Iterable[str]) -> dict[str, dict[str, list]]:
    """``{kind: {fingerprint hash: [partitions]}}`` of the training inputs' shards now (what a
    training run that used ``partitions`` records as its input fingerprints)."""
    from flowmatch_models.storage.store import read_shard

    out: dict[str, dict[str, list]] = {}
    for kind in TRAINING_INPUTS:
        groups = out.setdefault(kind, {})
        for p in partitions:
            path = res.layout.asset_path(kind, p)
            try:
                fp = Fingerprint.from_json(read_shard(path).attrs.get("fingerprint"))
            except Exception:  # noqa: BLE001 - gone or unreadable: no fingerprint to record
                fp = None
            groups.setdefault(hash_of(fp), []).append(p)
    return out


def model_staleness(res: Settings, runs: Sequence[str] | None = None) -> list[Stale]:
    """Training runs (``flow_model`` records) that trained on a partition that is stale now,
    or whose shard was re-made with another fingerprint since; and fine-tunes whose parent was
    re-trained since they started from it (its weights at that step changed, or are gone), or
    is stale itself (flowmatch_models/train/finetune.py)."""
    from flowmatch_models.train.finetune import parent_changed

    rows = catalog.Catalog(res.data_root).query(
        "SELECT partition AS run, extra FROM materializations WHERE asset = 'flow_model' "
        "ORDER BY partition"
    )
    records = {r["run"]: json.loads(r["extra"] or "{}") for r in rows}
    wanted = [r for r in records if runs is None or r in runs]
    if not wanted:
        return []
    now = recorded_fingerprints(res, list(TRAINING_INPUTS), None)
    stale = {(s.asset, s.partition): s for s in staleness(res, assets=list(TRAINING_INPUTS))}
    memo: dict[str, list[str]] = {}
    digests: dict = {}

    def reasons_of(run: str, seen: tuple = ()) -> list[str]:
        if run in memo:
            return memo[run]
        extra = records[run]
        reasons = _data_reasons(extra.get("input_fingerprints"), stale, now)
        parent = extra.get("parent")
        if parent:
            why = parent_changed(parent, digests)
            if why:
                reasons.append(why)
            elif parent["run"] in records and parent["run"] not in (*seen, run):
                up = reasons_of(parent["run"], (*seen, run))
                if up:
                    reasons.append(f"its parent {parent['run']} is stale ({up[0]})")
        memo[run] = reasons
        return reasons

    return [Stale("flow_model", r, tuple(why)) for r in wanted if (why := reasons_of(r))]


def _data_reasons(used: dict | None, stale: dict, now: dict) -> list[str]:
    """Why a run's training data is stale now (its record's ``input_fingerprints``)."""
    if not used:
        return ["no input fingerprints recorded: unknown"]
    reasons = []
    for kind, groups in sorted(used.items()):
        for h, parts in sorted(groups.items()):
            bad = [p for p in parts if (kind, p) in stale]
            if bad:
                first = stale[(kind, bad[0])]
                reasons.append(
                    f"{len(bad)} {kind} partitions it trained on are stale "
                    f"({', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}: {first.reason})"
                )
            remade = [p for p in parts if p not in bad and hash_of(now.get((kind, p))) != h]
            if remade and h != UNKNOWN:
                reasons.append(
                    f"{len(remade)} {kind} partitions were re-made since training "
                    f"({', '.join(remade[:5])}: {h} -> {hash_of(now.get((kind, remade[0])))})"
                )
    return reasons


def finetuned_runs(res: Settings) -> list[str]:
    """The runs recorded with a parent (fine-tunes: flowmatch_models/train/finetune.py)."""
    rows = catalog.Catalog(res.data_root).query(
        "SELECT partition AS run, extra FROM materializations WHERE asset = 'flow_model'"
    )
    return sorted(r["run"] for r in rows if json.loads(r["extra"] or "{}").get("parent"))


def has_runs(res: Settings) -> bool:
    rows = catalog.Catalog(res.data_root).query(
        "SELECT count(*) AS n FROM materializations WHERE asset = 'flow_model'"
    )
    return bool(rows[0]["n"])


def model_check_results(res: Settings, found: Sequence[Stale]) -> dict[str, tuple]:
    """``{check: (asset, passed, description, stale runs)}`` of ``flow_model_fresh`` (every
    run) and ``fine_tune_fresh`` (the fine-tunes) for the stale runs ``found``."""
    tuned = set(finetuned_runs(res))
    out = {}
    for asset, runs in (
        ("flow_model", list(found)),
        ("fine_tune", [s for s in found if s.partition in tuned]),
    ):
        desc = "; ".join(f"run {s.partition}: {s.reason}" for s in runs)[:2000] or None
        out[fresh_check_name(asset)] = (
            asset,
            not runs,
            desc,
            {s.partition: s.reasons for s in runs},
        )
    return out
