"""Training: data order, DDP sharding, mid-epoch resume exactness, edited-YAML resume, outputs."""

import csv
import itertools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import dagster as dg
import numpy as np
import pytest
import torch
import yaml

from flowmatch_models.data.module import EmbeddingDataModule
from flowmatch_models.data.source import ShardSource
from flowmatch_models.data.stream import BatchStream
from flowmatch_models.storage.layout import DataLayout
from flowmatch_models.storage.store import read_shard, write_shard
from flowmatch_models.train.config import ConfigError
from flowmatch_models.train.run import TrainRequest, TrainResult, main, train

REPO = Path(__file__).resolve().parents[1]
SIZES = {"000-00": 24, "000-01": 20, "000-02": 28, "001-00": 24}
SF = 0.41407


def make_store(root: Path, sizes: dict[str, int] = SIZES, seed: int = 0) -> Path:
    """Random but well-formed vae_latents / dino_features / text_embeddings shards."""
    rng = np.random.default_rng(seed)
    layout = DataLayout(root)
    for i, (p, n) in enumerate(sizes.items()):
        ids = [f"{p}/{j}" for j in range(n)]
        lat = (rng.standard_normal((n, 32, 8, 8)) / SF).astype(np.float16)
        write_shard(
            layout.asset_path("vae_latents", p),
            {"latents": lat},
            ids,
            codec="zstd" if i % 2 else "none",
            attrs={"scaling_factor": SF},
        )
        write_shard(
            layout.asset_path("dino_features", p),
            {
                "patch": rng.standard_normal((n, 64, 384)).astype(np.float16),
                "cls": rng.standard_normal((n, 384)).astype(np.float16),
            },
            ids,
            codec="none",
        )
        lengths = rng.integers(2, 24, n).astype(np.int32)
        tokens = rng.standard_normal((int(lengths.sum()), 640)).astype(np.float16)
        write_shard(
            layout.asset_path("text_embeddings", p),
            {"tokens": tokens, "lengths": lengths},
            ids,
            codec="zstd",
        )
    return root


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    root = make_store(tmp_path_factory.mktemp("store"))
    # an incomplete partition (no text) must be ignored
    layout = DataLayout(root)
    shutil.copy(
        layout.asset_path("vae_latents", "000-00"), layout.asset_path("vae_latents", "009-00")
    )
    return root


def tiny_config(root: Path, out: Path, **over) -> dict:
    cfg = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    cfg["run"]["out_dir"] = str(out)
    cfg["data"].update(root=str(root), batch_size=8, num_workers=0)
    cfg["trainer"].update(
        max_steps=8, accumulate_grad_batches=2, log_every=1, checkpoint_every=100, sample_every=0
    )
    cfg["optim"].update(warmup_steps=0, lr=1e-3)
    cfg["logging"].update(wandb=False, record_sample_ids=True)
    for key, value in over.items():
        section, leaf = key.split("__")
        cfg[section][leaf] = value
    return cfg


def run_training(cfg: dict, resume: str = "auto") -> TrainResult:
    return train(TrainRequest(config=cfg, resume=resume))


