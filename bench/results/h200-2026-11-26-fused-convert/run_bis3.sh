export PYTHONPATH=.
for t in .n9 .n10 .base; do timeout 60 python3 scratch/prof_one.py $t 2>&1 | grep "^\."; done
