"""Planning: small rules that turn (program, head dim, dtype, arch) into a KernelSpec, and the tier choice.

Every decision about a kernel's shape is made here, in Python, and tested; the templates only substitute.
`fagen tune` times candidate configurations on a GPU and records the winners in `tuned.json`, which
`choose` prefers over the rules when it has an entry.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from .spec import DTYPE_BYTES, KernelSpec, SpecError

# Shared memory one thread block may use (opt-in maximum), bytes.
SMEM_LIMIT = {"sm_80": 163 * 1024, "sm_86": 99 * 1024, "sm_89": 99 * 1024, "sm_90": 227 * 1024,
              "sm_90a": 227 * 1024}
TUNED = Path(__file__).with_name("tuned.json")


@dataclass(frozen=True)
class Choice:
    spec: KernelSpec
    reason: str


# --- simt: the portable tier -------------------------------------------------------------------------------
def simt_smem_bytes(head_dim: int, block_m: int, block_n: int) -> int:
    """Q_i, K_j (rows padded by one word), V_j and P_ij, all float."""
    return 4 * (block_m * head_dim + block_n * (head_dim + 1) + block_n * head_dim + block_m * block_n)


def simt_spec(variant: str, head_dim: int, dtype: str, arch: str) -> KernelSpec:
    """4 warps; each warp owns block_m/4 query rows, each lane 32-strided keys and dims.

    Rows per warp trade registers (acc holds rows × ceil(D/32) floats per lane) against reuse of each
    shared-memory load; 16 rows up to D = 128 and 8 beyond keep the accumulator at 64 floats per lane.
    Tiles shrink (keys first) until they fit the architecture's shared memory.
    """
    block_m = 64 if head_dim <= 128 else 32
    block_n = 64 if head_dim <= 128 else 32
    while simt_smem_bytes(head_dim, block_m, block_n) > SMEM_LIMIT[arch]:
        if block_n > 32:
            block_n //= 2
        elif block_m > 16:
            block_m //= 2
        else:
            raise SpecError(f"head_dim {head_dim} does not fit {arch}'s shared memory")
    return KernelSpec(variant, head_dim, dtype, arch, "simt", block_m, block_n, num_warps=4)


# --- mma: tensor cores ------------------------------------------------------------------------------------
def mma_smem_bytes(head_dim: int, block_m: int, block_n: int, stages: int) -> int:
    """Q_i and a ring of `stages` K_j and V_j tiles, 16-bit."""
    return 2 * head_dim * (block_m + 2 * stages * block_n)


def mma_supports(head_dim: int, dtype: str) -> str | None:
    """None if the mma tier takes this head dim and dtype, else why not."""
    if dtype not in ("f16", "bf16"):
        return f"{dtype} inputs have no 16-bit tensor-core path here"
    if head_dim % 32:
        return f"head dim {head_dim} is not a multiple of 32 (the swizzled 16-byte chunk layout needs it)"
    return None


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


def mma_rule(head_dim: int, causal: bool) -> dict:
    """Default tiles per head dim, before tuning. Registers per thread hold O (16·D/32 floats per row tile),
    S (16·block_n/32) and Q (16·D/64 words): one row tile per warp from D = 128 on keeps that near 200.
    """
    if head_dim <= 64:
        return dict(block_m=128, block_n=64, num_warps=4, stages=2)
    if head_dim <= 128:
        return dict(block_m=128, block_n=64, num_warps=8, stages=2)
    return dict(block_m=64, block_n=32, num_warps=4, stages=2)


@functools.lru_cache(maxsize=1)
def tuned_table() -> dict:
    try:
        return json.loads(TUNED.read_text())["configs"]
    except (OSError, ValueError, KeyError):
        return {}


def tuned_key(arch: str, head_dim: int, dtype: str, causal: bool) -> str:
    return f"{arch}/{dtype}/d{head_dim}/{'causal' if causal else 'full'}"


def mma_spec(variant: str, head_dim: int, dtype: str, arch: str, causal: bool, **override) -> tuple[KernelSpec, str]:
    table = tuned_table()
    # f16 and bf16 kernels differ only in the MMA's input type: f16 takes bf16's tiles unless tuned itself
    entry = table.get(tuned_key(arch, head_dim, dtype, causal)) or table.get(tuned_key(arch, head_dim, "bf16", causal))
    cfg, source = (dict(entry), "tuned") if entry else (mma_rule(head_dim, causal), "rule")
    cfg.update(override)
    spec = KernelSpec(variant, head_dim, dtype, arch, "mma", **cfg)
    if mma_smem_bytes(head_dim, spec.block_m, spec.block_n, spec.stages) > SMEM_LIMIT[arch]:
        if spec.stages > 2:
            cfg = dict(cfg, stages=spec.stages - 1)
        elif spec.block_n > 16:
            cfg = dict(cfg, block_n=spec.block_n // 2)
        else:
            raise SpecError(f"head_dim {head_dim}: no mma tiles fit {arch}'s shared memory")
        return mma_spec(variant, head_dim, dtype, arch, causal, **cfg)
    return spec, source


def choose(variant: str, head_dim: int, dtype: str, arch: str, tier: str | None = None, *,
           causal: bool = False) -> Choice:
    """The tier and tiles for a kernel. `causal` (the program masks keys) selects tuned entries."""
    if tier not in (None, "simt", "mma"):
        raise SpecError(f"tier: {tier!r} is not available (available: mma, simt)")
    why_not = mma_supports(head_dim, dtype)
    if tier == "mma" and why_not:
        raise SpecError(f"tier: mma cannot compile this kernel: {why_not}")
    if tier == "simt":
        return Choice(simt_spec(variant, head_dim, dtype, arch), "requested")
    if why_not:
        return Choice(simt_spec(variant, head_dim, dtype, arch), f"the mma tier does not apply: {why_not}")
    spec, source = mma_spec(variant, head_dim, dtype, arch, causal)
    how = "requested" if tier == "mma" else "default for f16/bf16 on sm_80+"
    return Choice(spec, f"{how}; tiles from the {'tuning table' if source == 'tuned' else 'rules'}")


def lighter(spec: KernelSpec) -> KernelSpec | None:
    """The next configuration to try when `spec` spills: one 16-row tile per warp (O and S halve), then
    narrower key tiles. None when there is nothing lighter."""
    import dataclasses
    if spec.tier != "mma":
        return None
    if spec.block_m > 16 * spec.num_warps:
        return dataclasses.replace(spec, block_m=16 * spec.num_warps)
    if spec.block_n > 32:
        return dataclasses.replace(spec, block_n=spec.block_n // 2)
    return None


def smem_bytes(spec: KernelSpec) -> int:
    if spec.tier == "simt":
        return simt_smem_bytes(spec.head_dim, spec.block_m, spec.block_n)
    return mma_smem_bytes(spec.head_dim, spec.block_m, spec.block_n, spec.stages)


__all__ = ["Choice", "choose", "smem_bytes", "simt_spec", "mma_spec", "swizzle", "SMEM_LIMIT", "DTYPE_BYTES"]
