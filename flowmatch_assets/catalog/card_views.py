"""The data card's views in catalog.duckdb (flowmatch_assets/reports/data_card.py reads
them): per partition and for the whole dataset, from each partition's card summary; the SQL
that :mod:`.views` creates with the others."""

from __future__ import annotations

from flowmatch_assets.catalog import derived, outcome_rules
from flowmatch_assets.catalog.records import CARD_SECTIONS

#: The data card's count sections whose shares are of the section's total.
CARD_SHARED = ("outcome", "license", "source", "aspect", "bucket")


def _quantile(q: float) -> str:
    """``quantile_cont(value, q)`` over the dataset's merged bins (``lo<q>``: the value at row
    floor((n - 1) q), ``hi<q>``: the next row's), interpolated as DuckDB's quantile_cont."""
    k, c = f"((total - 1) * {q})", int(q * 100)
    return f"lo{c} + ({k} - floor({k})) * (coalesce(hi{c}, lo{c}) - lo{c})"


def data_card_views(cards: str, summaries: str) -> list[str]:
    """The data card (flowmatch_assets/reports/data_card.py): per partition and whole dataset,
    from each partition's summary (catalog/summary.py: counts, exact statistics and bins), so
    no per-row record is read; the dataset's quantiles come from the merged bins (within 0.5%;
    whole numbers below 256 exactly), its mean and max are exact. ``data_card_of(partition)``
    is one partition's card, reading its summary alone. ``cards``: the card records' table
    expression (views.py's glob); ``summaries``: the card summaries' list of files."""
    return [
        # every row of every card: its facts and its final outcome (per row; the card itself
        # reads data_card_summary)
        f"""CREATE OR REPLACE VIEW data_card_rows AS
            SELECT c.* EXCLUDE (asset), d.outcome, d.reason, d.kept_id
            FROM {cards} c
            JOIN dataset_rows d ON d.partition = c.partition AND d.id = c.id
            WHERE c.asset IS NOT NULL""",
        # each partition's card: rows per item of a count section; per distribution its
        # statistics (p10, p50, p90, mean, max, sum, count: value) and bins (item 'bin')
        f"""CREATE OR REPLACE VIEW data_card_summary AS
            SELECT * FROM read_parquet({summaries}) WHERE partition IS NOT NULL""",
        # the distributions' bins, per partition and for the dataset (the card's picture)
        """CREATE OR REPLACE VIEW data_card_histograms AS
            SELECT partition AS scope, section, value, n FROM data_card_summary
            WHERE item = 'bin'
            UNION ALL
            SELECT 'dataset', section, value, sum(n) FROM data_card_summary
            WHERE item = 'bin' GROUP BY section, value""",
        f"CREATE OR REPLACE VIEW data_card AS {_card_select('data_card_summary', True)}",
        "CREATE OR REPLACE MACRO data_card_of(p) AS TABLE "
        + _card_select("(SELECT * FROM data_card_summary WHERE partition = p)", False),
    ]


