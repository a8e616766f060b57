"""Peak device memory of one call: fagen (O(N): the output, lse and the backward's workspaces) against attention
that materializes the N x N scores (SDPA's math backend)."""

from __future__ import annotations

from .. import testing
from . import timing
from .peers import Peers


def peak_memory(seqlens=(1024, 2048, 4096, 8192, 16384), D=128, dtype="bf16") -> list[dict]:
    """Peak extra device memory of one forward call: fagen vs attention that materializes S (SDPA math)."""
    import fagen

    torch = testing._torch()
    peers = Peers(torch)
    kern = fagen.compile(D, causal=False, dtype=dtype)
    math_fn = peers.sdpa("math", False)
    out = []
    for N in seqlens:
        B, H = max(1, 16384 // N), max(1, 2048 // D)
        q, k, v = testing.random_qkv(B, H, N, N, D, dtype)
        out.append(
            dict(
                seqlen=N,
                batch=B,
                heads=H,
                fagen_MiB=timing.peak_extra_mib(torch, lambda: kern(q, k, v)),
                materialized_MiB=timing.peak_extra_mib(torch, lambda: math_fn(q, k, v)),
            )
        )
    return out


def peak_memory_backward(seqlens=(1024, 2048, 4096, 8192, 16384), D=128, dtype="bf16", B=1, H=16) -> list[dict]:
    """Peak extra device memory of one forward + backward (the first call of its shape, so the backward's workspaces
    count: D, the float32 dQ accumulator), beyond q, k, v and dO, at one batch and H heads, so that it grows with N
    alone: fagen vs SDPA's math backend through autograd (it materializes S and P)."""
    import fagen

    torch = testing._torch()
    peers = Peers(torch)
    kern = fagen.compile(D, causal=False, dtype=dtype)
    math_fn = peers.sdpa("math", False)
    out = []
    for N in seqlens:
        q, k, v = testing.random_qkv(B, H, N, N, D, dtype)
        do = torch.randn_like(q)

        def fagen_fb():
            o, lse = kern(q, k, v, return_lse=True)
            return o, kern.backward(q, k, v, o, lse, do)

        def math_fb():
            qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
            o = math_fn(qg, kg, vg)
            o.backward(do)
            return o, (qg.grad, kg.grad, vg.grad)

        out.append(
            dict(
                seqlen=N,
                batch=B,
                heads=H,
                fagen_MiB=timing.peak_extra_mib(torch, fagen_fb),
                materialized_MiB=timing.peak_extra_mib(torch, math_fb),
            )
        )
    return out
