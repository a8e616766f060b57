#!/bin/bash
# one loop over the key tiles (first tile folded in): NVRTC time, GPU tests, compile probes
export FAGEN_CACHE_DIR=$PWD/.kcache
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/device.txt
nproc; lscpu | grep "Model name"
REP=2 PYTHONPATH=. python3 scratch/f1/ct.py scratch/f1/gen.base scratch/f1/gen.new 2>&1 | tee $OUT/nvrtc.log
PYTHONPATH=. timeout 300 python3 -m pytest -q tests/gpu/test_wgmma_gpu.py -p no:cacheprovider 2>&1 | tail -5 | tee $OUT/tests.log
python3 scratch/f1/ctimes.py . 2>&1 | tee $OUT/ctimes-new.log
python3 scratch/f1/ctimes.py .base 2>&1 | tee $OUT/ctimes-base.log
