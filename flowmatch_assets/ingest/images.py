"""Image ingest for the ``images_256`` stage: download, decode, resize, centre-crop, encode.

The crop is a centred square (``ingest.buckets: square``) or, in ``aspect`` mode, the image's
nearest aspect-ratio bucket (flowmatch_models/data/buckets.py), which crops the least.

Pure functions, no Dagster: ``fetch_bytes`` gets the bytes of one URL, ``process_image`` turns
them into an encoded ``size`` x ``size`` RGB image, ``ingest_rows`` does both for a list of
metadata rows on a thread pool and returns exactly one ``IngestResult`` per row, in input order.
A bad row never raises: it becomes a ``failed`` result whose ``reason`` is one of these codes
(the catalog counts them, and a failed row can be retried later):

``http_<status>``
    The server answered a non-2xx status (after retries for 5xx), e.g. ``http_404``,
    ``http_503``; also an unfollowable 3xx (no ``Location``, ``304``).
``timeout``
    Connect or read timeout on every attempt, or the row's total ``deadline_s`` (retries and
    redirects included) ran out, e.g. a server that trickles a byte every few seconds.
``connection_error``
    Refused/reset connection, DNS failure, TLS error or a body shorter than its
    ``Content-Length``, on every attempt.
``too_large``
    ``Content-Length`` (or the bytes counted while streaming, or a file's size) above
    ``max_bytes``.
``not_image``
    The bytes are not JPEG, PNG, WebP, GIF, BMP or TIFF by their magic bytes (HTML error pages,
    empty bodies, ...), whatever the ``Content-Type`` says.
``corrupt``
    The format was recognised but Pillow could not decode it (truncated or damaged data).
``too_small``
    The decoded short side is below ``min_side``.
``decompression_bomb``
    The header's width x height is above ``max_pixels`` (checked before decoding).
``redirect_refused``
    A redirect to a scheme other than http/https (e.g. ``file://``), or more than
    ``max_redirects`` redirects.
``file_not_allowed``
    A ``file://`` URL while ``file_root`` is unset, or one that resolves outside ``file_root``.
    A relative file URL (``file:images/a.jpg``, as the sample writes) is resolved against
    ``file_root``, so a data root can be moved or copied.
``not_found``
    A ``file://`` URL naming a missing file (HTTP 404 is ``http_404``), or a source's file that
    is gone.
``private_address``
    The URL's host resolves (when connecting, on the first request and on every redirect) only
    to addresses that are not public: loopback, private, link-local (the cloud metadata
    endpoint 169.254.169.254), multicast, reserved, unspecified or shared (CGNAT) ones. Nothing
    is sent to them. ``ingest.allow_networks`` (FLOWMATCH_ALLOW_NETWORKS) lists networks to
    allow anyway, e.g. a local mirror.
``outside_source``, ``not_regular_file``, ``unreadable``, ``corrupt_container``
    A source's image (flowmatch_assets/ingest/sources) that leads outside its location, is not
    a regular file (a FIFO, a device), cannot be read, or sits in a container that broke; a
    ``file://`` URL to something that is not a regular file (``not_regular_file``) or cannot
    be read (``unreadable``).
``bad_url``
    Missing, malformed or unsupported URL (not http, https or file).
``internal``
    An unexpected exception (a bug, not bad data); ``detail`` names the exception.

Speed: JPEG (almost all of PD12M) is decoded with ``simplejpeg`` (libjpeg-turbo), whose DCT
scaling goes in eighths (1/8 ... 8/8): the smallest M/8 whose short side is still at least
``size`` (e.g. 3/8 where Pillow's draft mode can only pick 1/2), which skips most of the IDCT and
colour-conversion work; Huffman decoding of every coefficient remains and is the floor. The
header (size, colour space) and the EXIF orientation are read without Pillow, and the bomb and
size checks run before decoding. Strict mode: any libjpeg warning (truncation, bad data) sends
the file to the Pillow path, which decides whether it is ``corrupt``, so outcomes match the
Pillow path's; so do CMYK/YCCK JPEGs (Adobe inversion) and a missing ``simplejpeg``. Pillow's
path for JPEG is draft mode (1/2, 1/4, 1/8 scaling). Only the centre-crop box of the decoded
image is resampled (``Image.resize(box=...)``, antialiased BICUBIC: after DCT scaling the
remaining factor is below 2, where it matches LANCZOS to within JPEG noise at 3/4 of the cost).
The EXIF orientation is applied to the small output (a lossless transpose that commutes with
the centred crop) instead of to the full decoded image. The body is read with ``read1`` (one
socket read per call) so the row's total deadline is checked between reads. Decode, resize, encode and md5 release the GIL, so a
thread pool scales over cores.
"""

