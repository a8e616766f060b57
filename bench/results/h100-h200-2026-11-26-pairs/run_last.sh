#!/bin/bash
export PYTHONPATH=.
S=$(date +%s)
timeout 300 python3 -m pytest -q -p no:cacheprovider $(cat scratch/last20.txt) > $OUT/bwd_last20.log 2>&1; echo "rc=$?"
echo "t=$(( $(date +%s) - S ))"; tail -n 2 $OUT/bwd_last20.log; grep -h FAILED $OUT/bwd_last20.log | head
