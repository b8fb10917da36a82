"""Fine-tuning with lineage, through the real CLI, Dagster (the fine_tune asset, Pipes) and the
catalog: a run that starts from another run's EMA weights (parts frozen) on a weighted mix of
PD12M's partitions and a second procedural dataset written as an image folder; what it records
about its parent everywhere; that it is stale once its parent is re-trained; and that starting
from the parent is what makes it learn faster than the same run from scratch."""

from __future__ import annotations

import csv
import json
import shutil
import warnings
from pathlib import Path

import dagster as dg
import pytest
import torch

from flowmatch_assets.catalog import Catalog
from flowmatch_assets.cli import main as cli_main
from flowmatch_assets.cli.commands import build_parser
from flowmatch_models.train.config import ConfigError, load_config
from flowmatch_models.train.finetune import ema_digest, freeze
from flowmatch_models.train.run import select_sources
from tests.byo_data import readme_commands
from tests.wandb_records import config as wandb_config

REPO = Path(__file__).resolve().parents[1]
FAST = [
    "data.batch_size=4",
    "trainer.log_every=1",
    "trainer.sample_every=0",
    "trainer.val_every=0",
    "optim.warmup_steps=2",
    "logging.wandb=false",
]


#: What the libraries print that tells a user nothing (issue 29): Dagster's preview notices,
#: Lightning's info lines and expected warnings, wandb's banner, transformers' bars. Silenced
#: where they are emitted; `--verbose` shows them.
NOISE = (
    "PreviewWarning",
    "is currently in preview",
    "GPU available",
    "TPU available",
    "litlogger",
    "module(s) in eval mode",
    "on_before_batch_transfer",
    "on_after_batch_transfer",
    "LeafSpec",
    "Loading weights",
    "Writing model shards",
    "wandb:",
    "anonymous setting",
)


def _run(capfd, rc: int, *argv: str) -> tuple[str, str]:
    """`flowmatch ARGV` in this process: its stdout and stderr, with those of the processes it
    starts (the training process), and the warnings it would print."""
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = cli_main(list(argv))
    out = capfd.readouterr()
    assert got == rc, out.out[-3000:] + out.err[-3000:]
    return out.out, out.err + "".join(f"{w.category.__name__}: {w.message}\n" for w in seen)


def _cli(capfd, rc: int, *argv: str) -> str:
    return _run(capfd, rc, *argv)[0]


def _noise(*texts: str) -> list[str]:
    return [n for n in NOISE if any(n in t for t in texts)]


def _sets(*items: str) -> list[str]:
    return [x for item in items for x in ("--set", item)]


def _load(p: Path) -> dict:
    return torch.load(p, map_location="cpu", weights_only=True)


def _train(data: Path, name: str, steps: int, *sets: str) -> None:
    """A training session in this process, as ``python -m flowmatch_models.train`` runs it
    (resumes the run's last checkpoint if it has one)."""
    from flowmatch_models.train.run import TrainRequest, train

    over = [f"data.root={data}", f"run.name={name}", "logging.wandb=false", *FAST, *sets]
    train(TrainRequest(config=str(REPO / "configs" / "tiny.yaml"), overrides=over, max_steps=steps))


def _losses(run: Path, n: int) -> list[float]:
    rows = list(csv.DictReader(open(sorted((run / "logs").glob("seg*/metrics.csv"))[0])))
    return [float(r["train/loss"]) for r in rows if r.get("train/loss")][:n]


