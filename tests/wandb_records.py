"""Read the history rows of an offline W&B run file (``run-<id>.wandb``) without a server.

wandb >= 0.2x writes records in LevelDB's log format (32 KiB blocks; each chunk has a crc32,
a length and a type: FULL, FIRST, MIDDLE or LAST) after a 7-byte ``:W&B`` header; each record
is a ``wandb_internal_pb2.Record``. Its own Python reader is gone, so tests use this one.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

BLOCK = 32768
FULL, LAST = 1, 4


def records(path: str | Path) -> Iterator:
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path}: not a W&B run file")
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # block trailer
            pos += left
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if n == 0 and kind == 0:
            pos += left
            continue
        buf += data[pos + 7 : pos + 7 + n]
        pos += 7 + n
        if kind in (FULL, LAST):
            rec = pb.Record()
            rec.ParseFromString(buf)
            buf = b""
            yield rec


def history(path: str | Path) -> list[dict]:
    """The logged rows (``run.log`` calls) of one run file, in order."""
    return [
        {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
        for r in records(path)
        if r.HasField("history")
    ]


def config(path: str | Path) -> dict:
    """The run config (``wandb.config``) recorded in one run file, merged in order."""
    out: dict = {}
    for r in records(path):
        if r.HasField("run"):
            items = r.run.config.update
        elif r.HasField("config"):
            items = r.config.update
        else:
            continue
        for i in items:
            key = i.key or "/".join(i.nested_key)
            out[key] = json.loads(i.value_json)
    return out
