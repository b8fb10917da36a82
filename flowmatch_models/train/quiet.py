"""What the libraries print that tells a user of a training run nothing, silenced (unless
``FLOWMATCH_VERBOSE``, the CLI's ``--verbose``): train/run.py calls these at start."""

from __future__ import annotations

import logging
import os
import warnings

from flowmatch_models.encoders.loading import verbose

EXPECTED_WARNINGS = (
    r"Found \d+ module\(s\) in eval mode at the start of training",
    r"You have overridden `on_(before|after)_batch_transfer` in `LightningModule` but have "
    r"passed in a `LightningDataModule`",
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
)


def quiet_libraries() -> None:
    """What the libraries print that tells a user of this run nothing, silenced in this process
    unless ``FLOWMATCH_VERBOSE`` is set (the CLI's ``--verbose``): Lightning's info lines
    ("GPU available ...", "TPU available ...", the litlogger tip, "max_steps reached"), the
    :data:`EXPECTED_WARNINGS` and transformers' "Writing model shards" bar of the export (wandb:
    :func:`quiet_wandb`). The run's own lines (progress, checkpoints, errors) are printed by
    this package and always show; so does every other warning."""
    if verbose():
        return
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    for message in EXPECTED_WARNINGS:
        warnings.filterwarnings("ignore", message=message)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def quiet_wandb() -> None:
    """wandb's banner, run summary and notices off, its errors on (unless ``FLOWMATCH_VERBOSE``;
    ``WANDB_*`` variables the user set win): the run folder's ``wandb/`` is named by the caller.
    Its terminal is set up from them now, before the logger starts its run, whose settings
    check warns about the ``anonymous`` argument Lightning passes. (Not ``wandb.setup()``: it
    would read the environment before the logger sets ``WANDB_MODE`` for an offline run.)"""
    if verbose():
        return
    for key, value in (
        ("WANDB_QUIET", "true"),
        ("WANDB_SHOW_INFO", "false"),
        ("WANDB_SHOW_WARNINGS", "false"),
    ):
        os.environ.setdefault(key, value)
    import wandb

    settings = wandb.Settings()
    settings.update_from_env_vars(dict(os.environ))
    wandb.termsetup(settings, None)
