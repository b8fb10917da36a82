"""Training entry point: ``python -m flowmatch_models.train --config run.yaml [--resume auto|PATH]``.

One YAML holds every hyperparameter (see ``configs/tiny.yaml``); ``--set key.sub=value``
overrides single entries. The YAML is read afresh on every start, so resuming with an edited
file uses the new values. Outputs under ``run.out_dir``:

    checkpoints/step0000100.ckpt, last.ckpt   model, EMA, optimizer, scheduler, data position
    checkpoints/trained_counts.json           samples trained per partition at the last save
    logs/segNNN/metrics.csv, metrics.csv      one CSV per (re)start, merged into metrics.csv
    wandb/offline-run-*                       W&B (online iff WANDB_API_KEY is set)
    loss_curve.png, samples/step*.png         pictures
    transformer_ema/                          EMA transformer, ``SanaTransformer2DModel.from_pretrained``

When ``DAGSTER_PIPES_CONTEXT`` is set (a Dagster Pipes launch), progress goes to the Dagster
log and the final metrics become an asset materialization; without it, nothing changes.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import csv
import json
import os
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
import yaml
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from flowmatch_models.atomic import atomic_path, atomic_write_text
from flowmatch_models.data import EmbeddingDataModule, OrderChangedError
from flowmatch_models.layout import DataLayout
from flowmatch_models.lightning_module import FlowMatchModule

DEFAULT_CONFIG: dict[str, dict[str, Any]] = {
    "run": {"out_dir": "runs/default", "seed": 0, "name": None},
    "model": {
        "preset": "tiny",
        "repa_encoder_depth": None,  # REPA aligns block k counted from 1; None = preset default
        "projector_hidden": None,  # default per preset (2048 for small/base)
        "pos_embed": True,  # sin-cos positional embedding on the 8x8 grid
        "init": "sana",  # sana | default
        "gradient_checkpointing": False,
        "compile": False,
    },
    "flow": {
        "t_mean": 0.0,
        "t_std": 1.0,
        "shift": 1.0,
        "caption_dropout": 0.1,
        "repa_lambda": 0.5,
        "n_bins": 10,
    },
    "optim": {
        "lr": 1e-4,
        "betas": [0.9, 0.999],
        "weight_decay": 0.0,
        "warmup_steps": 1000,
        "schedule": "constant",
        "min_lr_ratio": 0.1,
        "grad_clip": 1.0,
        "ema_decay": 0.9999,
    },
    "data": {
        "root": "data",
        "partitions": None,  # None = every complete partition
        "batch_size": 64,  # per device
        "num_workers": 2,
        "shuffle_window": 4,
        "text_max_len": 128,
        "allow_order_change": False,  # resume even if seed/shuffle_window changed (next epoch)
    },
    "trainer": {
        "max_steps": 1000,
        "accumulate_grad_batches": 1,
        "precision": "auto",  # bf16-mixed on GPU, 32-true on CPU
        "accelerator": "auto",
        "devices": "auto",
        "strategy": "auto",
        "num_nodes": 1,
        "log_every": 10,
        "checkpoint_every": 500,
        "keep_checkpoints": True,
        "sample_every": 500,
        "progress_bar": False,
    },
    "logging": {
        "wandb": True,
        "wandb_project": "flowmatch",
        "wandb_mode": "auto",  # auto = online iff WANDB_API_KEY is set, else offline
        "record_sample_ids": False,  # per-rank JSONL of each batch's sample ids and loss
    },
    "sample": {
        "prompts": [
            "a photograph of a lighthouse on a cliff at sunset",
            "an oil painting of a bowl of fruit",
            "a black and white photo of a city street",
            "a watercolor of mountains and a lake",
        ],
        "steps": 30,
        "cfg_scale": 4.0,
        "seed": 0,
    },
    "encoders": {"vae": None, "text": None},  # local folders or hub ids; None = no decode/encode
}


# --------------------------------------------------------------------------------------------
# config
# --------------------------------------------------------------------------------------------


class ConfigError(ValueError):
    """A config key or value the training does not know; the message names it and the fix."""


def _merge(base: dict, over: dict, where: str = "") -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if k not in base:
            raise ConfigError(
                f"unknown config key '{where}{k}'; known: {sorted(base)} (see configs/tiny.yaml)"
            )
        out[k] = _merge(base[k], v, f"{where}{k}.") if isinstance(base[k], dict) else v
    return out


def load_config(
    config: dict | str | os.PathLike, overrides: Sequence[str] = (), max_steps: int | None = None
) -> dict:
    """Defaults <- YAML (path or dict) <- ``key.sub=value`` overrides (values parsed as YAML)."""
    if not isinstance(config, dict):
        path = Path(config)
        if not path.is_file():
            raise FileNotFoundError(f"config {path} not found; start from configs/tiny.yaml")
        config = yaml.safe_load(path.read_text()) or {}
    cfg = _merge(DEFAULT_CONFIG, config)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set {item!r}: expected key.sub=value")
        *parents, leaf = key.split(".")
        node = cfg
        for p in parents:
            if not isinstance(node.get(p), dict):
                raise ConfigError(
                    f"--set {key}: unknown config section '{p}'; known: {sorted(node)}"
                )
            node = node[p]
        if leaf not in node:
            raise ConfigError(f"--set {key}: unknown config key; known: {sorted(node)}")
        node[leaf] = yaml.safe_load(value)
    if max_steps is not None:
        cfg["trainer"]["max_steps"] = int(max_steps)
    return cfg


# --------------------------------------------------------------------------------------------
# callbacks
# --------------------------------------------------------------------------------------------


class AtomicCheckpointIO(TorchCheckpointIO):
    """Checkpoints written by atomic rename and read with ``torch.load(weights_only=True)``."""

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        with atomic_path(path) as tmp:
            torch.save(checkpoint, tmp)

    def load_checkpoint(self, path, map_location=None, weights_only=None) -> dict:
        return torch.load(path, map_location=map_location or "cpu", weights_only=True)


class ProgressPrinter(Callback):
    """Prints a progress line (and a Dagster Pipes log line) every ``log_every`` steps."""

    def __init__(self, every: int, pipes=None):
        self.every, self.pipes, self.t0 = max(1, every), pipes, time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if not trainer.is_global_zero or step % self.every or step == getattr(self, "_last", 0):
            return
        self._last = step
        m = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
        line = (
            f"step {step}/{trainer.max_steps} loss {m.get('train/loss', float('nan')):.4f} "
            f"fm {m.get('train/fm', float('nan')):.4f} repa {m.get('train/repa', float('nan')):.4f} "
            f"lr {m.get('train/lr', float('nan')):.2e} "
            f"{m.get('train/samples_per_s', float('nan')):.0f} samples/s "
            f"({time.perf_counter() - self.t0:.0f}s)"
        )
        print(line, flush=True)
        if self.pipes is not None:
            self.pipes.log.info(line)


class SampleIdRecorder(Callback):
    """Appends ``{step, epoch, position, ids, loss}`` per batch to ``sample_ids/rank<r>.jsonl``."""

    def __init__(self, out_dir: Path):
        self.dir = out_dir / "sample_ids"

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        rec = {
            "step": trainer.global_step,
            "epoch": int(batch["epoch"]),
            "position": int(batch["position"]),
            "ids": list(batch["ids"]),
            "loss": float(outputs["loss"]) if isinstance(outputs, dict) else float(outputs),
        }
        with open(self.dir / f"rank{trainer.global_rank}.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")


class SampleGridCallback(Callback):
    """Every ``every`` steps (rank 0): EMA samples of fixed prompts -> ``samples/stepN.png``."""

    def __init__(self, cfg: dict, datamodule: EmbeddingDataModule):
        self.cfg, self.dm, self.every = cfg, datamodule, int(cfg["trainer"]["sample_every"])
        self._prompts = None
        self._vae = None
        self.last_path: Path | None = None

    def _prepare(self):
        from flowmatch_models.sample import load_vae, prompt_embeddings, store_captions

        enc = self.cfg["encoders"]
        if self._prompts is None:
            if enc.get("text"):
                self._prompts = prompt_embeddings(self.cfg["sample"]["prompts"], enc["text"])
            else:
                n = len(self.cfg["sample"]["prompts"])
                self._prompts = store_captions(self.dm.source, n)
            if enc.get("vae"):
                self._vae = load_vae(enc["vae"])
        return self._prompts

    def render(self, trainer, pl_module) -> Path:
        from flowmatch_models.sample import sample_grid

        text, mask, labels = self._prepare()
        s = self.cfg["sample"]
        out = Path(self.cfg["run"]["out_dir"]) / "samples" / f"step{trainer.global_step:07d}.png"
        self.last_path = sample_grid(
            pl_module.ema,
            text,
            mask,
            out,
            self.dm.scaling_factor,
            vae=self._vae,
            steps=int(s["steps"]),
            cfg_scale=float(s["cfg_scale"]),
            seed=int(s["seed"]),
            shift=float(self.cfg["flow"]["shift"]),
            labels=labels,
            null_text=pl_module.flow.null_text,
        )
        return self.last_path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if trainer.is_global_zero and self.every > 0 and step % self.every == 0:
            if step != getattr(self, "_last", -1):
                self._last = step
                self.render(trainer, pl_module)


# --------------------------------------------------------------------------------------------
# outputs
# --------------------------------------------------------------------------------------------


def merge_metrics(out_dir: Path) -> Path | None:
    """Merge ``logs/seg*/metrics.csv`` into ``metrics.csv``; a later segment wins its steps."""
    segs = sorted((out_dir / "logs").glob("seg*/metrics.csv"))
    if not segs:
        return None
    tables = []
    for p in segs:
        with open(p, newline="") as f:
            tables.append(list(csv.DictReader(f)))
    rows: list[dict] = []
    for i, table in enumerate(tables):
        later = [int(r["step"]) for t in tables[i + 1 :] for r in t if r.get("step")]
        cut = min(later) if later else None
        rows += [r for r in table if cut is None or int(r["step"]) < cut]
    keys = sorted({k for r in rows for k in r}, key=lambda k: (k != "step", k))
    target = out_dir / "metrics.csv"
    with atomic_path(target) as tmp, open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    return target


def plot_loss_curve(metrics_csv: Path, out_png: Path) -> Path:
    """Loss / FM / REPA against step from a ``metrics.csv``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(metrics_csv, newline="") as f:
        rows = list(csv.DictReader(f))
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.5))
    # the flow-matching term on a log axis; the total (fm + lambda * -cos) goes negative with
    # REPA, so it is drawn only when it stays positive (REPA off: it equals fm)
    for key in ("train/fm", "train/loss"):
        pts = [(int(r["step"]), float(r[key])) for r in rows if r.get(key)]
        if pts and (key == "train/fm" or min(v for _, v in pts) > 0):
            ax[0].plot(*zip(*pts), label="flow matching" if key == "train/fm" else "total")
    pts = [(int(r["step"]), float(r["train/repa"])) for r in rows if r.get("train/repa")]
    if pts:
        ax[1].plot(*zip(*pts), label="repa (-cos)", color="C2")
    for a in ax:
        a.set_xlabel("step")
        a.legend()
    ax[0].set_yscale("log")
    fig.tight_layout()
    with atomic_path(out_png, suffix=".png") as tmp:
        fig.savefig(tmp, dpi=100, format="png")
    plt.close(fig)
    return out_png


