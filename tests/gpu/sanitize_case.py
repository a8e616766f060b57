"""A small case for compute-sanitizer (memcheck, racecheck, synccheck): odd sizes, both causal alignments,
GQA, variants with call-time tensors and index math.

compute-sanitizer --tool memcheck --error-exitcode 1 python tests/gpu/sanitize_case.py
compute-sanitizer --tool racecheck python tests/gpu/sanitize_case.py   (no hazard may be in a flash_* kernel)
(argument `backward`, `backward_mma` (the tensor-core backward main kernels: mma, and wgmma on Hopper),
`backward_wgmma` (the wgmma backward alone), `backward_wide` (its d192 and d256 kernels alone), `backward_float32`
(float32 dK, dV: the ring's partials, every tier), `hopper`,
`block_sparse`, `block_sparse_backward` (the wgmma tier's BWD_SPARSE over a block mask's transposed table, Hopper)
or `gather`: those cases alone)
"""

import sys

import fagen
from fagen.tools import testing

CASES = [  # (dim, causal, dtype, tier, B, H, Hkv, M, N)
    (64, "bottom_right", "f16", "simt", 1, 2, 2, 33, 17),
    (128, True, "bf16", "simt", 1, 2, 1, 17, 70),
    (256, False, "f32", "simt", 1, 1, 1, 5, 40),
    (64, "bottom_right", "f16", "mma", 1, 2, 2, 150, 17),
    (128, True, "bf16", "mma", 1, 2, 1, 17, 200),
    (96, False, "bf16", "mma", 1, 1, 1, 130, 70),
    (256, True, "f16", "mma", 1, 1, 1, 70, 100),
]


