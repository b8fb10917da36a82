"""What the source kinds share: the rows and failures they list, and caption text.

A source kind lists a partition's samples as rows in the PD12M metadata columns (so the filters,
dedupe, the images stage and the data card treat them as they treat PD12M's): ``id``; ``url``
the sample's place in the source (``cats/a.jpg``, ``train-0.parquet#17``, ``00000.tar#000000017.jpg``;
a URL list's row: its URL, downloaded by the images stage);
``caption``; ``width``/``height`` unknown before decoding (the images stage checks the decoded
size against the same filters); ``mime_type`` from the extension; ``hash`` none (duplicates are
found by the bytes' md5 after reading, as ``duplicate_content``; a URL list's ``hash_field``); ``license`` the source's;
``source`` the source's name; ``row_index`` the sample's position in the partition. A sample
that cannot become a row is a failure ``{id, url, reason, detail}`` with one of:

``missing_caption``  no caption where the source says captions are (no sidecar, no jsonl line,
                     a null column value, no ``.txt`` member or ``.json`` key)
``missing_url``      a URL list's row without a URL
``missing_image``    a caption without an image (an orphan sidecar, a tar sample without an
                     image member, a parquet row whose image has no bytes)
``bad_caption``      a caption that is not text: a file or bytes that are not UTF-8, or a value
                     that is not a string (a number, a mapping; the detail names its type)
``bad_metadata``     a metadata.jsonl line (or a tar sample's ``.json``) that is not UTF-8 JSON
                     naming a ``file_name``
``duplicate_id``     a second sample with an id the partition has already (a parquet ``id_field``)
``outside_source``   a name or link that leads outside the source's location (a ``../`` or
                     absolute ``file_name``, a symlink out of the folder; ``follow_links`` opts in)
``not_regular_file`` a FIFO, a device, a socket or a folder where a file should be
``unreadable``       a file that cannot be read (permissions, I/O errors)
``corrupt_container`` a tar or parquet file that cannot be read (truncated, a member lying about
                     its size, a damaged footer): its samples fail, never the other files
``too_large``        a caption or metadata file above its limit (an image's is the images stage's)
``not_found``        a file named by the manifest or a jsonl line that is not there

No detail holds bytes of a file: it names the file and what it is. ``flowmatch_assets/ingest/
sources/location.py`` decides the confinement reasons for every read.
"""

from __future__ import annotations

import mimetypes

from flowmatch_assets.ingest.sources.config import SourceConfig

#: Failure reasons of the listing (the images stage adds its own: ingest/images.py REASONS).
LISTING_REASONS = (
    "missing_caption",
    "missing_url",
    "missing_image",
    "bad_caption",
    "bad_metadata",
    "duplicate_id",
    "outside_source",
    "not_regular_file",
    "unreadable",
    "corrupt_container",
    "too_large",
    "not_found",
)

#: The largest caption file, caption member or ``.json`` member read (a caption is a sentence,
#: PD12M's longest are ~2 KB); past it the sample fails as ``too_large``.
CAPTION_MAX_BYTES = 1 << 20
#: The largest metadata.jsonl read (a million lines of ~200 bytes), checked before reading.
METADATA_MAX_BYTES = 1 << 30
#: The longest metadata.jsonl line read (a caption and its file name); a longer one is a
#: ``bad_metadata`` row of its own, skipped without being held.
JSONL_LINE_MAX_BYTES = 2 << 20


def printable(text: str) -> str:
    """``text`` with every character that is not printable (terminal escapes, a bell, a
    newline) written as its escape (``\\x1b``): a file name or detail printed from an untrusted
    dataset can never drive the terminal."""
    return "".join(
        c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text
    )


def mime_of(name: str) -> str | None:
    return mimetypes.guess_type(name)[0]


def row(cfg: SourceConfig, name: str, sid: str, url: str, caption: str, index: int) -> dict:
    """One listed sample in the PD12M metadata columns (see the module doc)."""
    return {
        "id": sid,
        "url": url,
        "caption": caption,
        "width": None,
        "height": None,
        "mime_type": mime_of(url.rsplit("#", 1)[-1]),
        "hash": None,
        "license": cfg.license,
        "source": name,
        "row_index": index,
    }


def failure(sid: str, url: str | None, reason: str, detail: str) -> dict:
    return {"id": sid, "url": url, "reason": reason, "detail": detail}


class NotText(ValueError):
    """A caption value that is not text; the message says what it is (never its content)."""


def caption_text(value: object) -> str | None:
    """A caption value as text: a string (stripped), UTF-8 bytes (a BOM dropped), or the first
    of a list of them (several captions per image, COCO-style); None when there is none (null,
    an empty list). Raises :class:`NotText` naming the type otherwise."""
    if value is None:
        return None
    if isinstance(value, str):
        return value.strip()
    if isinstance(value, bytes | bytearray | memoryview):
        try:
            return bytes(value).decode("utf-8-sig").strip()
        except UnicodeDecodeError:
            raise NotText(f"{len(value)} bytes that are not UTF-8 text") from None
    if isinstance(value, list | tuple):
        if not value:
            return None
        try:
            return caption_text(value[0])
        except NotText as e:
            raise NotText(f"a list whose first caption is {e}") from None
    what = {bool: "a boolean", int: "a number", float: "a number", dict: "a mapping"}
    raise NotText(what.get(type(value), f"a {type(value).__name__}"))