NULL_FILE = "null_caption.safetensors"


def export_ema(module: FlowMatchModule, out_dir: Path, scaling_factor: float) -> Path:
    """``save_pretrained`` the EMA transformer to ``out_dir/transformer_ema`` (atomic swap)."""
    target = out_dir / "transformer_ema"
    tmp = out_dir / ".tmp-transformer_ema"
    shutil.rmtree(tmp, ignore_errors=True)
    module.ema.save_pretrained(tmp)
    meta = {
        "scaling_factor": scaling_factor,
        "preset": module.config["model"]["preset"],
        "null_caption": (
            "null_caption.safetensors: the encoded empty prompt (text_embeddings' null_tokens)"
            if module.flow.null_text is not None
            else "one all-zero token (mask [1]); see flowmatch_models.flow"
        ),
        "timestep_scale": "t in [0, 1] x 1000",
        "flow_shift": module.config["flow"]["shift"],
    }
    atomic_write_text(tmp / "flowmatch.json", json.dumps(meta, indent=1))
    if module.flow.null_text is not None:
        from safetensors.torch import save_file

        save_file({"null_text": module.flow.null_text.float().contiguous()}, tmp / NULL_FILE)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
    return target


def _resolve_resume(resume: str | None, out_dir: Path) -> str | None:
    if resume in (None, "", "none"):
        return None
    if resume == "auto":
        last = out_dir / "checkpoints" / "last.ckpt"
        return str(last) if last.is_file() else None
    if not Path(resume).is_file():
        raise FileNotFoundError(f"--resume {resume}: no such checkpoint; use --resume auto")
    return resume


