"""End to end through the real UI stack: `dagster dev` (webserver + daemon), an asset backfill
launched over GraphQL (flowmatch_assets.freshness.backfill), the DuckDB catalog afterwards, and the Dagster
UI in a real headless Chromium (Playwright, system /usr/bin/chromium; screenshots in
test-artifacts/)."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import threading
import time
from pathlib import Path

import dagster as dg
import pytest

from flowmatch_assets.bench import orchestration
from flowmatch_assets.catalog import Catalog
from flowmatch_assets.cli.devserver import REPO, dagster_dev, make_dagster_home
from flowmatch_assets.defs.partitions import register_partitions
from flowmatch_assets.defs.resources import resource_from_env as settings
from flowmatch_assets.freshness import backfill
from tests.conftest import make_resource

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = REPO / "test-artifacts"
#: The control room's screenshots (kept small: the viewport, not the page); with
#: FLOWMATCH_UPDATE_SCREENSHOTS=1 they also replace the committed ones in docs/ui/.
UI_SHOTS = ARTIFACTS / "ui"
DOCS_SHOTS = REPO / "docs" / "ui"
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
        orchestration.JOB_SNAPSHOT,
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


def _control_room(url: str, ids: dict[str, str], log) -> dict[str, Path]:
    """What issue 38 asks of the UI, in Chromium: the Timeline lists the CLI's and the UI's runs
    under their jobs, a train_job run shows its tags, a CLI-made run re-executes from its page
    ("Re-execute all"), and an orphan key's failure shows its one line. Screenshots to
    test-artifacts/ui/ (docs/ui/ with FLOWMATCH_UPDATE_SCREENSHOTS=1).
    Returns {name: path}; ``ids["reexecuted"]`` is set to the new run's id."""
    from PIL import Image
    from playwright.sync_api import Error as PlaywrightError
    from playwright.sync_api import sync_playwright

    UI_SHOTS.mkdir(parents=True, exist_ok=True)
    shots: dict[str, Path] = {}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            page.set_default_timeout(90_000)

            def shot(name: str) -> None:
                path = UI_SHOTS / f"{name}.png"
                page.screenshot(path=str(path))
                with Image.open(path) as im:  # small in git: 960 px wide, 64 colours
                    im = im.convert("RGB").resize((960, 600), Image.LANCZOS)
                    im.quantize(64).save(path, optimize=True)
                if os.environ.get("FLOWMATCH_UPDATE_SCREENSHOTS") == "1":
                    shutil.copyfile(path, DOCS_SHOTS / path.name)
                shots[name] = path

            try:
                page.goto(f"{url}/overview/activity/timeline", wait_until="domcontentloaded")
                with contextlib.suppress(PlaywrightError):
                    page.get_by_role("button", name="Skip").first.click(timeout=10_000)
                for job in ("reports_job", "train_job"):  # the CLI's and the UI's runs
                    page.get_by_text(job, exact=True).first.wait_for(state="visible")
                page.get_by_role("button", name="1hr").first.click()
                assert page.get_by_text("No runs or scheduled ticks").count() == 0
                shot("timeline")
                log("browser: the Timeline lists reports_job (CLI) and train_job runs")

                page.goto(f"{url}/runs/{ids['stopped']}", wait_until="domcontentloaded")
                page.get_by_role("button", name="View tags and config").first.click()
                page.get_by_text("flowmatch/stopped_at_step", exact=False).first.wait_for(
                    state="visible"
                )
                page.get_by_text("e2e-stop", exact=False).first.wait_for(state="visible")
                shot("train_run_tags")
                log("browser: the terminated train_job run shows its tags")

                page.goto(f"{url}/runs/{ids['cli']}", wait_until="domcontentloaded")
                button = page.get_by_role("button", name=re.compile("^Re-execute"))
                button.first.wait_for(state="visible")
                button.first.click()
                page.wait_for_url(lambda u: "/runs/" in u and ids["cli"] not in u)
                ids["reexecuted"] = page.url.rstrip("/").split("/runs/")[1].split("?")[0]
                page.get_by_text("data card of", exact=False).first.wait_for(state="visible")
                shot("reexecuted_cli_run")
                log(f"browser: re-executed the CLI's run as {ids['reexecuted']}; INFO lines shown")

                page.goto(f"{url}/runs/{ids['orphan']}", wait_until="domcontentloaded")
                page.get_by_text(
                    "flowmatch partitions remove --orphans", exact=False
                ).first.wait_for(state="visible")
                shot("orphan_partition")
                log("browser: the orphan key's run shows the one line that names the fix")
            except Exception:
                with contextlib.suppress(Exception):
                    page.screenshot(path=str(ARTIFACTS / "e2e_control_room_FAILED.png"))
                    log(f"browser: failed on {page.url}; body: {page.inner_text('body')[:1500]}")
                raise
        finally:
            browser.close()
    return shots


