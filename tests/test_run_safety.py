"""A long run that cannot waste itself: non-finite steps never reach the weights, one step is
the same under every precision, the training step never waits on the device, checkpoints
follow a retention policy, a full disk stops the run cleanly. (The compiled model trains like
the eager one: tests/test_bucket_training.py, on aspect-ratio buckets.)"""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import Callback
from test_train import REPO, SIZES, _cli_run, make_store, read_records, tiny_config

from flowmatch_models.inference.sample import load_model
from flowmatch_models.storage.layout import DataLayout
from flowmatch_models.storage.store import read_shard, write_shard
from flowmatch_models.train.callbacks import DiskFullError
from flowmatch_models.train.module import NonFiniteStepsError
from flowmatch_models.train.run import TrainRequest, _fit, decide, main


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return make_store(tmp_path_factory.mktemp("safety_store"))


def fit_with(cfg: dict, callbacks: list[Callback]):
    """``train`` with extra Lightning callbacks (the test's probes) added to the trainer."""
    import lightning as L

    request, config = decide(TrainRequest(config=cfg, resume="auto"))
    real = L.Trainer.__init__

    def init(self, *a, **kw):
        kw["callbacks"] = [*callbacks, *kw.get("callbacks", [])]  # the probes' hooks first
        real(self, *a, **kw)

    with _patched(L.Trainer, "__init__", init):
        return _fit(request, config, None)


@contextlib.contextmanager
def _patched(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def _state(module) -> dict[str, torch.Tensor]:
    """Weights, EMA and Adam state (moments and step counts) as one flat dict of copies."""
    out = {f"w.{k}": v.detach().clone() for k, v in module.model.state_dict().items()}
    out.update({f"ema.{k}": v.detach().clone() for k, v in module.ema.state_dict().items()})
    opt = module.trainer.optimizers[0]
    for i, p in enumerate(module.model.parameters()):
        for k, v in opt.state.get(p, {}).items():
            out[f"adam.{i}.{k}"] = v.detach().clone()
    return out


class PoisonStep(Callback):
    """Puts NaN into the latents of micro-batch ``micro`` of optimizer step ``step`` (counted
    from 0) and snapshots the whole state before and after that step."""

    def __init__(self, step: int, micro: int, accumulate: int, every_step_after: bool = False):
        self.step, self.micro, self.accumulate = step, micro, accumulate
        self.every_after = every_step_after
        self.before = self.after = None
        self._k = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        micro = self._k % self.accumulate
        self._k += 1
        step = trainer.global_step
        if step == self.step and micro == 0:
            self.before = _state(pl_module)
        if (step == self.step and micro == self.micro) or (self.every_after and step >= self.step):
            batch["latents"][0, 0, 0, 0] = float("nan")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step + 1 and self.after is None:
            self.after = _state(pl_module)


def _finite(ckpt: dict) -> bool:
    tensors = [v for v in ckpt["state_dict"].values()]
    for state in ckpt.get("optimizer_states", []):
        for s in state["state"].values():
            tensors += [v for v in s.values() if isinstance(v, torch.Tensor)]
    return all(torch.isfinite(t.float()).all() for t in tensors)


def test_a_nan_batch_is_skipped_weights_adam_and_ema_untouched(store: Path, tmp_path: Path) -> None:
    out = tmp_path / "nan"
    cfg = tiny_config(store, out, trainer__max_steps=6, trainer__accumulate_grad_batches=2)
    probe = PoisonStep(step=3, micro=1, accumulate=2)
    result = fit_with(cfg, [probe])
    assert result.step == 6 and result.skipped_steps == 1
    before, after = probe.before, probe.after
    assert before is not None and after is not None and before.keys() == after.keys()
    assert any(k.startswith("adam.") for k in before)
    same = [k for k in before if torch.equal(before[k], after[k])]
    assert same == list(before), sorted(set(before) - set(same))[:5]  # nothing moved at step 4
    ckpt = torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)
    assert _finite(ckpt) and ckpt["flowmatch"]["skipped_steps"] == 1
    # the Adam step count is one behind the global step: the skipped step never counted
    steps = {int(s["step"]) for s in ckpt["optimizer_states"][0]["state"].values()}
    assert steps == {5} and ckpt["global_step"] == 6
    assert np.isfinite(result.metrics["loss"])


