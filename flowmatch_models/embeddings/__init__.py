"""Embedding kinds: the registry every other part reads (kinds.py), the precalc that computes them (precalc.py), the rules a stored shard must follow (checks.py)."""
