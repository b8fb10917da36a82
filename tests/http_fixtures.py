"""A real loopback HTTP server for tests: ``http.server.ThreadingHTTPServer`` on 127.0.0.1:0.

Routes map a path to a ``Reply`` (status, headers, body, optional delay before or during the
body) or to a callable ``(attempt) -> Reply`` that sees how many times the path was requested
(1-based), e.g. to answer 500 and then 200. The server counts requests per path.

Use the ``loopback_http`` fixture (register it with ``pytest_plugins = ["tests.http_fixtures"]``
in a conftest, or import it), or the class as a context manager::

    with LoopbackHTTPServer() as srv:
        srv.add("/a.jpg", Reply(body=jpeg_bytes, headers={"Content-Type": "image/jpeg"}))
        fetch(srv.url("/a.jpg"))
"""

from __future__ import annotations

import collections
import http.server
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest


@dataclass
class Reply:
    """One canned HTTP response.

    ``delay_s`` sleeps before the status line; ``body_delay_s`` sleeps after the headers and the
    first half of the body (a stalled transfer). ``content_length`` overrides the header
    (None: the body's length; -1: no header, body ends at connection close). ``trickle_s`` > 0
    sends the body and then one more byte every ``trickle_s`` seconds, forever (until the client
    hangs up or the server stops). Sleeps end early when the server stops.
    """

    status: int = 200
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0
    body_delay_s: float = 0.0
    content_length: int | None = None
    trickle_s: float = 0.0


Route = Reply | Callable[[int], Reply]


class _Handler(http.server.BaseHTTPRequestHandler):
    """Serves the owning server's routes; 404 for unknown paths."""

    protocol_version = "HTTP/1.1"
    server: _Server

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        path = self.path.split("?", 1)[0]
        owner = self.server.owner
        attempt = owner._hit(path)
        route = owner.routes.get(path)
        if route is None:
            reply = Reply(status=404, body=b"not found", headers={"Content-Type": "text/plain"})
        else:
            reply = route(attempt) if callable(route) else route
        if reply.delay_s and owner.stopping.wait(reply.delay_s):
            self.close_connection = True
            return
        try:
            self.send_response(reply.status)
            for k, v in reply.headers.items():
                self.send_header(k, v)
            length = len(reply.body) if reply.content_length is None else reply.content_length
            if length >= 0:
                self.send_header("Content-Length", str(length))
            else:
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            if reply.body_delay_s:
                half = len(reply.body) // 2
                self.wfile.write(reply.body[:half])
                self.wfile.flush()
                owner.stopping.wait(reply.body_delay_s)
                self.wfile.write(reply.body[half:])
            else:
                self.wfile.write(reply.body)
            while reply.trickle_s and not owner.stopping.is_set():
                self.wfile.flush()
                owner.stopping.wait(reply.trickle_s)
                self.wfile.write(b"\x00")
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - base signature
        pass


class _Server(http.server.ThreadingHTTPServer):
    """ThreadingHTTPServer that knows its LoopbackHTTPServer."""

    daemon_threads = True
    owner: LoopbackHTTPServer

    def handle_error(self, request: object, client_address: object) -> None:
        """Clients that hang up early (timeouts, refused bodies) are expected, not errors."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class LoopbackHTTPServer:
    """A threaded HTTP server on 127.0.0.1 (or another loopback ``host``) with an ephemeral
    port, serving canned routes."""

    def __init__(self, routes: dict[str, Route] | None = None, host: str = "127.0.0.1") -> None:
        self.host = host  # any loopback address (127.0.0.2 is a second host on Linux)
        self.routes: dict[str, Route] = dict(routes or {})
        self._hits: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self._httpd: _Server | None = None
        self.stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, path: str, route: Route) -> str:
        """Serve ``route`` at ``path``; returns its full URL."""
        if not path.startswith("/"):
            raise ValueError(f"route path must start with '/', got {path!r}")
        self.routes[path] = route
        return self.url(path)

    def _hit(self, path: str) -> int:
        with self._lock:
            self._hits[path] += 1
            return self._hits[path]

    def hits(self, path: str) -> int:
        """How many requests ``path`` has received."""
        with self._lock:
            return self._hits[path]

    @property
    def port(self) -> int:
        if self._httpd is None:
            raise RuntimeError("LoopbackHTTPServer is not started; use it as a context manager")
        return self._httpd.server_address[1]

    def url(self, path: str) -> str:
        """The absolute http://<host>:<port><path> URL."""
        return f"http://{self.host}:{self.port}{path}"

    def start(self) -> LoopbackHTTPServer:
        self.stopping.clear()
        self._httpd = _Server((self.host, 0), _Handler)
        self._httpd.owner = self
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> LoopbackHTTPServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@pytest.fixture
def loopback_http() -> Iterator[LoopbackHTTPServer]:
    """A started ``LoopbackHTTPServer`` with no routes; stopped after the test."""
    with LoopbackHTTPServer() as srv:
        yield srv