from __future__ import annotations

import contextlib
import hashlib
import heapq
import io
import ipaddress
import math
import os
import socket
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, as_completed, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import unquote, urljoin, urlsplit

import numpy as np
import urllib3
from PIL import Image, ImageFile
from urllib3 import exceptions as u3e

try:  # libjpeg-turbo with M/8 DCT scaling; without it every JPEG takes the Pillow draft path
    import simplejpeg
except ImportError:  # pragma: no cover - simplejpeg is a declared dependency
    simplejpeg = None

from pydantic import BaseModel, Field, field_validator, model_validator

from flowmatch_models.data.buckets import GRID, Bucket, buckets_for, cover_box, nearest, square

__all__ = [
    "IngestConfig",
    "REASONS",
    "RETRYABLE",
    "IngestError",
    "IngestResult",
    "count_reasons",
    "fetch_bytes",
    "ingest_blobs",
    "ingest_rows",
    "make_pool",
    "process_image",
    "sniff_format",
]


class IngestConfig(BaseModel):
    """Download, decode, resize and encode settings of the images_256 stage."""

    size: int = Field(
        default=256,
        description="Output side (square mode: short side resized to this, centre crop); in "
        "aspect mode the buckets hold about size x size pixels.",
    )
    buckets: Literal["square", "aspect"] = Field(
        default="square",
        description="square: every image cut to a centred size x size square. aspect: each "
        "image resized to cover its nearest aspect-ratio bucket (flowmatch_models/data/buckets.py: "
        "multiples of 32 within 12.5% of size x size pixels, 1:2 to 2:1) and centre-cropped, "
        "the smallest crop; the bucket is stored per row (height, width).",
    )
    threads: int = Field(default=16, description="Concurrent downloads+decodes per process.")
    connect_timeout_s: float = Field(default=5.0, description="TCP connect timeout (seconds).")
    read_timeout_s: float = Field(default=15.0, description="Read timeout (seconds).")
    retries: int = Field(
        default=3, description="Retries on 5xx, timeouts and connection errors (never on 4xx)."
    )
    backoff_s: float = Field(default=0.25, description="First retry delay; doubles each retry.")
    deadline_s: float = Field(
        default=60.0,
        gt=0,
        description="Total time one download may take, retries and redirects included; past it "
        "the row fails as timeout (a trickling or stalled server never holds a thread longer).",
    )
    max_bytes: int = Field(default=40_000_000, description="Largest body accepted (bytes).")
    max_redirects: int = Field(default=5, description="Most http(s) redirects followed.")
    max_pixels: int = Field(
        default=100_000_000, description="Decompression-bomb limit: refuse images above w*h."
    )
    min_side: int = Field(
        default=64, description="Decoded images with a shorter side fail as too_small."
    )
    allow_networks: list[str] = Field(
        default_factory=list,
        description="Networks (CIDR, e.g. 127.0.0.0/8 or 10.1.0.0/16) that image URLs may "
        "reach although they are not public; by default a URL whose host resolves only to "
        "loopback, private, link-local or other non-public addresses fails as private_address.",
    )
    file_root: str | None = Field(
        default=None,
        description="file:// URLs are allowed only under this folder (None: file:// refused).",
    )
    min_stored_fraction: float = Field(
        default=0.5,
        ge=0,
        le=1,
        description="An attempt that stores fewer than this fraction of the shard's kept rows "
        "fails and keeps the previous shard and its catalog records (its failures are recorded "
        "in the rejected_attempts view).",
    )
    image_format: str = Field(default="jpeg", description="jpeg, webp or png.")
    quality: int = Field(default=95, description="JPEG/WebP quality.")
    user_agent: str = Field(
        default="flowmatch/0.1 (+PD12M research)", description="HTTP User-Agent."
    )

    @field_validator("allow_networks")
    @classmethod
    def _networks(cls, v: list[str]) -> list[str]:
        for net in v:
            try:
                ipaddress.ip_network(net, strict=False)
            except ValueError:
                raise ValueError(
                    f"ingest.allow_networks: {net!r} is not a network (e.g. 10.0.0.0/8)"
                ) from None
        return v

    @model_validator(mode="after")
    def _size_on_the_grid(self) -> IngestConfig:
        if self.buckets == "aspect" and self.size % GRID:
            raise ValueError(
                f"ingest.size {self.size} with ingest.buckets: aspect must be a multiple of "
                f"{GRID} (one DC-AE latent cell)"
            )
        return self

    def bucket_list(self) -> list[Bucket]:
        """The (height, width) sizes images are stored at: one square, or the aspect buckets."""
        return list(buckets_for(self.size)) if self.buckets == "aspect" else square(self.size)

    def bucket_of(self, width: int, height: int) -> Bucket:
        """The (height, width) an original of ``width x height`` (after EXIF orientation) is
        stored at."""
        if self.buckets == "square":
            return (self.size, self.size)
        return nearest(width, height, buckets_for(self.size))


