#!/bin/bash
# d256 persistent (O stored from registers, no O tile) against base
export FAGEN_CACHE_DIR=$PWD/.kcache
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/device.txt
for r in 1 2 3; do
  for t in .base .vP; do
    python3 scratch/rot_ab.py $t ${t#.} 256 2048,4096,8192,16384 2>&1 | grep -v Warn | tee -a $OUT/ab.log
  done
done
