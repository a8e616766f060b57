"""Planning: small rules that turn (program, head dim, dtype, arch) into a KernelSpec, and the tier choice.

Every decision about a kernel's shape is made here, in Python, and tested; the templates only substitute.
"""
from __future__ import annotations

from dataclasses import dataclass

from .spec import DTYPE_BYTES, KernelSpec, SpecError

# Shared memory one thread block may use (opt-in maximum), bytes.
SMEM_LIMIT = {"sm_80": 163 * 1024, "sm_86": 99 * 1024, "sm_89": 99 * 1024, "sm_90": 227 * 1024,
              "sm_90a": 227 * 1024}


@dataclass(frozen=True)
class Choice:
    spec: KernelSpec
    reason: str


def simt_smem_bytes(head_dim: int, block_m: int, block_n: int) -> int:
    """Q_i, K_j (rows padded by one word), V_j and P_ij, all float."""
    return 4 * (block_m * head_dim + block_n * (head_dim + 1) + block_n * head_dim + block_m * block_n)


def simt_spec(variant: str, head_dim: int, dtype: str, arch: str) -> KernelSpec:
    """The portable tier: 4 warps; each warp owns block_m/4 query rows, each lane 32-strided keys and dims.

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


def choose(variant: str, head_dim: int, dtype: str, arch: str, tier: str | None = None) -> Choice:
    if tier not in (None, "simt"):
        raise SpecError(f"tier: {tier!r} is not available (available: simt)")
    return Choice(simt_spec(variant, head_dim, dtype, arch), "the portable tiled tier (the only tier so far)")


def smem_bytes(spec: KernelSpec) -> int:
    if spec.tier == "simt":
        return simt_smem_bytes(spec.head_dim, spec.block_m, spec.block_n)
    raise SpecError(f"unknown tier {spec.tier!r}")


__all__ = ["Choice", "choose", "smem_bytes", "simt_spec", "SMEM_LIMIT", "DTYPE_BYTES"]
