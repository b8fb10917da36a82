"""Denoising Diffusion Probabilistic Models (Ho, Jain, Abbeel; NeurIPS 2020, arXiv:2006.11239).

The forward process of Sohl-Dickstein et al. with T = 1000 small fixed betas; the reverse
kernels have fixed variances and a mean parameterised through a noise predictor eps_theta
(Eq. 11), trained with the simplified loss L_simple (Eq. 14, Algorithm 1) and sampled by
ancestral sampling (Algorithm 2). The variational bound L_vlb (Eq. 5) is evaluated on held-out
data: in bits/dim on digits with the discretised decoder (Eq. 13), in nats on 2-D data with a
Gaussian decoder.

    python examples/ddpm.py --data digits   # or swissroll, moons, 8gaussians

Writes examples/out/ddpm-<data>/{metrics.json, samples.png}.
"""

from __future__ import annotations

import argparse
import math
import os
import time
import warnings

import lightning as L
import torch
from torch import nn

# isort: split
import data as datasets  # examples/data.py
import metrics  # examples/metrics.py

T = 1000  # Sec. 4: T = 1000, beta_1 = 1e-4 ... beta_T = 0.02 linearly


def timestep_embedding(t: torch.Tensor, dim: int = 64) -> torch.Tensor:
    freqs = torch.exp(-math.log(10_000) * torch.arange(dim // 2) / (dim // 2))
    args = t[:, None].float() * freqs[None]
    return torch.cat([args.cos(), args.sin()], -1)


class MLP(nn.Module):
    """eps_theta(x_t, t, y): a residual MLP; time and class enter every block."""

    def __init__(self, dim: int, hidden: int, depth: int, num_classes: int = 0):
        super().__init__()
        self.inp = nn.Linear(dim, hidden)
        self.t_emb = nn.Sequential(nn.Linear(64, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        self.y_emb = nn.Embedding(num_classes, hidden) if num_classes else None
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.LayerNorm(hidden),
                nn.Linear(hidden, hidden),
                nn.SiLU(),
                nn.Linear(hidden, hidden),
            )
            for _ in range(depth)
        )
        self.out = nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, dim))

    def forward(self, x, t, y=None):
        c = self.t_emb(timestep_embedding(t))
        if self.y_emb is not None:
            c = c + self.y_emb(y)
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h + c)
        return self.out(h)


def normal_cdf(x):
    return 0.5 * (1 + torch.erf(x / math.sqrt(2)))