def test_consecutive_nan_steps_stop_the_run_with_one_line(store: Path, tmp_path: Path) -> None:
    out = tmp_path / "stop"
    cfg = tiny_config(
        store,
        out,
        trainer__max_steps=40,
        trainer__accumulate_grad_batches=1,
        trainer__max_skipped_steps=5,
        trainer__log_every=1,
        trainer__checkpoint_every=2,
    )
    with pytest.raises(NonFiniteStepsError) as e:
        fit_with(cfg, [PoisonStep(step=4, micro=0, accumulate=1, every_step_after=True)])
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("step 9: 5 consecutive optimizer steps from step 5 had non-finite")
    assert "weights, Adam state and EMA are as at step 4" in msg
    assert str(out / "checkpoints" / "last.ckpt") in msg
    ckpt = torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 8 and _finite(ckpt) and ckpt["flowmatch"]["skipped_steps"] == 4


def _poisoned_store(root: Path, bad_id: str) -> Path:
    """The test store with the latents of one sample set to NaN (a corrupt embedding)."""
    make_store(root)
    layout = DataLayout(root)
    part = bad_id.split("/")[0]
    path = layout.asset_path("vae_latents", part)
    shard = read_shard(path)
    lat = np.array(shard["latents"], dtype=np.float16)
    lat[shard.ids.index(bad_id)] = np.nan
    write_shard(path, {"latents": lat}, shard.ids, codec="none", attrs=dict(shard.attrs))
    return root


def test_ddp_ranks_skip_a_nan_on_one_rank_together(tmp_path: Path) -> None:
    """A NaN sample reaches one rank of two (gloo): the all-reduced gradient is non-finite on
    both, both skip the same step, and the final weights are finite and equal on both."""
    root = _poisoned_store(tmp_path / "store", "000-01/5")
    out = tmp_path / "ddp"
    cfg = tiny_config(
        root,
        out,
        trainer__devices=2,
        trainer__strategy="ddp",
        trainer__accelerator="cpu",
        trainer__max_steps=8,
        trainer__accumulate_grad_batches=1,
    )
    _cli_run(tmp_path, cfg, "run")  # python -m flowmatch_models.train, 2 gloo ranks
    seen = [
        (r, rec["step"]) for r in (0, 1) for rec in read_records(out, r) if "000-01/5" in rec["ids"]
    ]
    bad_steps = {step for _, step in seen}
    assert seen and len(bad_steps) == len(seen), seen  # each time on one rank only
    ckpt = torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)
    assert _finite(ckpt) and ckpt["flowmatch"]["skipped_steps"] == len(bad_steps)
    steps = {int(s["step"]) for s in ckpt["optimizer_states"][0]["state"].values()}
    assert steps == {8 - len(bad_steps)}  # both ranks' Adam skipped exactly those steps


class StepProbe(Callback):
    """The first optimizer step's gradient norm (as logged) and update of the transformer, and
    the loss scaler's scale at the end (16-mixed)."""

    def __init__(self):
        self.w0 = self.norm = self.update = self.scale = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.w0 is None:
            self.w0 = [p.detach().clone() for p in pl_module.model.transformer.parameters()]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.norm is None:
            self.norm = float(pl_module._grad_norm)
            now = pl_module.model.transformer.parameters()
            self.update = torch.cat([(p.detach() - w).flatten() for p, w in zip(now, self.w0)])

    def on_train_end(self, trainer, pl_module) -> None:
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.scale = scaler.get_scale() if scaler is not None else None


def _fp16_plugin(real_init):
    """``Trainer.__init__`` with ``precision="16-mixed"`` given as Lightning's own
    MixedPrecision plugin (fp16 autocast, a real ``torch.amp.GradScaler("cpu")``): the
    Trainer's flag falls back to bf16 on CPU, the plugin runs fp16 as on a GPU."""
    from lightning.pytorch.plugins import MixedPrecision

    def init(self, *a, **kw):
        if kw.get("precision") == "16-mixed":
            kw.pop("precision")
            kw["plugins"] = [*kw.get("plugins", []), MixedPrecision("16-mixed", "cpu")]
        real_init(self, *a, **kw)

    return init


