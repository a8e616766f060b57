#!/bin/bash
# compile probes (twice) and host cost per call, on HEAD's tree
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/device.txt
for r in 1 2; do python3 scratch/f1/ctimes.py . 2>&1 | tee -a $OUT/ctimes.log; done
for r in 1 2 3; do PYTHONPATH=. python3 -c "
from fagen.tools import bench
o = bench.host_overhead()
print({k: v for k, v in o.items()})" 2>&1 | grep -v Warn | tee -a $OUT/host.log; done
PYTHONPATH=. python3 scratch/host_parts.py 2>&1 | head -14 | tee $OUT/host-parts.log
