"""simt: the portable tier. A tiled shared-memory kernel on plain float arithmetic: any head dim that is a
multiple of 8, fp32 as well as f16/bf16, any strides. The fallback of the faster tiers."""

from __future__ import annotations

from ..contract import Kind
from ..spec import KernelSpec, SpecError
from . import SMEM_LIMIT, Tier, register


def smem_bytes(head_dim: int, block_m: int, block_n: int) -> int:
    """Q_i, K_j (rows padded by one word), V_j and P_ij, all float."""
    return 4 * (block_m * head_dim + block_n * (head_dim + 1) + block_n * head_dim + block_m * block_n)


class Simt(Tier):
    name = "simt"
    priority = 0
    templates = {Kind.FORWARD: "flash_fwd_simt.cu.jinja"}
    describe = "the portable tier (any head dim, f32, any strides)"

    def supports(self, kind, head_dim, dtype, arch):
        return None if kind in self.templates else f"no {kind.value} kernel in this tier"

    def validate(self, spec):
        if problem := self.powers_of_two(spec):
            return problem
        if spec.block_m % spec.num_warps or spec.block_n % 32:
            return (
                f"block_m={spec.block_m} must be a multiple of num_warps={spec.num_warps} and "
                f"block_n={spec.block_n} of 32"
            )
        return None

    def configure(self, kind, head_dim, dtype, arch, masked):
        """4 warps; each warp owns block_m/4 query rows, each lane 32-strided keys and dims.

        Rows per warp trade registers (acc holds rows × ceil(D/32) floats per lane) against reuse of each
        shared-memory load; 16 rows up to D = 128 and 8 beyond keep the accumulator at 64 floats per lane.
        Tiles shrink (keys first) until they fit the architecture's shared memory.
        """
        block_m = 64 if head_dim <= 128 else 32
        block_n = 64 if head_dim <= 128 else 32
        while smem_bytes(head_dim, block_m, block_n) > SMEM_LIMIT[arch]:
            if block_n > 32:
                block_n //= 2
            elif block_m > 16:
                block_m //= 2
            else:
                raise SpecError(f"head_dim {head_dim} does not fit {arch}'s shared memory")
        return dict(block_m=block_m, block_n=block_n, num_warps=4, stages=1), "rules"

    def smem_bytes(self, spec: KernelSpec) -> int:
        return smem_bytes(spec.head_dim, spec.block_m, spec.block_n)


register(Simt())
