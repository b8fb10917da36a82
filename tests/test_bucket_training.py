"""Training on aspect-ratio buckets: a store whose partitions hold samples of several latent
grids (the cell layout) beside a one-size partition (the square layout): every batch is of one
bucket and reads each sample's own latents and DINO rows, the order is a pure function of seed,
epoch, partitions and chunk (any workers, any global batch dividing the chunk, resumable at any
batch), and a training run resumes exactly, logs a loss per bucket and its ledger reconstructs
the trained samples."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch

from flowmatch_models.data.order import epoch_order
from flowmatch_models.data.source import ShardSource
from flowmatch_models.data.stream import BatchStream
from flowmatch_models.storage.layout import DataLayout
from flowmatch_models.storage.store import read_shard, write_shard
from tests.test_train import SF, _csv, read_records, run_training, tiny_config

#: latent grids (h, w) in cells: the square, a wide and a tall bucket
GRIDS = [(8, 8), (7, 10), (10, 7)]
SIZES = {"000-00": 40, "000-01": 36, "000-02": 44, "001-00": 24}
SQUARE = "001-00"  # stored in the one-size layout ([N, 32, 8, 8]) like every shard before


def make_bucket_store(root: Path, seed: int = 0, grids_of=GRIDS) -> tuple[Path, dict]:
    """Random well-formed shards (samples of ``grids_of``); returns, per sample id, its latent
    [32, h, w] and DINO rows."""
    rng = np.random.default_rng(seed)
    layout = DataLayout(root)
    truth = {}
    for i, (p, n) in enumerate(SIZES.items()):
        ids = [f"{p}/{j}" for j in range(n)]
        grids = (
            [(8, 8)] * n
            if p == SQUARE
            else [grids_of[k] for k in rng.integers(0, 3, n) % len(grids_of)]
        )
        lats = [(rng.standard_normal((32, h, w)) / SF).astype(np.float16) for h, w in grids]
        patches = [rng.standard_normal((h * w, 384)).astype(np.float16) for h, w in grids]
        truth.update({sid: (lat, pat) for sid, lat, pat in zip(ids, lats, patches)})
        cls = rng.standard_normal((n, 384)).astype(np.float16)
        if p == SQUARE:
            vae, dino = {"latents": np.stack(lats)}, {"patch": np.stack(patches), "cls": cls}
        else:
            grid = np.array(grids, np.int32)
            vae = {"latents": np.concatenate([x.reshape(-1, 32) for x in lats]), "grid": grid}
            dino = {"patch": np.concatenate(patches), "cls": cls, "grid": grid}
        write_shard(
            layout.asset_path("vae_latents", p),
            vae,
            ids,
            codec="zstd" if i % 2 else "none",
            attrs={"scaling_factor": SF},
        )
        write_shard(
            layout.asset_path("dino_features", p), dino, ids, codec="none", lossy={"patch": "pca4"}
        )  # the default storage: transform-coded cell rows
        lengths = rng.integers(2, 24, n).astype(np.int32)
        tokens = rng.standard_normal((int(lengths.sum()), 640)).astype(np.float16)
        write_shard(
            layout.asset_path("text_embeddings", p),
            {"tokens": tokens, "lengths": lengths},
            ids,
            codec="zstd",
        )
    return root, truth


@pytest.fixture(scope="module")
def bucket_store(tmp_path_factory) -> tuple[Path, dict]:
    return make_bucket_store(tmp_path_factory.mktemp("buckets"))


def _batches(stream: BatchStream, n: int, workers: int = 0) -> list[dict]:
    loader = torch.utils.data.DataLoader(stream, batch_size=None, num_workers=workers)
    return [stream.source.decode(b) for b in itertools.islice(iter(loader), n)]


def test_one_bucket_batches_with_each_samples_own_values(bucket_store) -> None:
    root, truth = bucket_store
    src = ShardSource(root, sorted(SIZES))
    assert src.grids == sorted(GRIDS) and src.max_cells == 70
    assert np.bincount(src.buckets).tolist() == [
        sum(1 for sid, (lat, _) in truth.items() if lat.shape[1:] == g) for g in src.grids
    ]
    stream = BatchStream(src, 8, seed=3, bucket_chunk=16)
    per_epoch = len(src.epoch_order(0, 3, 4, 16)) // 8
    batches = _batches(stream, per_epoch)
    seen = set()
    for b in batches:
        grids = {truth[i][0].shape[1:] for i in b["meta"]["ids"]}
        assert len(grids) == 1  # one bucket a batch
        (h, w) = grids.pop()
        assert b["latents"].shape == (8, 32, h, w) and b["dino"].shape == (8, h * w, 384)
        for j, sid in enumerate(b["meta"]["ids"]):
            lat, pat = truth[sid]
            assert torch.equal(b["latents"][j], torch.from_numpy(lat).float() * SF)
            # coded: within the codec's error (another sample's rows would be unrelated noise)
            ref = torch.from_numpy(pat).float()
            assert torch.nn.functional.cosine_similarity(b["dino"][j], ref).min() > 0.6
        assert not seen & set(b["meta"]["ids"])  # no sample twice in an epoch
        seen |= set(b["meta"]["ids"])
    # what the chunks leave out of an epoch: less than a chunk per bucket
    assert 0 <= int(src.sizes.sum()) - len(seen) < len(GRIDS) * 16


def test_order_is_the_same_for_any_workers_batch_and_resume(bucket_store) -> None:
    root, _ = bucket_store
    src = ShardSource(root, sorted(SIZES), heldout=(0.1, 3))
    ids = lambda bs: [i for b in bs for i in b["meta"]["ids"]]  # noqa: E731
    ref = _batches(BatchStream(src, 8, seed=5, bucket_chunk=16), 40)  # > 2 epochs
    assert len({b["meta"]["epoch"] for b in ref}) >= 3
    # another worker count, another global batch dividing the chunk: the same samples in order
    assert ids(_batches(BatchStream(src, 8, seed=5, bucket_chunk=16), 40, workers=2)) == ids(ref)
    four = BatchStream(src, 4, seed=5, bucket_chunk=16)
    assert ids(_batches(four, 80, workers=3)) == ids(ref)
    # two ranks of 4: rank r takes the r-th half of each global batch
    halves = [
        _batches(BatchStream(src, 4, seed=5, rank=r, world_size=2, bucket_chunk=16), 40)
        for r in (0, 1)
    ]
    assert [x["meta"]["ids"] + y["meta"]["ids"] for x, y in zip(*halves)] == [
        b["meta"]["ids"] for b in ref
    ]
    # a resume at any batch (mid-epoch, at a boundary, in a later epoch) continues exactly
    stream = BatchStream(src, 8, seed=5, bucket_chunk=16)
    for k in (3, 12, 27):
        epoch, pos = list(itertools.islice(stream.positions(), k + 1))[k]
        resumed = BatchStream(src, 8, seed=5, start_epoch=epoch, start_sample=pos, bucket_chunk=16)
        assert ids(_batches(resumed, 40 - k, workers=2)) == ids(ref[k:])
    # a global batch that does not divide the chunk is refused, naming the setting
    with pytest.raises(ValueError, match="data.bucket_chunk"):
        BatchStream(src, 6, seed=5, bucket_chunk=16)
    # the order is a pure function: one bucket gives exactly the order without buckets
    sizes = np.array([10, 7, 12])
    assert np.array_equal(
        epoch_order(sizes, 2, 1, 2, np.zeros(29, np.uint8), 4), epoch_order(sizes, 2, 1, 2)
    )


def test_training_on_buckets_resumes_exactly_with_ledger_and_per_bucket_loss(
    bucket_store, tmp_path: Path
) -> None:
    root, _ = bucket_store

    def config(out: Path, **kw) -> dict:
        return tiny_config(
            root, out, data__bucket_chunk=16, trainer__val_every=4, data__heldout_fraction=0.1, **kw
        )

    full = run_training(config(tmp_path / "full"), resume="none")
    assert full.step == 8
    a = read_records(tmp_path / "full")
    split = tmp_path / "split"
    first = run_training(config(split, trainer__max_steps=3, data__num_workers=2), resume="none")
    assert first.step == 3
    second = run_training(config(split), resume="auto")
    assert second.step == 8
    b = read_records(split)
    assert [r["ids"] for r in b] == [r["ids"] for r in a]
    np.testing.assert_allclose([r["loss"] for r in b], [r["loss"] for r in a], rtol=0, atol=1e-6)

    # per-bucket loss in the logs: each bucket's steps, and the validation over every bucket
    rows = _csv(tmp_path / "full" / "metrics.csv")
    keys = {k for r in rows for k, v in r.items() if k.startswith("train/loss_") and v}
    assert keys == {"train/loss_256x256", "train/loss_224x320", "train/loss_320x224"}
    val = [float(r["val/loss"]) for r in rows if r.get("val/loss")]
    assert val and all(np.isfinite(val))
    cfg = config(tmp_path / "x")
    held = ShardSource(root, sorted(SIZES), heldout=(0.1, cfg["data"]["heldout_max_per_partition"]))
    n_held = min(sum(len(h) for h in held.heldout_rows), cfg["trainer"]["val_max_samples"])
    assert n_held > 4 and len(held.heldout_batches(n_held)) > 1  # several buckets held out
    assert {float(r["val/samples"]) for r in rows if r.get("val/samples")} == {float(n_held)}

    # the ledger reconstructs the samples and steps of the batches (grids read from the shards)
    from flowmatch_models.data.rows import sample_grids
    from flowmatch_models.train.ledger import expand

    layout = DataLayout(root)
    ckpt = torch.load(split / "checkpoints" / "last.ckpt", weights_only=True)
    segs = ckpt["EmbeddingDataModule"]["ledger"]
    assert {s.get("bucket_chunk") for s in segs} == {16}
    shard = lambda p: read_shard(layout.asset_path("vae_latents", p))  # noqa: E731
    got = expand(segs, lambda p: shard(p).ids, lambda p: sample_grids(shard(p)))
    want: dict[str, list[int]] = {}
    for i, r in enumerate(b):
        for sid in r["ids"]:
            want.setdefault(sid, []).append(i // 2 + 1)
    assert sorted(got["sample_id"].to_pylist()) == sorted(want)
    for sid, n, lo, hi in zip(
        got["sample_id"].to_pylist(), got["times_seen"], got["first_step"], got["last_step"]
    ):
        assert (n, lo, hi) == (len(want[sid]), min(want[sid]), max(want[sid])), sid


def test_an_elastic_resume_with_a_larger_batch_keeps_batches_one_bucket(
    bucket_store, tmp_path: Path
) -> None:
    """3 steps of 8 (position 24), resumed with batches of 16: 24 is not on the new batch's
    grid, so the run starts the next batch at 32 (8 samples of the epoch left for the next);
    every batch stays one bucket and the ledger reconstructs exactly what was trained."""
    root, truth = bucket_store
    out = tmp_path / "elastic"
    cfg = tiny_config(
        root, out, data__bucket_chunk=16, trainer__accumulate_grad_batches=1, trainer__max_steps=3
    )
    assert run_training(cfg, resume="none").step == 3
    cfg = tiny_config(
        root,
        out,
        data__bucket_chunk=16,
        trainer__accumulate_grad_batches=1,
        trainer__max_steps=6,
        data__batch_size=16,
    )
    assert run_training(cfg, resume="auto").step == 6
    recs = read_records(out)
    assert [len(r["ids"]) for r in recs] == [8, 8, 8, 16, 16, 16]
    assert [r["position"] for r in recs][3] == 32  # realigned from 24
    for r in recs:
        assert len({truth[i][0].shape for i in r["ids"]}) == 1  # one bucket a batch
    from flowmatch_models.data.rows import sample_grids
    from flowmatch_models.train.ledger import expand

    layout = DataLayout(root)
    shard = lambda p: read_shard(layout.asset_path("vae_latents", p))  # noqa: E731
    segs = torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)
    got = expand(
        segs["EmbeddingDataModule"]["ledger"],
        lambda p: shard(p).ids,
        lambda p: sample_grids(shard(p)),
    )
    want = sorted(i for r in recs for i in r["ids"])
    assert sorted(got["sample_id"].to_pylist()) == want


def test_ledger_epochs_view_reads_segments_recorded_before_buckets(tmp_path: Path) -> None:
    """A data root whose catalog holds ledger segments recorded before the ``heldout`` and
    ``bucket_chunk`` columns still reads, beside new ones (the view unions by name)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from flowmatch_assets.catalog import Catalog
    from flowmatch_assets.catalog.records import LEDGER_EPOCH_SCHEMA, ledger_path, record_ledger

    seg = {
        "epoch": 0,
        "partitions": ["000-00"],
        "sizes": [4],
        "seed": 0,
        "shuffle_window": 4,
        "global_batch": 2,
        "accumulate": 1,
        "pos_from": 0,
        "pos_to": 4,
        "step_from": 0,
        "available_partitions": 1,
        "available_samples": 4,
    }
    old = pa.schema([f for f in LEDGER_EPOCH_SCHEMA if f.name not in ("heldout", "bucket_chunk")])
    path = ledger_path(tmp_path, "old", 2, "ledger_epochs")
    path.parent.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist([{**seg, "run": "old", "checkpoint_step": 2}], old), path)
    empty = {
        "sample_id": pa.array([], pa.string()),
        "partition": pa.array([], pa.string()).dictionary_encode(),
        **{
            k: np.zeros(0, np.int64)
            for k in ("times_seen", "first_step", "last_step", "partition_size")
        },
    }
    record_ledger(
        tmp_path, "new", 2, empty, [{**seg, "heldout": [0.1, 3], "bucket_chunk": 16}], [2]
    )
    rows = Catalog(tmp_path).query(
        "SELECT run, bucket_chunk, samples FROM ledger_epochs ORDER BY run"
    )
    assert rows == [
        {"run": "new", "bucket_chunk": 16, "samples": 4},
        {"run": "old", "bucket_chunk": None, "samples": 4},
    ]


