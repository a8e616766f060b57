#!/bin/bash
export PYTHONPATH=.
nvidia-smi --query-gpu=name,temperature.gpu --format=csv,noheader
S=$(date +%s)
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_runtime_gpu.py > $OUT/runtime.log 2>&1; echo "runtime rc=$? t=$(( $(date +%s) - S ))"
tail -n 2 $OUT/runtime.log; grep -h FAILED $OUT/runtime.log | head
export FAGEN_CACHE_DIR=$PWD/.kcache
for r in 1 2; do for t in base:.base new:.; do python3 scratch/host_ab.py ${t#*:} ${t%%:*} 2>&1 | grep -v Warn | tee -a $OUT/host_ab.log; done; done
echo "t=$(( $(date +%s) - S ))"