#: Every failure reason code except the ``http_<status>`` family.
REASONS: frozenset[str] = frozenset(
    {
        "timeout",
        "connection_error",
        "too_large",
        "not_image",
        "corrupt",
        "too_small",
        "decompression_bomb",
        "redirect_refused",
        "file_not_allowed",
        "not_found",
        "bad_url",
        "internal",
        "private_address",
        "outside_source",
        "not_regular_file",
        "unreadable",
        "corrupt_container",
    }
)

#: Reasons a later attempt may fix (the server or network was at fault): `flowmatch retry`
#: re-fetches these by default; every other reason is permanent for the same bytes and config.
#: HTTP 5xx, 408 and 429 are retryable too (see :func:`is_retryable`).
RETRYABLE: frozenset[str] = frozenset({"timeout", "connection_error", "internal"})


def is_retryable(reason: str | None) -> bool:
    """Whether a failure ``reason`` may succeed on a later attempt (timeouts, 5xx, connection
    errors, 408/429); 4xx, corrupt, not_image, too_small, bombs, too_large and refused
    redirects are permanent."""
    if not reason:
        return False
    if reason.startswith("http_"):
        code = reason[5:]
        return code.isdigit() and (code.startswith("5") or code in ("408", "429"))
    return reason in RETRYABLE


_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
_CHUNK = 1 << 20
_ENCODERS = {"jpeg": "JPEG", "webp": "WEBP", "png": "PNG"}
# Same mapping as PIL.ImageOps.exif_transpose.
_EXIF_TRANSPOSE = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
_EXIF_ORIENTATION_TAG = 0x0112


