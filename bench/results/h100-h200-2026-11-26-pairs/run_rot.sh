#!/bin/bash
export FAGEN_CACHE_DIR=$PWD/.kcache
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
S=$(date +%s)
for r in 1 2; do
  for t in base:.base rot:. v2:.v2; do
    python3 scratch/rot_ab.py ${t#*:} ${t%%:*} 64,128,256 2048,4096,8192,16384 2>&1 | tee -a $OUT/rot_ab.log | grep -v Warn
  done
done
echo "t=$(( $(date +%s) - S ))"
