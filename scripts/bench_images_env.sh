#!/usr/bin/env bash
# Create the bench-only img2dataset virtualenv at .bench/img2dataset-venv.
#
# img2dataset 1.47 pins old dependencies (albumentations, fsspec, ...), so it lives in its own
# virtualenv and never in the project's environment. Used only by
# `python -m flowmatch_assets.bench.images`, which runs it as a subprocess.
#
# Usage: scripts/bench_images_env.sh            (from the repo root)
#        PYTHON=python3.11 scripts/bench_images_env.sh
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV=.bench/img2dataset-venv

if [ -x "$VENV/bin/img2dataset" ] && NO_ALBUMENTATIONS_UPDATE=1 "$VENV/bin/python" -c "import img2dataset" 2>/dev/null; then
    echo "img2dataset venv already present: $VENV"
    exit 0
fi

mkdir -p .bench
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip
"$VENV/bin/pip" install --quiet "img2dataset==1.47.0"
NO_ALBUMENTATIONS_UPDATE=1 "$VENV/bin/python" -c "import img2dataset, cv2; print('img2dataset ok; OpenCV', cv2.__version__)"
echo "created $VENV"
