"""How a source of the user's own images is configured, and where that configuration lives.

A source is one named collection of captioned images in a format people already have:

``folder``
    An image folder, nested folders allowed. A caption is the sidecar text file beside the
    image (``a.jpg`` + ``a.txt``: kohya / SimpleTuner), or the ``caption_field`` of the image's
    line in a ``metadata.jsonl`` (diffusers' ImageFolder: ``{"file_name": "a.jpg", "text":
    ...}``, ``file_name`` relative to the jsonl's folder); the sidecar wins when both exist.
``parquet``
    Parquet files with the image bytes inside (the Hugging Face ``datasets`` layout: an
    ``image_field`` struct with ``bytes``/``path``, or a binary column) and a caption column
    ``caption_field``; ``*.parquet`` anywhere under ``location``.
``webdataset``
    WebDataset tar shards as img2dataset writes them (``00000.tar`` holding ``000000000.jpg``,
    ``.txt``, ``.json``); the caption is the member with extension ``caption_field`` (``txt``),
    else that key (or ``caption``) of the sample's ``.json``.
``urls``
    Lists of image URLs and captions in img2dataset's input formats (``.csv``, ``.tsv``,
    ``.tsv.gz``, ``.jsonl``, ``.parquet``; one file or a folder of them), the columns
    ``url_field`` (``url``), ``caption_field`` (``caption``) and optionally ``hash_field``
    (an md5 to check) and ``id_field``; the images stage downloads them as it downloads
    PD12M's (PD12M is the built-in source of this kind: ``urls.py``).

Every source lives in ``FLOWMATCH_SOURCES`` (a YAML file; default ``<data root>/sources.yaml``,
what ``flowmatch sources add`` writes)::

    sources:
      photos: {kind: folder, location: /data/my_photos}
      pokemon: {kind: parquet, location: "https://host/data/", caption_field: text}
      mylist: {kind: urls, location: /data/list.csv, url_field: URL, caption_field: TEXT}

Its partitions are keyed ``<name>-NNNNN`` (``photos-00000``), numbered in the order they are
registered (flowmatch_assets/ingest/sources/registry.py); PD12M's stay ``NNN-KK``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal
from urllib.parse import unquote, urlsplit

import yaml
from pydantic import BaseModel, Field, PrivateAttr, ValidationError, field_validator

from flowmatch_models.storage.atomic import atomic_write_text
from flowmatch_models.storage.layout import BUILT_IN_SOURCES, SOURCE_NAME

#: The source kinds by name, which the config and the CLI validate against: each is a
#: ``SourceKind`` in ``flowmatch_assets/ingest/sources/<kind>.py``, registered in
#: ``registry.SOURCE_KIND_REGISTRY`` (which refuses to import when the two differ).
SOURCE_KINDS = ("folder", "parquet", "webdataset", "urls")
#: The file extensions a folder or tar sample's image may have.
IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")


class SourceError(ValueError):
    """A source that cannot be used as configured; the message names it and the fix."""


#: The location schemes a source (and PD12M's ``metadata_source``) may name, besides a local
#: path. Every other fsspec protocol is refused before anything is opened: chains
#: (``simplecache::http://...``) and wrappers open their inner URL without the address guard,
#: and ``ftp``, ``webhdfs``, ``tar``, ``jupyter``, ... connect or read where no bound holds.
ALLOWED_SCHEMES = ("file", "http", "https", "s3")
_HINTS = {
    "tar": "name the .tar itself with --kind webdataset (its headers are bounded)",
    "zip": "unpack it into a folder",
}


def check_location(location: str) -> str:
    """``location`` when it is a local path or a URL of an allowed scheme
    (:data:`ALLOWED_SCHEMES`), else SourceError in one line naming the scheme and the fix."""
    if not isinstance(location, str) or not location:
        raise SourceError("a location must be a non-empty folder, file or URL")
    if location != location.strip() or any(ord(c) < 32 or ord(c) == 127 for c in location):
        raise SourceError(
            f"location {redacted(location)!r} starts or ends with white space or holds a "
            "control character: write it as the path or URL alone"
        )
    allowed = "a local path, " + ", ".join(f"{s}://" for s in ALLOWED_SCHEMES)
    if "::" in location:
        outer = location.split("::", 1)[0].split("://", 1)[0]
        raise SourceError(
            f"location {redacted(location)!r} chains filesystems ({outer}::...): not allowed, "
            "a chain opens its inner URL past the address guard; "
            + _HINTS.get(outer.lower(), f"name the inner location itself ({allowed})")
        )
    scheme = location.split("://", 1)[0].lower() if "://" in location else None
    if scheme is None and location.lower().startswith("data:"):
        scheme = "data"
    if scheme is not None and scheme not in ALLOWED_SCHEMES:
        hint = _HINTS.get(scheme, f"use {allowed}")
        raise SourceError(
            f"location scheme {scheme!r} is not allowed ({redacted(location)!r}): {hint}"
        )
    return location


def _userinfo(location: str) -> tuple[str, str] | None:
    """``(user, password)`` of a URL location that carries a password, else None."""
    if "://" not in location:
        return None
    try:
        parts = urlsplit(location)
        password = parts.password
    except ValueError:
        return None
    return (parts.username or "", password) if password else None


def redact(text: str, location: str) -> str:
    """``text`` with the password of ``location`` (``http://user:password@host/``) replaced by
    ``***``, as written and as percent-decoded: credentials live only where the user put them
    (the sources file, the environment), never in the catalog, run records or output."""
    creds = _userinfo(location)
    if creds is None or not isinstance(text, str):
        return text
    raw = location.split("://", 1)[1].split("@", 1)[0].split(":", 1)[1]
    for secret in sorted({raw, unquote(raw), creds[1]}, key=len, reverse=True):
        if secret:
            text = text.replace(secret, "***")
    return text


def redacted(location: str) -> str:
    """The location as it may be shown and recorded: ``http://user:***@host/src/``."""
    return redact(location, location)


class SourceConfig(BaseModel):
    """One source of captioned images (``kind`` at ``location``) and how to read it."""

    kind: Literal[SOURCE_KINDS] = Field(  # type: ignore[valid-type]
        description="folder (images + .txt sidecars and/or metadata.jsonl), parquet (Hugging "
        "Face datasets layout, image bytes inside), webdataset (img2dataset's tar shards) or "
        "urls (img2dataset's URL lists: csv, tsv, tsv.gz, jsonl, parquet; downloaded)."
    )
    location: str = Field(description="A folder, or an fsspec URL (file://, https://, s3://, ...).")
    caption_field: str | None = Field(
        default=None,
        description="Where the caption is: folder: the metadata.jsonl key (default text; a "
        "sidecar file wins); parquet: the column (default text); webdataset: a member "
        "extension or a key of the .json (default txt); urls: the column (default caption).",
    )
    caption_extension: str = Field(
        default=".txt", description="folder: the extension of caption sidecar files."
    )
    image_field: str = Field(
        default="image", description="parquet: the image column (struct bytes/path or binary)."
    )
    id_field: str | None = Field(
        default=None,
        description="parquet, urls: a column that names each row (default: <file stem>/<row>).",
    )
    url_field: str | None = Field(
        default=None, description="urls: the column of image URLs (default url)."
    )
    hash_field: str | None = Field(
        default=None,
        description="urls: a column of each image's md5, checked after download "
        "(ingest.check_hash; default: none).",
    )
    shard_size: int = Field(
        default=1000, gt=0, description="Samples per partition (a tar or file is cut into these)."
    )
    license: str | None = Field(
        default=None, description="License recorded for every image (filters.licenses applies)."
    )
    deadline_s: float = Field(
        default=600,
        gt=0,
        description="The longest a remote read of this source may take (a list read at "
        "registration, a file): past it the file or rows fail as timeout.",
    )
    follow_links: bool = Field(
        default=False,
        description="Read files through links that leave the location (off: such a file is a "
        "failed row, outside_source). Only regular files are read either way.",
    )

    @field_validator("location")
    @classmethod
    def _allowed(cls, v: str) -> str:
        return check_location(v)

    @field_validator("caption_extension")
    @classmethod
    def _dot(cls, v: str) -> str:
        return v if v.startswith(".") else f".{v}"

    def caption(self) -> str:
        """``caption_field`` or the kind's default."""
        return self.caption_field or {"webdataset": "txt", "urls": "caption"}.get(self.kind, "text")

    def url(self) -> str:
        """``url_field`` or its default (``urls``)."""
        return self.url_field or "url"

    #: Networks a remote location may reach although they are not public (the resource's
    #: ``ingest.allow_networks``, set by FlowmatchResource.source; not a setting of its own).
    _allow_networks: tuple[str, ...] = PrivateAttr(default=())

    def allowing(self, networks) -> SourceConfig:
        """This config, whose remote location may reach ``networks`` (ingest.allow_networks)."""
        self._allow_networks = tuple(networks or ())
        return self

    @property
    def shown(self) -> str:
        """The location as it may be shown and recorded (a password as ``***``)."""
        return redacted(self.location)

    def row_fields(self) -> dict:
        """The settings that change what a partition's rows hold (its fingerprint, recorded
        with each materialization: the location redacted); ``follow_links`` only when on, so
        sources made before it existed stay fresh (``url_field``/``hash_field`` alike: a
        ``urls`` source's url column always)."""
        skip = {"shard_size", "deadline_s"} | (set() if self.follow_links else {"follow_links"})
        skip |= {k for k in ("url_field", "hash_field") if getattr(self, k) is None}
        urls = {"url_field": self.url()} if self.kind == "urls" else {}
        return (
            self.model_dump(exclude=skip)
            | urls
            | {
                "caption_field": self.caption(),
                "location": self.shown,
            }
        )


def check_name(name: str) -> str:
    """A source name is lower-case letters, digits and ``_``, a letter first (it starts its
    partition keys); a built-in source's name (``pd12m``) is taken."""
    if not SOURCE_NAME.fullmatch(name) or name in BUILT_IN_SOURCES:
        raise SourceError(
            f"source name {name!r}: use lower-case letters, digits and _ (a letter first, at "
            f"most 32), not {' or '.join(map(repr, BUILT_IN_SOURCES))}; it starts the "
            f"partition keys ({name}-00000)"
        )
    return name


def sources_file(data_root: str | Path, environ: dict | None = None) -> Path:
    """``FLOWMATCH_SOURCES``, else ``<data root>/sources.yaml``."""
    env = os.environ if environ is None else environ
    raw = env.get("FLOWMATCH_SOURCES")
    return Path(raw).expanduser().resolve() if raw else Path(data_root) / "sources.yaml"


def read_sources(path: str | Path) -> dict[str, dict]:
    """The sources in a sources file (``{sources: {name: {...}}}`` or ``{name: {...}}``);
    {} when it does not exist. Raises SourceError naming the file and the problem."""
    p = Path(path)
    if not p.is_file():
        return {}
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise SourceError(f"sources file {p} cannot be read: {e}") from None
    data = data.get("sources", data) if isinstance(data, dict) else data
    if not isinstance(data, dict):
        raise SourceError(f"sources file {p}: expected a mapping of source name -> settings")
    out = {}
    for name, raw in data.items():
        check_name(str(name))
        raw = dict(raw or {})
        loc = raw.get("location")
        if (
            isinstance(loc, str)
            and loc == loc.strip()
            and "://" not in loc
            and "::" not in loc
            and not Path(loc).expanduser().is_absolute()
        ):
            # relative to the sources file; a link stays a link (followed when read)
            raw["location"] = os.path.abspath(p.parent / loc)
        try:
            out[str(name)] = SourceConfig.model_validate(raw).model_dump(exclude_unset=True)
        except ValidationError as e:
            err = e.errors()[0]
            key = ".".join(str(x) for x in err["loc"])
            raise SourceError(f"sources file {p}: source {name}: {key}: {err['msg']}") from None
    return out


def write_source(path: str | Path, name: str, cfg: SourceConfig | None) -> Path:
    """Add or replace source ``name`` in the sources file, or remove it (``cfg`` None);
    written atomically."""
    check_name(name)
    p = Path(path)
    sources = read_sources(p)
    if cfg is None:
        sources.pop(name, None)
    else:
        sources[name] = cfg.model_dump(exclude_defaults=True) | {"kind": cfg.kind}
    atomic_write_text(p, yaml.safe_dump({"sources": sources}, sort_keys=False))
    from flowmatch_models.storage import remote

    store = remote.active(p.parent)  # the default sources file, in a remote data root
    if store is not None and p.parent.resolve() == store.root:
        store.push_files([p])
    return p


def absolute(location: str) -> str:
    """A local location as an absolute path (URLs as they are). A link is kept as given, not
    resolved: re-pointing it later points the source at the new target."""
    if "://" in location or location != location.strip():
        return location  # check_location names what is wrong with an odd one
    return os.path.abspath(os.path.expanduser(location))
