"""A downloaded dataset is untrusted input, part 2 (issue 36): what tests/test_hostile_sources.py
left open. Special-purpose address blocks refused on every Python version, PD12M's md5 checked,
decode time and memory bounded whatever a file claims (memory measured in a subprocess), reads
confined against pseudo-filesystems and races, credentials in a location redacted, and remote
sources behind the downloads' address guard. Each test fails on the code before issue 36."""

from __future__ import annotations

import hashlib
import ipaddress
import json
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flowmatch_assets.catalog import Catalog
from flowmatch_assets.ingest.fetch import address_refusal, fetch_bytes
from flowmatch_assets.ingest.images import IngestConfig, IngestError
from tests import hostile_sources as hs
from tests.http_fixtures import LoopbackHTTPServer, Reply
from tests.test_hostile_sources import _cli, _final, env  # noqa: F401 - env is a fixture

# ------------------------------------------------------------------------ special-purpose blocks


@pytest.mark.parametrize(
    "ip, why",
    [
        ("192.0.0.192", "special-purpose"), ("192.0.0.170", "special-purpose"),
        ("168.63.129.16", "cloud service"), ("::ffff:192.0.0.192", "special-purpose"),
        ("64:ff9b::a9fe:a9fe", "link-local"), ("192.31.196.1", "special-purpose"),
        ("192.175.48.1", "special-purpose"), ("3fff::1", "documentation"),
        ("2001:db8::1", "documentation"), ("192.0.2.1", "documentation"),
        ("255.255.255.255", "reserved"), ("fd00:ec2::254", "private"),
        ("168.63.129.17", None), ("192.0.1.1", None), ("8.8.8.8", None),
    ],
)  # fmt: skip
def test_special_purpose_blocks_are_refused_on_every_python(ip, why):
    assert address_refusal(ipaddress.ip_address(ip)) == why


@pytest.mark.parametrize("host", ["192.0.0.192", "168.63.129.16", "[64:ff9b::c000:c0]"])
def test_special_purpose_hosts_fail_before_connecting(host):
    """The guard refuses these before a socket exists (no packet leaves this machine)."""
    with pytest.raises(IngestError) as e:
        fetch_bytes(f"http://{host}/latest/meta-data/", IngestConfig(retries=0, deadline_s=2))
    assert e.value.reason == "private_address"


# ------------------------------------------------------------------------ PD12M's md5, checked


def _pd12m(md_dir: Path, rows: list[dict]) -> None:
    md_dir.mkdir(parents=True, exist_ok=True)
    for r in rows:
        r.setdefault("hash", None)
        r.setdefault("caption", f"a picture called {r['id']}")
        r.update(width=1024, height=768, mime_type="image/jpeg", license="cc0", source="test")
    pq.write_table(pa.Table.from_pylist(rows), md_dir / "pd12m.000.parquet")


def test_a_url_that_serves_other_bytes_than_pd12m_hashed_is_hash_mismatch(
    env,  # noqa: F811 - the fixture
    capsys,
    monkeypatch,
):
    """PD12M's ``hash`` is the image's md5: bytes that decode but differ (a CDN placeholder, a
    replaced file) are the permanent reason hash_mismatch, counted in the catalog, `catalog
    failures` and the data card; a row without an md5 is not checked; ingest.check_hash off
    stores them."""
    real, placeholder = hs.jpeg(11), hs.jpeg(12)
    with LoopbackHTTPServer() as srv:
        rows = [
            {"id": "right", "url": srv.add("/a.jpg", Reply(body=real)),
             "hash": hashlib.md5(real).hexdigest().upper()},
            {"id": "replaced", "url": srv.add("/b.jpg", Reply(body=placeholder)),
             "hash": hashlib.md5(hs.jpeg(13)).hexdigest()},
            {"id": "nohash", "url": srv.add("/c.jpg", Reply(body=hs.jpeg(14)))},
            {"id": "nomd5", "url": srv.add("/d.jpg", Reply(body=hs.jpeg(15))), "hash": "h-1"},
            {"id": "html", "url": srv.add("/e.jpg", Reply(body=b"<html>moved</html>")),
             "hash": hashlib.md5(hs.jpeg(16)).hexdigest()},
        ]  # fmt: skip
        _pd12m(env / "metadata", rows)
        monkeypatch.setenv("FLOWMATCH_ALLOW_NETWORKS", "127.0.0.1/32")
        _cli(capsys, 0, "partitions", "register")
        _cli(capsys, 0, "materialize", "-a", "metadata", "-a", "images")
        cat = Catalog(env / "data")
        assert _final(cat, "pd12m") == {
            "right": "stored", "replaced": "failed:hash_mismatch", "nohash": "stored",
            "nomd5": "stored", "html": "failed:not_image",
        }  # fmt: skip
        (detail,) = [r["detail"] for r in cat.query("SELECT detail FROM failures WHERE reason = 'hash_mismatch'")]  # fmt: skip
        assert hashlib.md5(placeholder).hexdigest() in detail
        out, _ = _cli(capsys, 0, "catalog", "failures", "--json")
        got = [r for r in json.loads(out) if r["reason"] == "hash_mismatch"]
        assert [(r["asset"], r["retryable"], r["rows"]) for r in got] == [("images", False, 1)]
        out, _ = _cli(capsys, 0, "retry", "-p", "000-00")
        assert srv.hits("/b.jpg") == 1  # permanent: not fetched again
        out, _ = _cli(capsys, 0, "data-card", "--json")
        card, _ = json.JSONDecoder().raw_decode(out[out.index("\n[") + 1 :])
        outcome = {r["item"]: r["value"] for r in card if r["section"] == "outcome"}
        assert outcome == {"stored": 3, "failed:hash_mismatch": 1, "failed:not_image": 1}

        (env / "settings.yaml").write_text(
            f"ingest: {{max_bytes: {hs.MAX_BYTES}, check_hash: false}}\n"
        )
        _cli(capsys, 0, "materialize", "-a", "images")
        assert _final(cat, "pd12m")["replaced"] == "stored"


# ------------------------------------------------------------------------ decode time


def test_a_progressive_jpeg_of_thousands_of_scans_is_refused_before_decoding():
    """3,000 scans of a 4000 x 4000 picture (156 KB) decoded for 76 s before (2 busy cores);
    the scans are counted first: too_many_scans at once. Ordinary progressive JPEGs pass."""
    from flowmatch_assets.ingest.decode import jpeg_scans, process_image

    bomb = hs.scan_bomb((4000, 4000), 3000)
    assert len(bomb) < 200_000 and jpeg_scans(bomb, 10**6) == 3000
    t0 = time.monotonic()
    with pytest.raises(IngestError) as e:
        process_image(bomb, IngestConfig())
    assert time.monotonic() - t0 < 0.5
    assert e.value.reason == "too_many_scans" and "max_jpeg_scans 100" in e.value.detail
    assert jpeg_scans(hs.scan_bomb((400, 300), 100), 10**6) == 100
    image, w, h = process_image(hs.scan_bomb((400, 300), 100), IngestConfig())
    assert (w, h) == (400, 300) and image[:3] == b"\xff\xd8\xff"
    assert jpeg_scans(hs.jpeg(1), 10**6) == 1
