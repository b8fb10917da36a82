"""The pHash decision at PD12M's size: a multi-index hash of the kept hashes, and the decision
kept between runs so that an appended partition is decided alone.

**The index** (:class:`HashIndex`; multi-index hashing, Norouzi et al. 2012). The 64 bits are
cut into ``m`` chunks of ``w`` ~ 64/m bits. Two hashes within ``t`` bits differ in at most
``r = t // m`` bits in at least one chunk (pigeonhole: ``m`` chunks of ``r + 1`` or more
differing bits would make ``m (r + 1) > t``). Per chunk, the kept rows are bucketed by the
chunk's exact value (a direct-addressed table: ``starts``, ``2^w + 1`` offsets into
``members``, the kept rows sorted by chunk value then by age). A query probes, per chunk, every
value within ``r`` bits of its own (``sum_{k<=r} C(w, k)`` buckets) and checks the candidates
found with an XOR and a popcount; those within ``t`` bits are checked with their colour
signatures (:mod:`.neardup_colour`, 32 bytes a kept row: read only for the rows the hash
matched). Every kept row within ``t`` bits is a candidate of some chunk, so the answer -- the
*earliest* kept row within ``t`` bits whose colours agree -- is exactly brute force's. With
``m = t + 1`` (``r = 0``: one probe a chunk) a 10-bit threshold would cut 6-bit chunks, whose
buckets hold 1/64 of the index each (no better than brute force at 12.4M); so ``m`` is chosen
for the threshold by the expected probes plus candidates at PD12M's size (:func:`chunks_for`):
3 chunks of 21-22 bits at 10 bits (1,794 probes a chunk, ~6 candidates a probe at 12.4M). A
threshold too large for any split (40 bits: ~all pairs are candidates) keeps brute force
(``m = 0``).

Adding rows is a merge, never a re-sort: the new rows are younger than every member, so each
goes at its bucket's end (``np.insert``) and ``starts`` grows by the new rows' counts (one pass
over the arrays: O(index size) memory moves, no comparisons).

**The decision kept** (:func:`decide_incremental`): per threshold and colour tolerance,
``catalog/neardup/decision/t<threshold>-c<tolerance>/`` holds the partitions decided (their
hash records' identities), the kept rows (hash, colour signature, partition number, position)
with their index, and the losers (``NEAR_SCHEMA`` rows). A run whose partitions start with the
decided ones, unchanged, decides only the rest: each is compared with the index (every kept row
before it) and then among its own rows in order (:func:`decide_block`), and its kept rows are
added. A partition inserted before a decided one (dataset order), or a changed record,
re-decides from there on (the rule's result depends on every earlier kept row). Files are written
under new names and ``state.json`` (the commit) last.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Callable
from itertools import combinations
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from flowmatch_assets.catalog.derived import NEAR_SCHEMA
from flowmatch_assets.ingest.neardup_colour import SIGNATURE_BYTES, colours_agree, pairs_agree
from flowmatch_models.storage.atomic import atomic_path, atomic_write_text

#: The size the chunking is chosen for (PD12M's stored rows).
DESIGN_ROWS = 12_400_000
MAX_CHUNK_BITS = 24  # a direct-addressed table of 2^24 offsets (128 MB) a chunk at most


def _widths(m: int) -> list[int]:
    return [64 // m + (1 if i < 64 % m else 0) for i in range(m)]


def _probes(w: int, r: int) -> int:
    return sum(math.comb(w, k) for k in range(r + 1))


def chunks_for(threshold: int, rows: int = DESIGN_ROWS) -> int:
    """The chunk count ``m`` with the fewest expected probes + candidates a query at ``rows``
    kept rows (uniform hashes); 0 where none beats brute force (``rows`` checks a query)."""
    best, cost = 0, float(rows) / 4  # an index must be clearly cheaper than brute force
    for m in range(3, 17):
        w = _widths(m)
        if w[0] > MAX_CHUNK_BITS:
            continue
        c = sum(_probes(x, r) * (1 + rows / 2**x) for x, r in zip(w, radii(threshold, m)))
        if c < cost:
            best, cost = m, c
    return best


def radii(threshold: int, m: int) -> list[int]:
    """Per chunk, the bits a probe may flip: the fewest with ``sum(r_i + 1) > threshold`` (if
    every chunk differed in more than its ``r_i`` bits, the hashes would differ in more than
    ``threshold``): ``threshold // m`` for some chunks, one less for the rest."""
    if not m:
        return []
    need = threshold - m + 1  # sum(r_i) >= need
    return [need // m + (1 if i < need % m else 0) for i in range(m)]


def _flips(w: int, r: int) -> np.ndarray:
    """Every ``w``-bit mask of at most ``r`` set bits (the probes' XORs), fewest bits first."""
    out = [0]
    for k in range(1, r + 1):
        for bits in combinations(range(w), k):
            out.append(sum(1 << b for b in bits))
    return np.asarray(out, np.int32)


def _colours(colours, n: int) -> np.ndarray:
    c = np.asarray(colours, np.uint8)
    if c.shape != (n, SIGNATURE_BYTES):
        raise ValueError(f"colour signatures {c.shape}: want ({n}, {SIGNATURE_BYTES})")
    return c


class HashIndex:
    """The kept hashes and colour signatures in insertion (dataset) order, and per chunk the
    hashes' buckets. A match: within ``threshold`` bits, colours within ``tolerance``."""

    def __init__(
        self, threshold: int, tolerance: int, m: int | None = None, rows: int = DESIGN_ROWS
    ):
        self.threshold = int(threshold)
        self.tolerance = int(tolerance)
        self.m = chunks_for(threshold, rows) if m is None else int(m)
        self.hashes = np.zeros(0, np.uint64)
        self.colours = np.zeros((0, SIGNATURE_BYTES), np.uint8)
        self.widths = _widths(self.m) if self.m else []
        self.shifts = [int(64 - sum(self.widths[: i + 1])) for i in range(self.m)]
        self.flips = [_flips(w, r) for w, r in zip(self.widths, radii(self.threshold, self.m))]
        self.starts = [np.zeros(2**w + 1, np.int32) for w in self.widths]
        self.members = [np.zeros(0, np.int32) for _ in self.widths]
        #: the members' hashes in bucket order: a bucket's candidates are checked from one
        #: contiguous run (no random reads of ``hashes``)
        self.bucketed = [np.zeros(0, np.uint64) for _ in self.widths]

    def __len__(self) -> int:
        return len(self.hashes)

    @property
    def nbytes(self) -> int:
        arrays = [self.colours, *self.starts, *self.members, *self.bucketed]
        return self.hashes.nbytes + sum(a.nbytes for a in arrays)

    def _chunk(self, h: np.ndarray, c: int) -> np.ndarray:
        mask = np.uint64((1 << self.widths[c]) - 1)
        return ((h >> np.uint64(self.shifts[c])) & mask).astype(np.int32)

    def add(self, hashes: np.ndarray, colours: np.ndarray) -> None:
        """Append rows (younger than every member): each at its buckets' ends. An empty index
        keeps the arrays given (no second copy of 12.4M rows): do not change them after."""
        hashes, colours = np.asarray(hashes, np.uint64), _colours(colours, len(hashes))
        base = len(self.hashes)
        if base:
            self.hashes = np.concatenate([self.hashes, hashes])
            self.colours = np.concatenate([self.colours, colours])
        else:
            self.hashes, self.colours = hashes, colours
        for c, w in enumerate(self.widths):
            key = self._chunk(hashes, c)
            order = np.argsort(key, kind="stable")
            at = self.starts[c][key[order] + 1]  # each bucket's end, before the new rows
            self.members[c] = np.insert(self.members[c], at, (base + order).astype(np.int32))
            self.bucketed[c] = np.insert(self.bucketed[c], at, hashes[order])
            counts = np.bincount(key, minlength=2**w)
            self.starts[c][1:] += np.cumsum(counts).astype(np.int32)

    def query(
        self, q: np.ndarray, q_colours: np.ndarray, block: int = 512
    ) -> tuple[np.ndarray, np.ndarray]:
        """Per query (hash, colour signature): (the earliest member within ``threshold`` bits
        whose colours agree, or -1; its distance in bits)."""
        q = np.asarray(q, np.uint64)
        qc = _colours(q_colours, len(q))
        win = np.full(len(q), -1, np.int64)
        dist = np.zeros(len(q), np.int32)
        if not len(self.hashes) or not len(q):
            return win, dist
        if not self.m:  # brute force
            for s in range(0, len(q), block):
                d = np.bitwise_count(q[s : s + block, None] ^ self.hashes[None, :])
                ok = d <= self.threshold
                r, k = np.nonzero(ok)  # the colours of the hash's matches only
                ok[r, k] = pairs_agree(qc, s + r, self.colours, k, self.tolerance)
                first = ok.argmax(axis=1)
                hit = ok[np.arange(len(first)), first]
                win[s : s + block] = np.where(hit, first, -1)
                dist[s : s + block] = np.where(hit, d[np.arange(len(first)), first], 0)
            return win, dist
        big, t = np.iinfo(np.int64).max, self.threshold
        for s in range(0, len(q), block):
            qs, qcs = q[s : s + block], qc[s : s + block]
            best = np.full(len(qs), big, np.int64)
            for c in range(self.m):
                probe = (self._chunk(qs, c)[:, None] ^ self.flips[c][None, :]).ravel()
                lo = self.starts[c][probe]
                n = self.starts[c][probe + 1] - lo
                nz = np.flatnonzero(n)  # most probes find an empty bucket
                if not len(nz):
                    continue
                lo, n = lo[nz].astype(np.int64), n[nz].astype(np.int64)
                total = int(n.sum())
                owner = np.repeat(nz // len(self.flips[c]), n)
                at = np.repeat(lo - (np.cumsum(n) - n), n) + np.arange(total)
                ok = np.flatnonzero(np.bitwise_count(self.bucketed[c][at] ^ qs[owner]) <= t)
                member = self.members[c][at[ok]].astype(np.int64)
                agree = pairs_agree(self.colours, member, qcs, owner[ok], self.tolerance)
                np.minimum.at(best, owner[ok][agree], member[agree])
            found = best < big
            win[s : s + block][found] = best[found]
            dist[s : s + block][found] = np.bitwise_count(
                self.hashes[best[found]] ^ qs[found]
            ).astype(np.int32)
        return win, dist

    def arrays(self) -> dict[str, np.ndarray]:
        out = {"hashes": self.hashes, "colours": self.colours}
        for c in range(self.m):
            out[f"starts{c}"], out[f"members{c}"] = self.starts[c], self.members[c]
        return out  # ``bucketed`` is ``hashes[members]``: not stored

    @classmethod
    def of(cls, threshold: int, tolerance: int, m: int, arrays) -> HashIndex:
        ix = cls(threshold, tolerance, m)
        ix.hashes = np.asarray(arrays["hashes"], np.uint64)
        ix.colours = _colours(arrays["colours"], len(ix.hashes))
        for c in range(m):
            ix.starts[c] = np.asarray(arrays[f"starts{c}"], np.int64)
            ix.members[c] = np.asarray(arrays[f"members{c}"], np.int32)
            ix.bucketed[c] = ix.hashes[ix.members[c]]
        return ix


def decide_block(
    index: HashIndex, hashes: np.ndarray, colours: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Rows later than every member of ``index``, in order (hashes and colour signatures):
    (winner, distance) of each. A winner ``>= 0`` is a member (the earliest kept row within
    the threshold whose colours agree); ``-2 - j``: row ``j`` of this block (the earliest of
    its rows kept before it); -1: kept. The index is not changed (:meth:`HashIndex.add` the
    kept rows)."""
    t, tol = index.threshold, index.tolerance
    hashes = np.asarray(hashes, np.uint64)
    colours = _colours(colours, len(hashes))
    win, dist = index.query(hashes, colours)
    kept = np.zeros(len(hashes), np.int64)  # this block's kept rows, in order
    kept_h = np.zeros(len(hashes), np.uint64)  # and their hashes
    n = 0
    for i in np.flatnonzero(win < 0):
        d = np.bitwise_count(kept_h[:n] ^ hashes[i])
        near = np.flatnonzero(d <= t)  # the colours of the hash's matches only
        ok = near[colours_agree(colours[kept[near]], colours[i], tol)]
        if len(ok):
            win[i], dist[i] = -2 - kept[ok[0]], d[ok[0]]
            continue
        kept[n], kept_h[n] = i, hashes[i]
        n += 1
    return win, dist


def decision_dir(root: str | Path, threshold: int, tolerance: int) -> Path:
    return Path(root) / "catalog" / "neardup" / "decision" / f"t{threshold}-c{tolerance}"


def _load(d: Path) -> tuple[dict, HashIndex | None, np.ndarray, pa.Table]:
    state_file = d / "state.json"
    if not state_file.exists():
        return {"partitions": []}, None, np.zeros((0, 2), np.int32), NEAR_SCHEMA.empty_table()
    state = json.loads(state_file.read_text())
    with np.load(d / state["kept"], allow_pickle=False) as z:
        index = HashIndex.of(state["threshold"], state["tolerance"], state["m"], z)
        where = np.asarray(z["where"], np.int32)
    return state, index, where, pq.read_table(d / state["losers"])


def decide_incremental(
    root: str | Path,
    threshold: int,
    tolerance: int,
    records: list[tuple[str, str]],
    load: Callable[[str], tuple[np.ndarray, np.ndarray, np.ndarray]],
) -> tuple[pa.Table, dict]:
    """The pHash losers of ``records`` (per partition in dataset order: name and its hash
    record's identity; ``load(name)``: its ids, hashes and colour signatures in position
    order) at ``threshold`` bits and colour ``tolerance``, deciding only
    the partitions after the longest unchanged prefix of the kept decision (only theirs and
    their winners' records are read); returns (NEAR_SCHEMA table, what was done: ``reused``,
    ``decided`` partitions)."""
    d = decision_dir(root, threshold, tolerance)
    state, index, where, losers = _load(d)
    done = [(p["name"], p["identity"]) for p in state["partitions"]]
    keep = 0
    while keep < min(len(done), len(records)) and done[keep] == tuple(records[keep]):
        keep += 1
    if keep < len(done):  # re-decide from the first partition that differs
        index, where, losers = None, np.zeros((0, 2), np.int32), NEAR_SCHEMA.empty_table()
        keep = 0
    index = index or HashIndex(threshold, tolerance)
    names = [r[0] for r in records]
    cache: dict[str, np.ndarray] = {}

    def ids_of(name: str) -> np.ndarray:
        if name not in cache:
            cache[name] = load(name)[0]
        return cache[name]

    tables, parts = [losers], []
    for k in range(keep, len(records)):
        name = names[k]
        ids, hashes, colours = load(name)
        hashes = np.asarray(hashes, np.uint64)
        cache[name] = ids
        win, dist = decide_block(index, hashes, colours)
        lost = np.flatnonzero(win != -1)
        kept = np.flatnonzero(win == -1)
        kp, kid = [], []
        for i in lost:
            w = int(win[i])
            if w >= 0:
                pi, pos = where[w]
                kp.append(names[int(pi)])
                kid.append(ids_of(names[int(pi)])[int(pos)])
            else:
                kp.append(name)
                kid.append(ids[-2 - w])
        dl = dist[lost].astype(np.int32)
        tables.append(
            pa.table(
                {
                    "partition": [name] * len(lost),
                    "id": [ids[i] for i in lost],
                    "kept_partition": kp,
                    "kept_id": kid,
                    "detector": ["phash"] * len(lost),
                    "distance": dl,
                    "similarity": 1.0 - dl / 64.0,
                },
                schema=NEAR_SCHEMA,
            )
        )
        index.add(hashes[kept], np.asarray(colours, np.uint8)[kept])
        add = np.stack([np.full(len(kept), k, np.int32), kept.astype(np.int32)], axis=1)
        where = np.concatenate([where, add])
        parts.append(name)
    table = pa.concat_tables(tables)
    if parts or not (d / "state.json").exists():
        _save(d, index, where, table, records)
    return table, {"reused": keep, "decided": parts}


def _save(d: Path, index: HashIndex, where, table: pa.Table, parts) -> None:
    d.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex[:12]
    kept, losers = f"kept-{tag}.npz", f"losers-{tag}.parquet"
    with atomic_path(d / kept, suffix=".npz") as tmp:
        np.savez(tmp, where=where, **index.arrays())
    with atomic_path(d / losers) as tmp:
        pq.write_table(table, tmp)
    state = {
        "threshold": index.threshold,
        "tolerance": index.tolerance,
        "m": index.m,
        "kept": kept,
        "losers": losers,
        "partitions": [{"name": n, "identity": i} for n, i in parts],
    }
    atomic_write_text(d / "state.json", json.dumps(state))
    for old in [*d.glob("kept-*.npz"), *d.glob("losers-*.parquet")]:
        if old.name not in (kept, losers):
            old.unlink(missing_ok=True)
