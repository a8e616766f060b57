#!/bin/bash
# HEAD's wgmma GPU tests and compute-sanitizer on the Hopper cases
export PYTHONPATH=.
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
timeout 300 python3 -m pytest -q tests/gpu/test_wgmma_gpu.py 2>&1 | tail -4 | tee $OUT/test_wgmma_gpu.log
for t in memcheck synccheck; do
  timeout 80 compute-sanitizer --tool $t --error-exitcode 1 python3 tests/gpu/sanitize_case.py hopper > $OUT/san_$t.log 2>&1; echo "$t rc=$?"; tail -2 $OUT/san_$t.log
done
timeout 80 compute-sanitizer --tool racecheck python3 tests/gpu/sanitize_case.py hopper > $OUT/san_racecheck.log 2>&1; echo "racecheck rc=$?"
grep -h "RACECHECK SUMMARY\|Internal" $OUT/san_racecheck.log; grep -o "access at flash_[A-Za-z0-9_]*" $OUT/san_racecheck.log | sort -u | head
