"""docs/settings.md lists every setting, made from the settings' classes
(flowmatch_assets/reports/settings_reference.py): a field added without its line there, or
without a description, fails here."""

from __future__ import annotations

from pathlib import Path

from flowmatch_assets.reports import settings_reference

REPO = Path(__file__).resolve().parents[1]


def test_every_setting_has_a_description():
    assert settings_reference.undescribed() == []
    # a Literal's values are not its description: an undescribed one is still undescribed

    from typing import Literal

    from pydantic import BaseModel, Field

    class Planted(BaseModel):
        mode: Literal["a", "b"] = "a"
        kind: Literal["a", "b"] = Field("a", description="Which.")

    rows = {k: what for k, _, what in settings_reference.fields(Planted)}
    assert rows == {"mode": "", "kind": "Which. One of: a, b."}


def test_docs_settings_md_is_current():
    want = settings_reference.render()
    got = (REPO / "docs" / "settings.md").read_text()
    assert got == want, (
        "docs/settings.md is not current: "
        "python -m flowmatch_assets.reports.settings_reference > docs/settings.md"
    )
    # what it lists, checked by hand: a key of each part, a default, a required field
    assert "| `trainer.keep_ema` | `0` | Newest EMA snapshots kept; 0 = all. |" in got
    assert "| `filters.max_caption_chars` | `4000` |" in got
    assert "| `data_root` | (required) |" in got
    assert "| `sources.<name>.kind` | (required) |" in got
    rows = settings_reference.training_rows() + settings_reference.pipeline_rows()
    rows += settings_reference.asset_rows()
    assert got.count("\n| `") == len(rows) > 170
    assert '| `flow_model.config_file` | `"configs/tiny.yaml"` |' in got  # not this checkout's path
