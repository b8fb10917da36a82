"""A URL list as a source (kind ``urls``, flowmatch_assets/ingest/sources/urls.py): an
img2dataset-style CSV of URLs on a loopback HTTP server, added and registered through the real
CLI, materialized metadata -> images -> text_embeddings in a real Dagster instance; the images
are downloaded as PD12M's are (the address policy included). And the list formats img2dataset
reads (tsv.gz, jsonl, parquet) with their own column names."""

from __future__ import annotations

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flowmatch_assets.catalog import Catalog
from flowmatch_assets.cli import main as cli_main
from flowmatch_assets.ingest.decode import process_image
from flowmatch_assets.ingest.sources import SourceConfig, source_kind
from flowmatch_models.storage.store import read_shard
from tests.byo_data import encode, photo
from tests.http_fixtures import LoopbackHTTPServer, Reply
from tests.test_sources import _cli, byo_env  # noqa: F401 - byo_env: the fixture

PICTURES = {"cat.jpg": "chelsea", "coffee.jpg": "coffee", "rocket.jpg": "rocket"}


@pytest.fixture
def urls_env(byo_env, monkeypatch):  # noqa: F811 - test_sources' fixture, imported
    """test_sources' data root and Dagster instance, and no ingest.allow_networks."""
    monkeypatch.delenv("FLOWMATCH_ALLOW_NETWORKS", raising=False)
    return byo_env


def _outcomes(cat: Catalog) -> dict[str, str]:
    rows = cat.query(
        "SELECT id, outcome, reason FROM dataset_rows WHERE source_of(partition) = ?", ["mylist"]
    )
    return {
        r["id"]: r["outcome"] + (f":{r['reason']}" if r["outcome"] != "stored" else "")
        for r in rows
    }


def test_a_url_list_is_downloaded_through_the_address_policy(urls_env, capsys, monkeypatch):
    tmp = urls_env
    served = {name: encode(photo(p)) for name, p in PICTURES.items()}
    with LoopbackHTTPServer() as srv:
        url = {
            n: srv.add(f"/{n}", Reply(body=b, headers={"Content-Type": "image/jpeg"}))
            for n, b in served.items()
        }
        lines = [
            "url,caption",
            f"{url['cat.jpg']},a cat on a rug",
            f"{url['coffee.jpg']},a cup",
            f"{srv.url('/gone.jpg')},a picture that is not there",
            f"{url['rocket.jpg']},",
            f"{url['rocket.jpg']},a rocket on its pad",
        ]
        (tmp / "list.csv").write_text("\n".join(lines) + "\n")
        _cli(
            capsys,
            "sources",
            "add",
            "mylist",
            "--kind",
            "urls",
            "--location",
            str(tmp / "list.csv"),
        )
        assert "registered 1 new partitions: mylist-00000" in _cli(capsys, "partitions", "register")

        # no ingest.allow_networks: the loopback server is not a public address
        _cli(capsys, "materialize", "-p", "mylist-00000", "-a", "metadata")
        assert cli_main(["materialize", "-p", "mylist-00000", "-a", "images"]) == 1
        blocked = _outcomes(Catalog(tmp / "data"))
        assert blocked == {
            "list/0": "pending:None",
            "list/1": "pending:None",
            "list/2": "pending:None",
            "list/3": "failed:missing_caption",
            "list/4": "pending:None",
        }
        rows = Catalog(tmp / "data").query(
            "SELECT reason, count(*) AS n FROM rejected_attempts GROUP BY reason"
        )
        assert {r["reason"]: r["n"] for r in rows} == {"private_address": 4}

        monkeypatch.setenv("FLOWMATCH_ALLOW_NETWORKS", "127.0.0.1/32")
        out = _cli(
            capsys,
            "materialize",
            "-p",
            "mylist-00000",
            "-a",
            "metadata",
            "-a",
            "images",
            "-a",
            "text_embeddings",
        )
        assert " ok (" in out, out
        # the list itself behind a URL (allowed: the same address policy)
        srv.add("/list.csv", Reply(body=(tmp / "list.csv").read_bytes()))
        _cli(capsys, "sources", "add", "web", "--kind", "urls", "--location", srv.url("/list.csv"))
        assert "web-00000" in _cli(capsys, "partitions", "register", "--source", "web")
        _cli(capsys, "materialize", "-p", "web-00000", "-a", "metadata")
    cat = Catalog(tmp / "data")
    assert _outcomes(cat) == {
        "list/0": "stored",
        "list/1": "stored",
        "list/2": "failed:http_404",
        "list/3": "failed:missing_caption",
        "list/4": "stored",
    }
    listed = cat.query("SELECT id, outcome FROM dataset_rows WHERE partition = 'web-00000'")
    assert sorted((r["id"], r["outcome"]) for r in listed) == [
        ("list/0", "pending"),
        ("list/1", "pending"),
        ("list/2", "pending"),
        ("list/3", "failed"),
        ("list/4", "pending"),
    ]
    rows = cat.query(
        "SELECT reason, count(*) AS n FROM failures WHERE source = 'mylist' GROUP BY ALL"
    )
    assert {r["reason"]: r["n"] for r in rows} == {"http_404": 1, "missing_caption": 1}

    from flowmatch_assets.defs.resources import resource_from_env

    ingest = resource_from_env().ingest
    shard = pq.read_table(tmp / "data" / "images" / "mylist-00000.parquet").to_pylist()
    assert [s["id"] for s in shard] == ["list/0", "list/1", "list/4"]
    for s, name in zip(shard, ["cat.jpg", "coffee.jpg", "rocket.jpg"]):  # the served, resized
        assert s["image"] == process_image(served[name], ingest)[0], name
    assert [s["caption"] for s in shard] == ["a cat on a rug", "a cup", "a rocket on its pad"]
    assert read_shard(tmp / "data" / "text_embeddings" / "mylist-00000.fms").ids == [
        "list/0",
        "list/1",
        "list/4",
    ]


