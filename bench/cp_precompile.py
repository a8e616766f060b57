"""Compile, in parallel, every kernel that bench/cp_device.sh runs, into fagen's disk cache: the piece programs of
the GPU ring tests (tests/gpu/test_ring_gpu.py), the single-GPU kernels they compare with where they take options
alone, and those of `fagen bench --context-parallel` for W = 2 and 4 (64k tokens a GPU, window 4096). The tests and
the benchmark then find them there (each also precompiles, serially, what it needs: cache hits by then).

One process a job batch (spawn; compiling needs no GPU context: the arch is read from the driver once, here, and
passed on); the cache's writes are atomic, so processes compiling different kernels at once are safe.

    PYTHONPATH=. python3 bench/cp_precompile.py [--workers N]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed

DIM, DTYPE = 128, "bf16"


def jobs(per_gpu: int = 65536, window: int = 4096) -> list[dict]:
    """fagen.compile's options (beside the head dim, dtype and arch) of every kernel, each once."""
    import torch

    from fagen.tools.bench import context_parallel
    from tests import ring_cases
    from tests.gpu.test_ring_gpu import CASES

    found: dict[str, dict] = {}

    def add(options: dict) -> None:
        options = {k: v for k, v in options.items() if v is not None and v is not False}  # compile()'s defaults
        found.setdefault(repr(sorted(options.items())), options)

    for case in CASES:
        for _, (_, program, dtypes) in sorted(ring_cases.piece_programs(case, torch).items()):
            add(dict(ir=str(program), tensor_dtypes=dtypes or None))
        if case.doc_mask is None and case.docs is None and not case.key_bias:  # options alone: compile() takes them
            add(dict(causal=case.causal, window=case.window, softcap=case.softcap, alibi=case.alibi))
    for world in (2, 4):
        for options in context_parallel.kernels(world, per_gpu, window):
            add(options)
    return list(found.values())


def compile_one(options: dict, arch: str) -> float:
    import fagen

    t0 = time.perf_counter()
    kernel = fagen.compile(DIM, dtype=DTYPE, arch=arch, **options)
    assert kernel.backward_plan is not None  # the backward too, into the cache
    return time.perf_counter() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=min(32, os.cpu_count() or 1))
    args = parser.parse_args()
    from fagen.request import detect_arch

    arch = detect_arch() or "sm_90a"
    todo = jobs()
    t0 = time.perf_counter()
    print(f"{len(todo)} kernels (forward and backward) for {arch}, {args.workers} processes", flush=True)
    failed = 0
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=args.workers, mp_context=spawn) as pool:
        futures = {pool.submit(compile_one, options, arch): options for options in todo}
        for future in as_completed(futures):
            options = futures[future]
            what = options.get("ir", "").split("\n")[0] or options
            try:
                print(f"  {future.result():6.1f} s  {what}", flush=True)
            except Exception as e:  # reported; the test or benchmark that needs it compiles it again and says why
                failed += 1
                print(f"  failed: {what}: {type(e).__name__}: {e}", flush=True)
    print(f"done in {time.perf_counter() - t0:.0f} s, {failed} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
