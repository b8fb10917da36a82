"""Each private Lightning API flowmatch uses (flowmatch_models/train/lightning_compat.py), checked
against the installed Lightning: a release that moves one fails here, naming the internal, not
deep inside a training run. tests/test_lightning_floor.py runs this file under the lowest
Lightning allowed too. And nothing outside the compat module reaches those internals."""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from flowmatch_models.train import lightning_compat as lc

REPO = Path(__file__).resolve().parents[1]
HOME = "flowmatch_models/train/lightning_compat.py"

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread


@contextlib.contextmanager
def internal(name: str):
    """A Lightning that changed ``name`` fails the test with a message saying so."""
    try:
        yield
    except (AttributeError, KeyError, TypeError, ImportError) as e:
        pytest.fail(
            f"Lightning {L.__version__} changed {name} ({type(e).__name__}: {e}): "
            f"update {HOME} (and the pin in pyproject.toml)"
        )


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        self.at = (self.current_epoch, batch_idx)  # where the loop stands
        return self.layer(batch).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Data(L.LightningDataModule):
    """Four batches an epoch; on a resume, optionally closes the checkpoint's epoch (as
    EmbeddingDataModule.load_state_dict does) and keeps what it saw."""

    def __init__(self, close: bool = False) -> None:
        super().__init__()
        self.close, self.seen = close, None

    def train_dataloader(self):
        return DataLoader(torch.randn(8, 2), batch_size=2)

    def state_dict(self):
        return {"n": 1}

    def load_state_dict(self, state) -> None:
        with internal("trainer._checkpoint_connector._loaded_checkpoint"):
            self.seen = lc.loaded_checkpoint(self.trainer)
        if self.close:
            lc.close_epoch(self.seen)


class SaveAt(L.Callback):
    """Saves the training state at ``step`` (inside the epoch, as the checkpoint callback)."""

    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            torch.save(lc.dump_checkpoint(trainer), self.path)


