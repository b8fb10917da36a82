"""Embedding kinds: one record per kind of embedding the pipeline computes, stores and trains on.

An :class:`EmbeddingKind` says everything the rest of the code needs about one kind: its name
(the Dagster asset and the store folder), what it is, which encoder computes it from what (images
or captions), its arrays with shapes and dtypes, which arrays may be stored in 1 byte, what the
seed's format would have stored for it (the compression report's reference), the attrs that
count problems (warning checks), and whether training needs it. :data:`KINDS` is the registry:
the Dagster multi-asset and its checks (``flowmatch_assets/defs/embedding_assets.py``), the catalog's
coverage, the budget and training's coverage read it, and nothing else lists the kinds.

:func:`encode_partition` is the whole precalc of one partition as a plain function (no Dagster,
no catalog): one pass over the images_256 shard for every image kind, one over its captions
for every caption kind. Torch is imported only when it runs.

Add a kind (README "Add an encoder")::

    register(EmbeddingKind(
        name="t5_text", description="T5 encoder states of each caption (valid tokens only).",
        encoder="text", model="google/t5-v1_1-base",
        arrays=(ArraySpec("tokens", (768,), rows="token"), ArraySpec("lengths", (), "int32"),
                ArraySpec("null_tokens", (768,), rows="once")),
        seed_bytes=padded_text_bytes(768), lossy=("tokens",)))
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from flowmatch_models.encoder_spec import EncoderSpec
from flowmatch_models.fingerprint import ATTR as FINGERPRINT_ATTR
from flowmatch_models.fingerprint import Fingerprint, weights_identity

if TYPE_CHECKING:
    from flowmatch_models.encoders import Encoders
    from flowmatch_models.store import Shard

FP16 = 2
ROWS = ("sample", "token", "once")


# ------------------------------------------------------------------------------- the record


@dataclass(frozen=True)
class ArraySpec:
    """One array of a kind's shard: name, shape after the first axis, dtype and what its rows
    are: ``sample`` (one per sample), ``token`` (ragged: counted by the ``lengths`` array) or
    ``once`` (per shard, e.g. the null caption). ``None`` in ``shape``: any size."""

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
class EmbeddingKind:
    """Everything the pipeline needs to know about one kind of embedding."""

    name: str
    description: str
    encoder: str  # role: "vae", "dino" or "text" (see ROLES)
    arrays: tuple[ArraySpec, ...]
    #: bytes the seed's format (dense fp16 per sample, text padded) would take for n samples
    #: of these arrays: ``seed_bytes(n, spec, arrays)``
    seed_bytes: Callable[[int, EncoderSpec, Mapping[str, np.ndarray]], int]
    model: str | None = None  # None: EncoderSpec's model of the role
    lossy: tuple[str, ...] = ()  # arrays that may be stored in 1 byte (EncoderSpec.lossy)
    warnings: tuple[WarnRule, ...] = ()
    tags: frozenset[str] = field(default_factory=lambda: frozenset({"pytorch"}))
    # flow_model waits for it: a partition trains only once this kind is there (TRAINING_INPUTS);
    # what the DiT reads of the kinds is chosen in data.py
    training_input: bool = True
    #: bump when the kind's code changes its values (a fingerprint field: shards made by an
    #: older version turn stale)
    code_version: str = "1"

    def __post_init__(self) -> None:
        if self.encoder not in ROLES:
            raise ValueError(f"{self.name}: encoder must be one of {sorted(ROLES)}")

    @property
    def role(self) -> Role:
        return ROLES[self.encoder]

    def array(self, name: str) -> ArraySpec:
        return next(a for a in self.arrays if a.name == name)


# ----------------------------------------------------------------------------- the roles


def _vae(enc: Encoders, images: np.ndarray) -> dict[str, np.ndarray]:
    return {"latents": enc.encode_vae(images)}


def _dino(enc: Encoders, images: np.ndarray) -> dict[str, np.ndarray]:
    patch, cls = enc.encode_dino(images)
    return {"patch": patch, "cls": cls}


def _text(enc: Encoders, captions: list[str]) -> dict[str, np.ndarray]:
    tokens, lengths = enc.encode_text(captions)
    return {"tokens": tokens, "lengths": lengths}


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
        return n * sum(int(np.prod(arrays[a].shape[1:])) for a in names) * FP16

    return seed


# ---------------------------------------------------------------------------- the registry

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

register(
    EmbeddingKind(
        name="vae_latents",
        description="DC-AE f32c32 latents (32x8x8, unscaled fp16; the scaling factor is in the shard attrs).",
        encoder="vae",
        arrays=(ArraySpec("latents", (32, 8, 8)),),
        seed_bytes=dense_bytes("latents"),
        tags=frozenset({"pytorch", "diffusers"}),
    )
)
register(
    EmbeddingKind(
        name="dino_features",
        description="DINOv2 patch features pooled to the 8x8 latent grid (64xD, D=384 for dinov2-small) plus CLS: the REPA target.",
        encoder="dino",
        # width None: the DINO model's (384 for dinov2-small); the DiT's REPA head follows it
        arrays=(ArraySpec("patch", (64, None)), ArraySpec("cls", (None,))),
        seed_bytes=dense_bytes("patch", "cls"),
        lossy=("patch",),
        tags=frozenset({"pytorch", "transformers"}),
    )
)
register(
    EmbeddingKind(
        name="text_embeddings",
        description="Text encoder (Gemma3-270M) last hidden states of each caption: only the valid tokens (<=128) plus lengths.",
        encoder="text",
        # width None: the text encoder's hidden size (640 for Gemma3-270M, 384 for MiniLM-L6);
        # the DiT's caption input follows it (flowmatch_models.data.MODEL_INPUTS)
        arrays=(
            ArraySpec("tokens", (None,), rows="token"),
            ArraySpec("lengths", (), "int32"),
            ArraySpec("null_tokens", (None,), rows="once"),
        ),
        seed_bytes=padded_text_bytes(),
        lossy=("tokens",),
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


# ------------------------------------------------------------------------ the fingerprint


def kind_fingerprint(
    kind: EmbeddingKind,
    spec: EncoderSpec,
    inputs: dict[str, str | None] | None = None,
    weights_cache: str | Path | None = None,
) -> Fingerprint:
    """What makes ``kind``'s values under ``spec``: model and weights identity, the role's
    preprocessing settings, compute and storage dtype, codec and the kind's code version;
    ``inputs``: the fingerprint hash of the images_256 partition it is made from. Weights are
    hashed once per process (flowmatch_models.fingerprint.folder_sha256)."""
    model = spec.model_of(kind)
    lossy = spec.lossy.get(kind.name) if kind.lossy else None
    fields = {
        "kind": kind.name,
        "code_version": kind.code_version,
        "model": model,
        **weights_identity(model, weights_cache),
        **kind.role.settings(spec),
        "compute_dtype": getattr(spec, kind.role.dtype_field),
        "storage_dtype": lossy or "float16",
        "lossy": bool(lossy),
        "codec": spec.codec,
    }
    return Fingerprint(fields, dict(inputs or {}))


# --------------------------------------------------------------------------- the precalc


@dataclass
class Encoded:
    """One kind's arrays and attrs for one partition, and the encoder seconds they took."""

    kind: EmbeddingKind
    arrays: dict[str, np.ndarray]
    attrs: dict
    seconds: float


