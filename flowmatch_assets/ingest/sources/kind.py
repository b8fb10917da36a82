"""What a source kind is: :class:`SourceKind`, the interface every format of the user's own
images implements (``folder.py``, ``parquet.py``, ``webdataset.py``, ``urls.py``), with named
types for what it takes and returns; ``registry.py`` registers one instance of each
(``SOURCE_KIND_REGISTRY``). And what a partition's source is: :class:`PartitionSource`, what the
stages ask of the source a partition key belongs to (a configured source: ``registry.py``;
PD12M, built in: ``urls.py``), so no stage asks which source it is.

A kind answers three questions, each for one stage:

- :meth:`SourceKind.scan` (registration): the samples no registered partition holds, cut into
  :class:`NewPartition` s, and the files it had to skip (:class:`Skipped`): a :class:`Found`;
- :meth:`SourceKind.rows` (the ``metadata`` asset): one partition's samples as rows in PD12M's
  metadata columns (:class:`ListedRow`) and the samples that cannot be rows (:class:`Failure`,
  ``common.LISTING_REASONS``): a :class:`Listing`;
- :meth:`SourceKind.images` (the ``images`` asset): each row's image bytes, or the
  ``IngestError`` why not (:data:`ImageRead`); a kind whose rows carry URLs says
  :attr:`SourceKind.downloads` instead, and the images stage downloads them (``urls.py``).
"""

from __future__ import annotations

import hashlib
import json
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, NamedTuple, TypedDict

import pyarrow as pa

from flowmatch_assets.ingest.images import IngestError
from flowmatch_assets.ingest.sources.config import redacted

if TYPE_CHECKING:
    from flowmatch_assets.ingest.shard import Reader
    from flowmatch_assets.ingest.sources.config import SourceConfig


@dataclass
class Manifest:
    """One registered partition of a source (see ``registry.py``'s module doc)."""

    key: str
    source: str
    kind: str
    unit: str
    start: int
    end: int
    entries: list = field(default_factory=list)
    #: where the samples lie in an uncompressed tar (``[first header offset, end offset]``),
    #: so a partition reads its own stretch, not the whole tar; not part of :meth:`digest`
    span: list | None = None

    @property
    def samples(self) -> int:
        return self.end - self.start

    def summary(self) -> dict:
        return {"key": self.key, "unit": self.unit, "start": self.start, "end": self.end}

    def digest(self) -> str:
        """A short hash of what the partition holds (a fingerprint field of its rows)."""
        body = json.dumps([self.kind, self.unit, self.start, self.end, self.entries])
        return hashlib.sha256(body.encode()).hexdigest()[:16]

    def as_partition(self, location: str) -> dict:
        """The catalog's ``partitions`` row of this partition (a password in ``location``
        redacted)."""
        location = redacted(location)
        return {
            "partition": self.key,
            "source": self.source,
            "source_file": f"{location.rstrip('/')}/{self.unit}" if self.unit else location,
            "row_start": self.start,
            "row_end": self.end,
        }


class NewPartition(NamedTuple):
    """A partition a scan found: the ``unit`` (file or folder) its samples come from, their
    range ``[start, end)`` in it, the ``entries`` the kind needs to find them again (folder
    samples, tar keys; none for parquet rows) and, for an uncompressed tar, its ``span``."""

    unit: str
    start: int
    end: int
    entries: list
    span: list | None = None


def cut(unit: str, n: int, size: int) -> list[NewPartition]:
    """The ``n`` rows of file ``unit`` as new partitions of at most ``size`` rows each (one,
    empty, when it has none)."""
    return [
        NewPartition(unit, k * size, min(n, (k + 1) * size), [])
        for k in range(max(1, math.ceil(n / size)))
    ]


class Skipped(NamedTuple):
    """A file a scan could not read whole (looked at again by the next scan)."""

    unit: str
    reason: str
    detail: str


@dataclass
class Found:
    """What :meth:`SourceKind.scan` found: new partitions, in key order, and skipped files."""

    new: list[NewPartition]
    skipped: list[Skipped] = field(default_factory=list)


