#!/bin/bash
export PYTHONPATH=.
nvidia-smi --query-gpu=name --format=csv,noheader
S=$(date +%s)
(timeout 400 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_wgmma_gpu.py tests/gpu/test_variants_gpu.py tests/gpu/test_intmath_gpu.py tests/gpu/test_gather_gpu.py > $OUT/fwd.log 2>&1; echo "fwd rc=$?" >> $OUT/fwd.log) &
(timeout 250 compute-sanitizer --tool memcheck python3 tests/gpu/sanitize_case.py hopper > $OUT/san_memcheck_hopper.log 2>&1; echo "memcheck hopper rc=$? $(grep 'ERROR SUMMARY' $OUT/san_memcheck_hopper.log | tail -1) fails=$(grep -c FAIL $OUT/san_memcheck_hopper.log)" >> $OUT/san.log;
 timeout 300 compute-sanitizer --tool racecheck python3 tests/gpu/sanitize_case.py hopper > $OUT/san_racecheck_hopper.log 2>&1; echo "racecheck hopper rc=$? $(grep 'ERROR SUMMARY' $OUT/san_racecheck_hopper.log | tail -1) fails=$(grep -c FAIL $OUT/san_racecheck_hopper.log)" >> $OUT/san.log) &
wait
echo "t=$(( $(date +%s) - S ))"
tail -n 2 $OUT/fwd.log; grep -h FAILED $OUT/fwd.log | head; cat $OUT/san.log
