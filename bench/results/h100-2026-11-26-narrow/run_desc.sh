#!/bin/bash
# A/B: wgmma descriptors by adds, unsigned ring arithmetic (vF) against HEAD (base)
cd "$(dirname "$0")/.."
R=$PWD
export FAGEN_CACHE_DIR=$R/.kcache
nvidia-smi --query-gpu=name,temperature.gpu --format=csv,noheader | tee $OUT/gpu.txt
for r in 1 2 3; do
  for t in base vF; do
    (cd /tmp && python3 $R/scratch/rot_ab.py $R/.$t $t 64,128,256 2048,4096,16384) 2>&1 | grep -v Warn | tee -a $OUT/ab.log
  done
done
echo ==== ; grep -h "d64\|d128\|d256" $OUT/ab.log | sort -s -k2,3
