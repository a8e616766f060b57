#!/bin/bash
export PYTHONPATH=.
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw --format=csv,noheader
S=$(date +%s)
timeout 200 python3 -m fagen bench --dims 64,128,256 --seqlens 2048,4096,8192,16384 --causal both --backends fagen,cudnn --rounds 2 -o $OUT/fwd > $OUT/bench-fwd.log 2>&1
echo "bench rc=$? t=$(( $(date +%s) - S ))"
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw --format=csv,noheader
sed -n '/^variant/,/^```/p' $OUT/fwd/bench.md | head -30
for r in 1 2; do for t in base:.base new:.; do
  FAGEN_CACHE_DIR=$PWD/.kcache python3 scratch/rot_ab.py ${t#*:} ${t%%:*} 64,128 1024,2048,4096,8192,16384 2>&1 | grep -v Warn | tee -a $OUT/ab.log
done; done
echo "ab t=$(( $(date +%s) - S ))"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_runtime_gpu.py > $OUT/tests4.log 2>&1; echo "tests rc=$?"
echo "t=$(( $(date +%s) - S ))"
tail -n 2 $OUT/tests4.log; grep -h FAILED $OUT/tests4.log | head
