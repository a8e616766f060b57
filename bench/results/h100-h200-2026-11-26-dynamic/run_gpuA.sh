#!/bin/bash
export PYTHONPATH=.
nvidia-smi --query-gpu=name,temperature.gpu --format=csv,noheader
S=$(date +%s)
(timeout 520 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_wgmma_gpu.py tests/gpu/test_runtime_gpu.py tests/gpu/test_variants_gpu.py tests/gpu/test_intmath_gpu.py tests/gpu/test_gather_gpu.py > $OUT/fwd.log 2>&1; echo "fwd rc=$?" >> $OUT/fwd.log) &
(for tool in memcheck racecheck synccheck; do timeout 250 compute-sanitizer --tool $tool python3 tests/gpu/sanitize_case.py hopper > $OUT/san_${tool}_hopper.log 2>&1; echo "$tool hopper rc=$? $(grep 'ERROR SUMMARY' $OUT/san_${tool}_hopper.log | tail -1) fails=$(grep -c FAIL $OUT/san_${tool}_hopper.log) t=$(( $(date +%s) - S ))" >> $OUT/san.log; done) &
wait
echo "t=$(( $(date +%s) - S ))"
tail -n 2 $OUT/fwd.log; grep -h FAILED $OUT/fwd.log | head; cat $OUT/san.log
