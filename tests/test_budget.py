"""The budget report: projections from measured catalog rates, the seeds' references, disk.

Real catalogs (parquet records + DuckDB views) in tmp dirs; no mocks.
"""

from __future__ import annotations

import json

import dagster as dg
import pyarrow.parquet as pq
import pytest

from flowmatch_assets.catalog import Catalog, MaterializationRecord, record_materialization
from flowmatch_assets.cli.budget import main
from flowmatch_assets.defs.budget_assets import budget_report
from flowmatch_assets.defs.resources import FlowmatchResource
from flowmatch_assets.reports.budget import BudgetConfig, budget, payback_hours, project
from flowmatch_assets.reports.measured import measure

EMB = {"vae_latents": 2.0, "dino_features": 1.0, "text_embeddings": 1.0}


def _rec(root, asset, part, samples, seconds, stored=0, device="cpu", extra=None):
    record_materialization(
        root,
        MaterializationRecord(
            asset,
            part,
            samples=samples,
            seconds=seconds,
            raw_bytes=stored * 2,
            stored_bytes=stored,
            device=device,
            extra=extra or {},
        ),
    )


def _rows(data):
    return {(r["stage"].split(":")[0], r["source"], r["device"]): r for r in data["projection"]}


def _embeddings(root, part, device="cuda:0", n=1000, random_weights=False):
    for a, s in EMB.items():
        _rec(
            root,
            a,
            part,
            n,
            s,
            stored=n * 20_000,
            device=device,
            extra={"random_weights": random_weights},
        )


def test_empty_catalog_says_not_measured_and_seed_references_are_exact(tmp_path):
    md, data = budget(Catalog(tmp_path), BudgetConfig(updates=400_000))
    rows = _rows(data)
    for stage in ("images", "precalc", "training"):
        r = rows[(stage, "ours", "-")]
        assert r["rate"] == "not measured" and r["hours"] is None and r["cloud_usd"] is None
    assert md.count("not measured") >= 5  # three stages + two disk rows
    seed = "seed (2x RTX 3090)"
    pre = rows[("precalc", seed, "2x RTX 3090")]
    assert pre["hours"] == pytest.approx(12.4e6 / 200 / 3600)  # the seed's ~17 h
    tr = rows[("training", seed, "2x RTX 3090")]
    assert tr["hours"] == pytest.approx(400_000 / 0.39 / 3600)
    assert tr["box_kwh"] == pytest.approx(tr["hours"] * 1.0)  # the seed's 1 kW
    assert tr["box_usd"] == pytest.approx(tr["hours"] * 0.32)
    repa = rows[("training", "REPA paper (8x H100)", "8x H100")]
    # the seed's arithmetic: 400k updates at 5.4/s on 8 H100 = ~164 GPU-h = ~$450 at $2.76
    assert repa["hours"] * 8 == pytest.approx(164.6, abs=0.1)
    assert repa["cloud_usd"] == pytest.approx(400_000 / 5.4 / 3600 * 8 * 2.76)
    assert repa["box_kwh"] is None  # not an owned box
    disk = {d["what"]: d for d in data["disk"]}
    assert disk["images (HDD)"]["gb"] is None and "not measured" in disk["images (HDD)"]["note"]
    assert disk["seed: embeddings"]["gb"] == pytest.approx(700.0)
    ckpt = disk["checkpoints (SSD, 400,000 updates)"]  # base.yaml retention, real param counts
    assert ckpt["gb"] == pytest.approx((50 * 757_303_424 + 2 * 3_107_910_656) / 1e9)
    assert "50 EMA snapshots (every 8,000)" in ckpt["note"] and ckpt["gb"] < 60


