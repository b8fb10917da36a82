"""PD12M metadata: schema validation, shard keys and ranges, filters (pure functions)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flowmatch_assets.ingest.metadata import (
    PD12M_COLUMNS,
    FilterConfig,
    MetadataError,
    discover_shards,
    filter_rows,
    read_metadata_shard,
)


def _rows(n: int, **over) -> list[dict]:
    rows = []
    for i in range(n):
        r = {
            "id": f"id-{i}",
            "url": f"https://example.org/{i}.jpg",
            "caption": f"a picture number {i}",
            "width": 1600,
            "height": 1200,
            "mime_type": "image/jpeg",
            "hash": f"h{i}",
            "license": "cc0-1.0",
            "source": "test",
        }
        r.update({k: v(i) if callable(v) else v for k, v in over.items()})
        rows.append(r)
    return rows


def _write(folder, number: int, rows: list[dict], row_group_size: int = 7):
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(
        pa.Table.from_pylist(rows),
        folder / f"pd12m.{number:03d}.parquet",
        row_group_size=row_group_size,
    )


def test_one_file_becomes_several_stable_sorted_shards(tmp_path):
    _write(tmp_path, 0, _rows(25))
    _write(tmp_path, 7, _rows(10))
    (tmp_path / "notes.txt").write_text("not metadata")
    specs = discover_shards(str(tmp_path), shard_size=10)
    assert [s.key for s in specs] == ["000-00", "000-01", "000-02", "007-00"]
    assert [(s.row_start, s.row_end) for s in specs] == [(0, 10), (10, 20), (20, 25), (0, 10)]
    table, spec = read_metadata_shard(str(tmp_path), "000-01", 10)
    assert table.column("id").to_pylist() == [f"id-{i}" for i in range(10, 20)]
    assert table.column("row_index").to_pylist() == list(range(10, 20))
    last, _ = read_metadata_shard(str(tmp_path), "000-02", 10)
    assert last.num_rows == 5


@pytest.mark.parametrize("missing", ["url", "caption", "hash"])
def test_missing_column_is_a_clear_error(tmp_path, missing):
    rows = [{k: v for k, v in r.items() if k != missing} for r in _rows(3)]
    _write(tmp_path, 0, rows)
    with pytest.raises(MetadataError, match=f"missing column '{missing}'") as e:
        discover_shards(str(tmp_path), 10)
    assert "pd12m.000.parquet" in str(e.value)


def test_wrong_type_and_bad_key_and_out_of_range(tmp_path):
    _write(tmp_path, 0, _rows(3, width="wide"))
    with pytest.raises(MetadataError, match="'width' has type string"):
        discover_shards(str(tmp_path), 10)
    _write(tmp_path, 0, _rows(3))
    with pytest.raises(MetadataError, match="NNN-KK"):
        read_metadata_shard(str(tmp_path), "zero", 10)
    with pytest.raises(MetadataError, match="shard_size"):
        read_metadata_shard(str(tmp_path), "000-05", 10)
    with pytest.raises(MetadataError, match="no metadata file number 3"):
        read_metadata_shard(str(tmp_path), "003-00", 10)
    with pytest.raises(MetadataError, match="does not exist"):
        discover_shards(str(tmp_path / "nope"), 10)


@pytest.mark.parametrize(
    "override, cfg, reason",
    [
        ({"width": 100}, FilterConfig(), "small_original"),
        ({"width": 4000, "height": 1000}, FilterConfig(max_aspect_ratio=3.0), "aspect_ratio"),
        ({"caption": "  "}, FilterConfig(), "caption_too_short"),
        ({"caption": "x" * 50}, FilterConfig(max_caption_chars=20), "caption_too_long"),
        ({"license": "cc-by-nc"}, FilterConfig(licenses=["cc0-1.0"]), "license"),
        ({"url": ""}, FilterConfig(), "missing_url"),
        ({"caption": "red  square"}, FilterConfig(min_caption_words=3), "caption_too_few_words"),
    ],
)
def test_each_filter_counts_its_reason(override, cfg, reason):
    rows = _rows(4)
    rows[1].update(override)
    kept, filtered = filter_rows(pa.Table.from_pylist(rows), cfg)
    assert kept.column("id").to_pylist() == ["id-0", "id-2", "id-3"]
    assert [(f["id"], f["reason"]) for f in filtered] == [("id-1", reason)]
    assert filtered[0]["detail"]


def test_duplicate_hash_keeps_the_first_and_every_row_has_one_outcome():
    rows = _rows(6, hash=lambda i: f"h{i % 2}")
    kept, filtered = filter_rows(pa.Table.from_pylist(rows), FilterConfig())
    assert kept.column("id").to_pylist() == ["id-0", "id-1"]
    assert {f["reason"] for f in filtered} == {"duplicate_hash"}
    assert kept.num_rows + len(filtered) == len(rows)
    kept, filtered = filter_rows(
        pa.Table.from_pylist(rows), FilterConfig(drop_duplicate_hash=False)
    )
    assert kept.num_rows == 6 and not filtered


def test_sample_is_real_pd12m_format(small_sample):
    specs = discover_shards(small_sample["metadata"], 10_000)
    assert [s.key for s in specs] == ["000-00", "001-00"]
    t = pq.read_table(specs[0].path)
    assert t.column_names == list(PD12M_COLUMNS)
    # long side 1,000-3,000 px for the good rows
    good = [r for r in t.to_pylist() if small_sample["expected_outcomes"][r["id"]] == "stored"]
    assert all(1000 <= max(r["width"], r["height"]) <= 3000 for r in good)


def test_filters_by_column_agree_with_the_row_by_row_definition():
    """The column-wise pass that keeps most rows (issue 28: the hash index filters every row of
    PD12M) keeps exactly the rows the row-by-row definition keeps, odd values included."""
    import random

    from flowmatch_assets.ingest.metadata import _row_reason

    rnd = random.Random(3)
    odd_text = ["", " ", "\u3000x", "x\u2029", "x\x1f", "\tok", "ok\n", "é", "ok", "a b", None]
    rows = []
    for i in range(3000):
        rows.append(
            {
                "id": f"id-{i}",
                "hash": None,
                "url": rnd.choice([f"https://x/{i}.jpg", *odd_text]),
                "caption": rnd.choice(
                    [
                        "a small red square",
                        "x" * rnd.randint(0, 30),
                        "two  words ",
                        "a\x1cb",
                        "a\u00a0b c",
                        *odd_text,
                    ]
                ),
                "width": rnd.choice([None, 0, 1, 255, 256, 257, 768, 769, 2000, 3000]),
                "height": rnd.choice([None, 0, 1, 255, 256, 257, 768, 2000, 1000]),
                "license": rnd.choice(["cc0-1.0", "other", None]),
            }
        )
    for cfg in (
        FilterConfig(),
        FilterConfig(
            licenses=["cc0-1.0"], max_caption_chars=20, min_caption_chars=3, max_aspect_ratio=2.0
        ),
        FilterConfig(min_caption_words=2),
    ):
        allowed = set(cfg.licenses) if cfg.licenses is not None else None
        want = [
            r["id"]
            for r in rows
            if _row_reason(
                r["url"], r["width"], r["height"], r["caption"], r["license"], cfg, allowed
            )
            is None
        ]
        kept, filtered = filter_rows(pa.Table.from_pylist(rows), cfg)
        assert kept.column("id").to_pylist() == want
        assert len(filtered) == len(rows) - len(want) > 100


def test_min_caption_words_joins_the_fingerprint_only_when_set():
    """Off (0), the filters' fingerprint and dedupe digest are those of the settings before the
    field existed, so nothing made earlier turns stale; set, they change."""
    from flowmatch_assets.ingest.dedupe import filters_digest
    from flowmatch_assets.ingest.metadata import filter_fields

    assert "min_caption_words" not in filter_fields(FilterConfig())
    assert filter_fields(FilterConfig(min_caption_words=3))["min_caption_words"] == 3
    assert filters_digest(FilterConfig()) != filters_digest(FilterConfig(min_caption_words=3))
