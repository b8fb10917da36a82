"""Benchmarks that compare flowmatch's way with the reference way on the same inputs.

Each module has ``main(argv) -> dict`` and ends its output with one JSON line; results and the
commands that reproduce them are recorded in BENCHMARKS.md.
"""
