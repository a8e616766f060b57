"""Where the ring's time goes (issue 41): one forward + backward of fagen's ring (causal d128, zigzag, `--per-gpu`
tokens a GPU) on W GPUs under the torch profiler, against fagen.attention on one GPU over the whole sequence.

Rank 0 prints, for its step: the wall time; the device time of fagen's kernels (by name), of NCCL's and of torch's own
(the merges, sums and casts between them, by name); the time the GPU ran no fagen kernel (gaps: waits on transfers and
launches); then one GPU's kernel time over the whole sequence, divided by W (what the ring's kernels would take at one
GPU's speed). The ring's fagen kernels above that share are its kernels' loss on the pieces' shapes (or under the
transfers); its wall time above its kernel time is the gaps. `--timeline`: every rank first prints its kernels of
100 µs or more in time order (ms from its first kernel; each rank's own clock), NCCL's beside fagen's and torch's.

    python3 bench/cp_profile.py --gpus 4 [--per-gpu 65536] [--timeline]  # multicast off: fagen.ring.NCCL_SAFE_ENV
"""

from __future__ import annotations

import os
import sys
from collections import defaultdict


def _profile(torch, step, reps: int = 2):
    """Kernel (name, start us, duration us) of the last of `reps` calls of step, and its wall seconds."""
    import time

    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.distributed.barrier() if torch.distributed.is_initialized() else None
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    kernels = [
        (e.name, e.time_range.start, e.time_range.elapsed_us()) for e in prof.events() if e.device_type.name == "CUDA"
    ]
    return kernels, wall


def _summary(kernels, wall: float, label: str) -> dict:
    fagen = [(n, s, d) for n, s, d in kernels if n.startswith("flash_")]
    nccl = sum(d for n, _, d in kernels if "nccl" in n.lower())
    busy, end = 0.0, float("-inf")  # the union of fagen's kernel intervals
    for _, s, d in sorted(fagen, key=lambda k: k[1]):
        busy += max(0.0, s + d - max(s, end))
        end = max(end, s + d)
    by_name: dict = defaultdict(float)
    for n, _, d in fagen:
        by_name[n] += d
    others: dict = defaultdict(float)  # torch's own kernels: the merges, sums, copies and casts between fagen's
    for n, _, d in kernels:
        if not n.startswith("flash_") and "nccl" not in n.lower():
            others[n[:90]] += d
    print(
        f"== {label}: wall {wall * 1e3:.1f} ms, fagen kernels {sum(by_name.values()) / 1e3:.1f} ms (busy "
        f"{busy / 1e3:.1f} ms), NCCL kernels {nccl / 1e3:.1f} ms, other kernels {sum(others.values()) / 1e3:.1f} ms"
    )
    for n, d in sorted(by_name.items(), key=lambda x: -x[1])[:10]:
        print(f"   {d / 1e3:9.2f} ms  {n}")
    for n, d in sorted(others.items(), key=lambda x: -x[1])[:8]:
        print(f"   {d / 1e3:9.2f} ms  (other) {n}")
    idle = _idle(kernels)
    print(f"   idle (no fagen or torch kernel running) {sum(d for d, _, _ in idle) / 1e3:.1f} ms; the longest:")
    for d, before, after in sorted(idle, reverse=True)[:8]:
        print(f"   {d / 1e3:9.2f} ms  after {before[:60]}, before {after[:60]}")
    return dict(wall=wall, kernels=sum(by_name.values()) / 1e6, busy=busy / 1e6)


def _timeline(kernels, least_us: float = 100.0) -> None:
    """The kernels of at least `least_us`, in time order (ms from the first kernel's start): where NCCL's transfers
    run against fagen's kernels."""
    t0 = min(s for _, s, _ in kernels)
    print("   timeline (start ms, end ms, kernel):")
    for n, s, d in sorted(kernels, key=lambda k: k[1]):
        if d >= least_us:
            label = n if n.startswith("flash_") or "nccl" in n.lower() else "(torch) " + n.split("<")[0][-40:]
            print(f"   {(s - t0) / 1e3:9.2f} {(s + d - t0) / 1e3:9.2f}  {label[:90]}")


def _idle(kernels, least_us: float = 200.0) -> list:
    """The gaps of at least `least_us` between the compute kernels (all but NCCL's, which run beside them), as
    (us, the kernel before, the kernel after), in time order."""
    compute = sorted((s, s + d, n) for n, s, d in kernels if "nccl" not in n.lower())
    gaps, end, last = [], None, ""
    for s, e, n in compute:
        if end is not None and s - end >= least_us:
            gaps.append((s - end, last, n))
        if end is None or e > end:
            end, last = e, n
    return gaps


def _rank(rank: int, world: int, port: int, per_gpu: int, timeline: bool = False) -> None:
    import torch

    import fagen
    from fagen.tools.bench.context_parallel import _inputs, _ring_step

    torch.cuda.set_device(rank)
    torch.distributed.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, device_id=torch.device(rank)
    )
    total = per_gpu * world
    step = _ring_step(torch, total, "zigzag", causal=True)  # the benchmark's own step
    kernels, wall = _profile(torch, step)
    for r in range(world) if timeline else ():  # every rank's, in turn
        if r == rank:
            print(f"== rank {rank}: wall {wall * 1e3:.1f} ms", flush=True)
            _timeline(kernels)
            sys.stdout.flush()
        torch.distributed.barrier()
    torch.distributed.barrier()  # the group goes before rank 0 times one GPU alone (holding it on hung at exit)
    torch.distributed.destroy_process_group()
    if rank == 0:
        r = _summary(kernels, wall, f"ring, rank 0 of {world}, {total} tokens")
        del step  # its inputs and gradients
        Q, K, V, DO = _inputs(torch, total)
        Q, K, V = (x.requires_grad_(True) for x in (Q, K, V))

        def one():
            Q.grad = K.grad = V.grad = None
            fagen.attention(Q, K, V, causal=True).backward(DO)

        kernels1, wall1 = _profile(torch, one, reps=1)
        o = _summary(kernels1, wall1, f"one GPU, {total} tokens")
        print(
            f"ring fagen kernels {r['kernels'] * 1e3:.1f} ms against one GPU's / {world} = "
            f"{o['kernels'] / world * 1e3:.1f} ms ({r['kernels'] / (o['kernels'] / world):.3f}x); ring wall ÷ its "
            f"busy kernel time {r['wall'] / r['busy']:.3f}"
        )


def main(argv: list[str]) -> int:
    import multiprocessing as mp

    from fagen.tools.bench.context_parallel import _free_port, precompile, rank_env

    world = int(argv[argv.index("--gpus") + 1]) if "--gpus" in argv else 4
    per_gpu = int(argv[argv.index("--per-gpu") + 1]) if "--per-gpu" in argv else 65536
    os.environ.update(rank_env(os.environ))  # as the bench's ranks
    precompile(world, per_gpu, None)
    port = _free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, world, port, per_gpu, "--timeline" in argv)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    return max(p.exitcode or 0 for p in procs)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
