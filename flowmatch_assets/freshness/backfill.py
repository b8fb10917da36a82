"""`flowmatch backfill`: launch and follow asset backfills through a running Dagster webserver.

The Python GraphQL client has no backfill method, so this module POSTs to ``<url>/graphql``
with the webserver's own schema (dagster_graphql): ``launchPartitionBackfill`` with
``LaunchBackfillParams{partitionNames, assetSelection}`` (an asset backfill, run by the daemon
that ``dagster dev`` starts), ``partitionBackfillOrError`` for its status, and ``assetNodes``
(``partitionKeysByDimension`` / ``assetPartitionStatuses``) for the partitions still missing.

    flowmatch backfill --missing [--assets a,b] [--url http://127.0.0.1:3000] [--wait]
    flowmatch backfill --stale [--assets a,b] [--wait]

``--stale`` re-runs exactly the stale asset partitions (flowmatch_assets.freshness.fingerprints: made
with other settings, or from a stale or re-made upstream; their downstream partitions are stale
too): partitions with the same set of stale assets go into one backfill.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence

from flowmatch_assets.freshness.settings import Settings, SettingsFrom
from flowmatch_models.storage.layout import PARTITIONED_ASSETS

#: The data assets of one partition, in lineage order (the default of ``--assets``; read live,
#: so every registered embedding kind is in it).
DEFAULT_ASSETS = PARTITIONED_ASSETS
DEFAULT_URL = "http://127.0.0.1:3000"
#: BulkActionStatus values after which a backfill does nothing more.
TERMINAL = {"COMPLETED", "COMPLETED_SUCCESS", "COMPLETED_FAILED", "FAILED", "CANCELED"}
SUCCESS = {"COMPLETED", "COMPLETED_SUCCESS"}


class BackfillError(RuntimeError):
    """The webserver refused a request or answered with an error."""


LAUNCH = """
mutation LaunchBackfill($params: LaunchBackfillParams!) {
  launchPartitionBackfill(backfillParams: $params) {
    __typename
    ... on LaunchBackfillSuccess { backfillId launchedRunIds }
    ... on PartitionSetNotFoundError { message }
    ... on PartitionKeysNotFoundError { message }
    ... on InvalidSubsetError { message }
    ... on UnauthorizedError { message }
    ... on PythonError { message stack }
  }
}
"""

STATUS = """
query BackfillStatus($id: String!) {
  partitionBackfillOrError(backfillId: $id) {
    __typename
    ... on PartitionBackfill {
      id
      status
      numPartitions
      partitionNames
      timestamp
      endTimestamp
      error { message }
      assetBackfillData {
        assetBackfillStatuses {
          __typename
          ... on AssetPartitionsStatusCounts {
            assetKey { path }
            numPartitionsTargeted
            numPartitionsInProgress
            numPartitionsMaterialized
            numPartitionsFailed
          }
        }
      }
    }
    ... on BackfillNotFoundError { message }
    ... on PythonError { message stack }
  }
}
"""

PARTITIONS = """
query AssetPartitions($keys: [AssetKeyInput!]) {
  assetNodes(assetKeys: $keys) {
    assetKey { path }
    partitionKeysByDimension { name partitionKeys }
    assetPartitionStatuses {
      __typename
      ... on DefaultPartitionStatuses { materializedPartitions materializingPartitions }
    }
  }
}
"""


def graphql(url: str, query: str, variables: dict | None = None, timeout: float = 60) -> dict:
    """POST one GraphQL request to ``<url>/graphql``; returns ``data`` or raises BackfillError."""
    body = json.dumps({"query": query, "variables": variables or {}}).encode()
    req = urllib.request.Request(
        url.rstrip("/") + "/graphql",
        data=body,
        headers={"Content-Type": "application/json", "Accept": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            payload = json.loads(resp.read().decode())
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[:2000]
        raise BackfillError(f"{url}/graphql answered HTTP {e.code}: {detail}") from e
    except (urllib.error.URLError, OSError) as e:
        raise BackfillError(f"cannot reach the Dagster webserver at {url}: {e}") from e
    if payload.get("errors"):
        msgs = "; ".join(str(err.get("message", err)) for err in payload["errors"])
        raise BackfillError(f"GraphQL error: {msgs}")
    return payload["data"]


def key_input(asset: str) -> dict:
    return {"path": asset.split("/")}


def launch_backfill(
    url: str,
    partition_keys: Sequence[str],
    asset_keys: Sequence[str],
    title: str | None = None,
    tags: dict[str, str] | None = None,
) -> str:
    """Launch an asset backfill of ``asset_keys`` (e.g. "images") over ``partition_keys``;
    returns the backfill id. The daemon then launches the runs, upstream partitions first."""
    if not partition_keys or not asset_keys:
        raise ValueError("launch_backfill needs at least one partition key and one asset key")
    params: dict = {
        "partitionNames": list(partition_keys),
        "assetSelection": [key_input(a) for a in asset_keys],
        "tags": [
            {"key": k, "value": v} for k, v in {"flowmatch/cli": "backfill", **(tags or {})}.items()
        ],
    }
    if title:
        params["title"] = title
    res = graphql(url, LAUNCH, {"params": params})["launchPartitionBackfill"]
    if res["__typename"] != "LaunchBackfillSuccess":
        raise BackfillError(f"launchPartitionBackfill: {res['__typename']}: {res.get('message')}")
    return res["backfillId"]


def backfill_status(url: str, backfill_id: str) -> dict:
    """The backfill's state: ``status`` (BulkActionStatus), ``done``, ``ok``, ``num_partitions``,
    ``error`` and per asset ``assets[name] = {targeted, in_progress, materialized, failed}``."""
    res = graphql(url, STATUS, {"id": backfill_id})["partitionBackfillOrError"]
    if res["__typename"] != "PartitionBackfill":
        raise BackfillError(f"backfill {backfill_id}: {res['__typename']}: {res.get('message')}")
    assets = {}
    for s in (res.get("assetBackfillData") or {}).get("assetBackfillStatuses") or []:
        if s["__typename"] == "AssetPartitionsStatusCounts":
            assets["/".join(s["assetKey"]["path"])] = {
                "targeted": s["numPartitionsTargeted"],
                "in_progress": s["numPartitionsInProgress"],
                "materialized": s["numPartitionsMaterialized"],
                "failed": s["numPartitionsFailed"],
            }
    status = res["status"]
    return {
        "id": res["id"],
        "status": status,
        "done": status in TERMINAL,
        "ok": status in SUCCESS,
        "num_partitions": res.get("numPartitions"),
        "partition_names": res.get("partitionNames"),
        "error": (res.get("error") or {}).get("message"),
        "assets": assets,
        "started": res.get("timestamp"),
        "ended": res.get("endTimestamp"),
    }


def format_status(st: dict) -> str:
    """One line: ``<status> images 2/3 (1 running, 0 failed) ...``."""
    parts = [
        f"{a} {c['materialized']}/{c['targeted']}"
        + (f" ({c['in_progress']} running)" if c["in_progress"] else "")
        + (f" ({c['failed']} FAILED)" if c["failed"] else "")
        for a, c in st["assets"].items()
    ]
    return f"backfill {st['id']} {st['status']}: " + ", ".join(parts)


def wait_backfill(
    url: str,
    backfill_id: str,
    timeout: float = 3600,
    progress_cb: Callable[[dict], None] | None = None,
    poll: float = 5.0,
) -> dict:
    """Poll until the backfill reaches a terminal status; returns its last status. Calls
    ``progress_cb(status)`` whenever the status changes. Raises TimeoutError after ``timeout``
    seconds (transient connection errors are retried until then)."""
    deadline = time.monotonic() + timeout
    last_seen = None
    last_err: Exception | None = None
    while True:
        try:
            st = backfill_status(url, backfill_id)
            last_err = None
        except BackfillError as e:  # the webserver may be busy on a loaded machine: retry
            st, last_err = None, e
        if st is not None:
            key = (st["status"], json.dumps(st["assets"], sort_keys=True))
            if progress_cb and key != last_seen:
                progress_cb(st)
            last_seen = key
            if st["done"]:
                return st
        if time.monotonic() > deadline:
            where = format_status(st) if st else f"last error: {last_err}"
            raise TimeoutError(f"backfill {backfill_id} not finished after {timeout:.0f}s: {where}")
        time.sleep(poll)


def _partition_statuses(url: str, asset_keys: Sequence[str]) -> dict[str, tuple[set, set]]:
    """Per asset, (registered partitions, ones Dagster counts materialized or materializing)."""
    nodes = graphql(url, PARTITIONS, {"keys": [key_input(a) for a in asset_keys]})["assetNodes"]
    found = {"/".join(n["assetKey"]["path"]): n for n in nodes}
    unknown = [a for a in asset_keys if a not in found]
    if unknown:
        raise BackfillError(f"unknown assets on {url}: {unknown}")
    out = {}
    for a in asset_keys:
        n = found[a]
        dims = n["partitionKeysByDimension"] or []
        if len(dims) != 1:
            raise BackfillError(f"{a} is not partitioned along one dimension: {dims}")
        st = n["assetPartitionStatuses"]
        if st["__typename"] != "DefaultPartitionStatuses":
            raise BackfillError(f"{a}: unexpected partition statuses {st['__typename']}")
        done = set(st["materializedPartitions"]) | set(st["materializingPartitions"])
        out[a] = (set(dims[0]["partitionKeys"]), done)
    return out


def _missing_from_url(url: str, asset_keys: Sequence[str], data_root: str) -> list[str]:
    statuses = _partition_statuses(url, asset_keys)
    unseen = {a: keys - done for a, (keys, done) in statuses.items()}
    # Dagster builds these from two reads, the materializations and then the unfinished
    # attempts: a partition whose materialization lands between them is in neither. One whose
    # files are already present is asked about once more, and is missing only if both say so.
    if any(unseen[a] - set(_missing_on_disk(sorted(unseen[a]), [a], data_root)) for a in unseen):
        statuses = _partition_statuses(url, asset_keys)
        unseen = {a: unseen[a] & (keys - done) for a, (keys, done) in statuses.items()}
    missing: set[str] = set()
    for a, (keys, _) in statuses.items():
        missing |= unseen[a]
        # the same definition as every other command: a file gone or corrupt, or no catalog
        # record, is missing even where Dagster remembers a materialization
        missing |= set(_missing_on_disk(sorted(keys - unseen[a]), [a], data_root))
    return sorted(missing)


def _missing_on_disk(
    keys: Sequence[str], asset_keys: Sequence[str], data_root: str, instance=None
) -> list[str]:
    from flowmatch_assets.freshness.state import missing_partitions as _missing
    from flowmatch_assets.freshness.state import partition_states
    from flowmatch_models.storage.layout import DataLayout

    layout = DataLayout(data_root)
    known = [a for a in asset_keys if a in DEFAULT_ASSETS]
    return _missing(partition_states(layout, keys, known, instance))


def _missing_from_instance(instance, asset_keys: Sequence[str], data_root: str) -> list[str]:
    from flowmatch_assets.freshness.shards import SHARDS

    keys = sorted(instance.get_dynamic_partitions(SHARDS))
    return _missing_on_disk(keys, asset_keys, data_root, instance)


def missing_partitions(source, asset_keys: Sequence[str] | None, data_root: str) -> list[str]:
    """Registered partitions that at least one of ``asset_keys`` is missing, by the one
    definition in flowmatch_assets.freshness.state (file valid, catalog record, Dagster materialization;
    failed partitions count as missing; on a webserver, ones materializing now do not).
    ``source`` is a webserver URL or a DagsterInstance; the files are those of ``data_root``."""
    asset_keys = list(DEFAULT_ASSETS) if asset_keys is None else asset_keys
    if isinstance(source, str):
        return _missing_from_url(source, asset_keys, data_root)
    return _missing_from_instance(source, asset_keys, data_root)


def main(argv: list[str] | None, settings: SettingsFrom) -> int:
    """`flowmatch backfill`; ``settings()`` gives the settings (the CLI: from the environment)."""
    p = argparse.ArgumentParser(
        prog="flowmatch backfill",
        description="Launch a Dagster asset backfill through a running webserver (dagster dev).",
    )
    p.add_argument(
        "--missing",
        action="store_true",
        help="backfill every registered partition that one of the assets has not materialized",
    )
    p.add_argument(
        "--stale",
        action="store_true",
        help="backfill exactly the stale asset partitions (`flowmatch stale`), one backfill per "
        "set of stale assets",
    )
    p.add_argument("--partitions", default="", help="comma-separated partition keys to backfill")
    p.add_argument("--assets", default=",".join(DEFAULT_ASSETS), help="comma-separated asset keys")
    p.add_argument("--url", default=DEFAULT_URL, help="webserver URL (default %(default)s)")
    p.add_argument("--wait", action="store_true", help="follow the backfill until it finishes")
    p.add_argument("--timeout", type=float, default=24 * 3600, help="seconds to --wait at most")
    p.add_argument("--poll", type=float, default=5.0, help="seconds between status polls")
    a = p.parse_args(argv)
    assets = [s.strip() for s in a.assets.split(",") if s.strip()]
    keys = [s.strip() for s in a.partitions.split(",") if s.strip()]
    if not a.missing and not a.stale and not keys:
        p.error("give --missing, --stale or --partitions")
    if a.stale and (a.missing or keys):
        p.error("--stale picks its own partitions and assets: give it alone (with --assets)")
    unknown = [x for x in assets if x not in DEFAULT_ASSETS]
    if unknown:
        print(
            f"flowmatch backfill: unknown asset {unknown[0]!r}; partitioned assets: "
            f"{', '.join(DEFAULT_ASSETS)}",
            file=sys.stderr,
        )
        return 2
    try:
        if a.stale:
            return _backfill_stale(a, assets, settings())
        if a.missing:
            missing = missing_partitions(a.url, assets, settings().data_root)
            keys = sorted(set(keys) | set(missing))
            print(f"{len(missing)} partitions missing for {', '.join(assets)}", flush=True)
        if not keys:
            print("nothing to backfill")
            return 0
        shown = ", ".join(keys[:10]) + (" ..." if len(keys) > 10 else "")
        bid = launch_backfill(a.url, keys, assets, title="flowmatch backfill")
        print(f"launched backfill {bid}: {len(keys)} partitions ({shown})", flush=True)
        print(f"  {a.url.rstrip('/')}/runs/b/{bid}", flush=True)
        if not a.wait:
            return 0
        st = wait_backfill(
            a.url,
            bid,
            timeout=a.timeout,
            poll=a.poll,
            progress_cb=lambda s: print(format_status(s), flush=True),
        )
    except BackfillError as e:
        if "cannot reach" in str(e):  # the common mistake: no webserver running
            print(
                f"flowmatch backfill: no Dagster webserver at {a.url}; start one with "
                "`DAGSTER_HOME=$PWD/dagster_home dagster dev -w workspace.yaml` or pass --url",
                file=sys.stderr,
            )
            return 2
        print(f"flowmatch backfill: {e}", file=sys.stderr)
        return 1
    except TimeoutError as e:
        print(f"flowmatch backfill: {e}", file=sys.stderr)
        return 1
    if st["error"]:
        print(f"error: {st['error']}", file=sys.stderr)
    return 0 if st["ok"] else 1


def stale_backfills(assets: Sequence[str], res: Settings) -> list[tuple]:
    """``(assets, partitions)`` of the backfills that re-make exactly the stale asset
    partitions of ``assets`` under the settings ``res`` (and its data root's files)."""
    from flowmatch_assets.freshness.fingerprints import stale_groups, staleness

    return stale_groups(staleness(res, assets=list(assets)))


def _backfill_stale(a: argparse.Namespace, assets: Sequence[str], res: Settings) -> int:
    groups = stale_backfills(assets, res)
    if not groups:
        print("nothing stale")
        return 0
    ids = []
    for names, keys in groups:
        shown = ", ".join(keys[:10]) + (" ..." if len(keys) > 10 else "")
        bid = launch_backfill(a.url, keys, names, title="flowmatch backfill --stale")
        ids.append(bid)
        print(f"launched backfill {bid}: {', '.join(names)} on {len(keys)} partitions ({shown})")
        print(f"  {a.url.rstrip('/')}/runs/b/{bid}", flush=True)
    if not a.wait:
        return 0
    ok = True
    for bid in ids:
        st = wait_backfill(
            a.url,
            bid,
            timeout=a.timeout,
            poll=a.poll,
            progress_cb=lambda s: print(format_status(s), flush=True),
        )
        ok = ok and st["ok"]
    return 0 if ok else 1
