"""The precalc: one images shard encoded by every kind's encoder role, batched per image size."""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from flowmatch_models.data.buckets import GRID
from flowmatch_models.embeddings.kinds import (
    FIRST_TOKEN_ATTR,
    CaptionBatch,
    EmbeddingKind,
    first_token_is_null,
    kind_fingerprint,
    kind_inputs,
)
from flowmatch_models.encoders.spec import EncoderSpec
from flowmatch_models.storage import remote
from flowmatch_models.storage.fingerprint import ATTR as FINGERPRINT_ATTR
from flowmatch_models.storage.fingerprint import weights_identity


@dataclass
class Encoded:
    """One kind's arrays and attrs for one partition, and the encoder seconds they took."""

    kind: EmbeddingKind
    arrays: dict[str, np.ndarray]
    attrs: dict
    seconds: float
    #: what the read-ahead's ``pin`` said of the version of the images file it read
    #: (:attr:`Ahead.version`), None without one
    version: Any = None


def encode_partition(
    images_path: str | Path,
    kinds: Sequence[EmbeddingKind],
    spec: EncoderSpec,
    device: str,
    log: Callable[[str], None] = print,
    inputs: dict[str, str | None] | None = None,
    weights_cache: str | Path | None = None,
    ahead: Ahead | None = None,
) -> dict[str, Encoded]:
    """Compute ``kinds`` for the images shard at ``images_path`` on ``device``: one pass
    over the images for every image kind, one over the captions for every caption kind.
    Arrays in the shard's row order, attrs with the model, its weights label, the device and
    the fingerprint (:func:`kind_fingerprint` over exactly what the kind reads,
    :func:`kind_inputs`; ``inputs``: the images partition's fingerprint hash, which the caller
    knows).

    The encoders are loaded once per process (:func:`shared_encoders`, by kind, settings and
    weights identity), so a run over many partitions pays each load once. The device never
    waits on the host for long: the shard's rows are read, its captions tokenized and its
    image batches decoded on threads (:class:`Ahead`) while the device encodes; a caller that
    encodes many partitions passes ``ahead`` = :func:`read_ahead` of this partition, started
    while the previous one was encoded, so that the device does not wait at a partition's start
    either. ``ahead`` is closed here; its encoders (loaded when it started, which tokenized its
    captions) are the ones that encode it.

    The fingerprint names what the values came from: the weights identity taken when each
    model was loaded (``Encoders.weights``), the compute dtype and device it ran with, and the
    ``inputs`` given (a caller that pinned ``ahead``: those of the very file version it read,
    :attr:`Ahead.version`)."""
    if ahead is None:
        ahead = Ahead(
            images_path, kinds, _encoders(kinds, spec, device, weights_cache), spec.batch_size
        )
    encs = ahead.encs
    try:
        return _encode(ahead, kinds, spec, device, encs, log, inputs, weights_cache)
    finally:
        ahead.close()  # no thread outlives the partition


def read_ahead(
    images_path: str | Path,
    kinds: Sequence[EmbeddingKind],
    spec: EncoderSpec,
    device: str,
    weights_cache: str | Path | None = None,
    pin: Callable[[Callable[[], Any]], Any] | None = None,
) -> Ahead:
    """Start reading ``images_path`` for :func:`encode_partition` now, on threads (its rows,
    its captions tokenized, its first image batches decoded), with the process's shared
    encoders' tokenizers. Never raises: a failure to read is raised by the encode that uses it.
    The caller passes it to :func:`encode_partition` or closes it. ``pin``: see :class:`Ahead`."""
    encs = _encoders(kinds, spec, device, weights_cache)
    return Ahead(images_path, kinds, encs, spec.batch_size, pin=pin)


def _encoders(kinds, spec: EncoderSpec, device: str, weights_cache) -> dict[str, Any]:
    encs = {}
    for k in kinds:
        kspec = k.spec_for(spec).model_copy(update={"device": device})
        encs[k.name] = shared_encoders(k, kspec, weights_cache)
        encs[k.name].load(k.encoder)  # here, before any thread uses it
    return encs


