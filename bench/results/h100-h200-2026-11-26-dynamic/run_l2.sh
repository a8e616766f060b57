#!/bin/bash
nvidia-smi --query-gpu=name,temperature.gpu --format=csv,noheader
S=$(date +%s)
export FAGEN_CACHE_DIR=$PWD/.kcache CAUSAL_ONLY=1
for r in 1 2; do
  for t in dyn32:. dyn16:.v16 dyn8:.v8 base:.base; do
    python3 scratch/rot_ab.py ${t#*:} ${t%%:*} 64,128 1024,2048,4096,16384 2>&1 | tee -a $OUT/l2_ab.log | grep -v Warn
  done
done
echo "t=$(( $(date +%s) - S ))"
