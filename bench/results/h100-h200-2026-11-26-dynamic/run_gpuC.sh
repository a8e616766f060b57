#!/bin/bash
export PYTHONPATH=.
S=$(date +%s)
(timeout 450 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_flex_gpu.py tests/gpu/test_block_mask_gpu.py "tests/gpu/test_kernel_gpu.py" -k "not test_kernel_gpu or compute_sanitizer or catches" > $OUT/tests3.log 2>&1; echo "tests3 rc=$? t=$(( $(date +%s) - S ))" >> $OUT/tests3.log) &
(timeout 450 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_autograd_gpu.py > $OUT/tests4.log 2>&1; echo "tests4 rc=$? t=$(( $(date +%s) - S ))" >> $OUT/tests4.log) &
wait
tail -n 3 $OUT/tests3.log $OUT/tests4.log; grep -h FAILED $OUT/tests3.log $OUT/tests4.log | head
