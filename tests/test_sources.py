"""Your own images as sources, through the real CLI, a real Dagster instance and DuckDB file:
an image folder (sidecars, metadata.jsonl, nested folders), Hugging Face-style parquet and
img2dataset WebDataset tars made from scikit-image's bundled photos, each with broken entries.
Every sample ends with exactly the outcome and reason it should (stored, failed, filtered), the
stored ones have their embeddings, the three sources share one instance and catalog with PD12M
untouched, new files become new partitions (and only those), and a changed source setting makes
exactly that source's partitions stale."""

from __future__ import annotations

import functools
import http.server
import json
import shutil
import threading
from collections import Counter

import dagster as dg
import pyarrow.parquet as pq
import pytest

from flowmatch_assets.catalog import Catalog
from flowmatch_assets.cli import main as cli_main
from flowmatch_models.storage.store import read_shard
from tests.byo_data import (
    encode,
    photo,
    readme_commands,
    write_folder,
    write_parquet,
    write_webdataset,
)

EMB = ("vae_latents", "dino_features", "text_embeddings")


@pytest.fixture
def byo_env(tmp_path, zoo, monkeypatch):
    """A data root and Dagster instance for the CLI, the zoo's encoders, no PD12M metadata."""
    monkeypatch.setenv("FLOWMATCH_DATA_ROOT", str(tmp_path / "data"))
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster_home"))
    monkeypatch.setenv("FLOWMATCH_VAE", zoo["vae"])
    monkeypatch.setenv("FLOWMATCH_DINO", zoo["dino"])
    monkeypatch.setenv("FLOWMATCH_TEXT", zoo["text"])
    for var in ("FLOWMATCH_SOURCES", "FLOWMATCH_SETTINGS", "FLOWMATCH_METADATA"):
        monkeypatch.delenv(var, raising=False)
    (tmp_path / "dagster_home").mkdir()
    (tmp_path / "dagster_home" / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    return tmp_path


def _cli(capsys, *argv: str) -> str:
    capsys.readouterr()
    rc = cli_main(list(argv))
    out = capsys.readouterr()
    assert rc == 0, out.out[-2000:] + out.err[-2000:]
    return out.out


def _final(cat: Catalog, source: str) -> dict[str, str]:
    """``{id: outcome[:reason]}`` of every input row of a source (the dataset_rows view)."""
    rows = cat.query(
        "SELECT id, outcome, reason FROM dataset_rows WHERE source_of(partition) = ?", [source]
    )
    return {
        r["id"]: r["outcome"] + (f":{r['reason']}" if r["outcome"] != "stored" else "")
        for r in rows
    }


@pytest.mark.slow
def test_three_source_kinds_through_the_cli(byo_env, capsys):
    """docs/own-images.md's commands as written (the paths under /data/ moved to the
    test's folder), then what they must have done."""
    tmp = byo_env
    expected = {
        "photos": write_folder(tmp / "my_photos"),
        "hf": write_parquet(tmp / "my_hf_dataset"),
        "wds": write_webdataset(tmp / "my_img2dataset_output"),
    }
    outs = []
    for argv in readme_commands("docs/own-images.md", "your-own-images"):
        outs.append(_cli(capsys, *[a.replace("/data/", f"{tmp}/") for a in argv]))
    listed, new, registered_photos, registered, materialized = outs[3:8]
    assert "photos  folder" in listed and "hf  parquet" in listed and "caption 'caption'" in listed
    # list showed what register would add; register --source added only that source's
    assert new.count("NEW") == 5 and "photos-00000  photos  rows [0, 19)" in new
    assert registered_photos.strip() == "registered 1 new partitions: photos-00000"
    assert (
        registered.strip()
        == "registered 4 new partitions: hf-00000, hf-00001, wds-00000, wds-00001"
    )
    assert _cli(capsys, "partitions", "register").strip() == "registered 0 new partitions"
    assert materialized.count(" ok (") == 5, materialized  # never a crashed partition

    cat = Catalog(tmp / "data")
    for source, want in expected.items():
        assert _final(cat, source) == want, source
    # failures by reason, per source, in the catalog's failures view (the guide's query)
    rows = cat.query("SELECT source, reason, count(*) AS n FROM failures GROUP BY ALL")
    got = {(r["source"], r["reason"]): r["n"] for r in rows}
    want = Counter(
        (s, o.split(":", 1)[1]) for s, e in expected.items() for o in e.values() if ":" in o
    )
    assert got == dict(want)
    assert got[("photos", "missing_caption")] == got[("wds", "missing_image")] == 1
    assert "| photos | images | failed | corrupt | 1 |" in outs[8]
    # coverage: every stored row has its 256px image and all three embeddings, aligned
    for part in cat.query("SELECT partition FROM partitions WHERE source != 'pd12m'"):
        p = part["partition"]
        stored = [
            r["id"]
            for r in cat.query(
                "SELECT id FROM dataset_rows WHERE partition = ? AND outcome = 'stored'", [p]
            )
        ]
        shard = pq.read_table(tmp / "data" / "images" / f"{p}.parquet")
        assert sorted(shard.column("id").to_pylist()) == sorted(stored), p
        for kind in EMB:
            assert (
                read_shard(tmp / "data" / kind / f"{p}.fms").ids == shard.column("id").to_pylist()
            )
    captions = dict(
        zip(
            *(
                pq.read_table(
                    tmp / "data" / "images" / "wds-00001.parquet", columns=["id", "caption"]
                )
                .to_pydict()
                .values()
            )
        )
    )
    assert captions["000010002"] == "a close-up of gravel"  # the caption only in its .json
    coverage = {r["partition"]: r for r in cat.coverage()}
    assert sorted(coverage) == ["hf-00000", "hf-00001", "photos-00000", "wds-00000", "wds-00001"]
    for p, r in coverage.items():  # catalog coverage = what the shards hold
        n = len(read_shard(tmp / "data" / "vae_latents" / f"{p}.fms").ids)
        assert r["images"] == r["text_embeddings"] == n > 0
    assert _cli(capsys, "stale", "--no-report").startswith("nothing stale")
    # the data card of a source's partition: every sample, its outcome, caption and license
    _cli(capsys, "data-card", "-p", "photos-00000")
    card = cat.query(
        "SELECT id, outcome, reason, caption_chars, license, source FROM "
        "data_card_rows WHERE partition = 'photos-00000'"
    )
    assert {
        r["id"]: r["outcome"] + (f":{r['reason']}" if r["reason"] else "") for r in card
    } == expected["photos"]
    assert {r["source"] for r in card} == {"photos"}
    assert next(r for r in card if r["id"] == "chelsea.jpg")["caption_chars"] == 31

    # new files become new partitions; the registered ones keep what they hold
    before = json.loads((tmp / "data" / "sources" / "photos" / "index.json").read_text())
    (tmp / "my_photos" / "new").mkdir()
    (tmp / "my_photos" / "new" / "rocket2.jpg").write_bytes(encode(photo("rocket"), quality=70))
    (tmp / "my_photos" / "new" / "rocket2.txt").write_text("a rocket again")
    wds = tmp / "my_img2dataset_output"
    shutil.copy(wds / "00000.tar", wds / "00002.tar")
    out = _cli(capsys, "partitions", "register")
    assert out.strip() == "registered 2 new partitions: photos-00001, wds-00002"
    after = json.loads((tmp / "data" / "sources" / "photos" / "index.json").read_text())
    assert after[:1] == before and after[1]["end"] == 1
    # the sensor finds the next one in the same way
    hf = tmp / "my_hf_dataset" / "data"
    shutil.copy(hf / "train-00001-of-00002.parquet", hf / "extra.parquet")
    from flowmatch_assets.definitions import defs
    from flowmatch_assets.defs.partitions import SHARDS
    from flowmatch_assets.defs.resources import resource_from_env

    with dg.DagsterInstance.get() as instance:
        sensor = defs.get_sensor_def("source_partition_sensor")
        ctx = dg.build_sensor_context(
            instance=instance, resources={"flowmatch": resource_from_env()}
        )
        (req,) = sensor(ctx).dynamic_partitions_requests
        assert req.partition_keys == ["hf-00002"]
        instance.add_dynamic_partitions(SHARDS, list(req.partition_keys))

    # a copied tar's samples are the same bytes as the first tar's: content duplicates
    _cli(capsys, "materialize", "-p", "wds-00002", "-a", "metadata", "-a", "images")
    rows = cat.query(
        "SELECT outcome, reason, count(*) AS n FROM dataset_rows "
        "WHERE partition = 'wds-00002' GROUP BY ALL"
    )
    assert {(r["outcome"], r["reason"]): r["n"] for r in rows} == {
        ("filtered", "duplicate_content"): 7
    }

    # a changed source setting: exactly that source's partitions are stale, and say why
    sources = tmp / "data" / "sources.yaml"
    sources.write_text(sources.read_text().replace("caption_field: caption", "caption_field: text"))
    stale = json.loads(_cli_rc(capsys, 1, "stale", "--no-report", "--json"))
    parts = {s["partition"] for s in stale if s["asset"] == "metadata"}
    assert parts == {"hf-00000", "hf-00001"}
    assert "source_settings.caption_field: caption -> text" in stale[0]["reason"]
    # a misconfigured source fails its partition with one line that names the fix
    capsys.readouterr()
    assert cli_main(["materialize", "-p", "hf-00000", "-a", "metadata"]) == 1
    assert "has no column 'text'" in capsys.readouterr().out


def _cli_rc(capsys, rc: int, *argv: str) -> str:
    capsys.readouterr()
    assert cli_main(list(argv)) == rc
    return capsys.readouterr().out


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *a) -> None:  # noqa: D401 - keep test output clean
        pass


