"""Every benchmark, in one place: `flowmatch bench <name>` runs ``flowmatch_assets.bench.<name>``.

Each compares flowmatch's way with the reference way on the same inputs (or a measured ceiling).
The convention: a module per benchmark with ``main(argv) -> dict``; its output ends with that
dict as one JSON line, whose ``"bench"`` key names it. Results and the commands that reproduce
them are recorded in BENCHMARKS.md. The store, precalc and train benchmarks import no Dagster
(only flowmatch_models); the others drive the pipeline.
"""

#: name -> module, for `flowmatch bench`
BENCHES = {
    name: f"flowmatch_assets.bench.{name}"
    for name in (
        "images",
        "store",
        "loader",
        "precalc",
        "precompute",
        "train",
        "orchestration",
        "learning",
        "gpu",
        "dedupe",
        "neardup",
        "semdedup",
        "ledger",
        "fingerprint",
        "finetune",
        "crop",
        "scale",
        "checkpoint",
        "remote",
        "launcher",
        "url_list",
    )
}
