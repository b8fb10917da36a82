"""The training loader at scale: memory bounded whatever the partition size and worker count,
the same sample order in every storage format, the order definition in the checkpoint, and the
shared batch ring that refuses to hand out a batch twice."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from flowmatch_assets.bench.loader import measure_in_subprocess
from flowmatch_models.data.module import EmbeddingDataModule
from flowmatch_models.data.order import ORDER, OrderChangedError, epoch_windows
from flowmatch_models.data.ring import BatchRing
from flowmatch_models.data.source import PartitionChangedError
from flowmatch_models.data.stream import BatchStream
from flowmatch_models.encoders.spec import DEFAULT_LOSSY
from flowmatch_models.storage.layout import DataLayout
from flowmatch_models.storage.lossy import lossy_error
from flowmatch_models.storage.store import read_shard, write_shard

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread
SF = 0.41407
#: storage name -> (codec, lossy per kind), as `flowmatch bench loader --storage` names them
STORAGES = {"default": ("none", DEFAULT_LOSSY), "lossless": ("none", {}), "zstd": ("zstd", {})}


def _states(rng, rows: int, width: int) -> np.ndarray:
    """Hidden-state-like rows: a concentrated spectrum plus a huge-mean channel."""
    basis = rng.standard_normal((24, width)) * np.linspace(2, 0.2, 24)[:, None]
    x = rng.standard_normal((rows, 24)) @ basis + 0.05 * rng.standard_normal((rows, width))
    x[:, 0] -= 30.0
    return x.astype(np.float16)


def make_root(
    root: Path,
    sizes: dict[str, int],
    storage: str,
    seed: int = 0,
    mean_len: int = 20,
    causal: Sequence[str] = (),
    flip: Sequence[str] = (),
):
    """Well-formed training shards of ``sizes`` in a storage of :data:`STORAGES`; the arrays
    depend only on ``seed``, not on the storage. ``causal`` partitions: every caption's first
    state is the null caption's (a causal encoder's, to fp16 batch noise), as the shard says
    (``first_token_is_null``); ``flip``: their text states negated (another fit, same ids)."""
    codec, lossy = STORAGES[storage]
    layout = DataLayout(root)
    rng = np.random.default_rng(seed)
    null = _states(np.random.default_rng(seed + 1), 1, 640)  # one text encoder: one empty prompt
    for p, n in sizes.items():
        ids = [f"{p}/{j}" for j in range(n)]
        lengths = rng.integers(2, 2 * mean_len, n).astype(np.int32)
        tokens = _states(rng, int(lengths.sum()), 640)
        starts = np.cumsum(lengths) - lengths
        attrs = {}
        if p in causal:
            noise = 1e-4 * np.random.default_rng(n).standard_normal((n, 640))
            tokens[starts] = (null[0].astype(np.float32) + noise).astype(np.float16)
            attrs = {"first_token_is_null": True}
        if p in flip:
            tokens = -tokens
        arrays = {
            "vae_latents": {
                "latents": (rng.standard_normal((n, 32, 8, 8)) / SF).astype(np.float16)
            },
            "dino_features": {
                "patch": _states(rng, n * 64, 384).reshape(n, 64, 384),
                "cls": _states(rng, n, 384),
            },
            "text_embeddings": {
                "tokens": tokens,
                "lengths": lengths,
                "null_tokens": -null if p in flip else null,
            },
        }
        for kind, arrs in arrays.items():
            mode = lossy.get(kind)
            write_shard(
                layout.asset_path(kind, p),
                arrs,
                ids,
                codec=codec,
                attrs={"scaling_factor": SF}
                if kind == "vae_latents"
                else attrs
                if kind == "text_embeddings"
                else {},
                lossy={"patch" if kind == "dino_features" else "tokens": mode} if mode else None,
            )
    return root


def _epoch(root: Path, workers: int, batch: int = 16, window: int = 2) -> list[dict]:
    """Every batch of one epoch through the data module's own loader, decoded on the host."""
    dm = EmbeddingDataModule(
        root, batch_size=batch, num_workers=workers, shuffle_window=window, heldout=(0.05, 4)
    )
    out = []
    for b in dm.train_dataloader():
        meta = b.pop("meta")
        d = dm.decode_batch(b, "cpu")
        out.append(
            {
                "ids": list(meta["ids"]),
                "position": meta["position"],
                **{k: d[k].clone() for k in ("latents", "text", "mask", "dino")},
            }
        )
    return out


