"""Near-duplicates, the perceptual detector: a 64-bit DCT hash (pHash) and a colour signature
of every stored 256 px image, and which stored rows lose to an earlier look-alike (Hamming
distance <= a threshold, and colours within a tolerance).

**The hashes** are a pure function of a partition's images shard: :func:`phash_partition`
reads the shard once and writes ``<root>/catalog/neardup/phash/<partition>.parquet`` (``id``,
``position``, ``phash``, ``colour``; atomic, tagged with the shard's identity and the record's
version: a rewritten shard, or a record of an older version, is hashed again, an unchanged one
never). No model, no GPU, no network; ~1 ms an image (the decode).

**The decision** (:func:`near_duplicates`) reads those small records only (40 bytes a row; no
image of an older partition is read again) and walks every stored row in dataset order
(partition, position): a row loses to the earliest row *kept* before it whose hash is within
``threshold`` bits of its own and whose colour signature agrees within ``colour_tolerance``
(:mod:`.neardup_colour`: the hash is grey, so without it the same shape at the same place in
another colour is a "copy"). The rule depends on the set of records and the two settings
alone, never on which partition was materialized first, so any order keeps the same samples.
The settings belong to this decision only: changing them rewrites no images shard and no
embedding (nothing upstream of the decision reads them).

The hash (as ``imagehash.phash``): the image in grey, resized to 32x32 (box filter), its 2-D
DCT-II, the 8x8 lowest frequencies, one bit per coefficient above their median. Re-encodes,
0.5x resizes, crops of a few per cent and thin borders stay within ~10 bits; unrelated images
of the same shape and colour differ in ~20-40, of the same shape and place in another colour
in as few as 6 (there the colour check decides; ``tests/test_neardup.py``).
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image
from scipy.fft import dctn

from flowmatch_assets.catalog.derived import NEAR_SCHEMA, near_path
from flowmatch_assets.ingest.neardup_colour import (
    DEFAULT_TOLERANCE,
    SIGNATURE_BYTES,
    check_tolerance,
    colour_signature,
    pairs_agree,
)
from flowmatch_assets.ingest.neardup_index import decide_incremental
from flowmatch_assets.ingest.neardup_semantic import decide_clustered, stored_centroids
from flowmatch_models.storage import remote
from flowmatch_models.storage.atomic import atomic_path
from flowmatch_models.storage.layout import DataLayout

#: Bits that may differ between a row and the earlier row it duplicates (the default setting).
DEFAULT_THRESHOLD = 10
#: The largest colour difference (:mod:`.neardup_colour`) between them (the default setting).
DEFAULT_COLOUR_TOLERANCE = DEFAULT_TOLERANCE
#: How a record's rows are stored.
PHASH_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("position", pa.int32()),
        ("phash", pa.uint64()),
        ("colour", pa.list_(pa.uint8(), SIGNATURE_BYTES)),
    ]
)
#: The records' version: a record of another (older: no colour) is written again.
RECORD_VERSION = "2"
_BITS = (1 << np.arange(63, -1, -1, dtype=np.uint64)).astype(np.uint64)


# ------------------------------------------------------------------------------- the hash


def phash_pixels(grey32: np.ndarray) -> np.ndarray:
    """uint64 pHash of each ``[N, 32, 32]`` grey image (float)."""
    d = dctn(np.asarray(grey32, np.float64), type=2, axes=(1, 2), norm="ortho")[:, :8, :8]
    flat = d.reshape(len(d), 64)
    bits = flat > np.median(flat, axis=1, keepdims=True)
    return (bits.astype(np.uint64) * _BITS).sum(axis=1, dtype=np.uint64)


def trimmed(image: Image.Image | np.ndarray | bytes) -> Image.Image:
    """An image (PIL, HxWx3 uint8 or encoded bytes) in RGB without its flat frame (what the
    hash and the colour signature read)."""
    if isinstance(image, bytes):
        with Image.open(io.BytesIO(image)) as im:
            return trimmed(im.convert("RGB"))
    im = Image.fromarray(image) if isinstance(image, np.ndarray) else image
    im = im.convert("RGB")
    top, bottom, left, right = _flat_border(np.asarray(im.convert("L"), np.int16))
    if bottom - top >= 8 and right - left >= 8:
        im = im.crop((left, top, right, bottom))
    return im


def _grey32(trim: Image.Image) -> np.ndarray:
    return np.asarray(trim.convert("L").resize((32, 32), Image.BOX), np.float64)


def grey32(image: Image.Image | np.ndarray | bytes) -> np.ndarray:
    """An image (PIL, HxWx3 uint8 or encoded bytes) as the 32x32 grey array the hash reads."""
    return _grey32(trimmed(image))


def _flat_border(a: np.ndarray, tol: int = 6, most: float = 0.25) -> tuple[int, int, int, int]:
    """(top, bottom, left, right) of ``a`` without its flat frame: the outer rows and columns
    of one colour (each pixel within ``tol`` of the frame's, at most ``most`` of a side), so an
    added border (a mat, a scan's margin) does not move the hash."""
    h, w = a.shape

    def run(lines: np.ndarray, limit: int) -> int:
        ref = np.median(lines[0])
        flat = np.abs(lines[:limit] - ref).max(axis=1) <= tol
        return int(limit if flat.all() else np.argmin(flat))

    top = run(a, int(h * most))
    bottom = h - run(a[::-1], int(h * most))
    left = run(a.T, int(w * most))
    right = w - run(a.T[::-1], int(w * most))
    return top, bottom, left, right


def phash(images: list) -> np.ndarray:
    """uint64 pHash of each image (PIL, array or encoded bytes)."""
    return signatures(images)[0]


def signatures(images: list) -> tuple[np.ndarray, np.ndarray]:
    """(uint64 pHash, uint8 ``[N, 32]`` colour signature) of each image (PIL, array or encoded
    bytes), each image decoded and trimmed once."""
    if not images:
        return np.zeros(0, np.uint64), np.zeros((0, SIGNATURE_BYTES), np.uint8)
    trims = [trimmed(i) for i in images]
    return phash_pixels(np.stack([_grey32(t) for t in trims])), colours_of(trims)


def colours_of(trims: list[Image.Image]) -> np.ndarray:
    return np.stack([colour_signature(t) for t in trims])


def hamming(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Bits that differ between uint64 hashes (broadcast)."""
    return np.bitwise_count(np.bitwise_xor(a, b)).astype(np.int32)


# ------------------------------------------------------------------- the per-partition record


def phash_dir(root: str | Path) -> Path:
    return DataLayout(root).catalog_dir / "neardup" / "phash"


def _shard_identity(shard: Path) -> str:
    st = shard.stat()
    return f"{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"


def phash_partition(root: str | Path, partition: str, batch: int = 256) -> Path:
    """The pHash and colour record of ``partition``'s images shard (written when missing, when
    the shard changed since or when the record is of another version; the shard's images are
    read in batches, never all at once)."""
    layout = DataLayout(root)
    shard = Path(remote.ensure(layout.asset_path("images", partition)))
    out = phash_dir(root) / f"{partition}.parquet"
    ident = _shard_identity(shard)
    if out.exists():
        meta = pq.read_schema(out).metadata or {}
        if (meta.get(b"flowmatch_shard"), meta.get(b"flowmatch_record")) == (
            ident.encode(),
            RECORD_VERSION.encode(),
        ):
            return out
    ids, hashes, colours = [], [np.zeros(0, np.uint64)], [np.zeros((0, SIGNATURE_BYTES), np.uint8)]
    pf = pq.ParquetFile(shard)
    for b in pf.iter_batches(batch_size=batch, columns=["id", "image"]):
        d = b.to_pydict()
        ids += [str(i) for i in d["id"]]
        h, c = signatures(d["image"])
        hashes.append(h)
        colours.append(c)
    c = np.concatenate(colours)
    t = pa.table(
        {
            "id": ids,
            "position": np.arange(len(ids), dtype=np.int32),
            "phash": np.concatenate(hashes),
            "colour": pa.FixedSizeListArray.from_arrays(pa.array(c.ravel()), SIGNATURE_BYTES),
        },
        schema=PHASH_SCHEMA.with_metadata(
            {"flowmatch_shard": ident, "flowmatch_record": RECORD_VERSION}
        ),
    )
    with atomic_path(out) as tmp:
        pq.write_table(t, tmp)
    return out


# ------------------------------------------------------------------------------ the decision


@dataclass
class HashRows:
    """Every hashed row in dataset order."""

    partition: np.ndarray  # object
    id: np.ndarray  # object
    phash: np.ndarray  # uint64
    colour: np.ndarray  # uint8 [N, 32]


def read_record(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids, hashes, colour signatures) of one record, in position order."""
    t = pq.read_table(path).sort_by("position")
    colour = t.column("colour").combine_chunks().flatten().to_numpy(zero_copy_only=False)
    return (
        np.asarray(t.column("id").to_pylist(), object),
        t.column("phash").to_numpy(),
        np.asarray(colour, np.uint8).reshape(t.num_rows, SIGNATURE_BYTES),
    )


def read_hashes(root: str | Path, partitions: list[str] | None = None) -> HashRows:
    """The pHash records of ``partitions`` (default: every one written), in dataset order."""
    d = phash_dir(root)
    names = sorted(p.stem for p in d.glob("*.parquet")) if d.is_dir() else []
    if partitions is not None:
        names = sorted(set(names) & set(partitions))
    parts, ids, hs, cs = [], [], [], []
    for n in names:
        i, h, c = read_record(d / f"{n}.parquet")
        ids.append(i)
        hs.append(h)
        cs.append(c)
        parts.append(np.full(len(i), n, object))
    if not names:
        empty = np.zeros(0, object)
        return HashRows(empty, empty, np.zeros(0, np.uint64), colours_of([]))
    return HashRows(*(np.concatenate(x) for x in (parts, ids, hs, cs)))


def _greedy(n: int, score, ok, block: int = 1024) -> tuple[np.ndarray, np.ndarray]:
    """(winner index or -1, score) of each of ``n`` rows in order: row ``i`` loses to the first
    kept row ``j < i`` with ``ok(score(i, j))``. A block of rows is compared with every kept row
    before it at once (``score(rows, kept)``: a matrix), then its rows among themselves in order."""
    winner = np.full(n, -1, np.int64)
    best = np.zeros(n, np.float64)
    kept_idx = np.zeros(0, np.int64)
    for s in range(0, n, block):
        rows = np.arange(s, min(n, s + block))
        if len(kept_idx):
            sc = score(rows, kept_idx)
            near = ok(sc)
            first = near.argmax(axis=1)  # kept_idx ascends: the earliest kept row
            for k in np.flatnonzero(near.any(axis=1)):
                winner[s + k], best[s + k] = kept_idx[first[k]], sc[k, first[k]]
        new_kept: list[int] = []
        for i in rows:
            if winner[i] >= 0:
                continue
            if new_kept:
                sk = score(np.array([i]), np.asarray(new_kept))[0]
                j = int(np.argmax(ok(sk)))
                if ok(sk[j]):
                    winner[i], best[i] = new_kept[j], sk[j]
                    continue
            new_kept.append(int(i))
        kept_idx = np.concatenate([kept_idx, np.asarray(new_kept, np.int64)])
    return winner, best


def decide(
    hashes: np.ndarray,
    threshold: int,
    colours: np.ndarray,
    tolerance: int = DEFAULT_COLOUR_TOLERANCE,
    block: int = 1024,
) -> tuple[np.ndarray, np.ndarray]:
    """(winner index or -1, distance) of each row in order: row ``i`` loses to the first kept
    row ``j < i`` within ``threshold`` bits (uint64 XOR + popcount) whose colour signature is
    within ``tolerance`` of its own (checked for the hash's matches only)."""
    colours = np.asarray(colours, np.uint8)

    def score(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        d = hamming(hashes[a][:, None], hashes[b][None, :])
        r, k = np.nonzero(d <= threshold)
        off = ~pairs_agree(colours, a[r], colours, b[k], tolerance)
        d[r[off], k[off]] = 65  # beyond any threshold: no match
        return d

    w, d = _greedy(len(hashes), score, lambda sc: sc <= threshold, block)
    return w, d.astype(np.int32)


def decide_cosine(
    vectors: np.ndarray, min_cosine: float, block: int = 1024
) -> tuple[np.ndarray, np.ndarray]:
    """(winner index or -1, cosine) of each row in order: row ``i`` loses to the first kept
    row ``j < i`` whose vector's cosine with its own is >= ``min_cosine``."""
    v = np.asarray(vectors, np.float32)
    v = v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)
    return _greedy(len(v), lambda a, b: v[a] @ v[b].T, lambda sc: sc >= min_cosine, block)


def _table(partition, ids, lost, winner, detector: str, distance, similarity) -> pa.Table:
    w = winner[lost]
    return pa.table(
        {
            "partition": partition[lost].tolist(),
            "id": ids[lost].tolist(),
            "kept_partition": partition[w].tolist(),
            "kept_id": ids[w].tolist(),
            "detector": [detector] * len(lost),
            "distance": distance,
            "similarity": similarity,
        },
        schema=NEAR_SCHEMA,
    )


def near_duplicates(
    root: str | Path,
    threshold: int = DEFAULT_THRESHOLD,
    partitions: list[str] | None = None,
    brute: bool = False,
    colour_tolerance: int = DEFAULT_COLOUR_TOLERANCE,
) -> pa.Table:
    """The stored rows that lose to an earlier kept look-alike (:data:`NEAR_SCHEMA`;
    similarity: the share of the 64 bits that agree): by the kept decision and its index
    (:mod:`.neardup_index`: only partitions after the unchanged decided ones are decided), or
    with ``brute`` every row against every kept row (the reference; O(rows x kept))."""
    tol = check_tolerance(colour_tolerance)
    if not brute:
        d = phash_dir(root)
        names = sorted(p.stem for p in d.glob("*.parquet")) if d.is_dir() else []
        names = [n for n in names if partitions is None or n in partitions]
        records = [(n, _shard_identity(d / f"{n}.parquet")) for n in names]
        return decide_incremental(
            root, threshold, tol, records, lambda n: read_record(d / f"{n}.parquet")
        )[0]
    rows = read_hashes(root, partitions)
    winner, dist = decide(rows.phash, threshold, rows.colour, tol)
    lost = np.flatnonzero(winner >= 0)
    d = dist[lost]
    return _table(rows.partition, rows.id, lost, winner, "phash", d, 1.0 - d / 64.0)


# ------------------------------------------------------------- the semantic detector (CLS)


def read_cls(root: str | Path, partitions: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(partition, id, DINOv2 CLS) of every row of the ``dino_features`` shards of
    ``partitions`` that have one, in dataset order (the ``cls`` array alone is read)."""
    from flowmatch_models.storage.store import read_shard

    layout = DataLayout(root)
    parts, ids, vecs = [], [], []
    for p in sorted(partitions):
        path = layout.asset_path("dino_features", p)
        if not path.exists():
            continue
        sh = read_shard(remote.ensure(path))
        vecs.append(np.asarray(sh["cls"], np.float32))
        ids.append(np.asarray(sh.ids, object))
        parts.append(np.full(len(sh.ids), p, object))
    if not vecs:
        return np.zeros(0, object), np.zeros(0, object), np.zeros((0, 1), np.float32)
    return np.concatenate(parts), np.concatenate(ids), np.concatenate(vecs)


def semantic_duplicates(
    root: str | Path,
    min_cosine: float,
    partitions: list[str],
    skip: set = frozenset(),
    brute: bool = False,
) -> pa.Table:
    """The stored rows whose DINOv2 CLS has cosine >= ``min_cosine`` with an earlier kept
    row's, within clusters (:mod:`.neardup_semantic`; with ``brute``, every kept row: the
    reference); rows in ``skip`` ((partition, id): lost to another detector already) take no
    part (the centroids are fitted before they are left out)."""
    part, ids, v = read_cls(root, partitions)
    centroids = None if brute else stored_centroids(root, part, ids, v)
    keep = np.array([(p, i) not in skip for p, i in zip(part, ids)], bool)
    part, ids, v = part[keep], ids[keep], v[keep]
    if brute:
        winner, cos = decide_cosine(v, min_cosine)
    else:
        winner, cos = decide_clustered(v, min_cosine, centroids)
    lost = np.flatnonzero(winner >= 0)
    return _table(part, ids, lost, winner, "dino_cls", np.zeros(len(lost), np.int32), cos[lost])


def write_near_duplicates(
    root: str | Path,
    threshold: int = DEFAULT_THRESHOLD,
    partitions: list[str] | None = None,
    min_cosine: float | None = None,
    colour_tolerance: int = DEFAULT_COLOUR_TOLERANCE,
) -> pa.Table:
    """Decide over the pHash records of ``partitions`` (default: every one), then (with
    ``min_cosine``) over the DINOv2 CLS of the rows the pHash kept, and write the table the
    catalog reads (atomically, with the settings it was decided at)."""
    t = near_duplicates(root, threshold, partitions, colour_tolerance=colour_tolerance)
    if min_cosine is not None:
        if partitions is None:
            partitions = sorted(p.stem for p in phash_dir(root).glob("*.parquet"))
        lost = set(zip(t.column("partition").to_pylist(), t.column("id").to_pylist()))
        t = pa.concat_tables([t, semantic_duplicates(root, min_cosine, partitions, lost)])
    settings = {"phash": threshold, "phash_colour": colour_tolerance, "dino_cls": min_cosine}
    meta = {"flowmatch_neardup": json.dumps({"thresholds": settings})}
    out = near_path(DataLayout(root))
    with atomic_path(out) as tmp:
        pq.write_table(t.replace_schema_metadata(meta), tmp)
    store = remote.active(root)
    if store is not None:  # every machine's loader excludes the same rows (their sync brings it)
        store.push_files([out])
    return t


# ---------------------------------------------------------------------------- the picture


def pairs_picture(
    root: str | Path, near: pa.Table, n: int = 12, cell: int = 128
) -> tuple[Path | None, list[tuple[str, str]]]:
    """``<root>/reports/near_duplicates.png``: up to ``n`` pairs side by side (kept row left,
    the row that lost to it right), the least similar first (those closest to the threshold:
    where a user sees whether it is right). Returns (path or None, the (kept id, loser id)
    pairs shown, top to bottom); with none to show, an earlier run's picture is removed (it
    would show pairs this run did not find)."""
    from flowmatch_models.figures.grid import make_grid, save_png
    from flowmatch_models.storage.image_shard import decode

    layout = DataLayout(root)
    png = layout.root / "reports" / "near_duplicates.png"
    if not near.num_rows:
        png.unlink(missing_ok=True)
        return None, []
    t = near.sort_by([("similarity", "ascending"), ("partition", "ascending"), ("id", "ascending")])
    rows = t.slice(0, n).to_pylist()
    want: dict[str, set[str]] = {}
    for r in rows:
        want.setdefault(r["kept_partition"], set()).add(r["kept_id"])
        want.setdefault(r["partition"], set()).add(r["id"])
    images: dict[tuple[str, str], bytes] = {}
    for p, ids in want.items():
        shard = remote.ensure(layout.asset_path("images", p))
        got = pq.read_table(shard, columns=["id", "image"], filters=[("id", "in", sorted(ids))])
        for i, b in zip(got.column("id").to_pylist(), got.column("image").to_pylist()):
            images[(p, i)] = b
    cells, pairs = [], []
    for r in rows:
        a, b = (
            images.get((r["kept_partition"], r["kept_id"])),
            images.get((r["partition"], r["id"])),
        )
        if a is None or b is None:  # a shard rewritten since the decision
            continue
        cells += [decode(a), decode(b)]
        pairs.append((r["kept_id"], r["id"]))
    if not cells:
        png.unlink(missing_ok=True)
        return None, []
    return save_png(make_grid(cells, cols=2, cell=cell), png), pairs
