"""A downloaded dataset is untrusted input, part 3 (issue 45): every way a location or a list
reaches the network or the memory goes through one guard. One allow-list of location schemes
(no fsspec chains), s3 endpoints behind the downloads' address guard, parquet footers and list
files never trusted for memory or work, a bad list row costing its own row, deadlines on remote
list reads. Each test failed on the code before issue 45."""

from __future__ import annotations

import contextlib
import socket
import threading

import pytest

from flowmatch_assets.defs.resources import resource_from_env
from flowmatch_assets.ingest.sources import SourceError
from tests.http_fixtures import LoopbackHTTPServer, Reply
from tests.test_hostile_sources import _cli, env  # noqa: F401 - env is a fixture


class CountingListener:
    """A TCP listener on 127.0.0.2 that counts the connections it is offered (and closes each):
    the proof that a refused location never connected anywhere."""

    def __init__(self, host: str = "127.0.0.2") -> None:
        self.sock = socket.socket()
        self.sock.bind((host, 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            self.connections += 1
            with contextlib.suppress(OSError):
                conn.close()

    def __enter__(self) -> CountingListener:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


def _locations(http: str, tcp: int) -> dict[str, str]:
    """Each hostile location and the words its refusal must hold."""
    return {
        f"simplecache::{http}src/": "chains filesystems (simplecache::",
        f"async_wrapper::{http}src/": "chains filesystems (async_wrapper::",
        f"filecache::{http}src/": "chains filesystems (filecache::",
        f"blockcache::{http}src/": "chains filesystems (blockcache::",
        f"dir::{http}src/": "chains filesystems (dir::",
        f"reference://::{http}ref.json": "chains filesystems (reference::",
        f"tar://a.jpg::{http}a.tar": "--kind webdataset",
        f"webhdfs://127.0.0.2:{tcp}/x": "scheme 'webhdfs' is not allowed",
        f"ftp://user:Pw0rd-s3cret@127.0.0.2:{tcp}/x": "scheme 'ftp' is not allowed",
        "tar:///tmp/a.tar": "--kind webdataset",
        f"jupyter://127.0.0.2:{tcp}/x": "scheme 'jupyter' is not allowed",
        " /tmp/with-a-space": "white space",
    }


def test_every_location_outside_the_scheme_allow_list_is_refused_wherever_it_enters(
    env,  # noqa: F811
    capsys,
    monkeypatch,
):
    """Fsspec chains, wrappers and schemes that connect where no guard holds (ftp, webhdfs,
    jupyter, tar, data) are refused in one line naming the scheme, by `sources add`, the
    sources file, the launchpad's `sources` override and PD12M's metadata_source, and nothing
    ever connects: the internal http host gets no request, the TCP listener no connection."""
    with LoopbackHTTPServer(host="127.0.0.2") as internal, CountingListener() as tcp:
        internal.add("/src/", Reply(body=b'<a href="a.jpg">a.jpg</a>'))
        internal.add("/src/a.jpg", Reply(body=b"INTERNAL-BODY"))
        hostile = _locations(internal.url("/"), tcp.port)
        sources = env / "sources.yaml"
        for loc, words in hostile.items():
            _, err = _cli(capsys, 2, "sources", "add", "s", "--kind", "folder", "--location", loc)
            assert words in err, (loc, err)
            assert len(err.strip().splitlines()) == 1, err
            assert "Pw0rd-s3cret" not in err
            # the same location written into the sources file by hand
            sources.write_text(f"sources:\n  s: {{kind: folder, location: {loc!r}}}\n")
            monkeypatch.setenv("FLOWMATCH_SOURCES", str(sources))
            _, err = _cli(capsys, 2, "partitions", "register")
            assert words in err and "Pw0rd-s3cret" not in err, (loc, err)
            monkeypatch.delenv("FLOWMATCH_SOURCES")
            # the launchpad's (or a settings file's) override of a source
            with pytest.raises(Exception, match="not allowed|white space"):
                resource_from_env(overrides={"sources": {"s": {"kind": "folder", "location": loc}}})
            # PD12M's metadata location
            with pytest.raises(Exception, match="not allowed|white space"):
                resource_from_env(overrides={"metadata_source": loc})
        assert internal.hits("/src/") == internal.hits("/src/a.jpg") == 0
        assert not internal._hits, internal._hits
        assert tcp.connections == 0
    # the schemes that are allowed still are
    for ok in ("/tmp/x", "file:///tmp/x", "http://127.0.0.1/x/", "https://h/x", "s3://b/x"):
        with contextlib.suppress(SourceError):
            res = resource_from_env(
                overrides={"sources": {"s": {"kind": "folder", "location": ok}}}
            )
            assert res.sources["s"].location == ok


def test_an_s3_endpoint_on_an_internal_address_is_refused_before_connecting(
    env,  # noqa: F811
    capsys,
    monkeypatch,
):
    """`s3://` locations go through the same socket guard as http: with the endpoint variable
    pointing at an internal address, `sources add` is refused naming the address, nothing
    connects, and the secret key is never printed. Allowing that network lets it connect."""
    with CountingListener() as tcp:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.2:{tcp.port}")
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "flowmatch-test")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "S3-SECRET-never-printed")
        monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
        monkeypatch.setenv("FLOWMATCH_ALLOW_NETWORKS", "127.0.0.1/32")
        add = ["sources", "add", "b", "--kind", "folder", "--location", "s3://bucket/photos/"]
        _, err = _cli(capsys, 2, *add)
        assert "127.0.0.2 (loopback)" in err, err
        assert "S3-SECRET" not in err and len(err.strip().splitlines()) == 1
        assert tcp.connections == 0
        # the guard is what refused: with the network allowed, the client does connect
        monkeypatch.setenv("FLOWMATCH_ALLOW_NETWORKS", "127.0.0.0/8")
        monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
        capsys.readouterr()
        from flowmatch_assets.cli import main as cli_main

        assert cli_main(add) == 2  # the listener closes every connection: not an s3 service
        assert tcp.connections >= 1


