"""Scale-out wiring: the Kubernetes code location loads and carries the per-asset requests."""

from __future__ import annotations

import json

import dagster as dg

from flowmatch_assets.defs.deploy import K8S_CONFIG


def _k8s(defs: dg.Definitions, name: str) -> dict:
    """The dagster-k8s config of an asset's op (Dagster stores tag values as JSON strings)."""
    return json.loads(_node(defs, name).assets_def.op.tags[K8S_CONFIG])["container_config"]


def _node(defs: dg.Definitions, name: str):
    return defs.get_repository_def().asset_graph.get(dg.AssetKey(name))


def test_k8s_definitions_use_the_k8s_executor_and_gpu_requests():
    from flowmatch_assets.definitions_k8s import defs

    job = defs.resolve_implicit_global_asset_job_def()
    assert job.executor_def.name == "k8s"
    for name in ("vae_latents", "flow_model"):
        res = _k8s(defs, name)["resources"]
        assert res["limits"]["nvidia.com/gpu"] == "1", name
        assert _node(defs, name).assets_def.op.pool == "gpu"
    img = _k8s(defs, "images")
    assert "nvidia.com/gpu" not in img["resources"]["requests"]


def test_local_definitions_run_a_runs_steps_in_its_process():
    from flowmatch_assets.definitions import defs

    job = defs.resolve_implicit_global_asset_job_def()
    assert job.executor_def.name == "in_process"  # parallel partitions are parallel runs


def test_eager_automation_is_opt_in():
    from flowmatch_assets.defs.definitions import build_definitions

    def conditions(defs):
        g = defs.get_repository_def().asset_graph
        return {k.to_user_string(): g.get(k).automation_condition for k in g.get_all_asset_keys()}

    assert all(c is None for c in conditions(build_definitions(automation="off")).values())
    eager = conditions(build_definitions(automation="eager"))
    assert {k for k, c in eager.items() if c is not None} == {
        "images",
        "vae_latents",
        "dino_features",
        "text_embeddings",
    }
