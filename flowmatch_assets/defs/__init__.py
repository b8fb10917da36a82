"""Dagster definitions: the only place that defines Dagster objects (resources, partitions, assets, checks, sensors, jobs)."""