def test_one_step_is_the_same_under_every_precision(store: Path, tmp_path: Path) -> None:
    """One optimizer step from the same seed under 32-true, bf16-mixed and 16-mixed: the same
    gradient norm (the true one, not multiplied by the loss scale) and the same update (the
    clip acts on the true norm). Under 16-mixed a non-finite step is then skipped by the loss
    scaler: counted, weights untouched, and the scale halved."""
    import lightning as L

    got = {}
    for precision in ("32-true", "bf16-mixed", "16-mixed"):
        cfg = tiny_config(
            store,
            tmp_path / precision,
            trainer__max_steps=2,
            trainer__precision=precision,
            trainer__accumulate_grad_batches=1,
        )
        probe, poison = StepProbe(), PoisonStep(step=1, micro=0, accumulate=1)
        with _patched(L.Trainer, "__init__", _fp16_plugin(L.Trainer.__init__)):
            result = fit_with(cfg, [probe, poison])
        assert result.device.endswith(precision) and result.skipped_steps == 1
        assert all(torch.equal(poison.before[k], poison.after[k]) for k in poison.before)
        got[precision] = probe
    ref = got["32-true"]
    assert 0.5 < ref.norm and ref.update.norm() > 0  # the step clipped (grad_clip 1)
    for precision in ("bf16-mixed", "16-mixed"):
        a, b = ref.update, got[precision].update
        assert got[precision].norm == pytest.approx(ref.norm, rel=2e-3), precision
        assert float(b.norm() / a.norm()) == pytest.approx(1.0, abs=2e-3), precision
        assert float(a @ b / a.norm() / b.norm()) > 0.99, precision
    assert got["16-mixed"].scale == 2.0**15  # 2**16 halved once: the skipped step


# --------------------------------------------------------------------------------------------
# no device-to-host sync in the step
# --------------------------------------------------------------------------------------------


class NoSync(Callback):
    """Fails on any tensor -> host read (item, tolist, int, float, bool) while the training
    step and the optimizer step run; checks what the device batch holds."""

    SYNCS = ("item", "tolist", "__int__", "__float__", "__bool__", "cpu", "numpy")

    def __init__(self):
        self.batches = 0
        self._old: dict = {}

    def _arm(self) -> None:
        def trap(name):
            def f(*a, **kw):
                raise AssertionError(f"host sync in the training step: Tensor.{name}")

            return f

        for name in self.SYNCS:
            self._old[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, trap(name))

    def _disarm(self) -> None:
        for name, f in self._old.items():
            setattr(torch.Tensor, name, f)
        self._old = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        assert set(batch) == {"latents", "text", "mask", "dino"}, set(batch)
        assert all(isinstance(v, torch.Tensor) for v in batch.values())
        self.batches += 1
        self._arm()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._disarm()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._disarm()


@pytest.mark.parametrize("storage", ["mixed", "default"])
def test_the_training_step_never_reads_the_device(
    store: Path, tmp_path: Path, storage: str, monkeypatch
) -> None:
    """Micro-batches and optimizer steps (clip, skip check, EMA) run with every tensor -> host
    read trapped, and so does the decoding of the stored batch on the device (codes of the
    default storage; fp16 rows of lossless ones); the logging cadence (every 4th step) is
    where values are read."""
    from test_loader import make_root

    from flowmatch_models.train.module import FlowMatchModule

    if storage == "default":  # two partitions of a causal text encoder: exact first states
        store = make_root(tmp_path / "coded", SIZES, "default", causal=["000-00", "000-02"])
    out = tmp_path / "nosync"
    cfg = tiny_config(
        store, out, trainer__max_steps=8, trainer__log_every=4, trainer__max_skipped_steps=4
    )
    probe = NoSync()
    decode = FlowMatchModule.on_after_batch_transfer

    def trapped_decode(self, batch, idx):
        assert "text_rows" in batch and batch["latents"].dtype == torch.float16  # as stored
        assert ("text" in batch["coded"]) == (storage == "default")
        probe._arm()
        try:
            return decode(self, batch, idx)
        finally:
            probe._disarm()

    monkeypatch.setattr(FlowMatchModule, "on_after_batch_transfer", trapped_decode)
    result = fit_with(cfg, [probe])
    assert probe.batches == 16 and result.step == 8
    rows = [r for r in _metrics(out) if r.get("train_t/bin0")]
    assert len(rows) == 2  # steps 4 and 8: bins summed over all 8 micro-batches of 4 steps


