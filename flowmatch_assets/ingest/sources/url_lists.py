"""Reading a URL list (``urls.py``) without trusting it: streamed, never held whole.

A list is untrusted input: its size, its rows and its footer are its own word. So:

- a text list (``.csv``, ``.tsv``, ``.tsv.gz``, ``.jsonl``) is read once at registration, in
  chunks of :data:`CHUNK` bytes, counting its rows and recording where each partition's stretch
  starts and ends (the manifest's ``span``, offsets in the decompressed text); a partition then
  reads only its own stretch (a plain file seeks to it; a ``.tsv.gz`` is decompressed up to it,
  nothing kept). Memory stays flat whatever the list's size; the bytes read in all stay under
  :data:`LIST_MAX_BYTES` (decompressed) and remote reads under the source's ``deadline_s``.
- a bad row costs its own row: a row with the wrong number of fields or a csv error is
  ``bad_row``, one that is not UTF-8 ``not_utf8``, a field above :data:`FIELD_MAX_BYTES` (or a
  line above :data:`LINE_MAX_BYTES`, read past and never held) ``field_too_large``; a jsonl line
  that is not a JSON object ``bad_metadata``. The rest of the file is read.
- a ``.parquet`` list is read per row group the partition overlaps, each column's size checked
  against its footer first (``parquet.py``).

A record is ``(values, None)`` (``{column: text}`` of the columns the source's settings name)
or ``(None, (reason, detail))``. Blank lines are not rows (as Arrow's csv reader skips them).
"""

from __future__ import annotations

import csv
import gzip
import json
import re
import time
from collections.abc import Iterator

from flowmatch_assets.ingest.images import IngestError
from flowmatch_assets.ingest.sources.config import SourceConfig, SourceError

#: The most bytes a list is read for, in all (a ``.tsv.gz``: decompressed).
LIST_MAX_BYTES = 1 << 30
#: The longest field of a csv/tsv row (Python's csv default limit) and the longest line.
FIELD_MAX_BYTES = 128 << 10
LINE_MAX_BYTES = 2 << 20
#: Bytes read from the file at a time.
CHUNK = 1 << 20

Record = tuple[dict | None, tuple[str, str] | None]


class _TooLong(Exception):
    """A line above LINE_MAX_BYTES (read past, not held)."""


class Stream:
    """The lines of binary file ``f`` (a list), bounded: each line at most
    :data:`LINE_MAX_BYTES` (a longer one is read past and raises :class:`_TooLong`), all at most
    ``limit`` bytes (``too_large``), every read before ``deadline`` (``timeout``). ``pos`` is
    the offset after the last line handed out (a record's end, for the partitions' spans)."""

    def __init__(self, f, rel: str, deadline_s: float | None, limit: int = LIST_MAX_BYTES):
        self.f, self.rel, self.limit = f, rel, limit
        self.deadline = None if deadline_s is None else time.monotonic() + deadline_s
        self.deadline_s = deadline_s
        self.pos = 0
        self.record_start = 0
        self._read = 0
        # the bytes read and not yet handed out are _buf[_off:]: a line is handed out by moving
        # _off (slicing the rest off instead copied ~half a chunk per line: 8 of the 10 s
        # that a 500,000-row list took to register)
        self._buf = b""
        self._off = 0
        self._eof = False

    def _fill(self) -> bool:
        if self._eof:
            return False
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise IngestError("timeout", f"{self.rel}: not read within {self.deadline_s:g} s")
        try:
            chunk = self.f.read(CHUNK)
        except (TimeoutError, OSError, EOFError, ValueError) as e:
            if isinstance(e, TimeoutError) or "imeout" in type(e).__name__:
                raise IngestError("timeout", f"{self.rel}: a read timed out") from None
            raise IngestError("corrupt_container", f"{self.rel} cannot be read: {e}") from None
        if not chunk:
            self._eof = True
            return False
        self._read += len(chunk)
        if self._read > self.limit:
            raise IngestError("too_large", f"{self.rel} is above {self.limit} bytes (read)")
        self._buf, self._off = self._buf[self._off :] + chunk, 0
        return True

    def _left(self) -> int:
        return len(self._buf) - self._off

    def skip(self, n: int) -> None:
        """Read past ``n`` bytes, holding none of them."""
        while n > 0:
            if not self._left() and not self._fill():
                return
            take = min(n, self._left())
            self._off, self.pos, n = self._off + take, self.pos + take, n - take

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> bytes:
        end = self._buf.find(b"\n", self._off)
        while end < 0 and self._left() <= LINE_MAX_BYTES:
            seen = self._left()  # searched already: only the new chunk is searched
            if not self._fill():
                break
            end = self._buf.find(b"\n", seen)
        if not self._left():
            raise StopIteration
        if end < 0 and self._left() > LINE_MAX_BYTES:  # read past it, in chunks
            while True:
                self.pos += self._left()
                self._buf, self._off = b"", 0
                if not self._fill():
                    raise _TooLong
                end = self._buf.find(b"\n")
                if end >= 0:
                    self._off, self.pos = end + 1, self.pos + end + 1
                    raise _TooLong
        stop = len(self._buf) if end < 0 else end + 1
        line = self._buf[self._off : stop]
        self._off = stop
        self.pos += len(line)
        if self.pos - self.record_start > LINE_MAX_BYTES:  # a record over many lines
            raise _TooLong
        return line


