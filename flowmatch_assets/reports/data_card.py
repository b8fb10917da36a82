"""Data cards: what a shard (or the whole dataset) holds, on one page, before any GPU-hour.

Per partition, the ``data_card`` asset writes one record row per input row
(``catalog/cards/data_card/<partition>.parquet``: caption length in characters and in tokens of
the text encoder's tokenizer, before truncation, the claimed and the decoded original size,
license and source); the catalog's ``data_card`` view joins it with every row's final outcome
(``dataset_rows``) and the text shards' fp16 saturation counts, and reports, per partition and
for the whole dataset (``scope = 'dataset'``), one row per (section, item):

    rows            input / stored / filtered / failed / pending (share of input rows)
    outcome         stored, filtered:<reason>, failed:<reason> (share of input rows)
    license, source the mix of the stored rows
    aspect          long/short side of the stored originals, in buckets
    bucket          the size each stored image was cut to (``256x256``, or its aspect-ratio
                    bucket with ``ingest.buckets: aspect``)
    kept            the share of each stored original's area its crop kept: p10 / p50 / p90 /
                    mean / max (square crops of a 3:2 photo keep 0.67)
    caption_chars, caption_tokens, orig_long_side, orig_short_side   p10 / p50 / p90 / mean / max
    text            captions_over_max_tokens (cut short by the text embeddings: share of the
                    tokenized stored rows), fp16_saturated_values (hidden-state values clamped)

:func:`render` draws the same numbers (histograms and bars) as one PNG; :func:`markdown` is the
page's text. The CLI (``flowmatch data-card``) and the ``dataset_card`` asset show the whole
dataset; each ``data_card`` materialization shows its partition.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from urllib.parse import urlparse

import numpy as np
from PIL import Image

from flowmatch_assets.catalog import CARD_SECTIONS, Catalog, format_table
from flowmatch_assets.ingest.metadata import ids_as_strings, read_metadata_shard
from flowmatch_models.storage import remote
from flowmatch_models.storage.image_shard import read_image_meta
from flowmatch_models.storage.layout import DataLayout

DATASET = "dataset"


def card_rows(
    layout: DataLayout,
    metadata_source: str,
    shard_size: int,
    partition: str,
    token_counts: Callable[[list[str]], np.ndarray] | None,
    max_tokens: int,
    rows: list[dict] | None = None,
    image_size: int = 256,
) -> list[dict]:
    """One record per input row of ``partition`` (every row of its metadata shard; ``rows``:
    a source's listed rows and failures instead, flowmatch_assets/ingest/sources)."""
    if rows is None:
        table, _ = read_metadata_shard(metadata_source, partition, shard_size)
        rows = ids_as_strings(table).to_pylist()
    decoded: dict[str, dict] = {}
    shard = remote.ensure(layout.asset_path("images", partition))  # another machine's: fetched
    if shard.exists():
        decoded = {r["id"]: r for r in read_image_meta(shard, image_size).to_pylist()}
    captions = [r.get("caption") or "" for r in rows]
    tokens = token_counts(captions) if token_counts and rows else None
    return [
        {
            "id": r["id"],
            "caption_chars": len(c.strip()),
            "caption_tokens": int(tokens[i]) if tokens is not None else None,
            "max_tokens": max_tokens,
            "width": r.get("width"),
            "height": r.get("height"),
            "orig_width": decoded.get(r["id"], {}).get("orig_width"),
            "orig_height": decoded.get(r["id"], {}).get("orig_height"),
            "bucket": f"{d['height']}x{d['width']}" if (d := decoded.get(r["id"])) else None,
            "kept": decoded.get(r["id"], {}).get("kept"),
            "license": r.get("license"),
            "source": r.get("source") or urlparse(r.get("url") or "").hostname,
        }
        for i, (r, c) in enumerate(zip(rows, captions))
    ]


def card(cat: Catalog, scope: str = DATASET) -> list[dict]:
    """The ``data_card`` view's rows of one scope (a partition key, or ``"dataset"``; a
    partition's from ``data_card_of``, which reads its summary alone)."""
    src = "data_card WHERE scope = ?" if scope == DATASET else "data_card_of(?)"
    return cat.query(
        f"SELECT section, item, value, share FROM {src} ORDER BY section_order, value DESC, item",
        [scope],
    )


def markdown(rows: list[dict], scope: str) -> str:
    """The card as markdown: one small table per section."""
    out = [f"## Data card: {'the whole dataset' if scope == DATASET else 'partition ' + scope}"]
    for s in CARD_SECTIONS:
        sub = [
            {"item": r["item"], "value": r["value"], "share": r["share"]}
            for r in rows
            if r["section"] == s
        ]
        if sub:
            out += ["", f"**{s}**", "", format_table(sub, floatfmt="{:.4g}")]
    return "\n".join(out)


#: The picture's histograms: its key -> the data card section that holds the values.
HISTOGRAMS = {
    "caption_chars": "caption_chars",
    "caption_tokens": "caption_tokens",
    "max_tokens": "max_tokens",
    "long_side": "orig_long_side",
    "aspect": "aspect_value",
    "kept": "kept",
}


def _values(cat: Catalog, scope: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The stored rows' distributions of ``scope`` as (values, how many rows have each): the
    ``data_card_histograms`` view (per-partition summaries, never the per-row records)."""
    rows = cat.query(
        "SELECT section, value, n FROM data_card_histograms WHERE scope = ? AND section IN "
        "(SELECT unnest(?)) ORDER BY section, value",
        [scope, list(HISTOGRAMS.values())],
    )
    out = {}
    for key, section in HISTOGRAMS.items():
        sub = [r for r in rows if r["section"] == section]
        out[key] = (
            np.array([r["value"] for r in sub], float),
            np.array([r["n"] for r in sub], float),
        )
    return out


def _bucket_order(item: str) -> float:
    """Buckets from the widest to the tallest (height / width)."""
    h, _, w = item.partition("x")
    return int(h) / int(w) if h.isdigit() and w.isdigit() else float("inf")


def render(cat: Catalog, scope: str = DATASET, rows: list[dict] | None = None) -> Image.Image:
    """The card as one picture: caption length (chars, tokens), original size and aspect,
    license/source mix, outcomes by reason, the stored sizes (buckets) and how much of each
    original the crop kept. ``rows``: the card's rows, if :func:`card` already read them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = card(cat, scope) if rows is None else rows
    v = _values(cat, scope)
    get = {(r["section"], r["item"]): r for r in rows}
    fig, ax = plt.subplots(2, 4, figsize=(17, 7.5))
    hist = (
        (ax[0, 0], "caption_chars", "caption length (characters)"),
        (ax[0, 1], "caption_tokens", "caption length (tokens, before truncation)"),
        (ax[1, 0], "long_side", "original long side (px)"),
        (ax[1, 1], "aspect", "original aspect (long / short)"),
        (ax[1, 3], "kept", "share of the original the crop kept"),
    )
    for a, key, title in hist:
        values, counts = v[key]
        if len(values) and key == "caption_tokens":  # integers: one bar a token count
            lo, hi = int(min(values)), int(max(values))
            a.hist(values, bins=np.arange(lo, hi + 2) - 0.5, weights=counts, color="#4c72b0")
        elif len(values):
            bins = min(30, max(5, int(counts.sum()) // 3))
            a.hist(values, bins=bins, weights=counts, color="#4c72b0")
        else:
            a.text(0.5, 0.5, "not measured", ha="center", va="center", transform=a.transAxes)
        a.set_title(title, fontsize=10)
    if len(v["max_tokens"][0]):
        limit = v["max_tokens"][0][0]
        tokens = v["caption_tokens"][0]
        if len(tokens) and max(tokens) < limit / 2:  # a line far right would squeeze the bars
            ax[0, 1].set_title(
                f"caption length (tokens; max_tokens {limit:.0f}, all below)", fontsize=10
            )
        else:
            ax[0, 1].axvline(limit, color="#c44e52", ls="--", label="max_tokens")
            ax[0, 1].legend(fontsize=8)
    mix = [r for r in rows if r["section"] in ("license", "source")]
    ax[0, 2].barh(
        [f"{r['section']}: {r['item']}" for r in mix], [r["share"] for r in mix], color="#55a868"
    )
    ax[0, 2].set_title("license and source (share of stored)", fontsize=10)
    ax[0, 2].invert_yaxis()
    out = [r for r in rows if r["section"] == "outcome"]
    ax[1, 2].barh([r["item"] for r in out], [r["share"] for r in out], color="#8172b2")
    ax[1, 2].set_title("outcome by reason (share of input rows)", fontsize=10)
    ax[1, 2].invert_yaxis()
    bk = sorted(
        (r for r in rows if r["section"] == "bucket"), key=lambda r: _bucket_order(r["item"])
    )
    ax[0, 3].barh([r["item"] for r in bk], [r["share"] or 0 for r in bk], color="#dd8452")
    ax[0, 3].set_title("stored size, height x width (share)", fontsize=10)
    ax[0, 3].invert_yaxis()
    for a in (ax[0, 2], ax[1, 2], ax[0, 3]):
        a.tick_params(axis="y", labelsize=7)

    def n(section: str, item: str) -> int:
        r = get.get((section, item))
        return int(r["value"]) if r and r["value"] is not None else 0

    title = (
        f"{'whole dataset' if scope == DATASET else 'partition ' + scope}: "
        f"{n('rows', 'input')} rows, {n('rows', 'stored')} stored, "
        f"{n('text', 'captions_over_max_tokens')} captions over max_tokens, "
        f"{n('text', 'fp16_saturated_values')} fp16-saturated text values"
    )
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    plt.close(fig)
    return Image.open(io.BytesIO(buf.getvalue())).convert("RGB")
