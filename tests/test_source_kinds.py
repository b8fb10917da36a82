"""A source kind is an explicit, typed interface (flowmatch_assets/ingest/sources/kind.py:
SourceKind with named return types), registered in one place (registry.SOURCE_KIND_REGISTRY)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from flowmatch_assets.ingest.sources import SOURCE_KINDS, SourceConfig, register
from flowmatch_assets.ingest.sources.kind import (
    Found,
    Listing,
    Manifest,
    NewPartition,
    Skipped,
    SourceKind,
)
from flowmatch_assets.ingest.sources.registry import (
    SOURCE_KIND_REGISTRY,
    partition_rows,
    source_kind,
)
from tests import hostile_sources as hs


def test_every_kind_of_the_config_is_one_registered_source_kind():
    assert (
        tuple(SOURCE_KIND_REGISTRY) == SOURCE_KINDS == ("folder", "parquet", "webdataset", "urls")
    )
    for name, kind in SOURCE_KIND_REGISTRY.items():
        assert isinstance(kind, SourceKind) and kind.name == name
        assert source_kind(name) is kind
    # the images stage downloads a urls partition (its rows carry URLs); the others read bytes
    assert [k for k, v in SOURCE_KIND_REGISTRY.items() if v.downloads] == ["urls"]


def test_a_kind_returns_named_types(tmp_path):
    """scan -> Found (NewPartition, Skipped), rows -> Listing, images -> (row, bytes)."""
    src = tmp_path / "src"
    src.mkdir()
    for i, caption in enumerate(["a red circle", "a blue square", None]):
        (src / f"{i}.jpg").write_bytes(hs.jpeg(i))
        if caption:
            (src / f"{i}.txt").write_text(caption)
    (src / "broken.parquet").write_bytes(b"not parquet")
    cfg = SourceConfig(kind="folder", location=str(src), shard_size=2)
    folder = source_kind("folder")
    found = folder.scan(cfg, [])
    assert isinstance(found, Found) and found.skipped == []
    assert found.new == [
        NewPartition(
            "", 0, 2, [{"id": "0.jpg", "image": "0.jpg"}, {"id": "1.jpg", "image": "1.jpg"}]
        ),
        NewPartition("", 0, 1, [{"id": "2.jpg", "image": "2.jpg"}]),
    ]
    m = Manifest("s-00000", "s", "folder", *found.new[0])
    listing = folder.rows(cfg, "s", m)
    assert isinstance(listing, Listing) and listing.failed == []
    assert [(r["id"], r["caption"], r["row_index"]) for r in listing.rows] == [
        ("0.jpg", "a red circle", 0),
        ("1.jpg", "a blue square", 1),
    ]
    got = list(folder.images(cfg, m, listing.rows, 10**6))
    assert [(r["id"], data) for r, data in got] == [("0.jpg", hs.jpeg(0)), ("1.jpg", hs.jpeg(1))]
    second = folder.rows(cfg, "s", Manifest("s-00001", "s", "folder", *found.new[1]))
    assert second.rows == [] and [(f["id"], f["reason"]) for f in second.failed] == [
        ("2.jpg", "missing_caption")
    ]
    pq_cfg = SourceConfig(kind="parquet", location=str(src))
    assert source_kind("parquet").scan(pq_cfg, []) == Found(
        [],
        [
            Skipped(
                "broken.parquet",
                "corrupt_container",
                "broken.parquet cannot be read as parquet: Parquet magic bytes not found in "
                "footer. Either the file is corrupted or this is not a parquet file.",
            )
        ],
    )


def test_a_unit_that_cannot_be_read_fails_each_of_its_samples_by_its_kinds_ids(tmp_path):
    """The ids of an unreadable unit's samples come from its kind (parquet: <stem>/<row>;
    the registry no longer forks on the kind's name)."""
    src, root = tmp_path / "pq", tmp_path / "data"
    src.mkdir()
    pq.write_table(
        pa.table({"image": [b"x", b"y", b"z"], "text": ["a", "b", "c"]}), src / "train.parquet"
    )
    cfg = SourceConfig(kind="parquet", location=str(src))
    (m,) = register(root, "p", cfg).new
    assert source_kind("parquet").sample_ids(m) == ["train/0", "train/1", "train/2"]
    (src / "train.parquet").write_bytes(b"gone bad")
    table, failed, _ = partition_rows(root, cfg, m.key)
    assert table.num_rows == 0
    assert [(f["id"], f["reason"]) for f in failed] == [
        (f"train/{r}", "corrupt_container") for r in range(3)
    ]
