"""flowmatch's settings, listed once: each one's field of the ``FlowmatchSettings`` resource, its
FLOWMATCH_* environment variable, its default and what it means.

``FlowmatchSettings`` (defs/resources.py) takes its fields and their descriptions from
:data:`SETTINGS`; ``resource_from_env`` reads the variables (:data:`ENV_OF`); docs/command-line.md's
Settings table is tested against this one (tests/test_env_vars.py).
"""

from __future__ import annotations

from typing import NamedTuple


class Setting(NamedTuple):
    """One setting a deployment sets: as a resource field or as its environment variable."""

    field: str  # FlowmatchSettings' field
    env: str  # its FLOWMATCH_* variable
    default: str  # when neither is set (as docs/command-line.md's table writes it)
    meaning: str


_ENCODER_DEFAULT = "the real models; the demo's when `<data root>/zoo` exists"

SETTINGS: tuple[Setting, ...] = (
    Setting(
        "data_root",
        "FLOWMATCH_DATA_ROOT",
        "`data`",
        "where every asset's per-partition files, the runs and the catalog live",
    ),
    Setting(
        "metadata_source",
        "FLOWMATCH_METADATA",
        "`<data root>/sample/metadata`",
        "folder or fsspec URL of the `pd12m.NNN.parquet` files",
    ),
    Setting(
        "shard_size",
        "FLOWMATCH_SHARD_SIZE",
        "`10000`",
        "rows per PD12M partition (keys `NNN-KK`: file NNN, shard KK)",
    ),
    Setting(
        "file_root",
        "FLOWMATCH_FILE_ROOT",
        "`<data root>/sample`",
        "`file://` image URLs are allowed only under this folder (ingest.file_root)",
    ),
    Setting(
        "min_stored_fraction",
        "FLOWMATCH_MIN_STORED_FRACTION",
        "`0.5`",
        "an images run that stores less than this fraction of its rows fails "
        "(ingest.min_stored_fraction)",
    ),
    Setting(
        "deadline_s",
        "FLOWMATCH_DEADLINE_S",
        "`60`",
        "total seconds one image download may take (ingest.deadline_s)",
    ),
    Setting(
        "allow_networks",
        "FLOWMATCH_ALLOW_NETWORKS",
        "none",
        "networks that image URLs may reach although they are not public, e.g. 127.0.0.0/8 "
        "(ingest.allow_networks; the variable: comma-separated)",
    ),
    Setting("vae", "FLOWMATCH_VAE", _ENCODER_DEFAULT, "the VAE: a hub id or folder (encoders.vae)"),
    Setting(
        "dino", "FLOWMATCH_DINO", _ENCODER_DEFAULT, "DINOv2: a hub id or folder (encoders.dino)"
    ),
    Setting(
        "text",
        "FLOWMATCH_TEXT",
        _ENCODER_DEFAULT,
        "the text encoder: a hub id or folder (encoders.text)",
    ),
    Setting("device", "FLOWMATCH_DEVICE", "`auto`", "the encoders' device (encoders.device)"),
    Setting(
        "settings_file",
        "FLOWMATCH_SETTINGS",
        "none",
        "a YAML or JSON file of standing overrides in the launchpad's shape "
        "({encoders: {max_tokens: 64}}); what `flowmatch stale` compares shards with",
    ),
    Setting(
        "sources_file",
        "FLOWMATCH_SOURCES",
        "`<data root>/sources.yaml`",
        "the YAML file of the sources of your own images (`flowmatch sources add` writes it)",
    ),
)

#: The environment variable of each setting, by field (error messages name it).
ENV_OF: dict[str, str] = {s.field: s.env for s in SETTINGS}


def described(field: str) -> str:
    """The description a setting's resource field carries (the UI shows it)."""
    (s,) = (s for s in SETTINGS if s.field == field)
    return f"{s.meaning}. Unset: {s.env}, else {s.default.replace('`', '')}."
