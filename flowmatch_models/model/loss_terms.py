"""The loss names, in one place.

``FlowMatching.loss`` (flow.py) returns its scalar terms under ``LossTerm.key``; the Lightning
module logs them as ``train/<key>`` (``LossTerm.logged``) and the held-out loss as ``VAL_LOSS``;
the progress line (train/callbacks.py), the session's result and its record (train/run.py,
defs/training_assets.py: ``TrainResult.metrics``, keyed by ``key`` and ``VAL_METRIC``), the
asset's metadata (``LossTerm.metadata``), the loss curve (figures/curves.py: ``label``,
``panel``) and the validation records (catalog/records.py) read them from here.
tests/test_loss_terms.py fails when one of these names is written in another file.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LossTerm:
    key: str  # FlowMatching.loss's key, TrainResult.metrics's and the run record's
    metadata: str  # the training asset's metadata name
    label: str  # the loss curve's legend
    panel: int  # the loss curve's panel: 0 the loss (log axis), 1 the REPA alignment
    positive: bool = False  # drawn on the log axis only while it stays positive

    @property
    def logged(self) -> str:
        """Its name in Lightning's metrics (``metrics.csv``, wandb, ``callback_metrics``)."""
        return f"train/{self.key}"


TOTAL, FM, REPA = "loss", "fm", "repa"
LOSS_TERMS = (  # in the progress line's order ("step N/M loss ...")
    # fm + lambda * -cos: negative with REPA, so the curve draws it only while positive
    LossTerm(TOTAL, "total_loss", "total", 0, positive=True),
    # the flow-matching term: what falls as it learns (the metadata's headline)
    LossTerm(FM, "fm_loss", "flow matching", 0),
    LossTerm(REPA, "repa_loss", "repa (-cos)", 1),
)
TERMS = {t.key: t for t in LOSS_TERMS}

# the held-out loss (EMA, fixed noise and t grid): logged as VAL_LOSS (the mean over the grid),
# VAL_BIN + k per t-bin and VAL_SAMPLES; kept in TrainResult.metrics and the record as VAL_METRIC
VAL_LOSS, VAL_BIN, VAL_SAMPLES = "val/loss", "val/t", "val/samples"
VAL_METRIC = "val_loss"
METADATA = {t.key: t.metadata for t in LOSS_TERMS} | {VAL_METRIC: VAL_METRIC}
HEADLINE = (TERMS[FM].metadata, VAL_METRIC)  # the metadata's first entries


def bucket_loss(height_px: int, width_px: int) -> str:
    """The total loss of one aspect-ratio bucket's batches (logged with buckets)."""
    return f"{TERMS[TOTAL].logged}_{height_px}x{width_px}"
