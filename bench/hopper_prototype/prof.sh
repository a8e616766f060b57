#!/bin/bash
# ncu: speed of light + warp stall reasons for one launch of a variant (args: VARIANT N CAUSAL TAG)
timeout 40 ncu --kernel-name fa3_fwd --launch-count 1 --section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis \
  --page details --csv python3 run.py prof $1 $2 $3 > $OUT/ncu_$4.csv 2>&1
grep -E '"(Compute \(SM\) Throughput|Memory Throughput|Duration|Executed Ipc Active|Stall[^"]*|Warp Cycles Per Issued Instruction|Issue Slots Busy|SM Busy)"' $OUT/ncu_$4.csv | awk -F'","' '{print "'$4'", $(NF-2), $NF}' | head -30
