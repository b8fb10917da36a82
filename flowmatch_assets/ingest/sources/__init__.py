"""The user's own captioned images as partitions: image folders, Hugging Face-style parquet,
WebDataset tars and URL lists (no Dagster). ``config.py`` says how a source is configured and where,
``registry.py`` how its samples become partitions (manifests) and rows, ``kind.py`` what a
source kind is (``SourceKind``: scan, rows, images, with named return types), one module per
kind (``folder.py``, ``parquet.py``, ``webdataset.py``, ``urls.py``: a ``SourceKind`` each,
registered in ``registry.SOURCE_KIND_REGISTRY``) how each format is read (``urls.py`` also holds
PD12M, the built-in source; ``registry.partition_source`` gives any partition key's source as
a ``PartitionSource``), ``location.py`` the
one way they reach bytes (confined to the location, regular files only, bounded), ``common.py``
the rows and failure reasons they share."""

from flowmatch_assets.ingest.sources.common import LISTING_REASONS
from flowmatch_assets.ingest.sources.config import (
    SOURCE_KINDS,
    SourceConfig,
    SourceError,
    check_name,
    read_sources,
    sources_file,
    write_source,
)
from flowmatch_assets.ingest.sources.kind import Found, Listing, PartitionSource, SourceKind
from flowmatch_assets.ingest.sources.registry import (
    SOURCE_KIND_REGISTRY,
    Manifest,
    Scan,
    all_sources,
    forget,
    manifest,
    partition_images,
    partition_rows,
    partition_source,
    register,
    registered,
    source_kind,
    source_named,
    unregistered,
)

__all__ = [
    "SOURCE_KINDS",
    "SOURCE_KIND_REGISTRY",
    "Found",
    "Listing",
    "SourceKind",
    "PartitionSource",
    "all_sources",
    "partition_source",
    "source_named",
    "source_kind",
    "LISTING_REASONS",
    "Manifest",
    "Scan",
    "SourceConfig",
    "SourceError",
    "check_name",
    "forget",
    "manifest",
    "partition_images",
    "partition_rows",
    "read_sources",
    "register",
    "registered",
    "sources_file",
    "unregistered",
    "write_source",
]
