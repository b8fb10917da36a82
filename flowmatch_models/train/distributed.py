"""DDP coordination: the launcher process decides, the ranks it starts read its decision.

Lightning's DDP launcher re-runs the same command line in one process per extra local rank
(``LOCAL_RANK`` set). Whatever must be identical on every rank (the partition list, the step
budget, the run folder, the log segment) is decided once by the launcher, written into the run
folder as the request (``request.json``) and found by the ranks through ``FLOWMATCH_REQUEST``.
"""

from __future__ import annotations

import os
from pathlib import Path

REQUEST_ENV = "FLOWMATCH_REQUEST"


def is_launcher() -> bool:
    """True in the process the user (or Dagster) started: local rank 0 of node 0."""
    return os.environ.get("LOCAL_RANK", "0") == "0" and os.environ.get("NODE_RANK", "0") == "0"


def published_request() -> Path | None:
    """The launcher's decided request, in a rank the launcher started; None in the launcher."""
    if is_launcher():
        return None
    path = os.environ.get(REQUEST_ENV)
    return Path(path) if path else None


def publish_request(path: Path) -> None:
    """Point the ranks this process will start at the decided request ``path``."""
    os.environ[REQUEST_ENV] = str(path)


def device_description(trainer) -> str:
    """What trained, measured from the trainer: ``cuda (NVIDIA H200) x 2, bf16-mixed``."""
    import torch

    dev = trainer.strategy.root_device
    name = dev.type
    if dev.type == "cuda":
        name = f"cuda ({torch.cuda.get_device_name(dev)})"
    world = int(trainer.world_size)
    return f"{name}{f' x {world}' if world > 1 else ''}, {trainer.precision}"
