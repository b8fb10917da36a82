"""PD12M metadata, global dedupe and the image ingest: no Dagster."""
