#!/bin/bash
# the wgmma forward tests on the working tree (descriptor adds), then the backward A/B: .vF against .base
cd "$(dirname "$0")/.."
R=$PWD
export FAGEN_CACHE_DIR=$R/.kcache
nvidia-smi --query-gpu=name,temperature.gpu --format=csv,noheader | tee $OUT/gpu.txt
for r in 1 2 3; do
  for t in base vF; do
    (cd /tmp && python3 $R/scratch/bwd_ab.py $R/.$t $t) 2>&1 | grep -v Warn | tee -a $OUT/bwd_ab.log
  done
done
PYTHONPATH=. timeout 250 python3 -m pytest -q tests/gpu/test_wgmma_gpu.py 2>&1 | tail -3 | tee $OUT/test_wgmma_gpu.log
