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
