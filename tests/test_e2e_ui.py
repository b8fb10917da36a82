"""End to end through the real UI stack: `dagster dev` (webserver + daemon), an asset backfill
launched over GraphQL (flowmatch_assets.freshness.backfill), the DuckDB catalog afterwards, and the Dagster
UI in a real headless Chromium (Playwright, system /usr/bin/chromium; screenshots in
test-artifacts/)."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import dagster as dg
import pytest

from flowmatch_assets.bench import orchestration
from flowmatch_assets.catalog import Catalog
from flowmatch_assets.cli.devserver import REPO, dagster_dev, make_dagster_home
from flowmatch_assets.defs.partitions import register_partitions
from flowmatch_assets.freshness import backfill
from tests.conftest import make_resource

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = REPO / "test-artifacts"
DATA_ASSETS = ["metadata", "images"]
EMBEDDINGS = ["vae_latents", "dino_features", "text_embeddings"]
ASSETS = DATA_ASSETS + EMBEDDINGS
BACKFILL_TIMEOUT = 420
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def test_graphql_documents_match_the_installed_schema():
    """The backfill module's queries validate against dagster_graphql's schema (no server)."""
    from dagster_graphql.schema import create_schema
    from graphql import parse, validate

    schema = create_schema().graphql_schema
    for doc in (
        backfill.LAUNCH,
        backfill.STATUS,
        backfill.PARTITIONS,
        orchestration.REPOS,
        orchestration.LAUNCH_RUN,
        orchestration.RUN_STATUS,
        orchestration.TERMINATE_RUN,
        orchestration.RUN_DETAILS,
    ):
        assert validate(schema, parse(doc)) == [], doc


def _final_outcomes(cat: Catalog) -> dict[str, str]:
    """id -> "stored" / "failed:<reason>" / "filtered:<reason>", as in expected_outcomes."""
    final = {}
    for r in cat.query("SELECT asset, id, outcome, reason FROM rows ORDER BY asset, id"):
        if r["asset"] == "metadata" and r["outcome"] == "filtered":
            final[r["id"]] = f"filtered:{r['reason']}"
        elif r["asset"] == "images":
            final[r["id"]] = "stored" if r["outcome"] == "stored" else f"failed:{r['reason']}"
    return final


def _browse(url: str, log) -> list[Path]:
    """Asset graph, images's page and its partitions in headless Chromium; screenshots."""
    from playwright.sync_api import Error as PlaywrightError
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    shots = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1600, "height": 1000})
            page.set_default_timeout(90_000)

            def shot(name: str) -> None:
                path = ARTIFACTS / f"e2e_{name}.png"
                page.screenshot(path=str(path), full_page=True)
                shots.append(path)

            try:
                # the global lineage graph: our asset groups (collapsed groups at this size)
                page.goto(f"{url}/asset-groups", wait_until="domcontentloaded")
                page.get_by_text("Global asset lineage").first.wait_for(state="visible")
                skip = page.get_by_role("button", name="Skip")  # the first-visit community modal
                with contextlib.suppress(PlaywrightError):
                    skip.first.click(timeout=15_000)
                for group in ("data", "embeddings"):
                    page.get_by_text(group, exact=True).first.wait_for(state="visible")
                shot("asset_graph")
                log("browser: global asset lineage shows groups data, embeddings")

                # images's lineage graph: the asset and its upstream metadata as nodes
                page.goto(f"{url}/assets/images?view=lineage", wait_until="domcontentloaded")
                for name in DATA_ASSETS:
                    page.get_by_text(name, exact=True).first.wait_for(state="visible")
                shot("images_lineage")
                log("browser: images lineage shows " + ", ".join(DATA_ASSETS))

                # images's partitions view lists the shard partitions
                page.goto(f"{url}/assets/images?view=partitions", wait_until="domcontentloaded")
                for key in ("000-00", "001-00"):
                    page.get_by_text(key, exact=True).first.wait_for(state="visible")
                page.get_by_text("Materialized (2)").first.wait_for(state="visible")
                shot("images_partitions")
                log("browser: images partitions view shows 000-00, 001-00, Materialized (2)")
            except Exception:
                with contextlib.suppress(Exception):
                    shot("FAILED")
                    log(
                        f"browser: failed on {page.url}; body text: {page.inner_text('body')[:1500]}"
                    )
                raise
        finally:
            browser.close()
    return shots


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_dagster_dev_backfill_catalog_and_ui(tmp_path, small_sample, zoo, monkeypatch):
    t0 = time.monotonic()
    timings: dict[str, float] = {}

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - t0:6.1f}s] {msg}", flush=True)

    home = make_dagster_home(tmp_path / "dagster_home")
    data = tmp_path / "data"
    env = {
        "FLOWMATCH_DATA_ROOT": str(data),
        "FLOWMATCH_METADATA": small_sample["metadata"],
        "FLOWMATCH_FILE_ROOT": small_sample["dest"],
        "FLOWMATCH_SHARD_SIZE": "10000",
        "FLOWMATCH_VAE": zoo["vae"],
        "FLOWMATCH_DINO": zoo["dino"],
        "FLOWMATCH_TEXT": zoo["text"],
        "FLOWMATCH_DEVICE": "cpu",
        "WANDB_MODE": "offline",
        "FLOWMATCH_SETTINGS": str(tmp_path / "settings.yaml"),  # standing settings, read per run
    }
    (tmp_path / "settings.yaml").write_text("{}\n")
    # register the partitions directly (the sensor would too, on its first daemon tick)
    with dg.DagsterInstance.from_config(str(home)) as instance:
        keys = sorted(register_partitions(instance, make_resource(data, small_sample)))
    assert keys == ["000-00", "001-00"]

    with dagster_dev(home, env, tmp_path / "dagster_dev.log") as dev:
        timings["startup"] = time.monotonic() - t0
        log(f"dagster dev ready on {dev.url}")

        assert backfill.missing_partitions(dev.url, ASSETS, str(data)) == keys, dev.fail_msg(
            "missing"
        )
        bid = backfill.launch_backfill(dev.url, keys, ASSETS, title="e2e test")
        log(f"launched backfill {bid}")
        t1 = time.monotonic()
        try:
            st = backfill.wait_backfill(
                dev.url,
                bid,
                timeout=BACKFILL_TIMEOUT,
                poll=5,
                progress_cb=lambda s: log(backfill.format_status(s)),
            )
        except TimeoutError as e:
            pytest.fail(dev.fail_msg(str(e)))
        timings["backfill"] = time.monotonic() - t1
        assert st["ok"], dev.fail_msg(f"backfill ended {st}")
        for a in ASSETS:
            assert st["assets"][a]["materialized"] == len(keys), dev.fail_msg(str(st))

        # nothing is missing any more, seen from the webserver and from the instance
        assert backfill.missing_partitions(dev.url, ASSETS, str(data)) == [], dev.fail_msg(
            "still missing"
        )
        with dg.DagsterInstance.from_config(str(home)) as instance:
            assert backfill.missing_partitions(instance, ASSETS, str(data)) == []
        monkeypatch.setenv("FLOWMATCH_DATA_ROOT", str(data))  # the CLI reads it from env
        assert backfill.main(["--missing", "--assets", ",".join(ASSETS), "--url", dev.url]) == 0

        # a standing setting changes: `backfill --stale` re-makes exactly text_embeddings
        for k in ("FLOWMATCH_SETTINGS", "FLOWMATCH_METADATA", "FLOWMATCH_VAE", "FLOWMATCH_DINO",
                  "FLOWMATCH_TEXT", "FLOWMATCH_FILE_ROOT"):  # fmt: skip
            monkeypatch.setenv(k, env[k])
        (tmp_path / "settings.yaml").write_text("encoders: {max_tokens: 16}\n")
        assert backfill.stale_backfills(ASSETS) == [(["text_embeddings"], keys)]
        t1 = time.monotonic()
        assert backfill.main(["--stale", "--url", dev.url, "--wait", "--poll", "3"]) == 0
        timings["backfill --stale"] = time.monotonic() - t1
        assert backfill.stale_backfills(ASSETS) == [], dev.fail_msg("still stale")
        with dg.DagsterInstance.from_config(str(home)) as instance:
            for a in ASSETS:  # one more materialization of text_embeddings only
                n = len(instance.fetch_materializations(dg.AssetKey(a), limit=10).records)
                assert n == len(keys) * (2 if a == "text_embeddings" else 1), (a, n)

        # the catalog: every good row covered, every bad row listed with its reason
        expected = small_sample["expected_outcomes"]
        cat = Catalog(data)
        cov = {r["partition"]: r for r in cat.coverage()}
        assert sorted(cov) == keys, cov
        n_stored = sum(1 for o in expected.values() if o == "stored")
        for a in ["images", *EMBEDDINGS]:
            assert all(cov[k][a] for k in keys), (a, cov)
            assert sum(cov[k][a] for k in keys) == n_stored, (a, cov)
        assert _final_outcomes(cat) == expected
        bad = {}
        for o in expected.values():
            if o != "stored":
                bad[tuple(o.split(":", 1))] = bad.get(tuple(o.split(":", 1)), 0) + 1
        got = {}
        for r in cat.failures_by_reason():
            if r["asset"] in DATA_ASSETS:
                got[(r["outcome"], r["reason"])] = (
                    got.get((r["outcome"], r["reason"]), 0) + r["rows"]
                )
        assert got == bad, (got, bad)
        log(f"catalog: {n_stored} rows stored, failures {sorted(bad)}")

        # training from the webserver: flow_model (+ samples) with launchpad run config
        t3 = time.monotonic()
        train_cfg = {
            "run_name": "e2e",
            "max_steps": 6,
            "overrides": [
                "data.batch_size=4",
                "trainer.log_every=2",
                "trainer.sample_every=1000",
                "trainer.checkpoint_every=1000",
                "sample.steps=2",
            ],
        }
        run_config = {
            "ops": {
                "flow_model": {"config": train_cfg},
                "samples": {"config": {"run_name": "e2e", "steps": 2}},
            }
        }
        run_id = orchestration.launch_run(dev.url, ["flow_model", "samples"], run_config)
        log(f"launched training run {run_id}")
        try:
            status = orchestration.wait_run(dev.url, run_id, timeout=400)
        except TimeoutError as e:
            pytest.fail(dev.fail_msg(str(e)))
        assert status == "SUCCESS", dev.fail_msg(f"training run ended {status}")
        timings["training"] = time.monotonic() - t3
        with dg.DagsterInstance.from_config(str(home)) as instance:
            rec = instance.fetch_materializations(dg.AssetKey("flow_model"), limit=1).records[0]
            md = rec.asset_materialization.metadata
            assert md["step"].value == 6  # reported live by the training process (Pipes)
            assert md["partitions_used"].value == keys
            assert "data:image/jpeg;base64" in md["loss_curve"].value
        assert (data / "samples" / "e2e.png").stat().st_size > 1000
        log("training: 6 steps through Pipes, loss curve and sample grid recorded")

        # the UI in a real browser
        if not CHROMIUM.exists():
            pytest.skip(f"{CHROMIUM} is absent (apt-get install -y chromium)")
        t2 = time.monotonic()
        try:
            shots = _browse(dev.url, log)
        except Exception as e:
            pytest.fail(dev.fail_msg(f"browser check failed: {type(e).__name__}: {e}"))
        timings["browser"] = time.monotonic() - t2
        assert all(s.stat().st_size > 10_000 for s in shots), shots
    timings["total"] = time.monotonic() - t0
    log("timings: " + ", ".join(f"{k} {v:.0f}s" for k, v in timings.items()))
