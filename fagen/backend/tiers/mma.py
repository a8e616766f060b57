"""mma: tensor cores through warp-level mma.sync.m16n8k16 (FlashAttention-2's work split), f16/bf16.

K/V stream through a cp.async ring in XOR-swizzled shared memory; P stays in registers between the MMAs.
Inputs it cannot load (unit stride along D and 16-byte aligned rows are needed) go to the simt tier.
The backward's main kernel (Kind.BWD, head dims 64 and 128) is here too: a block owns a key tile (16 keys a
warp) and streams Q_i, dO_i through a 2-deep ring; it loads inputs at any strides itself (element loads where
cp.async cannot), so the runtime needs no fallback for it.
Split-KV decode (Kind.DECODE_SPLIT) is here too: a block owns a 16-row tile of a GQA group's rows (query heads
× q_len) and streams its split's K/V tiles through a cp.async ring, each warp taking a share of every tile;
the last split of a row tile to finish merges the splits (templates/decode_merge_splits.cu.jinja).
"""

from __future__ import annotations

import itertools

from ..contract import MAX_ROW_GRADIENTS, Kind
from ..spec import KernelSpec, SpecError
from . import SMEM_LIMIT, Tier, register


def smem_bytes(head_dim: int, block_m: int, block_n: int, stages: int) -> int:
    """Q_i and a ring of `stages` K_j and V_j tiles, 16-bit."""
    return 2 * head_dim * (block_m + 2 * stages * block_n)


def swizzle(head_dim: int) -> tuple[int, int]:
    """(mask, shift) of the XOR swizzle: chunk ^= (row >> shift) & mask.

    A row of a tile is head_dim/8 chunks of 16 bytes. ldmatrix reads one chunk column from 8 consecutive
    rows; cp.async writes 8 consecutive chunks per 128-byte wavefront. With 8k chunks a row (a multiple of
    128 bytes) XOR-ing by row % 8 puts those 8 in 8 distinct bank groups; with 4k chunks (rows 64k bytes long,
    every other row starting half-way round the banks) XOR-ing by (row / 2) % 4 does.
    """
    chunks = head_dim // 8
    if chunks % 8 == 0:
        return 7, 0
    if chunks % 4 == 0:
        return 3, 1
    raise SpecError(f"head_dim {head_dim}: no swizzle for {chunks} chunks a row")


