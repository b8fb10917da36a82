#!/usr/bin/env bash
# The full CPU runs behind examples/README.md's table and figures: 3 papers x 4 data sets, one
# after another on one thread, then the table (examples/out/table.md) and the figures
# (examples/figures/). Usage: bash examples/run_all.sh [python]   (about 15-20 min on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-python}
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
for example in flow_matching nonequilibrium ddpm; do
  for data in swissroll moons 8gaussians digits; do
    "$PY" examples/$example.py --data $data --seed 0 --out examples/out
  done
done
"$PY" examples/make_table.py examples/out
