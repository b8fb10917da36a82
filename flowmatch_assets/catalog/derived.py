"""What a record's writer derives from it, so that no catalog query has to (issue 28).

- ``record_card_rows`` -> :func:`write_card_summary`: the partition's data card as counts,
  exact statistics and bins (``<root>/catalog/card_summaries/<partition>.parquet``), from its
  card records and its metadata and image row records as they are when the card is written.
- ``record_content`` -> :func:`write_content_hashes`: the sorted 64-bit hashes of the md5s it
  stored (``<root>/catalog/content_hashes/<partition>.u64``), which find repeated bytes across
  PD12M's ~12M stored rows without reading their strings.

Each records what it was made from (file identities), and :mod:`.summary` redoes it when one of
those changed since (a retried images, a content duplicate found later). No DuckDB.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from flowmatch_assets.catalog import outcome_rules
from flowmatch_assets.catalog.record_kinds import record_path
from flowmatch_models.data import exclude as exclusions
from flowmatch_models.storage.atomic import atomic_path, write_parquet
from flowmatch_models.storage.layout import DataLayout

# ------------------------------------------------------------------------------- writing


def _replace(path: Path, write) -> None:
    """``write(tmp)`` then rename onto ``path`` (:func:`atomic_path`): readers see the old file
    or the new one, a failed write (a full disk) leaves no temp file, and inside a
    partition's publish (defs/routine.py) the rename waits for the partition's other files."""
    with atomic_path(path) as tmp:
        write(tmp)


def _write_bytes(path: Path, data: bytes) -> None:
    _replace(path, lambda tmp: tmp.write_bytes(data))


def _write_table(path: Path, table: pa.Table) -> None:
    _replace(path, lambda tmp: write_parquet(table, tmp))


def card_summary_path(layout: DataLayout, partition: str) -> Path:
    """A partition's data card summary: written with its card records (``record_card_rows``),
    redone by :func:`refresh` when one of its inputs changed since."""
    return layout.catalog_dir / "card_summaries" / f"{partition}.parquet"


#: One partition's data card: ``item`` (a count section's value) or ``value`` (one value of a
#: distribution), and how many rows have it.
CARD_SUMMARY_SCHEMA = pa.schema(
    [
        ("partition", pa.string()),
        ("section", pa.string()),
        ("item", pa.string()),
        ("value", pa.float64()),
        ("n", pa.int64()),
    ]
)

#: The data card's distributions: section -> how a stored row's value is read.
CARD_STATS = ("kept", "caption_chars", "caption_tokens", "orig_long_side", "orig_short_side")
#: Values of a distribution are kept exactly below this (whole numbers) ...
EXACT_BELOW = 256
#: ... and above it in bins of this relative width (a mergeable sketch: the dataset's
#: quantiles are within half a bin, 0.5%, of the exact ones; a partition's are exact).
BIN_RATIO = 1.01
_LOG_RATIO = float(np.log(BIN_RATIO))


def _bins(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(bin value, rows) of the values ``x``: whole numbers below :data:`EXACT_BELOW` exactly,
    others at the nearest power of :data:`BIN_RATIO` (rounded, if all are whole numbers)."""
    whole = x == np.floor(x)
    with np.errstate(divide="ignore", invalid="ignore"):
        binned = np.exp(np.round(np.log(x) / _LOG_RATIO) * _LOG_RATIO)
    if whole.all():  # whole numbers stay whole (a bin above EXACT_BELOW is > 2 wide)
        binned = np.round(binned)
    v = np.where((whole & (x < EXACT_BELOW)) | (x <= 0), x, binned)
    return np.unique(v, return_counts=True)


def _aspect_bucket(a: np.ndarray) -> np.ndarray:
    edges = np.array([1.25, 1.5, 2.0, 3.0])
    names = np.array(["1-1.25", "1.25-1.5", "1.5-2", "2-3", ">=3"], dtype=object)
    return names[np.searchsorted(edges, a, side="right")]


