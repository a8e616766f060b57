"""The decode benchmark (`fagen bench --decode`): split-KV decode, bytes of K + V read per second.

fagen (its default split kernel, the mma tier's) over a contiguous cache and over paged caches (pages in shuffled
order) of each page size, the simt tier's split kernel over the contiguous cache, PyTorch SDPA's flash and cuDNN
backends on the same K/V, and a device-to-device copy of the same bytes (its bandwidth: bytes read + written / time,
as CUDA's bandwidthTest counts a device-to-device copy). bf16, every sequence at the full length, causal
(bottom-right).
"""

from __future__ import annotations

import math

from .. import testing
from . import timing


def paged_cache(torch, kc, vc, page: int):
    """(pool_k, pool_v, block table) holding kc, vc [B, L, Hkv, D] in pages of `page` tokens, in shuffled order."""
    B, L, Hkv, D = kc.shape
    per = -(-L // page)
    order = torch.randperm(B * per, device="cuda")
    table = order.view(B, per).to(torch.int32)
    pool_k = torch.empty(B * per, page, Hkv, D, device="cuda", dtype=kc.dtype)
    pool_v = torch.empty_like(pool_k)
    pad = per * page - L
    src_k = torch.nn.functional.pad(kc, (0, 0, 0, 0, 0, pad)).view(B * per, page, Hkv, D)
    src_v = torch.nn.functional.pad(vc, (0, 0, 0, 0, 0, pad)).view(B * per, page, Hkv, D)
    pool_k[order], pool_v[order] = src_k, src_v  # sequence b's page j is pool page table[b, j]
    return pool_k, pool_v, table


def decode_ops(torch, kernel, simt, q, kc, vc, lens, paged: dict) -> list[tuple]:
    """(name, call, kind) of each op timed at one query length; kind "sdpa": its output is [B, H, M, D]."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    ops: list[tuple] = [(f"fagen contiguous ({kernel.spec.tier})", lambda: kernel.decode(q, kc, vc, lens), None)]
    for page, (pk, pv, table) in paged.items():
        ops.append(
            (f"fagen paged {page}", lambda pk=pk, pv=pv, t=table: kernel.decode(q, pk, pv, lens, block_table=t), None)
        )
    ops.append(("fagen contiguous (simt)", lambda: simt.decode(q, kc, vc, lens), None))
    # SDPA without a mask: its is_causal is top-left, and a bottom-right mask is refused by its flash
    # backend; at q_len > 1 it reads the same K/V (its difference column is then left out).
    qs, ks, vs = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)
    for name, backend in (("SDPA flash", SDPBackend.FLASH_ATTENTION), ("SDPA cuDNN", SDPBackend.CUDNN_ATTENTION)):

        def sdpa(backend=backend):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True)

        ops.append((name, sdpa, "sdpa"))
    return ops


def measure(bench, op: tuple, o_ref, M: int, nbytes: int, copy_bw: float) -> dict:
    """One op's row: its time, K + V bytes read per second, that over the copy's, and its difference from fagen's."""
    name, fn, kind = op
    try:
        o = fn()
        o = o.transpose(1, 2) if kind == "sdpa" else o
        err = float((o.float() - o_ref.float()).abs().max()) if kind is None or M == 1 else math.nan
        ms = bench(fn)
        status = "ok"
    except Exception as e:  # noqa: BLE001 - a backend that refuses the shape is reported, not fatal
        ms, err, status = math.nan, math.nan, f"{type(e).__name__}: {str(e).splitlines()[0][:60]}"
    tbs = nbytes / (ms * 1e-3)
    return dict(op=name, us=ms * 1e3, tbs=tbs / 1e12, of_copy=tbs / copy_bw, err=err, status=status)


def decode(lengths=(8192, 32768, 131072), q_lens=(1, 4), B=8, H=32, Hkv=8, D=128, page_sizes=(16, 256)) -> list[dict]:
    """Rows {kv_len, q_len, op, us, tbs, of_copy, err, status} for each KV length and query length."""
    import fagen

    torch = testing._torch()
    bench = timing.timer(torch)
    kernel = fagen.compile(D, causal=True, decode=True, dtype="bf16")
    simt = fagen.compile(D, causal=True, decode=True, dtype="bf16", tier="simt")
    rows = []
    for L in lengths:
        kc = torch.randn(B, L, Hkv, D, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
        nbytes = 2 * kc.numel() * kc.element_size()
        paged = {page: paged_cache(torch, kc, vc, page) for page in page_sizes}
        copy_src = torch.empty(nbytes // 2, device="cuda", dtype=torch.bfloat16)
        copy_dst = torch.empty_like(copy_src)
        copy_ms = bench(lambda: copy_dst.copy_(copy_src))
        copy_bw = 2 * nbytes / (copy_ms * 1e-3)  # a copy reads and writes the bytes: its DRAM traffic per second
        copy_src = copy_dst = None  # freed before the kernels run
        for M in q_lens:
            q = torch.randn(B, M, H, D, device="cuda", dtype=torch.bfloat16)
            o_ref = kernel.decode(q, kc, vc, lens)
            for op in decode_ops(torch, kernel, simt, q, kc, vc, lens, paged):
                rows.append(dict(kv_len=L, q_len=M, **measure(bench, op, o_ref, M, nbytes, copy_bw)))
            copy = dict(op="copy (D2D of the same bytes; read + write)", us=copy_ms * 1e3, tbs=copy_bw / 1e12)
            rows.append(dict(kv_len=L, q_len=M, **copy, of_copy=1.0, err=math.nan, status="ok"))
        kc = vc = None  # this length's caches, freed
        paged.clear()
        torch.cuda.empty_cache()
    return rows


def decode_table(rows: list[dict]) -> str:
    lines = ["| kv len | q_len | op | time (us) | K+V TB/s | / copy | max abs diff vs fagen contiguous |"]
    lines.append("|---|---|---|---|---|---|---|")
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['kv_len']} | {r['q_len']} | {r['op']} | – | – | – | {r['status']} |")
            continue
        lines.append(
            f"| {r['kv_len']} | {r['q_len']} | {r['op']} | {r['us']:.1f} | {r['tbs']:.2f} | {r['of_copy']:.2f} | "
            f"{r['err']:.1e} |"
        )
    return "\n".join(lines)
