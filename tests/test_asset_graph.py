"""The code location's asset graph is the recorded one (tests/asset_graph.json).

`dagster dev` loads ``flowmatch_assets.definitions`` (workspace.yaml); a refactoring that moves
code must leave its graph unchanged: the same asset keys with their groups, dependencies and
partitions, the same checks, sensors and jobs. After a deliberate change (a new asset, a new
embedding kind), rewrite the record with ``python tests/test_asset_graph.py`` and commit it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

RECORD = Path(__file__).with_name("asset_graph.json")


def graph_repo():
    """The repository of the code location ``workspace.yaml`` names."""
    import importlib

    import yaml

    workspace = yaml.safe_load((Path(__file__).resolve().parents[1] / "workspace.yaml").read_text())
    module = workspace["load_from"][0]["python_module"]
    defs = getattr(importlib.import_module(module["module_name"]), module["attribute"])
    return defs.get_repository_def()


def graph() -> dict:
    """The graph of the code location ``workspace.yaml`` names, as plain JSON."""
    repo = graph_repo()
    assets = {}
    for key, node in (
        (n.key, n) for n in sorted(repo.asset_graph.asset_nodes, key=lambda n: n.key)
    ):
        pdef = node.partitions_def
        assets[key.to_user_string()] = {
            "group": node.group_name,
            "deps": sorted(k.to_user_string() for k in node.parent_keys),
            "partitions": None
            if pdef is None
            else type(pdef).__name__ + ":" + (getattr(pdef, "name", None) or ""),
            "checks": sorted(c.name for c in node.check_keys),
            "code_version": node.code_version,
            "pools": sorted(node.pools or []),
            "kinds": sorted(node.kinds),
            "op": node.assets_def.node_def.name,
        }
    check_ops = {
        k.to_user_string(): d.node_def.name
        for d in repo.asset_checks_defs_by_key.values()
        for k in d.check_keys
    }
    check_ops.update(
        {
            k.to_user_string(): d.node_def.name
            for d in repo.assets_defs_by_key.values()
            for k in d.check_keys
        }
    )
    return {
        "assets": assets,
        "checks": {
            k.to_user_string(): {
                "blocking": repo.asset_graph.get(k).blocking,
                "op": check_ops[k.to_user_string()],
            }
            for k in sorted(repo.asset_graph.asset_check_keys)
        },
        "sensors": sorted(s.name for s in repo.sensor_defs),
        "jobs": sorted(j.name for j in repo.get_all_jobs() if not j.name.startswith("__")),
        "resources": sorted(repo.get_top_level_resources()),
        "executor": repo.get_job(next(iter(sorted(repo.job_names)))).executor_def.name,
    }


def test_the_code_location_loads_the_recorded_asset_graph():
    recorded = json.loads(RECORD.read_text())
    now = graph()
    assert now == recorded, (
        "the asset graph changed; if deliberate, rewrite the record: python tests/test_asset_graph.py"
    )


#: What each library verb of flowmatch_assets/runs.py runs, and the job the UI lists it under.
CLI_RUNS = {
    "ingest_and_embed_job": [  # materialize (and the demo): a partition's whole lineage
        ["metadata", "images", "vae_latents", "dino_features", "text_embeddings"],
        ["images", "text_embeddings"],  # materialize --missing / --stale: what is left
    ],
    "ingest_images": [["images"]],  # retry
    "encode_embeddings_job": [["vae_latents", "dino_features", "text_embeddings"]],
    "train_job": [["flow_model", "samples"], ["flow_model"]],  # train (--no-samples)
    "finetune_job": [["fine_tune", "samples"], ["fine_tune"]],  # finetune
    "evaluation_job": [["evaluation"]],  # evaluate
    "reports_job": [["budget_report"], ["data_card"], ["dataset_card"]],  # budget, data-card
    "__ASSET_JOB": [["images", "flow_model"]],  # no job holds it: Dagster's own
}


def test_cli_runs_are_recorded_under_the_code_locations_jobs(tmp_path, monkeypatch):
    """A run the CLI makes (runs.run_assets) is one of the code location's jobs, so the UI
    lists it by name, not as ``__ephemeral_asset_job__``; a real run says so in the instance."""
    import dagster as dg

    from flowmatch_assets import runs
    from flowmatch_assets.defs.definitions import assets

    jobs, every = {j.name for j in graph_repo().get_all_jobs()}, assets()
    for job, selections in CLI_RUNS.items():
        assert job in jobs
        for selection in selections:
            assert runs.job_for(selection, every) == job, selection
    monkeypatch.setenv("FLOWMATCH_DATA_ROOT", str(tmp_path / "data"))
    with dg.DagsterInstance.ephemeral() as instance:
        result = runs.run_assets(["budget_report"], dagster_instance=instance, steps=False)
        assert result.success
        (run,) = instance.get_runs()
        assert run.job_name == "reports_job" and run.asset_selection == {
            dg.AssetKey("budget_report")
        }


def test_cli_runs_are_the_code_locations_own_runs(tmp_path, monkeypatch, capfd):
    """What the UI needs to treat a CLI run as its own (issue 38): the code location's origin
    (the Timeline and the job's Runs tab filter on the ``.dagster/repository`` tag), the job's
    snapshot as the webserver loads it (no "may be a different version" on re-execution), a
    run config with no logger in it (a re-execution logs at INFO) but the resource the CLI ran
    with, the verb's tag; and a quiet terminal all the same, with the stored log complete."""
    import dagster as dg

    from flowmatch_assets import runs
    from flowmatch_assets.definitions import defs
    from flowmatch_assets.defs.resources import resource_from_env

    monkeypatch.setenv("FLOWMATCH_DATA_ROOT", str(tmp_path / "data"))
    other = resource_from_env(overrides={"data_root": str(tmp_path / "other")})
    with dg.DagsterInstance.ephemeral() as instance:
        result = runs.run_assets(
            ["budget_report"],
            tags={"flowmatch/cli": "budget"},
            res=other,
            dagster_instance=instance,
            steps=False,
        )
        assert result.success
        (run,) = instance.get_runs()
        label = {".dagster/repository": "__repository__@flowmatch_assets.definitions:defs"}
        assert instance.get_runs(dg.RunsFilter(tags=label)) == [run]  # the UI's filter
        assert run.tags["flowmatch/cli"] == "budget"
        assert run.remote_job_origin.job_name == "reports_job"
        snap = instance.get_job_snapshot(run.job_snapshot_id)
        job = defs.resolve_job_def("reports_job")
        assert snap.lineage_snapshot.parent_snapshot_id == job.get_job_snapshot_id()
        assert "loggers" not in run.run_config
        assert run.run_config["resources"]["flowmatch"]["config"]["data_root"] == str(
            tmp_path / "other"
        )
        assert (tmp_path / "other" / "reports" / "budget.md").exists()
        logs = instance.all_logs(run.run_id)
        assert [e.dagster_event.event_type_value for e in logs if e.is_dagster_event][-1] == (
            "PIPELINE_SUCCESS"
        )
    err = capfd.readouterr().err
    assert " - dagster - " not in err and "STEP_SUCCESS" not in err, err[-2000:]

    # the demo's runs: the verb that made them (`flowmatch demo`) and the demo's stage win over
    # the library function's own tag (materialize_budget says "budget")
    monkeypatch.setattr(runs, "EXTRA_TAGS", {"flowmatch/cli": "demo", "flowmatch/demo": "reports"})
    with dg.DagsterInstance.ephemeral() as instance:
        monkeypatch.setattr(runs, "instance", lambda: instance)
        assert runs.materialize_budget()
        (run,) = instance.get_runs()
        assert {k: v for k, v in run.tags.items() if k.startswith("flowmatch/")} == {
            "flowmatch/cli": "demo",
            "flowmatch/demo": "reports",
        }


if __name__ == "__main__":
    RECORD.write_text(json.dumps(graph(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {RECORD}", file=sys.stderr)


def test_a_terminated_training_run_is_given_time_to_save_its_state(monkeypatch):
    """Pipes waits this long for the training process after "Terminate" sends it SIGINT (a full
    state of a large model takes minutes): 600 s by default, FLOWMATCH_STOP_TIMEOUT_S sets it."""
    from flowmatch_assets.defs.definitions import resources_for

    monkeypatch.delenv("FLOWMATCH_STOP_TIMEOUT_S", raising=False)
    assert resources_for(None)["pipes_subprocess_client"].termination_timeout_seconds == 600
    monkeypatch.setenv("FLOWMATCH_STOP_TIMEOUT_S", "90")
    assert resources_for(None)["pipes_subprocess_client"].termination_timeout_seconds == 90
    monkeypatch.setenv("FLOWMATCH_STOP_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="FLOWMATCH_STOP_TIMEOUT_S='soon' is not a number"):
        resources_for(None)
