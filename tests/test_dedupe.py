"""Global dedupe: duplicates by metadata hash and by identical bytes across three partitions give
the same kept rows, reasons and winners whatever order the partitions run in (forward, reverse,
in parallel as separate Dagster runs in separate processes)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flowmatch_assets.catalog import Catalog
from flowmatch_assets.cli.devserver import make_dagster_home
from flowmatch_assets.definitions import defs
from flowmatch_assets.defs.definitions import resources_for
from flowmatch_assets.defs.partitions import register_partitions
from flowmatch_assets.defs.resources import FlowmatchResource
from flowmatch_assets.demo.dataset import SampleSpec, write_sample
from flowmatch_assets.ingest.dedupe import build_hash_index
from flowmatch_assets.ingest.images import IngestConfig
from flowmatch_assets.ingest.metadata import FilterConfig
from tests.conftest import REPO
from tests.http_fixtures import LoopbackHTTPServer, Reply

KEYS = ["000-00", "001-00", "002-00"]


def _fake_hash(name: str) -> str:
    return hashlib.md5(f"wrong-{name}".encode()).hexdigest()


@pytest.fixture(scope="module")
def dup_dataset(tmp_path_factory):
    """Three metadata files (one partition each) served over loopback HTTP, with duplicates
    injected: by hash (across files, within a file, and one whose first row is filtered), and
    by identical bytes under a wrong hash (a chain over all three partitions, one across two,
    one within a shard). Yields (metadata folder, expected final outcome by id)."""
    base = tmp_path_factory.mktemp("dups")
    s = write_sample(base / "sample", SampleSpec(files=3, rows_per_file=5, seed=7, bad_rows=False))
    files = [pq.read_table(Path(s["metadata"]) / f"pd12m.{n:03d}.parquet") for n in range(3)]
    rows = [t.to_pylist() for t in files]
    a, b, c = (list(r) for r in rows)  # the original rows, by index (rows get inserts)
    expected = {r["id"]: ("stored", None, None) for f in rows for r in f}

    def copy(src: dict, name: str, hash_: str | None = None, caption: str | None = None):
        r = {**src, "id": f"dup-{name}", "hash": hash_ or src["hash"]}
        if caption is not None:
            r["caption"] = caption
        return r

    def after(lst: list, anchor: dict, row: dict) -> None:
        lst.insert(lst.index(anchor) + 1, row)

    # by metadata hash
    rows[1].append(copy(a[1], "b-hash-a1"))
    rows[2].append(copy(a[1], "c-hash-a1"))
    rows[2].append(copy(b[2], "c-hash-b2"))
    rows[2].append(copy(c[0], "c-hash-c0"))
    expected.update(
        {
            "dup-b-hash-a1": ("filtered", "duplicate_hash", a[1]["id"]),
            "dup-c-hash-a1": ("filtered", "duplicate_hash", a[1]["id"]),
            "dup-c-hash-b2": ("filtered", "duplicate_hash", b[2]["id"]),
            "dup-c-hash-c0": ("filtered", "duplicate_hash", c[0]["id"]),
        }
    )
    # the first row with b3's hash has an empty caption: it never shadows b3
    rows[0].insert(0, copy(b[3], "a-empty-b3", caption="  "))
    expected["dup-a-empty-b3"] = ("filtered", "caption_too_short", None)
    # by content: same bytes, wrong metadata hash
    after(rows[1], b[0], copy(a[2], "b-bytes-a2", hash_=_fake_hash("b-a2")))
    rows[2].append(copy(a[2], "c-bytes-a2", hash_=_fake_hash("c-a2")))
    rows[2].append(copy(b[4], "c-bytes-b4", hash_=_fake_hash("c-b4")))
    after(rows[1], b[1], copy(b[0], "b-bytes-b0", hash_=_fake_hash("b-b0")))
    expected.update(
        {
            "dup-b-bytes-a2": ("filtered", "duplicate_content", a[2]["id"]),
            "dup-c-bytes-a2": ("filtered", "duplicate_content", a[2]["id"]),
            "dup-c-bytes-b4": ("filtered", "duplicate_content", b[4]["id"]),
            "dup-b-bytes-b0": ("filtered", "duplicate_content", b[0]["id"]),
        }
    )
    with LoopbackHTTPServer() as srv:
        md = base / "metadata"
        md.mkdir()
        for n, lst in enumerate(rows):
            for r in lst:
                body = (Path(s["dest"]) / r["url"].removeprefix("file:")).read_bytes()
                r["url"] = srv.add(f"/{r['id']}", Reply(body=body))
            pq.write_table(
                pa.Table.from_pylist(lst, schema=files[n].schema), md / f"pd12m.{n:03d}.parquet"
            )
        yield md, expected


def _resource(data: Path, md: Path) -> FlowmatchResource:
    return FlowmatchResource(
        data_root=str(data),
        metadata_source=str(md),
        # the md5 check off: a wrong metadata hash is how the same bytes arrive twice
        ingest=IngestConfig(threads=4, allow_networks=["127.0.0.0/8"], check_hash=False),
    )


def _outcomes(data: Path) -> dict[str, tuple]:
    rows = Catalog(data).query(
        "SELECT id, outcome, reason, kept_id FROM dataset_rows ORDER BY partition, id"
    )
    return {r["id"]: (r["outcome"], r["reason"], r["kept_id"]) for r in rows}


def _sequential(data: Path, md: Path, order: list[str]) -> dict[str, tuple]:
    res = _resource(data, md)
    with dg.instance_for_test() as instance:
        register_partitions(instance, res)
        for k in order:
            result = dg.materialize(
                list(defs.assets),
                selection=["metadata", "images"],
                partition_key=k,
                instance=instance,
                resources=resources_for(res),
            )
            assert result.success
    return _outcomes(data)


def test_duplicates_are_dropped_the_same_way_in_forward_and_reverse_order(tmp_path, dup_dataset):
    md, expected = dup_dataset
    forward = _sequential(tmp_path / "fwd", md, KEYS)
    assert forward == expected
    reverse = _sequential(tmp_path / "rev", md, KEYS[::-1])
    assert reverse == forward
    # forward: the later copies never reached a shard; reverse: they were stored before their
    # winner existed, and the catalog names them (content_duplicates, still_stored)
    for root, stored_losers in ((tmp_path / "fwd", 0), (tmp_path / "rev", 3)):
        cat = Catalog(root)
        by_kind = cat.query(
            "SELECT kind, still_stored, count(*) AS n FROM duplicates GROUP BY ALL ORDER BY ALL"
        )
        assert by_kind == [
            {"kind": "content", "still_stored": False, "n": 4 - stored_losers},
            *(
                [{"kind": "content", "still_stored": True, "n": stored_losers}]
                if stored_losers
                else []
            ),
            {"kind": "hash", "still_stored": False, "n": 4},
        ]
    # docs/catalog.md's queries
    cat = Catalog(tmp_path / "rev")
    assert cat.query("SELECT kind, still_stored, count(*) FROM duplicates GROUP BY ALL")
    readme = "SELECT partition, id, outcome, reason, kept_id FROM dataset_rows WHERE reason LIKE 'duplicate%'"
    assert len(cat.query(readme)) == 8
    # in reverse order the chain's later copies (001-00, 002-00 of a2; 002-00 of b4) are stored
    rev = Catalog(tmp_path / "rev").query("SELECT id, kept_id FROM content_duplicates ORDER BY id")
    assert [r["id"] for r in rev] == ["dup-b-bytes-a2", "dup-c-bytes-a2", "dup-c-bytes-b4"]
    # forward: dropped at ingest, a row outcome of images with the winner in its detail
    fwd = Catalog(tmp_path / "fwd").query(
        "SELECT id, outcome, detail FROM rows WHERE asset = 'images' AND reason = 'duplicate_content' ORDER BY id"
    )
    assert [r["id"] for r in fwd] == sorted(
        i for i, e in expected.items() if e[1] == "duplicate_content"
    )
    assert all(r["outcome"] == "filtered" and "id " in r["detail"] for r in fwd)


@pytest.mark.slow
def test_duplicates_are_dropped_the_same_way_when_partitions_run_in_parallel(tmp_path, dup_dataset):
    """Three `dagster asset materialize` processes at once, one per partition, one sqlite
    DAGSTER_HOME and one data root: the same final outcomes as one after the other."""
    md, expected = dup_dataset
    home, data = make_dagster_home(tmp_path / "home"), tmp_path / "data"
    settings = tmp_path / "settings.yaml"
    settings.write_text("ingest: {check_hash: false}\n")  # as _resource: wrong hashes on purpose
    env = {
        **os.environ,
        "DAGSTER_HOME": str(home),
        "FLOWMATCH_DATA_ROOT": str(data),
        "FLOWMATCH_METADATA": str(md),
        "FLOWMATCH_ALLOW_NETWORKS": "127.0.0.0/8",  # the loopback image server
        "FLOWMATCH_SETTINGS": str(settings),
    }
    os.environ["DAGSTER_HOME"] = str(home)
    try:
        with dg.DagsterInstance.get() as instance:
            assert register_partitions(instance, _resource(data, md)) == KEYS
    finally:
        del os.environ["DAGSTER_HOME"]
    cmd = [sys.executable, "-m", "dagster", "asset", "materialize", "-m"]
    cmd += ["flowmatch_assets.definitions", "--select", "metadata,images"]
    procs = [
        subprocess.Popen(
            [*cmd, "--partition", k],
            env=env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for k in KEYS
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    assert _outcomes(data) == expected
    # one global hash index, built once (the others waited for it or found it)
    assert len(list((data / "dedupe").glob("*/global-*"))) == 1


def test_the_hash_index_agrees_with_a_brute_force_first_occurrence(tmp_path):
    """Random hashes over four files (with rows the filters drop): the index's winner of every
    hash is its first eligible (file, row); it is reused, and a new file changes no winner."""
    rng = np.random.default_rng(0)
    pool = [hashlib.md5(str(i).encode()).hexdigest() for i in range(60)]
    md = tmp_path / "md"
    md.mkdir()
    truth: dict[str, tuple[int, int]] = {}

    def write(n: int, rows: int) -> None:
        recs = []
        for i in range(rows):
            h = pool[int(rng.integers(len(pool)))]
            if rng.random() < 0.1:
                h = h.upper()  # same md5, other case
            small = bool(rng.random() < 0.2)
            recs.append(
                {
                    "id": f"{n}-{i}",
                    "url": "http://x/" + str(i),
                    "caption": "c",
                    "width": 100 if small else 500,
                    "height": 500,
                    "mime_type": "image/jpeg",
                    "hash": h,
                    "license": "cc0-1.0",
                    "source": "s",
                }
            )
            if not small:
                truth.setdefault(h.lower(), (n, i))
        pq.write_table(pa.Table.from_pylist(recs), md / f"pd12m.{n:03d}.parquet", row_group_size=16)

    for n in range(3):
        write(n, 50)
    data = tmp_path / "data"
    idx = build_hash_index(data, str(md), FilterConfig(), 20)
    got = {}
    for h in truth:
        f, r = idx.lookup(np.array([bytes.fromhex(h)], dtype="S16"))
        got[h] = (int(f[0]), int(r[0]))
    assert got == truth
    assert (
        idx.partition_of(*truth[pool[0]]) == f"{truth[pool[0]][0]:03d}-0{truth[pool[0]][1] // 20}"
    )
    (glob,) = (data / "dedupe").glob("*/global-*")
    again = build_hash_index(data, str(md), FilterConfig(), 20)  # reused, not rebuilt
    assert (glob / "row.npy").stat().st_mtime_ns == (glob / "row.npy").stat().st_mtime_ns
    assert len(again.keys) == len(idx.keys)
    before = dict(truth)
    write(3, 50)
    idx2 = build_hash_index(data, str(md), FilterConfig(), 20)
    for h, w in before.items():
        f, r = idx2.lookup(np.array([bytes.fromhex(h)], dtype="S16"))
        assert (int(f[0]), int(r[0])) == w
    assert not glob.exists()  # the old file list's index was replaced


def test_the_hash_index_is_readable_by_the_group_that_shares_the_data_root(tmp_path):
    """Under ``umask 002`` (a team on one box) every file and folder of the index has the mode a
    plain write would give; the global index's folder used to be tempfile's 0700."""
    md = tmp_path / "md"
    md.mkdir()
    recs = [
        {
            "id": f"0-{i}",
            "url": f"http://x/{i}",
            "caption": "c",
            "width": 500,
            "height": 500,
            "mime_type": "image/jpeg",
            "hash": hashlib.md5(str(i % 7).encode()).hexdigest(),
            "license": "cc0-1.0",
            "source": "s",
        }
        for i in range(20)
    ]
    pq.write_table(pa.Table.from_pylist(recs), md / "pd12m.000.parquet")
    old = os.umask(0o002)
    try:
        build_hash_index(tmp_path / "data", str(md), FilterConfig(), 10)
    finally:
        os.umask(old)
    made = list((tmp_path / "data" / "dedupe").rglob("*"))
    assert any(p.name.startswith("global-") for p in made)
    modes = {str(p.relative_to(tmp_path)): p.stat().st_mode & 0o777 for p in made}
    want = {k: 0o775 if (tmp_path / k).is_dir() else 0o664 for k in modes}
    assert modes == want
