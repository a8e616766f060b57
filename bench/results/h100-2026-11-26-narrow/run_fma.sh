#!/bin/bash
# A/B: a share of the forward's exps on the FMA pipe (vC: 1 chunk in 4, vD: 1 in 8, vE: 1 in 2) against HEAD (base)
cd "$(dirname "$0")/.."
R=$PWD
export FAGEN_CACHE_DIR=$R/.kcache
nvidia-smi --query-gpu=name,temperature.gpu --format=csv,noheader | tee $OUT/gpu.txt
for r in 1 2 3; do
  for t in base vC vD vE; do
    (cd /tmp && python3 $R/scratch/rot_ab.py $R/.$t $t 64,128 2048,4096,16384) 2>&1 | grep -v Warn | tee -a $OUT/ab.log
  done
done
echo ==== ; grep -h "d64\|d128" $OUT/ab.log | sort -s -k2,3
