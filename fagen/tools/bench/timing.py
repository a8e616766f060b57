"""Timing: triton's do_bench (L2 flushed, the median of its runs), rotated rounds, host time per call, peak memory."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable


def timer(torch) -> Callable[[Callable[[], object]], float]:
    """ms of one call of a function: do_bench(fn, warmup=25, rep=100), median; CUDA events where triton is missing."""
    try:
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=25, rep=100, return_mode="median")
    except ImportError:  # pragma: no cover - triton ships with torch on CUDA

        def bench(fn):
            for _ in range(5):
                fn()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            times = []
            for _ in range(30):
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            return float(statistics.median(times))

        return bench


def time_in_rounds(candidates: list, inputs: dict, timer, rounds: int) -> list[dict]:
    """{length: median ms} for each of `candidates` (callables of q, k, v) on `inputs` ({length: (q, k, v)}): `rounds`
    passes over all of them, pass r starting at candidate r (so none always runs after the same one)."""
    times: list[dict] = [{n: [] for n in inputs} for _ in candidates]
    for r in range(rounds):
        for i in range(len(candidates)):
            c = (r + i) % len(candidates)
            for n, (q, k, v) in inputs.items():
                times[c][n].append(timer(lambda f=candidates[c], q=q, k=k, v=v: f(q, k, v)))
    return [{n: statistics.median(ts) for n, ts in t.items()} for t in times]


def per_call_seconds(fn, sync, n=1000, warmup=50) -> float:
    """Host time per call of `fn`, back to back: a perf_counter around n calls after warm-up, one
    synchronize at the end (so the queue drains inside the window), divided by n."""
    for _ in range(warmup):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    sync()
    return (time.perf_counter() - t0) / n


def median_seconds(fn, sync, n=20, warmup=3) -> float:
    """The median of `n` whole calls of `fn`, each closed by `sync`, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return float(statistics.median(times))


def peak_extra_mib(torch, fn) -> float:
    """The device memory `fn` allocates at its peak beyond what was allocated before it (its results included),
    in MiB; NaN where it runs out of memory."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    try:
        result = fn()
        torch.cuda.synchronize()
        mib = round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)
        del result
    except torch.OutOfMemoryError:
        mib = math.nan
    torch.cuda.empty_cache()
    return mib