@pytest.mark.slow
def test_finetune_lineage_staleness_and_head_start(tmp_path, small_sample, zoo, monkeypatch, capfd):
    data = tmp_path / "data"
    monkeypatch.setenv("FLOWMATCH_DATA_ROOT", str(data))
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster_home"))
    monkeypatch.setenv("FLOWMATCH_METADATA", small_sample["metadata"])
    monkeypatch.setenv("FLOWMATCH_FILE_ROOT", small_sample["dest"])
    for role in ("vae", "dino", "text"):
        monkeypatch.setenv(f"FLOWMATCH_{role.upper()}", zoo[role])
    monkeypatch.delenv("FLOWMATCH_SOURCES", raising=False)
    (tmp_path / "dagster_home").mkdir()
    (tmp_path / "dagster_home" / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    monkeypatch.chdir(tmp_path)
    readme = readme_commands("docs/fine-tuning.md", "fine-tuning")
    sample, add, materialize, simple, mix, stale = readme
    _cli(capfd, 0, *sample, "--images", "16")  # the guide's, 16 images instead of 192
    _cli(capfd, 0, *add)
    out, err = _run(capfd, 0, "materialize", "--source", "pd12m")  # the parent's data
    assert _noise(out, err) == [], err  # the zoo encoders load without their bars ...
    more, err = _run(capfd, 0, "--verbose", *materialize)
    assert "Loading weights" in err  # ... which --verbose shows (with Dagster's event log)
    out += more
    assert out.count(" ok (") == 3, out  # 000-00, 001-00, shapes2-00000

    # the parent ("demo"): 12 steps on PD12M's partitions only (directly: no record needed)
    _train(data, "demo", 12, "data.sources=[pd12m]", "trainer.checkpoint_every=6")
    parent = data / "runs" / "demo"
    p_ema = _load(parent / "checkpoints" / "step0000012-ema.ckpt")

    # the guide's mixed fine-tune: from its EMA, caption projection frozen, shapes2 weighted
    # 2 beside PD12M (6 steps, not 500); the simpler line parses
    assert build_parser().parse_args(simple).parent == "demo"
    # wandb offline as the demo has it: no API key, no WANDB_MODE (the logger sets it)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    out, err = _run(
        capfd,
        0,
        *mix,
        "--steps",
        "6",
        "--no-samples",
        *_sets(*FAST, "trainer.checkpoint_every=3", "logging.wandb=true"),
    )
    # its story only: the training process's step lines, no Lightning / wandb / Dagster notices
    assert _noise(out, err) == [], err
    assert "step 6/6 loss" in out and "fine-tune ok" in out, out
    monkeypatch.setenv("WANDB_MODE", "offline")
    # the CLI's runs, under the code location's jobs (not __ephemeral_asset_job__)
    runs = dg.DagsterInstance.from_config(str(tmp_path / "dagster_home")).get_runs()
    assert {r.job_name for r in runs} == {"ingest_and_embed_job", "finetune_job"}
    child = data / "runs" / "demo-mix"
    c = _load(child / "checkpoints" / "last.ckpt")
    assert c["global_step"] == 6  # a fresh schedule: its own steps, not the parent's + 6
    sd, pe = c["state_dict"], p_ema["state_dict"]
    frozen = [k for k in sd if k.startswith("model.transformer.caption_projection.")]
    assert len(frozen) == 4
    for k in frozen:  # kept exactly at the parent's EMA weights, in the model and its EMA
        name = k.removeprefix("model.transformer.")
        assert torch.equal(sd[k], pe[f"ema.{name}"]) and torch.equal(
            sd[f"ema.{name}"], pe[f"ema.{name}"]
        )
    moved = "model.transformer.transformer_blocks.0.attn1.to_q.weight"
    assert not torch.equal(sd[moved], pe["ema.transformer_blocks.0.attn1.to_q.weight"])
    trainable = sum(1 for k in sd if k.startswith("model.")) - len(frozen)
    assert len(c["optimizer_states"][0]["state"]) == trainable  # a fresh Adam, frozen ones out
    assert c["optimizer_states"][0]["state"][0]["step"].item() == 6
    for part in ("shift", "scale"):  # the parent's caption standardisation, not recomputed
        assert torch.equal(c["flowmatch"]["text_norm"][part], p_ema["flowmatch"]["text_norm"][part])

    # the parent, named everywhere: checkpoint, lineage.json, export, request, catalog, wandb
    digest = ema_digest(parent / "checkpoints" / "step0000012-ema.ckpt")
    lineage = {
        "run": "demo",
        "step": 12,
        "weights": "ema",
        "digest": digest,
        "freeze": ["transformer.caption_projection"],
    }
    for rec in (
        c["flowmatch"]["parent"],
        json.loads((child / "lineage.json").read_text()),
        json.loads((child / "pipeline" / "transformer" / "flowmatch.json").read_text())["parent"],
    ):
        assert {k: rec[k] for k in lineage} == lineage
    request = json.loads((child / "request.json").read_text())
    assert request["partitions"] == ["000-00", "001-00", "shapes2-00000", "shapes2-00000"]
    cat = Catalog(data)
    extra = json.loads(
        cat.query(
            "SELECT extra FROM materializations WHERE asset = 'flow_model' "
            "AND partition = 'demo-mix'"
        )[0]["extra"]
    )
    assert extra["parent"]["run"] == "demo" and extra["parent"]["digest"] == digest
    assert extra["sources"] == ["pd12m", "shapes2"] and extra["step"] == 6
    trained = extra["trained_counts"]  # shapes2 is drawn twice per epoch
    assert trained["shapes2-00000"] > trained["000-00"]
    (wb,) = (child / "wandb").glob("offline-run-*/run-*.wandb")
    assert wandb_config(wb)["parent"]["digest"] == digest
    assert _cli(capfd, 0, "stale", "--no-report").startswith("nothing stale")

    # a resume of the fine-tune keeps its lineage and its frozen parts
    _train(data, "demo-mix", 8, "data.sources=[shapes2, pd12m]", "data.source_weights={shapes2: 2}")
    c2 = _load(child / "checkpoints" / "last.ckpt")
    assert c2["global_step"] == 8 and c2["flowmatch"]["parent"]["digest"] == digest
    assert all(torch.equal(c2["state_dict"][k], sd[k]) for k in frozen)

    # the head start: the same run from scratch (same data, seed, schedule) starts higher
    _train(data, "scratch", 3, "data.sources=[shapes2, pd12m]", "data.source_weights={shapes2: 2}")
    tuned, scratch = _losses(child, 3), _losses(data / "runs" / "scratch", 3)
    with capfd.disabled():
        print(f"\nhead start, first 3 losses: fine-tune {tuned}, scratch {scratch}")
    assert sum(tuned) < 0.8 * sum(scratch), (tuned, scratch)

    # the parent re-trained (another seed): the fine-tune is stale, and says why
    shutil.rmtree(parent)
    gone = json.loads(_cli(capfd, 1, *stale, "--no-report", "--json"))
    assert gone == [
        {
            "asset": "flow_model",
            "partition": "run demo-mix",
            "reason": "its parent "
            "demo has no checkpoint at step 12 any more (re-trained, or pruned): the "
            "weights it started from are unknown",
        }
    ]
    _train(data, "demo", 12, "data.sources=[pd12m]", "trainer.checkpoint_every=6", "run.seed=1")
    (row,) = json.loads(_cli(capfd, 1, *stale, "--no-report", "--json"))
    assert row["partition"] == "run demo-mix"
    assert row["reason"].startswith(
        f"its parent demo was re-trained: its step-12 weights changed ({digest[:12]} -> "
    )
    from flowmatch_assets.defs.checks import fine_tune_fresh
    from flowmatch_assets.defs.resources import resource_from_env

    check = fine_tune_fresh(flowmatch=resource_from_env())
    assert not check.passed and "run demo-mix: its parent demo was re-trained" in check.description
    # the guide's `flowmatch stale` reports it to Dagster: the UI's checks say so too

    from flowmatch_assets import compat

    out = _cli(capfd, 1, *stale)
    assert "1 stale training runs" in out and "check results reported" in out
    with dg.DagsterInstance.get() as instance:
        for asset in ("fine_tune", "flow_model"):
            key = dg.AssetCheckKey(dg.AssetKey(asset), f"{asset}_fresh")
            assert compat.check_status(instance, key) == "FAILED", asset


