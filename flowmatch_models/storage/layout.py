"""Where every artefact lives under the data root.

One folder per asset, one file per partition (shard); files appear only complete (atomic
rename), so "the file exists" means "the partition is materialized".

    <root>/metadata/<partition>.parquet        metadata: the shard's kept rows
    <root>/images/<partition>.parquet      images: encoded 256x256 images + metadata
    <root>/<kind>/<partition>.fms              each embedding kind (flowmatch_models.embeddings:
                                                vae_latents, dino_features, text_embeddings, ...)
    <root>/catalog/...                          per-partition catalog records (parquet)
    <root>/catalog.duckdb                       DuckDB views over the records
    <root>/exclusions/<digest>.parquet          every version of the rows training skipped
                                                (flowmatch_models.data.exclude)
    <root>/previews/<asset>/<partition>.png     preview grids
    <root>/runs/<name>/                         a training run's folder (DataLayout.run_dir; a
                                                config's run.out_dir puts it elsewhere)
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from flowmatch_models.embeddings.kinds import KINDS, TRAINING_INPUTS

#: The data assets before the embeddings, with the suffix of their per-partition files.
DATA_ASSETS: dict[str, str] = {"metadata": ".parquet", "images": ".parquet"}


class _PartitionedAssets(Mapping[str, str]):
    """Partitioned assets in lineage order -> file suffix: the data assets, then every
    registered embedding kind (flowmatch_models.embeddings, read live)."""

    def _all(self) -> dict[str, str]:
        return {**DATA_ASSETS, **dict.fromkeys(KINDS, ".fms")}

    def __getitem__(self, asset: str) -> str:
        return self._all()[asset]

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())


PARTITIONED_ASSETS: Mapping[str, str] = _PartitionedAssets()

#: The source of every partition whose key starts with a digit (``NNN-KK``): the PD12M metadata.
PD12M = "pd12m"
#: The sources every data root has beside the configured ones (no configured source takes
#: their names; flowmatch_assets/ingest/sources/urls.py ``BUILT_IN``).
BUILT_IN_SOURCES = (PD12M,)
#: A configured source's name (flowmatch_assets/ingest/sources): its partitions are ``<name>-NNNNN``.
SOURCE_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")


def run_folder(run: str | Path, data_root: str | Path) -> Path:
    """A run given as a folder (one holding ``checkpoints/``) or by name (its folder under the
    data root)."""
    p = Path(run).expanduser()
    return p.resolve() if (p / "checkpoints").is_dir() else DataLayout(data_root).run_dir(str(run))


def source_of(partition: str) -> str:
    """The source a partition key belongs to: ``photos-00003`` -> ``photos``; PD12M's keys
    (``000-00``, a digit first) -> ``pd12m``."""
    head = partition.split("-", 1)[0]
    return head if SOURCE_NAME.fullmatch(head) else PD12M


@dataclass(frozen=True)
class DataLayout:
    """Paths of every per-partition artefact under one data root."""

    root: Path

    def __init__(self, root: str | Path):
        object.__setattr__(self, "root", Path(root).expanduser().resolve())

    def asset_dir(self, asset: str) -> Path:
        return self.root / asset

    def asset_path(self, asset: str, partition: str) -> Path:
        return self.asset_dir(asset) / f"{partition}{PARTITIONED_ASSETS[asset]}"

    def preview_path(self, asset: str, partition: str) -> Path:
        return self.root / "previews" / asset / f"{partition}.png"

    def partitions_with(self, asset: str) -> list[str]:
        """Sorted partition keys whose file for ``asset`` exists (complete by construction),
        and with a remote data root those another machine published (their synced markers:
        ``storage/remote.py``; the file is fetched on first read)."""
        from flowmatch_models.storage import remote

        d = self.asset_dir(asset)
        suffix = PARTITIONED_ASSETS[asset]
        here = {
            p.name[: -len(suffix)]
            for p in (d.iterdir() if d.is_dir() else ())
            if p.name.endswith(suffix) and not p.name.startswith(".")
        }
        if remote.active(self.root) is not None:
            here |= remote.published(self.root, asset)
        return sorted(here)

    def complete_partitions(self, assets: Sequence[str] = TRAINING_INPUTS) -> list[str]:
        """Partitions that have every asset in ``assets`` (default: every training input)."""
        sets = [set(self.partitions_with(a)) for a in assets]
        return sorted(set.intersection(*sets)) if sets else []

    def run_dir(self, name: str) -> Path:
        """The folder of the training run ``name`` (the one place the rule is written:
        ``TrainConfig.run_dir``, the assets and the CLI ask here)."""
        return self.root / "runs" / name

    @property
    def catalog_dir(self) -> Path:
        return self.root / "catalog"

    @property
    def catalog_db(self) -> Path:
        return self.root / "catalog.duckdb"