class DDPM(L.LightningModule):
    def __init__(self, dim, num_classes, hidden, depth, lr, steps):
        super().__init__()
        self.save_hyperparameters()
        self.eps = MLP(dim, hidden, depth, num_classes)
        self.num_classes = num_classes
        beta = torch.linspace(1e-4, 0.02, T, dtype=torch.float64)
        ab = torch.cumprod(1 - beta, 0)
        ab_prev = torch.cat([torch.ones(1, dtype=torch.float64), ab[:-1]])
        for name, v in {
            "beta": beta,  # index t - 1 holds beta_t
            "alpha": 1 - beta,
            "alpha_bar": ab,
            # Eq. 7: q(x_{t-1} | x_t, x_0) = N(mu_tilde, beta_tilde I)
            "beta_tilde": (1 - ab_prev) / (1 - ab) * beta,
            "coef_x0": ab_prev.sqrt() * beta / (1 - ab),
            "coef_xt": (1 - beta).sqrt() * (1 - ab_prev) / (1 - ab),
        }.items():
            self.register_buffer(name, v.float())

    def _at(self, name, t):  # schedule value for integer times t (1..T), shaped to broadcast
        return getattr(self, name)[t - 1][:, None]

    def training_step(self, batch, _):
        # Algorithm 1: x_0 ~ q(x_0), t ~ U{1..T}, eps ~ N(0, I), and a gradient step on
        # Eq. 14: L_simple = E || eps - eps_theta(sqrt(abar_t) x_0 + sqrt(1 - abar_t) eps, t) ||^2
        x0, y = batch
        t = torch.randint(1, T + 1, (len(x0),))
        eps = torch.randn_like(x0)
        ab = self._at("alpha_bar", t)
        xt = ab.sqrt() * x0 + (1 - ab).sqrt() * eps
        loss = (eps - self.eps(xt, t, y if self.num_classes else None)).pow(2).mean()
        self.log("L_simple", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.0)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, self.hparams.steps)
        return [opt], [{"scheduler": sched, "interval": "step"}]

    # --- the reverse process p_theta(x_{t-1} | x_t) = N(mu_theta, sigma_t^2 I) -----------------

    def p_mean(self, xt, t, y=None):
        """Eq. 11: mu_theta = (x_t - beta_t / sqrt(1 - abar_t) eps_theta(x_t, t)) / sqrt(alpha_t)."""
        b, ab, a = self._at("beta", t), self._at("alpha_bar", t), self._at("alpha", t)
        return (xt - b / (1 - ab).sqrt() * self.eps(xt, t, y)) / a.sqrt()

    def sigma2(self, t):
        """Sec. 3.2: sigma_t^2 = beta_tilde_t (the second of the paper's two choices); at t = 1,
        where beta_tilde_1 = 0, the decoder uses beta_1."""
        return torch.where(t[:, None] > 1, self._at("beta_tilde", t), self._at("beta", t))

    @torch.no_grad()
    def sample(self, n, y=None):
        """Algorithm 2: x_T ~ N(0, I); x_{t-1} = mu_theta(x_t, t) + sigma_t z, z = 0 at t = 1."""
        x = torch.randn(n, self.hparams.dim)
        for t in range(T, 0, -1):
            tt = torch.full((n,), t)
            x = self.p_mean(x, tt, y)
            if t > 1:
                x = x + self.sigma2(tt).sqrt() * torch.randn_like(x)
        return x

    # --- the variational bound (Eq. 5) on held-out data ---------------------------------------

    @torch.no_grad()
    def vlb(self, x0, y=None, discrete=True):
        """Per example, in nats: L_vlb = L_T + sum_{t=2}^T L_{t-1} + L_0 (Eq. 5), with
        L_T = KL(q(x_T | x_0) || N(0, I)), L_{t-1} = KL(q(x_{t-1} | x_t, x_0) || p_theta(x_{t-1} | x_t))
        at one draw x_t ~ q(x_t | x_0) per term, and L_0 = -log p_theta(x_0 | x_1): the
        discretised Gaussian decoder of Eq. 13 (bins of the 17 pixel levels, edges at +-1 open)
        on digits, a Gaussian density on 2-D data."""
        n, d = x0.shape
        total = torch.zeros(n)
        for t in range(2, T + 1):
            tt = torch.full((n,), t)
            ab = self._at("alpha_bar", tt)
            xt = ab.sqrt() * x0 + (1 - ab).sqrt() * torch.randn_like(x0)
            mu_q = self._at("coef_x0", tt) * x0 + self._at("coef_xt", tt) * xt
            var_q, var_p = self._at("beta_tilde", tt), self.sigma2(tt)
            mu_p = self.p_mean(xt, tt, y)
            kl = 0.5 * (var_p.log() - var_q.log() + (var_q + (mu_q - mu_p) ** 2) / var_p - 1)
            total += kl.sum(-1)
        abT = self.alpha_bar[-1]
        total += 0.5 * (abT * x0.pow(2) + (1 - abT) - 1 - (1 - abT).log()).sum(-1)  # L_T
        one = torch.ones(n, dtype=torch.long)
        ab1 = self._at("alpha_bar", one)
        x1 = ab1.sqrt() * x0 + (1 - ab1).sqrt() * torch.randn_like(x0)
        mu, sd = self.p_mean(x1, one, y), self.sigma2(one).sqrt()
        if discrete:  # Eq. 13: integral of N(mu, sd^2) over the pixel's bin
            h = datasets.DIGIT_BIN / 2
            upper = torch.where(x0 > 1 - 1e-3, torch.ones_like(x0), normal_cdf((x0 + h - mu) / sd))
            lower = torch.where(
                x0 < -1 + 1e-3, torch.zeros_like(x0), normal_cdf((x0 - h - mu) / sd)
            )
            total += -(upper - lower).clamp_min(1e-12).log().sum(-1)  # L_0
        else:
            total += -torch.distributions.Normal(mu, sd).log_prob(x0).sum(-1)  # L_0
        return total


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", choices=datasets.DATASETS, default="digits")
    p.add_argument(
        "--steps", type=int, default=None, help="training steps (default: 5000 2-D, 10000 digits)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="examples/out")
    p.add_argument("--n-samples", type=int, default=None, help="default: 2000 2-D, 1000 digits")
    args = p.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    L.seed_everything(args.seed)

    data = datasets.load(args.data)
    img = data.is_image
    steps = args.steps or (10_000 if img else 5_000)
    n = args.n_samples or (1000 if img else 2000)
    model = DDPM(
        data.dim, data.num_classes, hidden=256 if img else 128, depth=3, lr=1e-3, steps=steps
    )
    trainer = L.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        log_every_n_steps=50,
    )
    t0 = time.time()
    # digits: the 17 levels as they are (the discretised decoder models them)
    trainer.fit(model, datasets.loader(data, 128 if img else 256))
    train_s = time.time() - t0

    model.eval()
    labels = metrics.eval_labels(data, n)
    t0 = time.time()
    samples = model.sample(n, labels)
    sample_s = time.time() - t0
    m = {
        "example": "ddpm",
        "data": args.data,
        "seed": args.seed,
        "steps": steps,
        "train_seconds": round(train_s, 1),
        "sample_seconds": round(sample_s, 1),
        "sampling_steps": T,
        "sampler": "ancestral (Algorithm 2), sigma_t^2 = beta_tilde_t",
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    m |= metrics.evaluate(samples, labels, data)
    t0 = time.time()
    if img:
        m |= metrics.digits_bits_per_dim(-model.vlb(data.x_test, data.y_test).mean().item(), data)
        m["likelihood"] = (
            "L_vlb (Eq. 5), discretised decoder (Eq. 13), no dequantisation, class-conditional"
        )
    else:
        m["nll_bound_nats"] = model.vlb(data.x_test, discrete=False).mean().item()
        m["likelihood"] = "L_vlb (Eq. 5) with a Gaussian decoder, nats per held-out example"
    m["likelihood_seconds"] = round(time.time() - t0, 1)
    out = os.path.join(args.out, f"ddpm-{args.data}")
    metrics.write(out, m)
    title = f"DDPM (eps-prediction, L_simple), {args.data}, {steps} steps, T={T} ancestral steps"
    metrics.plot(os.path.join(out, "samples.png"), title, samples, labels, data)


if __name__ == "__main__":
    main()
