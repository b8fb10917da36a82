"""The caption-following analyser: grammar round trip, accuracy on ground truth, no crashes on
junk, and the committed demo VAE reconstructs well enough for the analyser to read it."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from flowmatch_assets.demo import DEMO_VAE
from flowmatch_assets.demo.dataset import BACKGROUNDS, COLOURS, SHAPES
from flowmatch_assets.demo.images import sample_images
from flowmatch_assets.reports.caption_eval import (
    ATTRIBUTES,
    CHANCE,
    POSITION_PHRASES,
    SIZES,
    UNKNOWN,
    analyse_image,
    format_caption,
    parse_caption,
    prompts,
    score,
)
from flowmatch_assets.reports.evaluation import evaluation_figure
from flowmatch_models.encoders.zoo import DEMO_WEIGHTS_MARKER
from flowmatch_models.figures.grid import markdown_image


@pytest.fixture(scope="module")
def ground_truth() -> tuple[np.ndarray, list[str]]:
    """32 images exactly as images stores them (seeded; ~6 s on one core)."""
    return sample_images(seed=20261202, n=32)


def test_parse_caption_round_trips_every_combination():
    n = 0
    for size, colour, shape, position, bg in itertools.product(
        SIZES, COLOURS, SHAPES, POSITION_PHRASES, BACKGROUNDS
    ):
        attrs = {
            "colour": colour,
            "shape": shape,
            "size": size,
            "position": position,
            "background": bg,
        }
        assert parse_caption(format_caption(**attrs)) == attrs
        n += 1
    assert n == 2 * 8 * 6 * 5 * 6


def test_parse_caption_refuses_other_sentences():
    with pytest.raises(ValueError, match="not in the sample grammar"):
        parse_caption("a photograph of a cat")
    with pytest.raises(ValueError, match="not in the sample grammar"):
        parse_caption("a large teal circle on the left of a textured navy background")


def test_prompts_follow_the_grammar_and_are_deterministic():
    ps = prompts(200, seed=3)
    assert ps == prompts(200, seed=3) and ps != prompts(200, seed=4)
    parsed = [parse_caption(p) for p in ps]
    assert {p["shape"] for p in parsed} == set(SHAPES)
    assert {p["colour"] for p in parsed} == set(COLOURS)
    assert {p["position"] for p in parsed} == set(POSITION_PHRASES)


def test_draw_image_captions_parse_and_format_back(ground_truth):
    _, captions = ground_truth
    for c in captions:
        assert format_caption(**parse_caption(c)) == c


def test_analyser_reads_ground_truth(ground_truth):
    images, captions = ground_truth
    r = score(captions, images)
    acc = r["accuracy"]
    # measured on these 32 images: 1.0 on every attribute (and on 120 others, seed 123)
    assert acc["colour"] >= 0.95 and acc["shape"] >= 0.9, acc
    assert acc["size"] >= 0.9 and acc["position"] >= 0.9 and acc["background"] >= 0.9, acc
    assert r["chance"] == CHANCE and CHANCE["colour"] == 1 / 8 and CHANCE["shape"] == 1 / 6
    assert r["n"] == 32 and len(r["items"]) == 32
    assert set(r["items"][0]["pred"]) == set(ATTRIBUTES)


def test_analyser_survives_noise_and_uniform_images():
    rng = np.random.default_rng(0)
    noise = [rng.integers(0, 256, (256, 256, 3), dtype=np.uint8) for _ in range(8)]
    uniform = [np.full((256, 256, 3), v, np.uint8) for v in (COLOURS["red"], (128, 128, 128))]
    for img in uniform:
        assert analyse_image(img)["shape"] == UNKNOWN
        assert analyse_image(img)["colour"] == UNKNOWN
    caps = prompts(len(noise), seed=1)
    r = score(caps, noise)
    assert r["accuracy"]["shape"] <= 0.5 and r["accuracy"]["colour"] <= 0.5, r["accuracy"]
    with pytest.raises(ValueError, match="HxWx3"):
        analyse_image(np.zeros((256, 256), np.uint8))
    with pytest.raises(ValueError, match="uint8"):
        analyse_image(np.zeros((256, 256, 3), np.float32))


def test_demo_vae_reconstructs_what_captions_say(ground_truth):
    torch = pytest.importorskip("torch")
    from diffusers import AutoencoderDC

    marker = json.loads((DEMO_VAE / DEMO_WEIGHTS_MARKER).read_text())
    assert "not the real dc-ae" in marker["what"].lower()
    vae = AutoencoderDC.from_pretrained(DEMO_VAE).float().eval()
    assert vae.config.scaling_factor == pytest.approx(marker["scaling_factor"])
    images, captions = ground_truth[0][:16], ground_truth[1][:16]
    x = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # on a busy 2-core CI box, 2 threads are several times slower
    try:
        with torch.no_grad():
            assert tuple(vae.encode(x[:1]).latent.shape) == (1, 32, 8, 8)  # 256 px -> 32x8x8
            z = vae.encode(x).latent
            y = vae.decode(z).sample
    finally:
        torch.set_num_threads(threads)
    scaled_std = float((z * vae.config.scaling_factor).std())
    assert 0.5 < scaled_std < 2.0, scaled_std  # scaled latents have ~unit variance
    recon = ((y.clamp(-1, 1) + 1) * 127.5).round().byte().permute(0, 2, 3, 1).numpy()
    assert score(captions, recon)["accuracy"]["colour"] >= 0.9


def test_evaluation_figure_reads_at_the_size_the_ui_shows_it(ground_truth, tmp_path):
    """The evaluation asset's figure is shown in the UI shrunk to 800 px a side (its ``figure``
    metadata: markdown_image); each page is drawn no larger, 24 prompts a page, so the labels
    (13 px) are read there at 1:1. What the analyser read right is green."""
    import base64
    import io

    from PIL import Image

    images, captions = ground_truth
    result = {**score(captions, images), "images": images, "step": 7}
    out = evaluation_figure(result, tmp_path / "step0000007.png")
    pages = sorted(tmp_path.glob("step0000007*.png"))
    assert pages == [out, tmp_path / "step0000007_p2.png"]  # 32 prompts: 24 + 8
    for page in pages:
        size = Image.open(page).size
        assert max(size) <= 800, size
    shown = markdown_image(Image.open(out), "evaluation", 800)  # as the asset's metadata has it
    jpeg = base64.b64decode(shown.split("base64,", 1)[1].rstrip(")"))
    assert Image.open(io.BytesIO(jpeg)).size == Image.open(out).size  # not shrunk
    px = np.asarray(Image.open(out).convert("RGB")).reshape(-1, 3)
    assert (px == (0, 120, 0)).all(axis=1).sum() > 1000  # the readings, in green
