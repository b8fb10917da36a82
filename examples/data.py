"""The examples' data, all offline: three 2-D toy sets and scikit-learn's 8x8 handwritten digits.

- ``swissroll``, ``moons``, ``8gaussians``: 10,000 training and 2,000 held-out points drawn once
  with a fixed data seed (the model seed does not change the data), standardised per coordinate
  with the training mean and std.
- ``digits``: ``sklearn.datasets.load_digits`` (1,797 real 8x8 images, shipped with
  scikit-learn), pixel values 0..16 scaled to [-1, 1] as 64-d vectors (17 levels, bin width 1/8),
  split 1,437 train / 360 held-out, stratified by class.

Also the baselines every example is compared with: a Gaussian fitted to the training data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from sklearn.datasets import load_digits, make_moons, make_swiss_roll
from sklearn.model_selection import train_test_split

DATASETS = ("swissroll", "moons", "8gaussians", "digits")
DIGIT_BIN = 2 / 16  # width of one of the 17 pixel levels after scaling 0..16 to [-1, 1]


@dataclass
class Data:
    name: str
    x_train: torch.Tensor  # (n, dim) float32
    x_test: torch.Tensor  # held out: never trained on
    y_train: torch.Tensor | None = None  # class labels (digits only)
    y_test: torch.Tensor | None = None
    num_classes: int = 0  # 0: unconditional 2-D data

    @property
    def dim(self) -> int:
        return self.x_train.shape[1]

    @property
    def is_image(self) -> bool:
        return self.name == "digits"


def _toy_2d(name: str, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if name == "swissroll":
        x, _ = make_swiss_roll(n, noise=0.5, random_state=seed)
        return x[:, [0, 2]]
    if name == "moons":
        x, _ = make_moons(n, noise=0.05, random_state=seed)
        return x
    if name == "8gaussians":
        angles = np.arange(8) * math.pi / 4
        centres = 2.0 * np.stack([np.cos(angles), np.sin(angles)], 1)
        return centres[rng.integers(0, 8, n)] + 0.1 * rng.standard_normal((n, 2))
    raise ValueError(f"unknown 2-D data set {name!r}; choose from {DATASETS}")


def load(name: str, n_train: int = 10_000, n_test: int = 2_000, data_seed: int = 0) -> Data:
    if name == "digits":
        x, y = load_digits(return_X_y=True)
        x_tr, x_te, y_tr, y_te = train_test_split(
            x, y, test_size=360, stratify=y, random_state=data_seed
        )

        def f(a):
            return torch.tensor(a / 8.0 - 1.0, dtype=torch.float32)

        return Data(name, f(x_tr), f(x_te), torch.tensor(y_tr), torch.tensor(y_te), 10)
    x = _toy_2d(name, n_train + n_test, data_seed)
    mean, std = x[:n_train].mean(0), x[:n_train].std(0)
    x = torch.tensor((x - mean) / std, dtype=torch.float32)
    return Data(name, x[:n_train], x[n_train:])


class RandomBatches(torch.utils.data.IterableDataset):
    """Endless random minibatches drawn from tensors in memory (training stops at --steps)."""

    def __init__(self, data: Data, batch_size: int, dequantise: bool = False):
        self.x, self.y, self.batch_size, self.dequantise = (
            data.x_train,
            data.y_train,
            batch_size,
            dequantise,
        )

    def __iter__(self):
        while True:
            i = torch.randint(0, len(self.x), (self.batch_size,))
            x = self.x[i]
            if self.dequantise:  # uniform noise within each pixel's bin (Theis et al. 2016)
                x = x + DIGIT_BIN * (torch.rand_like(x) - 0.5)
            y = self.y[i] if self.y is not None else torch.zeros(len(i), dtype=torch.long)
            yield x, y


def loader(data: Data, batch_size: int, dequantise: bool = False):
    return torch.utils.data.DataLoader(RandomBatches(data, batch_size, dequantise), batch_size=None)


# --- the fitted-Gaussian baseline ---------------------------------------------------------------


def fit_gaussian(x: torch.Tensor, jitter: float = 1e-4):
    """Maximum-likelihood mean and covariance (plus a small jitter for rank-deficient data)."""
    x = x.double()
    mean = x.mean(0)
    cov = torch.cov(x.T, correction=0).reshape(x.shape[1], x.shape[1])
    return torch.distributions.MultivariateNormal(mean, cov + jitter * torch.eye(x.shape[1]))


def gaussian_samples(data: Data, labels: torch.Tensor | None, n: int) -> torch.Tensor:
    """Samples of the baseline: one Gaussian (2-D) or one Gaussian per class (digits)."""
    if labels is None:
        return fit_gaussian(data.x_train).sample((n,)).float()
    out = torch.empty(len(labels), data.dim)
    for c in range(data.num_classes):
        g = fit_gaussian(data.x_train[data.y_train == c], jitter=1e-2)
        out[labels == c] = g.sample((int((labels == c).sum()),)).float()
    return out


def gaussian_nll_nats(data: Data) -> float:
    """Held-out negative log-likelihood (nats per example) of the Gaussian fitted to train."""
    return -fit_gaussian(data.x_train).log_prob(data.x_test.double()).mean().item()


def gaussian_bits_per_dim(data: Data, seed: int = 0) -> float:
    """Digits: an upper bound on the Gaussian's held-out bits/dim under uniform dequantisation.

    log P(x) >= E_u log p(x + u) + D log(bin) for u uniform in the pixel's bin (Jensen), so
    -(log p(x + u) + D log bin) / (D ln 2) bounds the discrete model's bits/dim from above.
    """
    g = torch.Generator().manual_seed(seed)

    def deq(x):
        return (x + DIGIT_BIN * (torch.rand(x.shape, generator=g) - 0.5)).double()

    logp = fit_gaussian(deq(data.x_train), jitter=0.0).log_prob(deq(data.x_test)).mean().item()
    return -(logp + data.dim * math.log(DIGIT_BIN)) / (data.dim * math.log(2))


def pixel_histogram_bits_per_dim(data: Data) -> float:
    """Digits: held-out bits/dim of independent per-pixel histograms (add-one smoothing)."""
    levels_tr = ((data.x_train + 1) * 8).round().long()
    levels_te = ((data.x_test + 1) * 8).round().long()
    counts = torch.ones(data.dim, 17)
    counts.scatter_add_(1, levels_tr.T, torch.ones_like(levels_tr.T, dtype=torch.float))
    logp = (counts / counts.sum(1, keepdim=True)).log2()
    return -logp.gather(1, levels_te.T).mean().item()
