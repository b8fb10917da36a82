"""The one dynamic partitions definition, ``shards``: every partition of PD12M and of the
configured sources (defs/partitions.py registers them; freshness/ reads and records their
states in the Dagster instance under this name)."""

import dagster as dg

SHARDS = "shards"
shard_partitions = dg.DynamicPartitionsDefinition(name=SHARDS)
