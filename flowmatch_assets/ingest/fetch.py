"""Fetching one URL's bytes: http(s) with retries, redirects and one total deadline, to public addresses only (make_pool); file:// only under file_root."""

from __future__ import annotations

import contextlib
import heapq
import ipaddress
import os
import socket
import stat
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit

import urllib3
from urllib3 import exceptions as u3e

from flowmatch_assets.ingest.images import IngestConfig, IngestError

_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})

_CHUNK = 1 << 20


#: Address blocks never connected to, whatever the Python version's ``ipaddress`` says (3.11
#: calls 192.0.0.192, Oracle Cloud's metadata service, global: CVE-2024-4032): IANA's IPv4 and
#: IPv6 special-purpose address registries' blocks that are not globally reachable (taken
#: whole where only some sub-blocks are), multicast, and cloud services on public-range
#: addresses. First match wins: the reason names the kind of block.
SPECIAL_BLOCKS: tuple[tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, str], ...] = tuple(
    (ipaddress.ip_network(net), why)
    for net, why in (
        ("0.0.0.0/32", "unspecified"),
        ("0.0.0.0/8", "this network"),
        ("10.0.0.0/8", "private"),
        ("100.64.0.0/10", "not public"),  # shared address space (CGNAT)
        ("127.0.0.0/8", "loopback"),
        ("169.254.0.0/16", "link-local"),
        ("172.16.0.0/12", "private"),
        ("192.0.0.0/24", "special-purpose"),  # IETF protocol assignments (192.0.0.192: OCI)
        ("192.0.2.0/24", "documentation"),
        ("192.31.196.0/24", "special-purpose"),  # AS112-v4
        ("192.52.193.0/24", "special-purpose"),  # AMT
        ("192.88.99.0/24", "special-purpose"),  # 6to4 relay anycast (deprecated)
        ("192.168.0.0/16", "private"),
        ("192.175.48.0/24", "special-purpose"),  # direct delegation AS112
        ("198.18.0.0/15", "private"),  # benchmarking
        ("198.51.100.0/24", "documentation"),
        ("203.0.113.0/24", "documentation"),
        ("224.0.0.0/4", "multicast"),
        ("240.0.0.0/4", "reserved"),  # and 255.255.255.255, limited broadcast
        ("168.63.129.16/32", "cloud service"),  # Azure WireServer
        ("::/128", "unspecified"),
        ("::1/128", "loopback"),
        ("::/96", "reserved"),  # IPv4-compatible (deprecated)
        ("64:ff9b:1::/48", "private"),  # local-use NAT64
        ("100::/64", "special-purpose"),  # discard-only
        ("100:0:0:1::/64", "special-purpose"),  # dummy prefix
        ("2001::/23", "special-purpose"),  # IETF protocol assignments (Teredo, ORCHIDv2, ...)
        ("2001:db8::/32", "documentation"),
        ("3fff::/20", "documentation"),
        ("5f00::/16", "special-purpose"),  # SRv6 SIDs
        ("fc00::/7", "private"),  # unique local (fd00:ec2::254: AWS's metadata service)
        ("fe80::/10", "link-local"),
        ("fec0::/10", "private"),  # site-local (deprecated)
        ("ff00::/8", "multicast"),
    )
)

_NAT64 = ipaddress.ip_network("64:ff9b::/96")


