#!/bin/bash
export PYTHONPATH=.
nvidia-smi --query-gpu=name,temperature.gpu --format=csv,noheader
S=$(date +%s)
timeout 230 python3 -m fagen bench --dims 64,128,256 --seqlens 2048,4096,8192,16384 --causal both --backends fagen,cudnn --rounds 2 -o $OUT/fwd > $OUT/bench-fwd.log 2>&1
echo "bench rc=$? t=$(( $(date +%s) - S ))"
sed -n '/^variant/,/^```/p' $OUT/fwd/bench.md | head -30
timeout 330 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernel_gpu.py tests/gpu/test_flex_gpu.py tests/gpu/test_block_mask_gpu.py > $OUT/tests2.log 2>&1; echo "tests rc=$?"
echo "t=$(( $(date +%s) - S ))"
tail -n 2 $OUT/tests2.log; grep -h FAILED $OUT/tests2.log | head
