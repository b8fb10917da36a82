"""An input row's final outcome, as one table of rules that yields both the catalog's SQL (the
``dataset_rows`` view: ``views.py``) and the data card's numpy (``derived.py``), so the two can
never say different things about the same row.

The first rule whose condition holds decides the row's ``outcome`` and ``reason``. A rule's
values name a stage's own record (``("metadata", "outcome")``: the metadata stage's outcome
of the row) or are literals. The conditions read five facts of a row: its metadata record's
outcome, whether the image stage has a record of it, whether it lost to an earlier row with
the same bytes (a content duplicate), whether it lost to an earlier look-alike (a near
duplicate: ``ingest/neardup.py``), and the image stage's record.

A new outcome rule (a near-duplicate filter, say) is one :class:`Rule` here, in its place in
:data:`RULES`; ``tests/test_outcome_rules.py`` checks that SQL and numpy agree on every
combination of the facts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: A value: a literal, None, or ``(stage, column)`` of that stage's record of the row.
Value = str | None | tuple[str, str]
#: The SQL alias of each stage's record (and of the content duplicates) in ``dataset_rows``.
SQL_ALIAS = {"metadata": "m", "images": "i", "content_duplicate": "c", "near_duplicate": "n"}


@dataclass(frozen=True)
class Rule:
    """When ``condition`` holds (and no rule before it did): ``outcome`` and ``reason``."""

    condition: str  # a key of CONDITIONS
    outcome: Value
    reason: Value


#: The conditions: (SQL over the aliases, the facts' numpy expression).
CONDITIONS = {
    "metadata_did_not_keep": (
        "m.outcome != 'stored'",
        lambda f: f["metadata.outcome"] != "stored",
    ),
    "images_not_run": ("i.id IS NULL", lambda f: ~f["images.has"]),
    "content_duplicate": ("c.id IS NOT NULL", lambda f: f["content_duplicate"]),
    "near_duplicate": ("n.id IS NOT NULL", lambda f: f["near_duplicate"]),
    "always": ("TRUE", lambda f: np.ones(len(f["images.has"]), bool)),
}

#: The rules, in order (the first that holds decides).
RULES: tuple[Rule, ...] = (
    Rule("metadata_did_not_keep", ("metadata", "outcome"), ("metadata", "reason")),
    Rule("images_not_run", "pending", None),
    Rule("content_duplicate", "filtered", "duplicate_content"),
    Rule("near_duplicate", "filtered", "near_duplicate"),
    Rule("always", ("images", "outcome"), ("images", "reason")),
)

#: Every final outcome a row can have.
OUTCOMES = ("stored", "filtered", "failed", "pending")


def _sql_value(v: Value) -> str:
    if v is None:
        return "NULL"
    if isinstance(v, tuple):
        return f"{SQL_ALIAS[v[0]]}.{v[1]}"
    return "'" + v.replace("'", "''") + "'"


def sql_case(column: str) -> str:
    """``CASE WHEN ... END`` of ``column`` (``outcome`` or ``reason``) by :data:`RULES`, over
    the aliases of :data:`SQL_ALIAS`."""
    whens = " ".join(
        f"WHEN {CONDITIONS[r.condition][0]} THEN {_sql_value(getattr(r, column))}"
        for r in RULES
        if r.condition != "always"
    )
    last = next(r for r in RULES if r.condition == "always")
    return f"CASE {whens} ELSE {_sql_value(getattr(last, column))} END"


def select(facts: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """``(outcome, reason)`` arrays by :data:`RULES` over ``facts``: ``metadata.outcome``,
    ``metadata.reason``, ``images.has``, ``images.outcome``, ``images.reason`` and
    ``content_duplicate`` and ``near_duplicate`` (one entry per row)."""
    conds = [np.asarray(CONDITIONS[r.condition][1](facts), bool) for r in RULES]
    n = len(facts["images.has"])

    def values(column: str) -> list[np.ndarray]:
        out = []
        for r in RULES:
            v = getattr(r, column)
            out.append(
                np.asarray(facts[f"{v[0]}.{v[1]}"], object)
                if isinstance(v, tuple)
                else np.full(n, v, object)
            )
        return out

    outcome = np.select(conds, values("outcome"), default=None)
    reason = np.select(conds, values("reason"), default=None)
    return outcome, reason
