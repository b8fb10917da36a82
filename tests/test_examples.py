"""The three paper examples (examples/*.py) learn, on a short schedule: each runs as a subprocess
on one 2-D data set and on the digits, and its metrics.json must show it: on 2-D an energy
distance to held-out data below half the fitted Gaussian's (and a likelihood that beats it, for
the two that optimise one), on digits a classifier accuracy far above chance with every class
drawn, and nearest-neighbour distances that rule out copies of the training set.

The schedules are short (800 steps) so that all six runs take under 3 minutes on 2 CPU cores
(140 s measured); the README's table comes from the full runs (examples/README.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_example(tmp_path: Path, example: str, data: str, steps: int, *extra: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    cmd = [sys.executable, str(REPO / "examples" / f"{example}.py"), "--data", data]
    cmd += ["--steps", str(steps), "--seed", "0", "--out", str(tmp_path), *extra]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = tmp_path / f"{example}-{data}"
    assert (out / "samples.png").stat().st_size > 10_000
    return json.loads((out / "metrics.json").read_text())


def check_2d(m: dict) -> None:
    # samples are much closer to held-out data than samples of the fitted Gaussian are
    assert m["energy_distance"] < 0.5 * m["energy_distance_gaussian"], m
    assert m["energy_distance_train_vs_heldout"] < m["energy_distance"] + 1e-3  # the floor


def check_digits(m: dict) -> None:
    # a classifier trained on real digits recognises the asked-for class (chance: 0.1)
    assert m["classifier_accuracy"] > 0.6, m
    assert min(m["class_histogram"]) > 0.3 * m["n_samples"] / 10  # no class missing
    # new digits, not copies: as far from the training set as held-out digits are (or further)
    assert 0.7 < m["nn_ratio"] < 2.5, m
    assert m["nn_min_samples"] > 0.25 * m["nn_min_heldout"], m


@pytest.mark.parametrize(
    ("example", "data"),
    [("flow_matching", "8gaussians"), ("nonequilibrium", "swissroll"), ("ddpm", "moons")],
)
def test_example_learns_2d(tmp_path, example, data):
    m = run_example(tmp_path, example, data, 800, "--n-samples", "1000")
    check_2d(m)
    if example == "flow_matching":  # the exact ODE likelihood beats the Gaussian's
        assert m["nll_nats"] < m["nll_gaussian_nats"] - 0.2, m
    elif example == "nonequilibrium":  # so does the bound K (Eq. 14)
        assert m["nll_bound_nats"] < m["nll_gaussian_nats"], m
        assert abs(m["nll_bound_nats"] - m["nll_bound_exact_edges_nats"]) < 0.05, m
    else:  # L_vlb (Eq. 5) bounds the NLL from above; on a short schedule it is only finite
        assert 0 < m["nll_bound_nats"] < 10, m


@pytest.mark.parametrize("example", ["flow_matching", "nonequilibrium", "ddpm"])
def test_example_learns_digits(tmp_path, example):
    m = run_example(tmp_path, example, "digits", 800, "--n-samples", "500")
    check_digits(m)
    assert 0 < m["bits_per_dim"] < 8, m
