"""Training skips the exclusion list (near duplicates, stored content duplicates): the loader
never yields its ids, the ledger records its version and maps positions back with it, and a
resume under a re-decided list finishes its epoch with the recorded one, exactly."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from flowmatch_models.data import exclude as exclusions
from flowmatch_models.data.order import heldout_rows
from flowmatch_models.storage.layout import DataLayout
from flowmatch_models.storage.store import read_shard
from flowmatch_models.train.ledger import expand
from tests.test_train import SIZES, make_store, read_records, run_training, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread


def _write(root: Path, rel: str, pairs: list[tuple[str, str]]) -> None:
    """A catalog table of losers as the catalog writes it (only the columns training reads)."""
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [{"partition": p, "id": i, "kept_id": "x"} for p, i in pairs]
    pq.write_table(pa.Table.from_pylist(rows), path)


def _trainable(root: Path) -> set[str]:
    """Every id the tiny config trains on without an exclusion list (held-out ones left out)."""
    out = set()
    for p in SIZES:
        ids = read_shard(DataLayout(root).asset_path("vae_latents", p)).ids
        held = set(heldout_rows(ids, 0.1, 50).tolist())
        out |= {i for j, i in enumerate(ids) if j not in held}
    return out


def _ids(records: list[dict], epoch: int | None = None) -> list[str]:
    return [i for r in records if epoch in (None, r["epoch"]) for i in r["ids"]]


def _ledger_counts(root: Path, ckpt: Path) -> dict[str, int]:
    state = torch.load(ckpt, weights_only=True)["EmbeddingDataModule"]
    layout = DataLayout(root)
    rows = expand(
        state["ledger"],
        lambda p: read_shard(layout.asset_path("vae_latents", p)).ids,
        excluded_of=lambda d: exclusions.recorded(root, d),
    )
    return dict(zip(rows["sample_id"].to_pylist(), rows["times_seen"].tolist()))


def _counts(records: list[dict]) -> dict[str, int]:
    out: dict[str, int] = {}
    for i in _ids(records):
        out[i] = out.get(i, 0) + 1
    return out


def test_training_never_yields_an_excluded_id_and_the_ledger_records_the_list(tmp_path):
    root = make_store(tmp_path / "store")
    trainable = sorted(_trainable(root))
    near = [("000-00", trainable[0]), ("000-01", trainable[25]), ("001-00", trainable[-1])]
    content = [("000-02", trainable[50])]
    _write(root, exclusions.NEAR_DUPLICATES, near)
    _write(root, exclusions.CONTENT_LOSERS, content)
    skipped = {i for _, i in near + content}
    assert len(skipped) == 4 and skipped <= set(trainable)

    out = tmp_path / "run"
    run_training(tiny_config(root, out, trainer__max_steps=8), resume="none")  # > 1 epoch
    records = read_records(out)
    got, epoch0 = _ids(records), _ids(records, 0)
    assert len(got) > len(epoch0) and _ids(records, 1)  # the second epoch too
    assert not skipped & set(got)
    # the first epoch: every other one, once (the last partial batch left for the next)
    n = len(trainable) - len(skipped)
    assert len(epoch0) == len(set(epoch0)) == n // 8 * 8 and n % 8
    assert set(epoch0) <= set(trainable) - skipped
    state = torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)
    data = state["EmbeddingDataModule"]
    digest = exclusions.current(root).digest
    assert len(digest) == 16 and data["exclude"] == digest
    assert [s["exclude"] for s in data["ledger"]] == [digest, digest]
    assert (
        sum(s["sizes"][0] for s in data["ledger"][:1])
        == len([i for i in trainable if i.startswith("000-00/")]) - 1
    )
    assert exclusions.recorded(root, digest).ids == {
        "000-00": {near[0][1]},
        "000-01": {near[1][1]},
        "001-00": {near[2][1]},
        "000-02": {content[0][1]},
    }
    # the ledger maps every position back to the ids trained, with the recorded list
    assert _ledger_counts(root, out / "checkpoints" / "last.ckpt") == _counts(read_records(out))

    # the setting off: every trainable id again, and no list recorded
    off = tmp_path / "off"
    run_training(
        tiny_config(root, off, trainer__max_steps=6, data__skip_duplicates=False), resume="none"
    )
    state = torch.load(off / "checkpoints" / "last.ckpt", weights_only=True)
    assert sum(state["EmbeddingDataModule"]["ledger"][0]["sizes"]) == len(trainable)
    assert set(_ids(read_records(off))) <= set(trainable) and skipped & set(_ids(read_records(off)))
    assert "exclude" not in state["EmbeddingDataModule"]
    assert all("exclude" not in s for s in state["EmbeddingDataModule"]["ledger"])


def test_a_resume_finishes_its_epoch_with_the_recorded_list_and_the_next_takes_the_new(tmp_path):
    root = make_store(tmp_path / "store")
    trainable = sorted(_trainable(root))
    first = [("000-00", trainable[3]), ("001-00", trainable[-2])]
    _write(root, exclusions.NEAR_DUPLICATES, first)
    old = exclusions.current(root).digest
    full = tmp_path / "full"
    run_training(tiny_config(root, full, trainer__max_steps=8), resume="none")
    want = read_records(full)

    split = tmp_path / "split"
    run_training(tiny_config(root, split, trainer__max_steps=2), resume="none")
    done = _ids(read_records(split))
    # re-decided while the run was stopped: one more loser, not trained yet this epoch
    later = next(i for i in _ids(want)[len(done) :] if i.startswith("000-01/"))
    _write(root, exclusions.NEAR_DUPLICATES, [*first, ("000-01", later)])
    new = exclusions.current(root).digest
    assert new != old
    run_training(tiny_config(root, split, trainer__max_steps=8), resume="auto")
    got = read_records(split)
    # epoch 0: the recorded list, exactly as uninterrupted; epoch 1: the new list
    assert _ids(got, 0) == _ids(want, 0) and later in _ids(got, 0)
    assert later not in _ids(got, 1) and _ids(got, 1) and later in _ids(want, 1)
    state = torch.load(split / "checkpoints" / "last.ckpt", weights_only=True)
    ledger = state["EmbeddingDataModule"]["ledger"]
    assert [(s["epoch"], s["exclude"]) for s in ledger] == [(0, old), (0, old), (1, new)]
    assert _ledger_counts(root, split / "checkpoints" / "last.ckpt") == _counts(got)

    # the recorded version gone: the resume says which file it needs
    (root / "exclusions" / f"{old}.parquet").unlink()
    with pytest.raises(exclusions.ExclusionsMissingError, match=old):
        _ledger_counts(root, split / "checkpoints" / "last.ckpt")
