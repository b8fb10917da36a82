"""The data card assets (flowmatch_assets/reports/data_card.py): a picture per partition and one for the
whole dataset. (No ``from __future__ import annotations`` here: Dagster reads the annotations.)"""

import time

import dagster as dg

from flowmatch_assets import catalog
from flowmatch_assets.catalog import Catalog
from flowmatch_assets.defs.data_assets import images, metadata
from flowmatch_assets.defs.partitions import shard_partitions
from flowmatch_assets.defs.resources import FlowmatchResource
from flowmatch_assets.ingest.sources import partition_source
from flowmatch_assets.reports.data_card import DATASET, card, card_rows, markdown, render
from flowmatch_models.figures.grid import markdown_image, save_png
from flowmatch_models.storage.atomic import atomic_write_text

GROUP = "reports"


def _token_counter(flowmatch: FlowmatchResource, log):
    """The text encoder's tokenizer as a counter, or None (logged) when it cannot load."""
    from flowmatch_models.encoders.frozen import Encoders

    enc = Encoders(flowmatch.encoders)
    try:
        enc.tokenizer  # noqa: B018 - load now, so a missing tokenizer is one warning
    except Exception as e:  # noqa: BLE001 - the card is still useful without token counts
        log.warning(f"data card: no caption token counts ({str(e).splitlines()[0]})")
        return None
    return enc.token_counts


def _numbers(rows: list[dict]) -> dict:
    """The card's headline numbers for the UI's metadata."""
    get = {(r["section"], r["item"]): r["value"] for r in rows}
    return {
        "input_rows": int(get.get(("rows", "input")) or 0),
        "stored_rows": int(get.get(("rows", "stored")) or 0),
        # apart, as `flowmatch catalog failures` counts them (dataset-wide on dataset_card)
        "filtered_rows": int(get.get(("rows", "filtered")) or 0),
        "failed_rows": int(get.get(("rows", "failed")) or 0),
        "caption_tokens_p50": get.get(("caption_tokens", "p50")),
        "captions_over_max_tokens": int(get.get(("text", "captions_over_max_tokens")) or 0),
        "fp16_saturated_values": int(get.get(("text", "fp16_saturated_values")) or 0),
    }


@dg.asset(
    partitions_def=shard_partitions,
    deps=[metadata, images],  # + the text kinds: definitions.assets()
    group_name=GROUP,
    kinds={"duckdb", "matplotlib"},
    description="The shard's data card: caption length (chars, tokens), original size and aspect, license and source mix, outcomes by reason, text saturation.",
)
def data_card(
    context: dg.AssetExecutionContext, flowmatch: FlowmatchResource
) -> dg.MaterializeResult:
    """Record the partition's per-row card facts, then draw its card from the catalog view."""
    t0 = time.perf_counter()
    part, layout = context.partition_key, flowmatch.layout
    listed = partition_source(flowmatch, part).listing(part)  # its input rows, failures included
    rows = card_rows(
        layout,
        flowmatch.metadata_source,
        flowmatch.shard_size,
        part,
        _token_counter(flowmatch, context.log),
        flowmatch.encoders.max_tokens,
        rows=listed,
        image_size=flowmatch.ingest.size,
    )
    catalog.record_card_rows(flowmatch.data_root, part, rows)
    cat = Catalog(flowmatch.data_root)
    view = card(cat, part)
    img = render(cat, part, view)
    png = save_png(img, layout.preview_path("data_card", part))
    context.log.info(f"{part}: data card of {len(rows)} rows in {time.perf_counter() - t0:.1f}s")
    return dg.MaterializeResult(
        metadata={
            **_numbers(view),
            "card": dg.MetadataValue.md(markdown_image(img, f"data card {part}", max_side=900)),
            "table": dg.MetadataValue.md(markdown(view, part)),
            "card_png": dg.MetadataValue.path(str(png)),
        }
    )


def write_dataset_card(data_root: str) -> tuple[str, str, object, list[dict]]:
    """Render the whole dataset's card: (markdown path, png path, image, view rows)."""
    cat = Catalog(data_root)
    view = card(cat, DATASET)
    img = render(cat, DATASET, view)
    reports = cat.layout.root / "reports"
    md_path, png_path = reports / "data_card.md", reports / "data_card.png"
    save_png(img, png_path)
    atomic_write_text(md_path, markdown(view, DATASET) + "\n\n![data card](data_card.png)\n")
    return str(md_path), str(png_path), img, view


@dg.asset(
    group_name=GROUP,
    kinds={"duckdb", "matplotlib"},
    description="The whole dataset's data card (every partition with a data_card): read it before spending GPU-hours.",
)
def dataset_card(
    context: dg.AssetExecutionContext, flowmatch: FlowmatchResource
) -> dg.MaterializeResult:
    """Draw the card over every partition's records; write ``reports/data_card.{md,png}``."""
    md_path, png_path, img, view = write_dataset_card(flowmatch.data_root)
    return dg.MaterializeResult(
        metadata={
            **_numbers(view),
            "card": dg.MetadataValue.md(markdown_image(img, "data card", max_side=900)),
            "table": dg.MetadataValue.md(markdown(view, DATASET)),
            "path": dg.MetadataValue.path(md_path),
            "card_png": dg.MetadataValue.path(png_path),
        }
    )
