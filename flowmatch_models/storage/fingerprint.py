"""Fingerprints: what made a shard, as a small dict of named fields plus a short hash.

A fingerprint holds every setting that changes a shard's values -- model id and the identity
of its weights (``weights_sha256`` of a local folder, or the ``revision`` a hub id resolves to
in the HF cache), preprocessing (image size, pooling, max tokens, ...), compute and storage
dtypes, codec, the kind's ``code_version`` -- and ``inputs``: the fingerprint hash of each
upstream partition it was made from, so an image-stage change reaches every embedding. Its
``hash`` covers both; it is the shard's Dagster data version.

Staleness compares field by field (:func:`diff`), so the reason names the field that changed:
``max_tokens: 128 -> 64``. Shards made before fingerprints have none: "unknown", stale against
any expectation, still trainable together.

Weight hashing reads every file of a model folder once per process (cached by path, size and
mtime; optionally also in a JSON file, so the next process skips it): see BENCHMARKS.md
"Fingerprints" for its cost.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

#: Shard attr (embedding store) and catalog ``extra`` key that hold the fingerprint.
ATTR = "fingerprint"
UNKNOWN = "unknown"
_HASH_CHARS = 16


def _canonical(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


@dataclass(frozen=True)
class Fingerprint:
    """The fields of what made a partition, and the hashes of its inputs' fingerprints."""

    fields: dict
    inputs: dict[str, str | None] = field(default_factory=dict)
    #: digests of the rows a partition holds, or was made from (:func:`rows_digest`:
    #: ``{"ids": ..., "captions": ...}``): compared by staleness, outside the hash (every
    #: partition's rows differ, its settings do not)
    rows: dict[str, str] = field(default_factory=dict, compare=False)

    @property
    def hash(self) -> str:
        body = _canonical({"fields": self.fields, "inputs": self.inputs})
        return hashlib.sha256(body.encode()).hexdigest()[:_HASH_CHARS]

    def to_json(self) -> dict:
        out = {"hash": self.hash, "fields": dict(self.fields), "inputs": dict(self.inputs)}
        return {**out, "rows": dict(self.rows)} if self.rows else out

    def with_rows(self, **rows: str) -> Fingerprint:
        """This fingerprint with row digests added (:attr:`rows`)."""
        return Fingerprint(self.fields, self.inputs, {**self.rows, **rows})

    @classmethod
    def from_json(cls, d: dict | str | None) -> Fingerprint | None:
        """The fingerprint stored as :meth:`to_json` (a dict or its JSON text), or None."""
        if isinstance(d, str):
            d = json.loads(d)
        if not d or "fields" not in d:
            return None
        return cls(dict(d["fields"]), dict(d.get("inputs") or {}), dict(d.get("rows") or {}))


def rows_digest(ids, captions=None) -> str:
    """A short digest of a partition's rows: its ids in order (``captions``: each id with its
    caption text). What a caption kind is made from is exactly ``rows_digest(ids, captions)``
    of the images shard; an image kind's rows are ``rows_digest(ids)``."""
    h = hashlib.sha256()
    for i, row in enumerate(ids):
        h.update(str(row).encode("utf-8", "surrogatepass") + b"\0")
        if captions is not None:
            c = captions[i]
            h.update(("" if c is None else str(c)).encode("utf-8", "surrogatepass") + b"\1")
    return h.hexdigest()[:_HASH_CHARS]


def hash_of(fp: Fingerprint | None) -> str:
    """The fingerprint's hash, or ``unknown`` for a shard made before fingerprints."""
    return fp.hash if fp is not None else UNKNOWN


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def diff(stored: dict, expected: dict) -> list[str]:
    """Fields that differ, as ``name: stored -> expected`` (nested dicts by dotted name; a
    field only one side has shows as ``(none)`` on the other)."""
    a, b = _flat(stored), _flat(expected)
    out = []
    for k in sorted(set(a) | set(b)):
        if a.get(k, ...) != b.get(k, ...):
            show = lambda v: "(none)" if v is ... else _canonical(v).strip('"')  # noqa: E731
            out.append(f"{k}: {show(a.get(k, ...))} -> {show(b.get(k, ...))}")
    return out


def disagreement(
    fps: dict[str, Fingerprint | None], source_of: Callable[[str], str] | None = None
) -> str | None:
    """None when every partition's fingerprint is the same (or all unknown); otherwise which
    partitions disagree with the first one, and on which fields.

    With ``source_of`` (partition -> its source), partitions of one source must share a
    fingerprint and partitions of different sources only its ``fields`` (the kind's own
    settings): their ``inputs`` differ because each source's rows stage records its own
    settings (flowmatch_assets/ingest/sources), which changes no array's meaning. A fingerprint
    recorded before the resolved compute dtype reads as :func:`as_resolved` makes it."""
    fps = {p: as_resolved(fp) for p, fp in fps.items()}
    if source_of is not None:
        by: dict[str, dict[str, Fingerprint | None]] = {}
        for p, fp in fps.items():
            by.setdefault(source_of(p), {})[p] = fp
        for group in by.values():
            if why := disagreement(group):
                return why
        first = {s: next(iter(g.items())) for s, g in by.items()}
        fields = {
            p: (Fingerprint(fp.fields) if fp is not None else None) for p, fp in first.values()
        }
        return disagreement(fields)
    groups: dict[str, list[str]] = {}
    for p, fp in fps.items():
        groups.setdefault(hash_of(fp), []).append(p)
    if len(groups) <= 1:
        return None
    (h0, parts0), *rest = groups.items()
    fp0 = fps[parts0[0]]
    lines = [f"{len(parts0)} partitions ({_few(parts0)}) have fingerprint {h0}"]
    for h, parts in rest:
        fp = fps[parts[0]]
        if fp is None or fp0 is None:
            why = "no fingerprint recorded (made before fingerprints)"
        else:
            why = "; ".join(diff(fp0.fields, fp.fields) + _input_diff(fp0, fp)) or "inputs"
        lines.append(f"{len(parts)} ({_few(parts)}) have {h}: {why}")
    return "; ".join(lines)