# variants with call-time tensors and integer index math in the mask
VARIANTS = [  # (options, dim, dtype, tier, B, H, Hkv, M, N)
    (dict(causal=True, alibi=True), 64, "bf16", "mma", 2, 2, 1, 77, 130),
    (dict(mask=lambda b, h, q, k: fagen.ne(((q - k) // 3) % 4, 1)), 64, "bf16", "mma", 1, 2, 2, 100, 90),
    (dict(causal="bottom_right", window=20), 64, "f32", "simt", 1, 2, 2, 40, 90),
]


# the Hopper tier, where the GPU is one
HOPPER = [
    (dict(causal=True), 64, "bf16", "wgmma", 1, 2, 1, 150, 170),
    (dict(), 64, "f16", "wgmma", 2, 4, 2, 450, 333),  # three consumer warpgroups (192 rows), a partial last tile
    (dict(causal="bottom_right", alibi=True), 128, "f16", "wgmma", 1, 2, 2, 77, 300),
    (dict(), 256, "bf16", "wgmma", 1, 1, 1, 130, 90),
    (dict(causal=True, softcap=20.0), 96, "bf16", "wgmma", 1, 2, 1, 140, 150),
    # persistent (no mask): 210 work tiles, so blocks take two in turn (the ring and Q's phases run on)
    (dict(softcap=20.0), 128, "bf16", "wgmma", 1, 70, 7, 300, 200),
    # persistent under a mask: 350 work tiles (5 query tiles a head) drawn from the counter, the longest first
    (dict(causal=True), 128, "bf16", "wgmma", 1, 70, 7, 600, 600),
    # the same at three consumer warpgroups (192 rows), 5 query tiles a head
    (dict(causal=True), 64, "bf16", "wgmma", 1, 70, 7, 900, 900),
]


# split-KV decode over paged caches with appended keys (the page-table reads and the cache writes)
DECODE = [  # (options, dim, dtype, page_size (0: contiguous), q_len, new, seqlens); the default tier is mma's
    (dict(causal=True), 128, "bf16", 16, 1, 1, [1, 17, 300]),
    (dict(causal=True, window=40, alibi=True), 64, "f16", 5, 4, 4, [0, 33, 90]),
    (dict(), 128, "bf16", 0, 3, 2, [2, 70]),
    (dict(causal=True), 96, "bf16", 256, 9, 3, [0, 255, 600]),  # mma: 12 chunks a row, 2 row tiles of 18 rows
    (dict(causal=True, tier="simt"), 128, "bf16", 16, 4, 2, [1, 17, 300]),  # the simt split kernel
]


def decode_cases() -> int:
    """Paged and appending decode calls against a float64 reference of the keys they should see."""
    import torch

    failed = 0
    for options, dim, dtype, page, M, new, seqlens in DECODE:
        kernel = fagen.compile(dim, dtype=dtype, decode=True, **options)
        B, H, Hkv = len(seqlens), 4, 2
        dt = getattr(torch, testing.TORCH_DTYPE[dtype])
        q = torch.randn(B, M, H, dim, device="cuda").to(dt)
        kn, vn = (torch.randn(B, new, Hkv, dim, device="cuda").to(dt) for _ in range(2))
        need = [-(-(L + new) // max(page, 1)) for L in seqlens]
        if page:
            pages = torch.randperm(sum(need)).int()
            table = torch.zeros(B, max(need), dtype=torch.int32)
            for b, n in enumerate(need):
                table[b, :n] = pages[sum(need[:b]) : sum(need[:b]) + n]
            table = table.cuda()
            kc, vc = (torch.randn(sum(need), page, Hkv, dim, device="cuda").to(dt) for _ in range(2))
            rows = [[(int(table[b, j // page]), j % page) for j in range(L)] for b, L in enumerate(seqlens)]
        else:
            table = None
            kc, vc = (torch.randn(B, max(seqlens) + new, Hkv, dim, device="cuda").to(dt) for _ in range(2))
            rows = [[(b, j) for j in range(L)] for b, L in enumerate(seqlens)]
        logical = [
            tuple(torch.cat([c[[r[0] for r in rs], [r[1] for r in rs]], n[b]]) for c, n in ((kc, kn), (vc, vn)))
            for b, rs in enumerate(rows)
        ]
        lens = torch.tensor(seqlens, dtype=torch.int32, device="cuda")
        tensors = testing.call_tensors(kernel, B, H)
        o, lse = kernel.decode(
            q, kc, vc, lens, block_table=table, k_new=kn, v_new=vn, return_lse=True, num_splits=3, **tensors
        )
        torch.cuda.synchronize()
        ok = True
        for b, (k1, v1) in enumerate(logical):
            N = k1.shape[0]
            keep = testing.keep_matrix(kernel, 1, H, M, N, tensors)
            score = testing.score_function(kernel, 1, H, M, N, tensors)
            args = (q[b : b + 1].transpose(1, 2), k1[None].transpose(1, 2), v1[None].transpose(1, 2), keep)
            ref = testing.reference(*args, kernel.default_scale, score=score)
            naive = testing.reference(*args, kernel.default_scale, dtype=dt, score=score)
            r = testing.compare(o[b : b + 1].transpose(1, 2), lse[b : b + 1], ref, naive, dtype)
            ok &= r.ok
        print(f"{kernel.name} paged={page} M={M} new={new}: {'ok' if ok else 'FAIL'}")
        failed += not ok
    return failed


# the backward (simt): preprocess, main (atomics), convert; and the deterministic dQ kernel
BACKWARD = [  # (options, dim, dtype, B, H, Hkv, M, N, deterministic)
    (dict(causal="bottom_right"), 64, "f16", 1, 2, 1, 33, 17, False),
    (dict(causal=True, alibi=True), 128, "bf16", 2, 2, 1, 17, 70, True),
    (dict(causal=True, window=20), 64, "f32", 1, 2, 2, 40, 90, False),
    (dict(score_mod=lambda s, b, h, q, k, bias: s + bias[h] * (k - q) * 0.01), 96, "bf16", 1, 2, 2, 50, 37, False),
]
# the backward on the mma tier (its main kernel: the cp.async ring of Q_i/dO_i, dS^T in shared memory, the dQ
# atomics; head dims 64 and 128, both tile sizes: 128 keys a block, 64 query rows a step, and 32 where those
# spill past the tier's budget) with the simt preprocess/convert and deterministic dQ. Sizes leave partial key and
# query tiles.
BACKWARD_MMA = [  # (options, dim, dtype, B, H, Hkv, M, N, deterministic)
    (dict(causal="bottom_right"), 64, "f16", 1, 2, 1, 150, 70, False),
    (dict(), 128, "bf16", 1, 2, 2, 130, 200, False),
    (dict(causal=True, alibi=True), 128, "bf16", 2, 2, 1, 70, 140, True),
    (dict(causal=True, alibi=True), 128, "f16", 2, 2, 1, 70, 140, False),  # the slopes' row sums by atomics
    (dict(causal=True, window=20), 128, "f16", 1, 2, 1, 90, 150, False),
    # (300 x 257, not 200 x 37: there the bias gradient's bound, from a naive error with much cancellation, failed 1
    # draw in 8 on the simt and mma kernels alike, on an H100; at 300 x 257 none of 8 on any tier)
    (dict(score_mod=lambda s, b, h, q, k, bias: s + bias[h] * (k - q) * 0.01), 64, "bf16", 1, 2, 2, 300, 257, False),
    (dict(softcap=30), 64, "bf16", 1, 2, 1, 260, 130, False),
    (dict(score_mod=lambda s, b, h, q, k, bias: s + bias[b, h] * (k - q) * 0.01), 64, "bf16", 2, 2, 1, 300, 257, True),
]

BACKWARD_WGMMA = [  # the wgmma tier's own: d96 on d128's tiles (columns 96-127 zero-filled, never written)
    (dict(causal=True), 96, "bf16", 1, 2, 1, 130, 200, False),
    (dict(softcap=30), 96, "f16", 2, 2, 2, 70, 140, True),  # deterministic: the ordered dQ additions
    (dict(causal=True), 128, "bf16", 2, 2, 1, 300, 700, True),
    # deterministic over 3 x 7 = 21 (batch, KV head) pairs: det_tile's chunks of wgmma.BWD_DET_PAIRS, the last partial
    (dict(causal=True), 64, "bf16", 3, 21, 7, 150, 300, True),
    # d128 without a mask: 80 rows a step (dQ transposed); partial query and key tiles, GQA, deterministic
    (dict(), 128, "f16", 2, 4, 2, 170, 90, True),
    # d96 without a mask: 80 rows a step too; d64 full: the dQ part handed over at named barriers
    (dict(), 96, "bf16", 1, 4, 2, 170, 250, False),
    (dict(), 64, "f16", 2, 2, 1, 300, 140, False),
    # the persistent kernel (d128 under a mask): 168 work units (GQA 28/14, 6 key tiles), some blocks taking two from
    # the counter; deterministic, every unit drawn from the counter in det_tile's order, dQ's counters laid out by batch
    # and heads
    (dict(causal="bottom_right"), 128, "bf16", 2, 28, 14, 200, 700, False),
    (dict(causal=True, window=100), 128, "bf16", 2, 4, 2, 300, 700, True),
]
# d192 and d256: the warpgroups split dK, dV, dQ by head-dim columns (P^T, dS^T through shared memory; d256's ring 1
# deep); partial key and query tiles, GQA, deterministic (ordered dQ additions), a tensor gradient (dq_accum null when
# deterministic: the dQ kernel's)
BACKWARD_WIDE = [
    (dict(causal=True), 192, "bf16", 1, 2, 1, 130, 200, False),
    (dict(), 256, "f16", 2, 2, 2, 70, 140, True),
    (dict(causal="bottom_right", window=20), 192, "f16", 1, 4, 2, 150, 90, True),
    (dict(softcap=30), 256, "bf16", 1, 2, 1, 200, 130, False),
    (dict(score_mod=lambda s, b, h, q, k, bias: s + bias[h] * (k - q) * 0.01), 192, "bf16", 1, 2, 2, 300, 257, True),
    (dict(causal=True, alibi=True), 256, "bf16", 2, 2, 1, 70, 140, False),
]


# float32 dK, dV (Kernel.backward(float32_dkv=True): the ring's partials) on every tier the GPU has: the per-value
# store of the main kernels' epilogue (the wgmma one's 16-byte chunks are off in this mode), odd sizes, GQA, a
# transposed layout, both wgmma step sizes (d128 without a mask: 80 rows), the wide kernels, deterministic dQ
BACKWARD_FLOAT32 = [  # (options, dim, dtype, tier, B, H, Hkv, M, N, layout, deterministic)
    (dict(causal=True), 64, "bf16", "simt", 1, 2, 1, 70, 33, "bhsd", False),
    (dict(causal=True), 128, "f16", "mma", 2, 2, 1, 150, 133, "bshd", False),
    (dict(causal=True), 64, "bf16", "wgmma", 2, 4, 2, 150, 333, "bshd", False),
    (dict(), 128, "bf16", "wgmma", 1, 4, 2, 170, 250, "bhsd", True),
    (dict(causal=True), 96, "f16", "wgmma", 1, 2, 1, 130, 200, "bshd", False),
    (dict(causal=True), 192, "bf16", "wgmma", 1, 2, 1, 130, 200, "bhsd", False),
    (dict(), 256, "bf16", "wgmma", 1, 2, 2, 70, 140, "bshd", True),
]


def float32_dkv_cases(hopper: bool) -> int:
    """float32 dK, dV against the default call's: they must round to its dK, dV exactly."""
    import torch

    failed = 0
    for i, (options, dim, dtype, tier, B, H, Hkv, M, N, layout, det) in enumerate(BACKWARD_FLOAT32):
        if tier == "wgmma" and not hopper:
            continue
        kernel = fagen.compile(dim, dtype=dtype, tier=tier, **options)
        q, k, v = testing.random_qkv(B, H, M, N, dim, dtype, Hkv=Hkv, layout=layout, seed=4000 + i)
        o, lse = kernel(q, k, v, return_lse=True)
        do = torch.randn(o.shape, device=o.device, generator=testing.generator(5000 + i)).to(o.dtype)
        base = kernel.backward(q, k, v, o, lse, do, deterministic=det)
        wide = kernel.backward(q, k, v, o, lse, do, deterministic=det, float32_dkv=True)
        torch.cuda.synchronize()
        ok = all(
            got.dtype == torch.float32 and bool(torch.isfinite(got).all()) and torch.equal(got.to(want.dtype), want)
            for got, want in ((wide.dk, base.dk), (wide.dv, base.dv))
        )
        main = kernel.backward_plan.main.spec.name
        print(f"float32 dK, dV {kernel.name} ({main}) M={M} N={N} {layout} det={det}: {'ok' if ok else 'FAIL'}")
        failed += not ok
    return failed


# run-time block masks: the BLOCK_MASK kernel and the block-sparse forward (odd sizes: partial last tiles, GQA)
BLOCK_SPARSE = [  # (mask_mod, dim, dtype, tier, B (None: broadcast), H, Hkv, M, N)
    (lambda b, h, q, k: (q // 37 == k // 37) & (q >= k), 64, "bf16", "mma", None, 2, 1, 150, 170),
    (lambda b, h, q, k: (q % 3 == k % 3) & (k <= q + 50), 64, "f32", "simt", 2, 2, 2, 77, 130),
    (lambda b, h, q, k: ((q + h) // 50 == k // 50) & (q < k), 128, "f16", "mma", None, 2, 2, 130, 90),
]
HOPPER_BLOCK_SPARSE = [
    (lambda b, h, q, k: (q // 37 == k // 37) & (q >= k), 128, "bf16", "wgmma", None, 2, 1, 150, 300),
    (lambda b, h, q, k: (q // 100 == k // 100) & (q < k), 64, "f16", "wgmma", 2, 2, 2, 257, 130),
]


def block_sparse_cases(hopper: bool) -> int:
    """Block masks built on the GPU, then read by the block-sparse forward, against a float64 reference."""
    import numpy as np
    import torch

    failed = 0
    for mask_mod, dim, dtype, tier, B, H, Hkv, M, N in BLOCK_SPARSE + (HOPPER_BLOCK_SPARSE if hopper else []):
        kernel = fagen.compile(dim, dtype=dtype, tier=tier, mask=mask_mod, block_sparse=True)
        bm = fagen.create_block_mask(mask_mod, B, H, M, N, BLOCK_SIZE=(kernel.spec.block_m, kernel.spec.block_n))
        Bx = B or 1
        q, k, v = testing.random_qkv(Bx, H, M, N, dim, dtype, Hkv=Hkv)
        o, lse = kernel(q, k, v, block_mask=bm, return_lse=True)
        torch.cuda.synchronize()
        bb, hh, qi, ki = np.ogrid[:Bx, :H, :M, :N]
        keep = np.broadcast_to(np.asarray(mask_mod(bb, hh, qi, ki), bool), (Bx, H, M, N))
        ref = testing.reference(q, k, v, keep, kernel.default_scale)
        naive = testing.reference(q, k, v, keep, kernel.default_scale, dtype=q.dtype)
        r = testing.compare(o, lse, ref, naive, dtype)
        print(f"{kernel.name} block mask M={M} N={N}: err {r.err:.2e} (bound {r.bound:.2e}) {'ok' if r.ok else 'FAIL'}")
        failed += not r.ok
    return failed


# the block-sparse backward (Hopper): per key tile, the query tiles of the block mask's transposed table; odd sizes,
# GQA, broadcast and per-head tables, key tiles no query sees, rows that see no key, d64's 128 rows a step
BLOCK_SPARSE_BACKWARD = [  # (mask_mod, dim, dtype, B, H (None: broadcast), the inputs' H, Hkv, M, N)
    (lambda b, h, q, k: (q // 37 == k // 37) & (q >= k), 128, "bf16", None, None, 2, 1, 150, 300),
    (lambda b, h, q, k: (q // 100 == k // 100) & (q < k), 64, "f16", 2, None, 2, 2, 257, 130),
    (lambda b, h, q, k: ((q + 29 * h) // 90 == (k + 29 * h) // 90) & (q - k <= 60), 96, "bf16", None, 4, 4, 2, 333, 99),
    (lambda b, h, q, k: (q >= k) & (q - k <= 70), 64, "bf16", None, None, 2, 1, 200, 200),
]


def block_sparse_backward_cases() -> int:
    """The block-sparse forward and backward with block masks built on the GPU, against float64 autograd."""
    import numpy as np
    import torch

    failed = 0
    for i, (mask_mod, dim, dtype, B, Hm, H, Hkv, M, N) in enumerate(BLOCK_SPARSE_BACKWARD):
        kernel = fagen.compile(dim, dtype=dtype, tier="wgmma", mask=mask_mod, block_sparse=True)
        bm = fagen.create_block_mask(mask_mod, B, Hm, M, N)
        Bx = B or 1
        q, k, v = testing.random_qkv(Bx, H, M, N, dim, dtype, Hkv=Hkv, seed=2000 + i)
        o, lse = kernel(q, k, v, block_mask=bm, return_lse=True)
        do = torch.randn(o.shape, device=o.device, generator=testing.generator(3000 + i)).to(o.dtype)
        g = kernel.backward(q, k, v, o, lse, do, block_mask=bm)
        torch.cuda.synchronize()
        bb, hh, qi, ki = np.ogrid[:Bx, :H, :M, :N]
        keep = np.broadcast_to(np.asarray(mask_mod(bb, hh, qi, ki), bool), (Bx, H, M, N))
        ref = testing.reference_grads(kernel, q, k, v, do, {}, keep, kernel.default_scale)
        naive = testing.reference_grads(kernel, q, k, v, do, {}, keep, kernel.default_scale, dtype=q.dtype)
        ok = True
        for name, got in (("dq", g.dq), ("dk", g.dk), ("dv", g.dv)):
            err = float((got.double() - ref[name]).abs().max())
            bound = 2 * float((naive[name].double() - ref[name]).abs().nan_to_num(0.0).max())
            bound += testing.FLOOR[dtype] * max(1.0, float(ref[name].abs().max()))
            ok = ok and bool(torch.isfinite(got).all()) and err <= bound
        sparse = kernel.backward_plan.main_sparse
        print(f"block-sparse backward {sparse and sparse.spec.name} M={M} N={N}: {'ok' if ok else 'FAIL'}")
        failed += not ok
    return failed


# gathered tensors whose indices run past both ends (clamped in the kernel: memcheck must see no read outside them),
# and a gathered gradient scatter-added by atomics
GATHER_DOC_LEN = 10  # shorter than the queries: doc[q] reads past its end, clamped


def gather_cases(tiers_: tuple) -> int:
    import torch

    failed = 0
    doc = torch.randint(0, 3, (GATHER_DOC_LEN,), dtype=torch.int32, device="cuda")
    rel = torch.randn(2, 5, device="cuda")  # rel[h, q - k + 3]: most reads clamped

    def mask(b, h, q, k):
        return fagen.eq(doc[q], doc[k]) | (q == k)

    def score(s, b, h, q, k):
        return s + rel[h, q - k + 3]

    B, H, M, N = 1, 2, 77, 130
    for tier in tiers_:
        kernel = fagen.compile(64, dtype="bf16", tier=tier, mask=mask, score_mod=score)
        q, k, v = testing.random_qkv(B, H, M, N, 64, "bf16")
        o, lse = kernel(q, k, v, return_lse=True)
        torch.cuda.synchronize()
        tensors = {"doc": doc, "rel": rel}
        keep = testing.keep_matrix(kernel, B, H, M, N, tensors)
        fn = testing.score_function(kernel, B, H, M, N, tensors)
        ref = testing.reference(q, k, v, keep, kernel.default_scale, score=fn)
        naive = testing.reference(q, k, v, keep, kernel.default_scale, dtype=q.dtype, score=fn)
        r = testing.compare(o, lse, ref, naive, "bf16")
        print(f"gather {kernel.name}: {'ok' if r.ok else 'FAIL'}")
        failed += not r.ok
    kernel = fagen.compile(64, dtype="f32", tier="simt", score_mod=score)
    q, k, v = testing.random_qkv(B, H, M, N, 64, "f32")
    o, lse = kernel(q, k, v, return_lse=True)
    g = kernel.backward(q, k, v, o, lse, torch.randn_like(q))
    torch.cuda.synchronize()
    ok = tuple(g.tensors["rel"].shape) == (2, 5) and bool(torch.isfinite(g.tensors["rel"]).all())
    print(f"gather backward {kernel.name}: {'ok' if ok else 'FAIL'}")
    return failed + (not ok)


def main() -> int:
    import cupy

    only = sys.argv[1] if len(sys.argv) > 1 else None  # backward(_mma), hopper, block_sparse, decode, gather: alone
    hopper = cupy.cuda.Device().compute_capability == "90"
    if only == "block_sparse":
        return 1 if block_sparse_cases(hopper) else 0
    if only == "block_sparse_backward":
        return 1 if hopper and block_sparse_backward_cases() else 0
    if only == "decode":
        return 1 if decode_cases() else 0
    if only == "backward_float32":
        return 1 if float32_dkv_cases(hopper) else 0
    failed = 0 if only else decode_cases() + block_sparse_cases(hopper) + float32_dkv_cases(hopper)
    if hopper and not only:
        failed += block_sparse_backward_cases()
    cases = [
        (dict(causal=causal), dim, dtype, tier, B, H, Hkv, M, N) for dim, causal, dtype, tier, B, H, Hkv, M, N in CASES
    ] + VARIANTS
    if only:
        cases = []
    if hopper and only in (None, "hopper"):
        cases += HOPPER
    for options, dim, dtype, tier, B, H, Hkv, M, N in cases:
        kernel = fagen.compile(dim, dtype=dtype, tier=tier, **options)
        r = testing.check_kernel(kernel, B=B, H=H, Hkv=Hkv, M=M, N=N)
        print(f"{kernel.name} M={M} N={N}: err {r.err:.2e} (bound {r.bound:.2e}) {'ok' if r.ok else 'FAIL'}")
        failed += not r.ok
    tiers = {None: ("wgmma", "mma") if hopper else ("mma",), "hopper": ("wgmma",) if hopper else ()}.get(only, ())
    for tier in tiers:
        failed += not varlen_case(tier)
    if only in (None, "gather"):
        failed += gather_cases(("simt", "mma", "wgmma") if hopper else ("simt", "mma"))
    tc = ("mma", "wgmma") if hopper else ("mma",)  # the same cases on the wgmma backward (d64 at both tile sizes)
    if only in ("backward_wgmma", "backward_wide"):
        tc = ("wgmma",) if hopper else ()
    wgmma_own = BACKWARD_WIDE if only == "backward_wide" else BACKWARD_MMA + BACKWARD_WGMMA + BACKWARD_WIDE
    backward = (
        [(t, *case) for t in tc for case in (wgmma_own if t == "wgmma" else BACKWARD_MMA)]
        if only in (None, "backward", "backward_mma", "backward_wgmma", "backward_wide")
        else []
    )
    if only in (None, "backward"):
        backward = [("simt", *case) for case in BACKWARD] + backward
    # seeded: the check of a tensor's gradient (a sum with much cancellation) has a tail of draws where the naive
    # error that sets its bound is unusually small (seen on the simt, mma and wgmma kernels alike); a failure repeats
    for i, (tier, options, dim, dtype, B, H, Hkv, M, N, det) in enumerate(backward):
        kernel = fagen.compile(dim, dtype=dtype, tier=tier, **options)
        r = testing.check_backward(kernel, B=B, H=H, Hkv=Hkv, M=M, N=N, deterministic=det, seed=1000 + i)
        main = kernel.backward_plan.main.spec.name
        if dim > 128 and tier == "wgmma" and kernel.backward_plan.main.spec.tier != "wgmma":
            print(f"backward {kernel.name}: its main kernel stepped down to {main}: FAIL")  # not the kernel to check
            failed += 1
        print(f"backward {kernel.name} ({main}) M={M} N={N} det={det}: {r} {'ok' if r.ok else 'FAIL'}")
        failed += not r.ok
    return 1 if failed else 0


def varlen_case(tier: str) -> bool:
    """A packed batch whose key tiles run past each sequence's end (and past the packed arrays' end), whose O rows
    end inside a warpgroup's 64 (the wgmma forward writes them from shared memory), at d64 (three consumer
    warpgroups), d128 and d256 (a block a work tile)."""
    import torch

    ok = True
    for dim in (64, 128, 256) if tier == "wgmma" else (64,):
        kernel = fagen.compile(dim, dtype="bf16", tier=tier, causal="bottom_right")
        lens_q, lens_k = [3, 130, 1], [70, 129, 200]
        q = torch.randn(sum(lens_q), 2, dim, device="cuda").bfloat16()
        k, v = (torch.randn(sum(lens_k), 1, dim, device="cuda").bfloat16() for _ in range(2))
        cu_q, cu_k = (
            torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
            for n in (lens_q, lens_k)
        )
        o = kernel.varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k))
        torch.cuda.synchronize()
        good = bool(torch.isfinite(o).all()) and kernel._fallback is None
        print(f"{kernel.name} varlen {lens_q} x {lens_k}: {'ok' if good else 'FAIL'}")
        ok &= good
    return ok


if __name__ == "__main__":
    sys.exit(main())
