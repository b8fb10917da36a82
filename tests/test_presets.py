"""A model size is one `dit.Preset` record: the training config's list of names is that list."""

from __future__ import annotations

import typing

from flowmatch_models.model.dit import PRESETS
from flowmatch_models.train.config import ModelConfig


def test_the_config_accepts_exactly_the_presets_dit_defines():
    names = typing.get_args(ModelConfig.model_fields["preset"].annotation)
    assert list(names) == list(PRESETS), (
        "train/config.py ModelConfig.preset lists other names than model/dit.py PRESETS: "
        "a new model size is one Preset in PRESETS and its name in the Literal"
    )
