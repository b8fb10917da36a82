"""Every interactive verb costs the same per partition at any size (issue 28): `flowmatch bench
scale`'s synthetic instance (the catalog's own writers, a real Dagster instance) at 20 and 80
partitions, each verb timed in-process (warm), its CPU seconds per partition compared: at most
1.5x at 4x the partitions. At these sizes a verb's fixed cost hides much, so the patterns that
made verbs quadratic are also held directly: `--missing` asks Dagster once per asset, not once
per partition, and a catalog query after nothing changed reads no record file. Absolute times
are BENCHMARKS.md's (`flowmatch bench scale --partitions 1240`)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest

from flowmatch_assets.bench import scale

#: The verbs whose cost could grow with the partitions (the rest are scale's `verbs`).
VERBS = [
    "catalog_build",
    "catalog_coverage",
    "catalog_failures",
    "catalog_compression",
    "data_card",
    "budget",
    "materialize_missing",
    "materialize_stale",
    "stale_no_report",
    "verify",
]
SIZES = (20, 80)
ROWS = 10


@pytest.fixture(scope="module")
def instances():
    """The two instances, on tmpfs where there is one (Dagster's sqlite commits each event)."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else None
    with tempfile.TemporaryDirectory(prefix="flowmatch-scale-", dir=base) as tmp:
        roots = {}
        for n in SIZES:
            roots[n] = Path(tmp) / str(n)
            scale.build(roots[n], n, ROWS, log=lambda m: None, checks=False)
        yield roots


def test_every_verb_costs_the_same_per_partition_at_4x_the_partitions(instances):
    """(~15 s on 2 shared cores, half of it building the instances: Dagster's event log.)"""
    scale.time_in_process(instances[SIZES[0]], VERBS, repeat=1)  # imports, first-time caches
    # the least of two runs each: one run's one-off pause is not what grows with the partitions
    # (a CI run under load once read catalog_build 1.16 s at 80 vs 0.14 s at 20, a ratio of
    # 2.1; the same commit on an idle box: 0.46)
    cost = {n: scale.time_in_process(root, VERBS, repeat=2) for n, root in instances.items()}
    small, big = SIZES
    report = {}
    for verb in VERBS:
        a, b = cost[small][verb], cost[big][verb]
        assert a["rc"] == 0 and b["rc"] == 0, (verb, a, b)
        report[verb] = round((b["cpu_s"] / big) / (a["cpu_s"] / small), 2)
    print(json.dumps({"per_partition_cpu_ratio": report, "cpu_s": cost}))
    grew = {v: r for v, r in report.items() if r > 1.5}
    assert not grew, f"cost per partition grew with the partitions: {grew} ({cost})"


@pytest.fixture
def env_of(instances):
    """The FLOWMATCH_* and DAGSTER_HOME of the bigger instance, for the test's duration."""
    root = instances[SIZES[1]]
    env = scale.instance_env(root)
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield root
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def test_missing_asks_dagster_once_per_asset_and_finds_the_one_gone(env_of, monkeypatch, capsys):
    from flowmatch_assets import runs
    from flowmatch_assets.cli import main

    res, inst = runs.resource(), runs.instance()
    keys = runs.known_partitions(inst)
    gone = res.layout.asset_path("vae_latents", keys[7])
    asked = []
    real = type(inst).get_materialized_partitions

    def counted(self, *a, **kw):
        asked.append(a)
        return real(self, *a, **kw)

    monkeypatch.setattr(type(inst), "get_materialized_partitions", counted)
    assert main(["materialize", "--missing", "-a", "metadata"]) == 0
    assert len(asked) == 1  # one asset: one question, whatever the partitions
    out = capsys.readouterr().out
    assert out.count("skipped") == len(keys) == SIZES[1]
    from flowmatch_assets.freshness.state import partition_states

    gone.rename(gone.with_name("moved"))
    try:
        states = partition_states(res.layout, keys, ["metadata", "vae_latents"], inst)
        assert [(s.partition, s.state) for s in states if s.missing] == [(keys[7], "gone")]
    finally:
        gone.with_name("moved").rename(gone)


def test_a_query_after_nothing_changed_lists_no_record_folder(env_of):
    from flowmatch_assets.catalog import Catalog, record_scan, summary
    from flowmatch_models.storage.layout import DataLayout

    layout = DataLayout(env_of / "data")
    cat = Catalog(layout.root)
    cat.query("SELECT count(*) FROM materializations")
    state = record_scan.State(summary.summary_dir(layout))
    for rel in list(state.dirs):  # listed long enough after their last change
        state.dirs[rel]["listed"] += 3600
    state.save([])
    changes, listed = record_scan.scan(
        layout,
        record_scan.State(summary.summary_dir(layout)),
        ["materializations", *summary.row_kinds()],
    )
    assert listed == [] and not changes.changed and not changes.gone
