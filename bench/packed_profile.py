"""Packed documents, forward + backward, kernel by kernel: where fagen's time goes against FlashAttention-4's on
`fagen bench`'s packed case (varlen, 7 documents of 256-4096 tokens, 16k tokens, d128 causal, 16 heads, bf16), and
on the dense case of the same tokens (d128 causal, 8 x 2k) beside it, so that what only varlen pays stands out.

    python3 bench/packed_profile.py                 # fagen (kernel.varlen + varlen_backward, as `fagen bench`),
                                                    # fagen through autograd (flash_attn_varlen_func) and FA4
    python3 bench/packed_profile.py --root OLD      # the fagen at OLD (a checkout), to compare trees in turn
    python3 bench/packed_profile.py --reps 20 --no-dense

For each implementation: the median time of a forward + backward (CUDA events around each call, L2 flushed before
it, as triton's do_bench), the host time of a call (its Python and launches, measured with the GPU kept busy so
that nothing waits on it), then the torch profiler's kernels (CUPTI sees fagen's NVRTC launches too): microseconds
per forward + backward, launches per call and share of the total. Fills (zeros_like, torch.zeros, memsets) are
kernels there like the others, so a workspace or output zeroed per call shows as its own row."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

if "--root" in sys.argv:  # the tree whose fagen is timed, ahead of everything else on the path
    sys.path.insert(0, str(Path(sys.argv[sys.argv.index("--root") + 1]).resolve()))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import fagen  # noqa: E402
from fagen.tools.bench.cases import cu_seqlens, packed_document_lengths  # noqa: E402

H, D = 16, 128


def arg(name: str, default: int) -> int:
    return int(sys.argv[sys.argv.index(name) + 1]) if name in sys.argv else default


def median_us(fn, reps: int) -> float:
    """The median of `reps` calls, each timed by CUDA events after the L2 is flushed (256 MB written)."""
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    times = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in times)


def host_us(fn, reps: int) -> float:
    """The host's time per call: calls queued behind a long sleep kernel, so that none waits on the GPU."""
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9))  # ~1 s of GPU time ahead of the calls: the queue never drains while they are made
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    out = (time.perf_counter() - t) / reps * 1e6
    torch.cuda.synchronize()
    return out


def kernels(fn, reps: int) -> list[tuple[float, float, str]]:
    """(µs per call, launches per call, name) of each kernel the profiler sees over `reps` calls, longest first."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    rows = [
        (e.device_time_total / reps, e.count / reps, e.key)
        for e in prof.key_averages()
        if e.device_time_total > 0 and e.key
    ]
    return sorted(rows, reverse=True)


def report(name: str, fn, flops: float, reps: int) -> None:
    for _ in range(3):  # the first calls compile and allocate
        fn()
    torch.cuda.synchronize()
    t = median_us(fn, reps)
    host = host_us(fn, reps)
    rows = kernels(fn, reps)
    busy = sum(us for us, _, _ in rows)
    rate = flops / t / 1e6
    print(f"\n{name}: {t:.0f} us fwd+bwd ({rate:.0f} TF/s), host {host:.0f} us a call, kernels {busy:.0f} us")
    if host > 100e3:  # the calls were queued behind ~1 s of GPU time: one of them waited for it
        print("  (the host waited on the GPU: a synchronization inside the call)")
    fills = [(us, count) for us, count, key in rows if "FillFunctor" in key or "Memset" in key]
    filled, launches = sum(us for us, _ in fills), sum(c for _, c in fills)
    print(f"  fills (zeros_like, zero_, memsets): {filled:.1f} us, {launches:g} a call")
    for us, count, key in rows:
        print(f"  {us:8.1f} us {100 * us / busy:5.1f}%  x{count:g}  {key[:90]}")


def packed(reps: int) -> None:
    docs = packed_document_lengths()
    total, longest = sum(docs), max(docs)
    cu = torch.tensor(cu_seqlens(docs), dtype=torch.int32, device="cuda")
    q, k, v, do = (torch.randn(total, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    flops = 3.5 * sum(4.0 * H * n * n * D / 2 for n in docs)
    print(f"\npacked documents {docs} ({total} tokens, longest {longest}), d{D} causal, {H} heads, bf16")
    kern = fagen.compile(D, causal=True, dtype="bf16")

    def direct():  # as `fagen bench --backward` times it
        o, lse = kern.varlen(q, k, v, cu, cu, longest, longest, return_lse=True)
        return kern.varlen_backward(q, k, v, o, lse, do, cu, cu, longest, longest, tensor_grads=False)

    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))

    def through_autograd():
        qg.grad = kg.grad = vg.grad = None
        fagen.flash_attn_varlen_func(qg, kg, vg, cu, cu, longest, longest, causal=True).backward(do)

    peers = [("fagen (kernel.varlen + varlen_backward)", direct), ("fagen (flash_attn_varlen_func)", through_autograd)]
    try:
        from flash_attn import cute

        def fa4():
            qg.grad = kg.grad = vg.grad = None
            o = cute.flash_attn_varlen_func(
                qg, kg, vg, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest, causal=True
            )
            (o[0] if isinstance(o, tuple) else o).backward(do)

        peers.append(("FlashAttention-4 (flash_attn.cute.flash_attn_varlen_func)", fa4))
    except ImportError as e:
        print(f"(FlashAttention-4 skipped: {e})")
    for name, fn in peers:
        report(name, fn, flops, reps)


def dense(reps: int, B: int = 8, N: int = 2048) -> None:
    q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    flops = 3.5 * 4.0 * B * H * N * N * D / 2
    print(f"\ndense d{D} causal, {B} x {N}, {H} heads, bf16 (the same tokens)")
    kern = fagen.compile(D, causal=True, dtype="bf16")

    def ours():
        o, lse = kern(q, k, v, return_lse=True)
        return kern.backward(q, k, v, o, lse, do, tensor_grads=False)

    peers = [("fagen (kernel + backward)", ours)]
    try:
        from flash_attn import cute

        qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
        dot = do.transpose(1, 2).contiguous()

        def fa4():
            qt.grad = kt.grad = vt.grad = None
            o = cute.flash_attn_func(qt, kt, vt, causal=True)
            (o[0] if isinstance(o, tuple) else o).backward(dot)

        peers.append(("FlashAttention-4 (flash_attn.cute.flash_attn_func)", fa4))
    except ImportError:
        pass
    for name, fn in peers:
        report(name, fn, flops, reps)


if __name__ == "__main__":
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, fagen {fagen.__version__} from {fagen.__file__}")
    reps = arg("--reps", 30)
    packed(reps)
    if "--no-dense" not in sys.argv:
        dense(reps)
