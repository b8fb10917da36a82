"""The images_256 shard format: one parquet file per partition.

Columns: ``id, caption, image (encoded 256x256 RGB), format, orig_width, orig_height, md5, url``,
row groups of 512 rows. One file means one atomic rename; parquet means sequential, columnar
reads (captions without images) and no custom code to open it (pyarrow, DuckDB, pandas).
"""

from __future__ import annotations

import io
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from flowmatch_models.atomic import atomic_path

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
    ]
)
ROW_GROUP = 512


def write_image_shard(path: str | Path, rows: Sequence[dict]) -> int:
    """Write ``rows`` (dicts with the schema's keys) atomically; returns the file size."""
    table = pa.Table.from_pylist(list(rows), schema=IMAGE_SHARD_SCHEMA)
    with atomic_path(path) as tmp:
        # images are already compressed: don't spend time re-compressing that column
        pq.write_table(
            table,
            tmp,
            row_group_size=ROW_GROUP,
            compression={c: ("NONE" if c == "image" else "ZSTD") for c in table.column_names},
        )
    return Path(path).stat().st_size


def read_image_meta(path: str | Path) -> pa.Table:
    """Every column but the image bytes."""
    cols = [n for n in IMAGE_SHARD_SCHEMA.names if n != "image"]
    return pq.read_table(path, columns=cols)


def decode(data: bytes) -> np.ndarray:
    """Encoded image bytes -> HxWx3 uint8."""
    with Image.open(io.BytesIO(data)) as im:
        return np.asarray(im.convert("RGB"))


def iter_image_batches(
    path: str | Path, batch_size: int = 64
) -> Iterator[tuple[list[str], list[str], np.ndarray]]:
    """Sequentially yield ``(ids, captions, images uint8 [B, H, W, 3])`` batches of a shard."""
    pf = pq.ParquetFile(path)
    for batch in pf.iter_batches(batch_size=batch_size, columns=["id", "caption", "image"]):
        d = batch.to_pydict()
        yield d["id"], d["caption"], np.stack([decode(b) for b in d["image"]])
