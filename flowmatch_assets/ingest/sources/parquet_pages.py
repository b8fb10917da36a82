"""A parquet column chunk's size as its pages say it, not as its footer says it.

The footer's ``total_uncompressed_size`` is the file's own word and can be falsified (a 70 KB
file whose footer said its columns were small peaked at 3.67 GB when read). What Arrow
allocates and decompresses into is each page's ``uncompressed_page_size``, in the page's own
header. :func:`pages_bytes` walks a chunk's page headers (Thrift compact protocol, the only
fields needed read, the rest skipped) and adds those sizes up, reading only the headers.
"""

from __future__ import annotations

#: The most bytes one page header is read for (real headers are tens of bytes; statistics can
#: make them a few KB).
HEADER_MAX_BYTES = 64 << 10
#: The most pages walked in one chunk (past it the chunk is taken as too large).
PAGES_MAX = 1 << 20


class BadPage(ValueError):
    """A page header that cannot be parsed."""


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    out = shift = 0
    while True:
        if i >= len(buf) or shift > 63:
            raise BadPage("a varint runs past the header")
        b = buf[i]
        i += 1
        out |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return out, i


def _zigzag(n: int) -> int:
    return (n >> 1) ^ -(n & 1)


def _skip(buf: bytes, i: int, kind: int, depth: int) -> int:
    """The offset after one value of compact type ``kind`` at ``i``."""
    if depth > 16:
        raise BadPage("nested too deep")
    if kind in (1, 2):  # booleans: in the field header
        return i
    if kind == 3:
        return i + 1
    if kind in (4, 5, 6):
        return _varint(buf, i)[1]
    if kind == 7:
        return i + 8
    if kind == 8:
        n, i = _varint(buf, i)
        return i + n
    if kind in (9, 10):  # list, set
        if i >= len(buf):
            raise BadPage("a list runs past the header")
        size, elem = buf[i] >> 4, buf[i] & 0x0F
        i += 1
        if size == 15:
            size, i = _varint(buf, i)
        for _ in range(size):
            i = i + 1 if elem in (1, 2) else _skip(buf, i, elem, depth + 1)
        return i
    if kind == 11:  # map
        size, i = _varint(buf, i)
        if size:
            kv = buf[i]
            i += 1
            for _ in range(size):
                i = _skip(buf, i, kv >> 4, depth + 1)
                i = _skip(buf, i, kv & 0x0F, depth + 1)
        return i
    if kind == 12:
        return _struct(buf, i, depth + 1, {})[1]
    raise BadPage(f"unknown type {kind}")


def _struct(buf: bytes, i: int, depth: int, want: dict) -> tuple[dict, int]:
    """Read a struct at ``i``: ``{field id: int value}`` of the integer fields in ``want``
    (and ``{field id: dict}`` of the struct fields in it, read with ``want[id]``)."""
    got: dict = {}
    last = 0
    while True:
        if i >= len(buf):
            raise BadPage("a struct runs past the header")
        head = buf[i]
        i += 1
        kind = head & 0x0F
        if kind == 0:
            return got, i
        delta = head >> 4
        if delta:
            fid = last + delta
        else:
            raw, i = _varint(buf, i)
            fid = _zigzag(raw)
        last = fid
        if fid in want and kind in (4, 5, 6):
            raw, i = _varint(buf, i)
            got[fid] = _zigzag(raw)
        elif fid in want and kind == 12:
            got[fid], i = _struct(buf, i, depth + 1, want[fid])
        else:
            i = _skip(buf, i, kind, depth)


#: PageHeader fields: 2 uncompressed_page_size, 3 compressed_page_size, 5 data_page_header
#: (1 num_values), 8 data_page_header_v2 (1 num_values)
_PAGE = {2: None, 3: None, 5: {1: None}, 8: {1: None}}


def page_header(buf: bytes) -> tuple[int, int, int, int]:
    """``(uncompressed size, compressed size, values, header length)`` of the page header at
    the start of ``buf``."""
    got, n = _struct(buf, 0, 0, _PAGE)
    if 2 not in got or 3 not in got:
        raise BadPage("a page header without its sizes")
    values = (got.get(5) or got.get(8) or {}).get(1, 0)
    return got[2], got[3], values, n


def pages_bytes(f, start: int, values: int, file_size: int, limit: int) -> int:
    """The uncompressed bytes of the pages of a column chunk that starts at ``start`` and holds
    ``values`` values, by their headers, read from file ``f``; stops once past ``limit``
    (the answer is then above it). Raises BadPage for a header that cannot be parsed or a page
    that lies past the end of the file."""
    total = seen = pages = 0
    pos = start
    while seen < values and total <= limit:
        if pos < 0 or pos >= file_size or pages >= PAGES_MAX:
            raise BadPage(f"a page at offset {pos} of a {file_size}-byte file")
        f.seek(pos)
        head = f.read(min(HEADER_MAX_BYTES, file_size - pos))
        size, stored, n, hlen = page_header(head)
        if size < 0 or stored < 0:
            raise BadPage("a page header with a negative size")
        total += size
        seen += n
        pages += 1
        pos += hlen + stored
    return total
