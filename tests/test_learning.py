"""The demo domain is learnable: on a shortened schedule (1,000 steps of configs/tiny.yaml) the
tiny DiT follows captions clearly above chance, scored by the caption analyser on images decoded
by the committed demo VAE. The full demo (2,000 steps) and `flowmatch bench learning` record the
longer curves; this pins that learning happens at all (it did not before: sample grids were
noise and accuracies sat at chance)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from flowmatch_assets.demo import DEMO_VAE
from flowmatch_assets.demo.images import sample_images
from flowmatch_assets.reports.caption_eval import CHANCE
from flowmatch_assets.reports.evaluation import evaluate_checkpoint, fd_dinov2, heldout_set
from flowmatch_models.encoders.frozen import Encoders
from flowmatch_models.encoders.spec import EncoderSpec
from flowmatch_models.storage.layout import DataLayout
from flowmatch_models.storage.store import write_shard
from flowmatch_models.train.run import TrainRequest, train

REPO = Path(__file__).resolve().parents[1]


def encode_store(root: Path, zoo: dict, n: int = 256, parts: int = 2) -> None:
    """images-stage images of the sample grammar -> the three embedding shards, as the
    embedding step writes them (demo VAE latents + scaling factor, zoo DINO, zoo text + null)."""
    images, captions = sample_images(seed=7, n=n)
    enc = Encoders(EncoderSpec(vae=str(DEMO_VAE), dino=zoo["dino"], text=zoo["text"]))
    layout = DataLayout(root)
    null = enc.encode_null()
    for k, idx in enumerate(np.array_split(np.arange(n), parts)):
        p, ids = f"000-{k:02d}", [f"{k}-{i}" for i in idx]
        lat = enc.encode_vae(images[idx])
        write_shard(
            layout.asset_path("vae_latents", p),
            {"latents": lat},
            ids,
            attrs={"scaling_factor": enc.scaling_factor},
        )
        patch, cls = enc.encode_dino(images[idx])
        write_shard(layout.asset_path("dino_features", p), {"patch": patch, "cls": cls}, ids)
        tokens, lengths = enc.encode_text([captions[i] for i in idx])
        write_shard(
            layout.asset_path("text_embeddings", p),
            {"tokens": tokens, "lengths": lengths, "null_tokens": null},
            ids,
        )


@pytest.mark.slow
# 1,000 real training steps: ~14 min on 2 loaded cores (CI at load 5: 839 s); a CI run whose
# rate dipped to 6-10 samples/s for minutes at a time (best 130) passed 900 s at step 925
@pytest.mark.timeout(1800)
def test_tiny_dit_learns_to_follow_captions(tmp_path: Path, zoo: dict) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        encode_store(tmp_path / "data", zoo)
        cfg = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
        cfg["run"]["out_dir"] = str(tmp_path / "run")
        cfg["data"]["root"] = str(tmp_path / "data")
        cfg["trainer"].update(max_steps=1000, checkpoint_every=250, full_every=1000, sample_every=0)
        cfg["logging"]["wandb"] = False
        result = train(TrainRequest(config=cfg, resume="none"))
        assert result.step == 1000 and result.device == "cpu, 32-true"
        ckpts = tmp_path / "run" / "checkpoints"
        r = evaluate_checkpoint(ckpts / "last.ckpt", zoo["text"], str(DEMO_VAE), 48)
        held = heldout_set(tmp_path / "data", ckpts / "last.ckpt")
        fd = [
            fd_dinov2(
                ckpts / f"step{s:07d}-ema.ckpt", tmp_path / "data", str(DEMO_VAE), zoo["dino"], held
            )
            for s in (250, 1000)
        ]
    finally:
        torch.set_num_threads(threads)
    acc = r["accuracy"]
    print({a: round(v, 3) for a, v in acc.items()})
    # clearly above chance (1/8 colour, 1/2 size, 1/3 position) after half the demo's schedule;
    # shape (1/6) needs the full schedule (the demo's floor: 2x chance at 2,000 steps)
    assert acc["colour"] >= 4 * CHANCE["colour"]
    assert acc["position"] >= 1.8 * CHANCE["position"]
    assert acc["size"] >= 1.2 * CHANCE["size"]
    all_four = CHANCE["colour"] * CHANCE["shape"] * CHANCE["size"] * CHANCE["position"]
    assert r["all_correct"] >= 10 * all_four  # all four right in one image
    # the held-out signals (tiny.yaml holds out 10%): FD-DINOv2 and the validation loss fall
    print("FD-DINOv2", [round(f["fd_dinov2"], 2) for f in fd], "on", held["n"])
    assert 15 <= held["n"] <= 40 and fd[0]["dino_weights"].startswith("RANDOM WEIGHTS")
    assert fd[1]["fd_dinov2"] < 0.8 * fd[0]["fd_dinov2"]
    import csv

    with open(tmp_path / "run" / "metrics.csv") as f:
        val = [
            (int(x["step"]), float(x["val/loss"])) for x in csv.DictReader(f) if x.get("val/loss")
        ]
    assert [s for s, _ in val] == [250, 500, 750, 1000]
    assert val[-1][1] < val[0][1]
