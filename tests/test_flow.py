"""Flow matching and REPA: the loss learns a known distribution; REPA's gradients go where they should."""

from __future__ import annotations

import pytest
import torch

from flowmatch_models.model.dit import build_model
from flowmatch_models.model.flow import FlowMatching, null_caption, sample

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread


@pytest.fixture()
def batch() -> dict:
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[2:, 3:] = False
    return {
        "x": torch.randn(4, 32, 8, 8, generator=g),
        "text": torch.randn(4, 6, 640, generator=g) * mask[..., None],
        "mask": mask,
        "dino": torch.randn(4, 64, 384, generator=g),
    }


def test_gaussian_clusters_are_learned_and_sampled() -> None:
    """Per-caption Gaussians N(mu_c, sigma^2): Euler samples recover each mean and the spread."""
    torch.manual_seed(0)
    n_cap, sigma = 3, 0.3
    g = torch.Generator().manual_seed(1)
    mu = torch.randn(n_cap, 32, generator=g)  # per-caption, per-channel means
    text = torch.randn(n_cap, 4, 640, generator=g)
    mask = torch.ones(n_cap, 4, dtype=torch.bool)
    model = build_model("tiny")
    fm = FlowMatching(repa_lambda=0.0, caption_dropout=0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / 200)
    for _ in range(200):
        c = torch.randint(0, n_cap, (32,), generator=g)
        x = mu[c][:, :, None, None] + sigma * torch.randn(32, 32, 8, 8, generator=g)
        loss = fm.loss(model, x, text[c], mask[c], generator=g)["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    model.eval()
    n = 96
    for c in range(n_cap):
        z = fm.sample(
            model,
            text[c : c + 1].expand(n, -1, -1),
            mask[c : c + 1].expand(n, -1),
            steps=16,
            cfg_scale=1.0,
            generator=g,
        )
        mean = z.mean(dim=(0, 2, 3))
        std = z.transpose(0, 1).reshape(32, -1).std(dim=1)
        assert (mean - mu[c]).abs().mean() < 0.04, (mean - mu[c]).abs()
        assert (mean - mu[c]).abs().max() < 0.12
        # the spread matches sigma (slightly under-dispersed after 200 steps: ~0.87 sigma)
        assert 0.75 * sigma < std.mean() < 1.15 * sigma, std.mean()
        # and samples are nearer their own caption's mean than any other caption's
        d = ((mean[None] - mu) ** 2).sum(1)
        assert d.argmin() == c


def test_lambda_zero_is_plain_flow_matching(batch: dict) -> None:
    torch.manual_seed(0)
    model = build_model("tiny", init="default")  # a non-zero output, so the comparison can fail
    fm = FlowMatching(repa_lambda=0.0, caption_dropout=0.0)
    out = fm.loss(
        model,
        batch["x"],
        batch["text"],
        batch["mask"],
        batch["dino"],
        generator=torch.Generator().manual_seed(5),
    )
    # the same draws by hand: t first, then the noise
    g = torch.Generator().manual_seed(5)
    t = torch.sigmoid(torch.randn(4, generator=g))
    e = torch.randn(batch["x"].shape, generator=g)
    x_t = (1 - t.view(4, 1, 1, 1)) * batch["x"] + t.view(4, 1, 1, 1) * e
    v = model.transformer(x_t, batch["text"], t * 1000, encoder_attention_mask=batch["mask"]).sample
    plain = ((v - (e - batch["x"])) ** 2).mean()
    torch.testing.assert_close(out["loss"], plain)
    assert out["repa"] == 0 and out["loss"] == out["fm"]
    assert out["bin_count"].sum() == 4
    with_repa = FlowMatching(repa_lambda=0.5, caption_dropout=0.0).loss(
        model,
        batch["x"],
        batch["text"],
        batch["mask"],
        batch["dino"],
        generator=torch.Generator().manual_seed(5),
    )
    torch.testing.assert_close(with_repa["fm"], out["fm"])
    torch.testing.assert_close(with_repa["loss"], with_repa["fm"] + 0.5 * with_repa["repa"])


@pytest.mark.parametrize("checkpointing", [False, True])
def test_repa_gradients_reach_projector_and_blocks_up_to_k_only(
    batch: dict, checkpointing: bool
) -> None:
    torch.manual_seed(0)
    # PyTorch's default init: Sana's zero-initialised output would leave the blocks without
    # gradient on the very first step, which is not what this test is about
    model = build_model("tiny", repa_encoder_depth=2, init="default")
    if checkpointing:  # the hook must also see block k under gradient checkpointing
        model.transformer.enable_gradient_checkpointing()
    fm = FlowMatching(repa_lambda=0.5, caption_dropout=0.0)
    out = fm.loss(model, batch["x"], batch["text"], batch["mask"], batch["dino"])
    out["repa"].backward()

    def grad_norm(module: torch.nn.Module) -> float:
        return sum(float(p.grad.abs().sum()) for p in module.parameters() if p.grad is not None)

    blocks = model.transformer.transformer_blocks
    assert grad_norm(model.projector) > 0
    assert grad_norm(blocks[0]) > 0 and grad_norm(blocks[1]) > 0
    assert grad_norm(model.transformer.patch_embed) > 0
    assert grad_norm(blocks[2]) == 0 and grad_norm(blocks[3]) == 0
    assert grad_norm(model.transformer.proj_out) == 0
    # and the full loss trains every block
    model.zero_grad()
    fm.loss(model, batch["x"], batch["text"], batch["mask"], batch["dino"])["loss"].backward()
    assert all(grad_norm(b) > 0 for b in blocks)


def test_caption_dropout_is_the_null_caption(batch: dict) -> None:
    fm = FlowMatching(caption_dropout=1.0)
    text, mask = fm.drop_captions(batch["text"], batch["mask"])
    null_text, null_mask = null_caption(4)
    assert not text.any() and mask[:, 0].all() and not mask[:, 1:].any()
    torch.manual_seed(0)
    model = build_model("tiny", init="default").eval()
    x, t = torch.randn(4, 32, 8, 8), torch.rand(4)
    with torch.no_grad():  # padded null == one-token null: masked tokens carry no weight
        torch.testing.assert_close(model(x, t, text, mask)[0], model(x, t, null_text, null_mask)[0])


def test_stored_null_caption_is_what_dropout_and_cfg_use(batch: dict) -> None:
    """The encoded empty prompt (2 tokens here) replaces dropped captions and is CFG's input."""
    g = torch.Generator().manual_seed(3)
    null_tokens = torch.randn(2, 640, generator=g)
    fm = FlowMatching(caption_dropout=1.0, null_text=null_tokens)
    text, mask = fm.drop_captions(batch["text"], batch["mask"])
    torch.testing.assert_close(text[:, :2], null_tokens.expand(4, -1, -1))
    assert not text[:, 2:].any() and mask[:, :2].all() and not mask[:, 2:].any()
    one = torch.randn(4, 1, 640, generator=g)  # captions shorter than the null caption: padded
    t1, m1 = fm.drop_captions(one, torch.ones(4, 1, dtype=torch.bool))
    assert t1.shape == (4, 2, 640) and m1.all()
    torch.manual_seed(0)
    model = build_model("tiny", init="default").eval()
    noise = torch.randn(4, 32, 8, 8, generator=g)
    ours = fm.sample(model, batch["text"], batch["mask"], steps=3, cfg_scale=3.0, noise=noise)
    null = null_caption(4, tokens=null_tokens)
    explicit = sample(model, batch["text"], batch["mask"], null, 3, 3.0, noise=noise)
    zero = sample(model, batch["text"], batch["mask"], None, 3, 3.0, noise=noise)
    torch.testing.assert_close(ours, explicit)
    assert (ours - zero).abs().max() > 1e-3  # the null caption matters under CFG


def test_sana_init_and_positional_embedding() -> None:
    torch.manual_seed(0)
    model = build_model("small")
    tr = model.transformer
    assert torch.all(tr.caption_norm.weight == 0.01)
    assert not tr.proj_out.weight.any() and not tr.proj_out.bias.any()
    assert all(not b.attn2.to_out[0].weight.any() for b in tr.transformer_blocks)
    std = tr.time_embed.emb.timestep_embedder.linear_1.weight.std().item()
    assert abs(std - 0.02) < 0.002
    assert abs(tr.caption_projection.linear_1.weight.std().item() - 0.02) < 0.002
    w = tr.transformer_blocks[0].attn1.to_q.weight  # xavier-uniform bound sqrt(6/(in+out))
    bound = (6 / (w.shape[0] + w.shape[1])) ** 0.5
    assert w.abs().max() <= bound and w.abs().max() > 0.95 * bound
    for preset in ("tiny", "small", "base"):
        from flowmatch_models.model.dit import transformer_config

        assert transformer_config(preset)["interpolation_scale"] == 1  # PE on everywhere
    assert tr.patch_embed.pos_embed.shape == (1, 64, 384)
    assert build_model("tiny", pos_embed=False).transformer.patch_embed.pos_embed is None
    # REPA counts blocks from 1; with REPA off there is no head (DDP needs no unused params)
    assert model.encoder_depth == 4 and build_model("base", repa=False).projector is None
    with pytest.raises(ValueError, match="outside 1..4"):
        build_model("tiny", repa_encoder_depth=5)


def test_sampler_integrates_a_known_velocity_field() -> None:
    """With the exact velocity of a point mass at m (v = (x_t - m) / t), Euler lands on m."""
    m = torch.randn(1, 32, 8, 8)

    class PointMass(torch.nn.Module):
        config = build_model("tiny").transformer.config

        def forward(self, hidden_states, encoder_hidden_states, timestep, **kw):
            t = (timestep / 1000).view(-1, 1, 1, 1)
            return ((hidden_states - m) / t,)

    cond, mask = null_caption(2)
    out = sample(PointMass(), cond, mask, steps=10, cfg_scale=3.0)
    torch.testing.assert_close(out, m.expand(2, -1, -1, -1), atol=1e-5, rtol=0)


def test_caption_standardisation_folds_into_a_plain_sana_transformer(batch: dict) -> None:
    """model.text_norm: the training model standardises caption states per channel; the folded
    copy (what sampling, evaluation and the export run) gives the same velocity on raw states."""
    from flowmatch_models.model.dit import fold_text_norm

    torch.manual_seed(0)
    model = build_model("tiny", init="default").eval()
    text = batch["text"] * 20 + torch.linspace(-30, 30, batch["text"].shape[-1])  # huge channels
    x, t, mask = batch["x"], torch.full((4,), 0.3), batch["mask"]
    plain, _ = model(x, t, text, mask)
    mean, std = text.flatten(0, 1).mean(0), text.flatten(0, 1).std(0)
    model.set_text_stats(mean, std)
    normed, _ = model(x, t, text, mask)
    assert (normed - plain).abs().max() > 1e-3  # it changes what the model sees
    z = (text - mean) / std
    by_hand = model.transformer(x, z, t * 1000, encoder_attention_mask=mask).sample
    torch.testing.assert_close(normed, by_hand, atol=1e-5, rtol=1e-4)
    folded = fold_text_norm(model.transformer, model.text_norm())
    raw = folded(x, text, t * 1000, encoder_attention_mask=mask).sample
    torch.testing.assert_close(raw, normed, atol=1e-4, rtol=1e-4)
    assert type(folded) is type(model.transformer) and folded is not model.transformer
    assert fold_text_norm(model.transformer, None) is model.transformer


# --- timestep sampling by name, and the flow config made of FlowMatching's fields -------------


def _mode_t(u: torch.Tensor, s: float) -> torch.Tensor:
    """SD3 paper eq. 20, f_mode(u; s) = 1 - u - s (cos^2(pi u / 2) - 1 + u) (decreasing in u)."""
    return 1 - u - s * (torch.cos(torch.pi * u / 2) ** 2 - 1 + u)


_Q = torch.tensor([0.05, 0.25, 0.5, 0.75, 0.95], dtype=torch.float64)
_PHI = torch.distributions.Normal(0.0, 1.0).icdf(_Q)  # standard-normal quantiles


@pytest.mark.parametrize(
    "settings, quantiles, mean",
    [
        # logit-normal: the q-quantile is sigmoid(t_mean + t_std * Phi^-1(q)), then the shift
        ({"t_mean": 0.5, "t_std": 0.8}, torch.sigmoid(0.5 + 0.8 * _PHI), None),
        ({"train_shift": 3.0}, (3 * torch.sigmoid(_PHI)) / (1 + 2 * torch.sigmoid(_PHI)), None),
        ({"t_sampling": "uniform"}, _Q, 0.5),
        # uniform shifted by 3: s q / (1 + (s - 1) q)
        ({"t_sampling": "uniform", "train_shift": 3.0}, 3 * _Q / (1 + 2 * _Q), None),
        # mode: t = f(u) with f decreasing, so t's q-quantile is f(1 - q); its mean is 1/2 for
        # every s (the integral of cos^2(pi u / 2) over [0, 1] is 1/2)
        ({"t_sampling": "mode", "mode_scale": 1.29}, _mode_t(1 - _Q, 1.29), 0.5),
        ({"t_sampling": "mode", "mode_scale": -0.5}, _mode_t(1 - _Q, -0.5), 0.5),
    ],
    ids=[
        "logit_normal",
        "logit_normal_shift3",
        "uniform",
        "uniform_shift3",
        "mode1.29",
        "mode-0.5",
    ],
)
def test_each_timestep_sampler_draws_its_closed_form(settings, quantiles, mean) -> None:
    t = FlowMatching(**settings).sample_t(200_000, torch.Generator().manual_seed(0)).double()
    assert 0 <= t.min() and t.max() <= 1
    torch.testing.assert_close(torch.quantile(t, _Q), quantiles, atol=4e-3, rtol=0)
    if mean is not None:
        assert abs(t.mean().item() - mean) < 3e-3


def test_mode_sampling_puts_mass_on_the_middle_and_scale_zero_is_uniform() -> None:
    g = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    mid = lambda t: ((t > 0.25) & (t < 0.75)).double().mean().item()  # noqa: E731
    m = FlowMatching(t_sampling="mode", mode_scale=1.29).sample_t(100_000, g())
    u = FlowMatching(t_sampling="uniform").sample_t(100_000, g())
    # closed form: P(0.25 < t < 0.75) = u1 - u0 where f_mode(u0) = 0.75, f_mode(u1) = 0.25; with
    # s = 1.29 (root finding) u0 = 0.13363, u1 = 0.86637: 0.7327 against the uniform's 0.5
    u0, u1 = 0.13362675083888964, 0.8663732491611104
    assert _mode_t(torch.tensor([u0, u1]), 1.29).tolist() == pytest.approx([0.75, 0.25])
    assert mid(u) == pytest.approx(0.5, abs=0.004) and mid(m) == pytest.approx(u1 - u0, abs=0.004)
    zero = FlowMatching(t_sampling="mode", mode_scale=0.0).sample_t(1000, g())
    torch.testing.assert_close(zero, 1 - FlowMatching(t_sampling="uniform").sample_t(1000, g()))


def test_logit_normal_is_the_old_sample_t_bit_for_bit() -> None:
    """The default draws exactly what the single-`shift` code drew for the same generator."""
    for mean, std, shift in ((0.0, 1.0, 1.0), (0.3, 0.7, 3.0)):
        fm = FlowMatching(t_mean=mean, t_std=std, train_shift=shift)
        assert fm.t_sampling == "logit_normal"
        new = fm.sample_t(4096, torch.Generator().manual_seed(7))
        z = torch.randn(4096, generator=torch.Generator().manual_seed(7)) * std + mean
        old = shift * torch.sigmoid(z) / (1 + (shift - 1) * torch.sigmoid(z))  # the old code
        assert torch.equal(new, old)
    # recorded from the code before t_sampling (commit 14e72c7), seed 0
    g = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    assert FlowMatching().sample_t(3, g()).tolist() == [
        0.823609471321106,
        0.42716464400291443,
        0.10167144984006882,
    ]
    assert FlowMatching(t_mean=0.3, t_std=0.7, train_shift=3.0).sample_t(3, g()).tolist() == [
        0.9225358366966248,
        0.767315149307251,
        0.46840712428092957,
    ]


def test_flow_config_is_made_of_flow_matchings_fields() -> None:
    """FlowConfig and FlowMatching read one list (FlowSettings): same names, same defaults; a
    config's flow section builds the FlowMatching the module trains with."""
    from dataclasses import fields

    from flowmatch_models.model.flow_settings import FlowSettings
    from flowmatch_models.train.config import FlowConfig

    runtime = {"null_text"}  # set by the run, not configured
    names = [f.name for f in fields(FlowMatching) if f.name not in runtime]
    assert list(FlowConfig.model_fields) == names == [f.name for f in fields(FlowSettings)]
    assert {"t_sampling", "mode_scale", "train_shift", "sample_shift"} <= set(names)
    defaults = FlowMatching()
    for name, info in FlowConfig.model_fields.items():
        assert info.default == getattr(defaults, name), name
        assert info.description, f"flow.{name} has no description"
    assert FlowMatching(**FlowConfig().model_dump()) == defaults
    with pytest.raises(ValueError, match="unknown t_sampling 'cosine'; known: "):
        FlowMatching(t_sampling="cosine")


def test_flow_config_chooses_the_sampler_and_names_the_shifts_apart() -> None:
    from flowmatch_models.train.config import ConfigError, load_config

    repo = __import__("pathlib").Path(__file__).resolve().parents[1]
    cfg = load_config(repo / "configs" / "tiny.yaml", ["flow.t_sampling=mode", "flow.mode_scale=1"])
    assert (cfg.flow.t_sampling, cfg.flow.mode_scale) == ("mode", 1.0)
    fm = FlowMatching(**cfg.flow.model_dump())
    u = torch.rand(5, generator=torch.Generator().manual_seed(1))
    expected = 3 * _mode_t(u, 1.0) / (1 + 2 * _mode_t(u, 1.0))  # tiny.yaml's train_shift 3
    torch.testing.assert_close(fm.sample_t(5, torch.Generator().manual_seed(1)), expected)
    with pytest.raises(ConfigError, match=r"^--set flow.t_sampling: Input should be 'logit_nor"):
        load_config({}, ["flow.t_sampling=cosine"])
    with pytest.raises(ConfigError, match=r"^--set flow.mode_scale: Input should be less than"):
        load_config({}, ["flow.mode_scale=2"])  # f_mode is no longer monotone: t leaves [0, 1]
    apart = load_config({"flow": {"train_shift": 3.0, "sample_shift": 1.5}}).flow
    assert (apart.train_shift, apart.sample_shift) == (3.0, 1.5)


def test_an_old_config_with_shift_loads_to_the_same_values(tmp_path) -> None:
    """A config, request or --set from before the split: `shift` sets both shifts, so an old
    run resumes unchanged (docs/training.md)."""
    import yaml

    from flowmatch_models.train.config import load_config

    repo = __import__("pathlib").Path(__file__).resolve().parents[1]
    new = yaml.safe_load((repo / "configs" / "tiny.yaml").read_text())
    old = {
        **new,
        "flow": {
            k: v
            for k, v in new["flow"].items()
            if k not in ("t_sampling", "mode_scale", "train_shift", "sample_shift")
        },
    }
    old["flow"]["shift"] = 3.0  # the tiny.yaml of before: t_mean, t_std, shift, ...
    (tmp_path / "old.yaml").write_text(yaml.safe_dump(old))
    loaded = load_config(tmp_path / "old.yaml")
    assert loaded == load_config(repo / "configs" / "tiny.yaml")
    assert (loaded.flow.train_shift, loaded.flow.sample_shift) == (3.0, 3.0)
    assert load_config({}, ["flow.shift=2"]).flow.sample_shift == 2.0  # --set flow.shift too
    given = load_config({"flow": {"shift": 2.0, "sample_shift": 1.0}}).flow  # a named one wins
    assert (given.train_shift, given.sample_shift) == (2.0, 1.0)