class IngestError(Exception):
    """A row that cannot become an image; ``reason`` is a short code (see the module doc)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@dataclass
class IngestResult:
    """The outcome of one metadata row: a stored image or a failure with its reason."""

    id: str
    url: str
    outcome: str  # "stored" or "failed"
    reason: str | None = None
    detail: str | None = None
    image: bytes | None = None  # encoded size x size RGB in cfg.image_format
    orig_width: int | None = None  # decoded size after EXIF orientation
    orig_height: int | None = None
    md5: str | None = None  # md5 hex of the downloaded bytes
    bytes_downloaded: int = 0  # body bytes fetched (0 for a failed download)


# --------------------------------------------------------------------------------------------
# Fetching
# --------------------------------------------------------------------------------------------


def address_refusal(
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address,
    allowed: Sequence[ipaddress.IPv4Network | ipaddress.IPv6Network] = (),
) -> str | None:
    """Why ``ip`` may not be fetched from (``"loopback"``, ``"private"``, ``"link-local"``,
    ...), or None for a public address or one in ``allowed``. An IPv6 address that embeds an
    IPv4 one (mapped, 6to4, Teredo) is judged by that too."""
    if any(ip.version == net.version and ip in net for net in allowed):
        return None
    if isinstance(ip, ipaddress.IPv6Address):
        embedded = [ip.ipv4_mapped, ip.sixtofour, ip.teredo[1] if ip.teredo else None]
        for v4 in (e for e in embedded if e is not None):
            why = address_refusal(v4, allowed)
            if why is not None:
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
    raw = Path(unquote(parts.path))
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


# --------------------------------------------------------------------------------------------
# Decoding
# --------------------------------------------------------------------------------------------


def describe_bytes(data: bytes) -> str:
    """What a body that is not an image was, never what it held: its length, a coarse kind
    (HTML, text, binary) and a short md5 (failure details end up in the catalog; a body can be
    a secret a server handed out)."""
    if not data:
        return "empty body"
    head = bytes(data[:512]).lstrip().lower()
    if head.startswith((b"<!doctype html", b"<html", b"<head", b"<body")):
        kind = "HTML"
    elif head.startswith((b"<?xml", b"<svg")):
        kind = "XML/SVG"
    elif head.startswith((b"{", b"[")):
        kind = "JSON-like text"
    else:
        try:
            bytes(data[:512]).decode("utf-8")
            kind = "text"
        except UnicodeDecodeError:
            kind = "binary data"
    return f"{kind}, {len(data)} bytes (md5 {hashlib.md5(data).hexdigest()[:12]}), not an image"


def sniff_format(data: bytes) -> str | None:
    """The Pillow format name of ``data`` from its magic bytes, or None if not a known image."""
    head = data[:16]
    if head[:3] == b"\xff\xd8\xff":
        return "JPEG"
    if head[:8] == b"\x89PNG\r\n\x1a\n":
        return "PNG"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "WEBP"
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return "GIF"
    if head[:2] == b"BM":
        return "BMP"
    if head[:4] in (b"II*\x00", b"MM\x00*"):
        return "TIFF"
    return None


def _to_8bit_l(im: Image.Image) -> Image.Image:
    """I;16*, I and F modes to L, scaling by the data's range rather than clipping at 255."""
    arr = np.asarray(im)
    if im.mode.startswith("I;16"):
        out = (arr.astype(np.uint16) >> 8).astype(np.uint8)
    else:
        a = arr.astype(np.float64)
        hi = float(a.max()) if a.size else 0.0
        if im.mode == "F" and hi <= 1.0:
            a = a * 255.0
        elif hi > 255.0:
            a = a / (257.0 if hi <= 65535.0 else hi / 255.0)
        out = np.clip(np.rint(a), 0, 255).astype(np.uint8)
    return Image.fromarray(out, "L")


def _composite_white(im: Image.Image) -> Image.Image:
    """RGBA/LA to RGB over a white background."""
    rgba = im.convert("RGBA") if im.mode != "RGBA" else im
    bg = Image.new("RGB", rgba.size, (255, 255, 255))
    bg.paste(rgba, mask=rgba.getchannel("A"))
    return bg


def _tiff_orientation(tiff: bytes) -> int:
    """The Orientation (0x0112) of IFD0 in a TIFF/EXIF block, 1 if absent or unreadable."""
    if len(tiff) < 8 or tiff[:2] not in (b"II", b"MM"):
        return 1
    order = "little" if tiff[:2] == b"II" else "big"
    ifd = int.from_bytes(tiff[4:8], order)
    if ifd + 2 > len(tiff):
        return 1
    count = int.from_bytes(tiff[ifd : ifd + 2], order)
    for pos in range(ifd + 2, min(ifd + 2 + 12 * count, len(tiff) - 11), 12):
        if int.from_bytes(tiff[pos : pos + 2], order) == _EXIF_ORIENTATION_TAG:
            typ = int.from_bytes(tiff[pos + 2 : pos + 4], order)
            if typ == 3:  # SHORT
                return int.from_bytes(tiff[pos + 8 : pos + 10], order)
            if typ == 4:  # LONG
                return int.from_bytes(tiff[pos + 8 : pos + 12], order)
            return 1
    return 1


def _jpeg_orientation(data: bytes) -> int:
    """EXIF orientation of a JPEG: IFD0 of its first ``Exif`` APP1 segment, as Pillow reads it.

    Scans the marker segments up to the start of scan; 1 when there is no EXIF orientation.
    """
    n = len(data)
    i = 2
    while i + 4 <= n:
        if data[i] != 0xFF:
            return 1
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in (0xDA, 0xD9):  # start of scan, end of image
            return 1
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # no length field
            i += 2
            continue
        seg_len = int.from_bytes(data[i + 2 : i + 4], "big")
        if marker == 0xE1 and data[i + 4 : i + 10] == b"Exif\x00\x00":
            return _tiff_orientation(data[i + 10 : i + 2 + seg_len])
        i += 2 + seg_len
    return 1