def _wait_step(dev, offset: int, step: int, timeout: float = 300) -> int:
    """The newest ``step N/M`` progress line the training process printed into the dagster dev
    log after byte ``offset``, once N >= ``step``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(dev.log_path, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
        done = [int(n) for n in re.findall(r"^step (\d+)/", text, flags=re.M)]
        if done and done[-1] >= step:
            return done[-1]
        time.sleep(0.5)
    raise TimeoutError(dev.fail_msg(f"the training run never reached step {step}"))


def _wait_materialized(
    dev, home: Path, bid: str, data: str, log, timeout: float = BACKFILL_TIMEOUT
) -> None:
    """Until every partition of ASSETS is materialized (the runs' own events, as each run ends:
    the webserver counts a partition materializing now as not missing, the instance does not),
    logging the backfill's status as it changes; a backfill that ended unsuccessfully fails."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            st = backfill.backfill_status(dev.url, bid)
            missing = backfill.missing_partitions(dev.url, ASSETS, data)
        except backfill.BackfillError:  # the webserver may be busy: retry
            time.sleep(1)
            continue
        if backfill.format_status(st) != last:
            last = backfill.format_status(st)
            log(last)
        if st["done"] and not st["ok"]:
            pytest.fail(dev.fail_msg(f"backfill ended {st}"))
        if not missing:
            with dg.DagsterInstance.from_config(str(home)) as instance:
                if not backfill.missing_partitions(instance, ASSETS, data):
                    return
        time.sleep(1)
    pytest.fail(dev.fail_msg(f"backfill {bid}: partitions still missing after {timeout:.0f}s"))


def _final_weights(run: Path) -> dict:
    import torch

    ck = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    adam = ck["optimizer_states"][0]["state"]
    return {
        **ck["state_dict"],
        **{f"adam.{i}.{k}": v for i, st in adam.items() for k, v in st.items()},
    }


