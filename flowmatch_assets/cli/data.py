"""The data verbs: partitions, sources, materialize, retry, verify, stale, upgrade, cache,
demo-data."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from flowmatch_assets import runs
from flowmatch_assets.cli.common import CliError, dagster_instance, flowmatch_resource
from flowmatch_assets.ingest.sources.common import printable
from flowmatch_assets.runs import check_assets, check_partitions, known_partitions


def cmd_partitions(action: str, source: str | None, partition: list[str], orphans: bool) -> int:
    """`flowmatch partitions [list|register|remove] [--source NAME]`: PD12M's shards and the
    configured sources' partitions; ``register`` adds new ones (a source: its new images,
    files or tars) to the Dagster instance, ``list`` shows what register would add as NEW and
    the keys with no data behind them (ORPHAN: added by hand in the UI, a removed source);
    ``remove -p KEY`` (or ``--orphans``) drops such keys from the instance."""
    from flowmatch_assets.defs.partitions import SHARDS, discover, register_partitions
    from flowmatch_assets.ingest import sources as src

    res = flowmatch_resource()
    if source is not None:
        src.source_named(res, source)  # unknown: one line naming the configured ones
    if action == "register":
        skipped: list[str] = []
        new = register_partitions(
            dagster_instance(), res, source, log=skipped.append, strict=source is not None
        )
        print(f"registered {len(new)} new partitions" + (f": {', '.join(new[:10])}" if new else ""))
        if skipped:  # what could not be read, one line, on stderr; the rest is registered
            print(f"flowmatch: {printable('; '.join(skipped))}", file=sys.stderr)
        return 0
    inst = dagster_instance()
    found = discover(res)
    known = set(inst.get_dynamic_partitions(SHARDS))
    orphan = sorted(known - {p["partition"] for p in found.partitions})
    if action == "remove":
        return _remove_partitions(inst, SHARDS, orphan if orphans else partition, orphan, found)
    rows = [p for p in found.partitions if source is None or p["source"] == source]
    scan = sorted(res.sources) if source is None else [source]
    scan = [s for s in scan if src.source_named(res, s).registers]  # built-in: from its files
    notes = [p.line for p in found.problems]
    for name in scan:
        cfg = res.source(name)
        try:
            pending = src.unregistered(res.data_root, name, cfg)
        except src.SourceError as e:
            notes.append(f"{name}: {e}")
            continue
        rows += [{**m.as_partition(cfg.location), "new": True} for m in pending.new]
        if pending.skipped:
            notes.append(pending.skipped_line(name))
    for p in rows:
        mark = "NEW" if p.get("new") or p["partition"] not in known else "registered"
        print(
            f"{p['partition']}  {p['source']}  rows [{p['row_start']}, {p['row_end']})  "
            f"{p['source_file']}  {mark}"
        )
    for key in orphan if source is None else []:
        print(
            f"{key}  ?  no data behind it (no PD12M shard, no registered source partition)  "
            "ORPHAN: `flowmatch partitions remove --orphans`"
        )
    for line in notes:
        print(f"skipped {printable(line)}")
    return 0


def _remove_partitions(inst, name: str, keys: list[str], orphan: list[str], found) -> int:
    """Drop partition keys that have no data behind them from the Dagster instance."""
    if not keys:
        print("no partitions to remove" + ("" if orphan else " (no orphans)"))
        return 0
    owner = {p["partition"]: p["source"] for p in found.partitions}
    for k in keys:
        if k in owner:
            raise CliError(
                f"partition {k} has data behind it ({owner[k]}); only keys without any "
                "(ORPHAN in `flowmatch partitions list`) are removed here. A source's "
                f"partitions go with the source: `flowmatch sources remove {owner[k]} --purge`"
            )
        if k not in orphan:
            raise CliError(f"unknown partition {k!r}: not in the Dagster instance")
    for k in keys:
        inst.delete_dynamic_partition(name, k)
    print(f"removed {len(keys)} partitions: {', '.join(keys[:10])}")
    return 0


def cmd_sources(
    action: str,
    name: str | None,
    kind: str | None,
    location: str | None,
    caption_field: str | None,
    shard_size: int | None,
    image_field: str | None,
    id_field: str | None,
    url_field: str | None,
    hash_field: str | None,
    license: str | None,
    deadline_s: float | None,
    follow_links: bool,
    replace: bool,
    allow_missing: bool,
    purge: bool,
) -> int:
    """`flowmatch sources [list|add NAME ...|remove NAME]`: the sources of your own images (the
    YAML file FLOWMATCH_SOURCES, default <data root>/sources.yaml)."""
    from flowmatch_assets.ingest import sources as src

    res = flowmatch_resource()
    path = src.sources_file(res.data_root)
    if action == "add":
        return _add_source(
            res,
            path,
            name,
            kind,
            location,
            replace,
            allow_missing,
            {
                "caption_field": caption_field,
                "shard_size": shard_size,
                "image_field": image_field,
                "id_field": id_field,
                "url_field": url_field,
                "hash_field": hash_field,
                "license": license,
                "deadline_s": deadline_s,
                "follow_links": follow_links or None,
            },
        )
    if action == "remove":
        return _remove_source(res, path, name, purge)
    print(f"sources file: {path}" + ("" if path.is_file() else " (none yet)"))
    print(f"pd12m  metadata  {res.metadata_source}")
    for n in sorted(res.sources):
        cfg = res.source(n)
        parts = src.registered(res.data_root, n)
        links = "  follows links" if cfg.follow_links else ""
        print(
            f"{n}  {cfg.kind}  {cfg.shown}  caption {cfg.caption()!r}  shard_size "
            f"{cfg.shard_size}  {len(parts)} partitions registered{links}"
        )
    return 0


def _add_source(
    res,
    path: Path,
    name: str | None,
    kind: str | None,
    location: str | None,
    replace: bool,
    allow_missing: bool,
    options: dict,
) -> int:
    """`sources add`: a new source (or, with ``replace``, new settings of an existing one);
    its location must exist unless ``allow_missing``."""
    from pydantic import ValidationError

    from flowmatch_assets.ingest import sources as src
    from flowmatch_assets.ingest.sources.location import Location

    if not name or not kind or not location:
        raise CliError(
            f"sources add needs NAME, --kind {'|'.join(src.SOURCE_KINDS)} and "
            "--location FOLDER_OR_URL"
        )
    if kind not in src.SOURCE_KINDS:
        raise CliError(f"--kind {kind!r}: choose one of {', '.join(src.SOURCE_KINDS)}")
    given = {"kind": kind, "location": src.config.absolute(location), **options}
    try:
        cfg = src.SourceConfig.model_validate({k: v for k, v in given.items() if v is not None})
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(x) for x in err["loc"])
        raise CliError(f"sources add {name}: {field}: {err['msg']}") from None
    cfg.allowing(res.ingest.allow_networks)
    src.check_name(name)
    parts = src.registered(res.data_root, name)
    old = res.source(name) if name in res.sources else None
    if old is not None and not replace:
        raise CliError(
            f"source {name} exists ({old.kind} at {old.shown}, {len(parts)} partitions "
            "registered); `--replace` gives it these settings, or `flowmatch sources remove "
            f"{name}` first"
        )
    if old is not None and parts and old.kind != cfg.kind:
        raise CliError(
            f"source {name} has {len(parts)} partitions registered as {old.kind}; a "
            f"{cfg.kind} source needs another name (or `flowmatch sources remove {name} --purge`)"
        )
    if not allow_missing:
        Location(cfg)  # SourceError (one line) when it does not exist or cannot be reached
    src.write_source(path, name, cfg)
    if old is not None:
        print(
            f"source {name} replaced: {cfg.kind} at {cfg.shown} (in {path}). Its "
            f"{len(parts)} registered partitions keep the samples they hold (their manifests) "
            "and read them from the new location when next materialized (a file not there "
            "fails as not_found; `flowmatch stale` shows which settings changed); new files "
            "become new partitions"
        )
    else:
        print(
            f"source {name}: {cfg.kind} at {cfg.shown} (in {path}); next: "
            f"`flowmatch partitions register --source {name}`"
        )
    return 0


def _remove_source(res, path: Path, name: str | None, purge: bool) -> int:
    """`sources remove NAME [--purge]`: the source, its registered partitions and manifests;
    what was made from them is kept unless ``purge`` (then refused while any exists)."""
    from flowmatch_assets.defs.partitions import SHARDS
    from flowmatch_assets.ingest import sources as src

    if not name:
        raise CliError("sources remove needs NAME (`flowmatch sources list`)")
    if name not in res.sources:
        res.source(name)  # unknown: one line naming the configured ones
    inst = dagster_instance()
    keys = sorted(
        {
            *(p["key"] for p in src.registered(res.data_root, name)),
            *(k for k in inst.get_dynamic_partitions(SHARDS) if k.startswith(f"{name}-")),
        }
    )
    made = runs.partition_files(res, keys)
    if made and not purge:
        raise CliError(
            f"source {name} has {len(made)} files made from its {len(keys)} partitions (shards, "
            f"previews, catalog records); `flowmatch sources remove {name} --purge` deletes them "
            "with the source, or keep the source"
        )
    for f in made:
        f.unlink(missing_ok=True)
    for k in keys:
        inst.delete_dynamic_partition(SHARDS, k)
    src.forget(res.data_root, name)
    src.write_source(path, name, None)
    print(
        f"source {name} removed: {len(keys)} partitions"
        + (f", {len(made)} files deleted" if made else "")
    )
    return 0


def cmd_materialize(
    partition: list[str], asset: list[str], missing: bool, stale: bool, source: list[str]
) -> int:
    res = runs.materialize(
        partition or None,
        asset or None,
        missing_only=missing,
        stale_only=stale,
        sources=source or None,
    )
    return 0 if all(res.values()) else 1


def cmd_retry(partition: list[str], reason: list[str]) -> int:
    if partition:
        check_partitions(partition, known_partitions(dagster_instance()))
    res = runs.retry(partition or None, reason or None)
    return 0 if all(res.values()) else 1


def cmd_verify(partition: list[str], quick: bool) -> int:
    from flowmatch_assets.freshness.state import verify

    res = flowmatch_resource()
    instance = dagster_instance()
    known = known_partitions(instance)
    check_partitions(partition, known)
    with runs.quiet_console():
        bad = verify(
            res.layout, partition or known, instance, deep=not quick, run_config=runs.log_config()
        )
    for s in bad:
        print(f"{s.partition}  {s.asset}  {s.state}  {s.detail}")
    fixed = sum(s.state in ("gone", "corrupt") for s in bad)
    print(
        f"{len(bad)} asset partitions missing ({fixed} gone or corrupt: catalog records removed, "
        "a failed materialization recorded in Dagster, check failed)"
        + ("; re-create them with `flowmatch materialize --missing`" if bad else "")
    )
    return 1 if bad else 0


def cmd_stale(partition: list[str], asset: list[str], as_json: bool, no_report: bool) -> int:
    """List stale asset partitions and training runs with the fingerprint fields that changed;
    report them to Dagster as the per-partition ``<asset>_fresh`` checks (unless --no-report)."""
    from flowmatch_assets.catalog import format_table
    from flowmatch_assets.freshness.fingerprints import staleness
    from flowmatch_assets.freshness.stale_report import report
    from flowmatch_assets.freshness.training_runs import model_staleness
    from flowmatch_models.storage.layout import PARTITIONED_ASSETS

    res, instance = flowmatch_resource(), dagster_instance()
    known = known_partitions(instance)
    check_partitions(partition, known)
    check_assets(asset, [*PARTITIONED_ASSETS, "flow_model"])
    assets = [a for a in (asset or PARTITIONED_ASSETS) if a != "flow_model"]
    found = staleness(res, partition or None, assets) if assets else []
    models = model_staleness(res) if not asset or "flow_model" in asset else []
    rows = [{"asset": s.asset, "partition": s.partition, "reason": s.reason} for s in found]
    rows += [
        {"asset": "flow_model", "partition": f"run {s.partition}", "reason": s.reason}
        for s in models
    ]
    with_models = models if not asset or "flow_model" in asset else None
    if as_json:
        print(json.dumps(rows, indent=1), flush=True)
    else:  # the answer first: recording many check results in Dagster takes a while
        print(format_table(rows) if rows else "nothing stale")
        parts = sorted({s.partition for s in found})
        print(
            f"{len(found)} stale asset partitions in {len(parts)} partitions"
            + (f", {len(models)} stale training runs" if models else "")
            + (
                "; re-make them with `flowmatch backfill --stale` (or `flowmatch materialize "
                "--stale`)"
                if found
                else ""
            ),
            flush=True,
        )
    if not no_report and (assets or with_models is not None):
        with runs.quiet_console():
            n = report(
                instance, res, found, partition or known, assets, runs.log_config(), with_models
            )
        if n and not as_json:
            print(f"{n} `<asset>_fresh` check results reported to Dagster")
    return 1 if rows else 0


def cmd_upgrade() -> int:
    """`flowmatch upgrade`: carry a data root and Dagster instance made before the renames
    (metadata -> metadata, images -> images, shards -> shards) over; safe to
    run again."""
    from flowmatch_assets.freshness.renames import upgrade_data_root, upgrade_instance

    res = flowmatch_resource()
    done = upgrade_data_root(res.data_root) + upgrade_instance(dagster_instance())
    print("\n".join(done) or "nothing to upgrade: the data root and instance use today's names")
    return 0


def cmd_demo_data(argv: list[str]) -> int:
    from flowmatch_assets.demo.dataset import main

    main(argv)
    return 0


def cmd_cache(action: str, max_gb: float | None) -> int:
    """`flowmatch cache [show|trim --max-gb N]`: the shards this machine holds of the remote
    data root (each removable: the remote keeps it and a reader fetches it again), least
    recently used trimmed first."""
    from flowmatch_assets.defs.routine import human_bytes
    from flowmatch_models.storage import remote

    res = flowmatch_resource()
    store = remote.active(res.data_root)
    if store is None:
        raise CliError(
            f"no remote data root: set {remote.REMOTE_ENV}=s3://bucket/prefix (docs/scaling-out.md)"
        )
    if action == "trim":
        if max_gb is None:
            raise CliError("cache trim needs --max-gb N (0 empties the cache)")
        gone = store.trim(int(max_gb * 1e9))
        print(f"removed {len(gone)} cached shards; the remote keeps them")
    files = store.cache_files()
    total = sum(f["size"] for f in files)
    print(f"cache of {store.url} in {store.root}: {len(files)} shards, {human_bytes(total)}")
    for f in files[:20]:
        print(f"  {f['path'].relative_to(store.root)}  {human_bytes(f['size'])}")
    return 0
