"""flowmatch_models: everything that runs without Dagster (encoders, store, DiT, flow matching, training)."""
