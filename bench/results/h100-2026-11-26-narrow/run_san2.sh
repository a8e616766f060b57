#!/bin/bash
export PYTHONPATH=.
for only in hopper backward_wgmma; do
  timeout 250 compute-sanitizer --tool racecheck python3 tests/gpu/sanitize_case.py $only > $OUT/san_racecheck_$only.log 2>&1; echo "racecheck $only rc=$?"
  grep -h "RACECHECK SUMMARY\|Internal" $OUT/san_racecheck_$only.log; grep -o "access at [A-Za-z0-9_]*" $OUT/san_racecheck_$only.log | sort | uniq -c
done
timeout 120 compute-sanitizer --tool synccheck --error-exitcode 1 python3 tests/gpu/sanitize_case.py hopper > $OUT/san_synccheck_hopper.log 2>&1; echo "synccheck hopper rc=$?"; grep -h "ERROR SUMMARY" $OUT/san_synccheck_hopper.log