def _embedded_v4(ip: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses an IPv6 one carries: v4-mapped, NAT64 (64:ff9b::/96), 6to4, Teredo
    (client and server)."""
    out = [ip.ipv4_mapped, ip.sixtofour, *(ip.teredo or ())]
    if ip in _NAT64:
        out.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    return [v4 for v4 in out if v4 is not None]


def address_refusal(
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address,
    allowed: Sequence[ipaddress.IPv4Network | ipaddress.IPv6Network] = (),
) -> str | None:
    """Why ``ip`` may not be fetched from (``"loopback"``, ``"private"``, ``"link-local"``,
    ``"special-purpose"``, ...), or None for a public address or one in ``allowed``. The
    blocks refused are :data:`SPECIAL_BLOCKS` (the same on every Python version), then
    whatever ``ipaddress`` does not call global. An IPv6 address that embeds an IPv4 one
    (mapped, NAT64, 6to4, Teredo) is judged by that too."""
    if any(ip.version == net.version and ip in net for net in allowed):
        return None
    if isinstance(ip, ipaddress.IPv6Address):
        for v4 in _embedded_v4(ip):
            why = address_refusal(v4, allowed)
            if why is not None:
                return why
    for net, why in SPECIAL_BLOCKS:
        if ip.version == net.version and ip in net:
            return why
    for test, why in (
        ("is_unspecified", "unspecified"),
        ("is_loopback", "loopback"),
        ("is_link_local", "link-local"),
        ("is_multicast", "multicast"),
        ("is_private", "private"),
        ("is_reserved", "reserved"),
    ):
        if getattr(ip, test):
            return why
    return None if ip.is_global else "not public"


def _guarded_new_conn(self) -> socket.socket:
    """urllib3's ``HTTPConnection._new_conn`` that connects only to addresses
    :func:`address_refusal` allows (the class's ``allowed_networks``): the host is resolved
    here and the socket connects to the address that was checked, so neither a redirect nor a
    DNS answer that changes between check and connect reaches a refused address."""
    try:
        infos = socket.getaddrinfo(self._dns_host, self.port, 0, socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise u3e.NameResolutionError(self.host, self, e) from e
    ok, refused = [], []
    for info in infos:
        ip = ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])
        why = address_refusal(ip, self.allowed_networks)
        (refused if why else ok).append((info, f"{ip} ({why})"))
    if not ok:
        raise IngestError(
            "private_address",
            f"{self.host} resolves to {', '.join(w for _, w in refused[:3])}: not fetched; "
            "ingest.allow_networks (FLOWMATCH_ALLOW_NETWORKS) allows chosen networks",
        )
    err: OSError | None = None
    for (family, socktype, proto, _name, sockaddr), _ in ok:
        sock = None
        try:
            sock = socket.socket(family, socktype, proto)
            for opt in self.socket_options or ():
                sock.setsockopt(*opt)
            if isinstance(self.timeout, int | float):
                sock.settimeout(self.timeout)
            if self.source_address:
                sock.bind(self.source_address)
            sock.connect(sockaddr)
            sys.audit("http.client.connect", self, self.host, self.port)
            return sock
        except TimeoutError as e:
            if sock is not None:
                sock.close()
            raise u3e.ConnectTimeoutError(
                self, f"Connection to {self.host} timed out. (connect timeout={self.timeout})"
            ) from e
        except OSError as e:
            err = e
            if sock is not None:
                sock.close()
    raise u3e.NewConnectionError(self, f"Failed to establish a new connection: {err}")


def make_pool(cfg: IngestConfig) -> urllib3.PoolManager:
    """A thread-safe urllib3 pool sized for ``cfg.threads`` concurrent downloads, whose
    connections reach public addresses only (and ``cfg.allow_networks``): a host that resolves
    to a loopback, private, link-local or other non-public address fails as
    ``private_address`` before anything is sent to it."""
    from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool

    allowed = tuple(ipaddress.ip_network(n, strict=False) for n in cfg.allow_networks)
    attrs = {"allowed_networks": allowed, "_new_conn": _guarded_new_conn}
    conn = type("PublicHTTPConnection", (urllib3.connection.HTTPConnection,), attrs)
    sconn = type("PublicHTTPSConnection", (urllib3.connection.HTTPSConnection,), attrs)
    pm = urllib3.PoolManager(
        num_pools=max(64, cfg.threads * 4),
        maxsize=max(1, cfg.threads),
        block=False,
        headers={"User-Agent": cfg.user_agent, "Accept": "image/*,*/*;q=0.8"},
    )
    pm.pool_classes_by_scheme = {
        "http": type("PublicHTTPPool", (HTTPConnectionPool,), {"ConnectionCls": conn}),
        "https": type("PublicHTTPSPool", (HTTPSConnectionPool,), {"ConnectionCls": sconn}),
    }
    return pm


def _read_file(url: str, cfg: IngestConfig) -> bytes:
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise IngestError("bad_url", f"file URL with a host ({parts.netloc!r}) is not supported")
    if cfg.file_root is None:
        raise IngestError(
            "file_not_allowed", "file:// URLs are refused; set ingest.file_root to allow a folder"
        )
    root = Path(cfg.file_root).resolve()
    name = unquote(parts.path)
    if "\x00" in name:  # no file has such a name: permanent, never retried
        raise IngestError("bad_url", "a file URL whose path holds a NUL byte (%00)")
    raw = Path(name)
    path = (raw if raw.is_absolute() else root / raw).resolve()
    if not path.is_relative_to(root):
        raise IngestError("file_not_allowed", f"{path} is outside file_root {root}")
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):  # a FIFO or device is never opened
            raise IngestError("not_regular_file", f"{path} is not a regular file")
        if st.st_size > cfg.max_bytes:
            raise IngestError("too_large", f"{st.st_size} bytes > max_bytes {cfg.max_bytes}")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise IngestError("not_regular_file", f"{path} is not a regular file")
            data = f.read(cfg.max_bytes + 1)  # at most the limit, whatever the size said
    except FileNotFoundError:
        raise IngestError("not_found", f"no file {path}") from None
    except OSError as e:
        raise IngestError("unreadable", f"cannot read {path}: {e.strerror or e}") from None
    if len(data) > cfg.max_bytes:
        raise IngestError("too_large", f"{path} is above max_bytes {cfg.max_bytes}")
    return data


def _discard(resp: urllib3.BaseHTTPResponse) -> None:
    """Give a response's connection back: drain a small body, close on a large/unknown one."""
    try:
        length = resp.headers.get("Content-Length")
        if length is not None and length.isdigit() and int(length) <= 65536:
            resp.drain_conn()
        else:
            resp.close()
    except Exception:  # noqa: BLE001 - any failure here only costs a reconnect
        resp.close()
    finally:
        resp.release_conn()


def _remaining(deadline: float) -> float:
    return deadline - time.monotonic()


def _deadline_error(cfg: IngestConfig, what: str) -> IngestError:
    return IngestError("timeout", f"download deadline {cfg.deadline_s:g}s exceeded ({what})")


def _set_sock_timeout(resp: urllib3.BaseHTTPResponse, seconds: float) -> None:
    """Bound the next socket read by ``seconds`` (the time left to the deadline)."""
    conn = getattr(resp, "_connection", None)
    sock = getattr(conn, "sock", None)
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.settimeout(max(seconds, 0.001))


def _read_body(resp: urllib3.BaseHTTPResponse, cfg: IngestConfig, deadline: float) -> bytes:
    """The body, at most ``cfg.max_bytes``, read before ``deadline`` (time.monotonic()).

    With a Content-Length (and no content encoding) the body is read in one call, and a
    watchdog timer shuts the socket down at the deadline, so a server that trickles bytes
    cannot hold the row longer. Otherwise it is read with ``read1`` (one socket read per call)
    and the time left is checked between reads and bounds each socket read.
    """
    max_bytes = cfg.max_bytes
    length = resp.headers.get("Content-Length")
    encoded = resp.headers.get("Content-Encoding", "identity").lower() not in ("", "identity")
    if length is not None and length.strip().isdigit():
        if int(length) > max_bytes:
            raise IngestError("too_large", f"Content-Length {int(length)} > max_bytes {max_bytes}")
        if not encoded:
            return _read_sized(resp, cfg, deadline)
    chunks: list[bytes] = []
    total = 0
    while True:
        left = _remaining(deadline)
        if left <= 0:
            raise _deadline_error(cfg, f"{total} body bytes received")
        if left < cfg.read_timeout_s:  # near the deadline: bound each socket read by it
            _set_sock_timeout(resp, left)
        chunk = resp.read1(_CHUNK)
        if not chunk:
            break
        total += len(chunk)
        if total > max_bytes:
            raise IngestError("too_large", f"body above max_bytes {max_bytes}")
        chunks.append(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class _Watchdog:
    """One daemon thread that calls ``fn`` at time ``when`` unless disarmed first: the deadline
    of every in-flight body read, without a thread per download (starting one costs ms)."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._live: set[int] = set()
        self._next = 0
        self._thread: threading.Thread | None = None

    def arm(self, when: float, fn: Callable[[], None]) -> int:
        with self._cv:
            self._next += 1
            token = self._next
            heapq.heappush(self._heap, (when, token, fn))
            self._live.add(token)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="ingest-deadline", daemon=True
                )
                self._thread.start()
            self._cv.notify()
        return token

    def disarm(self, token: int) -> None:
        with self._cv:
            self._live.discard(token)

    def _run(self) -> None:
        while True:
            with self._cv:
                while self._heap and self._heap[0][1] not in self._live:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._cv.wait(timeout=60)
                    continue
                when, token, fn = self._heap[0]
                wait = when - time.monotonic()
                if wait > 0:
                    self._cv.wait(timeout=wait)
                    continue
                heapq.heappop(self._heap)
                self._live.discard(token)
            with contextlib.suppress(Exception):
                fn()


_WATCHDOG = _Watchdog()


def _read_sized(resp: urllib3.BaseHTTPResponse, cfg: IngestConfig, deadline: float) -> bytes:
    """One read of exactly Content-Length bytes (no chunk list, no join copy), cut off at the
    deadline by the watchdog, which shuts the socket down. A short body raises urllib3's
    ProtocolError (IncompleteRead) -> connection_error."""
    if _remaining(deadline) <= 0:
        raise _deadline_error(cfg, "before the body")
    fired = threading.Event()

    def cut() -> None:
        fired.set()
        sock = getattr(getattr(resp, "_connection", None), "sock", None)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    token = _WATCHDOG.arm(deadline, cut)
    try:
        return resp.read()
    except Exception:
        if fired.is_set():
            raise _deadline_error(cfg, "body incomplete") from None
        raise
    finally:
        _WATCHDOG.disarm(token)
        if fired.is_set():  # the socket was shut down even if read() returned: never reuse it
            resp.close()


def _get_once(
    url: str, cfg: IngestConfig, pool: urllib3.PoolManager, deadline: float
) -> tuple[int, str, bytes]:
    """One GET without redirects. Returns (status, location, body); body only for 2xx."""
    left = _remaining(deadline)
    if left <= 0:
        raise _deadline_error(cfg, "before the request")
    try:
        resp = pool.request(
            "GET",
            url,
            redirect=False,
            retries=False,
            preload_content=False,
            timeout=urllib3.Timeout(
                connect=min(cfg.connect_timeout_s, left), read=min(cfg.read_timeout_s, left)
            ),
        )
    except u3e.LocationValueError as e:
        raise IngestError("bad_url", str(e)) from None
    status = resp.status
    if not 200 <= status < 300:
        location = resp.headers.get("Location", "")
        _discard(resp)
        return status, location, b""
    done = False
    try:
        body = _read_body(resp, cfg, deadline)
        done = True
        return status, "", body
    finally:
        if not done:
            resp.close()
        resp.release_conn()


def _retryable(e: BaseException) -> IngestError | None:
    """Map a transport exception to a retryable IngestError, or None if it is not one."""
    if isinstance(e, u3e.NewConnectionError | u3e.ProxyError | u3e.SSLError):
        return IngestError("connection_error", str(e))
    if isinstance(e, u3e.ConnectTimeoutError | u3e.ReadTimeoutError | socket.timeout):
        return IngestError("timeout", str(e))
    if isinstance(e, u3e.ProtocolError | u3e.HTTPError | ConnectionError):
        return IngestError("connection_error", str(e))
    return None


def _http_get(url: str, cfg: IngestConfig, pool: urllib3.PoolManager, deadline: float) -> bytes:
    """GET with retries (5xx, timeouts, connection errors) at the current hop, all before
    ``deadline``; a retry that would start after it fails the row as ``timeout``."""
    attempts = max(0, cfg.retries) + 1
    for attempt in range(attempts):
        last = attempt == attempts - 1
        try:
            status, location, body = _get_once(url, cfg, pool, deadline)
        except IngestError:
            raise
        except Exception as e:  # noqa: BLE001 - mapped below, re-raised if unknown
            err = _retryable(e)
            if err is None:
                raise
            if last:
                raise err from None
        else:
            if 200 <= status < 300:
                return body
            if status in _REDIRECT_STATUSES:
                raise _Redirect(status, location)
            if status < 500 or last:
                raise IngestError(f"http_{status}", f"GET {url} -> {status}")
            err = IngestError(f"http_{status}", f"GET {url} -> {status}")
        left = _remaining(deadline)
        pause = cfg.backoff_s * (2**attempt)
        if pause >= left:  # no time for another attempt: report what the last one got
            if err.reason == "timeout":
                raise _deadline_error(cfg, f"{attempt + 1} attempts; last: {err.detail}")
            raise err
        time.sleep(pause)
    raise AssertionError("unreachable")


class _Redirect(Exception):
    """Internal signal: the current hop answered a redirect."""

    def __init__(self, status: int, location: str) -> None:
        super().__init__(status, location)
        self.status = status
        self.location = location


def fetch_bytes(url: str, cfg: IngestConfig, pool: urllib3.PoolManager | None = None) -> bytes:
    """Return the body of ``url`` (http, https, or file under ``cfg.file_root``).

    Redirects are followed by hand, at most ``cfg.max_redirects``, and only to http/https.
    The whole download (every hop, attempt and backoff) ends within ``cfg.deadline_s``.
    Raises ``IngestError`` with a reason code from the module docstring.
    """
    deadline = time.monotonic() + cfg.deadline_s
    if not isinstance(url, str) or not url.strip():
        raise IngestError("bad_url", f"no URL ({url!r})")
    url = url.strip()
    scheme = urlsplit(url).scheme.lower()
    if scheme == "file":
        return _read_file(url, cfg)
    if scheme not in ("http", "https"):
        raise IngestError("bad_url", f"unsupported scheme {scheme!r} in {url!r}")
    if not urlsplit(url).hostname:
        raise IngestError("bad_url", f"no host in {url!r}")
    pool = pool if pool is not None else make_pool(cfg)
    current = url
    for _ in range(cfg.max_redirects + 1):
        try:
            return _http_get(current, cfg, pool, deadline)
        except _Redirect as r:
            if not r.location:
                raise IngestError(f"http_{r.status}", "redirect without Location") from None
            target = urljoin(current, r.location)
            target_scheme = urlsplit(target).scheme.lower()
            if target_scheme not in ("http", "https"):
                raise IngestError(
                    "redirect_refused", f"{current} redirects to {target_scheme}:// ({target})"
                ) from None
            current = target
    raise IngestError("redirect_refused", f"more than {cfg.max_redirects} redirects from {url}")
