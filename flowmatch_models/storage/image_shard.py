"""The images shard format: one parquet file per partition.

Columns: ``id, caption, image (encoded RGB), format, orig_width, orig_height, md5, url, height,
width, kept``, row groups of 512 rows. ``height, width`` is the stored size (the square, or the
row's aspect-ratio bucket, flowmatch_models/data/buckets.py), ``kept`` the share of the original's
area the crop kept. Shards written before those three columns hold size x size squares:
:func:`read_image_meta` fills them in (``kept`` from the original's size). One file means one atomic rename; parquet means sequential, columnar
reads (captions without images) and no custom code to open it (pyarrow, DuckDB, pandas).
"""

from __future__ import annotations

import io
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from flowmatch_models.storage import remote
from flowmatch_models.storage.atomic import atomic_path, write_parquet, written

IMAGE_SHARD_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("caption", pa.string()),
        ("image", pa.binary()),
        ("format", pa.string()),
        ("orig_width", pa.int32()),
        ("orig_height", pa.int32()),
        ("md5", pa.string()),
        ("url", pa.string()),
        ("height", pa.int32()),
        ("width", pa.int32()),
        ("kept", pa.float32()),
    ]
)
#: Columns a shard written before aspect-ratio buckets lacks (:func:`read_image_meta` fills them).
SIZE_COLUMNS = ("height", "width", "kept")
ROW_GROUP = 512


def write_image_shard(path: str | Path, rows: Sequence[dict]) -> int:
    """Write ``rows`` (dicts with the schema's keys) atomically; returns the file size."""
    table = pa.Table.from_pylist(list(rows), schema=IMAGE_SHARD_SCHEMA)
    with atomic_path(path) as tmp:
        # images are already compressed: don't spend time re-compressing that column
        write_parquet(
            table,
            tmp,
            row_group_size=ROW_GROUP,
            compression={c: ("NONE" if c == "image" else "ZSTD") for c in table.column_names},
        )
    return written(path).stat().st_size  # inside a deferred publish: the temp file


def read_image_meta(path: str | Path, size: int = 256, images: bool = False) -> pa.Table:
    """Every column but the image bytes (``images``: with them), in today's schema (a shard
    from before buckets: ``height = width = size``, the square it holds, and ``kept`` = short
    side / long side of the original)."""
    path = remote.ensure(path)  # with a remote data root: in this machine's cache first
    have = set(pq.read_schema(path).names)
    cols = [n for n in IMAGE_SHARD_SCHEMA.names if (images or n != "image") and n in have]
    t = pq.read_table(path, columns=cols)
    if all(c in have for c in SIZE_COLUMNS):
        return t
    n = t.num_rows
    ow = t.column("orig_width").to_numpy(zero_copy_only=False).astype(np.float64)
    oh = t.column("orig_height").to_numpy(zero_copy_only=False).astype(np.float64)
    kept = (np.minimum(ow, oh) / np.maximum(ow, oh)).astype(np.float32) if n else []
    t = t.append_column("height", pa.array(np.full(n, size, np.int32)))
    t = t.append_column("width", pa.array(np.full(n, size, np.int32)))
    return t.append_column("kept", pa.array(kept, pa.float32()))


def decode(data: bytes) -> np.ndarray:
    """Encoded image bytes -> HxWx3 uint8."""
    with Image.open(io.BytesIO(data)) as im:
        return np.asarray(im.convert("RGB"))


def iter_image_batches(
    path: str | Path, batch_size: int = 64, threads: int = 1
) -> Iterator[tuple[list[str], list[str], list[np.ndarray]]]:
    """Sequentially yield ``(ids, captions, images)`` batches of a shard: each image uint8
    ``[H, W, 3]`` at its stored size (one size in square mode; its bucket's in aspect mode).
    ``threads`` > 1: a batch's images are decoded by that many threads (Pillow's decoder
    releases the GIL), in order."""
    pf = pq.ParquetFile(remote.ensure(path))
    pool = (
        ThreadPoolExecutor(threads, thread_name_prefix="flowmatch-decode") if threads > 1 else None
    )
    try:
        for batch in pf.iter_batches(batch_size=batch_size, columns=["id", "caption", "image"]):
            d = batch.to_pydict()
            images = list(pool.map(decode, d["image"])) if pool else [decode(b) for b in d["image"]]
            yield d["id"], d["caption"], images
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
