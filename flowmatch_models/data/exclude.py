"""The stored samples training skips: one exclusion list, at a recorded version.

The list is every stored row that loses to an earlier sample of the dataset:

- the near duplicates (``catalog/neardup/near_duplicates.parquet``, as ``flowmatch catalog
  neardup`` last decided them: a look-alike of an earlier kept image, by pHash or DINO CLS);
- the content duplicates that stayed stored (``catalog/summary/content_losers.parquet``: bytes
  an earlier row stored too, when the later row's partition ran first).

Both tables are the catalog's (``flowmatch_assets.catalog.derived`` names its paths from these
constants); this module only reads them, as plain ``(partition, id)`` pairs, so training never
depends on the catalog's code or on Dagster.

**Version.** The list's version is the digest of its sorted pairs. The loader
(:class:`~flowmatch_models.data.source.ShardSource`) skips the rows of one version; the ledger's
segments and the data state record its digest, and every version trained with is kept,
content-addressed and immutable, at ``<root>/exclusions/<digest>.parquet``: a resume finishes
its epoch with the recorded version, and the ledger maps a segment's positions back to sample
ids with the version it was trained with, however the catalog re-decides since.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from flowmatch_models.storage.atomic import atomic_path, write_parquet

#: The catalog's tables of losers, relative to the data root (read if present).
NEAR_DUPLICATES = "catalog/neardup/near_duplicates.parquet"
CONTENT_LOSERS = "catalog/summary/content_losers.parquet"
#: Every version trained with: ``<root>/exclusions/<digest>.parquet`` (partition, id).
SNAPSHOTS = "exclusions"

_SCHEMA = pa.schema([("partition", pa.string()), ("id", pa.string())])


class ExclusionsMissingError(FileNotFoundError):
    """A checkpoint or ledger names an exclusion list whose snapshot is gone."""


@dataclass(frozen=True)
class Exclusions:
    """Per partition, the ids training skips; ``digest`` names this version ("" = none)."""

    ids: Mapping[str, frozenset[str]] = field(default_factory=dict)
    digest: str = ""

    def rows(self, partition: str, ids: Sequence[str]) -> np.ndarray:
        """The rows (shard order) of ``partition`` whose ids are excluded."""
        skip = self.ids.get(partition)
        if not skip:
            return np.zeros(0, np.int64)
        return np.flatnonzero([i in skip for i in ids]).astype(np.int64)

    def __len__(self) -> int:
        return sum(len(v) for v in self.ids.values())


NONE = Exclusions()


def of_pairs(pairs: Iterable[tuple[str, str]]) -> Exclusions:
    """The list of ``(partition, id)`` pairs (duplicates merged) and its digest."""
    unique = sorted(set(pairs))
    if not unique:
        return NONE
    h = hashlib.sha256()
    for p, i in unique:
        h.update(f"{p}\0{i}\n".encode())
    by: dict[str, set[str]] = {}
    for p, i in unique:
        by.setdefault(p, set()).add(i)
    return Exclusions({p: frozenset(v) for p, v in by.items()}, h.hexdigest()[:16])


def _pairs(path: Path) -> list[tuple[str, str]]:
    if not path.exists():
        return []
    t = pq.read_table(path, columns=["partition", "id"])
    return list(zip(t.column("partition").to_pylist(), t.column("id").to_pylist()))


def snapshot_path(root: str | Path, digest: str) -> Path:
    return Path(root) / SNAPSHOTS / f"{digest}.parquet"


def read(root: str | Path) -> Exclusions:
    """The list as the catalog has it now (near duplicates + stored content duplicates)."""
    root = Path(root)
    return of_pairs([*_pairs(root / NEAR_DUPLICATES), *_pairs(root / CONTENT_LOSERS)])


def current(root: str | Path) -> Exclusions:
    """:func:`read`, its snapshot written (atomically, once per version) so that it can be
    read back by digest (:func:`recorded`): the version a training epoch uses."""
    root = Path(root)
    ex = read(root)
    if ex.digest and not snapshot_path(root, ex.digest).exists():
        pairs = sorted((p, i) for p, v in ex.ids.items() for i in v)
        table = pa.Table.from_pylist([{"partition": p, "id": i} for p, i in pairs], schema=_SCHEMA)
        with atomic_path(snapshot_path(root, ex.digest)) as tmp:
            write_parquet(table, tmp)
    return ex


def recorded(root: str | Path, digest: str | None) -> Exclusions:
    """The version ``digest`` (a ledger segment's or a checkpoint's ``exclude``; empty: none)."""
    if not digest:
        return NONE
    path = snapshot_path(root, digest)
    if not path.exists():
        raise ExclusionsMissingError(
            f"{path}: the exclusion list {digest} this run trained with is gone; it is needed to "
            "resume the epoch or to map its ledger to sample ids exactly (restore the file)"
        )
    ex = of_pairs(_pairs(path))
    if ex.digest != digest:
        raise ValueError(f"{path}: its pairs have digest {ex.digest}, not {digest}")
    return ex