def _one_square_size(images_path, meta) -> None:
    """The image kinds store one fixed grid per shard (8 x 8 latents at 256 px): a shard of
    aspect-ratio buckets (ingest.buckets: aspect) is refused before any encoding, in one line."""
    sizes = sorted(set(zip(meta.column("height").to_pylist(), meta.column("width").to_pylist())))
    if len(sizes) > 1 or any(h != w for h, w in sizes):
        raise ValueError(
            f"{Path(images_path).name} holds images of {', '.join(f'{h}x{w}' for h, w in sizes)}: "
            "aspect-ratio buckets (ingest.buckets: aspect) reach images_256 and the data card so "
            "far; the embeddings per bucket are not built yet. Use ingest.buckets: square to "
            "compute embeddings."
        )


def encode_partition(
    images_path: str | Path,
    kinds: Sequence[EmbeddingKind],
    spec: EncoderSpec,
    device: str,
    log: Callable[[str], None] = print,
    inputs: dict[str, str | None] | None = None,
    weights_cache: str | Path | None = None,
) -> dict[str, Encoded]:
    """Compute ``kinds`` for the images_256 shard at ``images_path`` on ``device``: one pass
    over the images for every image kind, one over the captions for every caption kind.
    Arrays in the shard's row order, attrs with the model, its weights label, the device and
    the fingerprint (:func:`kind_fingerprint`; ``inputs``: the images_256 partition's
    fingerprint hash, which the caller knows)."""
    from flowmatch_models.encoders import Encoders
    from flowmatch_models.image_shard import iter_image_batches, read_image_meta
    from flowmatch_models.zoo import weights_label

    meta = read_image_meta(images_path)
    n = meta.num_rows
    if any(k.role.input == "images" for k in kinds):
        _one_square_size(images_path, meta)
    encs = {k.name: Encoders(spec.for_kind(k).model_copy(update={"device": device})) for k in kinds}
    parts: dict[str, dict[str, list[np.ndarray]]] = {k.name: {} for k in kinds}
    secs = dict.fromkeys(parts, 0.0)

    def run(kind: EmbeddingKind, batch: Any) -> None:
        t0 = time.perf_counter()
        for key, arr in kind.role.encode(encs[kind.name], batch).items():
            parts[kind.name].setdefault(key, []).append(arr)
        secs[kind.name] += time.perf_counter() - t0

    image_kinds = [k for k in kinds if k.role.input == "images"]
    if image_kinds:
        done = 0
        for _, _, imgs in iter_image_batches(images_path, batch_size=spec.batch_size):
            for k in image_kinds:
                run(k, imgs)
            done += len(imgs)
            log(f"images {done}/{n}")
    captions = meta.column("caption").to_pylist()
    for k in (k for k in kinds if k.role.input == "captions"):
        for i in range(0, len(captions), spec.batch_size):
            run(k, captions[i : i + spec.batch_size])

    out = {}
    for k in kinds:
        enc, model = encs[k.name], spec.model_of(k)
        t0 = time.perf_counter()
        extra_arrays, extra_attrs = k.role.finish(enc)
        secs[k.name] += time.perf_counter() - t0
        arrays = {a.name: a.empty() for a in k.arrays}  # an empty shard is still well-formed
        arrays.update({key: np.concatenate(v) for key, v in parts[k.name].items()})
        arrays.update(extra_arrays)
        local = Path(model).expanduser().is_dir()
        attrs = {
            "model": model,
            "weights": weights_label(model) if local else "",
            "random_weights": enc.random_weights[k.encoder],
            "device": device,
            "dtype": str(enc.dtype),
            "source": f"images_256/{Path(images_path).stem}",
            **extra_attrs,
            FINGERPRINT_ATTR: kind_fingerprint(k, spec, inputs, weights_cache).to_json(),
        }
        out[k.name] = Encoded(k, arrays, attrs, secs[k.name])
    return out


