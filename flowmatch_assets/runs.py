"""In-process runs of the asset graph: what the CLI verbs, the demo and the tests call.

:func:`run_assets` is the one place that runs a selection of the code location's assets (with
their checks) in this process, recorded in the Dagster instance at DAGSTER_HOME, so the UI shows
it. It prints one line per step; Dagster's own event log is shown only with ``verbose`` (the
CLI's ``--verbose``). :func:`materialize`, :func:`retry`, :func:`materialize_budget` and
:func:`materialize_data_cards` are the verbs' library functions over it; the training verbs
(train, finetune, evaluate) are :mod:`flowmatch_assets.train_runs`'s. A usage mistake raises :class:`UsageError` (one line: the problem and the fix).
"""

from __future__ import annotations

import contextlib
import difflib
import os
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # Dagster is imported when a run is made, not when the CLI starts
    import dagster as dg

#: The workspace `dagster dev` loads: runs made here are its code location's runs.
WORKSPACE = Path(__file__).resolve().parents[1] / "workspace.yaml"

#: Dagster's event log on the console (the CLI's ``--verbose``); off: one line per step.
VERBOSE = False


class UsageError(Exception):
    """A usage mistake: printed by the CLI as one line (problem and fix), exit code 2."""


def instance() -> dg.DagsterInstance:
    """The Dagster instance at DAGSTER_HOME (default ./dagster_home)."""
    import dagster as dg

    home = Path(os.environ.get("DAGSTER_HOME") or "dagster_home").resolve()
    home.mkdir(exist_ok=True)
    return dg.DagsterInstance.from_config(str(home))


def resource(overrides: dict | None = None):
    """The FlowmatchResource of the FLOWMATCH_* environment (``overrides`` win)."""
    from flowmatch_assets.defs.resources import resource_from_env

    return resource_from_env(overrides=overrides)


def log_config(verbose: bool | None = None) -> dict:
    """Run config for Dagster's console logger: its event log at DEBUG with ``verbose``, else
    nothing (the run's own config then holds no logger: :func:`run_assets` keeps the terminal
    quiet in this process instead, so a re-execution from the UI logs as any run does)."""
    verbose = VERBOSE if verbose is None else verbose
    return {"loggers": {"console": {"config": {"log_level": "DEBUG"}}}} if verbose else {}


#: The tag every run flowmatch makes carries: where it came from (``cli: materialize``, ...).
ORIGIN_TAG = "flowmatch/cli"
#: The tag of the runs `flowmatch demo` makes.
DEMO_TAG = "flowmatch/demo"
#: Tags every run made in this process carries: the CLI sets ``ORIGIN_TAG`` to its verb,
#: `flowmatch demo` ``DEMO_TAG`` to its stage (lineage, train, evaluate, reports).
EXTRA_TAGS: dict[str, str] = {}


def quiet_console():
    """A block in which Dagster runs executed in this process print no event log to the
    terminal (unless :data:`VERBOSE`); their stored log is complete."""
    from flowmatch_assets import compat

    return contextlib.nullcontext() if VERBOSE else compat.console_silenced()


def resource_config(res) -> dict:
    """Run config for the code location's ``flowmatch`` resource that makes it ``res`` when the
    run starts: the fields where ``res`` differs from the FLOWMATCH_* environment of this
    process (nested settings field by field; none when they agree), so that the run's config
    says what it ran with and a re-execution from the UI runs with the same settings."""
    from flowmatch_assets.defs.resources import resource_from_env

    want = res.model_dump()

    def diff(a: dict, b: dict) -> dict:
        out = {}
        for k, v in a.items():
            if isinstance(v, dict) and isinstance(b.get(k), dict) and v != b[k]:
                out[k] = diff(v, b[k]) if k != "sources" else v
            elif v != b.get(k):
                out[k] = v
        return out

    try:
        over = diff(want, resource_from_env().model_dump())
        if resource_from_env(overrides=over).model_dump() != want:  # not expressible as a diff
            over = want
    except ValueError:  # the environment's own settings do not build (SettingError): all of it
        over = want
    return {"resources": {"flowmatch": {"config": over}}} if over else {}


def _merged_config(*configs: dict) -> dict:
    out: dict = {}
    for c in configs:
        for k, v in (c or {}).items():
            out[k] = {**out[k], **v} if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def step_failures(result) -> list[tuple[str, str]]:
    """``(step, message)`` of every failed step: a ``dg.Failure``'s description, else the last
    line of the error."""
    out = []
    for ev in result.all_events:
        if ev.is_step_failure:
            data = ev.step_failure_data
            if data.user_failure_data and data.user_failure_data.description:
                msg = data.user_failure_data.description
            else:  # the root cause, not Dagster's "Error occurred while executing op"
                err = data.error
                while err is not None and err.cause is not None:
                    err = err.cause
                lines = (err.message if err else "").strip().splitlines()
                msg = lines[-1] if lines else "failed"
            out.append((ev.step_key, msg))
    return out


