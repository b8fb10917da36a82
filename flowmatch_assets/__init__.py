"""flowmatch_assets: the pipeline around flowmatch_models, one folder per concern.

    defs/       every Dagster definition (resources, partitions, assets, checks, sensors, jobs)
    ingest/     PD12M metadata and filters, global dedupe, image download and encode, the shard
    catalog/    the DuckDB catalog: per-partition records and the views over them
    freshness/  what is stale (fingerprints), missing or gone (state), and backfills of them
    reports/    budget, data card, caption-following evaluation and its analyser
    demo/       the synthetic PD12M-format dataset, its images, the committed demo VAE
    cli/        `flowmatch`: the table of verbs; runs.py is the in-process runs they call
    bench/      every benchmark (BENCHMARKS.md)

Only defs/, cli/, freshness/, bench/, runs.py, compat.py (every private Dagster API) and the two
code locations (definitions.py, definitions_k8s.py) import Dagster; docs/DESIGN.md has the map.
"""
