"""Encoders through the real from_pretrained path on the offline zoo; missing-weights errors."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch

from flowmatch_models.encoders.frozen import Encoders, decode_latents
from flowmatch_models.encoders.loading import MissingWeightsError
from flowmatch_models.encoders.spec import EncoderSpec
from flowmatch_models.encoders.zoo import RANDOM_WEIGHTS_MARKER, create_zoo, main
from flowmatch_models.storage.store import pad_ragged, read_shard, write_shard


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return create_zoo(tmp_path_factory.mktemp("zoo"))


@pytest.fixture(scope="module")
def enc(zoo) -> Encoders:
    spec = EncoderSpec(vae=str(zoo["vae"]), dino=str(zoo["dino"]), text=str(zoo["text"]))
    spec.batch_size = 3
    return Encoders(spec)


@pytest.fixture(scope="module")
def images() -> np.ndarray:
    """Smooth, image-like uint8 pictures (gradients + a disc), not pure noise."""
    yy, xx = np.mgrid[0:256, 0:256] / 255.0
    out = []
    for i in range(5):
        r = (xx * (i + 1)) % 1.0
        g = yy
        b = ((xx - 0.5) ** 2 + (yy - 0.5) ** 2 < 0.05 * (i + 1)).astype(float)
        out.append(np.stack([r, g, b], -1))
    return (np.stack(out) * 255).astype(np.uint8)


def test_zoo_is_labelled_and_deterministic(zoo, tmp_path):
    for folder in zoo.values():
        info = json.loads((folder / RANDOM_WEIGHTS_MARKER).read_text())
        assert info["random_weights"] is True
    assert main(["create", str(tmp_path / "again")]) == 0

    def digest(root):
        return {
            p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*"))
            if p.is_file()
        }

    assert digest(zoo["vae"].parent) == digest(tmp_path / "again")


def test_image_encoders_shapes_and_dtypes(enc, images):
    assert enc.device == "cpu" and enc.dtype == torch.float32
    assert enc.random_weights == {"vae": True, "dino": True, "text": True}
    assert enc.scaling_factor == pytest.approx(0.41407)
    z = enc.encode_vae(images)
    assert z.shape == (5, 32, 8, 8) and z.dtype == np.float16 and np.isfinite(z).all()
    assert z.astype(np.float32).std() > 0
    patch, cls = enc.encode_dino(images)
    assert patch.shape == (5, 64, 384) and cls.shape == (5, 384)
    assert patch.dtype == cls.dtype == np.float16
    # batching does not change results (batch_size 3 over 5 images vs one image at a time)
    z0 = enc.encode_vae(images[4:5])
    np.testing.assert_allclose(z0[0], z[4], atol=2e-3, rtol=1e-3)
    empty = enc.encode_vae(images[:0])
    assert empty.shape == (0, 32, 8, 8)
    # any bucket on the 32-pixel grid: its own latent grid, DINO pooled onto it row-major
    wide = np.ascontiguousarray(images[:, :128])
    assert enc.encode_vae(wide).shape == (5, 32, 4, 8)
    assert enc.dino_input_hw(128, 256) == (112, 224)
    assert enc.encode_dino(wide)[0].shape == (5, 32, 384)
    with pytest.raises(ValueError, match=r"multiples of 32"):
        enc.encode_vae(images[:, :100])


def test_dino_pools_map_to_the_latent_grid(zoo, images, enc):
    small = Encoders(EncoderSpec(dino=str(zoo["dino"]), dino_pool="resize112"))
    assert small.dino_input_size == 112 and enc.dino_input_size == 224
    patch, cls = small.encode_dino(images[:2])
    assert patch.shape == (2, 64, 384) and cls.shape == (2, 384)
    # avg2x2 equals running DINOv2 at 224 and pooling the 16x16 patch tokens by hand
    x = torch.from_numpy(images[:1]).permute(0, 3, 1, 2).float() / 255
    x = torch.nn.functional.interpolate(x, size=(224, 224), mode="bicubic", antialias=True)
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    with torch.inference_mode():
        h = enc.dino(pixel_values=(x - mean) / std).last_hidden_state[:, 1:]
    grid = h.reshape(1, 16, 16, 384)
    pooled = grid.reshape(1, 8, 2, 8, 2, 384).mean(dim=(2, 4)).reshape(1, 64, 384)
    ours, _ = enc.encode_dino(images[:1])
    np.testing.assert_allclose(ours[0], pooled[0].numpy(), atol=1e-2, rtol=1e-2)
    with pytest.raises(ValueError, match="dino_pool"):
        Encoders(EncoderSpec(dino_pool="max"))


def test_latents_decode_through_the_same_dcae(enc, images):
    z = enc.encode_vae(images[:2])
    out = decode_latents(enc.vae, z)
    assert out.shape == (2, 256, 256, 3) and out.dtype == np.uint8
    again = decode_latents(enc.vae, torch.from_numpy(z))
    np.testing.assert_array_equal(out, again)


def test_text_lengths_match_tokenizer_with_truncation(zoo, tmp_path):
    enc = Encoders(EncoderSpec(text=str(zoo["text"]), max_tokens=16, batch_size=2))
    captions = [
        "A red circle on a blue background.",
        "golden star",
        "An image of a large green hexagon next to a purple spiral, museum collection, scan",
        "x",
    ]
    tokens, lengths = enc.encode_text(captions)
    expected = [min(len(enc.tokenizer(c)["input_ids"]), 16) for c in captions]
    assert lengths.tolist() == expected and lengths.dtype == np.int32
    assert lengths[2] == 16  # truncated at max_tokens
    assert tokens.shape == (sum(expected), 640) and tokens.dtype == np.float16
    # store -> read -> pad equals encoding each caption alone (padding never leaks in)
    write_shard(tmp_path / "t.fms", {"tokens": tokens, "lengths": lengths}, list("abcd"))
    shard = read_shard(tmp_path / "t.fms")
    padded, mask = pad_ragged(shard["tokens"], shard["lengths"], [0, 1, 2, 3])
    assert mask.sum(1).tolist() == expected
    for i, c in enumerate(captions):
        alone, n = enc.encode_text([c])
        np.testing.assert_allclose(padded[i, : n[0]], alone, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize(
    "caption",
    ["", "   \n\t ", "y" * 10_000, "日本語 🎨 Ünïcödé \u200b\ud800\x00 ʕ•ᴥ•ʔ", None, float("nan")],
)
def test_bad_captions_are_handled(enc, caption):
    tokens, lengths = enc.encode_text(["a blue square", caption])
    assert lengths[0] > 1 and 1 <= lengths[1] <= 128
    assert tokens.shape == (int(lengths.sum()), 640) and np.isfinite(tokens).all()
    if caption in ("", "   \n\t ", None) or caption != caption:
        assert lengths[1] == 1  # BOS only
    if isinstance(caption, str) and len(caption) == 10_000:
        assert lengths[1] == 128


def test_missing_weights_error_names_model_and_fix(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    enc = Encoders(EncoderSpec(text="google/gemma-3-270m", dino="facebook/dinov2-small"))
    assert enc.random_weights == {"vae": False, "dino": False, "text": False}
    with pytest.raises(MissingWeightsError) as err:
        _ = enc.text_model
    msg = str(err.value)
    assert "google/gemma-3-270m" in msg and "huggingface-cli login" in msg
    assert "huggingface-cli download google/gemma-3-270m" in msg and "HF cache" in msg
    with pytest.raises(MissingWeightsError, match="facebook/dinov2-small.*download"):
        _ = enc.dino
    missing = Encoders(EncoderSpec(vae=str(tmp_path / "nope" / "vae")))
    with pytest.raises(MissingWeightsError, match=r"nope/vae does not exist.*zoo create"):
        _ = missing.vae


def test_text_encoder_never_computes_in_fp16_and_counts_saturation(zoo):
    with pytest.raises(ValueError, match="overflow fp16.*bf16 or fp32"):
        Encoders(EncoderSpec(text=str(zoo["text"]), text_dtype="fp16"))
    # fp16 for the image encoders still leaves the text encoder in fp32 on the CPU
    enc = Encoders(EncoderSpec(text=str(zoo["text"]), dtype="fp16"))
    assert enc.text_dtype == torch.float32
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(zoo["text"])
    with torch.no_grad():  # Gemma-sized activations: the final norm scales states past 65504
        model.norm.weight.fill_(3e5)
    tok = AutoTokenizer.from_pretrained(zoo["text"])
    big = Encoders.from_models(EncoderSpec(text=str(zoo["text"])), text=model, tokenizer=tok)
    tokens, lengths = big.encode_text(["a red circle", "a small blue star on the left"])
    assert np.isfinite(tokens).all() and np.abs(tokens).max() == 65504  # clamped, not inf
    hidden = model(**tok(["a red circle"], return_tensors="pt")).last_hidden_state
    expect_first = int((hidden.abs() > 65504).sum())
    assert big.text_saturated > expect_first > 0  # counted per valid token value, both captions
    before = big.text_saturated
    null = big.encode_null()
    assert null.shape == (1, 640) and big.text_saturated == before  # BOS only; not a sample


def test_null_caption_is_the_encoded_empty_prompt(enc):
    null = enc.encode_null()
    tokens, lengths = enc.encode_text([""])
    assert lengths.tolist() == [1] and np.array_equal(null, tokens)
    assert np.abs(null).sum() > 0  # not the zero token it replaces


def test_a_causal_encoders_first_states_are_the_null_captions(enc, minilm):
    """Gemma (causal): every caption's first state is the BOS state, i.e. the null caption's,
    to the batch's float noise (the shard says so: training then feeds it exactly). MiniLM
    (BERT, bidirectional): its [CLS] state depends on the caption; nothing is substituted."""
    from flowmatch_models.embeddings.kinds import first_token_is_null

    captions = ["a red circle", "a small blue star on the left of a very large sandy field", ""]
    tokens, lengths = enc.encode_text(captions)
    assert first_token_is_null(tokens, lengths, enc.encode_null())
    bert = Encoders(EncoderSpec(text=minilm, device="cpu"))
    tokens, lengths = bert.encode_text(captions)
    assert not first_token_is_null(tokens, lengths, bert.encode_null())


def test_an_unknown_store_codec_is_refused_when_the_settings_are_read():
    """The codec setting names one of the store's codecs (one list: storage/codecs.py); a typo
    fails at launch, not inside write_shard after a partition was encoded."""
    from pydantic import ValidationError

    from flowmatch_models.storage.codecs import CODECS

    assert [EncoderSpec(codec=c).codec for c in CODECS] == list(CODECS)
    with pytest.raises(ValidationError, match="unknown codec 'lz5'; choose one of none, zstd"):
        EncoderSpec(codec="lz5")