def _outcomes(
    cards: pa.Table,
    meta: pa.Table | None,
    images: pa.Table | None,
    losers: set[str],
    near: set[str] = frozenset(),
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each card row's final outcome and reason by the ``dataset_rows`` rules (the metadata's;
    else the image stage's, ``pending`` before it ran, a content duplicate's ``filtered:
    duplicate_content``), and which card rows have a metadata row at all."""
    import pyarrow.compute as pc

    ids = cards.column("id")
    n = len(ids)

    def lookup(t: pa.Table | None):
        if t is None or not t.num_rows:
            return np.zeros(n, bool), np.full(n, None, object), np.full(n, None, object)
        idx = pc.index_in(ids, value_set=t.column("id"))
        has = pc.is_valid(idx).to_numpy(zero_copy_only=False)
        take = pc.fill_null(idx, 0)
        out = t.column("outcome").take(take).to_numpy(zero_copy_only=False)
        why = t.column("reason").take(take).to_numpy(zero_copy_only=False)
        return has, out, why

    has_m, m_out, m_why = lookup(meta)
    has_i, i_out, i_why = lookup(images)

    def among(which: set[str]) -> np.ndarray:
        if not which:
            return np.zeros(n, bool)
        value_set = pa.array(sorted(which), pa.string())
        return pc.is_in(ids, value_set=value_set).to_numpy(zero_copy_only=False)

    outcome, reason = outcome_rules.select(
        {
            "metadata.outcome": m_out,
            "metadata.reason": m_why,
            "images.has": has_i,
            "images.outcome": i_out,
            "images.reason": i_why,
            "content_duplicate": among(losers),
            "near_duplicate": among(near),
        }
    )
    return outcome, reason, has_m


def card_summary(
    partition: str,
    cards: pa.Table,
    meta: pa.Table | None,
    images: pa.Table | None,
    losers: set[str],
    near: set[str] = frozenset(),
) -> pa.Table:
    """One partition's data card from its card records and its metadata and image row
    records (``losers``: its stored rows whose bytes an earlier row stored; ``near``: those
    that lose to an earlier look-alike): rows per item of
    each count section, each distribution's exact p10 / p50 / p90 / mean / max (+ sum and
    count, which merge) and its bins (:func:`_bins`, which merge into the dataset's)."""
    import pyarrow.compute as pc

    outcome, reason, has_m = _outcomes(cards, meta, images, losers, near)
    keep = np.flatnonzero(has_m)  # a card row without a metadata row is no input row
    outcome, reason = outcome[keep], reason[keep]
    stored = outcome == "stored"
    rows = cards.take(pa.array(keep[stored], pa.int64()))
    out: list[tuple] = []

    def counts(section: str, values) -> None:
        vc = pc.value_counts(
            pa.array(values) if not isinstance(values, pa.ChunkedArray) else values.combine_chunks()
        )
        for v, k in zip(vc.field("values").to_pylist(), vc.field("counts").to_pylist()):
            out.append((section, "(none)" if v is None else str(v), None, int(k)))

    def floats(name: str) -> np.ndarray:
        if name not in rows.column_names:
            return np.full(rows.num_rows, np.nan)
        return rows.column(name).cast(pa.float64()).to_numpy(zero_copy_only=False)

    items = np.where(reason == None, outcome, outcome + ":" + reason.astype(str))  # noqa: E711
    counts("outcome", items.astype(str))
    for section in ("license", "source"):
        if section in rows.column_names:
            counts(section, rows.column(section).cast(pa.string()))
        else:
            counts(section, pa.nulls(rows.num_rows, pa.string()))
    w, h = floats("orig_width"), floats("orig_height")
    long_side, short_side = np.fmax(w, h), np.fmin(w, h)
    with np.errstate(divide="ignore", invalid="ignore"):
        aspect = long_side / short_side
    counts("aspect", _aspect_bucket(aspect[~np.isnan(w)]).astype(str))
    if "bucket" in rows.column_names:
        counts("bucket", rows.column("bucket").drop_null())
    values = {
        "kept": floats("kept"),
        "caption_chars": floats("caption_chars"),
        "caption_tokens": floats("caption_tokens"),
        "orig_long_side": long_side,
        "orig_short_side": short_side,
    }
    for section, x in values.items():
        x = x[~np.isnan(x)]
        if not len(x):
            continue
        q = np.quantile(x, [0.1, 0.5, 0.9])
        for item, v in zip(
            ("p10", "p50", "p90", "mean", "max", "sum", "count"),
            (*q, x.mean(), x.max(), x.sum(), len(x)),
        ):
            out.append((section, item, float(v), None))
        out += [(section, "bin", float(v), int(k)) for v, k in zip(*_bins(x))]
    for section, x in (("aspect_value", aspect), ("max_tokens", floats("max_tokens"))):
        x = x[~np.isnan(x)]
        out += [(section, "bin", float(v), int(k)) for v, k in zip(*_bins(x))]
    if rows.num_rows:
        tokens, most = floats("caption_tokens"), floats("max_tokens")
        with np.errstate(invalid="ignore"):
            over = int(np.sum(tokens > most))
        out.append(("text", "captions_over_max_tokens", None, over))
        out.append(("text", "tokenized", None, int(np.sum(~np.isnan(tokens)))))
    sections, items_, vals, ns = zip(*out) if out else ((), (), (), ())
    return pa.table(
        {
            "partition": pa.repeat(pa.scalar(partition, pa.string()), len(out)),
            "section": pa.array(sections, pa.string()),
            "item": pa.array(items_, pa.string()),
            "value": pa.array(vals, pa.float64()),
            "n": pa.array(ns, pa.int64()),
        },
        schema=CARD_SUMMARY_SCHEMA,
    )


def _ident(path: Path) -> list | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return [st.st_ino, st.st_size, st.st_mtime_ns]


def card_inputs(layout: DataLayout, partition: str, losers: set[str]) -> dict:
    """What a partition's card summary is made from: its card, metadata and image row records
    (inode, size, mtime), its content losers and its near duplicates."""
    return {
        "cards": _ident(record_path(layout, "cards", "data_card", partition)),
        "meta": _ident(record_path(layout, "rows", "metadata", partition)),
        "images": _ident(record_path(layout, "rows", "images", partition)),
        "losers": sorted(losers),
        "near": sorted(near_of(layout).get(partition, ())),
    }


#: The near duplicates' table (``ingest/neardup.py`` writes it; the ``near_duplicates`` view).
NEAR_SCHEMA = pa.schema(
    [
        ("partition", pa.string()),
        ("id", pa.string()),
        ("kept_partition", pa.string()),
        ("kept_id", pa.string()),
        ("detector", pa.string()),
        ("distance", pa.int32()),  # phash: bits that differ
        ("similarity", pa.float64()),  # dino_cls: cosine; phash: share of bits that agree
    ]
)


def near_path(layout: DataLayout) -> Path:
    """The stored rows that lose to an earlier look-alike, as last decided."""
    return layout.root / exclusions.NEAR_DUPLICATES  # training skips them too


_NEAR_CACHE: dict[str, tuple] = {}


def near_of(layout: DataLayout) -> dict[str, set[str]]:
    """partition -> the ids of its near duplicates (read once per version of the table)."""
    p = near_path(layout)
    ident = _ident(p)
    hit = _NEAR_CACHE.get(str(p))
    if hit is not None and hit[0] == ident:
        return hit[1]
    out: dict[str, set[str]] = {}
    if ident is not None:
        t = pq.read_table(p, columns=["partition", "id"])
        for k, i in zip(t.column("partition").to_pylist(), t.column("id").to_pylist()):
            out.setdefault(k, set()).add(i)
    _NEAR_CACHE[str(p)] = (ident, out)
    return out


def losers_path(layout: DataLayout) -> Path:
    """The stored rows whose bytes an earlier row stored too (written by :mod:`.summary`)."""
    return layout.root / exclusions.CONTENT_LOSERS  # training skips them too


def losers_of(layout: DataLayout, partitions: Iterable[str]) -> dict[str, set[str]]:
    """The ids of each partition's stored rows whose bytes an earlier row stored too."""
    p = losers_path(layout)
    want = set(partitions)
    out: dict[str, set[str]] = {k: set() for k in want}
    if p.exists():
        t = pq.read_table(p, columns=["partition", "id"])
        for k, i in zip(t.column("partition").to_pylist(), t.column("id").to_pylist()):
            if k in want:
                out[k].add(i)
    return out


def write_card_summary(layout: DataLayout, partition: str, losers: set[str] | None = None) -> None:
    """Summarise one partition's data card from its records as they are now (the data card
    asset calls it when it writes the card records, so that no catalog query has to); its
    inputs' identities go into the file, so a refresh redoes it only when one changed."""
    if losers is None:
        losers = losers_of(layout, [partition])[partition]
    inputs = card_inputs(layout, partition, losers)  # before reading: a later change shows

    def read(path: Path, columns=None) -> pa.Table | None:
        try:
            return pq.read_table(path, columns=columns)
        except FileNotFoundError:
            return None

    cards = read(record_path(layout, "cards", "data_card", partition))
    if cards is None:
        card_summary_path(layout, partition).unlink(missing_ok=True)
        return
    cols = ["id", "outcome", "reason"]
    t = card_summary(
        partition,
        cards,
        read(record_path(layout, "rows", "metadata", partition), cols),
        read(record_path(layout, "rows", "images", partition), cols),
        losers,
        near_of(layout).get(partition, set()),
    )
    t = t.replace_schema_metadata({"flowmatch_inputs": json.dumps(inputs)})
    _write_table(card_summary_path(layout, partition), t)


# ------------------------------------------------------------------------- content hashes

_HEX = np.full(256, 255, np.uint8)
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX[_c] = _HEX[ord(chr(_c).upper())] = _i


def md5_hashes(md5: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """A 64-bit hash of each md5 (its first 16 hex digits; another string: sha256 of it),
    nulls left out: what finds the repeated md5s without holding the strings."""
    import hashlib

    import pyarrow.compute as pc

    arr = md5.combine_chunks() if isinstance(md5, pa.ChunkedArray) else md5
    arr = arr.drop_null().cast(pa.string())
    n = len(arr)
    if not n:
        return np.zeros(0, np.uint64)
    hexed = pc.fill_null(pc.match_substring_regex(arr, "^[0-9a-fA-F]{16}"), False)
    head = pc.utf8_slice_codeunits(pc.if_else(hexed, arr, pa.scalar("0" * 16)), 0, 16)
    fixed = head.cast(pa.binary()).cast(pa.binary(16))
    raw = np.frombuffer(fixed.buffers()[1], np.uint8)[fixed.offset * 16 : (fixed.offset + n) * 16]
    nib = _HEX[raw.reshape(n, 16)].astype(np.uint64)
    h = np.zeros(n, np.uint64)
    for k in range(16):
        h = (h << np.uint64(4)) | nib[:, k]
    for i in np.flatnonzero(~hexed.to_numpy(zero_copy_only=False)):
        digest = hashlib.sha256(arr[int(i)].as_py().encode()).digest()
        h[i] = np.frombuffer(digest[:8], ">u8")[0]
    return h


def content_hashes_path(layout: DataLayout, partition: str) -> Path:
    """A partition's sorted md5 hashes: ``[inode, size, mtime_ns]`` of the content record they
    were made from (3 x uint64), then the hashes (uint64)."""
    return layout.catalog_dir / "content_hashes" / f"{partition}.u64"


def write_content_hashes(layout: DataLayout, partition: str, md5, ident: list[int]) -> None:
    """Write a partition's md5 hashes (``record_content`` calls it with the record it wrote)."""
    h = np.sort(md5_hashes(md5))
    _write_bytes(
        content_hashes_path(layout, partition), np.asarray(ident, np.uint64).tobytes() + h.tobytes()
    )