def _print_steps(result, prefix: str = "  ") -> None:
    for ev in result.all_events:
        if ev.is_step_success:
            seconds = (ev.event_specific_data.duration_ms or 0) / 1000
            print(f"{prefix}{ev.step_key}: ok ({seconds:.1f}s)", file=sys.stderr)
    for step, msg in step_failures(result):
        print(f"{prefix}{step}: FAILED: {msg}", file=sys.stderr)


#: Dagster's implicit job of every asset (the UI's Materialize button): a selection no job holds.
IMPLICIT_JOB = "__ASSET_JOB"


def job_for(selection: Sequence[str], graph: list | None = None) -> str:
    """The name of the code location's job a run of ``selection`` (asset names) is recorded
    under: the first of ``definitions.JOBS`` whose selection holds every asset of it, else
    Dagster's own asset job (:data:`IMPLICIT_JOB`). ``graph``: the assets (default: all)."""
    import dagster as dg

    from flowmatch_assets.defs.definitions import JOBS, assets

    graph = assets() if graph is None else graph
    wanted = {dg.AssetKey(a) for a in selection}
    for job in JOBS:
        if wanted <= job.selection.resolve(graph):
            return job.name
    return IMPLICIT_JOB


@contextlib.contextmanager
def quiet_dagster():
    """Dagster's notices that an API is in preview or beta (e.g. ``PipesMessageReader.
    expected_writer_count``, which its own Pipes client calls) silenced inside the block,
    unless :data:`VERBOSE`: nothing a user of flowmatch can act on. Everything else shows."""
    import dagster as dg

    with warnings.catch_warnings():
        if not VERBOSE:
            warnings.filterwarnings("ignore", category=dg.PreviewWarning)
            warnings.filterwarnings("ignore", category=dg.BetaWarning)
            # a lineage job mixes the embeddings' 64-partition policy with one-partition
            # assets; a run the CLI makes is one partition's (or none) either way
            warnings.filterwarnings("ignore", message=".*materializes assets with varying Backf")
        yield


def run_assets(
    selection: Sequence[str],
    partition: str | None = None,
    config: dict | None = None,
    tags: dict | None = None,
    *,
    res=None,
    dagster_instance: dg.DagsterInstance | None = None,
    raise_on_error: bool = False,
    steps: bool = True,
):
    """Materialize ``selection`` (asset names) of the whole graph, for ``partition`` (or none),
    with ``config`` (run config: ``{"ops": ...}``) and ``tags``, in this process; the assets'
    checks run in the same run (blocking ones stop downstream assets). The run is one of the
    code location's jobs (:func:`job_for`: ``ingest_and_embed_job``, ``train_job``, ...) as the
    webserver loads it (workspace.yaml), recorded with its origin: the UI shows it on the
    Timeline and under its job, and re-executes it with the same result. ``res``: the
    FlowmatchResource (default: from the environment), passed as the run's resource config
    where it differs from the environment (:func:`resource_config`). The terminal shows one line
    per step (``steps``), Dagster's event log only with :data:`VERBOSE`; the run's stored log is
    complete either way. Returns Dagster's result (``.success``)."""
    import dagster as dg

    from flowmatch_assets import compat

    run_config = _merged_config(
        log_config(), resource_config(res) if res is not None else {}, config or {}
    )
    all_tags = {**(tags or {}), **EXTRA_TAGS}  # the verb that made it wins over the function's
    if partition is not None:
        all_tags["dagster/partition"] = partition
    with quiet_dagster(), quiet_console(), compat.log_mirrors_apart():
        result = compat.execute_code_location_run(
            str(WORKSPACE),
            job_for(selection),
            [dg.AssetKey(a) for a in selection],
            run_config,
            all_tags,
            dagster_instance or instance(),
            raise_on_error=raise_on_error,
        )
    if steps:
        _print_steps(result)
    return result


# --------------------------------------------------------------------------------------------
# checks of what the user asked for
# --------------------------------------------------------------------------------------------


