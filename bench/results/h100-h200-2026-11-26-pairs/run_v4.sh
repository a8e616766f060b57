#!/bin/bash
export PYTHONPATH=.
nvidia-smi --query-gpu=name,temperature.gpu --format=csv,noheader
S=$(date +%s)
for r in 1 2 3; do for t in rot:. rotstep:.v4; do
  FAGEN_CACHE_DIR=$PWD/.kcache python3 scratch/ab_causal.py ${t#*:} ${t%%:*} 64,128 1024,2048,4096,8192,16384 2>&1 | grep -v Warn | tee -a $OUT/ab.log
done; done
echo "ab t=$(( $(date +%s) - S ))"