def test_source_selection_and_weights_and_init_mistakes(tmp_path):
    cfg = load_config(REPO / "configs" / "tiny.yaml", ["data.sources=[shapes2]"])
    assert select_sources(["000-00", "shapes2-00000", "shapes2-00001"], cfg) == [
        "shapes2-00000",
        "shapes2-00001",
    ]
    assert cfg.data.grow is False  # the list is fixed for the session
    cfg = load_config(REPO / "configs" / "tiny.yaml", ["data.source_weights={pd12m: 3}"])
    assert select_sources(["000-00", "a-00000"], cfg) == ["000-00"] * 3 + ["a-00000"]
    cfg = load_config(REPO / "configs" / "tiny.yaml", ["data.sources=[nope]"])
    with pytest.raises(ConfigError, match=r"data.sources \['nope'\]: no complete partition"):
        select_sources(["000-00"], cfg)
    from flowmatch_models.model.dit import build_model

    model = build_model("tiny", repa=False)
    with pytest.raises(ConfigError, match="init.freeze 'transformer.nope' matches no parameter"):
        freeze(model, ["transformer.nope"])
    assert freeze(model, ["transformer.caption_projection"]) == sum(
        p.numel() for p in model.transformer.caption_projection.parameters()
    )
    from flowmatch_models.train.finetune import resolve_parent

    init = load_config(REPO / "configs" / "tiny.yaml", ["init.from_run=ghost"]).init
    with pytest.raises(ConfigError, match="init.from_run 'ghost': no run folder"):
        resolve_parent(init, tmp_path, tmp_path / "runs" / "x")


