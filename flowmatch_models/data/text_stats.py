"""The caption states' per-channel statistics a run standardises them with (``model.text_norm``):
read from the first partitions' ``text_embeddings`` shards, decoded as training decodes them."""

from __future__ import annotations

import numpy as np
import torch

from flowmatch_models.data.rows import open_rows
from flowmatch_models.embeddings.kinds import FIRST_TOKEN_ATTR
from flowmatch_models.storage import transform as transform_codec
from flowmatch_models.storage.store import ragged_offsets


def caption_stats(source, max_tokens: int = 200_000) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and std of the caption states (``text_embeddings.tokens``) over the
    first partitions of ``source`` (a :class:`~.source.ShardSource`), up to ``max_tokens`` tokens (float64 sums): the caption
    standardisation of ``model.text_norm``."""
    total = count = sq = None
    n, chunk = 0, 16_384
    for p in source.partitions:
        shard = source._shard(source.text, p)
        tokens = open_rows(shard, "tokens")
        rows = min(tokens.shape[0], max_tokens - n)
        dev = tokens.coded and source.tables(
            source.text, p, key=shard.table_key("tokens"), shard=shard
        )
        # a causal encoder's first states: the null caption's, as training decodes them
        firsts = (
            ragged_offsets(np.asarray(shard["lengths"]))[:-1]
            if shard.attrs.get(FIRST_TOKEN_ATTR) and source.null_tokens is not None
            else np.zeros(0, np.int64)
        )
        for a in range(0, rows, chunk):
            part = torch.from_numpy(
                np.empty((min(chunk, rows - a), *tokens.row_shape), tokens.dtype)
            )
            tokens.read([a], len(part), part, [0])
            t = (transform_codec.decode(part, dev) if dev else part.float()).double().numpy()
            at = firsts[(firsts >= a) & (firsts < a + len(t))] - a
            if len(at):
                t[at] = source.null_tokens[0]
            total = t.sum(0) if total is None else total + t.sum(0)
            sq = (t**2).sum(0) if sq is None else sq + (t**2).sum(0)
        n += rows
        if n >= max_tokens:
            break
    count = max(n, 1)
    mean = total / count
    std = np.sqrt(np.maximum(sq / count - mean**2, 0.0))
    return torch.from_numpy(mean).float(), torch.from_numpy(std).float()
