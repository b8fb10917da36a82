"""The budget report: projections from measured catalog rates, the seeds' references, disk."""

from __future__ import annotations

import dagster as dg
import pytest

from flowmatch_assets.budget_report import BudgetConfig, budget, budget_report, main
from flowmatch_assets.catalog import MaterializationRecord, record_materialization
from flowmatch_assets.resources import FlowmatchResource


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
        ),  # fmt: skip
    )


def _rows(data):
    return {(r["stage"].split(":")[0], r["source"]): r for r in data["projection"]}


def test_unmeasured_stages_say_so_and_seed_references_are_exact(tmp_path):
    md, data = budget(tmp_path, BudgetConfig(updates=400_000))
    rows = _rows(data)
    assert rows[("images_256", "ours")]["hours"] is None
    assert "not measured yet" in md
    # seed: 12.4M pairs at 200/s = 17.2 h; REPA: 400k updates at 5.4/s on 8 H100 at $2.76 ~ $454
    assert rows[("precalc", "seed (2x RTX 3090)")]["hours"] == pytest.approx(12.4e6 / 200 / 3600)
    assert rows[("training", "REPA paper (8x H100)")]["cloud_usd"] == pytest.approx(
        400_000 / 5.4 / 3600 * 8 * 2.76
    )
    assert rows[("training", "seed (2x RTX 3090)")]["hours"] == pytest.approx(400_000 / 0.39 / 3600)


def test_projection_from_measured_rates(tmp_path):
    for p in ("000-00", "000-01"):
        _rec(tmp_path, "images_256", p, 1000, 10.0, stored=13_000_000)  # 100 img/s, 13 kB each
        for a, s in (("vae_latents", 2.0), ("dino_features", 1.0), ("text_embeddings", 1.0)):
            _rec(
                tmp_path,
                a,
                p,
                1000,
                s,
                stored=20_000_000,
                device="cuda:0",
                extra={"random_weights": False},
            )
    _rec(tmp_path, "flow_model", "run", 2048, 1.0, device="cuda (H200)", extra={"preset": "base"})
    cfg = BudgetConfig(
        updates=1000, effective_batch=1024, gpu_hour_usd=2.0, box_watts=500, kwh_usd=0.5
    )
    md, data = budget(tmp_path, cfg)
    rows = _rows(data)
    img = rows[("images_256", "ours")]
    assert img["hours"] == pytest.approx(12.4e6 / 100 / 3600)
    assert img["cloud_usd"] == pytest.approx(img["hours"] * 0.10)  # a CPU rate: CPU price
    pre = rows[("precalc", "ours")]
    assert pre["hours"] == pytest.approx(12.4e6 / 250 / 3600)  # 1000 pairs per 4 s of encoders
    assert pre["cloud_usd"] == pytest.approx(pre["hours"] * 2.0)
    assert pre["box_usd"] == pytest.approx(pre["hours"] * 0.5 * 0.5)
    tr = rows[("training", "ours")]
    assert tr["hours"] == pytest.approx(1000 / 2.0 / 3600)  # 2048 samples/s = 2 updates/s
    assert "preset base" in tr["device"]
    disk = {d["what"]: d for d in data["disk"]}
    assert disk["images (HDD)"]["projected_gb"] == pytest.approx(13_000 * 12.4e6 / 1e9)
    assert disk["embeddings (SSD)"]["projected_gb"] == pytest.approx(60_000 * 12.4e6 / 1e9)
    assert "| training: 1,000 updates x 1024 | ours | 2 updates/s |" in md


def test_asset_and_cli(tmp_path, capsys, monkeypatch):
    _rec(tmp_path, "images_256", "000-00", 500, 5.0, stored=1000)
    res = FlowmatchResource(data_root=str(tmp_path), metadata_source=str(tmp_path))
    result = dg.materialize([budget_report], resources={"flowmatch": res})
    md = result.asset_materializations_for_node("budget_report")[0].metadata["report"].value
    assert "100.0 images/s" in md and (tmp_path / "reports" / "budget.md").read_text() == md
    monkeypatch.setenv("FLOWMATCH_DATA_ROOT", str(tmp_path))
    assert main(["--updates", "1000"]) == 0
    assert "1,000 updates" in capsys.readouterr().out