def check_partitions(keys: Sequence[str], known: Sequence[str]) -> None:
    """Raise :class:`UsageError` naming the first unknown partition and the nearest known."""
    unknown = [k for k in keys if k not in known]
    if not unknown:
        return
    if not known:
        raise UsageError(
            f"unknown partition {unknown[0]!r}: no partitions are registered; run "
            "`flowmatch partitions register` (or check FLOWMATCH_METADATA)"
        )
    near = difflib.get_close_matches(unknown[0], known, n=3, cutoff=0.3) or list(known[:3])
    raise UsageError(
        f"unknown partition {unknown[0]!r}; nearest: {', '.join(near)} "
        f"({len(known)} registered: `flowmatch partitions list`)"
    )


def check_assets(names: Sequence[str], valid: Sequence[str]) -> None:
    """Raise :class:`UsageError` for the first name not in ``valid`` (with a suggestion)."""
    for n in names:
        if n not in valid:
            near = difflib.get_close_matches(n, valid, n=1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise UsageError(f"unknown asset {n!r}; {hint}assets: {', '.join(valid)}")


def known_partitions(inst: dg.DagsterInstance) -> list[str]:
    """The registered partition keys, sorted."""
    from flowmatch_assets.defs.partitions import SHARDS

    return sorted(inst.get_dynamic_partitions(SHARDS))


# --------------------------------------------------------------------------------------------
# the verbs' library functions
# --------------------------------------------------------------------------------------------


def materialize(
    partitions: list[str] | None = None,
    assets: list[str] | None = None,
    missing_only: bool = False,
    raise_on_error: bool = False,
    run_config: dict | None = None,
    res=None,
    stale_only: bool = False,
    sources: list[str] | None = None,
) -> dict[str, bool]:
    """Materialize ``assets`` (default: the whole data lineage) for ``partitions`` (default: all
    registered), one run per partition, with the assets' checks; ``res``: the
    FlowmatchResource (default: from the environment); ``missing_only``: only the missing
    asset partitions (flowmatch_assets.freshness.state); ``stale_only``: only the stale ones
    (flowmatch_assets.freshness.fingerprints; with ``missing_only``: both); ``sources``: every
    partition of these sources (``pd12m`` or a configured source's name) besides
    ``partitions``. Prints one line per partition. Returns partition -> success."""
    from flowmatch_assets.defs.partitions import register_partitions
    from flowmatch_assets.freshness.state import partition_states
    from flowmatch_models.storage.layout import PARTITIONED_ASSETS, source_of

    inst = instance()
    res = res or resource()
    # scan only the sources asked for (all of them when nothing is named): a broken other
    # source is never read; what a scan skipped is one line each
    named = [*(sources or []), *(s for k in partitions or [] if (s := source_of(k)) in res.sources)]
    scan = sorted(set(named)) if (partitions or sources) else None
    register_partitions(inst, res, scan, log=_warn)
    known = known_partitions(inst)
    check_partitions(list(partitions or []), known)
    names = assets or list(PARTITIONED_ASSETS)
    check_assets(names, list(PARTITIONED_ASSETS))
    keys = partitions or ([] if sources else known)
    if sources:
        keys = [*keys, *(k for k in known if source_of(k) in sources and k not in keys)]
        if not keys:
            raise UsageError(
                f"no partitions of {', '.join(sources)} are registered; run "
                "`flowmatch partitions register --source NAME`"
            )
    out: dict[str, bool] = {}
    stale: set[tuple[str, str]] = set()
    if stale_only:
        from flowmatch_assets.freshness.fingerprints import staleness

        stale = {(s.asset, s.partition) for s in staleness(res, keys, names)}
    missing: set[tuple[str, str]] = set()
    if missing_only:  # every partition's state at once (Dagster asked once per asset)
        states = partition_states(res.layout, keys, names, inst)
        missing = {(s.asset, s.partition) for s in states if s.missing}
    for i, key in enumerate(keys):
        todo = names if not (missing_only or stale_only) else []
        if missing_only:
            todo = [a for a in names if (a, key) in missing]
        if stale_only:
            todo = [a for a in names if a in todo or (a, key) in stale]
        if not todo:
            flags = (("present", missing_only), ("fresh", stale_only))
            state = " and ".join(w for w, on in flags if on) or "present"
            print(f"[{i + 1}/{len(keys)}] {key}: all of {names} {state}, skipped")
            continue
        t0 = time.perf_counter()
        result = run_assets(
            todo,
            key,
            run_config,
            {"flowmatch/cli": "materialize"},
            res=res,
            dagster_instance=inst,
            raise_on_error=raise_on_error,
            steps=False,
        )
        out[key] = result.success
        status = "ok" if result.success else "FAILED"
        print(
            f"[{i + 1}/{len(keys)}] {key}: {', '.join(todo)} {status} ({time.perf_counter() - t0:.1f}s)"
        )
        for step, msg in step_failures(result):
            print(f"    {step}: {msg}")
    from flowmatch_models.embeddings.precalc import clear_shared_encoders

    clear_shared_encoders()  # loaded once for all these partitions; not held past them
    return out


def partition_files(res, keys: Sequence[str]) -> list[Path]:
    """Every file made from these partitions: each partitioned asset's file, the previews, the
    catalog's per-partition files (records, summaries, hashes: ``<key>.*`` under the catalog)
    and the locks."""
    from flowmatch_models.storage.layout import PARTITIONED_ASSETS

    layout = res.layout
    out: list[Path] = []
    for key in keys:
        out += [p for a in PARTITIONED_ASSETS if (p := layout.asset_path(a, key)).exists()]
        out += sorted(layout.root.joinpath("previews").glob(f"*/{key}.png"))
        out += sorted(layout.catalog_dir.rglob(f"{key}.*"))
        out += sorted(layout.root.joinpath(".locks").glob(f"*/{key}.lock"))
    return out


def _warn(line: str) -> None:
    print(f"flowmatch: {line}", file=sys.stderr)


def retry(
    partitions: list[str] | None = None, reasons: list[str] | None = None, res=None
) -> dict[str, bool]:
    """Re-fetch the failed rows (retryable reasons, or ``reasons``) of ``partitions`` (default:
    every partition with such rows) and merge them into their images shards."""
    from flowmatch_assets.catalog import Catalog

    res = res or resource()
    where = "reason IN (SELECT unnest(?))" if reasons else "retryable"
    params = [list(reasons)] if reasons else []
    rows = Catalog(res.data_root).query(  # the per-partition counts, not every row's record
        f"""SELECT partition, sum(rows)::BIGINT AS n FROM row_outcomes
            WHERE asset = 'images' AND outcome = 'failed' AND {where}
            GROUP BY partition ORDER BY partition""",
        params,
    )
    todo = {r["partition"]: r["n"] for r in rows}
    keys = [k for k in (partitions or sorted(todo)) if k in todo]
    if not keys:
        what = f"with reasons {reasons}" if reasons else "with a retryable reason"
        print(f"no failed rows {what}" + (f" in {', '.join(partitions)}" if partitions else ""))
        return {}
    for k in keys:
        print(f"{k}: retrying {todo[k]} failed rows")
    cfg = {"retry": True, "reasons": list(reasons) if reasons else None}
    return materialize(keys, ["images"], run_config={"ops": {"images": {"config": cfg}}}, res=res)


def materialize_budget(res=None) -> bool:
    """Materialize budget_report (the projection from what the catalog measured)."""
    result = run_assets(["budget_report"], tags={ORIGIN_TAG: "budget"}, res=res, steps=False)
    _print_outcome("budget_report", result)
    return result.success


def _print_outcome(what: str, result) -> None:
    """``what: ok (1.2s)``, or ``what: FAILED`` and each failed step's message: one line a run."""
    if not result.success:
        print(f"{what}: FAILED")
        for step, msg in step_failures(result):
            print(f"    {step}: {msg}")
        return
    seconds = sum(
        (ev.event_specific_data.duration_ms or 0) / 1000
        for ev in result.all_events
        if ev.is_step_success
    )
    print(f"{what}: ok ({seconds:.1f}s)")


def materialize_data_cards(partitions: list[str] | None = None, res=None) -> bool:
    """Materialize ``data_card`` for ``partitions`` (default: every partition with metadata),
    then ``dataset_card``; prints one line each. True when dataset_card succeeded."""
    from flowmatch_assets.defs.partitions import register_partitions

    res = res or resource()
    inst = instance()
    register_partitions(inst, res, log=_warn)
    have = res.layout.partitions_with("metadata")
    check_partitions(list(partitions or []), have)
    tags = {"flowmatch/cli": "data-card"}
    for key in partitions or have:
        result = run_assets(
            ["data_card"], key, tags=tags, res=res, dagster_instance=inst, steps=False
        )
        _print_outcome(f"data_card {key}", result)
    result = run_assets(["dataset_card"], tags=tags, res=res, dagster_instance=inst, steps=False)
    _print_outcome("dataset_card", result)
    return result.success


def unmaterialized(inst: dg.DagsterInstance | None = None) -> list[str]:
    """The code location's assets that the instance holds no materialization of (of any
    partition), sorted: what the demo says it left."""
    import dagster as dg

    from flowmatch_assets.defs.definitions import assets

    inst = inst or instance()
    names = sorted({k.to_user_string() for a in assets() for k in a.keys})
    return [n for n in names if inst.get_latest_materialization_event(dg.AssetKey(n)) is None]
