#!/bin/bash
export FAGEN_CACHE_DIR=$PWD/.kcache
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/device.txt
PYTHONPATH=. python3 scratch/f1/conc.py scratch/f1/gen.base/flash_fwd_full_d128_bf16_sm90a_wgmma_m128n160w12s2p.cu 2>&1 | tee $OUT/conc.log
for r in 1 2 3; do
  for t in .base .; do
    python3 scratch/rot_ab.py $t $([ $t = . ] && echo new || echo base) 64,128,256 2048,4096,16384 2>&1 | grep -v Warn | tee -a $OUT/ab.log
  done
done
