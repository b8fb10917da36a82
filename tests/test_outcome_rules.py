"""One place for the row-outcome rules (issue 47): the catalog's ``dataset_rows`` SQL and the
data card's numpy come from ``catalog/outcome_rules.py`` and agree on every combination of a
row's facts; no second copy of a rule is written elsewhere in the catalog."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import duckdb
import numpy as np

from flowmatch_assets.catalog import outcome_rules

REPO = Path(__file__).resolve().parents[1]
META = [("stored", None), ("filtered", "too_small"), ("failed", "missing_caption")]
IMAGES = [None, ("stored", None), ("failed", "timeout"), ("filtered", "too_small")]


def test_sql_and_numpy_agree_on_every_combination_of_a_rows_facts():
    combos = [
        (m, i, (c, n))
        for m, i, c, n in itertools.product(META, IMAGES, (False, True), (False, True))
    ]
    con = duckdb.connect()
    con.execute("CREATE TABLE m (id INT, outcome TEXT, reason TEXT)")
    con.execute("CREATE TABLE i (id INT, outcome TEXT, reason TEXT)")
    con.execute("CREATE TABLE c (id INT)")
    con.execute("CREATE TABLE n (id INT)")
    for k, (meta, img, dup) in enumerate(combos):
        con.execute("INSERT INTO m VALUES (?, ?, ?)", [k, *meta])
        if img is not None:
            con.execute("INSERT INTO i VALUES (?, ?, ?)", [k, *img])
        if dup[0]:
            con.execute("INSERT INTO c VALUES (?)", [k])
        if dup[1]:
            con.execute("INSERT INTO n VALUES (?)", [k])
    sql = (
        f"SELECT m.id, {outcome_rules.sql_case('outcome')}, {outcome_rules.sql_case('reason')} "
        "FROM m LEFT JOIN i ON i.id = m.id LEFT JOIN c ON c.id = m.id "
        "LEFT JOIN n ON n.id = m.id ORDER BY m.id"
    )
    by_sql = [(o, r) for _, o, r in con.execute(sql).fetchall()]
    facts = {
        "metadata.outcome": np.array([m[0] for m, _, _ in combos], object),
        "metadata.reason": np.array([m[1] for m, _, _ in combos], object),
        "images.has": np.array([i is not None for _, i, _ in combos]),
        "images.outcome": np.array([i[0] if i else None for _, i, _ in combos], object),
        "images.reason": np.array([i[1] if i else None for _, i, _ in combos], object),
        "content_duplicate": np.array([d[0] for _, _, d in combos]),
        "near_duplicate": np.array([d[1] for _, _, d in combos]),
    }
    outcome, reason = outcome_rules.select(facts)
    assert list(zip(outcome, reason)) == by_sql
    # and the rules say what they should, on a few rows by hand
    got = dict(zip(combos, by_sql))
    assert got[(META[1], IMAGES[1], (True, True))] == ("filtered", "too_small")  # the metadata's
    assert got[(META[0], None, (False, True))] == ("pending", None)
    assert got[(META[0], IMAGES[1], (True, False))] == ("filtered", "duplicate_content")
    # bytes equal beats look-alike: a content duplicate is one whatever its pHash says
    assert got[(META[0], IMAGES[1], (True, True))] == ("filtered", "duplicate_content")
    assert got[(META[0], IMAGES[1], (False, True))] == ("filtered", "near_duplicate")
    assert got[(META[0], IMAGES[2], (False, False))] == ("failed", "timeout")
    assert {o for o, _ in by_sql} <= set(outcome_rules.OUTCOMES)


def test_no_second_copy_of_an_outcome_rule_in_the_catalog():
    """The literals only the rules produce appear in no other catalog file as a rule would
    write them (a CASE branch, a numpy choice): a copy planted in views.py or derived.py fails
    here."""
    planted = re.compile(
        r"""THEN\s+'(pending|duplicate_content|near_duplicate)'|["'](pending|duplicate_content|near_duplicate)["']\s*[,)]"""
    )
    folder = REPO / "flowmatch_assets" / "catalog"
    copies = {
        f.name: found
        for f in folder.glob("*.py")
        if f.name != "outcome_rules.py" and (found := planted.findall(f.read_text()))
    }
    assert not copies, copies


def test_the_catalogs_retryable_is_the_ingest_rule_on_every_reason_and_status():
    """Which failures `flowmatch retry` fetches again (ingest.is_retryable) and what the
    catalog's ``retryable`` column says (views.py's macro) come from one pair of tables
    (``RETRYABLE``, ``RETRYABLE_HTTP``): they agree on every reason and every HTTP status, and
    no file writes the rule a second time (a copy of a reason list or a status pattern)."""
    from flowmatch_assets.catalog.views import _retryable_sql
    from flowmatch_assets.ingest.images import REASONS, RETRYABLE, RETRYABLE_HTTP, is_retryable

    reasons = [*sorted(REASONS), *(f"http_{c}" for c in range(100, 600)), None, ""]
    reasons += ["http_5", "http_5000", "xhttp_503", "http_503x", "HTTP_503"]
    con = duckdb.connect()
    con.execute(f"CREATE MACRO retryable(r) AS {_retryable_sql('r')}")
    by_sql = [con.execute("SELECT retryable(?)", [r]).fetchone()[0] for r in reasons]
    assert by_sql == [is_retryable(r) for r in reasons]
    assert {r for r, ok in zip(reasons, by_sql) if ok} == RETRYABLE | {
        f"http_{c}" for c in [*range(500, 600), 408, 429]
    }
    planted = re.compile(r"""["']connection_error["']\s*,\s*["']|http_\(?5""")
    copies = {
        str(f.relative_to(REPO)): found
        for f in (REPO / "flowmatch_assets").rglob("*.py")
        if (f.name != "images.py" or f.parent.name != "ingest")
        and (found := planted.findall(f.read_text()))
    }
    assert not copies, copies
    assert RETRYABLE_HTTP.startswith("http_(5")  # what the planted pattern looks for