def _metrics(out: Path) -> list[dict]:
    import csv

    with open(out / "metrics.csv") as f:
        return list(csv.DictReader(f))


# --------------------------------------------------------------------------------------------
# checkpoints: retention, resume, EMA-only snapshots, a full disk
# --------------------------------------------------------------------------------------------


def test_retention_keeps_exactly_the_policy_and_resumes_exactly(store: Path, tmp_path: Path):
    out = tmp_path / "keep"
    over = dict(
        trainer__checkpoint_every=1,
        trainer__full_every=3,
        trainer__keep_full=2,
        trainer__keep_ema=4,
        trainer__accumulate_grad_batches=1,
    )
    result = fit_with(tiny_config(store, out, trainer__max_steps=10, **over), [])
    names = sorted(p.name for p in (out / "checkpoints").glob("*.ckpt"))
    assert names == [
        "last.ckpt",
        "step0000007-ema.ckpt",
        "step0000008-ema.ckpt",
        "step0000009-ema.ckpt",
        "step0000009.ckpt",
        "step0000010-ema.ckpt",
        "step0000010.ckpt",
    ]
    ck = out / "checkpoints"
    assert os.path.samefile(ck / "last.ckpt", ck / "step0000010.ckpt")  # a link, not a copy
    assert not list(ck.glob(".tmp-*"))
    full = torch.load(ck / "step0000009.ckpt", weights_only=True)
    ema = torch.load(ck / "step0000009-ema.ckpt", weights_only=True)
    assert "optimizer_states" not in ema and ema["global_step"] == 9
    ema_keys = sorted(k for k in full["state_dict"] if k.startswith("ema."))
    assert sorted(ema["state_dict"]) == ema_keys
    assert all(torch.equal(full["state_dict"][k], ema["state_dict"][k]) for k in ema_keys)
    assert ema["EmbeddingDataModule"]["position"] == full["EmbeddingDataModule"]["position"]
    size = lambda p: p.stat().st_size  # noqa: E731
    assert size(ck / "step0000009-ema.ckpt") < 0.45 * size(ck / "step0000009.ckpt")
    # evaluation and export read the EMA-only snapshot
    model, meta = load_model(checkpoint=ck / "step0000008-ema.ckpt")
    assert meta["step"] == 8 and meta["preset"] == "tiny"
    from flowmatch_models.inference.export import export_checkpoint

    exported = export_checkpoint(ck / "step0000008-ema.ckpt", tmp_path / "exp")
    assert (exported / "transformer" / "config.json").is_file()
    # resume from the newest full state (step 9, last.ckpt removed): exactly the same steps
    (ck / "last.ckpt").unlink()
    out2 = tmp_path / "keep2"
    (out2 / "checkpoints").mkdir(parents=True)
    os.link(ck / "step0000009.ckpt", out2 / "checkpoints" / "last.ckpt")
    fit_with(tiny_config(store, out2, trainer__max_steps=10, **over), [])
    a = torch.load(ck / "step0000010.ckpt", weights_only=True)["state_dict"]
    b = torch.load(out2 / "checkpoints" / "step0000010.ckpt", weights_only=True)["state_dict"]
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    assert result.disk_bytes > 0


def _mount_tmpfs(where: Path, size: str) -> bool:
    where.mkdir(parents=True, exist_ok=True)
    try:
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
            capture_output=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


class FillDisk(Callback):
    """After optimizer step ``step``: fill the run's filesystem but ``leave`` bytes."""

    def __init__(self, folder: Path, step: int, leave: int):
        self.folder, self.step, self.leave, self.done = folder, step, leave, False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step and not self.done:
            import shutil

            self.done = True
            free = shutil.disk_usage(self.folder).free
            with open(self.folder / "ballast", "wb") as f:
                f.write(b"\0" * max(0, free - self.leave))


