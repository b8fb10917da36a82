"""flowmatch_assets: the Dagster orchestration layer of flowmatch (partitions, assets, catalog, CLI)."""
