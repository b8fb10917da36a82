"""Flow Matching for Generative Modeling (Lipman, Chen, Ben-Hamu, Nickel, Le; ICLR 2023,
arXiv:2210.02747), with the optimal-transport conditional path and sigma_min.

A network v_theta(x, t) is regressed onto the velocity of a simple per-sample path from noise
x0 ~ N(0, I) at t = 0 to a data point x1 at t = 1; sampling integrates the learned ODE
dx/dt = v_theta(x, t) from t = 0 to 1, and the exact log-likelihood follows from the same ODE by
the instantaneous change of variables (Chen et al. 2018).

    python examples/flow_matching.py --data 8gaussians   # or swissroll, moons, digits

Writes examples/out/flow_matching-<data>/{metrics.json, samples.png}.
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

SIGMA_MIN = 1e-4  # sigma_min: the std of the path's end point around x1 (Sec. 4)


def timestep_embedding(t: torch.Tensor, dim: int = 64) -> torch.Tensor:
    """Sinusoidal embedding of a (continuous) time; t in [0, 1] is scaled by 1000."""
    freqs = torch.exp(-math.log(10_000) * torch.arange(dim // 2) / (dim // 2))
    args = 1000 * t[:, None] * freqs[None]
    return torch.cat([args.cos(), args.sin()], -1)


class MLP(nn.Module):
    """v_theta(x, t, y): a residual MLP; time (and the digit class) enter every block."""

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


class FlowMatching(L.LightningModule):
    def __init__(self, dim, num_classes, hidden, depth, lr, steps):
        super().__init__()
        self.save_hyperparameters()
        self.v = MLP(dim, hidden, depth, num_classes)
        self.num_classes = num_classes

    def training_step(self, batch, _):
        x1, y = batch  # data
        x0 = torch.randn_like(x1)  # noise, p_0 = N(0, I)
        t = torch.rand(len(x1))
        s = SIGMA_MIN
        # Eq. 20: mu_t(x1) = t x1, sigma_t(x1) = 1 - (1 - sigma_min) t  (the OT path), so
        # Eq. 22: psi_t(x0) = (1 - (1 - sigma_min) t) x0 + t x1 is the flow that pushes N(0, I) to
        #         N(mu_t, sigma_t^2 I), and its velocity d/dt psi_t(x0) = x1 - (1 - sigma_min) x0
        #         is Eq. 21's u_t(x | x1) = (x1 - (1 - sigma_min) x) / (1 - (1 - sigma_min) t).
        xt = (1 - (1 - s) * t[:, None]) * x0 + t[:, None] * x1
        target = x1 - (1 - s) * x0
        # Eq. 23: L_CFM = E_{t, q(x1), p(x0)} || v_t(psi_t(x0)) - (x1 - (1 - sigma_min) x0) ||^2
        loss = (self.v(xt, t, y if self.num_classes else None) - target).pow(2).sum(-1).mean()
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.0)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, self.hparams.steps)
        return [opt], [{"scheduler": sched, "interval": "step"}]

    # --- sampling: Euler on the ODE dx/dt = v_theta(x, t) (Eq. 1), from t = 0 to t = 1 ---------

    @torch.no_grad()
    def sample(self, n, y=None, nfe=100, keep=()):
        """Euler with ``nfe`` steps; also returns x at the step indices in ``keep``."""
        x = torch.randn(n, self.hparams.dim)
        kept = [x] if 0 in keep else []
        for i in range(nfe):
            t = torch.full((n,), i / nfe)
            x = x + self.v(x, t, y) / nfe
            if i + 1 in keep:
                kept.append(x)
        return x, kept

    # --- likelihood: the instantaneous change of variables, exact divergence -----------------

    def log_likelihood(self, x1, y=None, steps=100):
        """log p_1(x1) = log p_0(x(0)) - int_0^1 div v_theta(x(t), t) dt, with x(t) solving the
        ODE backwards from x(1) = x1 (RK4, ``steps`` steps); the divergence is the exact trace
        of the Jacobian (one autograd pass per dimension: cheap in 2-D)."""

        def f(t, x):
            with torch.enable_grad():
                x = x.detach().requires_grad_(True)
                v = self.v(x, torch.full((len(x),), t), y)
                div = sum(
                    torch.autograd.grad(v[:, i].sum(), x, retain_graph=True)[0][:, i]
                    for i in range(x.shape[1])
                )
            return v.detach(), div.detach()

        x, int_div, h = x1.clone(), torch.zeros(len(x1)), 1.0 / steps
        for k in range(steps):  # from t = 1 down to t = 0 (dt = -h)
            t = 1.0 - k * h
            v1, d1 = f(t, x)
            v2, d2 = f(t - h / 2, x - h / 2 * v1)
            v3, d3 = f(t - h / 2, x - h / 2 * v2)
            v4, d4 = f(t - h, x - h * v3)
            x = x - h / 6 * (v1 + 2 * v2 + 2 * v3 + v4)
            int_div = int_div + h / 6 * (d1 + 2 * d2 + 2 * d3 + d4)
        log_p0 = -0.5 * (x.pow(2).sum(-1) + x.shape[1] * math.log(2 * math.pi))
        return log_p0 - int_div


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", choices=datasets.DATASETS, default="8gaussians")
    p.add_argument(
        "--steps", type=int, default=None, help="training steps (default: 5000 2-D, 10000 digits)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="examples/out")
    p.add_argument("--nfe", type=int, default=100, help="Euler steps when sampling")
    p.add_argument("--n-samples", type=int, default=None, help="default: 2000 2-D, 1000 digits")
    args = p.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    L.seed_everything(args.seed)

    data = datasets.load(args.data)
    img = data.is_image
    steps = args.steps or (10_000 if img else 5_000)
    n = args.n_samples or (1000 if img else 2000)
    model = FlowMatching(
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
    keep = [0, args.nfe // 4, args.nfe // 2, 3 * args.nfe // 4, args.nfe]
    samples, traj = model.sample(n, labels, args.nfe, keep=keep if img else range(args.nfe + 1))
    sample_s = time.time() - t0
    m = {
        "example": "flow_matching",
        "data": args.data,
        "seed": args.seed,
        "steps": steps,
        "train_seconds": round(train_s, 1),
        "sample_seconds": round(sample_s, 1),
        "sampling_steps": args.nfe,
        "sampler": "Euler ODE",
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    m |= metrics.evaluate(samples, labels, data)
    # how many ODE steps it needs: energy distance with fewer Euler steps
    q = metrics.quantise if img else (lambda x: x)
    m["energy_distance_by_nfe"] = {
        k: metrics.energy_distance(q(model.sample(n, labels, k)[0]), data.x_test)
        for k in (2, 5, 10, 20, 50)
    }
    t0 = time.time()
    with torch.no_grad():
        if img:  # a bound on the digits' bits/dim: dequantise, then log P >= log p + D log bin
            x = data.x_test + datasets.DIGIT_BIN * (torch.rand_like(data.x_test) - 0.5)
            logp = model.log_likelihood(x, data.y_test, steps=20).mean().item()
            m |= metrics.digits_bits_per_dim(logp + data.dim * math.log(datasets.DIGIT_BIN), data)
            m["likelihood"] = (
                "exact ODE likelihood (RK4, 20 steps, exact 64-d divergence) of uniformly "
                "dequantised held-out digits, class-conditional"
            )
        else:
            m["nll_nats"] = -model.log_likelihood(data.x_test, steps=50).mean().item()
            m["likelihood"] = "exact: RK4 ODE (50 steps), exact 2-D divergence, held-out data"
    m["likelihood_seconds"] = round(time.time() - t0, 1)
    out = os.path.join(args.out, f"flow_matching-{args.data}")
    metrics.write(out, m)
    trajectory = torch.stack(traj)
    times = [k / args.nfe for k in keep]
    title = f"Flow Matching (OT path, sigma_min={SIGMA_MIN}), {args.data}, {steps} steps, {args.nfe} Euler steps"
    metrics.plot(os.path.join(out, "samples.png"), title, samples, labels, data, trajectory, times)


if __name__ == "__main__":
    main()
