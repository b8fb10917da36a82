"""The run's Weights & Biases logger: one run id per run folder, the full resolved config, the
data coverage, images at the sample cadence (``callbacks.log_images``).

The id lives in ``<run>/wandb_run_id.txt``; every session of the run (training, a resume, the
``evaluation`` asset) logs under it with ``resume="allow"``, so online it is one wandb run.
Offline (the default without ``WANDB_API_KEY``), wandb writes one ``wandb/offline-run-*`` folder
per session, all with that id, which ``wandb sync`` uploads into the one run (wandb cannot
append to an offline folder: wandb/wandb#4624).
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from flowmatch_models.storage.atomic import atomic_write_text
from flowmatch_models.train.config import TrainConfig

ID_FILE = "wandb_run_id.txt"


def run_id(run_dir: Path, create: bool) -> str | None:
    """The run's wandb id (created by the launcher on the first session)."""
    id_file = Path(run_dir) / ID_FILE
    if not id_file.is_file() and create:
        atomic_write_text(id_file, uuid.uuid4().hex[:12])
    return id_file.read_text().strip() if id_file.is_file() else None


def is_online(mode: str) -> bool:
    return bool(os.environ.get("WANDB_API_KEY")) if mode == "auto" else mode == "online"


def make_logger(
    cfg: TrainConfig, run_dir: Path, create_id: bool, coverage: dict, parent: dict | None = None
):
    """A Lightning ``WandbLogger`` resuming the run's id, with the resolved config, the data
    coverage (``data/partitions``, ``data/samples``, ...) and a fine-tune's ``parent`` (run,
    step, digest: flowmatch_models/train/finetune.py) in its config."""
    from lightning.pytorch.loggers import WandbLogger

    lg = cfg.logging
    return WandbLogger(
        project=lg.wandb_project,
        name=cfg.run.name,
        save_dir=str(run_dir),
        offline=not is_online(lg.wandb_mode),
        id=run_id(run_dir, create_id),
        resume="allow",
        config={**cfg.to_dict(), "coverage": coverage, **({"parent": parent} if parent else {})},
    )


def finish(loggers) -> str | None:
    """Finish the wandb run of ``loggers`` (if any); returns its local folder."""
    for logger in loggers:
        if logger.__class__.__name__ == "WandbLogger":
            folder = str(Path(logger.experiment.dir).parent)
            logger.experiment.finish()
            return folder
    return None