def test_a_full_disk_keeps_the_last_checkpoint_and_stops_with_one_line(store, tmp_path):
    """A real 64 MB tmpfs (as root; else ENOSPC injected at the write): the step-2 state is
    saved, the disk is filled, the step-4 save fails: the run stops naming the folder and the
    space needed, last.ckpt is still step 2 and loads, nothing half-written is left."""
    disk = tmp_path / "disk"
    real = _mount_tmpfs(disk, "64m")
    try:
        out = disk / "run"
        out.mkdir(parents=True)
        cfg = tiny_config(
            store,
            out,
            trainer__max_steps=6,
            trainer__checkpoint_every=2,
            trainer__accumulate_grad_batches=1,
        )
        probes: list[Callback] = [FillDisk(disk, 3, leave=64 * 1024)] if real else []
        ctx = contextlib.nullcontext() if real else _enospc_after(2)
        with ctx, pytest.raises(DiskFullError) as e:
            fit_with(cfg, probes)
        msg = e.value.strerror
        assert "\n" not in msg and f"in {out / 'checkpoints'}" in msg
        assert "step0000004" in msg and "GB free" in msg and "needs ~0.00" in msg
        assert "previous checkpoint" in msg and "is intact" in msg
        ck = out / "checkpoints"
        assert not list(ck.glob(".tmp-*"))
        last = torch.load(ck / "last.ckpt", weights_only=True)
        assert last["global_step"] == 2 and _finite(last)
        assert sorted(p.name for p in ck.glob("step*.ckpt")) == [
            "step0000002-ema.ckpt",
            "step0000002.ckpt",
        ]
    finally:
        if real:
            subprocess.run(["umount", "-l", str(disk)], capture_output=True, timeout=20)


@contextlib.contextmanager
def _enospc_after(n_ok: int):
    """``torch.save`` raises ENOSPC after ``n_ok`` successful saves (no tmpfs here)."""
    import errno

    real, calls = torch.save, {"n": 0}

    def save(obj, f, *a, **kw):
        calls["n"] += 1
        if calls["n"] > n_ok:
            with open(f, "wb") as fh:
                fh.write(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(obj, f, *a, **kw)

    with _patched(torch, "save", save):
        yield


def test_the_cli_says_a_stopped_run_in_one_line(tmp_path: Path, capsys) -> None:
    """Every sample NaN: the CLI stops after max_skipped_steps with exit 3 and one line."""
    root = make_store(tmp_path / "store", {"000-00": 24})
    layout = DataLayout(root)
    path = layout.asset_path("vae_latents", "000-00")
    shard = read_shard(path)
    lat = np.full_like(np.array(shard["latents"]), np.nan)
    write_shard(path, {"latents": lat}, shard.ids, codec="none", attrs=dict(shard.attrs))
    cfg = tiny_config(
        root,
        tmp_path / "r",
        trainer__max_steps=50,
        trainer__max_skipped_steps=3,
        trainer__log_every=1,
        trainer__accumulate_grad_batches=1,
    )
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump(cfg))
    assert main(["--config", str(run)]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: step 3: 3 consecutive optimizer steps")
    assert "last good checkpoint: none yet" in err[0]


# --------------------------------------------------------------------------------------------
# held-out split and validation loss
# --------------------------------------------------------------------------------------------


def test_heldout_samples_are_never_trained_and_validation_is_fixed(store, tmp_path) -> None:
    from flowmatch_models.data.order import OrderChangedError, heldout_rows
    from flowmatch_models.train import ledger

    out = tmp_path / "val"
    over = dict(
        data__heldout_fraction=0.15,
        data__heldout_max_per_partition=3,
        trainer__val_every=2,
        trainer__accumulate_grad_batches=1,
    )
    result = fit_with(tiny_config(store, out, trainer__max_steps=12, **over), [])
    layout = DataLayout(store)
    ids = {p: read_shard(layout.asset_path("vae_latents", p)).ids for p in sorted(SIZES)}
    held = {ids[p][r] for p in ids for r in heldout_rows(ids[p], 0.15, 3)}
    assert 4 <= len(held) <= 12  # a few per partition, at most the cap
    trained = {i for rec in read_records(out) for i in rec["ids"]}
    assert len(trained) > 60 and not trained & held  # 12 x 8 samples: every trainable seen
    ckpt = torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)
    rows = ledger.expand(ckpt["EmbeddingDataModule"]["ledger"], lambda p: ids[p])
    from_ledger = set(rows["sample_id"].to_pylist())
    assert from_ledger == trained and not from_ledger & held  # the ledger proves it
    val = [r for r in _metrics(out) if r.get("val/loss")]
    assert [int(r["step"]) for r in val] == [2, 4, 6, 8, 10, 12]
    assert all(float(r["val/samples"]) == len(held) for r in val)
    assert all(np.isfinite(float(r["val/loss"])) for r in val)
    assert {f"val/t{k}" for k in range(10)} <= set(val[0])
    assert result.step == 12
    # into the catalog's `validation` view (a real DuckDB file), as flow_model records it
    from flowmatch_assets import catalog
    from flowmatch_assets.catalog import Catalog

    catalog.record_validation(
        tmp_path / "cat", "val", catalog.validation_rows(out / "metrics.csv", "val")
    )
    rows = Catalog(tmp_path / "cat").query(
        "SELECT step, t_bin, loss, samples FROM validation WHERE run = 'val' ORDER BY step, t_bin"
    )
    assert len(rows) == 6 * 11 and rows[0]["t_bin"] == -1 and rows[0]["samples"] == len(held)
    assert rows[0]["loss"] == pytest.approx(float(val[0]["val/loss"]))
    # a changed held-out rule changes the order: the resume stops and names it
    cfg = tiny_config(store, out, trainer__max_steps=14, **{**over, "data__heldout_fraction": 0.2})
    with pytest.raises(OrderChangedError, match="data.heldout_fraction"):
        fit_with(cfg, [])
    # a checkpoint from before held-out splits (no rule recorded) held nothing out
    from flowmatch_models.data.module import EmbeddingDataModule

    state = {k: v for k, v in ckpt["EmbeddingDataModule"].items() if k != "heldout"}
    dm = EmbeddingDataModule(store, batch_size=8, heldout=(0.15, 3))
    with pytest.raises(OrderChangedError, match=r"checkpoint \[0.0, 0.0\] -> now \[0.15, 3.0\]"):
        dm.load_state_dict(state)
    EmbeddingDataModule(store, batch_size=8).load_state_dict(state)  # no rule either: fine


