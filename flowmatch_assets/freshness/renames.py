"""Names changed since a data root or Dagster instance was made, and the one step that carries
them over (``flowmatch upgrade``).

Renamed (issue 29: names say what they are, for every source): the asset ``pd12m_metadata`` is
``metadata``, ``images_256`` is ``images`` (it holds aspect-ratio buckets too), the dynamic
partitions ``pd12m_shards`` are ``shards`` and the sensor ``pd12m_partition_sensor`` is
``metadata_partition_sensor``. An existing data root and instance keep working after one
command, which is safe to run again:

- the data root: each renamed asset's folder, its previews and its catalog records
  (``catalog/<kind>/<old>/`` -> ``<new>/``, the ``asset`` column rewritten; atomic per file);
- the Dagster instance: every registered partition key is added to ``shards``, and every
  partition Dagster saw materialized under an old key is reported materialized under the new
  one (``report_runless_asset_event``: the history stays under the old key, the UI and
  ``materialize --missing`` see the partition present).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq

from flowmatch_models.storage.atomic import atomic_path, write_parquet

#: old asset key -> new
RENAMED_ASSETS = {"pd12m_metadata": "metadata", "images_256": "images"}
#: old dynamic partitions definition -> new
RENAMED_PARTITIONS = {"pd12m_shards": "shards"}
#: old asset folder under the data root -> new (pd12m_metadata always lived in metadata/)
_FOLDERS = {"images_256": "images"}


def _move(src: Path, dst: Path, done: list[str]) -> None:
    if src.exists() and not dst.exists():
        dst.parent.mkdir(parents=True, exist_ok=True)
        src.rename(dst)
        done.append(f"moved {src} -> {dst}")


def upgrade_data_root(root: str | Path) -> list[str]:
    """Carry a data root over to the new asset names; returns what was done (one line each)."""
    root = Path(root)
    done: list[str] = []
    for old, new in _FOLDERS.items():
        _move(root / old, root / new, done)
    for old, new in RENAMED_ASSETS.items():
        _move(root / "previews" / old, root / "previews" / new, done)
        catalog = root / "catalog"
        for kind in sorted(catalog.iterdir()) if catalog.is_dir() else []:
            src = kind / old
            if not src.is_dir():
                continue
            dst = kind / new
            dst.mkdir(parents=True, exist_ok=True)
            n = 0
            for f in sorted(src.glob("*")):
                if f.suffix == ".parquet":
                    t = pq.read_table(f)
                    if "asset" in t.column_names:
                        i = t.column_names.index("asset")
                        t = t.set_column(i, "asset", pa.array([new] * t.num_rows, pa.string()))
                    with atomic_path(dst / f.name) as tmp:
                        write_parquet(t, tmp)
                    f.unlink()
                else:
                    f.rename(dst / f.name)
                n += 1
            shutil.rmtree(src, ignore_errors=True)
            done.append(f"catalog/{kind.name}: {n} records of {old} now {new}")
    return done


def upgrade_instance(instance: dg.DagsterInstance) -> list[str]:
    """Carry a Dagster instance over to the new partitions definition and asset keys."""
    done: list[str] = []
    for old, new in RENAMED_PARTITIONS.items():
        keys = list(instance.get_dynamic_partitions(old))
        have = set(instance.get_dynamic_partitions(new))
        todo = [k for k in keys if k not in have]
        if todo:
            instance.add_dynamic_partitions(new, todo)
            done.append(f"partitions: {len(todo)} keys of {old} registered in {new}")
    for old, new in RENAMED_ASSETS.items():
        was = set(instance.get_materialized_partitions(dg.AssetKey(old)))
        now = set(instance.get_materialized_partitions(dg.AssetKey(new)))
        for p in sorted(was - now):
            instance.report_runless_asset_event(
                dg.AssetMaterialization(asset_key=new, partition=p, metadata={"renamed_from": old})
            )
        if was - now:
            done.append(f"dagster: {len(was - now)} partitions of {old} reported as {new}")
    return done