def test_list_formats_and_column_names(tmp_path):
    """tsv.gz, jsonl and parquet lists, columns named as the settings say; a hash column is
    carried to the row (the images stage checks it)."""
    rows = [
        ("http://h/a.jpg", "first", "aa"),
        ("", "no url", "bb"),
        ("http://h/c.png", None, "cc"),
        ("http://h/d.jpg", "fourth", "dd"),
    ]
    d = tmp_path / "lists"
    d.mkdir()
    tsv = "URL\tTEXT\tMD5\n" + "".join(f"{u}\t{c or ''}\t{h}\n" for u, c, h in rows)
    (d / "a.tsv.gz").write_bytes(gzip.compress(tsv.encode()))
    (d / "b.jsonl").write_text(
        "".join(json.dumps({"URL": u, "TEXT": c, "MD5": h}) + "\n" for u, c, h in rows)
        + "not json\n"
    )
    pq.write_table(
        pa.table(
            {"URL": [r[0] for r in rows], "TEXT": [r[1] for r in rows], "MD5": [r[2] for r in rows]}
        ),
        d / "c.parquet",
    )
    (d / "notes.txt").write_text("not a list")
    cfg = SourceConfig(
        kind="urls",
        location=str(d),
        url_field="URL",
        caption_field="TEXT",
        hash_field="MD5",
        shard_size=3,
    )
    kind = source_kind("urls")
    assert kind.downloads
    found = kind.scan(cfg, [])
    assert [(p.unit, p.start, p.end) for p in found.new] == [
        ("a.tsv.gz", 0, 3),
        ("a.tsv.gz", 3, 4),
        ("b.jsonl", 0, 3),
        ("b.jsonl", 3, 5),
        ("c.parquet", 0, 3),
        ("c.parquet", 3, 4),
    ]
    from flowmatch_assets.ingest.sources import Manifest

    for unit, stem in [("a.tsv.gz", "a"), ("b.jsonl", "b"), ("c.parquet", "c")]:
        listed = [
            kind.rows(cfg, "l", Manifest("k", "l", "urls", unit, s, e))
            for s, e in [(0, 3), (3, 5 if unit == "b.jsonl" else 4)]
        ]
        got = [
            (r["id"], r["url"], r["caption"], r["hash"], r["row_index"])
            for x in listed
            for r in x.rows
        ]
        assert got == [
            (f"{stem}/0", "http://h/a.jpg", "first", "aa", 0),
            (f"{stem}/3", "http://h/d.jpg", "fourth", "dd", 0),
        ], unit
        reasons = {f["id"]: f["reason"] for x in listed for f in x.failed}
        want = {f"{stem}/1": "missing_url", f"{stem}/2": "missing_caption"}
        assert reasons == want | ({"b/4": "bad_metadata"} if stem == "b" else {}), unit
    wrong = cfg.model_copy(update={"url_field": "link"})
    with pytest.raises(ValueError, match="no column 'link'"):
        kind.rows(wrong, "l", Manifest("k", "l", "urls", "c.parquet", 0, 3))


def test_the_url_list_benchmark_registers_every_row_of_both_formats():
    """`flowmatch bench url_list` (BENCHMARKS.md, URL lists) on a small list: every row of the
    jsonl and the .tsv.gz registered, each timed beside the plain read of the same file."""
    from flowmatch_assets.bench import url_list

    out = url_list.main(["--rows", "5000", "--shard-size", "1000"])
    assert out["bench"] == "url_list" and out["rows"] == 5000
    for fmt in ("jsonl", "tsv_gz"):
        r = out[fmt]
        assert r["bytes"] > 5000 * 40 // (20 if fmt == "tsv_gz" else 1), r
        assert r["register_s"] > 0 and r["plain_read_s"] > 0 and r["ratio"] > 0
        assert abs(r["ratio"] - r["register_s"] / r["plain_read_s"]) < 0.1 * r["ratio"] + 0.05
        assert abs(r["pd12m_register_s"] - r["register_s"] * 12_400_000 / 5000) <= 1
