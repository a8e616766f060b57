#!/bin/bash
# A/B: d192/d256 persistent with O over Q (.vB) against a block per tile (.base); then the wgmma GPU tests of .vB at d192/d256
cd "$(dirname "$0")/.."
R=$PWD
export FAGEN_CACHE_DIR=$R/.kcache
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm --format=csv,noheader | tee $OUT/gpu.txt
for r in 1 2 3; do
  for t in base vB; do
    d=.base; [ $t = vB ] && d=.vB
    (cd /tmp && python3 $R/scratch/rot_ab.py $R/$d $t 256,192 2048,4096,8192,16384) 2>&1 | grep -v Warn | tee -a $OUT/ab.log
  done
done
cp -r tests .vB/ && cd .vB && timeout 240 python3 -m pytest -q -x tests/gpu/test_wgmma_gpu.py -k "256 or 192" 2>&1 | tail -8 | tee $OUT/wgmma_gpu.log
python3 -c "import fagen; print(fagen.__file__)"
echo ==== ; grep -h "d256\|d192" $OUT/ab.log | sort -s -k2,3
