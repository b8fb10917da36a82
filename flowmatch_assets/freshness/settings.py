"""What freshness reads of the settings, as a protocol: freshness/ never imports defs/.

``FlowmatchResource`` (defs/resources.py, the Dagster resource) has these attributes, and so
may any plain object a caller builds (a test, a notebook); ``resource_from_env`` there builds
one from the environment, and the CLI (cli/) hands it in.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from flowmatch_assets.ingest.images import IngestConfig
    from flowmatch_assets.ingest.metadata import FilterConfig
    from flowmatch_models.encoders.spec import EncoderSpec
    from flowmatch_models.storage.layout import DataLayout


class Settings(Protocol):
    """The settings a fingerprint, a staleness report or a backfill depends on."""

    data_root: str
    metadata_source: str
    shard_size: int
    filters: FilterConfig
    ingest: IngestConfig
    encoders: EncoderSpec
    sources: Mapping[str, Any]

    @property
    def layout(self) -> DataLayout: ...

    def source(self, name: str) -> Any: ...


#: Settings from the environment, ``overrides`` (the resource's fields) winning: the CLI passes
#: ``defs.resources.resource_from_env``'s keyword form.
SettingsFrom = Callable[..., Settings]
