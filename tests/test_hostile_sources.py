"""A downloaded dataset is untrusted input: hostile copies of the three source kinds and PD12M
rows pointing at loopback addresses, through the real CLI, Dagster instance and DuckDB catalog
(tests/hostile_sources.py writes them). Every row ends with the outcome and reason it should,
no byte from outside a source (or from a loopback service) reaches a shard, a caption or the
catalog, every step ends within its deadline (a FIFO would block forever), a broken source
never stops the others, and sources and orphan partitions can be managed."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq
import pytest

from flowmatch_assets.catalog import Catalog
from flowmatch_assets.cli import main as cli_main
from flowmatch_assets.ingest.fetch import fetch_bytes
from flowmatch_assets.ingest.images import IngestConfig, IngestError
from tests import hostile_sources as hs
from tests.http_fixtures import LoopbackHTTPServer, Reply

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def env(tmp_path, zoo, monkeypatch):
    """A data root and Dagster instance for the CLI, the zoo's encoders, tight limits."""
    home = tmp_path / "dagster_home"
    home.mkdir()
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    settings = tmp_path / "settings.yaml"
    settings.write_text(f"ingest: {{max_bytes: {hs.MAX_BYTES}}}\n")
    values = {
        "FLOWMATCH_DATA_ROOT": str(tmp_path / "data"),
        "DAGSTER_HOME": str(home),
        "FLOWMATCH_VAE": zoo["vae"],
        "FLOWMATCH_DINO": zoo["dino"],
        "FLOWMATCH_TEXT": zoo["text"],
        "FLOWMATCH_METADATA": str(tmp_path / "metadata"),
        "FLOWMATCH_FILE_ROOT": str(tmp_path / "pd12m_images"),
        "FLOWMATCH_SETTINGS": str(settings),
        "FLOWMATCH_DEADLINE_S": "10",
        "FLOWMATCH_MIN_STORED_FRACTION": "0",
    }
    for k, v in values.items():
        monkeypatch.setenv(k, v)
    for var in ("FLOWMATCH_SOURCES", "FLOWMATCH_ALLOW_NETWORKS"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path


def _cli(capsys, rc: int, *argv: str) -> tuple[str, str]:
    capsys.readouterr()
    got = cli_main(list(argv))
    out = capsys.readouterr()
    assert got == rc, (argv, out.out[-3000:], out.err[-3000:])
    assert "Traceback" not in out.err
    return out.out, out.err


def _permissions_enforced() -> list[str] | None:
    """A command prefix under which chmod 000 files cannot be read: none needed for a normal
    user; as root, capsh without the capabilities that override file permissions; None when
    neither is possible (the unreadable cases are then left out)."""
    if os.geteuid() != 0:
        return []
    if shutil.which("capsh"):
        return ["capsh", "--drop=cap_dac_override,cap_dac_read_search", "--", "-c"]
    return None


def _materialize_subprocess(prefix: list[str], *args: str) -> tuple[int, str, float]:
    """`flowmatch materialize ARGS` in its own process (under ``prefix``); rc, output, seconds."""
    cmd = [sys.executable, "-m", "flowmatch_assets.cli", "materialize", *args]
    if prefix:
        cmd = [*prefix, " ".join(f"'{c}'" for c in cmd)]
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    return p.returncode, p.stdout + p.stderr, time.monotonic() - t0


def _final(cat: Catalog, source: str) -> dict[str, str]:
    rows = cat.query(
        "SELECT id, outcome, reason FROM dataset_rows WHERE source_of(partition) = ?", [source]
    )
    return {
        r["id"]: r["outcome"] + (f":{r['reason']}" if r["outcome"] != "stored" else "")
        for r in rows
    }


def _no_secret_anywhere(data: Path, secret_md5s: set[str]) -> int:
    """No marker in any file under the data root (raw bytes, and every parquet's values), and no
    stored image with a secret picture's md5; returns how many files were checked."""
    n = 0
    for f in data.rglob("*"):
        if not f.is_file():
            continue
        n += 1
        raw = f.read_bytes()
        for m in hs.MARKERS:
            assert m not in raw, f"{m!r} in {f}"
        if f.suffix == ".parquet":
            values = repr(pq.read_table(f).to_pylist())
            for m in hs.MARKERS:
                assert m.decode() not in values, f"{m!r} in the values of {f}"
            if f.parent == data / "images":
                md5s = set(pq.read_table(f, columns=["md5"]).column("md5").to_pylist())
                assert not md5s & secret_md5s, f"a picture from outside in {f}"
    return n


@pytest.mark.slow
def test_hostile_sources_stay_confined_bounded_and_isolated(env, capsys):
    tmp = env
    outside = hs.write_outside(tmp)
    prefix = _permissions_enforced()
    expected = {
        "evil": hs.write_folder(tmp / "evil", outside["image"].parent, prefix is not None),
        "good": {},
    }
    expected["evilpq"], skip_pq, later_pq = hs.write_parquet(
        tmp / "evilpq", outside["image"].parent
    )
    expected["evilwds"], skip_wds, later_tar = hs.write_webdataset(
        tmp / "evilwds", outside["image"].parent
    )
    (tmp / "good").mkdir()
    for i in range(3):
        (tmp / "good" / f"g{i}.jpg").write_bytes(hs.jpeg(80 + i))
        (tmp / "good" / f"g{i}.txt").write_text(f"a healthy picture {i}")
        expected["good"][f"g{i}.jpg"] = "stored"
    secret_md5s = {hashlib.md5(outside["image"].read_bytes()).hexdigest()}
    secret_md5s |= {hashlib.md5(hs.jpeg(s)).hexdigest() for s in (997, 998)}

    with LoopbackHTTPServer() as srv, LoopbackHTTPServer(host="127.0.0.2") as other:
        token = Reply(body=hs.TOKEN.encode(), headers={"Content-Type": "image/jpeg"})
        ok = Reply(body=hs.jpeg(90), headers={"Content-Type": "image/jpeg"})
        other.add("/x.jpg", ok)
        urls = {
            "lo_token": srv.add("/token", token),
            "lo_ok": srv.add("/ok.jpg", ok),
            "lo_name": f"http://localhost:{srv.port}/token",
            "lo_v6": f"http://[::1]:{srv.port}/token",
            "lo_redirect": srv.add(
                "/redirect", Reply(status=302, headers={"Location": other.url("/x.jpg")})
            ),
        }
        expected["pd12m"] = hs.write_pd12m(tmp / "metadata", tmp / "pd12m_images", urls)
        expected["pd12m"] |= dict.fromkeys(urls, "failed:private_address")

        # ---- sources you can manage: what does not exist and what exists already are refused
        add = ["sources", "add"]
        _, err = _cli(
            capsys, 2, *add, "nope", "--kind", "folder", "--location", str(tmp / "nowhere")
        )
        assert "does not exist" in err and len(err.strip().splitlines()) == 1
        for name, kind, extra in [
            ("evil", "folder", []),
            ("evilpq", "parquet", []),
            ("evilwds", "webdataset", []),
            ("good", "folder", []),
            ("gone", "folder", ["--allow-missing"]),
        ]:
            _cli(capsys, 0, *add, name, "--kind", kind, "--location", str(tmp / name), *extra)
        _, err = _cli(capsys, 2, *add, "good", "--kind", "folder", "--location", str(tmp / "evil"))
        assert "source good exists" in err and "--replace" in err

        # ---- registration: what is readable is registered, what is not is one line with why
        out, err = _cli(capsys, 0, "partitions", "register")
        assert out.strip() == (
            "registered 10 new partitions: 000-00, evil-00000, evilpq-00000, evilpq-00001, "
            "evilpq-00002, evilpq-00003, evilpq-00004, evilwds-00000, evilwds-00001, good-00000"
        )
        assert len(err.strip().splitlines()) == 1 and err.startswith("flowmatch: skipped")
        for name, skipped in (("evilpq", skip_pq), ("evilwds", skip_wds)):
            for f, reason in skipped.items():
                assert f"{name}: {f} ({reason}:" in err, (f, err)
        assert f"gone: source location {str(tmp / 'gone')!r} does not exist" in err
        _, err = _cli(capsys, 2, "partitions", "register", "--source", "gone")
        assert "does not exist" in err and len(err.strip().splitlines()) == 1

        # ---- files that break after registration; then every partition, within its deadline
        hs.break_parquet(later_pq)
        hs.cut(later_tar)
        rc, log, seconds = _materialize_subprocess(prefix or [], "-a", "metadata", "-a", "images")
        assert rc == 0 and log.count(" ok (") == 10 and "Traceback" not in log, log
        assert seconds < 180, seconds  # a FIFO read would block until the test's timeout
        assert sum(srv.hits(p) for p in ("/token", "/ok.jpg", "/redirect")) == 0  # nothing sent

    cat = Catalog(tmp / "data")
    for source, want in expected.items():
        assert _final(cat, source) == want, source
    details = cat.query("SELECT reason, detail FROM failures WHERE source_of(partition) != 'x'")
    assert details and not any("starts with" in (r["detail"] or "") for r in details)
    assert _no_secret_anywhere(tmp / "data", secret_md5s) > 40

    # ---- the healthy source in full, while the others are broken; it reads no other source
    index = tmp / "data" / "sources" / "evilwds" / "index.json"
    before = index.read_text()
    shutil.copy(tmp / "evilwds" / "shard#1.tar", tmp / "evilwds" / "new.tar")
    out, _ = _cli(capsys, 0, "materialize", "--source", "good")
    assert out.count(" ok (") == 1, out
    assert index.read_text() == before  # evilwds was not scanned: new.tar is not registered
    cov = {r["partition"]: r for r in cat.coverage()}
    assert cov["good-00000"]["text_embeddings"] == cov["good-00000"]["images"] == 3

    # ---- the sensor keeps working for every source beside a missing one
    (tmp / "good" / "g9.jpg").write_bytes(hs.jpeg(89))
    (tmp / "good" / "g9.txt").write_text("a late picture")
    from flowmatch_assets.definitions import defs
    from flowmatch_assets.defs.partitions import SHARDS
    from flowmatch_assets.defs.resources import resource_from_env

    with dg.DagsterInstance.get() as instance:
        sensor = defs.get_sensor_def("source_partition_sensor")
        ctx = dg.build_sensor_context(
            instance=instance, resources={"flowmatch": resource_from_env()}
        )
        (req,) = sensor(ctx).dynamic_partitions_requests
        assert req.partition_keys == ["evilwds-00002", "good-00001"]
        instance.add_dynamic_partitions(SHARDS, list(req.partition_keys))

    # ---- following links is an opt-in, per source; only regular files are read even then
    linked = tmp / "linked"
    linked.mkdir()
    os.symlink(outside["image"], linked / "out.jpg")
    (linked / "out.txt").write_text("a picture outside, by choice")
    os.symlink("/dev/zero", linked / "zero.jpg")
    (linked / "zero.txt").write_text("still not a file")
    _cli(capsys, 0, *add, "linked", "--kind", "folder", "--location", str(linked), "--follow-links")
    out, _ = _cli(capsys, 0, "materialize", "--source", "linked", "-a", "metadata", "-a", "images")
    assert _final(cat, "linked") == {"out.jpg": "stored", "zero.jpg": "failed:not_regular_file"}

    # ---- removing sources: one with made files only with --purge, which deletes them
    _cli(capsys, 0, "sources", "remove", "gone")
    _, err = _cli(capsys, 2, "sources", "remove", "linked")
    assert "--purge" in err
    out, _ = _cli(capsys, 0, "sources", "remove", "linked", "--purge")
    assert out.startswith("source linked removed: 1 partitions") and "files deleted" in out
    assert not list((tmp / "data").rglob("linked-00000*"))
    assert "linked" not in (tmp / "data" / "sources.yaml").read_text()

    # ---- a key with no data behind it (added by hand in the UI) is listed and removed
    with dg.DagsterInstance.get() as instance:
        instance.add_dynamic_partitions(SHARDS, ["handmade-00000"])
    out, _ = _cli(capsys, 0, "partitions", "list")
    assert "handmade-00000  ?  no data behind it" in out and "ORPHAN" in out
    assert "linked-00000" not in out
    _, err = _cli(capsys, 2, "partitions", "remove", "-p", "good-00000")
    assert "has data behind it" in err
    out, _ = _cli(capsys, 0, "partitions", "remove", "--orphans")
    assert out.strip() == "removed 1 partitions: handmade-00000"
    with dg.DagsterInstance.get() as instance:
        assert "handmade-00000" not in instance.get_dynamic_partitions(SHARDS)


# ------------------------------------------------------------------------ public addresses only


@pytest.mark.parametrize(
    "ip, why",
    [
        ("127.0.0.1", "loopback"),
        ("10.1.2.3", "private"),
        ("172.16.0.1", "private"),
        ("192.168.1.1", "private"),
        ("169.254.169.254", "link-local"),
        ("100.64.0.1", "not public"),
        ("224.0.0.1", "multicast"),
        ("0.0.0.0", "unspecified"),
        ("::1", "loopback"),
        ("::ffff:127.0.0.1", "loopback"),
        ("::ffff:169.254.169.254", "link-local"),
        ("fe80::1", "link-local"),
        ("fc00::1", "private"),
        ("2002:7f00:1::1", "loopback"),
        ("8.8.8.8", None),
        ("93.184.216.34", None),
        ("2606:4700:4700::1111", None),
    ],
)
def test_which_addresses_are_refused(ip, why):
    import ipaddress

    from flowmatch_assets.ingest.fetch import address_refusal

    assert address_refusal(ipaddress.ip_address(ip)) == why
    allowed = [ipaddress.ip_network("10.0.0.0/8"), ipaddress.ip_network("::1/128")]
    if ip in ("10.1.2.3", "::1"):
        assert address_refusal(ipaddress.ip_address(ip), allowed) is None


def test_non_public_addresses_are_never_sent_a_byte():
    """Loopback is refused by default (nothing reaches the server), fetched when its network is
    allowed, and a redirect from an allowed host to a refused one is refused again."""
    with LoopbackHTTPServer() as a, LoopbackHTTPServer(host="127.0.0.2") as b:
        body = hs.jpeg(1)
        b.add("/x.jpg", Reply(body=body))
        a.add("/x.jpg", Reply(body=body))
        a.add("/to-b", Reply(status=302, headers={"Location": b.url("/x.jpg")}))
        with pytest.raises(IngestError) as e:
            fetch_bytes(a.url("/x.jpg"), IngestConfig(retries=0))
        assert e.value.reason == "private_address" and "127.0.0.1 (loopback)" in e.value.detail
        assert a.hits("/x.jpg") == 0
        allow_a = IngestConfig(retries=0, allow_networks=["127.0.0.1/32"])
        assert fetch_bytes(a.url("/x.jpg"), allow_a) == body
        with pytest.raises(IngestError) as e:
            fetch_bytes(a.url("/to-b"), allow_a)
        assert e.value.reason == "private_address" and "127.0.0.2" in e.value.detail
        assert a.hits("/to-b") == 1 and b.hits("/x.jpg") == 0
        both = IngestConfig(retries=0, allow_networks=["127.0.0.0/8"])
        assert fetch_bytes(a.url("/to-b"), both) == body


def test_a_body_that_is_not_an_image_is_described_never_quoted():
    from flowmatch_assets.ingest.decode import describe_bytes, process_image

    for body, kind in [
        (b"<!DOCTYPE html><p>secret-123</p>", "HTML"),
        (b"secret-123 token", "text"),
        (b"\x00\x01secret-123\xff", "binary data"),
        (b'{"token": "secret-123"}', "JSON-like text"),
    ]:
        with pytest.raises(IngestError) as e:
            process_image(body, IngestConfig())
        assert e.value.reason == "not_image" and e.value.detail == describe_bytes(body)
        assert e.value.detail.startswith(f"{kind}, {len(body)} bytes (md5 ")
        assert "secret" not in e.value.detail


def test_config_refuses_a_bad_network():
    with pytest.raises(ValueError, match="not a network"):
        IngestConfig(allow_networks=["10.0.0.0/33"])


def test_sources_file_records_follow_links_only_when_on(tmp_path):
    from flowmatch_assets.ingest.sources import SourceConfig

    off = SourceConfig(kind="folder", location=str(tmp_path))
    assert "follow_links" not in off.row_fields()  # sources made before it stay fresh
    on = SourceConfig(kind="folder", location=str(tmp_path), follow_links=True)
    assert on.row_fields()["follow_links"] is True


def test_manifest_from_before_is_still_confined(tmp_path):
    """A manifest written elsewhere (or before the checks) naming ``../`` or an absolute path
    is refused when read, not only when registered."""
    from flowmatch_assets.ingest.sources import SourceConfig
    from flowmatch_assets.ingest.sources.registry import Manifest, source_kind

    outside = hs.write_outside(tmp_path)
    src = tmp_path / "src"
    src.mkdir()
    cfg = SourceConfig(kind="folder", location=str(src))
    m = Manifest(
        "x-00000",
        "x",
        "folder",
        "",
        0,
        2,
        [
            {"id": "a", "image": "../outside/secret.jpg"},
            {"id": "b", "image": str(outside["image"])},
        ],
    )
    folder = source_kind("folder")
    listing = folder.rows(cfg, "x", m)
    listed, failed = listing.rows, listing.failed
    assert listed == [] and [f["reason"] for f in failed] == ["outside_source"] * 2
    got = list(folder.images(cfg, m, [{"id": "a", "url": "../outside/secret.jpg"}], 10**6))
    assert isinstance(got[0][1], IngestError) and got[0][1].reason == "outside_source"
    assert json.dumps([f["detail"] for f in failed]).count(hs.SECRET) == 0