def _card_select(src: str, dataset: bool) -> str:
    """The card's rows (scope, section, item, value, share, section_order) from the summaries
    ``src``: per partition, and with ``dataset`` for the whole dataset too."""
    order = ", ".join(f"('{s}', {i})" for i, s in enumerate(CARD_SECTIONS))
    stats = ", ".join(f"'{x}'" for x in derived.CARD_STATS)
    shared = ", ".join(f"'{x}'" for x in CARD_SHARED)
    bounds = ", ".join(
        f"min(value) FILTER (cum > floor((total - 1) * {q})) AS lo{int(q * 100)}, "
        f"min(value) FILTER (cum > floor((total - 1) * {q}) + 1) AS hi{int(q * 100)}"
        for q in (0.1, 0.5, 0.9)
    )
    outcome = "split_part(item, ':', 1)"
    outcomes = outcome_rules.OUTCOMES
    items = ", ".join(f"'{o}'" for o in ("input", *outcomes))
    counts = ", ".join(f"coalesce(sum(n) FILTER ({outcome} = '{o}'), 0)" for o in outcomes)
    share = ", ".join(f"coalesce(sum(n) FILTER ({outcome} = '{o}'), 0) / sum(n)" for o in outcomes)
    whole_counts = """UNION ALL
              SELECT 'dataset', section, item, sum(n) FROM s WHERE n IS NOT NULL
                AND item != 'bin' GROUP BY section, item"""
    whole_stats = f""",
            h AS (
              SELECT section, value, n,
                     sum(n) OVER (PARTITION BY section ORDER BY value) AS cum,
                     sum(n) OVER (PARTITION BY section) AS total
              FROM (SELECT section, value, sum(n) AS n FROM s
                    WHERE item = 'bin' AND section IN ({stats}) GROUP BY section, value)),
            q AS (SELECT section, any_value(total) AS total, {bounds} FROM h GROUP BY section),
            m AS (
              SELECT section, sum(value) FILTER (item = 'sum')
                              / sum(value) FILTER (item = 'count') AS mean,
                     max(value) FILTER (item = 'max') AS max
              FROM s WHERE section IN ({stats}) GROUP BY section)"""
    whole_quantiles = f"""UNION ALL
              SELECT 'dataset', section, unnest(['p10', 'p50', 'p90', 'mean', 'max']),
                     unnest([{_quantile(0.1)}, {_quantile(0.5)}, {_quantile(0.9)},
                             mean, max])::DOUBLE, NULL::DOUBLE
              FROM q JOIN m USING (section)"""
    sets = "GROUPING SETS ((partition), ())" if dataset else "partition"
    return f"""
            WITH s AS {"MATERIALIZED " if dataset else ""}(SELECT * FROM {src}),
            counts AS (
              SELECT partition AS scope, section, item, n FROM s WHERE n IS NOT NULL
                AND item != 'bin'
              {whole_counts if dataset else ""}){whole_stats if dataset else ""},
            parts AS (
              SELECT scope, 'rows' AS section,
                     unnest([{items}]) AS item,
                     unnest([sum(n), {counts}])::DOUBLE AS value,
                     unnest([1.0, {share}]) AS share
              FROM counts WHERE section = 'outcome' GROUP BY scope
              UNION ALL
              SELECT scope, section, item, n::DOUBLE, NULL::DOUBLE FROM counts
              WHERE section IN ({shared})
              UNION ALL
              SELECT partition, section, item, value, NULL::DOUBLE FROM s
              WHERE section IN ({stats}) AND item IN ('p10', 'p50', 'p90', 'mean', 'max')
              {whole_quantiles if dataset else ""}
              UNION ALL
              SELECT scope, 'text', 'captions_over_max_tokens',
                     sum(n) FILTER (item = 'captions_over_max_tokens')::DOUBLE,
                     sum(n) FILTER (item = 'captions_over_max_tokens')
                       / nullif(sum(n) FILTER (item = 'tokenized'), 0)
              FROM counts WHERE section = 'text' GROUP BY scope
              UNION ALL
              SELECT CASE WHEN grouping(partition) = 1 THEN 'dataset' ELSE partition END,
                     'text', 'fp16_saturated_values',
                     sum(CAST(extra->>'$.fp16_saturated' AS BIGINT))::DOUBLE, NULL
              FROM materializations
              WHERE extra->>'$.fp16_saturated' IS NOT NULL
                AND partition IN (SELECT partition FROM s)
              GROUP BY {sets}
            )
            SELECT p.scope, p.section, p.item, p.value,
                   CASE WHEN p.section IN ({shared})
                        THEN p.value / sum(p.value) OVER (PARTITION BY p.scope, p.section)
                        ELSE p.share END AS share,
                   o.section_order
            FROM parts p JOIN (VALUES {order}) o(section, section_order) USING (section)"""
