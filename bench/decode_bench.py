"""Decode bandwidth at each split count: TB/s of K + V read by fagen's split-KV decode (q_len 1, batch 8, GQA 32/8,
d128, bf16, a contiguous cache), against PyTorch SDPA's flash and cuDNN backends on the same cache.

    python3 bench/decode_bench.py [--seqlens 8192,32768]

`fagen bench --decode` gives the table at the default split count, paged caches included; this script adds the
split counts (`num_splits`: 'flash', FlashAttention's heuristic and the default; 'flex', FlexDecoding's; or a
number) and SDPA with K/V expanded to the query heads where a backend refuses GQA."""

from __future__ import annotations

import argparse
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

import fagen

SPLITS = ("flash", "flex", 1, 8, 12, 16, 24, 32, 64)


def sdpa(q, k, v, gqa: bool):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)


def rows_for(kern, L: int, B: int, H: int, Hkv: int, D: int) -> list[tuple]:
    """(kv len, op, seconds, K + V TB/s, max |O - SDPA|) for each split count and each SDPA backend."""
    q = torch.randn(B, 1, H, D, device="cuda", dtype=torch.bfloat16)
    kc, vc = (torch.randn(B, L, Hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
    nbytes = 2 * kc.numel() * kc.element_size()
    qs, ks, vs = (x.transpose(1, 2) for x in (q, kc, vc))  # [B, H, S, D] views
    ref = sdpa(qs, ks, vs, True).transpose(1, 2)
    rows = []
    for splits in SPLITS:
        err = float((kern.decode(q, kc, vc, lens, num_splits=splits).float() - ref.float()).abs().max())
        t = do_bench(lambda splits=splits: kern.decode(q, kc, vc, lens, num_splits=splits)) / 1e3
        rows.append((L, f"fagen num_splits={splits}", t, nbytes / t / 1e12, err))
    for name, backend in (("SDPA flash", SDPBackend.FLASH_ATTENTION), ("SDPA cuDNN", SDPBackend.CUDNN_ATTENTION)):
        for gqa in (True, False):  # a backend that refuses GQA gets K/V expanded to the query heads
            kk, vv = (ks, vs) if gqa else (x.repeat_interleave(H // Hkv, 1) for x in (ks, vs))
            try:
                with sdpa_kernel(backend):
                    t = do_bench(lambda kk=kk, vv=vv, gqa=gqa: sdpa(qs, kk, vv, gqa)) / 1e3
            except RuntimeError as e:
                print(f"# {name} gqa={gqa}: {str(e).splitlines()[0][:100]}", file=sys.stderr)
                continue
            label = name + (" (enable_gqa)" if gqa else f" (K/V expanded to {H} heads)")
            rows.append((L, label, t, nbytes / t / 1e12, float("nan")))
            break
    return rows


def main(lengths, B=8, H=32, Hkv=8, D=128) -> None:
    kern = fagen.compile(D, causal=True, decode=True, dtype="bf16")
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, fagen {fagen.__version__}, {kern.name}")
    print(f"# {kern.resources}")
    print("| kv len | op | time (us) | K+V TB/s | max abs diff vs SDPA |")
    print("|---|---|---|---|---|")
    for L in lengths:
        for L_, name, t, tbs, err in rows_for(kern, L, B, H, Hkv, D):
            print(f"| {L_} | {name} | {t * 1e6:.1f} | {tbs:.2f} | {err:.2e} |", flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqlens", default="8192,32768", help="keys in the cache, comma-separated (default 8192,32768)")
    main(tuple(int(x) for x in p.parse_args().seqlens.split(",")))
