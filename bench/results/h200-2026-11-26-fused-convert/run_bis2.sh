export PYTHONPATH=.
for t in .n6 .n8 .n5; do timeout 60 python3 scratch/prof_one.py $t 2>&1 | grep "^\."; done
