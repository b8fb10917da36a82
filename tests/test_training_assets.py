"""flow_model and samples through Dagster: the coverage rule, training via Pipes in a real
subprocess (metrics reported back), resume with extra steps, and the sample grid."""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg
import numpy as np
import pytest
from PIL import Image

from flowmatch_assets.catalog import Catalog
from flowmatch_assets.cli import main as cli_main
from flowmatch_assets.definitions import defs
from flowmatch_assets.defs.definitions import resources_for
from flowmatch_assets.defs.partitions import register_partitions
from flowmatch_assets.freshness.training_runs import model_staleness
from flowmatch_models.encoders.spec import EncoderSpec
from tests.conftest import make_resource
from tests.wandb_records import config as wandb_config
from tests.wandb_records import history

EMB = ["vae_latents", "dino_features", "text_embeddings"]
REPO = Path(__file__).resolve().parents[1]


def _materialize(res, instance, selection, run_config=None, partition_key=None):
    return dg.materialize(
        list(defs.assets),
        selection=selection,
        instance=instance,
        partition_key=partition_key,
        resources=resources_for(res),
        run_config=run_config or {},
        raise_on_error=False,
    )


def _step(run: Path) -> int:
    import torch

    return torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]


def _direct(tmp_path: Path, name: str, zoo: dict, *flags: str) -> None:
    """``python -m flowmatch_models.train`` as a user types it, from another folder, with the
    data root from FLOWMATCH_DATA_ROOT and the launchpad's settings as ``--set`` items."""
    import os
    import subprocess
    import sys

    cwd = tmp_path / "cwd"
    cwd.mkdir(exist_ok=True)
    settings = _train_cfg()["ops"]["flow_model"]["config"]["settings"]
    sets = ["run.name=" + name]
    sets += [f"{s}.{k}={json.dumps(v)}" for s, kv in settings.items() for k, v in kv.items()]
    sets += [f"encoders.vae={zoo['vae']}", f"encoders.text={zoo['text']}"]
    cmd = [
        sys.executable,
        "-m",
        "flowmatch_models.train",
        "--config",
        str(REPO / "configs" / "tiny.yaml"),
    ]
    for s in sets:
        cmd += ["--set", s]
    env = {**os.environ, "FLOWMATCH_DATA_ROOT": str(tmp_path / "data"), "PYTHONPATH": str(REPO)}
    env.pop("DAGSTER_PIPES_CONTEXT", None)
    proc = subprocess.run([*cmd, *flags], cwd=cwd, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


def _train_cfg(**kw):
    cfg = {
        "run_name": "t",
        "settings": {
            "data": {"batch_size": 4},
            "trainer": {
                "log_every": 2,
                "sample_every": 1000,
                "checkpoint_every": 1000,
                "val_every": 2,
            },
            "sample": {"steps": 2},
            "logging": {"record_sample_ids": True},
        },
        **kw,
    }
    return {"ops": {"flow_model": {"config": cfg}}}


@pytest.mark.slow
def test_coverage_rule_then_train_resume_and_sample(tmp_path, small_sample, zoo, monkeypatch):
    res = make_resource(tmp_path / "data", small_sample, encoders=EncoderSpec(**zoo, batch_size=8))
    with dg.instance_for_test() as instance:
        register_partitions(instance, res)
        assert _materialize(
            res, instance, ["metadata", "images", *EMB], partition_key="000-00"
        ).success

        # 1 of 2 partitions covered: refused, and the message names what is missing
        result = _materialize(res, instance, ["flow_model"], _train_cfg(max_steps=4))
        assert not result.success
        failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
        msg = failure.step_failure_data.user_failure_data.description
        assert "001-00: missing vae_latents, dino_features, text_embeddings" in msg
        assert "only 1 (50%)" in msg

        # with min_coverage 0.5 it trains on the covered partition, in a Pipes subprocess
        result = _materialize(
            res, instance, ["flow_model"], _train_cfg(max_steps=4, min_coverage=0.5)
        )
        assert result.success
        md = (
            instance.fetch_materializations(dg.AssetKey("flow_model"), limit=1)
            .records[0]
            .asset_materialization.metadata
        )
        assert md["step"].value == 4  # reported by the training process through Pipes
        assert md["grad_norm_mean"].value > 0  # the session's mean gradient norm
        assert md["device"].value == "cpu, 32-true"  # what the trainer ran on, not a guess
        assert md["partitions_used"].value == ["000-00"]
        assert "data:image/jpeg;base64" in md["loss_curve"].value

        # resume: 3 extra steps continue from the checkpoint
        result = _materialize(
            res, instance, ["flow_model"], _train_cfg(extra_steps=3, min_coverage=0.5)
        )
        assert result.success
        cat = Catalog(res.data_root)
        row = cat.query(
            "SELECT samples, device, extra FROM materializations WHERE asset='flow_model'"
        )[0]
        extra = json.loads(row["extra"])
        assert extra["step"] == 7 and extra["trained_counts"] == {"000-00": 7 * 4}
        assert extra["grad_norm_mean"] > 0  # this session's (the 3 resumed steps)
        # the record is this session's: 3 resumed steps x 4 samples; the total is kept beside it
        assert row["samples"] == 12 and extra["samples_total"] == 28
        assert extra["partitions"] == ["000-00"] and row["device"] == "cpu, 32-true"
        # what it trained on, by fingerprint: fresh now; another text max_tokens makes it stale
        assert set(extra["input_fingerprints"]) == set(EMB)
        assert [list(g.values()) for g in extra["input_fingerprints"].values()] == [
            [["000-00"]]
        ] * 3
        assert model_staleness(res) == []
        changed = make_resource(
            tmp_path / "data",
            small_sample,
            encoders=EncoderSpec(**zoo, batch_size=8, max_tokens=16),
        )
        (stale,) = model_staleness(changed, ["t"])
        assert (
            "1 text_embeddings partitions it trained on are stale (000-00: max_tokens: 128 -> 16)"
            in stale.reason
        )
        run = tmp_path / "data" / "runs" / "t"
        request = json.loads((run / "request.json").read_text())  # decided once, by Dagster
        assert request["partitions"] == ["000-00"] and request["max_steps"] == 7

        # the same run folder from the command line: resume the UI's run directly ...
        _direct(tmp_path, "t", zoo, "--extra-steps", "2")
        assert _step(run) == 9 and not (tmp_path / "cwd" / "runs").exists()
        # the ledger: every checkpoint's trained samples, in the catalog, equal to what the
        # loader yielded (the run's sample_ids records, over its three sessions)
        monkeypatch.setenv("FLOWMATCH_DATA_ROOT", str(tmp_path / "data"))
        assert cli_main(["ledger", "t"]) == 0  # the direct session's checkpoint (step 9)
        seen: dict[str, list[int]] = {}
        for line in (run / "sample_ids" / "rank0.jsonl").read_text().splitlines():
            rec = json.loads(line)
            for sid in rec["ids"]:
                seen.setdefault(sid, []).append(rec["step"])
        rows = cat.query(
            "SELECT sample_id, times_seen, first_step, last_step FROM ledger_samples "
            "WHERE run = 't' AND checkpoint_step = 9"
        )
        assert {r["sample_id"]: r["times_seen"] for r in rows} == {
            k: len(v) for k, v in seen.items()
        }
        assert all(
            (r["first_step"], r["last_step"])
            == (min(seen[r["sample_id"]]), max(seen[r["sample_id"]]))
            for r in rows
        )
        parts = cat.query(
            "SELECT checkpoint_step, samples_trained, epochs, partition_size "
            "FROM ledger_partitions WHERE run = 't' ORDER BY checkpoint_step"
        )
        assert [(p["checkpoint_step"], p["samples_trained"]) for p in parts] == [
            (4, 16),
            (7, 28),
            (9, 36),
        ]
        assert parts[-1]["epochs"] == pytest.approx(36 / parts[-1]["partition_size"])
        assert (
            cat.query(
                "SELECT count(*) AS n FROM ledger_epochs WHERE run = 't' AND checkpoint_step = 9"
            )[0]["n"]
            >= 3
        )
        # flowmatch export: the same pipeline folder from the checkpoint, encoders as trained
        assert cli_main(["export", "t", str(tmp_path / "exported")]) == 0
        from safetensors.torch import load_file

        for sub in ("transformer", "vae", "text_encoder"):
            (a,) = (tmp_path / "exported" / sub).glob("*model.safetensors")
            (b,) = (run / "pipeline" / sub).glob("*model.safetensors")
            assert load_file(a).keys() == load_file(b).keys()
            assert all((load_file(a)[k] == load_file(b)[k]).all() for k in load_file(a))
        assert (tmp_path / "exported" / "model_index.json").is_file()
        # ... and a run started directly resumes through Dagster
        _direct(tmp_path, "u", zoo, "--max-steps", "2")
        cfg = _train_cfg(extra_steps=1, min_coverage=0.5)
        cfg["ops"]["flow_model"]["config"]["run_name"] = "u"
        assert _materialize(res, instance, ["flow_model"], cfg).success
        assert _step(tmp_path / "data" / "runs" / "u") == 3

        result = _materialize(
            res,
            instance,
            ["samples"],
            {
                "ops": {
                    "samples": {
                        "config": {"run_name": "t", "steps": 2, "sizes": ["256x256", "320x224"]}
                    }
                }
            },
        )
        assert result.success
        grid = Image.open(tmp_path / "data" / "samples" / "t.png")
        assert grid.size[0] > 256 and grid.mode == "RGB"
        # a tall bucket's grid: the same prompts, each image 320 x 224 fitted in its 128 px
        # cell with its aspect kept, on white: the first cell's picture is ~128 x 90
        tall = np.asarray(
            Image.open(tmp_path / "data" / "samples" / "t_320x224.png").convert("RGB")
        )
        first = ~(tall[:130, :130] == 255).all(-1)
        h, w = (int(np.ptp(np.flatnonzero(first.any(a)))) + 1 for a in (1, 0))
        assert h >= 126 and abs(w - 128 * 224 / 320) <= 3, (h, w)

        # evaluation: caption following of every saved checkpoint, into the catalog
        result = _materialize(
            res,
            instance,
            ["evaluation"],
            {
                "ops": {
                    "evaluation": {
                        "config": {
                            "run_name": "t",
                            "n_prompts": 6,
                            "steps": 2,
                            "sizes": ["256x256", "224x320"],
                        }
                    }
                }
            },
        )
        assert result.success
        rows = cat.query(
            "SELECT * FROM evaluations WHERE run = 't' AND size = '256x256' ORDER BY attribute"
        )
        by_attr = {r["attribute"]: r for r in rows}
        assert set(by_attr) == {"colour", "shape", "size", "position", "background", "all_four"}
        assert all(r["step"] == 9 and r["n"] == 6 for r in rows)
        assert by_attr["colour"]["chance"] == pytest.approx(1 / 8)
        assert by_attr["all_four"]["chance"] == pytest.approx(1 / 8 * 1 / 6 * 1 / 2 * 1 / 3)
        # the recorded scores are exactly what the evaluation computes (deterministic)
        from flowmatch_assets.reports.evaluation import evaluate_checkpoint

        direct = evaluate_checkpoint(
            tmp_path / "data" / "runs" / "t" / "checkpoints" / "last.ckpt",
            zoo["text"],
            zoo["vae"],
            n_prompts=6,
            steps=2,
        )
        for a, r in by_attr.items():
            assert r["accuracy"] == pytest.approx(direct["accuracy"][a])
        # and at a wide bucket: landscape prompts, generated 224 x 320, recorded with the size
        wide = evaluate_checkpoint(
            tmp_path / "data" / "runs" / "t" / "checkpoints" / "last.ckpt",
            zoo["text"],
            zoo["vae"],
            n_prompts=6,
            steps=2,
            size=(224, 320),
        )
        assert wide["images"].shape[1:3] == (224, 320)
        got = {
            r["attribute"]: r["accuracy"]
            for r in cat.query("SELECT * FROM evaluations WHERE run = 't' AND size = '224x320'")
        }
        assert got == pytest.approx(wide["accuracy"])
        fig = tmp_path / "data" / "runs" / "t" / "evaluation" / "step0000009_224x320.png"
        assert Image.open(fig).size[0] > 320
        md = instance.fetch_materializations(dg.AssetKey("evaluation"), limit=1).records[0]
        md = md.asset_materialization.metadata
        assert md["colour_accuracy"].value == round(direct["accuracy"]["colour"], 3)
        assert (tmp_path / "data" / "runs" / "t" / "evaluation" / "step0000009.png").is_file()
        # 10 samples in the partition: tiny.yaml's 10% held-out rule picks none of these ids, so
        # no FD and no validation rows -- said, not invented (tests/test_run_safety.py and
        # test_learning.py cover the values)
        assert md["fd_heldout_samples"].value == 0 and md["fd_dinov2"].value is None
        assert cat.query("SELECT * FROM fd_dinov2 WHERE run = 't'") == []
        assert cat.query("SELECT * FROM validation WHERE run = 't'") == []
        # and into the training run's W&B run (same id; offline here), on their own x-axis
        run_id = (run / "wandb_run_id.txt").read_text().strip()
        files = sorted(Path(md["wandb_dir"].value).glob(f"run-{run_id}.wandb"))
        rows = [r for r in history(files[0]) if "eval/colour" in r]
        assert [r["eval/step"] for r in rows] == [9]
        assert rows[0]["eval/colour"] == pytest.approx(direct["accuracy"]["colour"])
        assert rows[0]["eval/colour_chance"] == pytest.approx(1 / 8)

        # wandb: the resolved config, the run's data coverage and the images are in the run
        first = sorted((run / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))[0]
        logged = wandb_config(first)
        assert logged["optim"]["lr"] == pytest.approx(2e-3) and logged["run"]["name"] == "t"
        assert logged["data"]["batch_size"] == 4 and logged["model"]["preset"] == "tiny"
        assert logged["coverage"]["partitions"] == 1 and logged["coverage"]["samples"] > 0
        assert logged["coverage"]["partitions_known"] == 2
        images = [r for r in history(first) if "samples/_type" in r]
        assert [r["trainer/global_step"] for r in images] == [4]  # the end of the first session
        assert images[0]["samples/_type"] == images[0]["loss_curve/_type"] == "image-file"

        # the exported SanaPipeline, loaded by plain diffusers in another process with the
        # lines in docs/training.md, draws what the project's sampler draws (same noise, steps and CFG)
        _pipeline_matches_sampler(run / "pipeline", tmp_path, zoo)


def _pipeline_matches_sampler(pipeline: Path, tmp_path: Path, zoo: dict) -> None:
    import os
    import re
    import subprocess
    import sys

    import numpy as np
    import torch

    from flowmatch_models.inference.export_format import prompt_max_tokens
    from flowmatch_models.inference.sample import generate, load_model, load_vae, prompt_embeddings

    block = (REPO / "docs" / "training.md").read_text().split("<!-- use-the-model -->")[1]
    code = re.search(r"```python\n(.*?)```", block, re.S).group(1)
    prompt = re.search(r'pipe\("([^"]+)"', code).group(1)
    code = code.replace("data/runs/demo/pipeline", str(pipeline))
    # the call's arguments, as the export records them (the guide shows the default's)
    call = json.loads((pipeline / "flowmatch_call.json").read_text())
    assert call["complex_human_instruction"] is None and code.count("max_sequence_length=128") == 2
    code = code.replace(
        "max_sequence_length=128", f"max_sequence_length={call['max_sequence_length']}"
    )
    env = {**os.environ, "PYTHONPATH": ""}  # plain diffusers: no flowmatch on the path
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]

    torch.set_num_threads(1)
    model, meta = load_model(model_dir=pipeline)
    assert [224, 320] in meta["buckets"] and [256, 256] in meta["buckets"]
    assert call["max_sequence_length"] == prompt_max_tokens(meta) == meta["max_tokens"]
    text, mask, _ = prompt_embeddings([prompt], zoo["text"], prompt_max_tokens(meta))
    # the square, and a wide aspect-ratio bucket (the guide's second line)
    for png, size in (("red_circle.png", (256, 256)), ("red_circle_wide.png", (224, 320))):
        theirs = np.asarray(Image.open(tmp_path / png).convert("RGB")).astype(int)
        ours = generate(
            model,
            text,
            mask,
            meta["scaling_factor"],
            load_vae(zoo["vae"]),
            steps=20,
            cfg_scale=4.5,
            seed=0,
            shift=meta["flow_shift"],
            null_text=meta["null_text"],
            size=size,
        )[0].astype(int)
        diff = np.abs(ours - theirs)
        assert ours.shape == theirs.shape == (*size, 3) and ours.std() > 5
        assert diff.mean() <= 1.0 and diff.max() <= 1, (png, diff.mean(), diff.max())
