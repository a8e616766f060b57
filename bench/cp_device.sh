#!/usr/bin/env bash
# Context parallelism (issue 41) on one 4-GPU host (nvidia-h100-x4 / nvidia-h200-x4), in about 8 minutes:
#   1. every kernel below compiled at once into fagen's cache (bench/cp_precompile.py, one process a kernel);
#   2. the GPU ring tests, W = 2 and 4 (tests/gpu/test_ring_gpu.py: outputs and gradients against float64 and
#      single-GPU fagen, tensors' gradients included; the tests spawn their own ranks);
#   3. fagen bench --context-parallel on 4 GPUs (256k tokens causal d128, forward + backward, against one GPU and
#      torch's context_parallel with cuDNN; the window 4096 pruned ring at 512k against one GPU's shard), then on
#      2 GPUs (128k; window at 256k);
#   4. a short table last (summary.md).
# Run from the repository root:  OUT=/some/folder bash bench/cp_device.sh   (OUT defaults to .out/cp; CP_W2=0
# leaves out the 2-GPU bench)
# Each part has its own time limit, so a slow one cannot starve the next; the logs hold what each printed.
set -u -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # NVLink multicast stays off
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-.out/cp}
PY=${PYTHON:-python3}
mkdir -p "$OUT/w4" "$OUT/w2"
start=$SECONDS

part() {  # part NAME LIMIT_S LOG COMMAND...: run COMMAND under LIMIT_S seconds, its output in LOG; prints its rc
  local name=$1 limit=$2 log=$3
  shift 3
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1
  local rc=$?
  echo "$name: rc $rc$([ $rc -eq 124 ] && echo ' (time limit)'), $((SECONDS - t0)) s" | tee -a "$OUT/summary.md" >&2
}

: >"$OUT/summary.md"
{
  nvidia-smi -L
  nvidia-smi topo -m
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version(), 'nccl', torch.cuda.nccl.version())"
} >"$OUT/precompile.log" 2>&1
part "precompile" 80 "$OUT/precompile.log.part" $PY bench/cp_precompile.py
cat "$OUT/precompile.log.part" >>"$OUT/precompile.log" && rm -f "$OUT/precompile.log.part"

part "ring GPU tests (W=2, 4)" 300 "$OUT/ring_tests.log" \
  $PY -m pytest -q -rA -p no:cacheprovider --durations=0 tests/gpu/test_ring_gpu.py

part "bench, 4 GPUs" 190 "$OUT/bench_w4.log" \
  $PY -m fagen bench --context-parallel --gpus 4 --seqlen 65536 --window 4096 --rounds 5 --out "$OUT/w4"
[ "${CP_W2:-1}" = 1 ] && part "bench, 2 GPUs" 100 "$OUT/bench_w2.log" \
  $PY -m fagen bench --context-parallel --gpus 2 --seqlen 65536 --window 4096 --rounds 5 --out "$OUT/w2"

{
  echo
  echo "## ring GPU tests"
  grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed|error" "$OUT/ring_tests.log" | tail -15
  for w in w4 w2; do
    echo
    if [ -s "$OUT/$w/context_parallel.md" ]; then
      grep -v "^# " "$OUT/$w/context_parallel.md" | sed '/^Model/,$d'
    else
      echo "## bench $w: no table; its log ends:"
      tail -5 "$OUT/bench_$w.log"
    fi
  done
  echo
  echo "total $((SECONDS - start)) s"
} >>"$OUT/summary.md"
cat "$OUT/summary.md"
