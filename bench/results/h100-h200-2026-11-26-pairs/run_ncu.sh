#!/bin/bash
export PYTHONPATH=.
for N in 2048 16384; do
echo "== d64 causal N=$N"
timeout 200 ncu --clock-control none -k regex:"flash_fwd|cudnn" --launch-skip 2 --launch-count 2 --section ComputeWorkloadAnalysis --section SpeedOfLight --metrics sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,smsp__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,sm__pipe_shared_cycles_active.avg.pct_of_peak_sustained_active python3 scratch/ncu_d64.py $N > $OUT/ncu_$N.log 2>&1
grep -E "^  [a-z_]+.*\(|Duration|Pipeline|pipe|issue|Compute \(SM\) Throughput|Tensor|Executed Ipc" $OUT/ncu_$N.log | cut -c1-150
done
