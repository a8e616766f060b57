#!/bin/bash
export PYTHONPATH=.
S=$(date +%s)
(timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_decode_gpu.py > $OUT/decode.log 2>&1; echo "decode rc=$?" >> $OUT/decode.log) &
(timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_backward_gpu.py -k "simt" > $OUT/bwd_simt.log 2>&1; echo "bwd rc=$?" >> $OUT/bwd_simt.log) &
wait
timeout 200 compute-sanitizer --tool memcheck python3 tests/gpu/sanitize_case.py decode > $OUT/san_memcheck_decode.log 2>&1; echo "memcheck decode rc=$? $(grep 'ERROR SUMMARY' $OUT/san_memcheck_decode.log | tail -1) fails=$(grep -c FAIL $OUT/san_memcheck_decode.log)"
timeout 200 compute-sanitizer --tool racecheck python3 tests/gpu/sanitize_case.py decode > $OUT/san_racecheck_decode.log 2>&1; echo "racecheck decode rc=$? $(grep 'SUMMARY' $OUT/san_racecheck_decode.log | tail -1) fails=$(grep -c FAIL $OUT/san_racecheck_decode.log)"
echo "t=$(( $(date +%s) - S ))"
tail -n 2 $OUT/decode.log $OUT/bwd_simt.log; grep -h FAILED $OUT/*.log | head
