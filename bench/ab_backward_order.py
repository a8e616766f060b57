"""A/B of the order the wgmma backward's key tiles start in (fagen.backend.tiers.wgmma.BWD_ORDER: natural,
heavy_first) on one GPU, in one process: each order's kernels are built afresh (use_cache=False), then timed in
turn, rounds rotated. Cases at FlashAttention's benchmark shapes (bf16, B·N = 16384 tokens, H·D = 2048; a full mask
as a control, whose kernel is the same under both orders), GQA 32/8 and packed documents (fagen bench's). Prints the
backward (preprocess, main kernel, convert) in µs, median of the rounds.

    python3 bench/ab_backward_order.py"""

from __future__ import annotations

import statistics

import torch
from ab_tools import timed_us

import fagen
from fagen.backend.tiers import wgmma
from fagen.tools.bench.cases import cu_seqlens, packed_document_lengths


def dense(D: int, causal: bool, N: int, H: int = 0, Hkv: int = 0, B: int = 0, window=None):
    B, H = B or 16384 // N, H or 2048 // D
    Hkv = Hkv or H
    q, do = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(B, Hkv, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    opts = dict(causal=causal, **({"window": window} if window else {}))

    def build():
        kern = fagen.compile(D, dtype="bf16", use_cache=False, **opts)
        o, lse = kern(q, k, v, return_lse=True)
        name = kern.backward_plan.main.spec.name
        return name, lambda: kern.backward(q, k, v, o, lse, do)

    return build


def packed():
    docs = packed_document_lengths()
    cu = torch.tensor(cu_seqlens(docs), dtype=torch.int32, device="cuda")
    T, H, D = sum(docs), 16, 128
    q, k, v, do = (torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))

    def build():
        kern = fagen.compile(D, dtype="bf16", causal=True, use_cache=False)
        o, lse = kern.varlen(q, k, v, cu, cu, max(docs), max(docs), return_lse=True)
        name = kern.backward_plan.main.spec.name
        return name, lambda: kern.varlen_backward(q, k, v, o, lse, do, cu, cu, max(docs), max(docs))

    return build


CASES = {
    "d128 full 8k (control)": dense(128, False, 8192),
    "d128 causal 2k": dense(128, True, 2048),
    "d128 causal 8k": dense(128, True, 8192),
    "d128 causal 16k": dense(128, True, 16384),
    "d64 causal 2k": dense(64, True, 2048),
    "d64 causal 8k": dense(64, True, 8192),
    "d256 causal 8k": dense(256, True, 8192),
    "gqa 32/8 d128 causal 8k": dense(128, True, 8192, H=32, Hkv=8, B=2),
    "window 256 d128 4k": dense(128, True, 4096, window=256),
    "packed documents d128": packed(),
}


def main(rounds: int = 5) -> None:
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, fagen {fagen.__version__}")
    for label, build in CASES.items():
        runs = {}
        for order in wgmma.BWD_ORDERS:
            wgmma.BWD_ORDER = order
            runs[order] = build()
        wgmma.BWD_ORDER = "heavy_first"
        times: dict[str, list[float]] = {n: [] for n in runs}
        for r in range(rounds):
            for n in list(runs)[r % 2 :] + list(runs)[: r % 2]:
                times[n].append(timed_us(runs[n][1]))
        nat, heavy = (statistics.median(times[n]) for n in wgmma.BWD_ORDERS)
        print(f"{label:26} natural {nat:8.0f} us  heavy_first {heavy:8.0f} us  {nat / heavy:5.3f}x", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
