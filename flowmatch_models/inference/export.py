"""Export a trained model as a diffusers ``SanaPipeline`` folder.

    <out>/model_index.json     SanaPipeline
    <out>/transformer/         the EMA SanaTransformer2DModel (+ flowmatch.json, null_caption)
    <out>/scheduler/           FlowMatchEulerDiscreteScheduler with the training's shift
    <out>/vae/                 the AutoencoderDC, its config's scaling_factor = the training's
    <out>/text_encoder/, tokenizer/   the caption encoder the text embeddings were made with

so that ``SanaPipeline.from_pretrained(out)`` samples exactly like the project's sampler (the
test compares them). The conventions diffusers reads from the folder are set there (scheduler
shift, VAE scaling factor); what ``SanaPipeline`` only takes at call time is in
:data:`CALL_KWARGS` (no instruction prefix: training encoded the captions bare; the caption
token limit). The null caption is the encoded empty prompt, which is ``SanaPipeline``'s default
negative prompt. Without a VAE and a text encoder only ``transformer/`` and ``scheduler/`` are
written (no ``model_index.json``: not a loadable pipeline).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from flowmatch_models.data.buckets import GRID, buckets_for
from flowmatch_models.encoders.spec import DEFAULT_MAX_TOKENS
from flowmatch_models.inference.export_format import META_FILE, NULL_FILE, prompt_max_tokens
from flowmatch_models.storage.atomic import atomic_write_text


class ExportError(ValueError):
    """The export cannot be made as asked (e.g. a text encoder of another width)."""


def call_kwargs(max_tokens: int) -> dict:
    """What ``SanaPipeline.__call__`` must be given for an export of this project."""
    return {"complex_human_instruction": None, "max_sequence_length": int(max_tokens)}


def write_transformer(
    ema,
    out: Path,
    scaling_factor: float,
    preset: str,
    shift: float,
    null_text,
    parent: dict | None = None,
    max_tokens: int = DEFAULT_MAX_TOKENS,
) -> Path:
    """``save_pretrained`` the EMA transformer to ``out`` with ``flowmatch.json`` (scaling
    factor, preset, shift, the prompts' ``max_tokens``; a fine-tune's ``parent``: run, step,
    digest, ...: flowmatch_models/finetune.py) and the null caption
    (``null_caption.safetensors``)."""
    ema.save_pretrained(out)
    meta = {
        "scaling_factor": float(scaling_factor),
        "preset": preset,
        "null_caption": (
            f"{NULL_FILE}: the encoded empty prompt (text_embeddings' null_tokens)"
            if null_text is not None
            else "one all-zero token (mask [1]); see flowmatch_models.model.flow"
        ),
        "timestep_scale": "t in [0, 1] x 1000",
        "text_width": int(ema.config.caption_channels),  # the caption states it was trained on
        "flow_shift": float(shift),
        # prompts are cut as its training captions were (export_format.prompt_max_tokens)
        "max_tokens": int(max_tokens),
        # (height, width) in pixels at the model's budget for SanaPipeline(height=, width=,
        # use_resolution_binning=False): its own bins stop at 512 px (flowmatch_models/data/buckets.py)
        "buckets": [[h, w] for h, w in buckets_for(int(ema.config.sample_size) * GRID)],
    }
    if parent:
        meta["parent"] = parent
    atomic_write_text(out / META_FILE, json.dumps(meta, indent=1))
    if null_text is not None:
        from safetensors.torch import save_file

        save_file({"null_text": null_text.float().contiguous().cpu()}, out / NULL_FILE)
    return out


def export_pipeline(
    ema,
    out: str | Path,
    *,
    scaling_factor: float,
    preset: str,
    shift: float,
    null_text: torch.Tensor | None = None,
    vae: str | None = None,
    text_encoder: str | None = None,
    parent: dict | None = None,
    max_tokens: int = DEFAULT_MAX_TOKENS,
) -> Path:
    """Write the pipeline folder ``out`` (replaced atomically: built beside it, then renamed);
    ``parent``: a fine-tune's parent, recorded in ``transformer/flowmatch.json``;
    ``max_tokens``: the token limit of the captions it trained on (the pipeline's
    ``max_sequence_length``)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    out = Path(out)
    tmp = out.parent / f".tmp-{out.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:  # a failed build (e.g. a full disk) leaves the old folder and no temp behind
        scheduler = FlowMatchEulerDiscreteScheduler(shift=float(shift))
        if vae and text_encoder:
            from diffusers import SanaPipeline

            from flowmatch_models.encoders.frozen import Encoders
            from flowmatch_models.encoders.spec import EncoderSpec

            enc = Encoders(
                EncoderSpec(
                    vae=vae,
                    text=text_encoder,
                    device="cpu",
                    dtype="fp32",
                    max_tokens=max_tokens,
                )
            )
            width = int(enc.text_model.config.hidden_size)
            if width != int(ema.config.caption_channels):
                raise ExportError(
                    f"text encoder {text_encoder} gives {width}-wide states but the model was "
                    f"trained on {ema.config.caption_channels}-wide captions: export with the "
                    "text encoder its text_embeddings were made with (--text)"
                )
            ae = enc.vae
            ae.register_to_config(scaling_factor=float(scaling_factor))
            pipe = SanaPipeline(
                tokenizer=enc.tokenizer,
                text_encoder=enc.text_model,
                vae=ae,
                transformer=ema,
                scheduler=scheduler,
            )
            pipe.save_pretrained(tmp)
            info = {**call_kwargs(enc.spec.max_tokens), "vae": vae, "text_encoder": text_encoder}
            atomic_write_text(tmp / "flowmatch_call.json", json.dumps(info, indent=1))
        else:
            scheduler.save_pretrained(tmp / "scheduler")
        write_transformer(
            ema, tmp / "transformer", scaling_factor, preset, shift, null_text, parent, max_tokens
        )
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = out.parent / f".old-{out.name}"
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)
    return out


def export_checkpoint(
    checkpoint: str | Path,
    out: str | Path,
    vae: str | None = None,
    text_encoder: str | None = None,
    default_vae: str | None = None,
    default_text: str | None = None,
) -> Path:
    """The pipeline folder of a training checkpoint's EMA weights; the VAE and text encoder:
    given, else those the run was trained with (recorded in the checkpoint), else the defaults."""
    from flowmatch_models.inference.sample import load_model

    model, meta = load_model(checkpoint=checkpoint)
    used = meta.get("encoders") or {}
    return export_pipeline(
        model,
        out,
        scaling_factor=float(meta["scaling_factor"]),
        preset=meta["preset"],
        shift=float(meta.get("flow_shift", 1.0)),
        null_text=meta.get("null_text"),
        vae=vae or used.get("vae") or default_vae,
        text_encoder=text_encoder or used.get("text") or default_text,
        parent=meta.get("parent"),
        max_tokens=prompt_max_tokens(meta),
    )
