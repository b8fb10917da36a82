"""What ``device: auto`` and ``dtype: auto`` resolve to (a GPU: cuda and bf16; else the CPU and
fp32): one rule, read by the loaders (``loading.py``) and by the fingerprints that record it
(``flowmatch_models/storage/fingerprint.py``)."""

from __future__ import annotations

import torch


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {
        "fp32": torch.float32,
        "float32": torch.float32,
        "bf16": torch.bfloat16,
        "bfloat16": torch.bfloat16,
        "fp16": torch.float16,
        "float16": torch.float16,
    }
    if dtype not in table:
        raise ValueError(f"unknown dtype {dtype!r}; use auto, fp32, bf16 or fp16")
    return table[dtype]
