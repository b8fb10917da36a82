"""Walking a JPEG's marker segments without decoding it: its EXIF orientation (as Pillow reads
it) and how many scans it has (a progressive JPEG decodes every scan over the whole image), so
that :mod:`.decode` can orient and refuse before any pixel is decoded. The bytes are untrusted:
every read is bounded by the data's length."""

from __future__ import annotations

import re

_EXIF_ORIENTATION_TAG = 0x0112


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


#: The byte before a marker inside entropy-coded data: 0xFF not followed by a stuffed 0x00, a
#: restart marker (RST0-7, part of the scan) or a fill byte.
_MARKER_IN_SCAN = re.compile(rb"\xff(?=[^\x00\xd0-\xd7\xff])")


def jpeg_scans(data: bytes, stop: int) -> int:
    """How many scans (SOS segments) a JPEG has, counted by walking its markers without
    decoding: a progressive JPEG decodes every scan over the whole image (a 1.4 MB file of
    10000 x 9999 with 7,000 scans decodes for 45 s). Bytes between segments are skipped to the
    next marker, as the decoder resynchronises. Stops counting past ``stop``."""
    n, i, size = 0, 2, len(data)
    while i + 4 <= size and n <= stop:
        if data[i] != 0xFF:
            # garbage between segments: libjpeg's next_marker skips to the next 0xFF (warning
            # "extraneous bytes") and goes on decoding, so the count goes on from there too
            i = data.find(b"\xff", i)
            if i < 0:
                break
            continue
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker == 0x00:  # a stuffed 0xFF outside a scan: not a marker, skipped the same way
            i += 2
            continue
        if marker == 0xD9:  # end of image
            break
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # no length field
            i += 2
            continue
        i += 2 + int.from_bytes(data[i + 2 : i + 4], "big")
        if marker == 0xDA:  # start of scan: its entropy-coded data runs to the next marker
            n += 1
            m = _MARKER_IN_SCAN.search(data, i)
            if m is None:
                break
            i = m.start()
    return n
