"""flow_model and samples through Dagster: the coverage rule, training via Pipes in a real
subprocess (metrics reported back), resume with extra steps, and the sample grid."""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg
import pytest
from PIL import Image

from flowmatch_assets.catalog import Catalog
from flowmatch_assets.definitions import defs, resources_for
from flowmatch_assets.partitions import register_partitions
from flowmatch_models.embeddings import EncoderSpec
from tests.conftest import make_resource
from tests.wandb_records import history

EMB = ["vae_latents", "dino_features", "text_embeddings"]


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


def _train_cfg(**kw):
    cfg = {
        "run_name": "t",
        "overrides": [
            "data.batch_size=4",
            "trainer.log_every=2",
            "trainer.sample_every=1000",
            "trainer.checkpoint_every=1000",
            "sample.steps=2",
        ],
        **kw,
    }
    return {"ops": {"flow_model": {"config": cfg}}}


@pytest.mark.slow
def test_coverage_rule_then_train_resume_and_sample(tmp_path, small_sample, zoo):
    res = make_resource(tmp_path / "data", small_sample, encoders=EncoderSpec(**zoo, batch_size=8))
    with dg.instance_for_test() as instance:
        register_partitions(instance, res)
        assert _materialize(
            res, instance, ["pd12m_metadata", "images_256", *EMB], partition_key="000-00"
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
        assert md["partitions_used"].value == ["000-00"]
        assert "data:image/jpeg;base64" in md["loss_curve"].value

        # resume: 3 extra steps continue from the checkpoint
        result = _materialize(
            res, instance, ["flow_model"], _train_cfg(extra_steps=3, min_coverage=0.5)
        )
        assert result.success
        summary = json.loads((tmp_path / "data" / "runs" / "t" / "summary.json").read_text())
        assert summary["step"] == 7 and summary["resumed_from"]
        assert summary["trained_counts"] == {"000-00": 7 * 4}
        cat = Catalog(res.data_root)
        row = cat.query("SELECT samples, extra FROM materializations WHERE asset='flow_model'")[0]
        # the record is this session's: 3 resumed steps x 4 samples; the total is kept beside it
        assert row["samples"] == 12 and json.loads(row["extra"])["samples_total"] == 28
        assert json.loads(row["extra"])["partitions"] == ["000-00"]

        result = _materialize(
            res,
            instance,
            ["samples"],
            {"ops": {"samples": {"config": {"run_name": "t", "steps": 2}}}},
        )
        assert result.success
        grid = Image.open(tmp_path / "data" / "samples" / "t.png")
        assert grid.size[0] > 256 and grid.mode == "RGB"

        # evaluation: caption following of every saved checkpoint, into the catalog
        result = _materialize(
            res,
            instance,
            ["evaluation"],
            {"ops": {"evaluation": {"config": {"run_name": "t", "n_prompts": 6, "steps": 2}}}},
        )
        assert result.success
        rows = cat.query("SELECT * FROM evaluations WHERE run = 't' ORDER BY attribute")
        by_attr = {r["attribute"]: r for r in rows}
        assert set(by_attr) == {"colour", "shape", "size", "position", "background", "all_four"}
        assert all(r["step"] == 7 and r["n"] == 6 for r in rows)
        assert by_attr["colour"]["chance"] == pytest.approx(1 / 8)
        assert by_attr["all_four"]["chance"] == pytest.approx(1 / 8 * 1 / 6 * 1 / 2 * 1 / 3)
        # the recorded scores are exactly what the evaluation computes (deterministic)
        from flowmatch_assets.evaluation import evaluate_checkpoint

        direct = evaluate_checkpoint(
            tmp_path / "data" / "runs" / "t" / "checkpoints" / "last.ckpt",
            zoo["text"], zoo["vae"], n_prompts=6, steps=2,
        )  # fmt: skip
        for a, r in by_attr.items():
            assert r["accuracy"] == pytest.approx(direct["accuracy"][a])
        md = instance.fetch_materializations(dg.AssetKey("evaluation"), limit=1).records[0]
        md = md.asset_materialization.metadata
        assert md["colour_accuracy"].value == round(direct["accuracy"]["colour"], 3)
        assert (tmp_path / "data" / "runs" / "t" / "evaluation" / "step0000007.png").is_file()
        # and into the training run's W&B run (same id; offline here), on their own x-axis
        run = tmp_path / "data" / "runs" / "t"
        run_id = (run / "wandb_run_id.txt").read_text().strip()
        files = sorted(Path(md["wandb_dir"].value).glob(f"run-{run_id}.wandb"))
        rows = [r for r in history(files[0]) if "eval/colour" in r]
        assert [r["eval/step"] for r in rows] == [7]
        assert rows[0]["eval/colour"] == pytest.approx(direct["accuracy"]["colour"])
        assert rows[0]["eval/colour_chance"] == pytest.approx(1 / 8)