def _decoded(stream: Stream) -> Iterator[str]:
    """The lines as text for the csv module (bytes that are not UTF-8 kept as surrogates, so
    a row can say ``not_utf8`` instead of failing the file)."""
    for line in stream:
        yield line.decode("utf-8", "surrogateescape")


#: The surrogates ``surrogateescape`` keeps a byte that is not UTF-8 as (searched in C: a
#: Python loop over every character was 70% of a .tsv.gz list's registration)
_ESCAPED = re.compile("[\udc80-\udcff]")


def _not_utf8(values: list[str]) -> bool:
    return any(_ESCAPED.search(v) for v in values)


def _csv_records(
    stream: Stream, delim: str, header: list[str], want: list[str]
) -> Iterator[Record]:
    lines = _decoded(stream)
    reader = csv.reader(lines, delimiter=delim)
    width = len(header)
    at = {c: header.index(c) for c in want}
    while True:
        stream.record_start = stream.pos
        try:
            fields = next(reader)
        except StopIteration:
            return
        except _TooLong:
            yield None, ("field_too_large", f"a line above {LINE_MAX_BYTES} bytes")
            lines = _decoded(stream)  # the line read past ended the old generator
            reader = csv.reader(lines, delimiter=delim)
            continue
        except csv.Error as e:
            reason = "field_too_large" if "field limit" in str(e) else "bad_row"
            yield None, (reason, f"csv: {e}")
            continue
        if not fields:
            continue  # a blank line is not a row
        if _not_utf8(fields):
            yield None, ("not_utf8", "the row holds bytes that are not UTF-8")
        elif len(fields) != width:
            yield None, ("bad_row", f"the row has {len(fields)} fields, the header {width}")
        else:
            yield {c: fields[i] for c, i in at.items()}, None


def _jsonl_records(stream: Stream, want: list[str], seen: set[str]) -> Iterator[Record]:
    while True:
        stream.record_start = stream.pos
        try:
            line = next(stream)
        except StopIteration:
            return
        except _TooLong:
            yield None, ("field_too_large", f"a line above {LINE_MAX_BYTES} bytes")
            continue
        if not line.strip():
            continue
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError:
            yield None, ("not_utf8", "the line holds bytes that are not UTF-8")
            continue
        try:
            obj = json.loads(text.lstrip("\ufeff"))
        except ValueError:
            obj = None
        if not isinstance(obj, dict):
            yield None, ("bad_metadata", "the line is not a JSON object")
            continue
        seen.update(c for c in want if c in obj)
        yield {c: obj.get(c) for c in want}, None


def header_of(stream: Stream, delim: str, cfg: SourceConfig, rel: str, want: list[str]) -> list:
    """The csv/tsv header (its first line), checked for the columns the settings name."""
    try:
        first = next(stream)
    except StopIteration:
        first = b""
    except _TooLong:
        raise IngestError(
            "corrupt_container", f"{rel}: a header above {LINE_MAX_BYTES} bytes"
        ) from None
    text = first.decode("utf-8-sig", "replace").rstrip("\r\n")
    names = next(csv.reader([text], delimiter=delim), [])
    check_columns(names, cfg, rel, want)
    return names


def check_columns(names, cfg: SourceConfig, rel: str, want: list[str]) -> None:
    """SourceError (the user's fix) when the list lacks a column its settings name."""
    for col in want:
        if col not in names:
            key = next(k for k, v in columns(cfg).items() if v == col)
            raise SourceError(
                f"{rel} has no column {col!r} (the source's {key}); its columns: "
                f"{', '.join(map(str, names))}. Set {key} in the sources file"
            )


def columns(cfg: SourceConfig) -> dict[str, str]:
    """The columns a list must have, by setting: ``{url_field: ..., caption_field: ...}``
    (``hash_field``, ``id_field`` when set)."""
    want = {"url_field": cfg.url(), "caption_field": cfg.caption()}
    return want | {k: getattr(cfg, k) for k in ("hash_field", "id_field") if getattr(cfg, k)}


def open_text(f, rel: str, deadline_s: float | None) -> Stream:
    """A :class:`Stream` of list file ``f`` (a ``.tsv.gz`` decompressed as it is read)."""
    raw = gzip.GzipFile(fileobj=f) if rel.lower().endswith(".gz") else f
    return Stream(raw, rel, deadline_s)


def text_records(
    stream: Stream, cfg: SourceConfig, rel: str, header: list | None, check: bool = False
) -> Iterator[Record]:
    """The records of a text list read from ``stream``'s position (``header``: a csv/tsv's,
    read before); ``check``, for a jsonl: a SourceError at the end when no line had a column
    the settings name (a setting to fix, as a csv header's would be)."""
    want = list(columns(cfg).values())
    if rel.lower().endswith(".jsonl"):
        seen: set[str] = set()
        got_any = False
        for rec in _jsonl_records(stream, want, seen):
            got_any = got_any or rec[0] is not None
            yield rec
        if check and got_any and len(seen) < len(want):
            check_columns(sorted(seen), cfg, rel, want)
        return
    delim = "," if rel.lower().endswith(".csv") else "\t"
    yield from _csv_records(stream, delim, header or [], want)