def _csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def read_records(out: Path, rank: int = 0) -> list[dict]:
    lines = (out / "sample_ids" / f"rank{rank}.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines]


# --------------------------------------------------------------------------------------------
# data order
# --------------------------------------------------------------------------------------------


def test_complete_partitions_and_batches(store: Path) -> None:
    dm = EmbeddingDataModule(store, batch_size=8)
    assert dm.partitions == sorted(SIZES)  # 009-00 has no dino/text
    assert dm.scaling_factor == pytest.approx(SF)
    stored = next(iter(dm.train_dataloader()))  # what the workers hand over: rows as stored
    assert stored["latents"].dtype == torch.float16 and "text" not in stored
    batch = dm.decode_batch(stored, "cpu")  # what the training step sees (on its device)
    assert batch["latents"].shape == (8, 32, 8, 8) and batch["dino"].shape == (8, 64, 384)
    width = batch["mask"].sum(1).max()
    assert batch["text"].shape == (8, width, 640)  # padded to the batch's longest caption
    assert not batch["text"][~batch["mask"]].any()
    assert (
        len({i.split("/")[0] for i in batch["meta"]["ids"]}) > 1
    )  # the shuffle window mixes shards


def test_ranks_and_workers_see_disjoint_exact_samples(store: Path) -> None:
    src = ShardSource(store, sorted(SIZES))
    n_batches = sum(SIZES.values()) // 16

    def ids(stream: BatchStream, n: int, workers: int = 0) -> list[list[str]]:
        it = iter(torch.utils.data.DataLoader(stream, batch_size=None, num_workers=workers))
        return [next(it)["meta"]["ids"] for _ in range(n)]

    per_rank = [ids(BatchStream(src, 8, seed=3, rank=r, world_size=2), n_batches) for r in (0, 1)]
    seen = [i for r in per_rank for b in r for i in b]
    assert len(seen) == len(set(seen)) == n_batches * 16  # disjoint, no repeats in an epoch
    # two dataloader workers interleave batches; the order is unchanged
    assert ids(BatchStream(src, 8, seed=3, rank=1, world_size=2), n_batches, 2) == per_rank[1]
    # resuming at a sample position continues the same sequence
    resumed = BatchStream(src, 8, seed=3, rank=1, world_size=2, start_sample=3 * 16)
    assert ids(resumed, 2) == per_rank[1][3:5]


def _stream_ids(stream: BatchStream, n: int, workers: int) -> list[list[str]]:
    kw = {"num_workers": workers, "prefetch_factor": 2} if workers else {}
    it = iter(torch.utils.data.DataLoader(stream, batch_size=None, **kw))
    return [next(it)["meta"]["ids"] for _ in range(n)]


def test_workers_follow_the_single_process_order_across_epochs(store: Path) -> None:
    """4 workers, 6 batches per epoch (not a multiple of 4), 8 epochs: the 0-worker sequence,
    and every sample exactly once per epoch (the per-epoch worker assignment drifted apart)."""
    src = ShardSource(store, sorted(SIZES))
    ref = _stream_ids(BatchStream(src, 16, seed=5), 48, 0)
    assert _stream_ids(BatchStream(src, 16, seed=5), 48, 4) == ref
    for e in range(8):
        epoch_ids = [i for b in ref[6 * e : 6 * e + 6] for i in b]
        assert len(epoch_ids) == len(set(epoch_ids)) == 96
    # odd sizes: 3 workers, batch 10 (9 batches per epoch, 6 samples dropped each epoch)
    ref10 = _stream_ids(BatchStream(src, 10, seed=1), 20, 0)
    assert _stream_ids(BatchStream(src, 10, seed=1), 20, 3) == ref10


@pytest.mark.parametrize("k", [3, 6, 13])  # mid-epoch, at an epoch boundary, in epoch 2
def test_resume_anywhere_with_another_worker_count(store: Path, k: int) -> None:
    src = ShardSource(store, sorted(SIZES))
    stream = BatchStream(src, 16, seed=5)
    ref = _stream_ids(stream, 18, 0)
    epoch, pos = list(itertools.islice(stream.positions(), k + 1))[k]
    resumed = BatchStream(src, 16, seed=5, start_epoch=epoch, start_sample=pos)
    assert _stream_ids(resumed, 18 - k, 3) == ref[k:]


# --------------------------------------------------------------------------------------------
# resume
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_is_exact_and_edited_yaml_wins(store: Path, tmp_path: Path, workers: int) -> None:
    # 96 samples, 12 batches of 8 per epoch; 8 steps x 2 accumulation = 16 batches (> 1 epoch).
    # With workers, batches are prefetched past the stop: the position counts consumed ones.
    def config(out: Path, **kw) -> dict:
        return tiny_config(store, out, **{"data__num_workers": workers, **kw})

    full = run_training(config(tmp_path / "full"), resume="none")
    assert full.step == 8
    a = read_records(tmp_path / "full")

    split = tmp_path / "split"
    # the first segment runs with the other worker count: the resumed order must not care
    first = run_training(
        config(split, trainer__max_steps=3, data__num_workers=2 - workers), resume="none"
    )
    assert first.step == 3
    ckpt = split / "checkpoints" / "last.ckpt"
    state = torch.load(ckpt, weights_only=True)  # only tensors and primitive containers
    assert state["EmbeddingDataModule"]["position"] == 3 * 2 * 8
    assert sum(state["EmbeddingDataModule"]["trained_counts"].values()) == 48
    counts = json.loads((split / "checkpoints" / "trained_counts.json").read_text())
    assert counts["trained_counts"] == state["EmbeddingDataModule"]["trained_counts"]
    shutil.copytree(split, tmp_path / "edited")

    second = run_training(config(split), resume="auto")
    assert second.resumed_from == str(ckpt) and second.step == 8
    b = read_records(split)
    assert [r["ids"] for r in b] == [r["ids"] for r in a]
    assert [r["step"] for r in b] == [r["step"] for r in a]
    np.testing.assert_allclose([r["loss"] for r in b], [r["loss"] for r in a], rtol=0, atol=1e-6)
    assert second.trained_counts == full.trained_counts
    assert sum(full.trained_counts.values()) == 16 * 8
    # the ledger of the resumed run's checkpoint (two sessions, an epoch boundary, gradient
    # accumulation 2) reconstructs exactly the samples the loader yielded, and their steps
    _ledger_matches_records(store, torch.load(ckpt, weights_only=True), a, accumulate=2)
    # a later checkpoint's ledger is its base checkpoint's plus a delta (what the catalog stores)
    from flowmatch_models.train.ledger import delta, expand, is_prefix

    base = torch.load(tmp_path / "edited" / "checkpoints" / "last.ckpt", weights_only=True)
    base = base["EmbeddingDataModule"]["ledger"]
    final = torch.load(ckpt, weights_only=True)["EmbeddingDataModule"]["ledger"]
    assert is_prefix(base, final) and not is_prefix(final, base)
    ids_of = lambda p: read_shard(DataLayout(store).asset_path("vae_latents", p)).ids  # noqa: E731
    count: dict[str, int] = {}
    for rows in (expand(base, ids_of), expand(delta(base, final), ids_of)):
        for sid, n in zip(rows["sample_id"].to_pylist(), rows["times_seen"]):
            count[sid] = count.get(sid, 0) + int(n)
    whole = expand(final, ids_of)
    assert count == dict(zip(whole["sample_id"].to_pylist(), whole["times_seen"].tolist()))

    # resume with an edited YAML: new lr and batch size take effect, data continues in place
    edited = tmp_path / "edited"
    (edited / "sample_ids" / "rank0.jsonl").unlink()
    cfg = config(edited, trainer__max_steps=5, optim__lr=5e-3, data__batch_size=4)
    out = run_training(cfg, resume="auto")
    assert out.metrics["lr"] == pytest.approx(5e-3)
    assert not list((edited / "checkpoints").glob("last-v*.ckpt"))  # last.ckpt overwritten
    assert torch.load(edited / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 5
    lrs = [r["train/lr"] for r in _csv(edited / "metrics.csv") if r.get("train/lr")]
    assert [float(x) for x in lrs] == pytest.approx([1e-3] * 3 + [5e-3] * 2)  # from step 4 on
    recs = read_records(edited)
    assert [len(r["ids"]) for r in recs] == [4] * 4
    assert recs[0]["position"] == 48  # exactly where the 3-step run stopped
    assert [i for r in recs for i in r["ids"]] == [i for r in a[6:8] for i in r["ids"]]


def _ledger_matches_records(store: Path, ckpt: dict, records: list[dict], accumulate: int) -> None:
    from flowmatch_models.storage.store import read_shard
    from flowmatch_models.train.ledger import expand

    layout = DataLayout(store)
    got = expand(
        ckpt["EmbeddingDataModule"]["ledger"],
        lambda p: read_shard(layout.asset_path("vae_latents", p)).ids,
    )
    want: dict[str, list[int]] = {}
    for i, r in enumerate(records):  # the optimizer step that used batch i
        for sid in r["ids"]:
            want.setdefault(sid, []).append(i // accumulate + 1)
    got_ids, got_parts = got["sample_id"].to_pylist(), got["partition"].to_pylist()
    assert sorted(got_ids) == sorted(want)
    for sid, p, n, lo, hi in zip(
        got_ids, got_parts, got["times_seen"], got["first_step"], got["last_step"]
    ):
        assert (n, lo, hi) == (len(want[sid]), min(want[sid]), max(want[sid])), sid
        assert sid.startswith(p + "/")


# --------------------------------------------------------------------------------------------
# end to end: 2-process DDP (gloo) via the CLI, W&B offline, every output
# --------------------------------------------------------------------------------------------


def test_ddp_cli_run_writes_everything(store: Path, tmp_path: Path) -> None:
    out = tmp_path / "ddp"
    cfg = tiny_config(
        store,
        out,
        trainer__devices=2,
        trainer__strategy="ddp",
        trainer__accelerator="cpu",
        trainer__max_steps=4,
        trainer__accumulate_grad_batches=1,
        trainer__checkpoint_every=2,
        trainer__sample_every=2,
        logging__wandb=True,
        logging__wandb_mode="offline",
    )
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {k: v for k, v in os.environ.items() if k not in ("WANDB_API_KEY", "LOCAL_RANK")}
    env.update(PYTHONPATH=str(REPO), WANDB_SILENT="true", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "flowmatch_models.train",
            "--config",
            str(path),
            "--result-json",
            str(tmp_path / "summary.json"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "step 4/4" in proc.stdout
    r0, r1 = read_records(out, 0), read_records(out, 1)
    assert len(r0) == len(r1) == 4
    for a, b in zip(r0, r1):
        assert a["position"] == b["position"] and not set(a["ids"]) & set(b["ids"])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert sum(summary["trained_counts"].values()) == 4 * 16
    ckpt = torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 4 and any(k.startswith("ema.") for k in ckpt["state_dict"])
    assert (out / "checkpoints" / "step0000002.ckpt").is_file()
    # wandb: the sample grid and the loss curve as images at the sample cadence, the config
    from tests.wandb_records import config as wandb_config
    from tests.wandb_records import history

    (run_file,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    images = [r for r in history(run_file) if "samples/_type" in r]
    assert [r["trainer/global_step"] for r in images] == [2, 4]  # the cadence (4 is also the end)
    assert all(r["loss_curve/_type"] == "image-file" for r in images)
    assert wandb_config(run_file)["trainer"]["devices"] == 2
    rows = (out / "metrics.csv").read_text().splitlines()
    assert "train/loss" in rows[0] and "train/lr" in rows[0] and len(rows) > 4
    for png in ("loss_curve.png", "samples/step0000002.png", "samples/step0000004.png"):
        assert (out / png).stat().st_size > 1000, png

    from diffusers import SanaTransformer2DModel

    model = SanaTransformer2DModel.from_pretrained(out / "pipeline" / "transformer")
    assert not (out / "pipeline" / "model_index.json").exists()  # no encoders: not a pipeline
    from flowmatch_models.model.dit import fold_text_norm

    ema = SanaTransformer2DModel(**ckpt["flowmatch"]["transformer_config"])
    ema.load_state_dict({k[4:]: v for k, v in ckpt["state_dict"].items() if k.startswith("ema.")})
    folded = fold_text_norm(ema, ckpt["flowmatch"]["text_norm"]).state_dict()  # model.text_norm
    assert not torch.equal(
        folded["caption_projection.linear_1.bias"],
        ema.state_dict()["caption_projection.linear_1.bias"],
    )
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, folded[k])


def test_bench_counts_grouped_conv_backward_like_the_forward() -> None:
    """torch's built-in formula prices depthwise-conv weight grads as dense; ours does not."""
    from torch.utils.flop_counter import FlopCounterMode

    from flowmatch_assets.bench.train import FLOP_FORMULAS

    for groups in (1, 64):
        conv = torch.nn.Conv2d(64, 64, 3, padding=1, groups=groups)
        x = torch.randn(2, 64, 8, 8, requires_grad=True)
        fwd, bwd = (FlopCounterMode(display=False, custom_mapping=FLOP_FORMULAS) for _ in "ab")
        with fwd:
            y = conv(x)
        with bwd:
            y.sum().backward()
        assert fwd.get_total_flops() == 2 * 2 * 64 * (64 // groups) * 9 * 64
        assert bwd.get_total_flops() == 2 * fwd.get_total_flops()  # grad input + grad weight


def test_cli_reports_to_dagster_pipes(store: Path, tmp_path: Path) -> None:
    """Launched through Dagster Pipes, the run logs progress and materializes its metrics."""
    cfg = tiny_config(
        store, tmp_path / "run", trainer__max_steps=2, logging__record_sample_ids=False
    )
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "flowmatch_models.train", "--config", str(tmp_path / "run.yaml")]
    env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}

    @dg.asset
    def training(context: dg.AssetExecutionContext, pipes: dg.PipesSubprocessClient):
        return pipes.run(command=cmd, context=context, env=env).get_materialize_result()

    result = dg.materialize([training], resources={"pipes": dg.PipesSubprocessClient()})
    assert result.success
    meta = result.asset_materializations_for_node("training")[0].metadata
    assert meta["step"].value == 2 and meta["loss"].value > 0
    assert meta["grad_norm_mean"].value > 0  # this session's mean gradient norm (TrainResult)
    assert Path(meta["checkpoint"].value).is_file()


def test_sample_grids_from_checkpoint_and_export_with_zoo_encoders(
    store: Path, tmp_path: Path
) -> None:
    """Prompts -> Gemma3 (tiny random zoo) -> EMA sampler -> DC-AE decode -> the same PNG."""
    from PIL import Image

    from flowmatch_models.encoders.zoo import create_zoo
    from flowmatch_models.inference.sample import main as sample_main

    zoo = create_zoo(tmp_path / "zoo")
    cfg = tiny_config(store, tmp_path / "run", trainer__max_steps=2, trainer__sample_every=2)
    cfg["encoders"] = {"vae": str(zoo["vae"]), "text": str(zoo["text"])}
    cfg["sample"].update(prompts=["a red car", "a cat on a mat", "a map"], steps=3)
    summary = run_training(cfg, resume="none")
    assert Image.open(summary.sample_grid).size == (262, 262)  # 3 prompts, 2x2 cells
    grids = []
    for src in (["--checkpoint", summary.checkpoint], ["--model", summary.export_dir]):
        out = tmp_path / f"grid{len(grids)}.png"
        args = ["--prompts", "a red car", "a cat", "--steps", "3", "--out", str(out)]
        args += ["--text-encoder", str(zoo["text"]), "--vae", str(zoo["vae"])]
        assert sample_main(src + args) == 0
        grids.append(np.asarray(Image.open(out)))
    assert grids[0].shape == (132, 262, 3)
    np.testing.assert_array_equal(grids[0], grids[1])  # checkpoint EMA == exported EMA


def test_configs_load_and_base_is_effective_batch_1024() -> None:
    from flowmatch_models.train.config import load_config

    tiny = load_config(REPO / "configs" / "tiny.yaml", ["optim.lr=0.01", "data.partitions=[a, b]"])
    assert tiny.optim.lr == 0.01 and tiny.data.partitions == ["a", "b"]
    base = load_config(REPO / "configs" / "base.yaml", max_steps=7)
    t = base.trainer
    assert base.data.batch_size * t.accumulate_grad_batches * t.devices == 1024
    assert t.max_steps == 7 and base.model.preset == "base"
    with pytest.raises(ConfigError, match="unknown config key 'optim.lrr'"):
        load_config({"optim": {"lrr": 1}})


def test_resume_that_changes_the_order_stops_and_names_the_setting(
    store: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    run_training(tiny_config(store, out, trainer__max_steps=2), resume="none")
    for key, value, name in (
        ("data__shuffle_window", 2, "data.shuffle_window"),
        ("run__seed", 7, "run.seed"),
    ):
        with pytest.raises(ValueError, match=rf"{name}: checkpoint .* -> now {value}"):
            run_training(tiny_config(store, out, trainer__max_steps=3, **{key: value}))
    # an explicit override continues from the start of the next epoch with the new order
    res = run_training(
        tiny_config(
            store, out, trainer__max_steps=3, data__shuffle_window=2, data__allow_order_change=True
        ),
    )
    assert res.step == 3 and res.data_position["epoch"] == 1


def test_ddp_with_repa_off(store: Path, tmp_path: Path) -> None:
    """repa_lambda 0: no REPA head is built, so DDP has no unused parameters (it failed on the
    second step). REPA on is covered by test_ddp_cli_run_writes_everything."""
    out = tmp_path / "ddp"
    cfg = tiny_config(
        store,
        out,
        trainer__devices=2,
        trainer__strategy="ddp",
        trainer__accelerator="cpu",
        trainer__max_steps=3,
        trainer__accumulate_grad_batches=1,
        flow__repa_lambda=0.0,
    )
    _cli_run(tmp_path, cfg, "run")
    ckpt = torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 3
    assert not any(k.startswith("model.projector") for k in ckpt["state_dict"])
    assert len(read_records(out, 0)) == len(read_records(out, 1)) == 3


def test_training_cli_mistakes_are_one_line(store: Path, tmp_path: Path, capsys) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tiny_config(store, tmp_path / "r", trainer__max_steps=1)))
    assert main(["--config", str(path), "--set", "optim.lrr=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --set optim.lrr: unknown config key") and "\n" not in err
    assert main(["--config", str(tmp_path / "nope.yaml")]) == 2
    err = capsys.readouterr().err
    assert "nope.yaml not found; start from configs/tiny.yaml" in err
    assert main(["--config", str(path), "--resume", "none"]) == 0
    assert main(["--config", str(path), "--set", "data.shuffle_window=3", "--max-steps", "2"]) == 2
    assert "data.shuffle_window: checkpoint 4 -> now 3" in capsys.readouterr().err


def test_config_is_typed_with_one_set_of_defaults(tmp_path: Path, monkeypatch) -> None:
    from flowmatch_models.train.config import load_config
    from flowmatch_models.train.module import FlowMatchModule

    with pytest.raises(ConfigError, match=r"^optim\.lr: Input should be a valid number.*'fast'"):
        load_config({"optim": {"lr": "fast"}})
    with pytest.raises(ConfigError, match=r"^--set optim.schedule: Input should be 'constant' or"):
        load_config({}, ["optim.schedule=linear"])
    with pytest.raises(ConfigError, match=r"^--set data.batch_size: Input should be greater"):
        load_config({}, ["data.batch_size=0"])
    with pytest.raises(ConfigError, match=r"^--set optim.lr.x: 'lr' is a value, not a section"):
        load_config({}, ["optim.lr.x=1"])
    for strategy in ("fsdp", "deepspeed_stage_2"):  # sharded gradients: refused in one line
        with pytest.raises(ConfigError, match=r"^--set trainer.strategy: .*use ddp") as e:
            load_config({}, [f"trainer.strategy={strategy}"])
        assert "\n" not in str(e.value)
    # the defaults live in TrainConfig alone: the module reads them, it has no fallbacks
    cfg = load_config({"optim": {"lr": 1e-3}})
    assert cfg.optim.warmup_steps == 1000 and cfg.optim.ema_decay == 0.9999
    sched = FlowMatchModule(cfg).configure_optimizers()["lr_scheduler"]["scheduler"]
    assert sched.get_last_lr()[0] == pytest.approx(1e-3 / 1000)  # warmup from the one default
    # one run folder: <data root>/runs/<run.name>, data root from FLOWMATCH_DATA_ROOT
    monkeypatch.setenv("FLOWMATCH_DATA_ROOT", str(tmp_path / "root"))
    monkeypatch.chdir(tmp_path)
    cfg = load_config(REPO / "configs" / "tiny.yaml", ["run.name=r1"])
    assert cfg.run_dir() == tmp_path / "root" / "runs" / "r1"
    assert load_config({"run": {"out_dir": "elsewhere"}}).run_dir() == tmp_path / "elsewhere"
    monkeypatch.delenv("FLOWMATCH_DATA_ROOT")
    assert load_config({}).run_dir() == tmp_path / "data" / "runs" / "default"


def test_gpu_check_says_it_needs_a_gpu_and_runs_every_phase_in_smoke(tmp_path, capsys) -> None:
    """scripts/gpu_check.sh: on a CPU machine one line and exit 0; --smoke runs every phase on
    the CPU at toy sizes so the GPU run is not the first run of the script."""
    from flowmatch_assets.bench.gpu import TARGETS
    from flowmatch_assets.bench.gpu import main as gpu_main

    if not torch.cuda.is_available():
        assert gpu_main(["--out", str(tmp_path / "none.json")])["skipped"] == "no CUDA GPU"
        assert "needs a CUDA GPU" in capsys.readouterr().out
        assert not (tmp_path / "none.json").exists()
    assert gpu_main(["--smoke", "--out", str(tmp_path / "g.json")])["bench"] == "gpu"
    r = json.loads((tmp_path / "g.json").read_text())
    pre, tr, a = r["precalc"][0], r["train"][0], r["achieved"]
    assert (
        pre["bench"] == "precalc" and pre["pairs_per_s"] > 0 and pre["gflops_per_pair_total"] > 300
    )
    assert tr["bench"] == "train" and 0 < tr["mfu"] < 1.5 and tr["samples_per_s"] > 0
    assert r["loader"]["samples_per_s"] > 0 and r["loader"]["samples"] == 64
    assert a["precalc_fraction_of_target"] == round(
        pre["pairs_per_s"] / TARGETS["precalc_pairs_per_s"], 3
    )
    assert a["train_fraction_of_target"] == round(tr["mfu"] / TARGETS["train_mfu"], 3)


def _cli_run(tmp_path: Path, cfg: dict, name: str) -> None:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {k: v for k, v in os.environ.items() if k not in ("WANDB_API_KEY", "LOCAL_RANK")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "flowmatch_models.train", "--config", str(path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _flat(out: Path, sessions: list[tuple[int, int]]) -> list[str]:
    """The global sample sequence of a run: per step, rank 0's ids then rank 1's; ``sessions``
    is ``(world size, steps)`` in order."""
    ranks = {
        r: read_records(out, r) for r in (0, 1) if (out / "sample_ids" / f"rank{r}.jsonl").exists()
    }
    seq, used = [], {0: 0, 1: 0}
    for world, steps in sessions:
        for _ in range(steps):
            for r in range(world):
                seq += ranks[r][used[r]]["ids"]
                used[r] += 1
    return seq


@pytest.mark.slow
def test_elastic_resume_keeps_the_global_sample_order(store: Path, tmp_path: Path) -> None:
    """Resuming with another number of DDP ranks (gloo, 2 -> 1 and 1 -> 2) continues the same
    global sample sequence as one uninterrupted single-rank run, across an epoch boundary."""

    def cfg(out: Path, devices: int, max_steps: int) -> dict:
        return tiny_config(
            store,
            out,
            trainer__devices=devices,
            trainer__accelerator="cpu",
            trainer__strategy="ddp" if devices > 1 else "auto",
            trainer__max_steps=max_steps,
            trainer__accumulate_grad_batches=1,
        )

    _cli_run(tmp_path, cfg(tmp_path / "ref", 1, 14), "ref")  # 14 x 8 = 112 > 96 samples
    ref = _flat(tmp_path / "ref", [(1, 14)])
    _cli_run(tmp_path, cfg(tmp_path / "a", 2, 3), "a1")  # 3 x 16 = 48
    _cli_run(tmp_path, cfg(tmp_path / "a", 1, 11), "a2")  # + 8 x 8 = 112
    assert _flat(tmp_path / "a", [(2, 3), (1, 8)]) == ref
    _cli_run(tmp_path, cfg(tmp_path / "b", 1, 6), "b1")  # 6 x 8 = 48
    _cli_run(tmp_path, cfg(tmp_path / "b", 2, 10), "b2")  # + 4 x 16 = 112
    assert _flat(tmp_path / "b", [(1, 6), (2, 4)]) == ref


@pytest.mark.slow
def test_training_grows_with_coverage_and_resumes_exactly_after_a_kill(tmp_path: Path) -> None:
    """Start on one partition; two more complete while it runs (their shards appear by atomic
    rename, as the embedding assets write them); they are used from the next epoch on; a kill
    and a resume continue the exact sample sequence, on each epoch's recorded partition set."""
    import signal
    import time

    root, staged = tmp_path / "data", tmp_path / "staged"
    make_store(root, {"000-00": 24})
    make_store(staged, {"001-00": 16, "002-00": 24}, seed=1)
    out = tmp_path / "run"
    cfg = tiny_config(
        root,
        out,
        trainer__max_steps=100000,
        trainer__accumulate_grad_batches=1,
        trainer__checkpoint_every=4,
    )
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {k: v for k, v in os.environ.items() if k not in ("WANDB_API_KEY", "LOCAL_RANK")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "flowmatch_models.train", "--config", str(path)]
    ids_file = out / "sample_ids" / "rank0.jsonl"

    def records() -> list[dict]:
        if not ids_file.exists():
            return []
        lines = ids_file.read_text().split("\n")[:-1]  # a killed writer's last line is partial
        return [json.loads(x) for x in lines]

    def wait_for(pred, timeout=120) -> list[dict]:
        t0 = time.time()
        while time.time() - t0 < timeout:
            recs = records()
            if pred(recs):
                return recs
            time.sleep(0.05)
        raise AssertionError(f"timed out; {len(records())} records")

    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:
        wait_for(lambda r: len(r) >= 6)  # two epochs of 3 batches on 000-00
        # both partitions complete at (nearly) one instant: their last asset moved back to back
        for asset in ("vae_latents", "dino_features", "text_embeddings"):
            for p in ("001-00", "002-00"):
                src = DataLayout(staged).asset_path(asset, p)
                dst = DataLayout(root).asset_path(asset, p)
                os.replace(src, dst)
        recs = wait_for(lambda r: any(not i.startswith("000-00") for x in r for i in x["ids"]))
        first_new = next(
            k for k, x in enumerate(recs) if any(not i.startswith("000") for i in x["ids"])
        )
        assert recs[first_new]["position"] == 0  # from an epoch's start, not mid-epoch
        grown_epoch = recs[first_new]["epoch"]
        assert all(i.startswith("000-00") for x in recs[:first_new] for i in x["ids"])
        # kill once a few batches of the grown epochs have trained, mid-epoch, with steps trained
        # after the last checkpoint. The trainer is paused (SIGSTOP) to look: killed right after
        # a checkpoint there would be nothing to train again, so it is resumed and looked at later.
        last = out / "checkpoints" / "last.ckpt"
        need = first_new + 13
        for _ in range(50):
            wait_for(lambda r, n=need: len(r) >= n and r[-1]["position"] > 0)
            proc.send_signal(signal.SIGSTOP)
            recs = records()
            saved = torch.load(last, weights_only=True)["global_step"] if last.exists() else -1
            if saved > recs[first_new]["step"] and recs[-1]["step"] > saved:
                break
            proc.send_signal(signal.SIGCONT)
            need = len(recs) + 1
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    killed = records()
    ids_file.write_text("".join(json.dumps(x) + "\n" for x in killed))  # drop a partial line
    ckpt = torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)
    step = ckpt["global_step"]
    assert step > killed[first_new]["step"]
    state = ckpt["EmbeddingDataModule"]
    assert state["partitions"] == ["000-00", "001-00", "002-00"]
    epochs = {s["epoch"]: s["partitions"] for s in state["ledger"]}
    assert epochs[grown_epoch - 1] == ["000-00"] and epochs[grown_epoch] == state["partitions"]

    # resume: the steps after the checkpoint are trained again on exactly the same samples
    cfg["trainer"]["max_steps"] = killed[-1]["step"] + 4
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = records()[len(killed) :]
    redo = [x for x in killed if x["step"] > step]
    assert redo and [x["ids"] for x in resumed[: len(redo)]] == [x["ids"] for x in redo]
    assert [x["step"] for x in resumed[: len(redo)]] == [x["step"] for x in redo]
    assert resumed[-1]["step"] == killed[-1]["step"] + 4
    # the coverage per epoch: available vs used, in the ledger and as a picture
    final = torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)["EmbeddingDataModule"]
    firsts = {s["epoch"]: s for s in reversed(final["ledger"])}
    assert [firsts[e]["available_partitions"] for e in (0, grown_epoch)] == [1, 3]
    # trainable samples: the 24 and 64 samples less tiny.yaml's 10% held out by id hash
    from flowmatch_models.data.order import train_rows

    trainable = {
        p: len(train_rows(read_shard(DataLayout(root).asset_path("vae_latents", p)).ids, 0.1, 50))
        for p in ("000-00", "001-00", "002-00")
    }
    assert [firsts[e]["available_samples"] for e in (0, grown_epoch)] == [
        trainable["000-00"],
        sum(trainable.values()),
    ]
    assert [trainable["000-00"], sum(trainable.values())] == [21, 55]
    assert (out / "coverage.png").stat().st_size > 5000
