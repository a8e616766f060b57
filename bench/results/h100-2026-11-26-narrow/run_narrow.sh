#!/bin/bash
# A/B of the narrow first tile (d64/d128 causal), then the wgmma GPU tests on the new tree
cd "$(dirname "$0")/.."
export FAGEN_CACHE_DIR=$PWD/.kcache
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm --format=csv,noheader | tee $OUT/gpu.txt
for r in 1 2 3; do
  for t in base vA; do
    d=.base; [ $t = vA ] && d=.vA
    (cd /tmp && CAUSAL_ONLY=1 python3 $OLDPWD/scratch/rot_ab.py $OLDPWD/$d $t 64,128 2048,4096,8192,16384) 2>&1 | grep -v Warn | tee -a $OUT/ab.log
  done
done
PYTHONPATH=. timeout 300 python3 -m pytest -q -x -m gpu tests/test_wgmma_gpu.py 2>&1 | tail -15 | tee $OUT/wgmma_gpu.log
echo ==== ; grep -h "d64\|d128" $OUT/ab.log
