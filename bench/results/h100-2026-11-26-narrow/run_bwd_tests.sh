#!/bin/bash
# the tensor-core backward tests (mma and wgmma) and the autograd tests on the working tree; sanitizers on the
# wgmma backward and Hopper cases
export PYTHONPATH=.
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
timeout 330 python3 -m pytest -q -k "tc_" -p no:randomly tests/gpu/test_backward_gpu.py 2>&1 | tail -12 | tee $OUT/test_backward_tc.log
timeout 60 compute-sanitizer --tool memcheck --error-exitcode 1 python3 tests/gpu/sanitize_case.py backward_wgmma > $OUT/san_memcheck_backward_wgmma.log 2>&1; echo "memcheck backward_wgmma rc=$?"; grep -h "ERROR SUMMARY" $OUT/san_memcheck_backward_wgmma.log
timeout 60 compute-sanitizer --tool memcheck --error-exitcode 1 python3 tests/gpu/sanitize_case.py hopper > $OUT/san_memcheck_hopper.log 2>&1; echo "memcheck hopper rc=$?"; grep -h "ERROR SUMMARY" $OUT/san_memcheck_hopper.log
