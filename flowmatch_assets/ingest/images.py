"""Image ingest for the ``images`` stage: download, decode, resize, centre-crop, encode.

The crop is a centred square (``ingest.buckets: square``) or, in ``aspect`` mode, the image's
nearest aspect-ratio bucket (flowmatch_models/data/buckets.py), which crops the least.

Pure functions, no Dagster, one module per step: ``fetch.py`` (``fetch_bytes``: the bytes of one
URL), ``decode.py`` (``process_image``: an encoded crop of them), ``batch.py`` (``ingest_rows``:
both for a list of metadata rows on a thread pool, exactly one ``IngestResult`` per row, in
input order). This module holds what they share: the settings (``IngestConfig``), the failure
reasons and the result.
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
``too_many_scans``
    A JPEG with more than ``max_jpeg_scans`` scans (SOS markers, counted before decoding):
    a progressive JPEG's decode time grows with its scans.
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
    endpoint 169.254.169.254), multicast, reserved, unspecified or shared (CGNAT) ones, and
    the rest of IANA's special-purpose blocks that are not globally reachable (all of
    192.0.0.0/24, documentation and benchmarking ranges, ...) and Azure's 168.63.129.16, the
    same on every Python version (fetch.SPECIAL_BLOCKS). Nothing is sent to them.
    ``ingest.allow_networks`` (FLOWMATCH_ALLOW_NETWORKS) lists networks to allow anyway, e.g. a
    local mirror.
``outside_source``, ``not_regular_file``, ``unreadable``, ``corrupt_container``
    A source's image (flowmatch_assets/ingest/sources) that leads outside its location, is not
    a regular file (a FIFO, a device), cannot be read, or sits in a container that broke; a
    ``file://`` URL to something that is not a regular file (``not_regular_file``) or cannot
    be read (``unreadable``).
``hash_mismatch``
    The downloaded bytes decode, but their md5 is not the metadata's ``hash`` (PD12M's md5 of
    the image): the URL now serves something else (a CDN placeholder, a replaced file), so it
    is not stored as that row's image. Permanent; ``ingest.check_hash: false`` turns the check
    off; rows without an md5-like hash are never checked.
``bad_url``
    Missing, malformed or unsupported URL (not http, https or file).
``out_of_memory``
    Decoding ran out of memory (a MemoryError: the process was short of it, the file may be
    fine); retryable.
``internal``
    An unexpected exception (a bug, not bad data); ``detail`` names the exception.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from flowmatch_models.data.buckets import GRID, Bucket, buckets_for, nearest, square

#: The stored images' formats (``IngestConfig.image_format``, any case) -> Pillow's encoder.
IMAGE_FORMATS = {"jpeg": "JPEG", "webp": "WEBP", "png": "PNG"}


def pillow_format(image_format: str) -> str:
    """Pillow's encoder of a stored image format; a clear error for any other."""
    encoder = IMAGE_FORMATS.get(image_format.lower())
    if encoder is None:
        raise ValueError(
            f"ingest.image_format {image_format!r} is not supported; use "
            + ", ".join(IMAGE_FORMATS)
        )
    return encoder


class IngestConfig(BaseModel):
    """Download, decode, resize and encode settings of the images stage."""

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
    decode_memory_bytes: int = Field(
        default=768 << 20,
        gt=0,
        description="Decoded pixels all decode threads of a process may hold at once (each "
        "image's estimate: width x height x bytes per pixel, and a converted copy); a decode "
        "waits for room, one bigger than this runs alone. Keeps 16 threads on 100 Mpx PNGs of "
        "290 KB each from holding 16 decoded images.",
    )
    max_jpeg_scans: int = Field(
        default=100,
        ge=0,
        description="A JPEG with more scans fails as too_many_scans, counted before decoding: "
        "each scan of a progressive JPEG decodes the whole image again (7,000 scans of a "
        "10000 x 9999 picture: 45 s). Encoders write about 10; 0 turns the limit off.",
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
    check_hash: bool = Field(
        default=True,
        description="Compare the downloaded bytes' md5 with the metadata's `hash` (PD12M "
        "publishes one per image); a row whose bytes decode but differ fails as hash_mismatch "
        "(a CDN placeholder, a replaced file). Rows without an md5-like hash (32 hex digits) "
        "and sources' own images are not checked.",
    )
    image_format: str = Field(
        default="jpeg", description="The stored images' format: " + ", ".join(IMAGE_FORMATS) + "."
    )
    quality: int = Field(default=95, description="JPEG/WebP quality.")
    user_agent: str = Field(
        default="flowmatch/0.1 (+PD12M research)", description="HTTP User-Agent."
    )

    @field_validator("image_format")
    @classmethod
    def _format(cls, v: str) -> str:
        pillow_format(v)  # refused when the settings are read, not at the first image
        return v

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
        "hash_mismatch",
        "too_many_scans",
        "out_of_memory",
    }
)

#: Reasons a later attempt may fix (the server or network was at fault): `flowmatch retry`
#: re-fetches these by default; every other reason is permanent for the same bytes and config.
#: HTTP 5xx, 408 and 429 are retryable too (see :func:`is_retryable`).
RETRYABLE: frozenset[str] = frozenset({"timeout", "connection_error", "internal", "out_of_memory"})
#: The HTTP statuses a later attempt may fix, as one pattern that Python's ``re`` and DuckDB's
#: ``regexp_full_match`` (catalog/views.py's ``retryable`` macro) both read: 5xx, 408, 429.
RETRYABLE_HTTP = r"http_(5[0-9][0-9]|408|429)"


def is_retryable(reason: str | None) -> bool:
    """Whether a failure ``reason`` may succeed on a later attempt (timeouts, 5xx, connection
    errors, 408/429); 4xx, corrupt, not_image, too_small, bombs, too_large and refused
    redirects are permanent. The catalog's SQL reads the same two tables."""
    if not reason:
        return False
    return reason in RETRYABLE or re.fullmatch(RETRYABLE_HTTP, reason) is not None


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
    outcome: str  # "stored" or "failed" (ingest/shard.py sets "filtered" after)
    reason: str | None = None
    detail: str | None = None
    image: bytes | None = None  # encoded size x size RGB in cfg.image_format
    orig_width: int | None = None  # decoded size after EXIF orientation
    orig_height: int | None = None
    md5: str | None = None  # md5 hex of the downloaded bytes
    bytes_downloaded: int = 0  # body bytes fetched (0 for a failed download)