def _check_size(w: int, h: int, orientation: int, cfg: IngestConfig) -> tuple[int, int]:
    """Bomb and too-small checks on the header size; returns the size after EXIF orientation."""
    if w * h > cfg.max_pixels:
        raise IngestError("decompression_bomb", f"{w}x{h} > max_pixels {cfg.max_pixels}")
    ow, oh = (h, w) if orientation in (5, 6, 7, 8) else (w, h)
    if min(w, h) < cfg.min_side:
        raise IngestError("too_small", f"{ow}x{oh} has short side < min_side {cfg.min_side}")
    return ow, oh


def _decoded_target(ow: int, oh: int, orientation: int, cfg: IngestConfig) -> tuple[int, int]:
    """(width, height) to resample the decoded, not yet oriented image to: the bucket of the
    picture as shown (``ow x oh``, after orientation), turned back when the orientation turns
    the image (the transpose is applied to the small output)."""
    bh, bw = cfg.bucket_of(ow, oh)
    return (bh, bw) if orientation in (5, 6, 7, 8) else (bw, bh)


def _decode_jpeg_scaled(data: bytes, cfg: IngestConfig) -> tuple[Image.Image, int, int, int] | None:
    """simplejpeg (libjpeg-turbo) decode straight to the smallest M/8 scale >= the resize target.

    Returns ``(image, orig_width, orig_height, orientation)`` with an RGB or L image, or None
    when this JPEG should take the Pillow path instead (no simplejpeg, CMYK/YCCK, a header or
    data error of any kind, even a warning: strict mode, so Pillow decides what is corrupt).
    Raises ``IngestError`` for ``decompression_bomb`` / ``too_small``, before decoding.
    """
    if simplejpeg is None:
        return None
    try:
        h, w, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    except Exception:  # noqa: BLE001 - Pillow reports what is wrong with this file
        return None
    if colorspace in ("YCbCr", "RGB"):
        target, mode = "RGB", "RGB"
    elif colorspace == "Gray":
        target, mode = "GRAY", "L"
    else:
        return None  # CMYK / YCCK (Adobe inversion): Pillow
    if Image.MAX_IMAGE_PIXELS and w * h > 2 * Image.MAX_IMAGE_PIXELS:
        return None  # Pillow raises its DecompressionBombError for these
    orientation = _jpeg_orientation(data)
    ow, oh = _check_size(w, h, orientation, cfg)
    tw, th = _decoded_target(ow, oh, orientation, cfg)
    scale = max(tw / w, th / h)
    try:
        arr = simplejpeg.decode_jpeg(
            data,
            colorspace=target,
            min_width=max(1, math.ceil(w * scale)),
            min_height=max(1, math.ceil(h * scale)),
            strict=True,
        )
    except Exception:  # noqa: BLE001 - truncated/damaged: Pillow decides (and says corrupt)
        return None
    im = Image.fromarray(arr[:, :, 0] if mode == "L" else arr, mode)
    return im, ow, oh, orientation


def _finish(
    im: Image.Image,
    transpose: Image.Transpose | None,
    cfg: IngestConfig,
    encoder: str,
    target: tuple[int, int],
) -> bytes:
    """Mode to RGB/L(A), resample the centred crop box to ``target`` (width, height, before
    orientation), orient, encode."""
    mode = im.mode
    alpha = mode in ("RGBA", "LA", "PA") or (mode == "P" and "transparency" in im.info)
    if mode == "P" or mode == "PA":
        im = im.convert("RGBA" if alpha else "RGB")
    elif mode in ("I", "F") or mode.startswith("I;16"):
        im = _to_8bit_l(im)
    elif mode == "L" and "transparency" in im.info:
        im = im.convert("LA")
        alpha = True
    elif mode not in ("RGB", "RGBA", "L", "LA"):
        im = im.convert("RGB")  # CMYK, YCbCr, 1, RGBX, ...
    elif mode == "RGB" and "transparency" in im.info:
        im = im.convert("RGBA")
        alpha = True
    dw, dh = im.size  # after DCT scaling
    tw, th = target
    out = im.resize(
        (tw, th), Image.Resampling.BICUBIC, box=cover_box(dw, dh, tw, th), reducing_gap=3.0
    )
    if alpha:
        out = _composite_white(out)
    elif out.mode != "RGB":
        out = out.convert("RGB")
    if transpose is not None:
        out = out.transpose(transpose)
    buf = io.BytesIO()
    if encoder == "PNG":
        out.save(buf, encoder)
    else:
        out.save(buf, encoder, quality=cfg.quality)
    return buf.getvalue()