@pytest.mark.slow
@pytest.mark.timeout(1200)
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
        # the runs' materializations are what the next steps read; the backfill's own
        # COMPLETED_SUCCESS comes at the daemon's next loop (Dagster's fixed 30 s): checked
        # below, once the training runs are done
        _wait_materialized(dev, home, bid, str(data), log)
        timings["backfill"] = time.monotonic() - t1

        # nothing is missing any more, seen from the webserver and from the instance
        assert backfill.missing_partitions(dev.url, ASSETS, str(data)) == [], dev.fail_msg(
            "still missing"
        )
        with dg.DagsterInstance.from_config(str(home)) as instance:
            assert backfill.missing_partitions(instance, ASSETS, str(data)) == []
        monkeypatch.setenv("FLOWMATCH_DATA_ROOT", str(data))  # the CLI reads it from env
        assert (
            backfill.main(["--missing", "--assets", ",".join(ASSETS), "--url", dev.url], settings)
            == 0
        )

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
            "settings": {
                "data": {"batch_size": 4},
                "trainer": {"log_every": 2, "sample_every": 1000, "checkpoint_every": 1000},
                "sample": {"steps": 2},
            },
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
            status = orchestration.wait_run(dev.url, run_id, timeout=400, poll=1)
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

        # "Terminate" on a training run (GraphQL terminateRun, what the UI's button sends):
        # the training process saves a full state through Pipes, the run ends CANCELED with the
        # step in its tags and an observation; materializing flow_model again resumes from it
        # and ends with the uninterrupted e2e run's weights, bit for bit (CPU)
        import torch

        from flowmatch_assets.defs.partitions import SHARDS

        t4 = time.monotonic()
        stop_cfg = {**train_cfg, "run_name": "e2e-stop", "max_steps": 1000}
        offset = dev.log_path.stat().st_size
        stop_id = orchestration.launch_run(
            dev.url,
            ["flow_model"],
            {"ops": {"flow_model": {"config": stop_cfg}}},
            tags={"flowmatch/cli": "e2e"},
            job="train_job",
        )
        seen = _wait_step(dev, offset, 2)
        orchestration.terminate_run(dev.url, stop_id)
        status = orchestration.wait_run(dev.url, stop_id, timeout=300, poll=1)
        assert status == "CANCELED", dev.fail_msg(f"terminated training run ended {status}")
        stopped = orchestration.run_details(dev.url, stop_id)
        tags = stopped["tags"]
        step = int(tags["flowmatch/stopped_at_step"])
        ckpt = data / "runs" / "e2e-stop" / "checkpoints" / f"step{step:07d}.ckpt"
        assert step >= seen and tags["flowmatch/checkpoint"] == str(ckpt), tags
        assert tags["flowmatch/run"] == "e2e-stop" and stopped["jobName"] == "train_job"
        state = torch.load(ckpt, weights_only=True)
        assert state["global_step"] == step and state["optimizer_states"]  # a full state
        with dg.DagsterInstance.from_config(str(home)) as instance:
            obs = instance.fetch_observations(dg.AssetKey("flow_model"), limit=1).records[0]
            assert obs.run_id == stop_id
            assert obs.asset_observation.metadata["stopped_at_step"].value == step
        total, reference = (6, "e2e") if step < 6 else (step + 2, "e2e-whole")
        if reference != "e2e":  # stopped late: an uninterrupted run of the same length
            whole = {**train_cfg, "run_name": reference, "max_steps": total}
            rid = orchestration.launch_run(
                dev.url, ["flow_model"], {"ops": {"flow_model": {"config": whole}}}
            )
            assert orchestration.wait_run(dev.url, rid, timeout=400, poll=1) == "SUCCESS"
        resume = {**train_cfg, "run_name": "e2e-stop", "max_steps": total}
        rid = orchestration.launch_run(
            dev.url, ["flow_model"], {"ops": {"flow_model": {"config": resume}}}
        )
        assert orchestration.wait_run(dev.url, rid, timeout=400, poll=1) == "SUCCESS", dev.fail_msg(
            "resume"
        )
        a, b = _final_weights(data / "runs" / "e2e-stop"), _final_weights(data / "runs" / reference)
        assert sorted(a) == sorted(b)
        assert [k for k in a if not torch.equal(a[k], b[k])] == []
        timings["terminate + resume"] = time.monotonic() - t4
        log(f"terminate: stopped at step {step} (saw {seen}), resumed to {total} == {reference}")

        # runs the CLI makes are the code location's own: its origin, the job's snapshot as the
        # webserver holds it, real start and end times, the verb's tag, no logger in the config
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        monkeypatch.setenv("DAGSTER_HOME", str(home))
        from flowmatch_assets.cli import main as cli_main

        assert cli_main(["data-card", "-p", "000-00"]) == 0
        with dg.DagsterInstance.from_config(str(home)) as instance:
            made = instance.get_runs(dg.RunsFilter(tags={"flowmatch/cli": "data-card"}))
        assert len(made) == 2, made
        (card,) = [r for r in made if r.asset_selection == {dg.AssetKey("data_card")}]
        assert card.tags["dagster/partition"] == "000-00" and "loggers" not in card.run_config
        cli = orchestration.run_details(dev.url, card.run_id)
        assert cli["jobName"] == "reports_job" and cli["startTime"] < cli["endTime"], cli
        repo = backfill.graphql(dev.url, orchestration.REPOS)["repositoriesOrError"]["nodes"][0]
        assert cli["repositoryOrigin"] == {
            "repositoryName": repo["name"],
            "repositoryLocationName": repo["location"]["name"],
        }
        assert cli["parentPipelineSnapshotId"] == orchestration.job_snapshot_id(
            dev.url, "reports_job"
        )  # the UI's "origin-and-snapshot" match: re-executes without a version warning

        # a key with nothing behind it (the Materialize dialog's "add partition"): one line
        with dg.DagsterInstance.from_config(str(home)) as instance:
            instance.add_dynamic_partitions(SHARDS, ["003-00"])
        orphan_id = orchestration.launch_run(dev.url, ["metadata"], partition="003-00")
        assert orchestration.wait_run(dev.url, orphan_id, timeout=120, poll=1) == "FAILURE"
        with dg.DagsterInstance.from_config(str(home)) as instance:
            (fail,) = [
                r.dagster_event
                for r in instance.all_logs(orphan_id)
                if r.is_dagster_event and r.dagster_event.is_step_failure
            ]
        line = fail.step_failure_data.user_failure_data.description
        assert "\n" not in line and line.endswith("(or `-p 003-00`)"), line
        assert "`flowmatch partitions remove --orphans`" in line
        ids = {"stopped": stop_id, "cli": card.run_id, "orphan": orphan_id}

        # the first backfill ended as the daemon saw it (its loop ran while training did)
        st = backfill.wait_backfill(dev.url, bid, timeout=120, poll=1)
        assert st["ok"] and st["status"] == "COMPLETED_SUCCESS", dev.fail_msg(f"backfill {st}")
        for a in ASSETS:
            assert st["assets"][a]["materialized"] == len(keys), dev.fail_msg(str(st))

        # a standing setting changes: `backfill --stale` re-makes exactly text_embeddings,
        # followed (--wait) beside the browser checks: its two daemon loops cost no extra time
        (tmp_path / "settings.yaml").write_text("encoders: {max_tokens: 16}\n")
        assert backfill.stale_backfills(ASSETS, settings()) == [(["text_embeddings"], keys)]
        t1 = time.monotonic()
        stale: dict = {}

        def follow_stale() -> None:
            try:
                argv = ["--stale", "--url", dev.url, "--wait", "--poll", "1"]
                stale["rc"] = backfill.main(argv, settings)
            except BaseException as e:  # noqa: BLE001 -- reported by the main thread
                stale["error"] = repr(e)

        follower = threading.Thread(target=follow_stale, daemon=True)
        follower.start()

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
        t5 = time.monotonic()
        try:
            room = _control_room(dev.url, ids, log)
        except Exception as e:
            pytest.fail(dev.fail_msg(f"control room check failed: {type(e).__name__}: {e}"))
        assert sorted(room) == [
            "orphan_partition",
            "reexecuted_cli_run",
            "timeline",
            "train_run_tags",
        ]
        assert all(5_000 < s.stat().st_size < 200_000 for s in room.values()), room
        # the re-execution from the UI: the same job and result, logging at INFO as any run
        assert orchestration.wait_run(dev.url, ids["reexecuted"], timeout=120, poll=1) == "SUCCESS"
        again = orchestration.run_details(dev.url, ids["reexecuted"])
        assert again["jobName"] == "reports_job" and again["tags"]["dagster/partition"] == "000-00"
        with dg.DagsterInstance.from_config(str(home)) as instance:
            infos = [
                r.user_message
                for r in instance.all_logs(ids["reexecuted"])
                if r.level == logging.INFO and not r.is_dagster_event
            ]
            assert any("000-00: data card of" in m for m in infos), infos
            assert "loggers" not in instance.get_run_by_id(ids["reexecuted"]).run_config
        timings["control room"] = time.monotonic() - t5
        follower.join(timeout=BACKFILL_TIMEOUT)
        assert stale == {"rc": 0}, dev.fail_msg(f"backfill --stale: {stale}")
        timings["backfill --stale (beside the browser)"] = time.monotonic() - t1
        assert backfill.stale_backfills(ASSETS, settings()) == [], dev.fail_msg("still stale")
        with dg.DagsterInstance.from_config(str(home)) as instance:
            for a in ASSETS:  # one more materialization of text_embeddings only
                n = len(instance.fetch_materializations(dg.AssetKey(a), limit=10).records)
                assert n == len(keys) * (2 if a == "text_embeddings" else 1), (a, n)
    timings["total"] = time.monotonic() - t0
    log("timings: " + ", ".join(f"{k} {v:.0f}s" for k, v in timings.items()))
