#!/bin/bash
export PYTHONPATH=.
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm --format=csv,noheader
S=$(date +%s)
timeout 200 python3 -m fagen bench --dims 64,128,256 --seqlens 2048,4096,8192,16384 --causal both --backends fagen,cudnn --rounds 2 -o $OUT/fwd > $OUT/bench-fwd.log 2>&1
echo "bench rc=$? t=$(( $(date +%s) - S ))"
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm --format=csv,noheader
sed -n '/^variant/,/^```/p' $OUT/fwd/bench.md | head -30