class Ahead:
    """One images shard read ahead of its encoding, started at once on a thread: its rows
    (ids, captions, sizes), its captions tokenized (one future per caption kind) and its image
    batches decoded up to ``depth`` batches ahead (by ``min(4, cores)`` decoding threads). An
    error is kept and raised to the consumer, in order. :meth:`close` stops and joins every
    thread it started.

    ``pin``: called on the reading thread as ``pin(open_file)`` before anything is read, where
    ``open_file()`` memory-maps the file (the one version every row and pixel is read from) and
    returns the mapping; what ``pin`` returns is kept as :attr:`version`. A caller names the
    version it reads there (flowmatch_assets: under the images partition's reader lock, its
    catalog record's fingerprint and the mapped bytes' content id). ``encs``: kept, the
    encoders that encode what it read."""

    _DONE = object()

    def __init__(
        self,
        images_path,
        kinds,
        encs: dict[str, Any],
        batch_size: int,
        depth: int = 2,
        pin: Callable[[Callable[[], Any]], Any] | None = None,
    ):
        self.path = Path(images_path)
        self.batch_size = int(batch_size)
        self.encs = encs
        self.version: Any = None
        self._pin = pin
        self.tokens: dict[str, Future] = {}
        self._meta: Any = None
        self._error: BaseException | None = None
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._q: queue.Queue = queue.Queue(maxsize=depth)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="flowmatch-tokenize")
        tokenizers = {k.name: encs[k.name].tokenize for k in kinds if k.role.input == "captions"}
        images = any(k.role.input == "images" for k in kinds)
        self._thread = threading.Thread(
            target=self._produce, args=(tokenizers, images), name="flowmatch-prefetch", daemon=True
        )
        self._thread.start()

    def _put(self, item) -> bool:  # False: closed
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self, tokenizers: dict[str, Callable], images: bool) -> None:
        import pyarrow as pa

        from flowmatch_models.storage.image_shard import iter_image_batches, read_image_meta

        mapped: list = []

        def open_file():
            if not mapped:
                # with a remote data root: another machine's shard fetched into the cache first
                mapped.append(pa.memory_map(str(remote.ensure(self.path))))
            return mapped[0]

        try:  # one version of the file for the rows and the images, whatever replaces it
            if self._pin is not None:
                self.version = self._pin(open_file)
            src = open_file()
            self._meta = read_image_meta(src)
            captions = self._meta.column("caption").to_pylist()
            self.tokens = {
                name: self._pool.submit(tok, captions) for name, tok in tokenizers.items()
            }
        except BaseException as e:  # noqa: BLE001 - raised to the consumer
            self._error = e
            return
        finally:
            self._ready.set()
        if not images:
            return
        threads = min(4, os.cpu_count() or 1)  # decoding keeps up with a fast GPU
        batches = iter_image_batches(src, batch_size=self.batch_size, threads=threads)
        try:
            for x in batches:
                if not self._put((x, None)):
                    return
            self._put((self._DONE, None))
        except BaseException as e:  # noqa: BLE001 - raised to the consumer, in order
            self._put((self._DONE, e))
        finally:
            batches.close()  # its decoding threads joined

    def meta(self):
        """The shard's rows (``read_image_meta``), once read; its read error raised."""
        self._ready.wait()
        if self._error is not None:
            raise self._error
        return self._meta

    def batches(self) -> Iterator:
        """The decoded ``(ids, captions, images)`` batches, in order; an error raised here."""
        self.meta()
        while True:
            x, err = self._q.get()
            if x is self._DONE:
                if err is not None:
                    raise err
                return
            yield x

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._pool.shutdown(wait=True, cancel_futures=True)


