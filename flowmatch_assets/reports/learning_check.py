"""Did a run on the demo domain learn? The floors, in one place, that two checks apply:

- ``flowmatch demo`` (tiny.yaml's full schedule, 2,000 steps) checks its own last checkpoint
  against :data:`FULL` and says so in its output; a demo that did not learn exits 1;
- ``tests/test_learning.py`` (a short schedule, 500 steps, in CI) checks :data:`SHORT`.

Accuracy floors are multiples of an attribute's chance (``caption_eval.CHANCE``): a model that
ignores the caption scores chance. Shape needs the full schedule (the demo: 0.54 at step 2,000,
0.08-0.15 at 500). The held-out signals must fall between the first and the last checkpoint
measured: FD-DINOv2 to at most :data:`FD_FALL` of the first, the validation loss below it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flowmatch_assets.reports.caption_eval import CHANCE
from flowmatch_assets.reports.evaluation import ATTRIBUTES


@dataclass(frozen=True)
class Floors:
    """Minimum accuracies as multiples of chance; ``all_four``: all four attributes right in
    one image, as a multiple of the product of their chances."""

    name: str
    times_chance: dict[str, float] = field(default_factory=dict)
    all_four: float = 10.0


#: What a short schedule (500 steps of tiny.yaml on 256 images) must reach: measured there,
#: colour 0.94, size 0.83, position 0.92, all four 0.10 (BENCHMARKS.md, Learning).
SHORT = Floors("500 steps", {"colour": 4.0, "size": 1.2, "position": 1.8})
#: What the demo's full schedule must reach (README's table: 1.00, 0.54, 0.94, 0.98 at 2,000).
FULL = Floors("tiny.yaml's 2,000 steps", {**SHORT.times_chance, "shape": 2.0})
#: The last FD-DINOv2 measured must be at most this fraction of the first.
FD_FALL = 0.8


def shortfalls(
    accuracy: dict[str, float],
    floors: Floors,
    fd: tuple[float, float] | None = None,
    val_loss: tuple[float, float] | None = None,
) -> list[str]:
    """Each floor the run did not reach, as a line (``shape 0.20 < 0.33 (2x chance)``);
    ``[]`` when it learned. ``accuracy``: attribute -> fraction right (``all_four`` among
    them); ``fd`` and ``val_loss``: (first, last) of the checkpoints measured."""
    out = []
    for attr, times in floors.times_chance.items():
        want, got = times * CHANCE[attr], accuracy.get(attr)
        if got is None or got < want:
            out.append(f"{attr} {_f(got)} < {want:.2f} ({times:g}x chance)")
    chance4 = 1.0
    for attr in ATTRIBUTES:  # the evaluation's all-four: these four right in one image
        chance4 *= CHANCE[attr]
    want, got = floors.all_four * chance4, accuracy.get("all_four")
    if got is None or got < want:
        out.append(f"all four {_f(got)} < {want:.3f} ({floors.all_four:g}x chance)")
    if fd is not None and not fd[1] <= FD_FALL * fd[0]:
        out.append(f"FD-DINOv2 {fd[0]:.2f} -> {fd[1]:.2f} (not <= {FD_FALL:g}x the first)")
    if val_loss is not None and not val_loss[1] < val_loss[0]:
        out.append(f"validation loss {val_loss[0]:.4f} -> {val_loss[1]:.4f} (did not fall)")
    return out


def _f(x: float | None) -> str:
    return "missing" if x is None else f"{x:.2f}"


def run_shortfalls(cat, run: str, floors: Floors) -> tuple[int | None, list[str]]:
    """:func:`shortfalls` of ``run``'s last evaluated checkpoint, from the catalog (``cat``: a
    ``catalog.Catalog``): its 256x256 accuracies, the first and last FD-DINOv2 and validation
    losses recorded. ``(None, [...])`` when nothing was evaluated."""
    rows = cat.query(
        "SELECT step, attribute, accuracy FROM evaluations WHERE run = ? AND "
        "coalesce(size, '256x256') = '256x256' AND step = (SELECT max(step) FROM evaluations "
        "WHERE run = ?)",
        [run, run],
    )
    if not rows:
        return None, [f"run {run!r} has no evaluation in the catalog"]
    acc = {r["attribute"]: r["accuracy"] for r in rows}
    fd = [r["fd_dinov2"] for r in cat.query(_SERIES.format("fd_dinov2", "fd_dinov2", ""), [run])]
    val = [r["loss"] for r in cat.query(_SERIES.format("loss", "validation", _ALL_T), [run])]
    pair = lambda xs: (xs[0], xs[-1]) if len(xs) >= 2 else None  # noqa: E731
    return rows[0]["step"], shortfalls(acc, floors, pair(fd), pair(val))


_SERIES = "SELECT {0} FROM {1} WHERE run = ? {2} ORDER BY step"
_ALL_T = "AND t_bin = -1"  # the validation loss over every timestep bin
