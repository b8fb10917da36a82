"""The catalog's views are rebuilt when the SQL that builds them changes (no hand-bumped version),
and the CLI lists the views the catalog has."""

from __future__ import annotations

import duckdb

from flowmatch_assets.catalog import Catalog, catalog_version, view_names, views
from flowmatch_assets.cli import main as cli_main


def _views(path) -> set[str]:
    with duckdb.connect(str(path), read_only=True) as con:
        return {
            r[0]
            for r in con.execute(
                "SELECT view_name FROM duckdb_views() WHERE NOT internal"
            ).fetchall()
        }


def test_an_edited_view_is_rebuilt_in_an_existing_catalog(tmp_path, monkeypatch):
    cat = Catalog(tmp_path)
    path = cat.ensure()
    before = catalog_version(cat.layout)
    assert _views(path) == set(view_names())
    built_at = path.stat().st_mtime_ns
    assert cat.ensure() == path and path.stat().st_mtime_ns == built_at  # current: kept
    built = views._view_sql

    def edited(layout):
        return [*built(layout), "CREATE OR REPLACE VIEW a_new_view AS SELECT 42 AS answer"]

    monkeypatch.setattr(views, "_view_sql", edited)
    assert catalog_version(cat.layout) != before
    assert Catalog(tmp_path).query("SELECT answer FROM a_new_view") == [{"answer": 42}]
    assert "a_new_view" in view_names()
    monkeypatch.setattr(views, "_view_sql", built)
    assert "a_new_view" not in _views(Catalog(tmp_path).ensure())  # and back


def test_the_catalog_lists_its_views_for_the_cli(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FLOWMATCH_DATA_ROOT", str(tmp_path))
    assert len(view_names()) == len(set(view_names())) >= 23
    assert cli_main(["catalog", "views"]) == 0
    assert capsys.readouterr().out.split() == view_names()
    assert cli_main(["catalog", "sql", "SELECT * FROM no_such_view"]) == 2
    err = capsys.readouterr().err
    assert "the catalog rejected the SQL" in err and ", ".join(view_names()) in err
