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


def test_the_pods_dagster_k8s_builds_for_the_steps_use_the_image_the_remote_and_no_secret():
    """The Job that dagster-k8s's step handler would create for the encoder, training and
    image steps (construct_dagster_k8s_job, as K8sStepHandler.launch_step calls it), from the
    Helm values as the chart passes them to runs: the image, the remote, one GPU where wanted,
    the keys only by Secret reference, and the cache an emptyDir (no shared volume)."""
    import yaml
    from dagster_k8s.container_context import K8sContainerContext
    from dagster_k8s.job import (
        DagsterK8sJobConfig,
        construct_dagster_k8s_job,
        get_user_defined_k8s_config,
    )

    from flowmatch_assets.definitions_k8s import defs
    from tests.conftest import REPO

    values = yaml.safe_load((REPO / "deploy" / "k8s" / "values.yaml").read_text())
    dep = values["dagster-user-deployments"]["deployments"][0]
    assert dep["dagsterApiGrpcArgs"] == ["-m", "flowmatch_assets.definitions_k8s"]
    image = f"{dep['image']['repository']}:{dep['image']['tag']}"
    launcher = values["runLauncher"]["config"]["k8sRunLauncher"]
    assert dep["includeConfigInLaunchedRuns"]["enabled"]
    base = K8sContainerContext(
        env=dep["env"],
        env_secrets=[s["name"] for s in dep["envSecrets"]],
        volumes=launcher["volumes"],
        volume_mounts=launcher["volumeMounts"],
    )
    cfg = DagsterK8sJobConfig(
        job_image=image, dagster_home="/opt/dagster/dagster_home", instance_config_map="instance"
    )
    for name, gpus in (("vae_latents", "1"), ("flow_model", "1"), ("images", None)):
        tags = _node(defs, name).assets_def.op.tags
        ctx = base.merge(K8sContainerContext(run_k8s_config=get_user_defined_k8s_config(tags)))
        job = construct_dagster_k8s_job(
            cfg, ["dagster", "api", "execute_step"], "dagster-step-x", ctx.run_k8s_config
        )
        pod = job.spec.template.spec
        (c,) = pod.containers
        assert c.image == image
        assert (c.resources.limits or {}).get("nvidia.com/gpu") == gpus, name
        env = {e.name: e.value for e in c.env}
        assert env["FLOWMATCH_REMOTE"].startswith("s3://")
        assert env["FLOWMATCH_DATA_ROOT"] == "/data"
        assert not any("SECRET" in k or "PASSWORD" in k for k in env), env
        assert [e.secret_ref.name for e in c.env_from if e.secret_ref] == ["flowmatch-s3"]
        assert [v.persistent_volume_claim for v in pod.volumes if v.name == "data"] == [None]
        assert [v.empty_dir is not None for v in pod.volumes if v.name == "data"] == [True]