def test_projection_from_measured_rates(tmp_path):
    for p in ("000-00", "000-01"):
        _rec(tmp_path, "images", p, 1000, 10.0, stored=13_000_000)  # 100 img/s, 13 kB each
        _embeddings(tmp_path, p)  # 1000 pairs per 2+1+1 s = 250 pairs/s
    _embeddings(tmp_path, "000-02")
    _rec(tmp_path, "vae_latents", "000-03", 1000, 0.1, device="cuda:0")  # incomplete: ignored
    _rec(
        tmp_path,
        "flow_model",
        "run",
        2048,
        1.0,
        device="cuda (NVIDIA H200)",
        extra={"preset": "base", "samples_per_s": 2048.0},
    )
    cfg = BudgetConfig(
        updates=1000, effective_batch=1024, gpu_hour_usd=2.0, gpus=2, box_watts=500, kwh_usd=0.5
    )
    md, data = budget(Catalog(tmp_path), cfg)
    rows = _rows(data)
    img = rows[("images", "ours", "cpu")]
    assert img["hours"] == pytest.approx(12.4e6 / 100 / 3600)
    assert img["cloud_usd"] == pytest.approx(img["hours"] * 0.10)  # a CPU rate: CPU price
    pre = rows[("precalc", "ours", "cuda:0")]
    assert pre["hours"] == pytest.approx(12.4e6 / 250 / 3600)  # rates are not scaled by gpus
    assert pre["cloud_usd"] == pytest.approx(pre["hours"] * 2.0 * 2)  # ...the price is
    assert pre["box_usd"] == pytest.approx(pre["hours"] * 0.5 * 0.5)
    assert "3000 samples" in pre["note"].replace(",", "") and "3 partitions" in pre["note"]
    tr = rows[("training", "ours", "cuda (NVIDIA H200)")]
    assert tr["hours"] == pytest.approx(1000 / 2.0 / 3600)  # 2048 samples/s = 2 updates/s
    assert "preset base" in tr["note"]
    disk = {d["what"]: d for d in data["disk"]}
    assert disk["images (HDD)"]["gb"] == pytest.approx(13_000 * 12.4e6 / 1e9)
    emb = disk["embeddings (SSD)"]  # 3 x 20 kB per pair (000-03 has no stored bytes)
    assert emb["gb"] == pytest.approx(60_000 * 12.4e6 / 1e9)
    assert "| training: 1,000 updates x 1,024 | ours | 2 updates/s" in md
    assert "| cuda (NVIDIA H200) |" in md


def test_devices_are_never_mixed_and_zoo_is_flagged(tmp_path):
    _rec(tmp_path, "images", "000-00", 100, 10.0, device="cpu")
    _rec(tmp_path, "images", "000-01", 1000, 10.0, device="cuda:0")
    _embeddings(tmp_path, "000-00", device="cpu", random_weights=True)
    m = measure(Catalog(tmp_path))
    assert {(r.device, r.per_s) for r in m["images"]} == {("cpu", 10.0), ("cuda:0", 100.0)}
    (pre,) = m["precalc"]
    assert pre.device == "cpu" and "RANDOM-WEIGHT" in pre.note
    rows = project(m, BudgetConfig())
    assert [r["device"] for r in rows if r["stage"].startswith("images")] == ["cpu", "cuda:0"]


def test_resumed_run_uses_the_logged_rate_and_latest_run_wins(tmp_path):
    # a resumed run: cumulative samples over one short session's wall -> samples/s far too high
    _rec(tmp_path, "flow_model", "old", 1024, 100.0, device="cuda", extra={"preset": "tiny"})
    _rec(
        tmp_path,
        "flow_model",
        "resumed",
        1_024_000,
        10.0,
        device="cuda",
        extra={"preset": "tiny", "samples_per_s": 512.0},
    )
    _rec(tmp_path, "flow_model", "nolog", 2048, 4.0, device="cpu", extra={"preset": "tiny"})
    m = measure(Catalog(tmp_path))
    by_dev = {r.device: r for r in m["training"]}
    assert by_dev["cuda"].per_s == 512.0 and by_dev["cuda"].count == 2
    assert by_dev["cpu"].per_s == 512.0 and "wall" in by_dev["cpu"].note


def test_config_validation_and_payback():
    with pytest.raises(ValueError, match="effective_batch"):
        project({}, BudgetConfig(effective_batch=0))
    assert payback_hours(BudgetConfig()) is None
    cfg = BudgetConfig(hardware_usd=2500, gpu_hour_usd=2.76, gpus=2, box_watts=1000, kwh_usd=0.32)
    assert payback_hours(cfg) == pytest.approx(2500 / (5.52 - 0.32))
    assert payback_hours(BudgetConfig(hardware_usd=1, gpu_hour_usd=0.1)) is None