def process_image(data: bytes, cfg: IngestConfig) -> tuple[bytes, int, int]:
    """Decode ``data``, resize it to cover its bucket (``cfg.bucket_of``: a size x size square,
    or the nearest aspect-ratio bucket), centre-crop, encode.

    Returns ``(encoded, orig_width, orig_height)``, the original size after EXIF orientation
    (the stored size is ``cfg.bucket_of(orig_width, orig_height)``).
    Raises ``IngestError`` (``not_image``, ``corrupt``, ``decompression_bomb``, ``too_small``).
    """
    if ImageFile.LOAD_TRUNCATED_IMAGES:
        raise RuntimeError(
            "PIL.ImageFile.LOAD_TRUNCATED_IMAGES is True somewhere in this process; truncated "
            "images would be stored silently. Leave it False."
        )
    encoder = _ENCODERS.get(cfg.image_format.lower())
    if encoder is None:
        raise ValueError(
            f"ingest.image_format {cfg.image_format!r} is not supported; use jpeg, webp or png"
        )
    fmt = sniff_format(data)
    if fmt is None:
        raise IngestError("not_image", describe_bytes(data))
    fast = _decode_jpeg_scaled(data, cfg) if fmt == "JPEG" else None
    if fast is not None:
        im, ow, oh, orientation = fast
    else:
        try:
            im = Image.open(io.BytesIO(data), formats=[fmt])
            w, h = im.size
            if w * h > cfg.max_pixels:  # before getexif: bombs are refused unparsed
                raise IngestError("decompression_bomb", f"{w}x{h} > max_pixels {cfg.max_pixels}")
            orientation = im.getexif().get(_EXIF_ORIENTATION_TAG, 1)
            ow, oh = _check_size(w, h, orientation, cfg)
            if fmt == "JPEG":
                tw, th = _decoded_target(ow, oh, orientation, cfg)
                scale = max(tw / w, th / h)
                need = (max(1, math.ceil(w * scale)), max(1, math.ceil(h * scale)))
                im.draft("RGB", need)
            im.load()
        except IngestError:
            raise
        except Image.DecompressionBombError as e:
            raise IngestError("decompression_bomb", str(e)) from None
        except Exception as e:  # noqa: BLE001 - PIL raises many types for damaged data
            raise IngestError("corrupt", f"{type(e).__name__}: {e}") from None
    try:
        target = _decoded_target(ow, oh, orientation, cfg)
        return _finish(im, _EXIF_TRANSPOSE.get(orientation), cfg, encoder, target), ow, oh
    except Exception as e:  # noqa: BLE001 - lazily-decoded frames can still fail here
        raise IngestError("corrupt", f"{type(e).__name__}: {e}") from None


# --------------------------------------------------------------------------------------------
# Rows
# --------------------------------------------------------------------------------------------


def _ingest_one(row: Mapping, cfg: IngestConfig, pool: urllib3.PoolManager) -> IngestResult:
    rid = str(row.get("id", ""))
    url = row.get("url")
    url_s = url if isinstance(url, str) else ""
    n = 0
    try:
        data = fetch_bytes(url, cfg, pool)  # type: ignore[arg-type]  # bad types -> bad_url
        n = len(data)
        md5 = hashlib.md5(data).hexdigest()
        image, ow, oh = process_image(data, cfg)
    except IngestError as e:
        return IngestResult(rid, url_s, "failed", e.reason, e.detail or None, bytes_downloaded=n)
    except Exception as e:  # noqa: BLE001 - a bad row must never crash the shard
        return IngestResult(
            rid, url_s, "failed", "internal", f"{type(e).__name__}: {e}", bytes_downloaded=n
        )
    return IngestResult(rid, url_s, "stored", None, None, image, ow, oh, md5, n)