_REGISTER = """
import sys
sys.stderr = sys.stdout  # the skip lines, with the rest of the output
from flowmatch_assets.cli import main
sys.exit(main(["partitions", "register"]))
"""


def _many_rows_few_bytes(path, n: int, columns: dict[str, object]) -> None:
    """A real parquet file of ``n`` rows, each column one repeated value (dictionary-encoded
    and run-length packed: ~150 KB for 20M rows): what a hostile footer claims, made honestly."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    idx = pa.array(np.zeros(n, dtype=np.int8))
    table = pa.table(
        {k: pa.DictionaryArray.from_arrays(idx, pa.array([v])) for k, v in columns.items()}
    )
    pq.write_table(table, path, row_group_size=n)


def test_a_parquet_footer_claiming_more_rows_than_bytes_registers_nothing(env, monkeypatch):  # noqa: F811
    """A 150 KB parquet claiming 20M rows, as a `urls` list and as a `parquet` source: both
    skipped at `partitions register` with the claim in the line, no partition file written,
    quickly and in bounded memory (before: 20,000 partitions of each; 10^10 rows: GBs and
    574k files until killed)."""
    import time

    from flowmatch_assets.ingest import sources as src
    from tests import hostile_sources as hs
    from tests.test_hostile_bounds import _peak_rss

    n = 20_000_000
    (env / "hf").mkdir()
    _many_rows_few_bytes(env / "list.parquet", n, {"url": "http://x/a.jpg", "caption": "a cat"})
    _many_rows_few_bytes(env / "hf" / "d.parquet", n, {"image": hs.jpeg(1), "text": "a cat"})
    sources = env / "sources.yaml"
    sources.write_text(
        "sources:\n"
        f"  lst: {{kind: urls, location: {env / 'list.parquet'}}}\n"
        f"  hf: {{kind: parquet, location: {env / 'hf'}}}\n"
    )
    monkeypatch.setenv("FLOWMATCH_SOURCES", str(sources))
    t0 = time.monotonic()
    peak, out = _peak_rss(_REGISTER, timeout=120)
    took = time.monotonic() - t0
    size = (env / "list.parquet").stat().st_size
    assert f"claims {n} rows in {size} bytes" in out, out
    assert "d.parquet claims 20000000 rows" in out, out
    data = env / "data"
    assert src.registered(data, "lst") == [] and src.registered(data, "hf") == []
    assert took < 60 and peak < 1.5e9, (took, peak)


_LIST_MEMORY = """
import sys
from flowmatch_assets.ingest.sources import SourceConfig, registry, source_kind
cfg = SourceConfig(kind="urls", location=sys.argv[1], shard_size=10_000)
kind = source_kind("urls")
def status(key):  # kB in /proc/self/status
    line = next(x for x in open("/proc/self/status") if x.startswith(key + ":"))
    return int(line.split()[1]) * 1024