def _resolve_partitions(root: str, partitions: list[str] | None) -> list[str]:
    """The partition list, fixed once by the launching process so that DDP ranks started
    later agree even if more partitions complete meanwhile (passed on in an env var)."""
    if partitions:
        return list(partitions)
    if not _is_launcher_rank_zero() and "FLOWMATCH_PARTITIONS" in os.environ:
        return json.loads(os.environ["FLOWMATCH_PARTITIONS"])
    found = DataLayout(root).complete_partitions()
    os.environ["FLOWMATCH_PARTITIONS"] = json.dumps(found)
    return found


def _is_launcher_rank_zero() -> bool:
    return os.environ.get("LOCAL_RANK", "0") == "0" and os.environ.get("NODE_RANK", "0") == "0"


# --------------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------------


def run_training(
    config: dict | str | os.PathLike,
    resume: str | None = "auto",
    max_steps: int | None = None,
    overrides: Sequence[str] = (),
) -> dict:
    """Train (or resume) the run described by ``config``; returns a summary dict."""
    cfg = load_config(config, overrides, max_steps)
    pipes_cm: Any = contextlib.nullcontext(None)
    if os.environ.get("DAGSTER_PIPES_CONTEXT") and _is_launcher_rank_zero():
        from dagster_pipes import open_dagster_pipes

        pipes_cm = open_dagster_pipes()
    with pipes_cm as pipes:
        summary = _train(cfg, resume, pipes)
        if pipes is not None and summary.get("is_global_zero"):
            meta = {
                k: summary[k]
                for k in ("step", "loss", "fm", "repa", "samples_per_s", "checkpoint", "wandb_dir")
                if summary.get(k) is not None
            }
            pipes.report_asset_materialization(metadata=meta)
    return summary


