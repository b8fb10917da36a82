"""How the examples show that they learn: numbers against held-out data and a Gaussian baseline.

- ``energy_distance``: 2 E|X - Y| - E|X - X'| - E|Y - Y'| (Szekely & Rizzo), zero iff the two
  distributions are equal; between model samples and held-out data, next to the same number for
  samples of a Gaussian fitted to the training data and for fresh training data (the floor).
- digits: a logistic-regression classifier trained on the real training images labels the
  class-conditional samples (accuracy; chance is 0.1), the class histogram of its labels, and the
  nearest-neighbour distance of each sample to the training set against the same distance for the
  held-out images (``nn_ratio`` near 1: as close as new real digits are; near 0: copies), and a
  classifier two-sample test (a quadratic logistic regression's accuracy at telling samples from held-out
  digits; 0.5 is indistinguishable). On digits the per-class Gaussian is a strong baseline for
  the linear classifier and for the energy distance in 64-d; the two-sample test and the
  likelihood are where it falls behind.
"""

from __future__ import annotations

import json
import math
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from sklearn.linear_model import LogisticRegression  # noqa: E402
from sklearn.model_selection import StratifiedKFold, cross_val_score  # noqa: E402

# isort: split
from data import (  # noqa: E402
    Data,
    gaussian_bits_per_dim,
    gaussian_nll_nats,
    gaussian_samples,
    pixel_histogram_bits_per_dim,
)