@pytest.mark.usefixtures("one_thread")
def test_a_finetunes_ema_goes_on_from_its_parents(tmp_path):
    """The EMA's warm-up ramp counts the parent's steps: after each fine-tune step n its EMA is
    ``d * EMA + (1 - d) * weights`` with ``d = min(decay, (1 + S + n) / (10 + S + n))``, S the
    parent's step (a ramp restarted at 0 gave d = 0.1: 90% the fine-tune's first weights),
    in the first session and after a resume alike."""
    from test_train import make_store, tiny_config

    from flowmatch_models.train.run import TrainRequest, train

    store = make_store(tmp_path / "store", {"000-00": 24, "000-01": 20})
    parent = tmp_path / "parent"
    one = dict(trainer__accumulate_grad_batches=1, trainer__checkpoint_every=100)
    train(TrainRequest(config=tiny_config(store, parent, trainer__max_steps=10, **one)))
    ema = _load(parent / "checkpoints" / "last.ckpt")["state_dict"]
    names = [k.removeprefix("ema.") for k in ema if k.startswith("ema.")]
    for steps in (1, 2):  # a session of one step, then a resume for one more
        cfg = tiny_config(store, tmp_path / "tuned", trainer__max_steps=steps, **one)
        cfg["init"] = {"from_run": str(parent)}
        train(TrainRequest(config=cfg))  # resumes the run's last checkpoint when it has one
        ckpt = _load(tmp_path / "tuned" / "checkpoints" / "last.ckpt")
        assert ckpt["global_step"] == steps and ckpt["flowmatch"]["parent"]["step"] == 10
        d = min(0.99, (1 + 10 + steps - 1) / (10 + 10 + steps - 1))  # 0.55, then 0.57
        sd, moved, to_before, to_weights = ckpt["state_dict"], 0, 0.0, 0.0
        for k in names:
            new, before, w = sd[f"ema.{k}"], ema[f"ema.{k}"], sd[f"model.transformer.{k}"]
            torch.testing.assert_close(new, d * before + (1 - d) * w, rtol=0, atol=1e-6)
            moved += not torch.equal(new, before)
            to_before += float((new - before).square().sum())
            to_weights += float((new - w).square().sum())
        assert moved > len(names) // 2
        assert to_before < to_weights  # still mostly the EMA it went on from
        ema = sd
