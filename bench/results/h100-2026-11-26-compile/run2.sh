#!/bin/bash
# A/B: base tree against the working tree, cuDNN in the same process
export FAGEN_CACHE_DIR=$PWD/.kcache
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/device.txt
for r in 1 2 3; do
  for t in .base .; do
    python3 scratch/rot_ab.py $t $([ $t = . ] && echo new || echo base) 64,128,256 2048,4096,16384 2>&1 | grep -v Warn | tee -a $OUT/ab.log
  done
done