def swizzled_offset(row: int, col: int, head_dim: int) -> int:
    """The template's tile_offset(row, col), in Python (the bank-conflict tests use it)."""
    mask, shift = swizzle(head_dim)
    return row * head_dim + ((col // 8) ^ ((row >> shift) & mask)) * 8 + col % 8


def q_in_registers(spec: KernelSpec) -> bool:
    """Q_i fragments (row tiles per warp × D/4 registers) stay in registers while they take at most 32;
    beyond, each key tile re-reads them from shared memory (as FlashAttention-2 does)."""
    return spec.block_m // (16 * spec.num_warps) * spec.head_dim // 4 <= 32


def rule(head_dim: int) -> dict:
    """Default tiles per head dim, before tuning. Registers per thread hold O (16·D/32 floats per row tile),
    S (16·block_n/32) and Q (16·D/64 words): one row tile per warp from D = 128 on keeps that near 200.
    """
    if head_dim <= 64:
        return dict(block_m=128, block_n=64, num_warps=4, stages=2)
    if head_dim <= 128:
        return dict(block_m=128, block_n=64, num_warps=8, stages=2)
    return dict(block_m=64, block_n=32, num_warps=4, stages=2)


BWD_HEAD_DIMS = (64, 128)  # the backward's main kernel on this tier; other head dims stay on simt


def backward_smem_bytes(head_dim: int, block_m: int, block_n: int, num_warps: int) -> int:
    """BWD: K_j and V_j, a 2-deep ring of Q_i and dO_i, dS_ij^T (all 16-bit), lse_i and D_i (2 x block_m floats
    each), one float per warp, and the row sums of the tensor gradients (the kernel's static rowsum_s: up to 4
    x num_warps x block_m floats, contract.MAX_ROW_GRADIENTS)."""
    rowsums = (1 + MAX_ROW_GRADIENTS) * num_warps * block_m
    return 2 * head_dim * (2 * block_n + 4 * block_m) + 2 * block_n * block_m + 4 * (4 * block_m + num_warps + rowsums)


def backward_rule(head_dim: int, arch: str) -> dict:
    """BWD tiles: 128 keys (16 per warp: 8 warps) and 64 query rows a step. A thread holds dK_j and dV_j (head_dim
    floats) and S_ij^T, dP_ij^T (block_m / 2 floats each): at D = 128 that is 192 accumulators, at the 255-register
    limit, and a step's fixed work (the loads of the next Q_i and dO_i, lse_i and D_i, the loop's bookkeeping, the
    dQ atomics' addresses) is shared by twice the tensor-core work of 32 rows (an H100 ran d128 8-10% faster than at
    32 rows). Where a score function needs more registers than that leaves, the kernel spills and the pipeline steps
    down to 32 rows (Mma.lighter, backward_stack_budget). 128 rows at D = 64 spill more than the budget under
    NVRTC 13.5 and were not measured. Query rows halve, then keys, until the tiles fit shared memory (sm_86/89's
    99 KiB)."""
    block_m, block_n = 64, 128
    while backward_smem_bytes(head_dim, block_m, block_n, block_n // 16) > SMEM_LIMIT[arch]:
        if block_m > 32:
            block_m //= 2
        elif block_n > 32:
            block_n //= 2
        else:
            raise SpecError(f"head_dim {head_dim}: no mma backward tiles fit {arch}'s shared memory")
    return dict(block_m=block_m, block_n=block_n, num_warps=block_n // 16, stages=2)


# --- split-KV decode ---------------------------------------------------------------------------------------
DECODE_WARP_N = 16  # keys of every K/V tile a warp takes (one k16 step of P V)


def decode_smem_bytes(head_dim: int, block_m: int, block_n: int, num_warps: int, stages: int) -> int:
    """The split kernel: Q (16-bit, block_m rows), then a ring of `stages` K and V tiles (16-bit) that after
    the key loop holds the warps' states for their merge (acc, m, l of block_m rows, float)."""
    ring = 2 * 2 * stages * block_n * head_dim
    merge = 4 * num_warps * block_m * (head_dim + 2)
    return 2 * block_m * head_dim + max(ring, merge)


def decode_rule(head_dim: int, arch: str) -> dict:
    """The split kernel's tiles: one 16-row tile (a GQA group of up to 16 rows: q_len 4 at 4 query heads per KV
    head), 8 warps of 16 keys each per 128-key tile, a 3-deep ring: at d128 two 64 KiB tiles in flight while one
    is computed, one block an SM (196 KiB of shared memory). Measured on an H100 and an H200 (batch 8, GQA 32/8,
    kv 8k and 32k, q_len 1, contiguous and paged 16 / 256; bench/results/h100-2026-11-25-decode): against the
    2-deep ring it held, the H200 reads 5-25 % faster (its 4.8 TB/s needs more bytes in flight than one tile an
    SM) and the H100 -2 to +2 %; 4 warps of 64-key tiles with 3 stages (two blocks an SM) came within 1 %
    of it on both, 4 stages of them (one block) 10-35 % slower. Where the ring does not fit the architecture's
    shared memory, it is 2 deep, then the warps (and keys per tile with them) halve (d256 on sm_90a: 4 warps,
    3 stages; sm_80 keeps 8 warps, 2 stages at d128)."""
    for warps in (8, 4, 2, 1):
        for stages in (3, 2):
            cfg = dict(block_m=16, block_n=warps * DECODE_WARP_N, num_warps=warps, stages=stages)
            if decode_smem_bytes(head_dim, **cfg) <= SMEM_LIMIT[arch]:
                return cfg
    raise SpecError(f"head_dim {head_dim}: no mma decode tiles fit {arch}'s shared memory")


def decode_min_blocks(spec: KernelSpec) -> int:
    """The split kernel's __launch_bounds__ minimum of resident blocks per SM: 2 where shared memory holds two
    (with 4 KiB a block for its static shared memory, 2.1 KiB, and what the driver reserves), else 1. Two blocks
    of 8 warps bound a thread to 128 registers: the head dims that fit twice (up to d64 on sm_90a) compile within
    it without spills (tests/test_decode.py checks every dim on sm_80 and sm_90a)."""
    smem = decode_smem_bytes(spec.head_dim, spec.block_m, spec.block_n, spec.num_warps, spec.stages)
    return 2 if 2 * (smem + 4 * 1024) <= SMEM_LIMIT[spec.arch] else 1


def decode_q_in_registers(spec: KernelSpec) -> bool:
    """Every warp holds all the row tiles' Q fragments (D/4 registers each) while they take at most 32."""
    return spec.block_m // 16 * spec.head_dim // 4 <= 32


GRID = dict(block_m=(64, 128, 256), block_n=(32, 64, 128), num_warps=(4, 8), stages=(2, 3, 4))


class Mma(Tier):
    name = "mma"
    priority = 10
    templates = {
        Kind.FORWARD: "flash_fwd_mma.cu.jinja",
        Kind.FORWARD_SPARSE: "flash_fwd_mma.cu.jinja",
        Kind.BWD: "flash_bwd_mma.cu.jinja",
        Kind.DECODE_SPLIT: "flash_decode_split_mma.cu.jinja",
    }
    exp2 = "fast_exp2"  # MUFU.EX2 (ex2.approx.ftz), as FlashAttention
    tanh = "fast_tanh"  # MUFU.TANH (tanh.approx.f32)
    fallback = "simt"
    describe = "default for f16/bf16 on sm_80+"
    decode_blocks_per_sm = 1  # resident split blocks per SM the split heuristic plans for (decode_rule)
    # BWD at its large tiles spills a few words at the register limit for some masks (their loads: one or two a
    # step); a stack frame beyond this is a spilling loop, and the tiles step down.
    backward_stack_budget = 32

    def supports(self, kind, head_dim, dtype, arch):
        if kind not in self.templates:
            return f"no {kind.value} kernel in this tier"
        if dtype not in ("f16", "bf16"):
            return f"{dtype} inputs have no 16-bit tensor-core path here"
        if head_dim % 32:
            return f"head dim {head_dim} is not a multiple of 32 (the swizzled 16-byte chunk layout needs it)"
        if kind is Kind.BWD and head_dim not in BWD_HEAD_DIMS:
            return f"the backward's mma kernel takes head dims {BWD_HEAD_DIMS}, not {head_dim}"
        return None

    def validate(self, spec):
        if spec.kind is Kind.DECODE_SPLIT:
            if spec.block_m % 16 or spec.block_n % (16 * spec.num_warps):
                return (
                    f"block_m={spec.block_m} must be a multiple of 16 and block_n={spec.block_n} of 16 keys per "
                    f"warp ({16 * spec.num_warps})"
                )
            if spec.block_n * spec.head_dim // 8 % (32 * spec.num_warps):
                return f"block_n={spec.block_n}: a tile's 16-byte chunks must split evenly over the threads"
            if spec.stages < 2:
                return "the mma tier pipelines K/V through at least 2 stages"
            return self.supports(spec.kind, spec.head_dim, spec.dtype, spec.arch)
        if problem := self.powers_of_two(spec):
            return problem
        if spec.kind is Kind.BWD:
            row_tiles = spec.block_m // 16
            if spec.block_n != 16 * spec.num_warps:
                return f"block_n={spec.block_n} must be 16 keys per warp ({16 * spec.num_warps})"
            if spec.block_m < 32 or spec.num_warps % row_tiles or spec.head_dim // (spec.num_warps // row_tiles) % 16:
                return (
                    f"block_m={spec.block_m}: dQ's {row_tiles} row tiles must be at least 2 and split "
                    f"num_warps={spec.num_warps} into dim groups of a multiple of 16"
                )
            return self.supports(spec.kind, spec.head_dim, spec.dtype, spec.arch)
        rows = 16 * spec.num_warps
        if spec.block_n % 16 or spec.block_m % rows:
            return f"block_m={spec.block_m} must be a multiple of {rows} and block_n={spec.block_n} of 16"
        if spec.stages < 2:
            return "the mma tier pipelines K/V through at least 2 stages"
        return self.supports(spec.kind, spec.head_dim, spec.dtype, spec.arch)

    def configure(self, kind, head_dim, dtype, arch, masked):
        from ..tuned import tuned_entry

        if kind is Kind.BWD:
            return backward_rule(head_dim, arch), "rules"
        if kind is Kind.DECODE_SPLIT:
            return decode_rule(head_dim, arch), "rules"
        entry = tuned_entry(self.name, arch, head_dim, dtype, masked)
        cfg, source = (dict(entry), "tuning table") if entry else (rule(head_dim), "rules")
        while smem_bytes(head_dim, cfg["block_m"], cfg["block_n"], cfg["stages"]) > SMEM_LIMIT[arch]:
            if cfg["stages"] > 2:
                cfg["stages"] -= 1
            elif cfg["block_n"] > 16:
                cfg["block_n"] //= 2
            else:
                raise SpecError(f"head_dim {head_dim}: no mma tiles fit {arch}'s shared memory")
        return cfg, source

    def smem_bytes(self, spec):
        if spec.kind is Kind.DECODE_SPLIT:
            return decode_smem_bytes(spec.head_dim, spec.block_m, spec.block_n, spec.num_warps, spec.stages)
        if spec.kind is Kind.BWD:
            return backward_smem_bytes(spec.head_dim, spec.block_m, spec.block_n, spec.num_warps)
        return smem_bytes(spec.head_dim, spec.block_m, spec.block_n, spec.stages)

    def lighter(self, spec):
        """One 16-row tile per warp (O and S halve), then narrower key tiles. BWD: fewer query rows a step."""
        if spec.kind is Kind.BWD:
            return self.replace(spec, block_m=spec.block_m // 2) if spec.block_m > 32 else None
        if spec.kind is Kind.DECODE_SPLIT:  # fewer row tiles a block (their O is what a thread holds)
            return self.replace(spec, block_m=spec.block_m - 16) if spec.block_m > 16 else None
        if spec.block_m > 16 * spec.num_warps:
            return self.replace(spec, block_m=16 * spec.num_warps)
        if spec.block_n > 32:
            return self.replace(spec, block_n=spec.block_n // 2)
        return None

    def candidates(self, kind, head_dim, dtype, arch):
        if kind is not Kind.FORWARD:
            return []
        out = []
        for bm, bn, w, st in itertools.product(*GRID.values()):
            cfg = dict(block_m=bm, block_n=bn, num_warps=w, stages=st)
            if bm // (16 * w) > 2 or bm % (16 * w) or smem_bytes(head_dim, bm, bn, st) > SMEM_LIMIT[arch]:
                continue
            out.append(cfg)
        return out

    def context(self, spec, *, masked=False):
        mask, shift = swizzle(spec.head_dim)
        if spec.kind is Kind.DECODE_SPLIT:
            return dict(
                swizzle_mask=mask,
                swizzle_shift=shift,
                mma_type=spec.dtype,
                q_in_registers="true" if decode_q_in_registers(spec) else "false",
                decode_min_blocks=decode_min_blocks(spec),
            )
        extra = {}
        if spec.kind is Kind.BWD:  # dS_ij^T's rows are block_m 16-bit values
            extra = dict(zip(("ds_swizzle_mask", "ds_swizzle_shift"), swizzle(spec.block_m)))
        return dict(
            **extra,
            swizzle_mask=mask,
            swizzle_shift=shift,
            mma_type=spec.dtype,
            q_in_registers="true" if q_in_registers(spec) else "false",
        )

    def fits(self, arrays):
        """16-byte cp.async row loads and paired O stores: unit stride along D, row and head/batch strides
        that are multiples of 8 elements, 16-byte aligned bases (4-byte for O). Decode: the caches (and k_new,
        v_new) as the simt split kernel needs them (q is read element by element, o by one warp a row)."""
        if "k_cache" in arrays:
            from .simt import decode_fits

            return decode_fits(arrays)
        for name in ("q", "k", "v"):
            t = arrays[name]
            if t.strides[-1] != 1 or any(s % 8 for s in t.strides[:-1]) or t.ptr % 16:
                return f"{name} is not 16-byte aligned with unit stride along D"
        o = arrays["o"]
        if o.strides[-1] != 1 or any(s % 2 for s in o.strides[:-1]) or o.ptr % 4:
            return "o is not 4-byte aligned with unit stride along D"
        return None


register(Mma())
