"""Stored batches decoded on the device: codes to values with their partition's tables, captions padded."""

from __future__ import annotations

import logging

import torch

from flowmatch_models.data.batch import DecodedBatch, StoredBatch
from flowmatch_models.embeddings.kinds import model_inputs
from flowmatch_models.storage import transform as transform_codec

log = logging.getLogger(__name__)


def decode_batch(
    batch: StoredBatch,
    tables,
    scaling_factor: float,
    device,
    null_first: torch.Tensor | None = None,
) -> DecodedBatch:
    """A stored batch (:meth:`ShardSource.read`, :class:`StoredBatch`) as float32 model inputs
    on ``device``: latents scaled; each group's text/DINO rows decoded with the tables of the
    file they were read from (``tables(kind, partition, key)`` ->
    :class:`~flowmatch_models.storage.transform.DeviceTables` on ``device``,
    :meth:`ShardSource.tables`; ``key``: the batch's ``<input>_tables``), or fp16 rows widened,
    then put in place (``index_copy_`` to ``<key>_dst``; text padding stays zero); the first
    caption state of a group flagged in ``text_first_null`` is ``null_first`` exactly (a
    causal encoder's, :data:`~flowmatch_models.embeddings.kinds.FIRST_TOKEN_ATTR`). Tensors already
    on ``device`` stay there; nothing here waits on the device."""
    if "text_rows" not in batch:
        return batch  # decoded already
    out = {k: v for k, v in batch.items() if not k.startswith(("text_", "dino_"))}
    for k in ("parts", "coded", "sizes"):
        out.pop(k, None)
    if "latents" in batch:
        out["latents"] = batch["latents"].to(device).float() * scaling_factor
    mask = batch["mask"].to(device)
    out["mask"] = mask
    b, width = mask.shape

    inputs = model_inputs()
    for key in ("text", "dino"):
        if f"{key}_rows" not in batch:
            continue
        rows = batch[f"{key}_rows"].to(device)
        if key in batch["coded"]:
            parts, start = [], 0
            keys = batch.get(f"{key}_tables") or [None] * len(batch["parts"])
            for p, n, k in zip(batch["parts"], batch[f"{key}_counts"], keys):
                parts.append(
                    transform_codec.decode(rows[start : start + n], tables(inputs[key].name, p, k))
                )
                start += n
            values = torch.cat(parts) if len(parts) > 1 else parts[0]
        else:
            values = rows.float()
        lead = (b * width,) if key == "text" else (b,)
        x = torch.zeros((*lead, *values.shape[1:]), device=values.device)
        dst = batch[f"{key}_dst"].to(device)
        flags = batch.get("text_first_null") if key == "text" else None
        if flags and any(flags):  # a caption's first row goes to position 0 of its sample
            if null_first is None:
                raise ValueError("a batch with exact first states needs null_first")
            first = dst % width == 0
            if not all(flags):  # partitions stored before the flag: as stored
                first &= torch.cat(
                    [
                        torch.full((n,), f, dtype=torch.bool, device=dst.device)
                        for f, n in zip(flags, batch["text_counts"])
                    ]
                )
            values = torch.where(first[:, None], null_first.to(values.device), values)
        x.index_copy_(0, dst, values)
        out[key] = x.view(b, width, -1) if key == "text" else x
    return out