open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) starts again from here
before = status("VmRSS")
scan = registry.register(sys.argv[2], "lst", cfg)
last = registry.manifest(sys.argv[2], scan.new[-1].key)
listing = kind.rows(cfg, "lst", last)
after = status("VmHWM")
print(len(scan.new), last.start, len(listing.rows), listing.rows[-1]["url"], after - before)
"""


@pytest.mark.parametrize("suffix", [".tsv.gz", ".jsonl"])
def test_a_url_list_is_streamed_once_and_each_partition_reads_its_own_stretch(tmp_path, suffix):
    """A ~40 MB list (500,000 rows): registering it and listing its last partition grow the
    process by less than 64 MB (before: the whole list parsed at registration and again for
    every partition: hundreds of MB each time, 1.85-4.4 GB a partition at 10M rows)."""
    import gzip
    import json

    from tests.test_hostile_bounds import _MEASURE  # noqa: F401 - the same subprocess pattern

    n = 500_000
    pad = "x" * 40
    if suffix == ".jsonl":
        text = "".join(
            json.dumps({"url": f"http://h/{i}.jpg", "caption": f"picture {i} {pad}"}) + "\n"
            for i in range(n)
        )
        data = text.encode()
    else:
        text = "url\tcaption\n" + "".join(
            f"http://h/{i}.jpg\tpicture {i} {pad}\n" for i in range(n)
        )
        data = gzip.compress(text.encode(), compresslevel=1)
    path = tmp_path / f"list{suffix}"
    path.write_bytes(data)
    assert len(text) > 35_000_000
    import subprocess
    import sys

    p = subprocess.run(
        [sys.executable, "-c", _LIST_MEMORY, str(path), str(tmp_path / "data")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    parts, start, rows, last_url, grew = p.stdout.split()
    assert (int(parts), int(start), int(rows)) == (50, 490_000, 10_000)
    assert last_url == f"http://h/{n - 1}.jpg"
    print(f"{suffix}: grew {int(grew) / 2**20:.1f} MB")
    assert int(grew) < 64 << 20, f"grew {int(grew) >> 20} MB"


def test_a_bad_row_costs_its_own_row(env, capsys):  # noqa: F811
    """A csv list with a row of the wrong width, a csv error, a byte that is not UTF-8 and a
    field above 128 KiB: exactly those rows fail with their reasons, every other row is listed
    (a caption of terminal escapes too, as data), and no output holds a raw escape (before:
    the whole file was skipped, uncounted, its skip line printing the row's escapes)."""
    from flowmatch_assets.catalog import Catalog
    from tests.test_hostile_sources import _final

    lines = [
        b"url,caption",
        b"http://127.0.0.1:9/0.jpg,a good row",
        b"http://127.0.0.1:9/1.jpg,too,many,fields",
        b'http://127.0.0.1:9/2.jpg,"a quote that "never" closes right',
        b"http://127.0.0.1:9/3.jpg,not utf-8 \xff\xfe here",
        b"http://127.0.0.1:9/4.jpg," + b"y" * (200 << 10),
        b"http://127.0.0.1:9/5.jpg,\x1b[31mred\x07 bell",
        b"http://127.0.0.1:9/6.jpg,the last good row",
    ]
    (env / "lst").mkdir()
    (env / "lst" / "l\x1b[2J.csv").write_bytes(b"\n".join(lines) + b"\n")
    _cli(capsys, 0, "sources", "add", "lst", "--kind", "urls", "--location", str(env / "lst"))
    out, err = _cli(capsys, 0, "partitions", "register")
    assert "skipped" not in out + err
    out2, err2 = _cli(capsys, 0, "materialize", "--source", "lst", "-a", "metadata")
    got = _final(Catalog(env / "data"), "lst")
    stem = "l\x1b[2J"
    assert {k: v for k, v in got.items() if v.startswith("failed")} == {
        f"{stem}/1": "failed:bad_row",
        f"{stem}/3": "failed:not_utf8",
        f"{stem}/4": "failed:field_too_large",
    }, got
    # the unclosed quote is Python csv's to judge: it reads the rest of the line as the field
    assert set(got) == {f"{stem}/{i}" for i in range(7)}
    for text in (out, err, out2, err2):
        assert "\x1b" not in text and "\x07" not in text


def test_a_remote_list_that_trickles_is_ended_by_its_deadline(env, capsys, monkeypatch):  # noqa: F811
    """A list served one byte a second: `partitions register` ends within seconds of the
    source's deadline_s with the file skipped as `timeout` (before: ~231 s of register, the
    same again at materialize)."""
    import time

    with LoopbackHTTPServer() as srv:
        srv.add(
            "/list.csv",
            Reply(body=b"url,caption\nhttp://h/a.jpg,a", content_length=-1, trickle_s=1.0),
        )
        monkeypatch.setenv("FLOWMATCH_ALLOW_NETWORKS", "127.0.0.1/32")
        add = ["sources", "add", "slow", "--kind", "urls", "--location", srv.url("/list.csv")]
        _cli(capsys, 0, *add, "--deadline-s", "3", "--allow-missing")
        t0 = time.monotonic()
        out, err = _cli(capsys, 0, "partitions", "register")
        took = time.monotonic() - t0
    assert "timeout" in err, (out, err)
    assert took < 20, took


def test_the_jpeg_scan_count_resynchronises_as_the_decoder_does():
    """600 scans behind a comment segment and a stray byte after the first scan: libjpeg skips
    the byte and decodes every scan (PIL opens it whole), and the counter now does the same
    (before: it stopped at the byte and counted 1 scan, and the file decoded for minutes)."""
    import io

    from PIL import Image

    from flowmatch_assets.ingest.decode import process_image
    from flowmatch_assets.ingest.images import IngestConfig, IngestError
    from flowmatch_assets.ingest.jpeg_markers import jpeg_scans
    from tests import hostile_sources as hs

    bomb = hs.scan_bomb((400, 300), 600)
    first = bomb.index(b"\xff\xda")
    second = bomb.index(b"\xff\xda", first + 2)
    hostile = bomb[:second] + b"\xff\xfe\x00\x05abc" + b"\x42" + b"\xff\x00" + bomb[second:]
    Image.open(io.BytesIO(hostile)).load()  # the decoder reads past the junk
    assert jpeg_scans(hostile, 10**6) == 600
    with pytest.raises(IngestError) as e:
        process_image(hostile, IngestConfig())
    assert e.value.reason == "too_many_scans"


def test_a_gzip_compressed_tar_registers_its_samples(env, capsys):  # noqa: F811
    """A WebDataset shard compressed with gzip (img2dataset can write them): its 3 samples
    register (before: refused, its members' offsets compared with the compressed size)."""
    import gzip
    import io
    import tarfile

    from flowmatch_assets.ingest import sources as src
    from tests import hostile_sources as hs

    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for i in range(3):
            for name, data in ((f"{i:05d}.jpg", hs.jpeg(i)), (f"{i:05d}.txt", b"a caption")):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    (env / "wds").mkdir()
    (env / "wds" / "00000.tar").write_bytes(gzip.compress(raw.getvalue()))
    _cli(capsys, 0, "sources", "add", "w", "--kind", "webdataset", "--location", str(env / "wds"))
    out, err = _cli(capsys, 0, "partitions", "register")
    assert "skipped" not in out + err, (out, err)
    parts = src.registered(env / "data", "w")
    assert sum(p["end"] - p["start"] for p in parts) == 3


def test_a_linked_location_is_followed_as_given_not_frozen_to_its_target(env, capsys):  # noqa: F811
    """A location that is a link (a `current` folder re-pointed at each new download) is kept
    as given: re-pointed after `sources add`, registration reads the new target (before: the
    link was resolved once, at add, and the old folder read for ever)."""
    from flowmatch_assets.ingest import sources as src
    from tests import hostile_sources as hs

    for d, names in (("old", ["a"]), ("new", ["b", "c"])):
        (env / d).mkdir()
        for n in names:
            (env / d / f"{n}.jpg").write_bytes(hs.jpeg(ord(n)))
            (env / d / f"{n}.txt").write_text(f"picture {n}")
    link = env / "current"
    link.symlink_to(env / "old")
    _cli(capsys, 0, "sources", "add", "p", "--kind", "folder", "--location", str(link))
    link.unlink()
    link.symlink_to(env / "new")
    _cli(capsys, 0, "partitions", "register")
    manifests = [
        src.registry.manifest(env / "data", p["key"]) for p in src.registered(env / "data", "p")
    ]
    assert [m.entries for m in manifests] == [
        [{"id": "b.jpg", "image": "b.jpg"}, {"id": "c.jpg", "image": "c.jpg"}]
    ]


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _lying_footer(path, column: str, claim: int) -> int:
    """Rewrite ``path``'s footer so that ``column``'s total_uncompressed_size says ``claim``
    (a varint padded to the real one's length: the file stays valid parquet); the real size."""
    import pyarrow.parquet as pq

    real = pq.ParquetFile(path).metadata.row_group(0)
    real = next(
        real.column(i).total_uncompressed_size
        for i in range(real.num_columns)
        if real.column(i).path_in_schema == column
    )
    data = bytearray(path.read_bytes())
    flen = int.from_bytes(data[-8:-4], "little")
    start = len(data) - 8 - flen
    footer = bytes(data[start:-8])
    old = _varint(real * 2)  # zigzag
    assert footer.count(old) == 1
    new = bytearray(_varint(claim * 2))
    while len(new) < len(old):  # a longer encoding of the same value (continuation bits)
        new[-1] |= 0x80
        new.append(0)
    at = start + footer.index(old)
    data[at : at + len(old)] = new
    path.write_bytes(bytes(data))
    return real


def test_a_column_chunk_is_sized_by_its_pages_not_its_footer(tmp_path, monkeypatch):
    """A parquet source whose footer says its caption column holds 100 bytes while its pages
    hold ~8 MB (zstd, a small file): the pages' own headers are read, and its rows fail
    `too_large` (before: the footer was believed and the column read; with larger lies that
    peaked at 3.67 GB)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from flowmatch_assets.ingest.sources import Manifest, SourceConfig, parquet, source_kind

    rng = np.random.default_rng(0)
    captions = ["".join(rng.choice(list("ab"), 2_000_000)) for _ in range(4)]
    (tmp_path / "src").mkdir()
    path = tmp_path / "src" / "d.parquet"
    table = pa.table({"image": [b"x"] * 4, "text": captions})
    pq.write_table(table, path, compression="zstd", use_dictionary=False)
    real = _lying_footer(path, "text", 100)
    assert real > 8_000_000 and path.stat().st_size < 2_500_000
    assert pq.ParquetFile(path).metadata.row_group(0).column(1).total_uncompressed_size == 100
    assert pq.read_table(path)["text"].to_pylist() == captions  # still a valid file
    monkeypatch.setattr(parquet, "CAPTION_CHUNK_MAX_BYTES", 1 << 20)
    cfg = SourceConfig(kind="parquet", location=str(tmp_path / "src"))
    listing = source_kind("parquet").rows(
        cfg, "p", Manifest("k", "p", "parquet", "d.parquet", 0, 4)
    )
    assert listing.rows == []
    assert {f["reason"] for f in listing.failed} == {"too_large"}
    assert "(its footer or its pages)" in listing.failed[0]["detail"]
    # an honest file of the same size is read
    monkeypatch.setattr(parquet, "CAPTION_CHUNK_MAX_BYTES", 16 << 20)
    listing = source_kind("parquet").rows(
        cfg, "p", Manifest("k", "p", "parquet", "d.parquet", 0, 4)
    )
    assert [r["caption"] for r in listing.rows] == captions