def ingest_rows(
    rows: Sequence[Mapping],
    cfg: IngestConfig,
    progress: Callable[[int, int], None] | None = None,
) -> list[IngestResult]:
    """Fetch and process every row (``id``, ``url``) on ``cfg.threads`` threads.

    Returns one ``IngestResult`` per row, in input order; never raises for a bad row (only for
    a bad config). ``progress(done, total)`` is called from the calling thread as rows finish.
    """
    if cfg.image_format.lower() not in _ENCODERS:
        raise ValueError(
            f"ingest.image_format {cfg.image_format!r} is not supported; use jpeg, webp or png"
        )
    if cfg.threads < 1:
        raise ValueError(f"ingest.threads must be >= 1, got {cfg.threads}")
    total = len(rows)
    results: list[IngestResult | None] = [None] * total
    if total == 0:
        return []
    pool = make_pool(cfg)
    try:
        with ThreadPoolExecutor(max_workers=cfg.threads, thread_name_prefix="ingest") as ex:
            futures = {ex.submit(_ingest_one, row, cfg, pool): i for i, row in enumerate(rows)}
            for done, fut in enumerate(as_completed(futures), start=1):
                i = futures[fut]
                results[i] = fut.result()
                if progress is not None:
                    progress(done, total)
    finally:
        pool.clear()
    return [r for r in results if r is not None]


def _process_one(row: Mapping, data: bytes | IngestError, cfg: IngestConfig) -> IngestResult:
    """One row whose bytes were read already (or whose read failed)."""
    rid, url = str(row.get("id", "")), str(row.get("url") or "")
    if isinstance(data, IngestError):
        return IngestResult(rid, url, "failed", data.reason, data.detail or None)
    try:
        md5 = hashlib.md5(data).hexdigest()
        image, ow, oh = process_image(data, cfg)
    except IngestError as e:
        return IngestResult(
            rid, url, "failed", e.reason, e.detail or None, bytes_downloaded=len(data)
        )
    except Exception as e:  # noqa: BLE001 - a bad row must never crash the shard
        return IngestResult(rid, url, "failed", "internal", f"{type(e).__name__}: {e}",
                            bytes_downloaded=len(data))  # fmt: skip
    return IngestResult(rid, url, "stored", None, None, image, ow, oh, md5, len(data))


def ingest_blobs(
    rows: Sequence[Mapping],
    blobs: Iterable[tuple[Mapping, bytes | IngestError]],
    cfg: IngestConfig,
    progress: Callable[[int, int], None] | None = None,
) -> list[IngestResult]:
    """:func:`ingest_rows` for rows whose bytes a source reads itself (a folder, parquet or tar
    source: flowmatch_assets/ingest/sources): ``blobs`` yields ``(row, bytes or the
    IngestError why not)`` in any order, read in the calling thread (sequential I/O), while
    ``cfg.threads`` threads decode; at most ``4 x threads`` read images wait in memory. Returns
    one ``IngestResult`` per row of ``rows``, in their order (a row ``blobs`` never yields fails
    as ``internal``)."""
    if cfg.image_format.lower() not in _ENCODERS:
        raise ValueError(
            f"ingest.image_format {cfg.image_format!r} is not supported; use jpeg, webp or png"
        )
    position = {str(r.get("id", "")): i for i, r in enumerate(rows)}
    results: list[IngestResult | None] = [None] * len(rows)
    done = 0
    with ThreadPoolExecutor(max_workers=max(1, cfg.threads), thread_name_prefix="decode") as ex:
        pending: set = set()
        futures: dict = {}

        def drain(limit: int) -> None:
            nonlocal pending, done
            while len(pending) > limit:
                finished, pending = wait(pending, return_when=FIRST_COMPLETED)
                for fut in finished:
                    results[futures.pop(fut)] = fut.result()
                    done += 1
                    if progress is not None:
                        progress(done, len(rows))

        for row, data in blobs:
            fut = ex.submit(_process_one, row, data, cfg)
            futures[fut] = position[str(row.get("id", ""))]
            pending.add(fut)
            drain(4 * max(1, cfg.threads))
        drain(0)
    return [
        r
        if r is not None
        else IngestResult(
            str(rows[i].get("id", "")),
            str(rows[i].get("url") or ""),
            "failed",
            "internal",
            "the source never yielded this row's bytes",
        )  # fmt: skip
        for i, r in enumerate(results)
    ]


def count_reasons(results: Sequence[IngestResult]) -> dict[str, int]:
    """Counts per outcome: ``{"stored": n, "<reason>": n, ...}`` (for logs and the catalog)."""
    counts: dict[str, int] = {}
    for r in results:
        key = "stored" if r.outcome == "stored" else (r.reason or "internal")
        counts[key] = counts.get(key, 0) + 1
    return counts