def _trainer(root: Path, steps: int, callbacks=()) -> L.Trainer:
    return L.Trainer(
        callbacks=list(callbacks),
        default_root_dir=root,
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def test_dump_checkpoint_is_the_full_state(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, 2)
    module = Tiny()
    assert lc.attached_trainer(module) is None
    trainer.fit(module, datamodule=Data())
    with internal("LightningModule._trainer"):
        assert lc.attached_trainer(module) is trainer
    with internal("trainer._checkpoint_connector.dump_checkpoint"):
        ckpt = lc.dump_checkpoint(trainer)
    assert ckpt["global_step"] == 2
    assert set(ckpt["state_dict"]) == {"layer.weight", "layer.bias"}
    assert len(ckpt["optimizer_states"]) == 1 and ckpt["Data"] == {"n": 1}
    assert ckpt["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]["completed"] == 2


@pytest.mark.parametrize("close", [False, True])
def test_a_resumed_checkpoints_loops_can_be_closed(tmp_path: Path, close: bool) -> None:
    """Saved mid-epoch (2 of 4 batches): the resuming data module sees the loaded checkpoint
    with every loop key close_epoch rewrites; closed, the resume starts the next epoch at its
    first batch; not closed, it goes on mid-epoch."""
    first = _trainer(tmp_path, 4, [SaveAt(2, tmp_path / "mid.ckpt")])
    first.fit(Tiny(), datamodule=Data())
    data = Data(close=close)
    resumed = _trainer(tmp_path, 3)
    module = Tiny()
    resumed.fit(module, datamodule=data, ckpt_path=tmp_path / "mid.ckpt")
    with internal("the checkpoint's loops.fit_loop progress keys"):
        fit = data.seen["loops"][lc.FIT_LOOP]
        for key in (lc.BATCH_PROGRESS, *lc.IN_EPOCH_PROGRESS, lc.OPTIM_PROGRESS):
            assert "current" in fit[key] or "optimizer" in fit[key], key
        assert set(fit[lc.EPOCH_PROGRESS]) >= {"total", "current"}
        assert fit[lc.OPTIM_PROGRESS]["optimizer"]["step"]["current"]
    # the one step after the resume: the next epoch's first batch, or the third of the first
    assert module.at == ((1, 0) if close else (0, 2))
    assert resumed.global_step == 3


def test_forget_sigterm_clears_what_lightnings_handler_recorded(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, 1)
    with internal("trainer._signal_connector.received_sigterm"):
        trainer._signal_connector.received_sigterm = True  # as Lightning's handler sets it
        assert trainer.received_sigterm
        lc.forget_sigterm(trainer)
    assert trainer.received_sigterm is False


def test_the_rank_observer_subclasses_lightnings() -> None:
    from flowmatch_models.train import distributed

    with internal("subprocess_script._ChildProcessObserver"):
        current = lc.child_process_observer()
        assert current is not None, "no _ChildProcessObserver"
        # an earlier test in this process (a DDP run) may have installed flowmatch's already
        base = current.__mro__[1] if getattr(current, "_flowmatch", False) else current
        lc.install_child_process_observer(base)
        done = subprocess.Popen([sys.executable, "-c", "pass"])
        done.wait()
        assert base(1, [done])._run() is True  # every child exited 0: stop watching
        assert callable(base._terminate_all)
        try:
            distributed.watch_ranks()
            observer = lc.child_process_observer()
            assert observer is not base and issubclass(observer, base)
            stopped = subprocess.Popen([sys.executable, "-c", "raise SystemExit(75)"])
            stopped.wait()
            # a rank that stopped on a signal (EXIT_STOPPED) is not a failure: no kill
            assert observer(1, [done, stopped])._run() is True
            assert observer(1, [done])._child_processes == [done]
        finally:
            lc.install_child_process_observer(current)
    assert lc.child_process_observer() is current


def test_plain_optimizer_and_a_skipped_fused_step() -> None:
    from lightning.pytorch.core.optimizer import LightningOptimizer

    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=0.1, fused=True)
    assert lc.plain_optimizer(LightningOptimizer(opt)) is opt
    assert lc.plain_optimizer(opt) is opt
    p.grad = torch.ones(3)
    with internal("torch's fused AdamW found_inf"):
        lc.skip_step_if(opt, torch.tensor(True))
        opt.step()
    assert torch.equal(p.detach(), torch.ones(3))  # skipped: untouched
    lc.skip_step_if(opt, torch.tensor(False))
    opt.step()
    assert torch.all(p.detach() < 1.0)  # stepped


def test_no_lightning_internal_outside_the_compat_module() -> None:
    private = re.compile(
        r"_checkpoint_connector|_signal_connector|_loaded_checkpoint|_ChildProcessObserver\b(?!``)"
        r"|found_inf\s*=|\._trainer\b|\._optimizer\b|[\"']epoch_loop\.|[\"']fit_loop[\"']"
    )
    found = {}
    for pkg in ("flowmatch_models", "flowmatch_assets"):
        for f in sorted((REPO / pkg).rglob("*.py")):
            rel = f.relative_to(REPO).as_posix()
            code = "\n".join(
                line for line in f.read_text().splitlines() if not line.lstrip().startswith("#")
            )
            if rel != HOME and (hits := private.findall(code)):
                found[rel] = hits
    assert not found, f"Lightning internals outside {HOME}: {found}"
    assert private.search("trainer._checkpoint_connector.dump_checkpoint(weights_only=False)")


def test_a_moved_internal_fails_naming_it() -> None:
    """What a Lightning that moved the checkpoint connector would print."""

    class Moved:  # a trainer without ``_checkpoint_connector``
        pass

    with pytest.raises(pytest.fail.Exception, match=r"changed trainer\._checkpoint_connector"):
        with internal("trainer._checkpoint_connector.dump_checkpoint"):
            lc.dump_checkpoint(Moved())
