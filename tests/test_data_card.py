"""Data cards: per partition (asset + picture) and for the whole dataset (catalog view, CLI),
on the embedded sample with its injected bad rows, in a real Dagster instance and DuckDB file."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import dagster as dg
import numpy as np
import pyarrow.parquet as pq
from transformers import AutoTokenizer

from flowmatch_assets import cli
from flowmatch_assets.catalog import Catalog
from flowmatch_assets.defs.definitions import all_assets_and_checks, resources_for
from flowmatch_assets.defs.partitions import register_partitions
from flowmatch_models.encoders.spec import EncoderSpec
from flowmatch_models.storage.store import read_shard
from tests.conftest import make_resource

MAX_TOKENS = 22  # the sample's good captions are 19-28 zoo tokens: some are cut short


def _card(cat: Catalog, scope: str) -> dict[tuple[str, str], dict]:
    rows = cat.query("SELECT section, item, value, share FROM data_card WHERE scope = ?", [scope])
    return {(r["section"], r["item"]): r for r in rows}


def test_data_card_counts_what_was_injected_per_partition_and_for_the_dataset(
    tmp_path, small_sample, zoo, monkeypatch, capsys
):
    data = tmp_path / "data"
    res = make_resource(
        data, small_sample, encoders=EncoderSpec(**zoo, batch_size=8, max_tokens=MAX_TOKENS)
    )
    keys = ["000-00", "001-00"]
    with dg.instance_for_test() as instance:
        register_partitions(instance, res)
        for k in keys:
            result = dg.materialize(
                all_assets_and_checks(),
                selection=["metadata", "images", "text_embeddings", "data_card"],
                partition_key=k,
                instance=instance,
                resources=resources_for(res),
            )
            assert result.success
        md = result.asset_materializations_for_node("data_card")[0].metadata
        assert "data:image/jpeg;base64" in md["card"].value
        assert Path(md["card_png"].value).exists()
        whole = dg.materialize(
            all_assets_and_checks(),
            selection=["dataset_card"],
            instance=instance,
            resources=resources_for(res),
        )
        assert whole.success
        # the dataset's totals where a user lands: failed and filtered apart, every partition
        md = whole.asset_materializations_for_node("dataset_card")[0].metadata
        outcomes = Counter(o.split(":")[0] for o in small_sample["expected_outcomes"].values())
        assert md["failed_rows"].value == outcomes["failed"] > 0
        assert md["filtered_rows"].value == outcomes["filtered"] > 0
        assert md["stored_rows"].value == outcomes["stored"]

    cat = Catalog(data)
    expected = small_sample["expected_outcomes"]
    tok = AutoTokenizer.from_pretrained(zoo["text"])
    totals = Counter()
    for k in keys:
        n = int(k[:3])
        meta = pq.read_table(Path(small_sample["metadata"]) / f"pd12m.{n:03d}.parquet").to_pylist()
        want = Counter(
            "stored" if expected[r["id"]] == "stored" else expected[r["id"]] for r in meta
        )
        card = _card(cat, k)
        got = {i: int(r["value"]) for (s, i), r in card.items() if s == "outcome"}
        assert got == dict(want)  # every injected failure and filter, by reason
        assert card[("rows", "input")]["value"] == len(meta)
        stored = [r for r in meta if expected[r["id"]] == "stored"]
        licenses = Counter(r["license"] for r in stored)
        assert {i: r["value"] for (s, i), r in card.items() if s == "license"} == licenses
        assert sum(r["share"] for (s, _), r in card.items() if s == "source") == 1.0
        chars = [len(r["caption"].strip()) for r in stored]
        assert card[("caption_chars", "max")]["value"] == max(chars)
        assert card[("caption_chars", "p50")]["value"] == np.quantile(chars, 0.5)
        tokens = [len(tok(r["caption"].lower())["input_ids"]) for r in stored]
        assert card[("caption_tokens", "max")]["value"] == max(tokens)
        over = sum(t > MAX_TOKENS for t in tokens)
        assert 0 < over < len(stored)
        assert card[("text", "captions_over_max_tokens")]["value"] == over
        sat = read_shard(data / "text_embeddings" / f"{k}.fms").attrs["fp16_saturated"]
        assert card[("text", "fp16_saturated_values")]["value"] == sat
        # decoded original sizes of the stored rows
        shard = pq.read_table(data / "images" / f"{k}.parquet").to_pylist()
        long_sides = [max(r["orig_width"], r["orig_height"]) for r in shard]
        assert card[("orig_long_side", "max")]["value"] == max(long_sides)
        aspects = sum(r["value"] for (s, _), r in card.items() if s == "aspect")
        assert aspects == len(shard)
        totals.update(got)
    whole = _card(cat, "dataset")
    assert {i: int(r["value"]) for (s, i), r in whole.items() if s == "outcome"} == dict(totals)
    assert (data / "reports" / "data_card.png").exists()
    page = cat.query("SELECT * FROM data_card WHERE scope = 'dataset' ORDER BY section_order")
    assert [r["section"] for r in page][0] == "rows" and page[-1]["section"] == "text"

    for k, v in {
        "DAGSTER_HOME": str(tmp_path),
        "FLOWMATCH_TEXT": zoo["text"],
        "FLOWMATCH_DATA_ROOT": str(data),
        "FLOWMATCH_METADATA": small_sample["metadata"],
    }.items():
        monkeypatch.setenv(k, v)
    capsys.readouterr()
    assert cli.main(["data-card", "--no-refresh"]) == 0
    out = capsys.readouterr().out
    assert "## Data card: the whole dataset" in out and "failed:not_image" in out
    assert cli.main(["data-card", "-p", "001-00"]) == 0  # re-draws one partition, then the whole
    out = capsys.readouterr().out
    assert "data_card 001-00: ok" in out and "dataset_card: ok" in out
