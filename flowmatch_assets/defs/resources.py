"""The Dagster resource: one typed object holding every data-pipeline knob.

The knobs themselves are plain pydantic models that live with the code that uses them
(``FilterConfig`` in ingest/metadata.py, ``IngestConfig`` in ingest/images.py, ``EncoderSpec``
in flowmatch_models/encoders/spec.py); :func:`dagster_config` makes each a ``dg.Config`` so that the
resource can nest it. The FLOWMATCH_* environment is read when the resource is built
(:func:`resource_from_env`: in a run, when its resources initialise), never when a module is
imported. The code location's ``flowmatch`` resource is :class:`FlowmatchSettings`: the settings
of defs/settings.py as typed fields a deployment sets (``dg.EnvVar``) and the launchpad overrides;
it builds the FlowmatchResource every asset takes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, get_origin

import dagster as dg
from pydantic import BaseModel, Field, create_model, field_validator

from flowmatch_assets.defs.settings import ENV_OF, described
from flowmatch_assets.demo import DEMO_VAE
from flowmatch_assets.ingest.images import IngestConfig
from flowmatch_assets.ingest.metadata import FilterConfig
from flowmatch_assets.ingest.sources import SourceConfig, SourceError, read_sources, sources_file
from flowmatch_assets.ingest.sources.config import check_location
from flowmatch_models.encoders.spec import EncoderSpec
from flowmatch_models.storage import remote
from flowmatch_models.storage.layout import DataLayout


def dagster_config(model: type[BaseModel]) -> type:
    """``model`` as a ``dg.Config`` (same fields, defaults and descriptions; still an instance
    of ``model``, so plain code takes it as is)."""
    return type(
        model.__name__, (model, dg.Config), {"__doc__": model.__doc__, "__module__": __name__}
    )


FilterSettings = dagster_config(FilterConfig)
IngestSettings = dagster_config(IngestConfig)
EncoderSettings = dagster_config(EncoderSpec)
SourceSettings = dagster_config(SourceConfig)


class FlowmatchResource(dg.ConfigurableResource):
    """Where the data lives and how each stage behaves (defaults come from FLOWMATCH_* env vars)."""

    data_root: str = Field(description="Folder that holds every asset's per-partition files.")
    metadata_source: str = Field(
        description="Folder or fsspec URL of PD12M metadata files pd12m.NNN.parquet."
    )
    shard_size: int = Field(default=10_000, description="Rows per partition (shard).")
    filters: FilterSettings = Field(default_factory=FilterSettings)
    ingest: IngestSettings = Field(default_factory=IngestSettings)
    encoders: EncoderSettings = Field(default_factory=EncoderSettings)
    sources: dict[str, SourceSettings] = Field(
        default_factory=dict,
        description="The user's own image sources by name (kind, location, caption_field, "
        "shard_size, ...: flowmatch_assets/ingest/sources); from FLOWMATCH_SOURCES, default "
        "<data root>/sources.yaml (`flowmatch sources add`). Their partitions are <name>-NNNNN.",
    )

    @field_validator("metadata_source")
    @classmethod
    def _allowed_metadata(cls, v: str) -> str:
        return check_location(v)  # the sources' scheme allow-list (no fsspec chains)

    @field_validator("filters", "ingest", "encoders", mode="before")
    @classmethod
    def _plain(cls, v: Any) -> Any:
        """Plain ``FilterConfig``/``IngestConfig``/``EncoderSpec`` objects are taken as they are."""
        return v.model_dump(exclude_unset=True) if isinstance(v, BaseModel) else v

    @field_validator("sources", mode="before")
    @classmethod
    def _plain_sources(cls, v: Any) -> Any:
        if isinstance(v, dict):
            return {
                k: (c.model_dump(exclude_unset=True) if isinstance(c, BaseModel) else c)
                for k, c in v.items()
            }
        return v

    @property
    def layout(self) -> DataLayout:
        return DataLayout(self.data_root)

    def source(self, name: str) -> SourceConfig:
        """The configured source ``name`` (SourceError naming the configured ones otherwise)."""
        if name not in self.sources:
            known = ", ".join(sorted(self.sources)) or "none"
            raise SourceError(
                f"no source {name!r} is configured (configured: {known}); add it with "
                f"`flowmatch sources add {name} --kind folder|parquet|webdataset|urls --location ...` "
                "(it writes FLOWMATCH_SOURCES, default <data root>/sources.yaml)"
            )
        cfg = SourceConfig.model_validate(self.sources[name].model_dump())
        return cfg.allowing(self.ingest.allow_networks)  # a remote location's address policy


def _abs(p: str) -> str:
    if "://" in p or "::" in p or p != p.strip():
        return p  # a URL as it is; an odd location is refused, as written, by check_location
    return str(Path(p).expanduser().resolve())


class SettingError(ValueError):
    """A FLOWMATCH_* environment variable holds a value that cannot be used."""


def resource_from_env(
    environ: dict[str, str] | None = None, overrides: dict | None = None
) -> FlowmatchResource:
    """The resource as `dagster dev` and the CLI build it from the environment.

    FLOWMATCH_DATA_ROOT (default ``data``), FLOWMATCH_METADATA (default
    ``<data root>/sample/metadata``), FLOWMATCH_SHARD_SIZE (default 10000) and
    FLOWMATCH_FILE_ROOT (folder under which file:// image URLs are allowed; default
    ``<data root>/sample``), FLOWMATCH_VAE / FLOWMATCH_DINO / FLOWMATCH_TEXT (encoder hub ids or
    folders; default the real models, or, when ``<data root>/zoo`` exists as it does after
    `flowmatch demo`, the demo's: the committed demo VAE and the random-weight zoo's DINOv2 and
    Gemma3), FLOWMATCH_DEVICE (default auto),
    FLOWMATCH_MIN_STORED_FRACTION (ingest.min_stored_fraction, default 0.5),
    FLOWMATCH_DEADLINE_S (ingest.deadline_s, default 60), FLOWMATCH_ALLOW_NETWORKS
    (ingest.allow_networks: comma-separated networks that image URLs may reach although they are
    not public, e.g. ``127.0.0.0/8`` for a local mirror; default none), FLOWMATCH_SETTINGS (a YAML or JSON
    file of standing overrides, same shape as the launchpad's: ``{encoders: {max_tokens: 64}}``;
    what `flowmatch stale` compares shards against), FLOWMATCH_SOURCES (the YAML file of the
    user's own image sources, default ``<data root>/sources.yaml``; a settings file's or the
    launchpad's ``sources`` merge into it per source). ``overrides`` (same shape as the
    resource's fields, nested settings merged field by field) win over the environment.
    """
    env = os.environ if environ is None else environ
    over = _merged(_settings_file(env.get("FLOWMATCH_SETTINGS")), overrides or {})
    root = _abs(over.pop("data_root", None) or env.get("FLOWMATCH_DATA_ROOT", "data"))
    source = over.pop("metadata_source", None) or env.get(
        "FLOWMATCH_METADATA", os.path.join(root, "sample", "metadata")
    )
    file_root = env.get("FLOWMATCH_FILE_ROOT", os.path.join(root, "sample"))
    ingest = {"file_root": _abs(file_root) if file_root else None}
    for field, var in (
        ("min_stored_fraction", "FLOWMATCH_MIN_STORED_FRACTION"),
        ("deadline_s", "FLOWMATCH_DEADLINE_S"),
    ):
        if env.get(var):
            ingest[field] = env[var]  # pydantic validates (a bad value names the field)
    if env.get("FLOWMATCH_ALLOW_NETWORKS"):  # comma-separated CIDRs (ingest.allow_networks)
        ingest["allow_networks"] = [
            n.strip() for n in env["FLOWMATCH_ALLOW_NETWORKS"].split(",") if n.strip()
        ]
    encoders: dict[str, Any] = {}
    for field in ("vae", "dino", "text", "device"):
        if env.get(ENV_OF[field]):
            encoders[field] = env[ENV_OF[field]]
        elif field != "device" and (Path(root) / "zoo" / field / "config.json").exists():
            # a demo data root: the encoders `flowmatch demo` used (so that the UI, `stale` and
            # backfills after the demo agree with it): the committed demo VAE, the real Gemma
            # where the demo made it, the zoo's others
            encoders[field] = str(DEMO_VAE if field == "vae" else Path(root) / "zoo" / field)
            from flowmatch_models.encoders.zoo import GEMMA_FOLDER, is_real_gemma

            if field == "text" and is_real_gemma(Path(root) / "zoo" / GEMMA_FOLDER):
                encoders[field] = str(Path(root) / "zoo" / GEMMA_FOLDER)
    sources = read_sources(sources_file(root, env))
    for name, cfg in (over.pop("sources", None) or {}).items():  # settings file / launchpad
        sources[name] = {**sources.get(name, {}), **cfg}
    return FlowmatchResource(
        data_root=root,
        metadata_source=_abs(source),
        shard_size=over.pop("shard_size", None) or _int_env(env, "FLOWMATCH_SHARD_SIZE", 10_000),
        filters=over.pop("filters", {}),
        ingest={**ingest, **over.pop("ingest", {})},
        encoders={**encoders, **over.pop("encoders", {})},
        sources=sources,
        **over,
    )


def _settings_file(path: str | None) -> dict:
    """The overrides in the FLOWMATCH_SETTINGS file (YAML or JSON), or {}."""
    if not path:
        return {}
    import yaml

    try:
        data = yaml.safe_load(Path(path).expanduser().read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise SettingError(f"FLOWMATCH_SETTINGS={path!r} cannot be read: {e}") from None
    if not isinstance(data, dict):
        raise SettingError(f"FLOWMATCH_SETTINGS={path!r} must hold a mapping of settings")
    return data


def _merged(base: dict, over: dict) -> dict:
    """``over`` on top of ``base``; the nested settings (filters, ingest, encoders) per field."""
    out = dict(base)
    for k, v in over.items():
        out[k] = {**out[k], **v} if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _int_env(env: Any, var: str, default: int) -> int:
    raw = env.get(var)
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise SettingError(f"{var}={raw!r} is not a whole number") from None


def overrides_config(model: type[BaseModel]) -> type:
    """``model``'s fields as a ``dg.Config`` of overrides: each optional and absent from the run
    config unless given (no default: a launchpad that sets ``max_tokens`` sets only it)."""
    fields = {
        n: (
            (str if get_origin(f.annotation) is Literal else f.annotation) | None,
            Field(description=f.description),
        )
        for n, f in model.model_fields.items()
    }
    return create_model(f"{model.__name__}Overrides", __base__=dg.Config, **fields)


FilterOverrides = overrides_config(FilterConfig)
IngestOverrides = overrides_config(IngestConfig)
EncoderOverrides = overrides_config(EncoderSpec)
SourceOverrides = overrides_config(SourceConfig)
#: the settings that resource_from_env takes as overrides (winning over a FLOWMATCH_SETTINGS file)
_OVERRIDES = ("data_root", "metadata_source", "shard_size", "filters", "ingest", "encoders")


class FlowmatchSettings(dg.ConfigurableResource):
    """flowmatch's settings (the ``flowmatch`` resource): each field unset means its FLOWMATCH_*
    variable, then the default (defs/settings.py lists them); a deployment sets a field with
    ``dg.EnvVar("FLOWMATCH_...")`` to make its variable required. The launchpad and a CLI run's
    config override fields, nested ones (filters, ingest, encoders, sources) field by field over
    the environment's (a run config's ``encoders`` replaces a constructor's ``encoders`` whole:
    a deployment sets the flat fields). Hands the assets a FlowmatchResource, built when a run
    starts (after a remote's sync)."""

    data_root: str | None = Field(description=described("data_root"))
    metadata_source: str | None = Field(description=described("metadata_source"))
    shard_size: int | None = Field(description=described("shard_size"))
    file_root: str | None = Field(description=described("file_root"))
    min_stored_fraction: float | None = Field(description=described("min_stored_fraction"))
    deadline_s: float | None = Field(description=described("deadline_s"))
    allow_networks: list[str] | None = Field(description=described("allow_networks"))
    vae: str | None = Field(description=described("vae"))
    dino: str | None = Field(description=described("dino"))
    text: str | None = Field(description=described("text"))
    device: str | None = Field(description=described("device"))
    settings_file: str | None = Field(description=described("settings_file"))
    sources_file: str | None = Field(description=described("sources_file"))
    filters: FilterOverrides | None = Field(description="Metadata filters to override.")
    ingest: IngestOverrides | None = Field(description="Image-stage settings to override.")
    encoders: EncoderOverrides | None = Field(description="Encoder settings to override.")
    sources: dict[str, SourceOverrides] | None = Field(
        description="Sources to add or override (merged per source into FLOWMATCH_SOURCES')."
    )

    def create_resource(self, context: dg.InitResourceContext) -> FlowmatchResource:
        given = context.resource_config or {}
        res = self.build(given)
        say = context.log.info if context.log else None
        if sync_remote(res.data_root, say):  # what arrived may be settings (the sources registry)
            res = self.build(given)
        return res

    def build(self, given: dict | None = None, environ: dict | None = None) -> FlowmatchResource:
        """The FlowmatchResource of these settings over ``environ`` (default: this process's).
        ``given``: the run's resource config as Dagster resolved it (exact: a null it gives is
        kept); a field it lacks is the constructor's (an EnvVar read now)."""
        env = dict(os.environ if environ is None else environ)
        values = {k: v for k, v in (given or {}).items() if v is not None}
        for k in type(self).model_fields:
            if k not in (given or {}) and getattr(self, k) is not None:
                values[k] = _plain(k, getattr(self, k))
        over = {k: values.pop(k) for k in (*_OVERRIDES, "sources") if k in values}
        for k, v in values.items():  # the others are their variables
            env[ENV_OF[k]] = ",".join(v) if isinstance(v, list) else str(v)
        return resource_from_env(env, over)


#: what ``dg.EnvVar(...)`` and ``dg.EnvVar.int(...)`` make (a field keeps it when a run config
#: that sets other fields rebuilds the resource: read here, not by Dagster)
_ENV_VARS = (dg.EnvVar, type(dg.EnvVar.int("_")))


def _plain(field: str, v: Any) -> Any:
    """A constructor's value as resource_from_env takes it: an EnvVar's value (SettingError
    naming it when unset), an overrides object's fields that are set."""
    if isinstance(v, _ENV_VARS):
        value = v.get_value()
        if value is None:
            raise SettingError(
                f"FlowmatchSettings.{field} is read from the environment variable "
                f"{v.env_var_name}, which is not set"
            )
        return value
    if isinstance(v, BaseModel):
        return {k: x for k, x in v.model_dump().items() if x is not None}
    if isinstance(v, dict):
        return {k: _plain(field, x) for k, x in v.items()}
    return v


def sync_remote(data_root: str, say=None) -> int:
    """Apply the remote's journal (of ``data_root``, if it has one) to this machine's cache;
    the number of publishes applied (0 without a remote). ``say`` gets one line when other
    machines published something."""
    store = remote.active(data_root)
    if store is None:
        return 0
    n = store.sync()
    if n and say is not None:
        say(f"remote {store.url}: {n} new publishes from other machines")
    return n


def synced(res: FlowmatchResource, say=None) -> FlowmatchResource:
    """``res`` after its remote's journal is applied to this machine's cache (no remote: as
    it is)."""
    sync_remote(res.data_root, say)
    return res