def test_base_yaml_keeps_a_400k_step_run_under_60_gb() -> None:
    """base.yaml's retention, priced with the real parameter counts of the base preset."""
    from flowmatch_models.model.dit import build_model, count_params
    from flowmatch_models.train.config import checkpoint_disk_plan, load_config

    cfg = load_config(REPO / "configs" / "base.yaml")
    with torch.device("meta"):
        model = build_model("base", projector_hidden=cfg.model.projector_hidden)
    plan = checkpoint_disk_plan(cfg, count_params(model), count_params(model.transformer))
    assert cfg.trainer.max_steps == 400_000
    assert 3.0e9 < plan["full_state_bytes"] < 3.3e9  # ~3.1 GB, as ARCHITECTURE.md works out
    assert plan["total_bytes"] < 60e9 and plan["ema_snapshots_kept"] == 50
    assert plan["without_retention_bytes"] > 150e9  # every event a full state, kept: 158 GB


def test_frechet_distance_is_exact_on_an_affine_pair() -> None:
    """b = 2a + 3: S_b = 4 S_a, so FD = |mu_a - mu_b|^2 + tr(S_a) + 4 tr(S_a) - 4 tr(S_a)."""
    from flowmatch_assets.reports.evaluation import frechet_distance

    rng = np.random.default_rng(0)
    a = rng.standard_normal((400, 16)) @ rng.standard_normal((16, 16))
    b = 2 * a + 3
    mu = a.mean(0) - b.mean(0)
    expected = mu @ mu + np.trace(np.cov(a, rowvar=False))
    assert frechet_distance(a, b) == pytest.approx(expected, rel=1e-9)
    assert frechet_distance(a, a) == pytest.approx(0.0, abs=1e-8)
    assert frechet_distance(a, b) == pytest.approx(frechet_distance(b, a), rel=1e-9)
    few = rng.standard_normal((10, 384))  # fewer samples than dimensions: still defined, >= 0
    assert frechet_distance(few, few + 0.1) >= 0
