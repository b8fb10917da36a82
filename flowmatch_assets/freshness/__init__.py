"""What is stale, missing or gone: fingerprints, partition state, backfills."""
