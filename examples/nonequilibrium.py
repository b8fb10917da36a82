"""Deep Unsupervised Learning using Nonequilibrium Thermodynamics (Sohl-Dickstein, Weiss,
Maheswaranathan, Ganguli; ICML 2015, arXiv:1503.03585): the first diffusion model.

A fixed forward diffusion slowly turns data into Gaussian noise (Sec. 2.1); a learned reverse
diffusion of Gaussian kernels, each with a learned mean *and* covariance, turns noise back into
data (Sec. 2.2); training maximises a lower bound K on the log-likelihood (Sec. 2.4, Eq. 14),
which is also the number reported on held-out data.

    python examples/nonequilibrium.py --data swissroll   # or moons, 8gaussians, digits

Writes examples/out/nonequilibrium-<data>/{metrics.json, samples.png}.
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

T = 100  # diffusion steps (the paper used 40 for its swiss roll)


def beta_schedule() -> torch.Tensor:
    """beta_1..beta_T, fixed (the paper learns it by gradient ascent on K; we keep it fixed)."""
    return torch.linspace(1e-4, 0.15, T)


def timestep_embedding(t: torch.Tensor, dim: int = 64) -> torch.Tensor:
    freqs = torch.exp(-math.log(10_000) * torch.arange(dim // 2) / (dim // 2))
    args = t[:, None].float() * freqs[None]
    return torch.cat([args.cos(), args.sin()], -1)


class MLP(nn.Module):
    """(x_t, t, y) -> (z_mu, z_Sigma), a residual MLP; time and class enter every block."""

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
        self.out = nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, 2 * dim))

    def forward(self, x, t, y=None):
        c = self.t_emb(timestep_embedding(t))
        if self.y_emb is not None:
            c = c + self.y_emb(y)
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h + c)
        return self.out(h).chunk(2, -1)


def gaussian_kl(mu_q, var_q, mu_p, var_p):
    """KL(N(mu_q, var_q) || N(mu_p, var_p)) for diagonal Gaussians, summed over dimensions."""
    return 0.5 * (var_p.log() - var_q.log() + (var_q + (mu_q - mu_p) ** 2) / var_p - 1).sum(-1)


class Nonequilibrium(L.LightningModule):
    def __init__(self, dim, num_classes, hidden, depth, lr, steps):
        super().__init__()
        self.save_hyperparameters()
        self.net = MLP(dim, hidden, depth, num_classes)
        self.num_classes = num_classes
        beta = beta_schedule()
        alpha_bar = torch.cumprod(1 - beta, 0)
        self.register_buffer("beta", beta)  # index t - 1 holds beta_t
        self.register_buffer("alpha_bar", alpha_bar)  # prod_{s <= t} (1 - beta_s)

    # --- the forward trajectory q (Sec. 2.1): fixed, Gaussian --------------------------
    # q(x_t | x_{t-1}) = N(x_t; x_{t-1} sqrt(1 - beta_t), beta_t I), hence in closed form
    # q(x_t | x_0) = N(x_t; sqrt(alpha_bar_t) x_0, (1 - alpha_bar_t) I) and the posterior
    # q(x_{t-1} | x_t, x_0) = N(mu_post, var_post I), whose KL to the reverse kernel Eq. 14 needs.

    def q_sample(self, x0, t):
        ab = self.alpha_bar[t - 1][:, None]
        return ab.sqrt() * x0 + (1 - ab).sqrt() * torch.randn_like(x0)

    def q_posterior(self, x0, xt, t):  # t >= 2
        b, ab, ab_prev = self.beta[t - 1], self.alpha_bar[t - 1], self.alpha_bar[t - 2]
        c0 = ab_prev.sqrt() * b / (1 - ab)
        ct = (1 - b).sqrt() * (1 - ab_prev) / (1 - ab)
        var = (1 - ab_prev) / (1 - ab) * b
        return c0[:, None] * x0 + ct[:, None] * xt, var[:, None].expand_as(x0)

    # --- the reverse trajectory p (Sec. 2.2): learned Gaussian kernels -------------------
    # p(x_{t-1} | x_t) = N(x_{t-1}; f_mu(x_t, t), f_Sigma(x_t, t)), a diagonal covariance. Both
    # are outputs of the network, written as a perturbation of the forward kernel:
    # f_mu = sqrt(1 - beta_t) x_t + sqrt(beta_t) z_mu,  f_Sigma = beta_t exp(z_Sigma).

    def p_mean_var(self, xt, t, y=None):
        z_mu, z_sigma = self.net(xt, t, y)
        b = self.beta[t - 1][:, None]
        return (1 - b).sqrt() * xt + b.sqrt() * z_mu, b * z_sigma.clamp(-12, 4).exp()

    def kl_term(self, x0, t, y=None):
        """E_q KL(q(x_{t-1} | x_t, x_0) || p(x_{t-1} | x_t)) at one draw of x_t (t >= 2)."""
        xt = self.q_sample(x0, t)
        mu_q, var_q = self.q_posterior(x0, xt, t)
        mu_p, var_p = self.p_mean_var(xt, t, y)
        return gaussian_kl(mu_q, var_q, mu_p, var_p)

    def training_step(self, batch, _):
        x0, y = batch
        t = torch.randint(2, T + 1, (len(x0),))
        # maximise K (Eq. 14): its only learned part is -sum_{t=2}^T E KL(...), estimated by one
        # uniformly drawn t per example times the number of terms (T - 1)
        loss = (T - 1) * self.kl_term(x0, t, y if self.num_classes else None).mean()
        self.log("-K (nats, minus constants)", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.0)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, self.hparams.steps)
        return [opt], [{"scheduler": sched, "interval": "step"}]

    # --- the bound K (Eq. 14) on held-out data -----------------------------------------------

    @torch.no_grad()
    def bound(self, x0, y=None):
        """Per example: K of Eq. 14, and the same bound with its edge terms computed exactly.

        K = -sum_{t=2}^T E_q KL(q(x_{t-1}|x_t,x_0) || p(x_{t-1}|x_t))
            + H_q(X_T | X_0) - H_q(X_1 | X_0) - H_p(X_T)
        uses the paper's choice for the last step (Appendix B): p(x_0 | x_1) is the forward kernel
        reversed under the stationary N(0, I), i.e. N(sqrt(1 - beta_1) x_1, beta_1 I), and it
        replaces two cross-entropies by entropies. Without those approximations the bound is
        L = E_q log p(x_0 | x_1) - sum_t E_q KL(...) - E_q KL(q(x_T | x_0) || N(0, I)) <= log p(x_0).
        """
        d, n = x0.shape[1], len(x0)
        kl_sum = torch.zeros(n)
        for t in range(2, T + 1):
            kl_sum += self.kl_term(x0, torch.full((n,), t), y)

        def entropy(var):  # of N(., var I) in d dimensions
            return 0.5 * d * (1 + math.log(2 * math.pi * var))

        b1, abT = self.beta[0].item(), self.alpha_bar[-1].item()
        K = -kl_sum + entropy(1 - abT) - entropy(b1) - entropy(1.0)
        x1 = self.q_sample(x0, torch.ones(n, dtype=torch.long))
        log_p01 = torch.distributions.Normal((1 - b1) ** 0.5 * x1, b1**0.5).log_prob(x0).sum(-1)
        kl_T = 0.5 * (abT * x0.pow(2).sum(-1) + d * (1 - abT) - d - d * math.log(1 - abT))
        return K, log_p01 - kl_sum - kl_T

    # --- sampling: run the reverse trajectory from x_T ~ N(0, I) ----------------------------

    @torch.no_grad()
    def sample(self, n, y=None):
        x = torch.randn(n, self.hparams.dim)  # p(x_T) = N(0, I)
        for t in range(T, 1, -1):
            mu, var = self.p_mean_var(x, torch.full((n,), t), y)
            x = mu + var.sqrt() * torch.randn_like(x)
        b1 = self.beta[0]
        return (1 - b1).sqrt() * x + b1.sqrt() * torch.randn_like(x)  # p(x_0 | x_1), Appendix B


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", choices=datasets.DATASETS, default="swissroll")
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
    model = Nonequilibrium(
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
    # digits: uniform dequantisation (noise within each pixel's 1/8 bin) so that a density exists
    trainer.fit(model, datasets.loader(data, 128 if img else 256, dequantise=img))
    train_s = time.time() - t0

    model.eval()
    labels = metrics.eval_labels(data, n)
    t0 = time.time()
    samples = model.sample(n, labels)
    sample_s = time.time() - t0
    m = {
        "example": "nonequilibrium",
        "data": args.data,
        "seed": args.seed,
        "steps": steps,
        "train_seconds": round(train_s, 1),
        "sample_seconds": round(sample_s, 1),
        "sampling_steps": T,
        "sampler": "reverse diffusion, learned Gaussian kernels",
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    m |= metrics.evaluate(samples, labels, data)
    t0 = time.time()
    if img:  # held-out digits, dequantised: log P(x | y) >= K(x + u) + D log bin
        x = data.x_test + datasets.DIGIT_BIN * (torch.rand_like(data.x_test) - 0.5)
        K, L_exact = model.bound(x, data.y_test)
        m |= metrics.digits_bits_per_dim(
            K.mean().item() + data.dim * math.log(datasets.DIGIT_BIN), data
        )
        m["bits_per_dim_exact_edges"] = metrics.digits_bits_per_dim(
            L_exact.mean().item() + data.dim * math.log(datasets.DIGIT_BIN), data
        )["bits_per_dim"]
        m["likelihood"] = (
            "bound K (Eq. 14) of uniformly dequantised held-out digits, class-conditional"
        )
    else:
        K, L_exact = model.bound(data.x_test)
        m["nll_bound_nats"] = -K.mean().item()  # -K >= -log p: an upper bound on the NLL
        m["nll_bound_exact_edges_nats"] = -L_exact.mean().item()
        m["likelihood"] = (
            "-K (Eq. 14) on held-out data, nats per example (an upper bound on the NLL)"
        )
    m["likelihood_seconds"] = round(time.time() - t0, 1)
    out = os.path.join(args.out, f"nonequilibrium-{args.data}")
    metrics.write(out, m)
    title = f"Sohl-Dickstein et al. 2015, {args.data}, {steps} steps, T={T} learned Gaussian reverse kernels"
    metrics.plot(os.path.join(out, "samples.png"), title, samples, labels, data)


if __name__ == "__main__":
    main()
