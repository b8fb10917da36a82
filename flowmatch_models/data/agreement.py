"""Which partitions of an embedding kind may train together: the fingerprint each shard
records, compared as :func:`agreeing` says (a captions-only kind by its fields alone; an
older shard's ``auto`` dtype as resolved here)."""

from __future__ import annotations

from flowmatch_models.embeddings.kinds import KINDS
from flowmatch_models.storage.fingerprint import ATTR as FINGERPRINT_ATTR
from flowmatch_models.storage.fingerprint import Fingerprint, as_resolved
from flowmatch_models.storage.layout import DataLayout
from flowmatch_models.storage.store import StoreError, read_shard


class FingerprintMismatchError(ValueError):
    """Partitions of one embedding kind made by different settings (fingerprints)."""


def shard_fingerprint(layout: DataLayout, kind: str, partition: str) -> Fingerprint | None:
    """The fingerprint in a shard's attrs (None: made before fingerprints, or unreadable)."""
    try:
        attrs = read_shard(layout.asset_path(kind, partition)).attrs
    except (OSError, StoreError):
        return None
    return Fingerprint.from_json(attrs.get(FINGERPRINT_ATTR))


def agreeing(kind: str, fp: Fingerprint | None) -> Fingerprint | None:
    """What partitions of ``kind`` must share to be trained together: the fingerprint; for a
    kind that reads only the rows' captions (its values do not depend on how the images were
    stored), its fields alone (a shard from before exact inputs recorded the images partition's
    fingerprint as its input; one made since, the rows it read: both train together). One
    recorded before the resolved compute dtype reads as made with what ``auto`` resolves to here
    (``as_resolved``): it trains with the shards made here since."""
    fp = as_resolved(fp)
    k = KINDS.get(kind)
    if fp is None or k is None or k.role.input != "captions":
        return fp
    return Fingerprint(fp.fields)
