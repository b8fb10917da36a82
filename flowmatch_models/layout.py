"""Where every artefact lives under the data root.

One folder per asset, one file per partition (shard); files appear only complete (atomic
rename), so "the file exists" means "the partition is materialized".

    <root>/metadata/<partition>.parquet        pd12m_metadata: the shard's kept rows
    <root>/images_256/<partition>.parquet      images_256: encoded 256x256 images + metadata
    <root>/vae_latents/<partition>.fms         DC-AE latents        (flowmatch_models.store)
    <root>/dino_features/<partition>.fms       DINOv2 features      (flowmatch_models.store)
    <root>/text_embeddings/<partition>.fms     Gemma3 hidden states (flowmatch_models.store)
    <root>/catalog/...                          per-partition catalog records (parquet)
    <root>/catalog.duckdb                       DuckDB views over the records
    <root>/previews/<asset>/<partition>.png     preview grids
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

#: Partitioned assets in lineage order, with the file suffix of their per-partition files.
PARTITIONED_ASSETS: dict[str, str] = {
    "pd12m_metadata": ".parquet",
    "images_256": ".parquet",
    "vae_latents": ".fms",
    "dino_features": ".fms",
    "text_embeddings": ".fms",
}
EMBEDDING_ASSETS = ("vae_latents", "dino_features", "text_embeddings")
_DIRS = {"pd12m_metadata": "metadata"}


@dataclass(frozen=True)
class DataLayout:
    """Paths of every per-partition artefact under one data root."""

    root: Path

    def __init__(self, root: str | Path):
        object.__setattr__(self, "root", Path(root).expanduser().resolve())

    def asset_dir(self, asset: str) -> Path:
        return self.root / _DIRS.get(asset, asset)

    def asset_path(self, asset: str, partition: str) -> Path:
        return self.asset_dir(asset) / f"{partition}{PARTITIONED_ASSETS[asset]}"

    def preview_path(self, asset: str, partition: str) -> Path:
        return self.root / "previews" / asset / f"{partition}.png"

    def partitions_with(self, asset: str) -> list[str]:
        """Sorted partition keys whose file for ``asset`` exists (complete by construction)."""
        d = self.asset_dir(asset)
        if not d.is_dir():
            return []
        suffix = PARTITIONED_ASSETS[asset]
        return sorted(
            p.name[: -len(suffix)]
            for p in d.iterdir()
            if p.name.endswith(suffix) and not p.name.startswith(".")
        )

    def complete_partitions(self, assets: tuple[str, ...] = EMBEDDING_ASSETS) -> list[str]:
        """Partitions that have every asset in ``assets``."""
        sets = [set(self.partitions_with(a)) for a in assets]
        return sorted(set.intersection(*sets)) if sets else []

    @property
    def catalog_dir(self) -> Path:
        return self.root / "catalog"

    @property
    def catalog_db(self) -> Path:
        return self.root / "catalog.duckdb"