# 002-00 has so few captions that its text spans fewer axes than the others (smaller tables,
# the same row size: batches mix it with the others)
SIZES = {"000-00": 40, "000-01": 36, "000-02": 44, "001-00": 40, "001-01": 30, "002-00": 3}


@pytest.fixture(scope="module")
def roots(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("storages")
    return {s: make_root(base / s, SIZES, s) for s in STORAGES}


def test_every_storage_gives_the_same_order_and_values(roots):
    """The sample order is a pure function of seed, epoch and partitions: the same ids, batch
    for batch, in every storage and with any worker count; lossless storages give identical
    values, the default (transform-coded) ones within its recorded error."""
    ref = _epoch(roots["zstd"], workers=0)
    trainable = EmbeddingDataModule(roots["zstd"], heldout=(0.05, 4)).source.sizes
    assert sum(SIZES.values()) - 6 * 4 <= trainable.sum() < sum(SIZES.values())  # held out
    assert len(ref) == int(trainable.sum()) // 16
    ids = [b["ids"] for b in ref]
    assert len({i for b in ids for i in b}) == sum(len(b) for b in ids)  # no sample twice
    for storage, workers in (("lossless", 2), ("default", 2), ("default", 0)):
        got = _epoch(roots[storage], workers)
        assert [b["ids"] for b in got] == ids, storage
        for a, b in zip(ref, got):
            assert torch.equal(a["mask"], b["mask"]) and torch.equal(a["latents"], b["latents"])
            if storage == "lossless":
                assert torch.equal(a["text"], b["text"]) and torch.equal(a["dino"], b["dino"])
            else:
                m = a["mask"]
                text = lossy_error(a["text"][m].numpy(), b["text"][m].numpy())
                assert text["mean_cosine"] > 0.999 and text["rel_rms"] < 0.05
                assert (b["text"][~m] == 0).all()  # padding stays zero
                dino = lossy_error(a["dino"].numpy(), b["dino"].numpy())
                assert dino["mean_cosine"] > 0.999
    few = read_shard(DataLayout(roots["default"]).asset_path("text_embeddings", "002-00"))
    many = read_shard(DataLayout(roots["default"]).asset_path("text_embeddings", "000-00"))
    assert len(few.coded("tokens").tables.lo) < len(many.coded("tokens").tables.lo)
    assert few.coded("tokens").codes.shape[1] == many.coded("tokens").codes.shape[1] == 360
    # the error reading returns is the error the shard recorded
    shard = read_shard(DataLayout(roots["default"]).asset_path("text_embeddings", "000-01"))
    ref_shard = read_shard(DataLayout(roots["zstd"]).asset_path("text_embeddings", "000-01"))
    err = lossy_error(ref_shard["tokens"], shard["tokens"])
    assert shard.attrs["lossy"]["tokens"]["rel_rms"] == pytest.approx(err["rel_rms"], rel=1e-6)


def test_the_next_window_is_opened_before_its_first_batch(roots):
    """No worker opens a whole window at the boundary: its partitions are open before the
    first batch that needs them."""
    dm = EmbeddingDataModule(roots["default"], batch_size=8, shuffle_window=2, heldout=(0.05, 4))
    src = dm.source
    windows = epoch_windows(src.sizes, 0, 0, 2)
    first_of_second = int(src.sizes[windows[0]].sum()) // 8
    stream = BatchStream(src, 8, shuffle_window=2)
    seen = sum(1 for _ in zip(range(first_of_second), stream))
    assert seen == first_of_second
    assert {int(p) for p in windows[1]} <= set(src._open)


def test_state_records_the_order_and_a_resume_under_another_stops(roots):
    dm = EmbeddingDataModule(roots["default"], batch_size=8)
    state = dm.state_dict()
    assert state["order"] == ORDER == "window-v1"
    dm.load_state_dict(dict(state))  # same definition: fine
    legacy = {k: v for k, v in state.items() if k != "order"}  # before the key: window-v1
    dm.load_state_dict(legacy)
    with pytest.raises(OrderChangedError) as e:
        dm.load_state_dict({**state, "order": "bucket-v1"})
    msg = str(e.value)
    assert "'bucket-v1'" in msg and "'window-v1'" in msg and "\n" not in msg


def test_a_ring_slot_refilled_while_in_use_is_refused(roots):
    dm = EmbeddingDataModule(roots["default"], batch_size=8)
    ring = BatchRing(dm.source, 8, workers=1, slots_per_worker=1)  # far too small on purpose
    items = iter(BatchStream(dm.source, 8, ring=ring))
    first = ring.open(next(items))
    assert first["latents"].shape == (8, 32, 8, 8)
    with pytest.raises(RuntimeError, match="refilled while batch 0 was in use"):
        ring.open(next(items))


def test_loader_memory_does_not_grow_with_partition_size_or_workers(tmp_path):
    """The loader's memory is its batch buffers: peak USS (private memory, summed over the
    main process and its workers, measured from outside) does not grow with the partition
    size nor, beyond each process's own interpreter, with the worker count. The old way
    (stored compressed: partitions decoded whole) grows with both: shown beside it."""
    small = make_root(
        tmp_path / "small", {f"00{i}-00": 300 for i in range(3)}, "default", mean_len=40
    )
    big = make_root(tmp_path / "big", {f"00{i}-00": 900 for i in range(3)}, "default", mean_len=40)
    old = make_root(tmp_path / "old", {f"00{i}-00": 900 for i in range(3)}, "zstd", mean_len=40)

    def uss(root: Path, workers: int) -> float:
        m = measure_in_subprocess(root, 32, workers, 2, max_batches=60)
        return m["peak_uss_gb"] * 1e3  # MB

    small1, big1, big3, old1 = uss(small, 1), uss(big, 1), uss(big, 3), uss(old, 1)
    # measured here: 348 / 353 / 384 MB at 1,200 samples a partition, the old way 632 MB
    assert big1 - small1 < 30, (small1, big1)
    assert big3 - big1 < 2 * 60, (big1, big3)  # two more interpreters, no more data
    # 3 x 900 captions x 40 tokens x 640 + 3 x 900 x 64 x 384 fp16: ~270 MB decoded
    assert old1 - big1 > 150, (big1, old1)  # decoding partitions whole: the growth the test sees


def test_a_causal_encoders_first_state_is_fed_exactly(tmp_path):
    """Gemma's first state of every caption is the null caption's (token 0 sees only BOS).
    Stored transform-coded like every token it decodes lossy; training puts it back exactly,
    as CFG and sampling feed it, for a shard that says so (``first_token_is_null``); a shard
    written before the attr existed reads as stored, and both train together."""
    root = make_root(tmp_path / "r", {"000-00": 40, "000-01": 40}, "default", causal=["000-00"])
    path = DataLayout(root).asset_path("text_embeddings", "000-01")
    old = read_shard(path)  # the same data, written before the attr: no substitution
    assert "first_token_is_null" not in old.attrs
    null0 = torch.from_numpy(old["null_tokens"][0].astype(np.float32))
    dm = EmbeddingDataModule(root, batch_size=16, heldout=(0.1, 3))
    seen = {"000-00": 0, "000-01": 0}
    batches = [(b.pop("meta")["ids"], dm.decode_batch(b, "cpu")) for b in dm.train_dataloader()]
    held = dm.source.decode(dm.source.heldout_batch(8))  # validation's: decoded on the host
    for ids, d in [*batches, (held["ids"], held)]:
        for j, i in enumerate(ids):
            part, first, second = i.split("/")[0], d["text"][j, 0], d["text"][j, 1]
            seen[part] += 1
            if part == "000-00":
                assert torch.equal(first, null0), i  # exactly the state inference feeds
            else:
                assert not torch.equal(first, null0)  # lossy, as stored
            assert not torch.equal(second, null0)
    assert min(seen.values()) > 0
    # the caption standardisation sees the first states as training does
    mean, _ = dm.source.text_stats()
    rows = []
    for p in ("000-00", "000-01"):
        shard = read_shard(DataLayout(root).asset_path("text_embeddings", p))
        t = np.asarray(shard["tokens"], np.float64)  # host decode (fp16), as stored
        if p == "000-00":
            t[np.cumsum(shard["lengths"]) - shard["lengths"]] = null0.double().numpy()
        rows.append(t)
    np.testing.assert_allclose(mean.numpy(), np.concatenate(rows).mean(0), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("workers, loader", [(0, "threads"), (1, "processes"), (2, "threads")])
def test_a_partition_remade_between_gather_and_decode_keeps_its_tables(tmp_path, workers, loader):
    """A partition re-made while a run reads it (atomic rename; the same ids, another fit):
    codes read from the old file are never decoded with the new file's tables. In the process
    that read them they decode with the old tables (the version it holds open: any thread
    count of the thread loader); with worker processes, where the main process never opened
    the old file, the batch stops the run in one line instead of training on it."""
    sizes = {"000-00": 40, "000-01": 40}
    root = make_root(tmp_path / "r", sizes, "default")
    want = {
        i: d
        for b in _epoch(root, workers=0, batch=8, window=2)
        for i, d in zip(b["ids"], b["text"])
    }
    dm = EmbeddingDataModule(
        root, batch_size=8, num_workers=workers, shuffle_window=2, heldout=(0.05, 4), loader=loader
    )
    it = iter(dm.train_dataloader())
    batch = next(it)  # read (codes of the files as they are now), not yet decoded
    ids = batch.pop("meta")["ids"]
    assert any(i.startswith("000-01/") for i in ids)
    path = DataLayout(root).asset_path("text_embeddings", "000-01")
    before = read_shard(path).coded("tokens").tables.mean
    # re-made: the same ids, another fit (every axis's sign flipped), by an atomic rename
    make_root(tmp_path / "r", sizes, "default", flip=["000-01"])
    assert read_shard(path).ids == [f"000-01/{j}" for j in range(40)]
    np.testing.assert_allclose(read_shard(path).coded("tokens").tables.mean, -before, atol=1e-3)
    if loader == "threads":
        got = dm.decode_batch(batch, "cpu")["text"]
        for j, i in enumerate(ids):
            assert torch.equal(got[j], want[i]), i  # the old file's values exactly
        return
    with pytest.raises(PartitionChangedError) as e:  # the main process never opened 000-01
        dm.decode_batch(batch, "cpu")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(
        "partition '000-01': its text_embeddings file was re-made while this run read it"
    )
    assert "resume (--resume auto)" in msg


def _stored(root: Path, loader: str, workers: int) -> list[dict]:
    """Every stored batch of one epoch as the module's loader hands it over (copied out)."""
    dm = EmbeddingDataModule(
        root, batch_size=8, num_workers=workers, shuffle_window=2, heldout=(0.05, 4), loader=loader
    )
    out = []
    for b in dm.train_dataloader():
        meta = b.pop("meta")
        out.append(
            {
                "ids": list(meta["ids"]),
                "position": meta["position"],
                **{k: v.clone() for k, v in b.items() if torch.is_tensor(v)},
                **{
                    k: v
                    for k, v in b.items()
                    if k in ("parts", "text_counts", "dino_counts", "text_tables", "dino_tables")
                },
            }
        )
    return out


@pytest.mark.parametrize("storage", ["default", "zstd"])
def test_the_thread_loader_hands_over_the_worker_loaders_batches(roots, storage):
    """``data.loader: threads`` (the default) yields exactly what the DataLoader's worker
    processes (``processes``, the loader before it) yield: the same samples in the same order
    and the same stored bytes, whatever the thread count (0: built in the consuming thread)."""
    ref = _stored(roots[storage], "processes", 2)
    assert len(ref) > 4
    for workers in (0, 3):
        got = _stored(roots[storage], "threads", workers)
        assert len(got) == len(ref), workers
        for a, b in zip(ref, got):
            assert a.keys() == b.keys()
            for k in a:
                same = torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k]
                assert same, (workers, k)


def test_reads_not_in_the_page_cache_are_finished_by_the_io_threads(roots, monkeypatch):
    """The thread loader's builder reads only what the page cache holds (``RWF_NOWAIT``); a
    run it could not read, or read in part, is finished by the io threads: the batches are
    the blocking reads' exactly. Simulated: every third read misses, every fifth stops short."""
    import os

    from flowmatch_models.data import rows as rows_mod

    want = _stored(roots["default"], "threads", 0)  # blocking reads only
    real, calls = os.preadv, {"nowait": 0, "missed": 0}

    def preadv(fd, bufs, off, flags=0):
        if not flags & rows_mod.NOWAIT:
            return real(fd, bufs, off)
        calls["nowait"] += 1
        if calls["nowait"] % 3 == 0:
            calls["missed"] += 1
            raise BlockingIOError(11, "Resource temporarily unavailable")
        if calls["nowait"] % 5 == 0 and len(bufs[0]) > 1:
            calls["missed"] += 1
            return real(fd, [bufs[0][: len(bufs[0]) // 2]], off)
        return real(fd, bufs, off, flags)

    monkeypatch.setattr(rows_mod.os, "preadv", preadv)
    got = _stored(roots["default"], "threads", 2)
    assert calls["missed"] > 10
    assert [b["ids"] for b in got] == [b["ids"] for b in want]
    for a, b in zip(want, got):
        for k in a:
            assert torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k], k


def test_a_plan_names_the_trainable_rows_and_reads_them_into_a_slot_as_into_new_buffers(roots):
    """A batch's plan holds the samples' rows (held-out rows skipped for ``train``) grouped by
    partition; its reads into a ring slot are the bytes of a batch read into new buffers, and
    decoding either gives each sample's own id."""
    src = EmbeddingDataModule(roots["default"], batch_size=8, heldout=(0.05, 4)).source
    shard, local = np.array([2, 0, 2, 1, 0, 5, 1, 0]), np.array([3, 0, 4, 7, 9, 1, 0, 2])
    plan = src.plan(shard, local, train=True)
    trainable = [
        np.delete(np.arange(SIZES[p]), h) for p, h in zip(src.partitions, src.heldout_rows)
    ]
    assert plan.rows.tolist() == [int(trainable[s][j]) for s, j in zip(shard, local)]
    assert plan.parts == [0, 1, 2, 5] and plan.counts == [3, 2, 2, 1]
    assert shard[plan.order].tolist() == [0, 0, 0, 1, 1, 2, 2, 5]
    ring = BatchRing(src, 8, workers=1, slots_per_worker=1, shared=False)
    small = src.read(plan, ring.buffers[0], ring.arrays[0])
    assert "latents" not in small and "text_rows" not in small  # the slot holds them
    ring.seqs[0] = 0
    slot, new = ring.open({**small, "slot": 0, "seq": 0}), src.gather(shard, plan.rows)
    for k in ("latents", "mask", "text_rows", "text_dst", "dino_rows", "dino_dst"):
        assert torch.equal(slot[k], new[k]), k
    want = [f"{src.partitions[s]}/{r}" for s, r in zip(shard, plan.rows)]
    assert src.decode(slot)["ids"] == src.decode(new)["ids"] == want
    assert torch.equal(src.decode(slot)["text"], src.decode(new)["text"])
