#!/usr/bin/env bash
# The GPU check: precalc, the base training step and the loader on this machine's CUDA GPU,
# in one JSON (default gpu_check.json) within ~9 minutes. On a machine without one it says so
# and exits 0. Usage: bash scripts/gpu_check.sh [--out FILE] [--budget-s 540]
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/install.sh
exec .venv/bin/flowmatch bench gpu "$@"