# ------------------------------------------------------------------------------- the rules


def shard_problems(kind: EmbeddingKind, shard: Shard, ids: Sequence[str]) -> list[str]:
    """What is wrong with one of ``kind``'s shards against the images_256 ids it was made from:
    ids, every array's shape and dtype, finite values, rows per sample and ragged lengths.
    Shapes come from the header; a transform-coded array is finite when its tables are (its
    codes are bounded integers), so nothing is decoded whole."""
    problems = []
    info = {a.name: shard.info(a.name) for a in kind.arrays if a.name in shard}
    widths = {
        name: int(i["shape"][-1])
        for name, i in info.items()
        if len(i["shape"]) > 1 and kind.array(name).shape and kind.array(name).shape[-1] is None
    }
    if len(set(widths.values())) > 1:  # the encoder's width, one per shard
        problems.append(f"arrays of the encoder's width disagree: {widths}")
    if list(shard.ids) != list(ids):
        problems.append(f"{len(shard.ids)} ids do not match images_256's {len(ids)}")
    n = len(shard.ids)
    for spec in kind.arrays:
        if spec.name not in shard:
            problems.append(f"no array {spec.name}")
            continue
        shape, dtype = tuple(info[spec.name]["shape"]), np.dtype(info[spec.name]["dtype"])
        tail_ok = len(shape) == len(spec.shape) + 1 and all(
            want is None or got == want for got, want in zip(shape[1:], spec.shape)
        )
        if not tail_ok or dtype != np.dtype(spec.dtype):
            problems.append(
                f"{spec.name} has shape {shape} dtype {dtype}, expected "
                f"(N, *{spec.shape}) {spec.dtype}"
            )
            continue
        if dtype.kind == "f":
            if "aux" in info[spec.name]:
                t = shard.coded(spec.name).tables
                finite = all(np.isfinite(np.asarray(x, np.float32)).all()
                             for x in (t.mean, t.weight, t.lo, t.step))  # fmt: skip
            else:
                finite = bool(np.isfinite(shard[spec.name]).all())
            if not finite:
                problems.append(f"{spec.name} has non-finite values")
        if spec.rows == "sample" and shape[0] != n:
            problems.append(f"{spec.name}: {shape[0]} rows != {n} ids")
        if spec.rows == "token" and "lengths" in shard:
            lengths = shard["lengths"]
            if len(lengths) != n or int(lengths.sum()) != shape[0] or (lengths < 1).any():
                problems.append(f"lengths do not add up to the {spec.name}")
    return problems
