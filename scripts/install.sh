#!/usr/bin/env bash
# Install flowmatch into ./.venv (idempotent).
#
# torch first, chosen for the machine: with an NVIDIA GPU, the default (CUDA) build from PyPI;
# without one, the CPU build (torch==2.13.0; set FLOWMATCH_TORCH_INDEX to a CPU wheel index,
# e.g. https://download.pytorch.org/whl/cpu, where PyPI's default build would be CUDA). Then the
# project with its dev extra. An existing torch is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip install --progress-bar off)
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "install: NVIDIA GPU found, installing CUDA torch"
    "${PIP[@]}" -q "torch>=2.4,<2.15"
  else
    echo "install: no GPU found, installing CPU torch ${FLOWMATCH_TORCH_VERSION:-2.13.0}"
    "${PIP[@]}" -q "torch==${FLOWMATCH_TORCH_VERSION:-2.13.0}" ${FLOWMATCH_TORCH_INDEX:+--index-url "$FLOWMATCH_TORCH_INDEX"}
  fi
fi
"${PIP[@]}" -q -e ".[dev]"
# the lowest Lightning pyproject.toml allows, beside the venv's, for tests/test_lightning_floor.py
# (a mid-epoch resume with accumulation is exact from 2.5 on; 2.4 shifts its groups)
[ -d .venv/lightning-floor/lightning ] || "${PIP[@]}" -q --no-deps --target .venv/lightning-floor "lightning==2.5.0"
echo "install: done ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__, "cuda" if torch.cuda.is_available() else "cpu")'))"
