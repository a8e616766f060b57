#!/bin/bash
# Nsight Compute: tensor-pipe figures of fagen's forward and SDPA's cuDNN kernel on the cases of issue 9
export PYTHONPATH=.
nvidia-smi --query-gpu=name,temperature.gpu --format=csv,noheader | tee $OUT/gpu.txt
ncu --version | tail -1 | tee -a $OUT/gpu.txt
ncu --query-metrics --chip gh100 > $OUT/metrics-gh100.txt 2>&1
grep -i "tensor" $OUT/metrics-gh100.txt | cut -c1-160 > $OUT/metrics-tensor.txt
M=gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,sm__inst_executed_pipe_tensor_op_gmma.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__pipe_shared_cycles_active.avg.pct_of_peak_sustained_active
for name in $(grep -o "^sm__pipe_tensor[a-z_]*cycles_active\b" $OUT/metrics-tensor.txt | sort -u); do M=$M,$name.avg.pct_of_peak_sustained_active; done
echo "metrics: $M" | tee -a $OUT/gpu.txt
for c in "128 0 8192" "128 0 2048" "64 1 2048" "256 1 2048" "128 1 8192"; do
  set -- $c
  echo "== d$1 causal=$2 N=$3" | tee -a $OUT/ncu.log
  timeout 150 ncu --clock-control none -k regex:"flash_fwd|cudnn" --launch-skip 2 --launch-count 2 --metrics $M python3 scratch/ncu_case.py $1 $2 $3 >> $OUT/ncu.log 2>&1
done
grep -E "^==|^  [a-zA-Z_]|  (gpu__|sm__|smsp__)" $OUT/ncu.log | cut -c1-140
