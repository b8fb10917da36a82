"""The loss names live in one list (flowmatch_models/model/loss_terms.py): the objective
returns its terms under those keys, and the logger, the progress line, the result, the asset's
metadata and record, the curves and the validation records read them from there. A name
written again in another file (a planted ``"train/fm"``, ``out["repa"]``, ``"val_loss"``)
fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from flowmatch_models.model import loss_terms
from flowmatch_models.model.loss_terms import LOSS_TERMS, TERMS, VAL_METRIC

REPO = Path(__file__).resolve().parents[1]
HOME = "flowmatch_models/model/loss_terms.py"

# a loss name as a literal: a logged name (train/loss, train/loss_<h>x<w>, val/t<k>, ...), a
# metadata name, the fm key anywhere, and the total / REPA keys read out of a loss dict or the
# result's metrics ("repa" alone is also the REPA target's width, "loss" a record column)
PLANTED = re.compile(
    r"""["'](train/(loss|fm|repa)|val/(loss|t|samples)|(fm|repa|total|val)_loss)([^a-z]|$)"""
    r"""|["']fm["']"""
    r"""|\b(out|metrics)\[["'](loss|repa)["']\]"""
    r"""|\.get\(["'](loss|repa|fm|val_loss)["']"""
)


def copies(text: str) -> list[str]:
    return [m.group(0) for m in PLANTED.finditer(text)]


@pytest.mark.parametrize(
    "line",
    [
        'self.log("train/fm", out[FM])',
        'self.log(f"train/loss_{h}x{w}", x)',
        'out[f"val/t{k}"] = v',
        'names = {"fm": "fm_loss"}',
        'm = out["repa"]',
        'return {"loss": total, "fm": fm}',
        'v = result.metrics.get("val_loss")',
        'md["total_loss"] = 1.0',
    ],
)
def test_a_planted_loss_name_is_caught(line: str) -> None:
    assert copies(line), line


def test_no_loss_name_outside_its_list() -> None:
    found = {}
    for folder in ("flowmatch_models", "flowmatch_assets", "scripts", "examples"):
        for f in sorted((REPO / folder).rglob("*.py")):
            rel = f.relative_to(REPO).as_posix()
            if rel != HOME and (hits := copies(f.read_text())):
                found[rel] = hits
    assert not found, f"loss names written outside {HOME} (read them from it): {found}"
    # and the list itself still holds every name the pattern knows
    assert copies((REPO / HOME).read_text())


def test_the_objective_returns_the_listed_terms() -> None:
    from flowmatch_models.model.dit import build_model
    from flowmatch_models.model.flow import FlowMatching

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    model = build_model("tiny", init="default")
    x = torch.randn(2, 32, 8, 8, generator=g)
    text, mask = torch.randn(2, 4, 640, generator=g), torch.ones(2, 4, dtype=torch.bool)
    dino = torch.randn(2, 64, 384, generator=g)
    out = FlowMatching(repa_lambda=0.5, caption_dropout=0.0).loss(model, x, text, mask, dino, g)
    assert set(out) == set(TERMS) | {"bin_loss", "bin_count"}
    fm, repa, total = (
        float(out[k].detach()) for k in (loss_terms.FM, loss_terms.REPA, loss_terms.TOTAL)
    )
    assert total == pytest.approx(fm + 0.5 * repa, rel=1e-5)
    assert fm > 0 and -1.0 <= repa <= 1.0


def test_the_metadata_leads_with_the_flow_matching_and_held_out_losses() -> None:
    from flowmatch_assets.defs.training_assets import training_metadata
    from flowmatch_models.train.run import TrainResult

    reported = {"loss": -0.25, "fm": 0.5, "repa": -1.5, "val_loss": 0.75, "step": 7}
    md = training_metadata(reported, TrainResult(run_dir="r", partitions=["a"]), 2.0, {})
    assert list(md)[:2] == ["fm_loss", "val_loss"]
    assert (md["fm_loss"], md["val_loss"], md["total_loss"], md["repa_loss"]) == (
        0.5,
        0.75,
        -0.25,
        -1.5,
    )
    assert md["step"] == 7 and "fm" not in md and "loss" not in md
    assert {t.metadata for t in LOSS_TERMS} | {VAL_METRIC} <= set(md)


def test_validation_rows_read_the_logged_held_out_names(tmp_path: Path) -> None:
    from flowmatch_assets.catalog.records import validation_rows

    csv = tmp_path / "metrics.csv"
    csv.write_text(
        "step,train/loss,val/loss,val/t0,val/t1,val/samples\n10,0.9,,,,\n20,0.8,0.5,0.75,0.25,12\n"
    )
    rows = validation_rows(csv, "run1")
    assert [(r["step"], r["t_bin"], r["loss"], r["samples"]) for r in rows] == [
        (20, -1, 0.5, 12),
        (20, 0, 0.75, 12),
        (20, 1, 0.25, 12),
    ]
