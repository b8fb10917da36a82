"""Benchmark: registering a URL list (a source of ``kind: urls``), against reading it plainly.

A text list is read once at registration (``ingest/sources/url_lists.py``): streamed in
bounded chunks, each row checked (width, UTF-8, field sizes, a jsonl object) and each
partition's stretch recorded. The reference is the plainest Python reader of the same file:
``for line in open(...)`` (or ``gzip.open``) with ``json.loads`` / ``csv.reader``, unbounded,
nothing checked or recorded. The ratio is flowmatch's time over the reference's; the rows a
second are scaled to PD12M's 12.4M rows.

Run: ``flowmatch bench url_list [--rows 1000000]``; ends with one JSON line.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import io
import json
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from flowmatch_assets.ingest.sources import SourceConfig, registry
from flowmatch_assets.ingest.sources.urls import UrlsKind

PD12M_ROWS = 12_400_000


def write_list(path: Path, rows: int, suffix: str) -> None:
    """``rows`` rows of a PD12M-like list (a URL and a ~60-character caption)."""
    pad = "a picture of something in the public domain"
    if suffix == ".jsonl":
        lines = (
            json.dumps({"url": f"https://h.example/{i}.jpg", "caption": f"{pad} {i}"}) + "\n"
            for i in range(rows)
        )
        path.write_text("".join(lines))
    else:
        text = "url\tcaption\n" + "".join(
            f"https://h.example/{i}.jpg\t{pad} {i}\n" for i in range(rows)
        )
        path.write_bytes(gzip.compress(text.encode(), compresslevel=1))


def plain_read(path: Path) -> int:
    """The reference: every row parsed, nothing bounded, checked or recorded."""
    n = 0
    if path.suffix == ".jsonl":
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    json.loads(line)
                    n += 1
        return n
    with gzip.open(path, "rb") as raw, io.TextIOWrapper(raw, encoding="utf-8") as f:
        reader = csv.reader(f, delimiter="\t")
        next(reader)
        for _ in reader:
            n += 1
    return n


def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        prog="flowmatch bench url_list", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--shard-size", type=int, default=10_000)
    a = p.parse_args(argv)
    out: dict = {"bench": "url_list", "rows": a.rows}
    with tempfile.TemporaryDirectory() as tmp:
        for suffix in (".jsonl", ".tsv.gz"):
            path = Path(tmp) / f"list{suffix}"
            write_list(path, a.rows, suffix)
            t0 = time.perf_counter()
            assert plain_read(path) == a.rows
            ref = time.perf_counter() - t0
            cfg = SourceConfig(kind=UrlsKind.name, location=str(path), shard_size=a.shard_size)
            t0 = time.perf_counter()
            scan = registry.register(Path(tmp) / f"data{suffix}", "lst", cfg)
            ours = time.perf_counter() - t0
            assert sum(m.end - m.start for m in scan.new) == a.rows
            name = suffix.lstrip(".").replace(".", "_")
            out[name] = {
                "bytes": path.stat().st_size,
                "register_s": round(ours, 4),
                "plain_read_s": round(ref, 4),
                "ratio": round(ours / ref, 2),
                "pd12m_register_s": round(ours * PD12M_ROWS / a.rows),
            }
            print(
                f"{suffix}: {a.rows:,} rows, register {ours:.2f} s vs a plain read {ref:.2f} s "
                f"({ours / ref:.2f}x); at PD12M's 12.4M rows ~{ours * PD12M_ROWS / a.rows:.0f} s",
                flush=True,
            )
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