class ListedRow(TypedDict):
    """One sample as a row in PD12M's metadata columns (``common.row``; ``registry.ROW_COLUMNS``)."""

    id: str
    url: str
    caption: str
    width: int | None
    height: int | None
    mime_type: str | None
    hash: str | None
    license: str | None
    source: str
    row_index: int


class Failure(TypedDict):
    """A sample that cannot be a row (``common.failure``; reason: ``common.LISTING_REASONS``)."""

    id: str
    url: str | None
    reason: str
    detail: str


@dataclass
class Listing:
    """What :meth:`SourceKind.rows` lists of a partition: its rows and its failures."""

    rows: list[ListedRow]
    failed: list[Failure]


#: A row and the bytes of its image, or the IngestError why there are none.
ImageRead = tuple[ListedRow, bytes | IngestError]


class SourceKind(ABC):
    """A format of the user's own images: how a source of it is scanned into partitions, how a
    partition lists its rows and how its images are read (every read through
    ``location.Location``: confined, regular files only, bounded)."""

    #: the ``kind`` of a ``SourceConfig`` (``config.SOURCE_KINDS``)
    name: ClassVar[str]
    #: True: the rows' ``url`` s are downloaded by the images stage (the guarded address pool,
    #: ``ingest.allow_networks``, the byte and time bounds), :meth:`images` is never called
    downloads: ClassVar[bool] = False

    @abstractmethod
    def scan(self, cfg: SourceConfig, known: Sequence[Manifest]) -> Found:
        """The samples under ``cfg.location`` that no ``known`` partition holds, as new
        partitions of at most ``cfg.shard_size`` samples; files that cannot be read whole
        are skipped (the location itself missing raises ``SourceError``)."""

    @abstractmethod
    def rows(self, cfg: SourceConfig, name: str, m: Manifest) -> Listing:
        """Partition ``m``'s samples of source ``name`` as rows, and those that cannot be."""

    @abstractmethod
    def images(
        self, cfg: SourceConfig, m: Manifest, rows: Sequence[ListedRow], max_bytes: int
    ) -> Iterator[ImageRead]:
        """``(row, bytes or IngestError)`` for each of ``rows`` (any order; a row not yielded
        fails with the error that stopped the read)."""

    def sample_ids(self, m: Manifest) -> list[str]:
        """The ids the samples of ``m`` get when its unit cannot be read at all (the entries'
        ids, or the entries themselves: tar keys)."""
        return [e["id"] if isinstance(e, dict) else e for e in m.entries]


class PartitionSource(ABC):
    """The source a partition key belongs to, as the stages ask it: what its partitions are,
    a partition's rows, how its images are read, the settings its rows depend on (the
    ``metadata`` fingerprint) and its input rows for the data card. ``registers``: its
    partitions are registered by a scan (``registry.register``); else they are found anew
    from its files each time (PD12M's metadata files)."""

    name: str
    registers: ClassVar[bool]

    @abstractmethod
    def partitions(self) -> list[dict]:
        """Its partitions as catalog ``partitions`` rows (``{partition, source, source_file,
        row_start, row_end}``), key order."""

    @abstractmethod
    def rows(self, key: str, log: Callable[[str], None]) -> tuple[pa.Table, list[dict], dict]:
        """Partition ``key``'s rows (the metadata columns), the samples that cannot be rows
        (``{id, url, reason, detail}``) and what the ``metadata`` record keeps of where they
        came from (``source_file``, ``row_start``, ``row_end``; ``winners``: the dedupe's)."""

    @abstractmethod
    def reader(self, key: str, max_bytes: int) -> Reader | None:
        """What reads partition ``key``'s images (``make_image_shard``'s ``read``); None: the
        images stage downloads each row's ``url``."""

    @abstractmethod
    def row_fields(self) -> dict:
        """The settings a partition's rows depend on (fingerprint fields of ``metadata``)."""

    @abstractmethod
    def listing(self, key: str) -> list[dict]:
        """Every input row of partition ``key``, failures included (the data card's)."""
