"""The training request flow_model and fine_tune send: typed settings validated in the Dagster
process (a bad one fails the run with one line naming it, before any training process starts),
and the validated config the training process receives."""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg
import pytest

from flowmatch_assets.definitions import defs
from flowmatch_assets.defs.definitions import resources_for
from flowmatch_assets.defs.resources import FlowmatchResource
from flowmatch_models.embeddings.kinds import TRAINING_INPUTS
from flowmatch_models.storage.layout import DataLayout
from flowmatch_models.train.config import TrainConfig, load_config, settings_from_items

REPO = Path(__file__).resolve().parents[1]


class _Launcher(dg.PipesSubprocessClient):
    """Records each training process it is asked to start, then fails the step (no process)."""

    requests: list = []

    def run(self, *, context, extras=None, **kw):
        self.requests.append(json.loads(json.dumps(extras["train_request"])))  # as Pipes sends it
        raise dg.Failure("stopped before the training process (test)")


def _run(tmp_path: Path, asset: str, config: dict):
    _Launcher.requests = []
    res = FlowmatchResource(data_root=str(tmp_path / "data"), metadata_source="unused")
    with dg.instance_for_test() as instance:
        result = dg.materialize(
            list(defs.assets),
            selection=[asset],
            instance=instance,
            resources={**resources_for(res), "pipes_subprocess_client": _Launcher()},
            run_config={"ops": {asset: {"config": config}}},
            raise_on_error=False,
        )
    failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
    return failure.step_failure_data.user_failure_data.description, res


@pytest.mark.parametrize(
    ("asset", "config", "line"),
    [
        ("flow_model", {"settings": {"data": {"bogus": 1}}}, "unknown config key 'data.bogus'"),
        (
            "flow_model",
            {"settings": {"data": {"batch_size": "many"}}},
            "data.batch_size: Input should be a valid integer",
        ),
        ("flow_model", {"settings": {"optimizer": {"lr": 1}}}, "unknown config key 'optimizer'"),
        ("flow_model", {"overrides": ["optim.lrr=3"]}, "unknown config key 'optim.lrr'"),
        (
            "flow_model",
            {"settings": {"optim": {"schedule": "linear"}}},
            "optim.schedule: Input should be 'constant' or 'cosine'",
        ),
        ("flow_model", {"overrides": ["optim.lr"]}, "--set 'optim.lr': expected key.sub=value"),
        ("flow_model", {"config_file": "nope.yaml"}, "config nope.yaml not found"),
        ("fine_tune", {"parent_run": "p", "weights": "rawish"}, "init.weights: Input should be"),
    ],
)
def test_a_bad_setting_fails_the_run_before_any_training_process(tmp_path, asset, config, line):
    """No partition is complete either: the settings are checked first, in this process."""
    description, _ = _run(tmp_path, asset, config)
    assert description.startswith("error: ") and line in description, description
    assert "\n" not in description
    assert _Launcher.requests == []  # no training process was started
    assert not (tmp_path / "data" / "runs").exists()


def test_the_process_receives_the_validated_config(tmp_path):
    """The request carries the full TrainConfig, validated (settings over the YAML, the
    resource's data root and encoders, the old ``overrides`` items under ``settings``), and the
    training process's ``decide`` reads back the same config."""
    from flowmatch_models.train.run import TrainRequest, decide

    layout = DataLayout(tmp_path / "data")
    for kind in TRAINING_INPUTS:  # one complete partition (the files are not read here)
        layout.asset_path(kind, "000-00").parent.mkdir(parents=True, exist_ok=True)
        layout.asset_path(kind, "000-00").touch()
    settings = {
        "data": {"batch_size": 4},
        "flow": {"shift": 2.5},
        "trainer": {"val_every": 2},
        "optim": {"schedule": "cosine"},
    }
    config = {
        "run_name": "r",
        "max_steps": 7,
        "settings": settings,
        "overrides": ["data.batch_size=8", "optim.lr=3e-4"],
    }
    description, res = _run(tmp_path, "flow_model", config)
    assert description == "stopped before the training process (test)"
    (sent,) = _Launcher.requests
    request = TrainRequest.from_dict(sent)
    assert request.overrides == [] and request.partitions == ["000-00"]
    cfg = TrainConfig.model_validate(request.config)
    assert cfg.to_dict() == request.config  # a full dump: every key, nothing to parse
    assert cfg.data.batch_size == 4 and cfg.optim.lr == 3e-4  # settings win over overrides
    assert cfg.optim.schedule == "cosine"  # the lr schedule by name, from the launchpad
    assert cfg.flow.train_shift == cfg.flow.sample_shift == 2.5  # the legacy key sets both
    assert cfg.trainer.max_steps == 7 and cfg.trainer.val_every == 2 and cfg.run.name == "r"
    assert cfg.data.root == res.data_root and cfg.encoders.vae == res.encoders.vae
    yaml_only = load_config(REPO / "configs" / "tiny.yaml")
    assert cfg.model == yaml_only.model and cfg.sample == yaml_only.sample
    decided, got = decide(request)  # what the training process makes of it
    assert got.model_copy(update={"run": cfg.run, "data": cfg.data}) == cfg
    assert got.data.batch_size == 4 and decided.max_steps == 7


def test_settings_from_items_is_the_nested_form_of_set_items():
    got = settings_from_items(["data.sources=[a, b]", "data.batch_size=16", "flow.shift=3"])
    assert got == {"data": {"sources": ["a", "b"], "batch_size": 16}, "flow": {"shift": 3}}
    cfg = load_config(REPO / "configs" / "tiny.yaml", settings=got)
    assert cfg == load_config(
        REPO / "configs" / "tiny.yaml",
        list(map(str, ["data.sources=[a, b]", "data.batch_size=16", "flow.shift=3"])),
    )


def test_the_lr_schedule_is_chosen_by_name():
    """``optim.schedule``: constant (the YAMLs' default) or cosine down to ``min_lr_ratio``
    after the warm-up; `--set optim.schedule=cosine` and the launchpad's settings set it."""
    from flowmatch_models.train.module import lr_factor

    assert load_config(REPO / "configs" / "tiny.yaml").optim.schedule == "constant"
    assert load_config(REPO / "configs" / "base.yaml").optim.schedule == "constant"
    cfg = load_config(REPO / "configs" / "tiny.yaml", ["optim.schedule=cosine"])
    assert cfg.optim.schedule == "cosine"
    assert [lr_factor(s, 2, "constant", 12, 0.1) for s in (0, 1, 2, 11)] == [0.5, 1.0, 1.0, 1.0]
    cos = [lr_factor(s, 2, "cosine", 12, 0.1) for s in (0, 2, 7, 12)]
    assert cos[:2] == [0.5, 1.0] and abs(cos[2] - 0.55) < 1e-9 and abs(cos[3] - 0.1) < 1e-9