@pytest.mark.slow
def test_parquet_and_tars_over_http(byo_env, capsys, monkeypatch):
    """Any fsspec URL: the parquet and tar sources from a loopback HTTP server that (like
    many) answers no range requests (allowed: a remote location meets the downloads' address
    policy)."""
    tmp = byo_env
    monkeypatch.setenv("FLOWMATCH_ALLOW_NETWORKS", "127.0.0.1/32")
    exp_hf = write_parquet(tmp / "site" / "hf", files=1, by_idx=True)
    exp_wds = write_webdataset(tmp / "site" / "wds", tars=1)
    handler = functools.partial(_Quiet, directory=str(tmp / "site"))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        _cli(
            capsys,
            "sources",
            "add",
            "web",
            "--kind",
            "parquet",
            "--location",
            f"{url}/hf/",
            "--caption-field",
            "caption",
            "--id-field",
            "idx",
        )
        _cli(capsys, "sources", "add", "tars", "--kind", "webdataset", "--location", f"{url}/wds/")
        out = _cli(capsys, "partitions", "register")
        assert "registered 2 new partitions: tars-00000, web-00000" in out
        out = _cli(
            capsys,
            "materialize",
            "--source",
            "web",
            "--source",
            "tars",
            "-a",
            "metadata",
            "-a",
            "images",
        )
        assert out.count(" ok (") == 2, out
    finally:
        server.shutdown()
        server.server_close()
    cat = Catalog(tmp / "data")
    assert _final(cat, "web") == exp_hf
    assert _final(cat, "tars") == exp_wds
