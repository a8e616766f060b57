#!/bin/bash
export PYTHONPATH=.
nvidia-smi --query-gpu=name,temperature.gpu --format=csv,noheader
S=$(date +%s)
FAGEN_CACHE_DIR=$PWD/.kcache timeout 240 python3 -m fagen tune --dims 64 --causal yes --seqlen 2048,4096,8192,16384 > $OUT/tune64.log 2>&1; echo "tune rc=$?"; tail -3 $OUT/tune64.log | cut -c1-250
cp fagen/tuned.json $OUT/tuned.json
echo "t=$(( $(date +%s) - S ))"
timeout 100 python3 -m fagen bench --dims 64 --seqlens 2048,4096,8192,16384 --causal yes --backends fagen,cudnn --rounds 2 --no-memory -o $OUT/after64 > $OUT/after64.log 2>&1; sed -n '/^none/p' $OUT/after64/bench.md
echo "t=$(( $(date +%s) - S ))"
timeout 330 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_autograd_gpu.py tests/gpu/test_backward_gpu.py > $OUT/bwd.log 2>&1; echo "bwd rc=$?"
echo "t=$(( $(date +%s) - S ))"
tail -n 2 $OUT/bwd.log; grep -h FAILED $OUT/bwd.log | head
