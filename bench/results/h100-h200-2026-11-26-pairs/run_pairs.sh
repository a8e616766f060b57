#!/bin/bash
nvidia-smi --query-gpu=name --format=csv,noheader
S=$(date +%s)
for r in 1 2; do
  for t in base:.base v3:.v3; do
    FAGEN_CACHE_DIR=$PWD/.kc_${t%%:*} python3 scratch/pairs_ab.py ${t#*:} ${t%%:*} 2>&1 | tee -a $OUT/pairs_ab.log | grep -v Warn
  done
done
echo "t=$(( $(date +%s) - S ))"