def _encode(ahead: Ahead, kinds, spec, device, encs, log, inputs, weights_cache):
    """:func:`encode_partition`'s body over what ``ahead`` reads."""
    from flowmatch_models.encoders.zoo import weights_label

    images_path = ahead.path
    meta = ahead.meta()
    n = meta.num_rows
    ids, captions = meta.column("id").to_pylist(), meta.column("caption").to_pylist()
    for k in kinds:
        encs[k.name].text_saturated = 0  # counted per partition
    parts: dict[str, dict[str, list[np.ndarray]]] = {k.name: {} for k in kinds}
    secs = dict.fromkeys(parts, 0.0)
    caption_kinds = [k for k in kinds if k.role.input == "captions"]
    tokens = ahead.tokens  # tokenized on a thread while the images are encoded

    def run(kind: EmbeddingKind, batch: Any) -> dict[str, np.ndarray]:
        t0 = time.perf_counter()
        got = kind.role.encode(encs[kind.name], batch)
        secs[kind.name] += time.perf_counter() - t0
        return got

    image_kinds = [k for k in kinds if k.role.input == "images"]
    sizes = np.stack([meta.column("height").to_numpy(), meta.column("width").to_numpy()], 1)
    one_size = len(np.unique(sizes, axis=0)) <= 1
    if image_kinds:
        # each bucket (image size) encoded in batches of its own; rows back in shard order
        rows: dict[str, dict[str, list[np.ndarray | None]]] = {k.name: {} for k in image_kinds}
        pending: dict[tuple[int, int], list[tuple[int, np.ndarray]]] = {}

        def flush(size: tuple[int, int]) -> None:
            batch = pending.pop(size)
            imgs = np.stack([im for _, im in batch])
            for k in image_kinds:
                for key, arr in run(k, imgs).items():
                    col = rows[k.name].setdefault(key, [None] * n)
                    for (i, _), x in zip(batch, arr):
                        col[i] = x

        done = 0
        for _, _, imgs in ahead.batches():
            for im in imgs:
                pending.setdefault(im.shape[:2], []).append((done, im))
                if len(pending[im.shape[:2]]) >= spec.batch_size:
                    flush(im.shape[:2])
                done += 1
            log(f"images {done}/{n}")
        for size in list(pending):
            flush(size)
        for k in image_kinds:
            for key, col in rows[k.name].items():
                if one_size:
                    parts[k.name][key] = [np.stack(col)]
                else:
                    parts[k.name][key] = [_cells(key, col)]
            if not one_size:
                parts[k.name]["grid"] = [(sizes // GRID).astype(np.int32)]
    for k in caption_kinds:
        got = tokens.get(k.name)
        ids_of = got.result() if got is not None else encs[k.name].tokenize(captions)
        # the whole partition at once: the encoder sorts it by length and cuts its own
        # batches, so a batch pads to captions of its own length, not to a random row's
        for key, arr in run(k, CaptionBatch(captions, ids_of)).items():
            parts[k.name].setdefault(key, []).append(arr)

    out = {}
    for k in kinds:
        enc, model = encs[k.name], k.model_in(spec)
        t0 = time.perf_counter()
        extra_arrays, extra_attrs = k.role.finish(enc)
        secs[k.name] += time.perf_counter() - t0
        specs = k.arrays_of(parts[k.name])
        arrays = {a.name: a.empty() for a in specs}  # an empty shard is still well-formed
        arrays.update({key: np.concatenate(v) for key, v in parts[k.name].items()})
        arrays.update(extra_arrays)
        if {"tokens", "lengths", "null_tokens"} <= set(arrays):  # a caption kind
            extra_attrs[FIRST_TOKEN_ATTR] = first_token_is_null(
                arrays["tokens"], arrays["lengths"], arrays["null_tokens"]
            )
        local = Path(model).expanduser().is_dir()
        attrs = {
            "model": model,
            "weights": weights_label(model) if local else "",
            "random_weights": enc.random_weights[k.encoder],
            "device": device,
            **(
                {"simulated_gpu_pairs_per_s": enc.simulated_pairs_per_s}
                if enc.simulated_pairs_per_s
                else {}
            ),
            "dtype": str(enc.dtype),
            "source": f"images/{Path(images_path).stem}",
            **extra_attrs,
            FINGERPRINT_ATTR: _fingerprint(k, spec, inputs, weights_cache, ids, captions, enc),
        }
        out[k.name] = Encoded(k, arrays, attrs, secs[k.name], ahead.version)
    return out


# --------------------------------------------------------------------- encoders, loaded once

_SHARED: OrderedDict[str, tuple[str, Any]] = OrderedDict()
_SHARED_LOCK = threading.Lock()


def shared_encoders(kind: EmbeddingKind, spec: EncoderSpec, weights_cache=None) -> Any:
    """This process's :class:`~flowmatch_models.encoders.frozen.Encoders` for ``kind`` under
    ``spec`` (device included): made once and kept while the settings and the model's weights
    (:func:`weights_identity`, hashed once per process and folder state) stay the same; other
    settings or weights replace it, so one kind never holds two models."""
    from flowmatch_models.encoders.frozen import Encoders

    model = kind.model_in(spec)
    key = json.dumps(
        [spec.model_dump(mode="json"), weights_identity(model, weights_cache)],
        sort_keys=True,
        default=str,
    )
    with _SHARED_LOCK:
        got = _SHARED.get(kind.name)
        if got is None or got[0] != key:
            enc = Encoders(spec)
            enc.weights_cache = weights_cache
            _SHARED[kind.name] = (key, enc)
        return _SHARED[kind.name][1]


def clear_shared_encoders() -> None:
    """Forget the loaded encoders (their memory is freed once nothing else holds them)."""
    with _SHARED_LOCK:
        _SHARED.clear()


def _fingerprint(kind, spec, images_inputs, weights_cache, ids, captions, enc=None) -> dict:
    """The kind's fingerprint with exactly its inputs (:func:`kind_inputs`), as stored: the
    weights ``enc`` loaded (identified at the load) and the dtype and device it computed in."""
    inputs, rows = kind_inputs(kind, images_inputs, ids, captions)
    weights = enc.weights.get(kind.encoder) if enc is not None else None
    compute = enc.compute(kind.encoder) if enc is not None else None
    fp = kind_fingerprint(kind, spec, inputs, weights_cache, weights=weights, compute=compute)
    return fp.with_rows(**rows).to_json()


def _cells(key: str, col: list[np.ndarray]) -> np.ndarray:
    """One image array of samples of several sizes as per-cell rows (the cell layout, see
    ``cell_arrays``): DINO patches ``[c, D]`` are cell rows already; a latent ``[32, h, w]`` is
    kept channel-first and cut into ``h * w`` rows of 32 values (its bytes as a one-size shard
    stores them); per-sample arrays (``cls``) stay per sample."""
    first = col[0]
    if key == "latents":
        return np.concatenate([x.reshape(-1, x.shape[0]) for x in col])
    if first.ndim == 2:
        return np.concatenate(col)
    return np.stack(col)