def test_asset_and_cli(tmp_path, capsys, monkeypatch):
    _rec(tmp_path, "images", "000-00", 500, 5.0, stored=1000)
    res = FlowmatchResource(data_root=str(tmp_path), metadata_source=str(tmp_path))
    result = dg.materialize(
        [budget_report],
        resources={"flowmatch": res},
        run_config={"ops": {"budget_report": {"config": {"updates": 2000, "hardware_usd": 2500}}}},
    )
    assert result.success
    md = result.asset_materializations_for_node("budget_report")[0].metadata["report"].value
    assert "100.0 images/s" in md and "2,000 updates" in md and "cheaper than the cloud" in md
    assert (tmp_path / "reports" / "budget.md").read_text() == md
    monkeypatch.setenv("FLOWMATCH_DATA_ROOT", str(tmp_path))
    assert main(["--updates", "1000", "--batch", "512"]) == 0
    assert "1,000 updates at batch 512" in capsys.readouterr().out
    assert main(["--watts", "700"]) == 0
    assert "Owned box: 700 W at" in capsys.readouterr().out
    assert main(["--json", "--watts", "700"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["config"]["box_watts"] == 700 and data["measured"]["images"][0]["per_s"] == 100
    assert main(["--batch", "0"]) == 2
    assert "effective_batch" in capsys.readouterr().err


def test_disk_per_kind_worst_case_tokens_and_whether_the_ssd_fits(tmp_path, capsys, monkeypatch):
    """Each kind's bytes from the catalog, the caption tokens measured and at max_tokens (a
    token's stored bytes are fixed), and whether embeddings + checkpoints fit the SSD."""
    for p in ("000-00", "000-01"):
        _rec(tmp_path, "vae_latents", p, 1000, 1.0, stored=1000 * 4_108)
        _rec(tmp_path, "dino_features", p, 1000, 1.0, stored=1000 * 13_100)
        # 100 tokens a caption at 359 B a token + 1,000 B of lengths/null/tables a sample
        _rec(
            tmp_path,
            "text_embeddings",
            p,
            1000,
            1.0,
            stored=1000 * 36_900,
            extra={"tokens": 100_000, "token_row_bytes": 359},
        )
    cfg = BudgetConfig(updates=400_000)
    _, data = budget(Catalog(tmp_path), cfg)
    disk = {d["what"].strip(): d for d in data["disk"]}
    text = disk["text_embeddings (SSD)"]
    assert text["gb"] == pytest.approx(36_900 * 12.4e6 / 1e9)
    assert "100.0 tokens/caption measured x 359 B" in text["note"]
    worst_text = 36_900 + 28 * 359  # 128 tokens each
    assert f"128 tokens each: {worst_text:,} B/sample" in text["note"]
    emb = disk["embeddings (SSD)"]
    total = 4_108 + 13_100 + 36_900
    assert emb["bytes_per_sample"] == pytest.approx(total)
    ckpt = disk["checkpoints (SSD, 400,000 updates)"]["gb"]
    fit = disk["SSD 1 TB: embeddings + checkpoints"]
    assert fit["gb"] == pytest.approx(total * 12.4e6 / 1e9 + ckpt)
    assert fit["fits"] and fit["fits_worst_case"]  # 671 + 44 and 715 + 44 GB of 1,000
    assert fit["note"].startswith(f"fits: {1000 - fit['gb']:,.0f} GB left")
    # a 0.5 TB SSD does not hold them: it says so, by how much, and what to do
    _, small = budget(Catalog(tmp_path), BudgetConfig(updates=400_000, ssd_tb=0.5))
    fit = {d["what"]: d for d in small["disk"]}["SSD 0.5 TB: embeddings + checkpoints"]
    assert not fit["fits"] and f"{fit['gb'] - 500:,.0f} GB short" in fit["note"]
    assert "pca4.5" in fit["note"]
    # the CLI: `flowmatch budget --ssd-tb 0.5` on this catalog
    monkeypatch.setenv("FLOWMATCH_DATA_ROOT", str(tmp_path))
    assert main(["--ssd-tb", "0.5", "--updates", "400000"]) == 0
    out = capsys.readouterr().out
    assert "| SSD 0.5 TB: embeddings + checkpoints |" in out and "does NOT fit" in out


def test_the_budget_imports_no_torch_and_its_recorded_counts_are_current(tmp_path):
    """`flowmatch budget` answers without torch and Lightning (~7 s of imports; issue 28): the
    presets' parameter counts are recorded (re-record: `python -m
    flowmatch_assets.reports.param_counts`) and still what the DiT counts."""
    import subprocess
    import sys

    from flowmatch_assets.reports import param_counts as b

    code = (
        "import sys; from flowmatch_assets.catalog import Catalog; "
        "from flowmatch_assets.reports.budget import BudgetConfig, budget; "
        f"budget(Catalog({str(tmp_path)!r}), BudgetConfig()); "
        "print(sorted(m for m in ('torch', 'lightning', 'diffusers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    table = json.loads(b.PARAM_COUNTS.read_text())
    assert table["key"] == b._param_key(), (
        "the DiT changed: re-record with `python -m flowmatch_assets.reports.param_counts`"
    )
    for name, counts in table["counts"].items():
        preset, hidden = name.split("/")
        assert b.count_params_of(preset, None if hidden == "None" else int(hidden)) == tuple(counts)


def test_the_budget_says_what_one_fault_costs(tmp_path):
    """base.yaml: a full state every 30 minutes (its 20,000 steps take ~14 h at the seed's
    0.39 updates/s), 2 GPUs: a fault loses 0.5 GPU-hours expected, 1 at worst; the stall per
    hour is the measured stall per state times 2 states an hour."""
    import json

    from flowmatch_assets.reports.faults import CHECKPOINT_BENCH

    md, data = budget(Catalog(tmp_path), BudgetConfig(updates=400_000))
    f = data["faults"]
    assert (
        f["interval_minutes"] == pytest.approx(30.0) and f["interval_from"] == "full_every_minutes"
    )
    assert f["gpus"] == 2 and f["updates_per_s"] == pytest.approx(0.39)
    assert f["expected_lost_gpu_hours"] == pytest.approx(0.5)
    assert f["worst_lost_gpu_hours"] == pytest.approx(1.0)
    assert "loses 0.50 GPU-hours expected, 1.00 at worst" in md
    bench = json.loads(CHECKPOINT_BENCH.read_text())
    assert f["stall_s_per_hour"] == pytest.approx(2 * bench["new"]["stall_s"])
    assert f["old_stall_s_per_hour"] == pytest.approx(2 * bench["old"]["stall_s"])


def _near(root, ids: list[tuple[str, str]]) -> None:
    """A near duplicates table as `flowmatch catalog neardup` writes it."""
    import pyarrow as pa

    from flowmatch_assets.catalog.derived import NEAR_SCHEMA, near_path
    from flowmatch_models.storage.layout import DataLayout

    rows = [
        {"partition": p, "id": i, "kept_partition": p, "kept_id": "w", "detector": "phash"}
        for p, i in ids
    ]
    path = near_path(DataLayout(root))
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=NEAR_SCHEMA), path)


def test_the_budget_prices_the_samples_training_skips(tmp_path):
    for p in ("000-00", "000-01"):
        _rec(tmp_path, "images", p, 1000, 10.0)  # 2,000 rows stored
        _embeddings(tmp_path, p)  # 250 pairs/s on cuda:0
    _rec(tmp_path, "flow_model", "run", 1, 1.0, device="cuda:0", extra={"samples_per_s": 500.0})
    _near(tmp_path, [("000-00", "a"), ("000-01", "b"), ("000-01", "c"), ("000-00", "d")])
    cfg = BudgetConfig(
        dataset_pairs=100_000, updates=1000, effective_batch=200, gpu_hour_usd=3.0, gpus=2
    )
    md, data = budget(Catalog(tmp_path), cfg)
    r = data["removed"]
    assert (r["removed"], r["stored"], r["fraction"]) == (4, 2000, 0.002)
    got = {(x["stage"], x["scope"]): x for x in r["rows"]}
    assert len(got) == 4 and {x["source"] for x in r["rows"]} == {"ours"}
    # rows removed x seconds per row x rate: a pair 1/250 s; training 2 visits (1000 x 200 /
    # 100,000) at 1/500 s each; 2 GPUs billed at $3 a GPU-hour
    for scope, rows in (("here", 4), ("dataset", 0.002 * 100_000)):
        pre, tr = got[("precalc", scope)], got[("training", scope)]
        assert pre["rows"] == pytest.approx(rows) and tr["rows"] == pytest.approx(rows)
        assert pre["gpu_hours"] == pytest.approx(rows * (1 / 250) / 3600 * 2)
        assert tr["gpu_hours"] == pytest.approx(rows * (2 / 500) / 3600 * 2)
        assert tr["cloud_usd"] == pytest.approx(tr["gpu_hours"] * 3.0)
    assert "## Removed samples" in md and "4 of 2,000 stored rows (0.20%)" in md
    assert "| training (100,000 pairs) | 200 | ours, cuda:0 | 0.004 | 0.0004444 | $0.001333 |" in md

    # nothing GPU-measured: the seed's rates, its 2 GPUs
    seed_root = tmp_path / "seed"
    _rec(seed_root, "images", "000-00", 300, 3.0)
    _near(seed_root, [("000-00", "a"), ("000-00", "b"), ("000-00", "c")])
    _, data = budget(Catalog(seed_root), cfg)
    seed = {(x["stage"], x["scope"]): x for x in data["removed"]["rows"]}
    assert data["removed"]["removed"] == 3 and data["removed"]["stored"] == 300
    assert seed[("precalc", "here")]["source"] == "seed (2x RTX 3090)"
    assert seed[("precalc", "here")]["gpu_hours"] == pytest.approx(3 / 200 / 3600 * 2)
    want = 3 * 2 / (0.39 * 1024) / 3600 * 2
    assert seed[("training", "here")]["gpu_hours"] == pytest.approx(want)
