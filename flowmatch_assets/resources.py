"""Dagster resources: one typed object holding every data-pipeline knob."""

from __future__ import annotations

import os
from pathlib import Path

import dagster as dg
from pydantic import Field

from flowmatch_assets.config import EncoderConfig, FilterConfig, IngestConfig
from flowmatch_models.layout import DataLayout


class FlowmatchResource(dg.ConfigurableResource):
    """Where the data lives and how each stage behaves (defaults come from FLOWMATCH_* env vars)."""

    data_root: str = Field(description="Folder that holds every asset's per-partition files.")
    metadata_source: str = Field(
        description="Folder or fsspec URL of PD12M metadata files pd12m.NNN.parquet."
    )
    shard_size: int = Field(default=10_000, description="Rows per partition (shard).")
    filters: FilterConfig = Field(default_factory=FilterConfig)
    ingest: IngestConfig = Field(default_factory=IngestConfig)
    encoders: EncoderConfig = Field(default_factory=EncoderConfig)

    @property
    def layout(self) -> DataLayout:
        return DataLayout(self.data_root)


def _abs(p: str) -> str:
    return p if "://" in p else str(Path(p).expanduser().resolve())


def resource_from_env() -> FlowmatchResource:
    """The resource as `dagster dev` and the CLI build it from the environment.

    FLOWMATCH_DATA_ROOT (default ``data``), FLOWMATCH_METADATA (default
    ``<data root>/sample/metadata``), FLOWMATCH_SHARD_SIZE (default 10000) and
    FLOWMATCH_FILE_ROOT (folder under which file:// image URLs are allowed; default
    ``<data root>/sample``), FLOWMATCH_VAE / FLOWMATCH_DINO / FLOWMATCH_TEXT (encoder hub ids or
    folders; default the real models, or the demo's random-weight zoo when ``<data root>/zoo``
    exists, as it does after `flowmatch demo`), FLOWMATCH_DEVICE (default auto),
    FLOWMATCH_MIN_STORED_FRACTION (ingest.min_stored_fraction, default 0.5),
    FLOWMATCH_DEADLINE_S (ingest.deadline_s, default 60).
    """
    root = _abs(os.environ.get("FLOWMATCH_DATA_ROOT", "data"))
    source = _abs(os.environ.get("FLOWMATCH_METADATA", os.path.join(root, "sample", "metadata")))
    file_root = os.environ.get("FLOWMATCH_FILE_ROOT", os.path.join(root, "sample"))
    return FlowmatchResource(
        data_root=root,
        metadata_source=source,
        shard_size=_int_env("FLOWMATCH_SHARD_SIZE", 10_000),
        ingest=IngestConfig(file_root=_abs(file_root) if file_root else None, **_ingest_env()),
        encoders=EncoderConfig(**_encoder_env(Path(root))),
    )


class SettingError(ValueError):
    """A FLOWMATCH_* environment variable holds a value that cannot be used."""


def _int_env(var: str, default: int) -> int:
    raw = os.environ.get(var)
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise SettingError(f"{var}={raw!r} is not a whole number") from None


def _ingest_env() -> dict:
    out = {}
    for field, var in (
        ("min_stored_fraction", "FLOWMATCH_MIN_STORED_FRACTION"),
        ("deadline_s", "FLOWMATCH_DEADLINE_S"),
    ):
        if os.environ.get(var):
            out[field] = os.environ[var]  # pydantic validates (a bad value names the field)
    return out


def _encoder_env(root: Path) -> dict:
    out = {}
    for field, var in (
        ("vae", "FLOWMATCH_VAE"),
        ("dino", "FLOWMATCH_DINO"),
        ("text", "FLOWMATCH_TEXT"),
    ):
        if os.environ.get(var):
            out[field] = os.environ[var]
        elif (root / "zoo" / field / "config.json").exists():
            out[field] = str(root / "zoo" / field)  # the demo's zoo: labelled random wherever used
    if os.environ.get("FLOWMATCH_DEVICE"):
        out["device"] = os.environ["FLOWMATCH_DEVICE"]
    return out
