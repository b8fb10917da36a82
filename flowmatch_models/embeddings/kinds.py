"""Embedding kinds: one record per kind of embedding the pipeline computes, stores and trains on.

An :class:`EmbeddingKind` says everything the rest of the code needs about one kind: its name
(the Dagster asset and the store folder), what it is, which encoder computes it from what (images
or captions), its arrays with shapes and dtypes, which arrays may be stored in 1 byte, what the
seed's format would have stored for it (the compression report's reference), the attrs that
count problems (warning checks), and whether training needs it. :data:`KINDS` is the registry:
the Dagster multi-asset and its checks (``flowmatch_assets/defs/embedding_assets.py``), the catalog's
coverage, the budget and training's coverage read it, and nothing else lists the kinds.

:func:`encode_partition` is the whole precalc of one partition as a plain function (no Dagster,
no catalog): one pass over the images shard for every image kind, one over its captions
for every caption kind. Torch is imported only when it runs.

Add a kind (docs/storage.md, "Add an encoder")::

    register(EmbeddingKind(
        name="t5_text", description="T5 encoder states of each caption (valid tokens only).",
        encoder="text", model="google/t5-v1_1-base",
        arrays=(ArraySpec("tokens", (768,), rows="token"), ArraySpec("lengths", (), "int32"),
                ArraySpec("null_tokens", (768,), rows="once")),
        seed_format_bytes=padded_text_bytes(768), lossy=("tokens",)))
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from flowmatch_models.encoders.spec import EncoderSpec, simulated_rate
from flowmatch_models.storage.fingerprint import (
    Fingerprint,
    dtype_name,
    rows_digest,
    weights_identity,
)

if TYPE_CHECKING:
    from flowmatch_models.encoders.frozen import Encoders


FP16 = 2

ROWS = ("sample", "token", "once", "cell")

#: a text shard's attr, true when every caption's first state is the null caption's first
#: (a causal encoder: Gemma's token 0 sees only BOS); training then feeds that state exactly
#: instead of its lossy decode, as CFG and sampling do (shards without it: as stored)
FIRST_TOKEN_ATTR = "first_token_is_null"

#: how close (relative L2) a caption's first state must be to the null's to count as it: the
#: encoder's batch numerics only (the transform codec's error is ~6%)
FIRST_TOKEN_RTOL = 1e-3


@dataclass(frozen=True)
class ArraySpec:
    """One array of a kind's shard: name, shape after the first axis, dtype and what its rows
    are: ``sample`` (one per sample), ``token`` (ragged: counted by the ``lengths`` array),
    ``cell`` (ragged: one per latent cell, counted by the ``grid`` array: a shard of several
    aspect-ratio buckets) or ``once`` (per shard, e.g. the null caption). ``None`` in
    ``shape``: any size."""

    name: str
    shape: tuple[int | None, ...]
    dtype: str = "float16"
    rows: str = "sample"

    def __post_init__(self) -> None:
        if self.rows not in ROWS:
            raise ValueError(f"{self.name}: rows must be one of {ROWS}, got {self.rows!r}")

    def empty(self) -> np.ndarray:
        """A well-formed array with no rows (``once`` arrays: one zero row)."""
        n = 1 if self.rows == "once" else 0
        return np.zeros((n, *(s or 1 for s in self.shape)), self.dtype)


@dataclass(frozen=True)
class WarnRule:
    """A shard attr that counts a problem worth a warning (a non-blocking check)."""

    name: str  # the check is named ``<kind>_<name>``
    attr: str
    description: str
    fix: str


@dataclass(frozen=True)
class Role:
    """How an encoder role computes arrays: from ``images`` (uint8 [N, 256, 256, 3]) or
    ``captions`` (strings), batch by batch, plus what it adds once per shard (arrays, attrs)."""

    input: str
    encode: Callable[[Encoders, Any], dict[str, np.ndarray]]
    finish: Callable[[Encoders], tuple[dict[str, np.ndarray], dict]]
    #: the EncoderSpec settings that change this role's values (its fingerprint fields)
    settings: Callable[[EncoderSpec], dict] = lambda spec: {}
    #: which EncoderSpec field is its compute dtype
    dtype_field: str = "dtype"


@dataclass(frozen=True)
class ModelInput:
    """What the DiT reads of a kind: ``array``, under the key ``batch`` of a training batch,
    and, for an input whose width the model is built for, the name of that width (``text``:
    caption channels, ``repa``: the REPA target's; checkpoints record ``{width: n}``)."""

    array: str
    batch: str
    width: str | None = None


@dataclass(frozen=True)
class EmbeddingKind:
    """Everything the pipeline needs to know about one kind of embedding."""

    name: str
    description: str
    encoder: str  # role: "vae", "dino" or "text" (see ROLES)
    arrays: tuple[ArraySpec, ...]
    #: bytes the seed's format (dense fp16 per sample, text padded) would take for n samples
    #: of these arrays: ``seed_format_bytes(n, spec, arrays)``
    seed_format_bytes: Callable[[int, EncoderSpec, Mapping[str, np.ndarray]], int]
    model: str | None = None  # None: EncoderSpec's model of the role
    lossy: tuple[str, ...] = ()  # arrays that may be stored in 1 byte (EncoderSpec.lossy)
    warnings: tuple[WarnRule, ...] = ()
    tags: frozenset[str] = field(default_factory=lambda: frozenset({"pytorch"}))
    # flow_model waits for it: a partition trains only once this kind is there (TRAINING_INPUTS)
    training_input: bool = True
    #: what the DiT reads of this kind (None: nothing; :func:`model_inputs`)
    model_input: ModelInput | None = None
    #: bump when the kind's code changes its values (a fingerprint field: shards made by an
    #: older version turn stale)
    code_version: str = "1"
    #: the arrays of a shard whose images are of several sizes (aspect-ratio buckets): per-cell
    #: rows and a ``grid [N, 2]`` (latent cells high, wide) per sample; None: ``arrays`` always
    cell_arrays: tuple[ArraySpec, ...] | None = None

    def __post_init__(self) -> None:
        if self.encoder not in ROLES:
            raise ValueError(f"{self.name}: encoder must be one of {sorted(ROLES)}")

    @property
    def role(self) -> Role:
        return ROLES[self.encoder]

    def array(self, name: str) -> ArraySpec:
        return next(a for a in self.arrays if a.name == name)

    def arrays_of(self, shard_arrays) -> tuple[ArraySpec, ...]:
        """The specs a shard holding ``shard_arrays`` (names) is checked against: the cell
        layout where it has a ``grid``."""
        return self.cell_arrays if self.cell_arrays and "grid" in shard_arrays else self.arrays

    def model_in(self, spec: EncoderSpec) -> str:
        """The model (hub id or folder) that computes this kind under ``spec``."""
        return spec.models.get(self.name) or self.model or getattr(spec, self.encoder)

    def spec_for(self, spec: EncoderSpec) -> EncoderSpec:
        """``spec`` with this kind's model in its encoder role (what ``Encoders`` loads)."""
        return spec.model_copy(update={self.encoder: self.model_in(spec)})


def _vae(enc: Encoders, images: np.ndarray) -> dict[str, np.ndarray]:
    return {"latents": enc.encode_vae(images)}


def _dino(enc: Encoders, images: np.ndarray) -> dict[str, np.ndarray]:
    patch, cls = enc.encode_dino(images)
    return {"patch": patch, "cls": cls}


@dataclass(frozen=True)
class CaptionBatch:
    """Captions with their token ids, tokenized ahead (flowmatch_models.embeddings.precalc)."""

    captions: Sequence[str | None]
    token_ids: Sequence[list[int]] | None = None


def _text(enc: Encoders, batch: CaptionBatch | list[str]) -> dict[str, np.ndarray]:
    if isinstance(batch, CaptionBatch):
        tokens, lengths = enc.encode_text(batch.captions, token_ids=batch.token_ids)
    else:
        tokens, lengths = enc.encode_text(batch)
    return {"tokens": tokens, "lengths": lengths}


def first_token_is_null(tokens: np.ndarray, lengths: np.ndarray, null: np.ndarray) -> bool:
    """Every caption's first state (``tokens`` ragged by ``lengths``) is the null caption's
    first within :data:`FIRST_TOKEN_RTOL` (relative L2): what a causal text encoder gives."""
    lengths = np.asarray(lengths, np.int64)
    if not len(lengths) or len(null) < 1 or (lengths < 1).any():
        return False
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    first = np.asarray(tokens[starts], np.float32)
    ref = np.asarray(null[0], np.float32)
    err = np.linalg.norm(first - ref, axis=1)
    return bool((err <= FIRST_TOKEN_RTOL * max(float(np.linalg.norm(ref)), 1e-12)).all())


def _text_finish(enc: Encoders) -> tuple[dict[str, np.ndarray], dict]:
    attrs = {
        "max_tokens": enc.spec.max_tokens,
        "text_dtype": str(enc.text_dtype),
        "fp16_saturated": enc.text_saturated,  # before the null caption (not a sample)
    }
    return {"null_tokens": enc.encode_null()}, attrs


def _dino_settings(spec: EncoderSpec) -> dict:
    size = spec.dino_size if spec.dino_pool == "avg2x2" else 112
    return {"pooling": spec.dino_pool, "image_size": size, "normalisation": "imagenet"}


ROLES: dict[str, Role] = {
    "vae": Role(
        "images",
        _vae,
        lambda enc: ({}, {"scaling_factor": enc.scaling_factor}),
        lambda spec: {"image_size": 256, "normalisation": "[-1, 1]"},
    ),
    "dino": Role(
        "images", _dino, lambda enc: ({}, {"dino_pool": enc.spec.dino_pool}), _dino_settings
    ),
    "text": Role(
        "captions",
        _text,
        _text_finish,
        lambda spec: {"max_tokens": spec.max_tokens, "lowercase": True, "pooling": "none"},
        dtype_field="text_dtype",
    ),
}


def padded_text_bytes(
    width: int | None = None, array: str = "tokens"
) -> Callable[[int, EncoderSpec, Mapping[str, np.ndarray]], int]:
    """The seed's text bytes: every caption padded to max_tokens, fp16, plus a 1-byte mask;
    ``width`` None: the stored ``array``'s width (whatever the text encoder gives)."""

    def seed(n: int, spec: EncoderSpec, arrays: Mapping[str, np.ndarray]) -> int:
        w = width or int(arrays[array].shape[-1])
        return n * (spec.max_tokens * w * FP16 + spec.max_tokens)

    return seed


def dense_bytes(*names: str) -> Callable[[int, EncoderSpec, Mapping[str, np.ndarray]], int]:
    """The seed's bytes for dense fp16 per-sample arrays: the named arrays' per-sample sizes."""

    def seed(n: int, spec: EncoderSpec, arrays: Mapping[str, np.ndarray]) -> int:
        # values per sample from the arrays (the cell layout's rows are cells, not samples)
        samples = len(arrays["grid"]) if "grid" in arrays else len(arrays[names[0]])
        if not samples:
            return 0
        return round(n * sum(int(arrays[a].size) for a in names) / samples) * FP16

    return seed


KINDS: dict[str, EmbeddingKind] = {}


def register(kind: EmbeddingKind) -> EmbeddingKind:
    """Add (or replace) a kind; every part of the pipeline sees it from then on."""
    KINDS[kind.name] = kind
    return kind


@contextlib.contextmanager
def registered(*kinds: EmbeddingKind) -> Iterator[None]:
    """Kinds registered for the duration of a block (tests, notebooks)."""
    before = dict(KINDS)
    for k in kinds:
        register(k)
    try:
        yield
    finally:
        KINDS.clear()
        KINDS.update(before)


class KindNames(Sequence[str]):
    """The names of the registered kinds (those ``training_input`` when asked), read live."""

    def __init__(self, training_only: bool = False):
        self.training_only = training_only

    def _names(self) -> tuple[str, ...]:
        return tuple(n for n, k in KINDS.items() if k.training_input or not self.training_only)

    def __getitem__(self, i):  # type: ignore[override]
        return self._names()[i]

    def __len__(self) -> int:
        return len(self._names())

    def __repr__(self) -> str:
        return repr(self._names())


#: Every embedding kind, and those training needs (live views of the registry).
EMBEDDING_ASSETS = KindNames()

TRAINING_INPUTS = KindNames(training_only=True)


def model_inputs() -> dict[str, EmbeddingKind]:
    """What the DiT reads, by batch key (``latents``, ``text``, ``dino``): the kind that holds
    it (its ``model_input`` names the array and the width). The one place the training data
    path learns which kind is which; an encoder swaps by configuration alone."""
    return {k.model_input.batch: k for k in KINDS.values() if k.model_input is not None}


register(
    EmbeddingKind(
        name="vae_latents",
        description="DC-AE f32c32 latents (32x8x8 at 256x256, 32x(h/32)x(w/32) in a bucket; unscaled fp16; the scaling factor is in the shard attrs).",
        encoder="vae",
        arrays=(ArraySpec("latents", (32, None, None)),),
        # several buckets: every sample's [32, h, w] values back to back (channel-first, as a
        # one-size shard's rows), counted in cells of 32 values; grid = (h, w) in cells
        cell_arrays=(ArraySpec("latents", (32,), rows="cell"), ArraySpec("grid", (2,), "int32")),
        seed_format_bytes=dense_bytes("latents"),
        model_input=ModelInput("latents", batch="latents"),
        tags=frozenset({"pytorch", "diffusers"}),
    )
)

register(
    EmbeddingKind(
        name="dino_features",
        description="DINOv2 patch features pooled to the latent grid (64xD at 256x256, one row per latent cell in a bucket; D=384 for dinov2-small) plus CLS: the REPA target.",
        encoder="dino",
        # width None: the DINO model's (384 for dinov2-small); the DiT's REPA head follows it
        arrays=(ArraySpec("patch", (None, None)), ArraySpec("cls", (None,))),
        cell_arrays=(
            ArraySpec("patch", (None,), rows="cell"),
            ArraySpec("cls", (None,)),
            ArraySpec("grid", (2,), "int32"),
        ),
        seed_format_bytes=dense_bytes("patch", "cls"),
        lossy=("patch",),
        model_input=ModelInput("patch", batch="dino", width="repa"),
        tags=frozenset({"pytorch", "transformers"}),
    )
)

register(
    EmbeddingKind(
        name="text_embeddings",
        description="Text encoder (Gemma3-270M) last hidden states of each caption: only the valid tokens (<=128) plus lengths.",
        encoder="text",
        # width None: the text encoder's hidden size (640 for Gemma3-270M, 384 for MiniLM-L6);
        # the DiT's caption input follows it (its model_input's width)
        arrays=(
            ArraySpec("tokens", (None,), rows="token"),
            ArraySpec("lengths", (), "int32"),
            ArraySpec("null_tokens", (None,), rows="once"),
        ),
        seed_format_bytes=padded_text_bytes(),
        lossy=("tokens",),
        model_input=ModelInput("tokens", batch="text", width="text"),
        warnings=(
            WarnRule(
                "fp16_saturation",
                "fp16_saturated",
                "Caption hidden-state values clamped to the fp16 range when stored (warns above 0).",
                "compute the text encoder in fp32, or check the captions of the listed partitions",
            ),
        ),
        tags=frozenset({"pytorch", "transformers"}),
    )
)


def kind_fingerprint(
    kind: EmbeddingKind,
    spec: EncoderSpec,
    inputs: dict[str, str | None] | None = None,
    weights_cache: str | Path | None = None,
    *,
    weights: dict | None = None,
    compute: dict | None = None,
) -> Fingerprint:
    """What makes ``kind``'s values under ``spec``: model and weights identity, the role's
    preprocessing settings, compute dtype and device class as resolved, storage dtype, codec
    and the kind's code version; ``inputs``: the fingerprint hash of the images partition it is
    made from. ``weights``: the identity of the weights the values came from (taken when they
    were loaded: ``Encoders.weights``); without it the folder is hashed now (once per process
    and folder state, flowmatch_models.storage.fingerprint.folder_sha256). ``compute``: the
    ``compute_dtype`` and ``device`` the encoder ran with (``Encoders.compute``); without it,
    what ``spec`` resolves to on this machine (:func:`resolved_compute`)."""
    model = kind.model_in(spec)
    lossy = spec.lossy.get(kind.name) if kind.lossy else None
    fields = {
        "kind": kind.name,
        "code_version": kind.code_version,
        "model": model,
        **(weights if weights is not None else weights_identity(model, weights_cache)),
        **kind.role.settings(spec),
        **(compute if compute is not None else resolved_compute(kind, spec)),
        "storage_dtype": lossy or "float16",
        "lossy": bool(lossy),
        "codec": spec.codec,
    }
    if simulated_rate():  # a benchmark's stand-in made these values: never fresh, never trained
        fields["simulated_gpu_pairs_per_s"] = simulated_rate()
    return Fingerprint(fields, dict(inputs or {}))


def resolved_compute(kind: EmbeddingKind, spec: EncoderSpec) -> dict:
    """``{"compute_dtype": "bf16", "device": "cuda"}``: the dtype ``kind``'s encoder computes
    in under ``spec`` (its ``dtype_field``; ``auto``: bf16 on a GPU, fp32 on the CPU) and the
    device class, as resolved on this machine (flowmatch_models.encoders.loading)."""
    from flowmatch_models.encoders.loading import resolve_device, resolve_dtype

    dev = resolve_device(spec.device)
    dtype = resolve_dtype(getattr(spec, kind.role.dtype_field), dev)
    return {"compute_dtype": dtype_name(dtype), "device": dev.type}


def compute_agrees(kind: EmbeddingKind, spec: EncoderSpec, fields: dict) -> bool:
    """A shard's recorded ``compute_dtype`` and ``device`` (``fields``) are what ``spec`` makes:
    what it resolves to on this machine, or, with ``device: auto``, on the device class the
    shard was made on (a GPU shard made under ``auto`` is not stale to a CPU-only machine; it
    is never trained together with a CPU one: their hashes differ)."""
    from flowmatch_models.encoders.loading import resolve_device, resolve_dtype

    got = {"compute_dtype": fields.get("compute_dtype"), "device": fields.get("device")}
    if got == resolved_compute(kind, spec):
        return True
    if spec.device != "auto" or got["device"] not in ("cpu", "cuda"):
        return False
    there = resolve_dtype(getattr(spec, kind.role.dtype_field), resolve_device(got["device"]))
    return dtype_name(there) == got["compute_dtype"]


def kind_inputs(
    kind: EmbeddingKind,
    images_inputs: dict[str, str | None] | None,
    ids: Sequence[str],
    captions: Sequence[str | None],
) -> tuple[dict[str, str | None], dict[str, str]]:
    """Exactly what ``kind``'s encoder reads of an images partition, as the fingerprint's
    ``(inputs, rows)``: a caption kind the stored rows' ids and captions (a digest: an images
    setting such as the JPEG quality changes nothing it reads); an image kind the images
    partition's fingerprint (``images_inputs``: its settings, and what its rows came from)
    and the ids it holds. A different stored row set makes both stale
    (flowmatch_assets/freshness/fingerprints.py)."""
    if kind.role.input == "captions":
        return {}, {"captions": rows_digest(ids, captions)}
    return dict(images_inputs or {}), {"ids": rows_digest(ids)}