def _train(cfg: dict, resume: str | None, pipes) -> dict:
    out_dir = Path(cfg["run"]["out_dir"]).expanduser().resolve()
    cfg["run"]["out_dir"] = str(out_dir)
    ckpt_path = _resolve_resume(resume, out_dir)
    L.seed_everything(int(cfg["run"]["seed"]), workers=True, verbose=False)
    d, t, lg = cfg["data"], cfg["trainer"], cfg["logging"]
    dm = EmbeddingDataModule(
        d["root"],
        _resolve_partitions(d["root"], d["partitions"]),
        batch_size=int(d["batch_size"]),
        num_workers=int(d["num_workers"]),
        seed=int(cfg["run"]["seed"]),
        shuffle_window=int(d["shuffle_window"]),
        text_max_len=int(d["text_max_len"]),
        load_dino=float(cfg["flow"]["repa_lambda"]) > 0,
        allow_order_change=bool(d["allow_order_change"]),
    )
    module = FlowMatchModule(cfg)
    module.flow.null_text = dm.source.null_text
    if cfg["model"]["compile"]:
        module.model.transformer.compile()
    cuda = torch.cuda.is_available() and t["accelerator"] in ("auto", "gpu", "cuda")
    precision = (
        t["precision"] if t["precision"] != "auto" else ("bf16-mixed" if cuda else "32-true")
    )

    segs = sorted((out_dir / "logs").glob("seg*")) if (out_dir / "logs").is_dir() else []
    if _is_launcher_rank_zero():
        seg = len(segs)
        os.environ["FLOWMATCH_LOG_SEGMENT"] = str(seg)  # DDP children reuse the parent's segment
    else:
        seg = int(os.environ.get("FLOWMATCH_LOG_SEGMENT", max(len(segs) - 1, 0)))
    loggers: list = [
        L.pytorch.loggers.CSVLogger(out_dir / "logs", name="", version=f"seg{seg:03d}")
    ]
    if lg["wandb"]:
        from lightning.pytorch.loggers import WandbLogger

        mode = lg["wandb_mode"]
        online = bool(os.environ.get("WANDB_API_KEY")) if mode == "auto" else mode == "online"
        id_file = out_dir / "wandb_run_id.txt"
        if not id_file.is_file() and _is_launcher_rank_zero():
            import uuid

            atomic_write_text(id_file, uuid.uuid4().hex[:12])
        run_id = id_file.read_text().strip() if id_file.is_file() else None
        loggers.append(
            WandbLogger(
                project=lg["wandb_project"],
                name=cfg["run"]["name"] or out_dir.name,
                save_dir=str(out_dir),
                offline=not online,
                id=run_id,
                resume="allow",
            )
        )
    ckpt_cb = ModelCheckpoint(
        dirpath=out_dir / "checkpoints",
        filename="step{step:07d}",
        auto_insert_metric_name=False,
        every_n_train_steps=int(t["checkpoint_every"]),
        save_top_k=-1 if t["keep_checkpoints"] else 1,
        save_last=True,  # also at the end of training, off the cadence
        enable_version_counter=False,  # always overwrite last.ckpt (resume --auto reads it)
    )
    grid_cb = SampleGridCallback(cfg, dm)
    callbacks: list[Callback] = [
        ckpt_cb,
        ProgressPrinter(int(t["log_every"]), pipes),
        grid_cb,
    ]
    if lg["record_sample_ids"]:
        callbacks.append(SampleIdRecorder(out_dir))
    trainer = L.Trainer(
        accelerator=t["accelerator"],
        devices=t["devices"],
        num_nodes=int(t["num_nodes"]),
        strategy=t["strategy"],
        precision=precision,
        max_steps=int(t["max_steps"]),
        max_epochs=-1,
        accumulate_grad_batches=int(t["accumulate_grad_batches"]),
        gradient_clip_val=float(cfg["optim"]["grad_clip"]) or None,
        log_every_n_steps=int(t["log_every"]),
        logger=loggers,
        callbacks=callbacks,
        plugins=[AtomicCheckpointIO()],
        use_distributed_sampler=False,
        enable_progress_bar=bool(t["progress_bar"]),
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    t0 = time.perf_counter()
    trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path)
    wall = time.perf_counter() - t0
    summary: dict[str, Any] = {"is_global_zero": trainer.is_global_zero, "out_dir": str(out_dir)}
    summary["step"] = int(trainer.global_step)
    for key in ("loss", "fm", "repa", "samples_per_s", "lr"):
        v = trainer.callback_metrics.get(f"train/{key}")
        summary[key] = float(v) if v is not None else None
    summary["wall_s"] = wall
    summary["resumed_from"] = ckpt_path
    summary["trained_counts"] = dict(dm.trained_counts)
    summary["data_position"] = {"epoch": dm.epoch, "position": dm.position}
    if not trainer.is_global_zero:
        return summary
    final = out_dir / "checkpoints" / "last.ckpt"
    summary["checkpoint"] = str(final) if final.is_file() else None
    metrics = merge_metrics(out_dir)
    summary["metrics_csv"] = str(metrics) if metrics else None
    if metrics:
        summary["loss_curve"] = str(plot_loss_curve(metrics, out_dir / "loss_curve.png"))
    if int(t["sample_every"]) > 0:
        summary["sample_grid"] = str(grid_cb.render(trainer, module))
    summary["export_dir"] = str(export_ema(module, out_dir, dm.scaling_factor))
    wandb_logger = next((lg_ for lg_ in loggers if lg_.__class__.__name__ == "WandbLogger"), None)
    if wandb_logger is not None:
        summary["wandb_dir"] = str(Path(wandb_logger.experiment.dir).parent)
        wandb_logger.experiment.finish()
    print(
        f"done: step {summary['step']} loss {summary['loss']} in {wall:.0f}s; "
        f"checkpoint {summary['checkpoint']}; export {summary['export_dir']}",
        flush=True,
    )
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    """CLI."""
    ap = argparse.ArgumentParser(prog="python -m flowmatch_models.train", description=__doc__)
    ap.add_argument("--config", required=True, help="run YAML (see configs/tiny.yaml)")
    ap.add_argument("--resume", default="auto", help="auto (last.ckpt if any), none, or a path")
    ap.add_argument("--max-steps", type=int, default=None)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--summary-json", default=None, help="also write the summary here")
    args = ap.parse_args(argv)
    try:  # a user's mistake (bad key or value, changed order on resume): one line, exit 2
        cfg = load_config(args.config, args.set, args.max_steps)
        summary = run_training(cfg, args.resume)
    except (ConfigError, OrderChangedError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.summary_json and summary.get("is_global_zero"):
        atomic_write_text(args.summary_json, json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
