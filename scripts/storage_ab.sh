#!/usr/bin/env bash
# The storage A/B of issue 20 (BENCHMARKS.md "Storage A/B"): the demo's data lossless, in the
# default storage, and at the default's PD12M-size error (the same arrays before coding, re-coded
# by the pipeline), then the learning benchmark on each: seeds 0 and 1 (default: seed 0).
# ~12 min a learning run on one thread; re-running skips what is done.
set -euo pipefail
cd "$(dirname "$0")/.."
B=.bench/ab
FM=.venv/bin/flowmatch
mkdir -p $B
printf 'encoders:\n  lossy: {}\n' > $B/lossless.yaml
if [ ! -f $B/lossless/.done ]; then
  rm -rf $B/lossless
  FLOWMATCH_SETTINGS=$PWD/$B/lossless.yaml $FM demo --data-root $B/lossless --train-steps 0
  touch $B/lossless/.done
fi
# the default storage's error on PD12M-like captions (text rel RMS 3.2%), reproduced on the
# demo's short captions: fewer bits (text pca1.5: 2.9%, DINO pca0.5: 7.1%)
printf 'encoders:\n  lossy: {text_embeddings: pca1.5, dino_features: pca0.5}\n' > $B/pd12merr.yaml
for s in default pd12merr; do
  [ -f $B/$s/.done ] && continue
  rm -rf $B/$s && cp -a $B/lossless $B/$s && rm -rf $B/$s/.done $B/$s/catalog/catalog.duckdb*
  settings=()
  [ $s = pd12merr ] && settings=(FLOWMATCH_SETTINGS=$PWD/$B/pd12merr.yaml)
  env FLOWMATCH_DATA_ROOT=$PWD/$B/$s "${settings[@]}" $FM materialize --stale
  touch $B/$s/.done
done
for seed in 0 1; do
  for s in lossless pd12merr default; do
    [ "$seed" = 1 ] && [ "$s" = default ] && continue
    [ -s $B/$s-$seed.json ] && continue
    OMP_NUM_THREADS=1 $FM bench learning --data-root $B/$s --variants repa+pe --steps 2000 \
      --eval-every 500 --toy-steps 0 --set run.seed=$seed --out $B/out-$s-$seed | tail -1 > $B/$s-$seed.json
  done
done