def energy_distance(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    n, m = len(x), len(y)
    xy = torch.cdist(x, y).mean()
    xx = torch.cdist(x, x).sum() / (n * (n - 1))
    yy = torch.cdist(y, y).sum() / (m * (m - 1))
    return (2 * xy - xx - yy).item()


def c2st(samples: torch.Tensor, labels: torch.Tensor, data: Data) -> float:
    """Classifier two-sample test (Lopez-Paz & Oquab 2017): 5-fold accuracy of a logistic
    regression on (x, x^2) at telling 36 samples per class from the 360 held-out digits.
    0.5: indistinguishable to it; digits with noise of std 0.5 added score ~0.94."""
    per = len(data.x_test) // data.num_classes
    s = torch.cat([samples[labels == c][:per] for c in range(data.num_classes)])
    x = torch.cat([s, data.x_test]).numpy()
    x = np.concatenate([x, x**2], 1)
    y = np.r_[np.zeros(len(s)), np.ones(len(data.x_test))]
    cv = StratifiedKFold(5, shuffle=True, random_state=0)
    return float(cross_val_score(LogisticRegression(max_iter=5000), x, y, cv=cv).mean())


def quantise(x: torch.Tensor) -> torch.Tensor:
    """Digits: to the nearest of the 17 pixel levels (a dequantised model's discrete sample)."""
    return ((x.clamp(-1, 1) + 1) * 8).round() / 8 - 1


def eval_labels(data: Data, n: int) -> torch.Tensor | None:
    """The classes to sample: n // 10 of each digit, or None for unconditional 2-D data."""
    return torch.arange(data.num_classes).repeat_interleave(n // 10) if data.is_image else None


def evaluate(samples: torch.Tensor, labels: torch.Tensor | None, data: Data) -> dict:
    """Sample-quality metrics of ``samples`` (drawn for ``labels``) and of the Gaussian baseline."""
    samples = samples.float()
    gauss = gaussian_samples(data, labels, len(samples))
    if data.is_image:  # all three models are models of the discrete 17-level digits
        samples, gauss = quantise(samples), quantise(gauss)
    idx = torch.randperm(len(data.x_train))[: len(data.x_test)]
    m = {
        "energy_distance": energy_distance(samples, data.x_test),
        "energy_distance_gaussian": energy_distance(gauss, data.x_test),
        "energy_distance_train_vs_heldout": energy_distance(data.x_train[idx], data.x_test),
        "n_samples": len(samples),
    }
    if not data.is_image:
        m["nll_gaussian_nats"] = gaussian_nll_nats(data)
        return m
    clf = LogisticRegression(max_iter=5000).fit(data.x_train.numpy(), data.y_train.numpy())
    pred = clf.predict(samples.numpy())
    nn_s = torch.cdist(samples, data.x_train).min(1).values
    nn_h = torch.cdist(data.x_test, data.x_train).min(1).values
    nn_g = torch.cdist(gauss, data.x_train).min(1).values
    m |= {
        "classifier_accuracy": float((pred == labels.numpy()).mean()),
        "classifier_accuracy_gaussian": float(
            (clf.predict(gauss.numpy()) == labels.numpy()).mean()
        ),
        "classifier_accuracy_real_heldout": float(
            clf.score(data.x_test.numpy(), data.y_test.numpy())
        ),
        "class_histogram": np.bincount(pred, minlength=10).tolist(),
        "c2st_accuracy": c2st(samples, labels, data),
        "c2st_accuracy_gaussian": c2st(gauss, labels, data),
        "c2st_accuracy_train": c2st(data.x_train[: len(labels)], data.y_train[: len(labels)], data),
        "nn_median_samples": nn_s.median().item(),
        "nn_median_heldout": nn_h.median().item(),
        "nn_ratio": (nn_s.median() / nn_h.median()).item(),
        "nn_ratio_gaussian": (nn_g.median() / nn_h.median()).item(),
        "nn_min_samples": nn_s.min().item(),
        "nn_min_heldout": nn_h.min().item(),
    }
    return m


def digits_bits_per_dim(log_p_discrete: float, data: Data) -> dict:
    """Bits/dim from a (bound on the) class-conditional discrete log-probability log P(x | y).

    The unconditional model P(x) = sum_y P(y) P(x | y) with P(y) = 1/10 has log P(x) >=
    log P(x | y) - log 10, so its bits/dim are at most log2(10) / 64 = 0.052 above: that number
    is the one to compare with the (unconditional) baselines.
    """
    bpd = -log_p_discrete / (data.dim * math.log(2))
    return {
        "bits_per_dim_given_class": bpd,
        "bits_per_dim": bpd + math.log2(10) / data.dim,
        "bits_per_dim_gaussian": gaussian_bits_per_dim(data),
        "bits_per_dim_pixel_histogram": pixel_histogram_bits_per_dim(data),
    }


def write(out_dir: str, metrics: dict) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=2)
    print(json.dumps(metrics, indent=2))


def _grid(x: torch.Tensor, rows: int) -> np.ndarray:
    """(rows * cols, 64) in [-1, 1] -> one image with a 1-pixel gap between the 8x8 digits."""
    x = x.clamp(-1, 1).reshape(rows, -1, 8, 8).numpy()
    cols = x.shape[1]
    img = np.zeros((rows * 9 + 1, cols * 9 + 1))  # grey lines between digits
    for r in range(rows):
        for c in range(cols):
            img[1 + 9 * r : 9 * r + 9, 1 + 9 * c : 9 * c + 9] = x[r, c]
    return img


def plot(
    path: str, title: str, samples, labels, data: Data, trajectory=None, times=None, dpi=90
) -> None:
    """Held-out data next to samples (and, given one, the trajectory from noise to data)."""
    n_panels = 3 if trajectory is not None else 2
    fig, axes = plt.subplots(1, n_panels, figsize=(4 * n_panels, 4.3))
    if data.is_image:
        per = 10
        real = torch.cat([data.x_test[data.y_test == c][:per] for c in range(10)])
        fake = torch.cat([samples[labels == c][:per] for c in range(10)])
        axes[0].imshow(-_grid(real, 10), cmap="gray", vmin=-1, vmax=1)
        axes[0].set_title("held-out digits (a row per class)")
        axes[1].imshow(-_grid(fake, 10), cmap="gray", vmin=-1, vmax=1)
        axes[1].set_title("samples (row c: class c asked for)")
        if trajectory is not None:  # (len(times), n, 64): first sample of each class over time
            first = torch.stack([(labels == c).nonzero()[0, 0] for c in range(10)])
            traj = trajectory[:, first].transpose(0, 1).reshape(-1, data.dim)
            axes[2].imshow(-_grid(traj, 10), cmap="gray", vmin=-1, vmax=1)
            axes[2].set_title("t = " + ", ".join(f"{t:.2g}" for t in times))
        for a in axes:
            a.axis("off")
    else:
        lim = (-3, 3)
        kw = dict(s=2, alpha=0.5, lw=0)
        axes[0].scatter(*data.x_test.T, c="tab:blue", **kw)
        axes[0].set_title(f"held-out data ({len(data.x_test)})")
        axes[1].scatter(*samples.T, c="tab:orange", **kw)
        axes[1].set_title(f"samples ({len(samples)})")
        if trajectory is not None:  # (len(times), n, 2)
            k = min(400, trajectory.shape[1])
            for i in range(k):
                axes[2].plot(*trajectory[:, i].T, c="k", lw=0.3, alpha=0.3)
            axes[2].scatter(*trajectory[0, :k].T, c="tab:gray", s=3, label="t=0 (noise)")
            axes[2].scatter(*trajectory[-1, :k].T, c="tab:orange", s=3, label="t=1 (data)")
            axes[2].legend(loc="lower right", fontsize=8)
            axes[2].set_title("ODE trajectories, noise -> data")
        for a in axes:
            a.set_xlim(*lim)
            a.set_ylim(*lim)
            a.set_aspect("equal")
            a.set_xticks([])
            a.set_yticks([])
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
