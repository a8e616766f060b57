#!/bin/bash
nvidia-smi --query-gpu=name,temperature.gpu,clocks.max.sm --format=csv,noheader
S=$(date +%s)
export FAGEN_CACHE_DIR=$PWD/.kcache
timeout 200 env PYTHONPATH=. python3 -m pytest -q -x tests/gpu/test_wgmma_gpu.py -k "persistent or gqa or fully_masked or fall_back" 2>&1 | tail -5 | tee $OUT/tests.log
echo "tests t=$(( $(date +%s) - S ))"
for r in 1 2 3; do
  for t in base:.base dyn:.; do
    python3 scratch/rot_ab.py ${t#*:} ${t%%:*} 64,128 1024,2048,4096,8192,16384 2>&1 | tee -a $OUT/dyn_ab.log | grep -v Warn
  done
done
echo "t=$(( $(date +%s) - S ))"