def _input_diff(a: Fingerprint, b: Fingerprint) -> list[str]:
    return [
        f"input {k}: {a.inputs.get(k)} -> {b.inputs.get(k)}"
        for k in sorted(set(a.inputs) | set(b.inputs))
        if a.inputs.get(k) != b.inputs.get(k)
    ]


def _few(parts: list[str], n: int = 5) -> str:
    return ", ".join(parts[:n]) + (f" and {len(parts) - n} more" if len(parts) > n else "")


# ------------------------------------------------------------------------ weights identity

_lock = threading.Lock()
_memo: dict[tuple, str] = {}


def _folder_state(folder: Path) -> tuple:
    """(relative path, size, mtime_ns) of every file in the folder (hidden files excluded)."""
    files = []
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder)
        if p.is_file() and not any(part.startswith(".") for part in rel.parts):
            st = p.stat()
            files.append((str(rel), st.st_size, st.st_mtime_ns))
    return tuple(files)


def folder_sha256(folder: str | Path, cache_file: str | Path | None = None) -> str:
    """sha256 over the names and contents of every file in a model folder (weights, config,
    tokenizer). Computed once per process and folder state (path, sizes, mtimes); with
    ``cache_file`` also remembered on disk for the next process."""
    folder = Path(folder).expanduser().resolve()
    state = _folder_state(folder)
    key = (str(folder), state)
    with _lock:
        if key in _memo:
            return _memo[key]
    disk_key = hashlib.sha256(_canonical(key).encode()).hexdigest()
    disk = _read_cache(cache_file)
    digest = disk.get(disk_key)
    if digest is None:
        h = hashlib.sha256()
        for rel, _, _ in state:
            h.update(rel.encode() + b"\0")
            with open(folder / rel, "rb") as f:
                while chunk := f.read(1 << 22):
                    h.update(chunk)
        digest = h.hexdigest()
        if cache_file is not None:
            _write_cache(Path(cache_file), {disk_key: digest})
    with _lock:
        _memo[key] = digest
    return digest


def _read_cache(cache_file: str | Path | None) -> dict:
    if cache_file is None:
        return {}
    try:
        return json.loads(Path(cache_file).read_text())
    except (OSError, ValueError):
        return {}


def _write_cache(path: Path, entries: dict) -> None:
    from flowmatch_models.storage.atomic import atomic_path

    merged = {**_read_cache(path), **entries}
    try:
        with atomic_path(path) as tmp:
            tmp.write_text(json.dumps(merged, indent=0, sort_keys=True))
    except OSError:  # a read-only place: the in-process memo still holds it
        pass


def hub_revision(model_id: str) -> str | None:
    """The commit a hub id resolves to in the local HF cache (``refs/main``), or None."""
    try:
        from huggingface_hub import constants
    except ImportError:  # pragma: no cover
        return None
    ref = Path(constants.HF_HUB_CACHE) / f"models--{model_id.replace('/', '--')}" / "refs" / "main"
    try:
        return ref.read_text().strip() or None
    except OSError:
        return None


def weights_identity(model: str, cache_file: str | Path | None = None) -> dict:
    """``{"weights_sha256": ...}`` for a local folder, ``{"revision": ...}`` for a hub id
    (``unresolved`` when it is not in the HF cache)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return {"weights_sha256": folder_sha256(path, cache_file)}
    return {"revision": hub_revision(model) or "unresolved"}


def weights_cache_file(data_root: str | Path) -> Path:
    """Where a data root remembers weight hashes between processes."""
    return Path(os.fspath(data_root)) / "catalog" / "weights_sha256.json"


# ------------------------------------------------------------------- compute dtype and device

#: The short names a fingerprint records for a resolved compute dtype.
DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def dtype_name(dtype) -> str:
    """``torch.bfloat16`` (or ``"bfloat16"``, ``"bf16"``) -> ``"bf16"``."""
    name = str(dtype).removeprefix("torch.")
    return DTYPE_NAMES.get(name, name)


def auto_resolution() -> dict:
    """What ``device: auto`` and ``dtype: auto`` resolve to on this machine, as a fingerprint
    records them: ``{"compute_dtype": "bf16", "device": "cuda"}`` with a GPU, ``fp32``/``cpu``
    without (flowmatch_models.encoders.resolve.resolve_dtype)."""
    from flowmatch_models.encoders.resolve import resolve_device, resolve_dtype

    dev = resolve_device("auto")
    return {"compute_dtype": dtype_name(resolve_dtype("auto", dev)), "device": dev.type}


def is_legacy_auto(fields: dict) -> bool:
    """A fingerprint recorded before the resolved compute dtype was (``compute_dtype: auto``
    and no ``device``): it was made with whatever ``auto`` resolved to where it ran."""
    return fields.get("compute_dtype") == "auto" and "device" not in fields


def as_resolved(fp: Fingerprint | None) -> Fingerprint | None:
    """``fp`` as it would be recorded now: a fingerprint from before the resolved compute dtype
    (:func:`is_legacy_auto`) read as made with what ``auto`` resolves to here (its stored hash
    and records are never rewritten: comparisons read it so, so no shard made with the dtype
    ``auto`` still resolves to turns stale after the upgrade); any other unchanged."""
    if fp is None or not is_legacy_auto(fp.fields):
        return fp
    return Fingerprint({**fp.fields, **auto_resolution()}, fp.inputs, fp.rows)
