"""The ``flowmatch`` resource, ``FlowmatchSettings``: each field is its FLOWMATCH_* variable (field,
then environment, then default), a deployment's ``dg.EnvVar`` survives a launchpad that sets
another field, a missing variable fails the run naming it, and a CLI run's config (what a
re-execution from the UI runs with) builds the resource the CLI ran with."""

from __future__ import annotations

import dagster as dg
import pytest

from flowmatch_assets.defs.resources import (
    FlowmatchResource,
    FlowmatchSettings,
    SettingError,
    resource_from_env,
)
from flowmatch_assets.defs.settings import ENV_OF, SETTINGS


@dg.asset
def probe(flowmatch: FlowmatchResource) -> dict:
    """What the assets get: the FlowmatchResource the settings built."""
    return flowmatch.model_dump()


def _run(settings: FlowmatchSettings, run_config: dict | None = None) -> dict:
    result = dg.materialize([probe], resources={"flowmatch": settings}, run_config=run_config)
    return result.output_for_node("probe")


def _launchpad(**config) -> dict:
    return {"resources": {"flowmatch": {"config": config}}}


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    """No FLOWMATCH_* setting in the environment; the working directory a scratch folder."""
    for var in ENV_OF.values():
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)
    return monkeypatch


def test_the_fields_are_the_settings_table():
    fields = FlowmatchSettings.model_fields
    scalars = [k for k in fields if k not in ("filters", "ingest", "encoders", "sources")]
    assert scalars == [s.field for s in SETTINGS]
    for s in SETTINGS:
        assert s.env in fields[s.field].description, s.field


def test_each_field_is_its_variable_the_field_winning(clean_env, tmp_path):
    given = {
        "data_root": str(tmp_path / "root"),
        "metadata_source": str(tmp_path / "md"),
        "shard_size": 7,
        "file_root": str(tmp_path / "files"),
        "min_stored_fraction": 0.9,
        "deadline_s": 5.0,
        "allow_networks": ["10.0.0.0/8", "127.0.0.0/8"],
        "vae": "my/vae",
        "dino": "my/dino",
        "text": "my/text",
        "device": "cpu",
    }
    as_env = {ENV_OF[k]: ",".join(v) if isinstance(v, list) else str(v) for k, v in given.items()}
    by_env = resource_from_env(as_env).model_dump()
    assert FlowmatchSettings(**given).build(environ={}).model_dump() == by_env
    # the field wins over its variable, the variable over the default
    env = {"FLOWMATCH_VAE": "env/vae", "FLOWMATCH_DEVICE": "cuda"}
    res = FlowmatchSettings(vae="field/vae").build(environ=env)
    assert (res.encoders.vae, res.encoders.device, res.encoders.dino) == (
        "field/vae",
        "cuda",
        resource_from_env({}).encoders.dino,
    )
    assert res.data_root == str(tmp_path / "data")  # the default, under the working folder
    assert res.ingest.file_root == str(tmp_path / "data" / "sample")  # defaults follow the root
    # a settings file and a sources file, by field
    (tmp_path / "s.yaml").write_text("encoders: {max_tokens: 32}\n")
    (tmp_path / "src.yaml").write_text("mine: {kind: folder, location: /pics}\n")
    res = FlowmatchSettings(
        settings_file=str(tmp_path / "s.yaml"), sources_file=str(tmp_path / "src.yaml")
    ).build(environ={})
    assert res.encoders.max_tokens == 32 and res.source("mine").location == "/pics"


def test_a_deployments_env_var_survives_a_launchpad_that_sets_another_field(clean_env, tmp_path):
    """Dagster gives a ConfigurableResource's constructor values as one default for its whole
    config: a run config that names the resource replaces them all (a field declared ``= None``
    came back None, so the deployment's EnvVar was silently lost)."""
    clean_env.setenv("DEPLOY_ROOT", str(tmp_path / "deployed"))
    clean_env.setenv("DEPLOY_SHARDS", "123")
    clean_env.setenv("FLOWMATCH_VAE", "env/vae")
    settings = FlowmatchSettings(
        data_root=dg.EnvVar("DEPLOY_ROOT"), shard_size=dg.EnvVar.int("DEPLOY_SHARDS")
    )
    plain = _run(settings)
    assert (plain["data_root"], plain["shard_size"]) == (str(tmp_path / "deployed"), 123)
    got = _run(settings, _launchpad(encoders={"max_tokens": 64}))
    assert got["data_root"] == str(tmp_path / "deployed")  # not None, not the name "DEPLOY_ROOT"
    assert got["shard_size"] == 123
    assert got["encoders"]["max_tokens"] == 64
    assert got["encoders"]["vae"] == "env/vae"  # the override is partial: vae stays the env's
    assert got["encoders"] == {**plain["encoders"], "max_tokens": 64}
    # a field the launchpad does set wins over the deployment's
    other = _run(settings, _launchpad(data_root=str(tmp_path / "other")))
    assert other["data_root"] == str(tmp_path / "other") and other["shard_size"] == 123


def test_a_deployment_variable_that_is_unset_fails_the_run_naming_it(clean_env):
    from flowmatch_assets.definitions_k8s import SETTINGS as k8s_settings

    with pytest.raises(
        dg.DagsterInvalidConfigError, match='"FLOWMATCH_DATA_ROOT" which is not set'
    ):
        _run(k8s_settings)
    with pytest.raises(
        dg.DagsterResourceFunctionError, match="flowmatch"
    ) as err:  # launchpad config for another field: our own message, naming the variable
        _run(k8s_settings, _launchpad(encoders={"max_tokens": 64}))
    cause = err.value.__cause__
    assert isinstance(cause, SettingError) and "FLOWMATCH_DATA_ROOT" in str(cause)


def test_a_cli_runs_config_builds_the_resource_it_ran_with(clean_env, tmp_path):
    """runs.resource_config is what the code location's resource (FlowmatchSettings, nothing
    set) is given for a CLI run and for its re-execution from the UI: typed and partial, with a
    null kept (file_root None is not "unset")."""
    from flowmatch_assets import runs

    clean_env.setenv("FLOWMATCH_DATA_ROOT", str(tmp_path / "env"))
    clean_env.setenv("FLOWMATCH_VAE", "env/vae")
    res = resource_from_env(
        overrides={
            "data_root": str(tmp_path / "cli"),
            "encoders": {"max_tokens": 64},
            "ingest": {"file_root": None, "buckets": "aspect", "allow_networks": ["10.0.0.0/8"]},
            "filters": {"licenses": ["cc0"]},
            "sources": {"mine": {"kind": "folder", "location": str(tmp_path / "pics")}},
        }
    )
    config = runs.resource_config(res)
    assert config["resources"]["flowmatch"]["config"]["ingest"]["file_root"] is None
    assert _run(FlowmatchSettings(), config) == res.model_dump()


def test_sensors_get_the_resource_the_settings_build(clean_env, small_sample, tmp_path):
    from flowmatch_assets.defs.partitions import metadata_partition_sensor

    settings = FlowmatchSettings(
        data_root=str(tmp_path / "data"), metadata_source=small_sample["metadata"]
    )
    with dg.instance_for_test() as instance:
        ctx = dg.build_sensor_context(instance=instance, resources={"flowmatch": settings})
        result = metadata_partition_sensor(ctx)
        assert result.dynamic_partitions_requests[0].partition_keys == ["000-00", "001-00"]