# --------------------------------------------------------------------------------------------
# torch.compile
# --------------------------------------------------------------------------------------------


def test_compiled_buckets_one_graph_each_no_eager_fallback_losses_of_eager(tmp_path) -> None:
    """12 steps of the tiny preset compiled (inductor, CPU) on two buckets, the square in both
    layouts and a wide one: one static graph per bucket compiled at its first batch (no graph
    break, no recompile within a bucket, never Dynamo's fall back to eager), losses equal to
    eager's. (Inductor compiles a bucket in ~1-1.5 min on 2 shared CPU cores with a cold
    cache: two buckets, not three; this replaced the square-only compile test.)"""
    import torch._dynamo
    from torch._dynamo.utils import counters

    root, _ = make_bucket_store(tmp_path / "b", grids_of=[(8, 8), (7, 10)])
    losses, keys = {}, {}
    for compiled in (False, True):
        out = tmp_path / f"c{int(compiled)}"
        cfg = tiny_config(
            root,
            out,
            trainer__max_steps=12,
            trainer__accumulate_grad_batches=1,
            trainer__log_every=1,
            data__bucket_chunk=16,
            model__compile=compiled,
            logging__record_sample_ids=False,
        )
        torch._dynamo.reset()
        counters.clear()
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):  # never eager
            run_training(cfg, resume="none")
        rows = _csv(out / "metrics.csv")
        losses[compiled] = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
        keys[compiled] = {
            k for r in rows for k, v in r.items() if k.startswith("train/loss_") and v
        }
        if compiled:
            assert dict(counters["graph_break"]) == {}
            assert counters["stats"]["unique_graphs"] == 2  # <= buckets + 1
            assert counters["frames"]["ok"] == counters["frames"]["total"] == 2
    assert keys[True] == keys[False] == {"train/loss_256x256", "train/loss_224x320"}
    assert len(losses[True]) == len(losses[False]) == 12
    np.testing.assert_allclose(losses[True], losses[False], rtol=1e-4)
    torch._dynamo.reset()


class Grid(torch.nn.Module):
    """A convolution over a latent grid (Dynamo compiles code outside torch's own files)."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x) * 2


def test_every_bucket_gets_its_own_graph_before_dynamo_would_run_eager() -> None:
    """Dynamo compiles at most ``recompile_limit`` graphs of a function (8 by default) and then
    runs it eager: compile_per_bucket leaves room for all 13 default buckets (Dynamo's own
    eager backend here: the limit is Dynamo's, whatever compiles the graphs)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from flowmatch_models.data.buckets import buckets_for
    from flowmatch_models.train.run import compile_per_bucket

    with torch._dynamo.config.patch(recompile_limit=8, fail_on_recompile_limit_hit=True):
        conv = Grid()  # takes any latent grid, like the DiT
        compile_per_bucket(conv, grids=2, backend="eager")  # 8: the default limit
        torch._dynamo.reset()
        counters.clear()
        for h, w in buckets_for():
            for _ in range(2):
                conv(torch.randn(2, 4, h // 32, w // 32))
    assert len(buckets_for()) == 13 and counters["stats"]["unique_graphs"] == 13
    torch._dynamo.reset()
