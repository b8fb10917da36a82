"""Real text encoders, offline: the real Gemma3-270M (dequantized from the PyPI GGUF by
``flowmatch zoo gemma``) and MiniLM-L6 (384-d) swapped in through configuration alone."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import numpy as np
import torch

from flowmatch_assets.definitions import defs
from flowmatch_assets.defs.definitions import resources_for
from flowmatch_assets.defs.partitions import register_partitions
from flowmatch_assets.freshness.fingerprints import staleness
from flowmatch_assets.freshness.training_runs import model_staleness
from flowmatch_models.encoders.frozen import Encoders
from flowmatch_models.encoders.spec import EncoderSpec
from flowmatch_models.encoders.zoo import (
    GEMMA_FOLDER,
    GEMMA_LABEL,
    PRETRAINED_MARKER,
    create_real_gemma,
    is_random_weights,
    weights_label,
)
from flowmatch_models.storage.image_shard import read_image_meta
from flowmatch_models.storage.store import read_shard
from tests.conftest import make_resource
from tests.test_training_assets import _pipeline_matches_sampler, _train_cfg

REPO = Path(__file__).resolve().parents[1]
EMB = ["vae_latents", "dino_features", "text_embeddings"]


def test_real_gemma_folder_is_the_pretrained_model(real_gemma, one_thread):
    folder = Path(real_gemma)
    info = json.loads((folder / PRETRAINED_MARKER).read_text())
    assert info["label"] == GEMMA_LABEL == weights_label(folder)
    assert "dequantized from Q4_K_M" in GEMMA_LABEL and not is_random_weights(folder)
    weights = (folder / "model.safetensors").read_bytes()
    assert info["weights_sha256"] == hashlib.sha256(weights).hexdigest()
    assert info["parameters"] == 268_098_176 and info["dtype"] == "bfloat16"
    assert 2 * 268_098_176 < len(weights) < 2 * 268_098_176 + 1e6  # really bf16 on disk
    assert not list(folder.parent.glob(".tmp-*"))  # the planted killed conversion is gone
    # loaded by the pipeline's own from_pretrained path: Gemma3TextModel, hidden 640, 18 layers
    enc = Encoders(EncoderSpec(text=real_gemma, device="cpu"))
    model = enc.text_model
    assert type(model).__name__ == "Gemma3TextModel"
    assert (model.config.hidden_size, model.config.num_hidden_layers) == (640, 18)
    # it knows things: the tied output embedding ranks "paris" first after this prompt
    ids = enc.tokenize(["The capital of France is"])[0]
    assert enc.tokenizer.convert_ids_to_tokens(ids)[0] == "<bos>"
    with torch.inference_mode():
        h = model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1]
        top = (h.float() @ model.embed_tokens.weight.float().T).topk(3).indices.tolist()
    assert enc.tokenizer.convert_ids_to_tokens(top)[0] == "▁paris"
    # a second call is a no-op (nothing rewritten)
    mtime = (folder / "model.safetensors").stat().st_mtime_ns
    t0 = time.perf_counter()
    assert create_real_gemma(folder) == folder
    assert time.perf_counter() - t0 < 1.0
    assert (folder / "model.safetensors").stat().st_mtime_ns == mtime


def test_a_killed_conversion_leaves_nothing_half_written(tmp_path):
    dest = tmp_path / "zoo" / GEMMA_FOLDER
    cmd = [sys.executable, "-m", "flowmatch_models.encoders.zoo", "gemma", str(dest)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not list(dest.parent.glob(f".tmp-{GEMMA_FOLDER}-*/gguf/*.gguf")):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        time.sleep(2)  # mid-conversion
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert not dest.exists()
    assert [p.name.startswith(f".tmp-{GEMMA_FOLDER}-") for p in dest.parent.iterdir()] == [True]


def test_real_gemma_text_embeddings(tmp_path, small_sample, zoo, real_gemma):
    """The text_embeddings asset on the real Gemma: labelled real (shards, metadata, catalog),
    640 wide, no fp16 saturation, token counts of the real tokenizer."""
    spec = EncoderSpec(vae=zoo["vae"], dino=zoo["dino"], text=real_gemma, batch_size=8)
    res = make_resource(tmp_path / "data", small_sample, encoders=spec)
    with dg.instance_for_test() as instance:
        register_partitions(instance, res)
        result = dg.materialize(
            list(defs.assets),
            selection=["metadata", "images", "text_embeddings"],
            partition_key="000-00",
            instance=instance,
            resources=resources_for(res),
        )
        assert result.success
        md = result.asset_materializations_for_node("encode_embeddings")[0].metadata
    shard = read_shard(res.layout.asset_path("text_embeddings", "000-00"), verify=True)
    assert shard.attrs["weights"] == GEMMA_LABEL and shard.attrs["random_weights"] is False
    assert md["model"].value == f"{real_gemma} ({GEMMA_LABEL})"
    assert shard.attrs["fp16_saturated"] == 0
    assert shard["tokens"].shape == (int(shard["lengths"].sum()), 640)
    captions = read_image_meta(res.layout.asset_path("images", "000-00"))
    captions = captions.column("caption").to_pylist()
    enc = Encoders(EncoderSpec(text=real_gemma, device="cpu"))
    want = [len(x) for x in enc.tokenize(captions)]
    assert shard["lengths"].tolist() == want  # BOS + SentencePiece pieces of the real tokenizer
    assert shard["null_tokens"].shape == (1, 640)  # the BOS state: the null caption
    assert shard.attrs["first_token_is_null"] is True  # causal: every caption's first state
    # real hidden states are not noise: two captions that differ in one word are closer to
    # each other than to a caption about something else
    a, b, c = (
        enc.encode_text([x])[0].astype(np.float32).mean(0)
        for x in (
            "a large red circle on a sandy background",
            "a large blue circle on a sandy background",
            "an old map of the city harbour, engraved in 1850",
        )
    )

    def cos(x, y):
        return float(x @ y / np.linalg.norm(x) / np.linalg.norm(y))

    assert cos(a, b) > cos(a, c) + 0.02


def test_minilm_text_encoder_through_configuration_alone(
    tmp_path, small_sample, zoo, minilm, capsys
):
    """MiniLM-L6 (384-d, real) as the text encoder by setting its folder and nothing else:
    encode, train, sample (our sampler and the exported SanaPipeline agree), and the
    fingerprints mark the partitions and the run stale when the text encoder changes back.
    Captions are cut at 8 tokens (encoders.max_tokens): the grids' and the export's prompts too."""
    spec = EncoderSpec(vae=zoo["vae"], dino=zoo["dino"], text=minilm, batch_size=8, max_tokens=8)
    res = make_resource(tmp_path / "data", small_sample, encoders=spec)
    with dg.instance_for_test() as instance:
        register_partitions(instance, res)

        def run(selection, **kw):
            return dg.materialize(
                list(defs.assets),
                selection=selection,
                instance=instance,
                resources=resources_for(res),
                raise_on_error=False,
                **kw,
            )

        for p in ("000-00", "001-00"):
            assert run(["metadata", "images", *EMB], partition_key=p).success
        shard = read_shard(res.layout.asset_path("text_embeddings", "000-00"))
        assert shard["tokens"].shape[1] == shard["null_tokens"].shape[1] == 384
        assert shard.attrs["model"] == minilm and shard.attrs["weights"] == ""
        assert shard.attrs["first_token_is_null"] is False  # BERT's [CLS] reads the caption
        assert run(["flow_model"], run_config=_train_cfg(max_steps=3)).success
    run_dir = tmp_path / "data" / "runs" / "t"
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["flowmatch"]["widths"] == {"text": 384, "repa": 384}
    assert ckpt["flowmatch"]["max_tokens"] == 8  # the run's prompts are cut as its captions
    assert ckpt["flowmatch"]["transformer_config"]["caption_channels"] == 384
    assert (
        ckpt["state_dict"]["model.transformer.caption_projection.linear_1.weight"].shape[1] == 384
    )
    pipeline = run_dir / "pipeline"
    meta = json.loads((pipeline / "transformer" / "flowmatch.json").read_text())
    assert meta["text_width"] == 384 and meta["max_tokens"] == 8
    call = json.loads((pipeline / "flowmatch_call.json").read_text())
    assert call["max_sequence_length"] == 8  # SanaPipeline cuts the prompt as training did
    index = json.loads((pipeline / "model_index.json").read_text())
    assert index["text_encoder"] == ["transformers", "BertModel"]
    # plain diffusers SanaPipeline with MiniLM as its text encoder == the project's sampler
    _pipeline_matches_sampler(pipeline, tmp_path, {"text": minilm, "vae": zoo["vae"]})
    # the fingerprints: back to the zoo's Gemma, every text partition and the run are stale
    back = make_resource(
        tmp_path / "data",
        small_sample,
        encoders=EncoderSpec(vae=zoo["vae"], dino=zoo["dino"], text=zoo["text"], batch_size=8),
    )
    stale = {(s.asset, s.partition): s.reason for s in staleness(back)}
    assert {k for k in stale if k[0] == "text_embeddings"} == {
        ("text_embeddings", "000-00"),
        ("text_embeddings", "001-00"),
    }
    assert f"model: {minilm} -> {zoo['text']}" in stale[("text_embeddings", "000-00")]
    assert ("vae_latents", "000-00") not in stale
    (run_stale,) = model_staleness(back, ["t"])
    assert "2 text_embeddings partitions it trained on are stale" in run_stale.reason
    # exporting with a text encoder of another width refuses, in one line
    from flowmatch_assets.cli import main as cli_main

    os.environ["FLOWMATCH_DATA_ROOT"] = str(tmp_path / "data")
    capsys.readouterr()  # what the runs above logged
    try:
        out = tmp_path / "wrong"
        code = cli_main(["export", "t", str(out), "--text", zoo["text"]])
    finally:
        os.environ.pop("FLOWMATCH_DATA_ROOT")
    err = capsys.readouterr().err.strip().splitlines()[-1]  # (after transformers' loading bar)
    assert code == 2 and not out.exists() and err.startswith("flowmatch: text encoder ")
    assert "gives 640-wide states but the model was trained on 384-wide captions" in err


def test_a_demo_data_root_defaults_to_the_real_gemma(tmp_path, zoo, real_gemma):
    """After `flowmatch demo` the UI, `stale` and backfills use the encoders the demo used: the
    real Gemma where the demo made it, else the zoo's random one."""
    from flowmatch_assets.defs.resources import resource_from_env

    root = tmp_path / "data"
    (root / "zoo").mkdir(parents=True)
    for k in ("dino", "text"):
        (root / "zoo" / k).symlink_to(zoo[k])
    assert resource_from_env({"FLOWMATCH_DATA_ROOT": str(root)}).encoders.text == str(
        root / "zoo" / "text"
    )
    (root / "zoo" / GEMMA_FOLDER).symlink_to(real_gemma)
    res = resource_from_env({"FLOWMATCH_DATA_ROOT": str(root)})
    assert res.encoders.text == str(root / "zoo" / GEMMA_FOLDER)
    assert res.encoders.dino == str(root / "zoo" / "dino")
    assert (
        resource_from_env(
            {"FLOWMATCH_DATA_ROOT": str(root), "FLOWMATCH_TEXT": zoo["text"]}
        ).encoders.text
        == zoo["text"]
    )  # what the user set wins
