"""simt: the portable tier. A tiled shared-memory kernel on plain float arithmetic: any head dim that is a
multiple of 8, fp32 as well as f16/bf16, any strides. The fallback of the faster tiers."""

from __future__ import annotations

from ..contract import Kind
from ..spec import KernelSpec, SpecError
from . import SMEM_LIMIT, Tier, register


def smem_bytes(head_dim: int, block_m: int, block_n: int) -> int:
    """Q_i, K_j (rows padded by one word), V_j and P_ij, all float."""
    return 4 * (block_m * head_dim + block_n * (head_dim + 1) + block_n * head_dim + block_m * block_n)


def decode_lanes(head_dim: int, dtype: str) -> tuple[int, int, int]:
    """The split kernel's layout of one key row over lanes: (VEC elements per 16-byte load, LANES per key
    (a power of two, at most 32), VECS per lane). A key group of LANES lanes reads a row with 16-byte loads."""
    vec = 4 if dtype == "f32" else 8
    vecs = -(-head_dim // vec)
    lanes = min(32, 1 << (vecs - 1).bit_length())
    return vec, lanes, -(-vecs // lanes)


ROW_KERNEL_WARPS = 8  # the backward's preprocess and convert: 256 threads a block


def row_lanes(head_dim: int, dtype: str) -> int | None:
    """The backward's preprocess and convert read a row of D values as 16-byte chunks, one a thread; a row takes
    the power of two of lanes at or above its chunks, up to 32 (its lanes then sit in one warp and sum by
    shuffles; lanes past the chunks idle: d96 bf16 has 12 chunks on 16 lanes). Their count, or None (a warp takes
    a row at a time)."""
    vec = 4 if dtype == "f32" else 8
    chunks = head_dim // vec
    lanes = 1 << (chunks - 1).bit_length() if chunks else 0
    return lanes if head_dim % vec == 0 and 0 < lanes <= 32 else None


def decode_min_blocks(head_dim: int, num_warps: int = 4, dtype: str = "bf16") -> int:
    """The split kernel's __launch_bounds__ minimum of resident blocks per SM: 16 warps (128 registers a
    thread, 64 KiB of loads in flight per SM) up to D = 128 where every lane of a key group holds dims; 12
    warps where some lanes idle (D = 96: their loads are predicated, and 128 registers spilled); beyond
    D = 128, 8 warps. None spills."""
    vec, lanes, vecs = decode_lanes(head_dim, dtype)
    warps = 8 if head_dim > 128 else 16 if lanes * vecs * vec == head_dim else 12
    return max(1, warps // num_warps)


def backward_smem_bytes(kind: Kind, head_dim: int, block_m: int, block_n: int, num_warps: int = 4) -> int:
    """BWD: Q_i and dO_i (rows padded by one word), K_j, V_j, P_ij^T and dS_ij^T, lse_i and D_i, one word per
    warp. BWD_DQ: Q_i, dO_i, K_j and V_j (rows padded), dS_ij. All float."""
    if kind is Kind.BWD:
        return 4 * (
            2 * block_m * (head_dim + 1) + 2 * block_n * head_dim + 2 * block_n * block_m + 2 * block_m + num_warps
        )
    return 4 * (2 * block_m * head_dim + 2 * block_n * (head_dim + 1) + block_m * block_n)


def backward_tiles(kind: Kind, head_dim: int, arch: str) -> dict:
    """4 warps. BWD: a block owns block_n keys (block_n / 4 per warp) and takes block_m = 64 query rows at a time
    (32 beyond D = 128), so that dK and dV (2 x keys per warp x ceil(D/32) floats per lane) stay at 64 registers;
    keys shrink first, then rows (down to 32, a lane's queries), until the tiles fit shared memory. BWD_DQ: the
    forward's layout with 8 rows per warp (4 beyond D = 128) and 32 keys per tile; rows shrink to fit."""
    wide = head_dim > 128
    if kind is Kind.BWD:
        block_m, block_n, floor_m, floor_n = (32, 16, 32, 4) if wide else (64, 32, 32, 4)
    else:
        block_m, block_n, floor_m, floor_n = (16, 32, 4, 32) if wide else (32, 32, 4, 32)
    while backward_smem_bytes(kind, head_dim, block_m, block_n) > SMEM_LIMIT[arch]:
        if block_n > floor_n:
            block_n //= 2
        elif block_m > floor_m:
            block_m //= 2
        else:
            raise SpecError(f"head_dim {head_dim} does not fit {arch}'s shared memory")
    return dict(block_m=block_m, block_n=block_n, num_warps=4, stages=1)


def decode_fits(arrays) -> str | None:
    """A split kernel (this tier's or mma's) reads and appends cache rows with 16-byte loads: unit stride along
    D, strides that are multiples of 16 bytes, 16-byte aligned bases, for the caches and k_new, v_new."""
    for name in ("k_cache", "v_cache", "k_new", "v_new"):  # k_new, v_new where appending
        t = arrays.get(name)
        if t is None:
            continue
        item = 4 if t.dtype == "f32" else 2
        if t.strides[-1] != 1 or any(s * item % 16 for s in t.strides[:-1]) or t.ptr % 16:
            return f"{name} is not 16-byte aligned with unit stride along D"
    return None


# The block mask: 16 warps a block, each classifying one key tile at a time (a 16k-token mask at 128 x 128 tiles
# is 128 blocks of query tiles, so the warps of one block are what keeps an SM's schedulers busy).
BLOCK_MASK_WARPS = 16
DECODE_UNROLL = 4  # keys per key group per step: 2 x 4 16-byte loads in flight per thread


class Simt(Tier):
    name = "simt"
    priority = 0
    templates = {
        Kind.FORWARD: "flash_fwd_simt.cu.jinja",
        Kind.DECODE_SPLIT: "flash_decode_split_simt.cu.jinja",
        Kind.BWD_PREPROCESS: "flash_bwd_preprocess.cu.jinja",
        Kind.BWD: "flash_bwd_simt.cu.jinja",
        Kind.BWD_CONVERT: "flash_bwd_convert.cu.jinja",
        Kind.BWD_DQ: "flash_bwd_dq_simt.cu.jinja",
        Kind.FORWARD_SPARSE: "flash_fwd_simt.cu.jinja",
        Kind.BLOCK_MASK: "flash_block_mask.cu.jinja",
    }
    describe = "the portable tier (any head dim, f32, any strides)"
    decode_blocks_per_sm = 4  # resident split blocks per SM the split heuristic plans for

    def supports(self, kind, head_dim, dtype, arch):
        return None if kind in self.templates else f"no {kind.value} kernel in this tier"

    def validate(self, spec):
        if spec.kind is Kind.BLOCK_MASK:  # any tiles (the reading kernel's); a key tile per warp, at most 32 warps
            return None if spec.num_warps <= 32 else f"num_warps={spec.num_warps}: at most 32"
        if spec.kind is Kind.DECODE_SPLIT:
            _, lanes, _ = decode_lanes(spec.head_dim, spec.dtype)
            groups = spec.num_warps * 32 // lanes
            if spec.block_n % groups:
                return f"block_n={spec.block_n} must be a multiple of the {groups} key groups of the block"
            return None
        if spec.kind in (Kind.BWD_PREPROCESS, Kind.BWD_CONVERT):
            return None if spec.block_m % spec.num_warps == 0 else f"{spec.kind.value}: block_m a multiple of num_warps"
        if problem := self.powers_of_two(spec):
            return problem
        if spec.kind is Kind.BWD:
            if spec.block_m % 32 or spec.block_n % spec.num_warps:
                return (
                    f"block_m={spec.block_m} must be a multiple of 32 and block_n={spec.block_n} of "
                    f"num_warps={spec.num_warps}"
                )
            return None
        if problem := self.powers_of_two(spec):
            return problem
        if spec.block_m % spec.num_warps or spec.block_n % 32:
            return (
                f"block_m={spec.block_m} must be a multiple of num_warps={spec.num_warps} and "
                f"block_n={spec.block_n} of 32"
            )
        return None

    def lighter(self, spec):
        """Decode split: fewer keys per key group per step (its UNROLL halves: K/V vectors and scores in flight),
        when a score function's registers spill (a gathered bias read per key)."""
        if spec.kind is Kind.DECODE_SPLIT:
            _, lanes, _ = decode_lanes(spec.head_dim, spec.dtype)
            groups = spec.num_warps * 32 // lanes
            if spec.block_n // 2 >= groups and (spec.block_n // 2) % groups == 0:
                return self.replace(spec, block_n=spec.block_n // 2)
        return None

    def configure(self, kind, head_dim, dtype, arch, masked):
        """4 warps; each warp owns block_m/4 query rows, each lane 32-strided keys and dims.

        Rows per warp trade registers (acc holds rows × ceil(D/32) floats per lane) against reuse of each
        shared-memory load; 16 rows up to D = 128 and 8 beyond keep the accumulator at 64 floats per lane.
        Tiles shrink (keys first) until they fit the architecture's shared memory.

        Decode: the split kernel takes block_m = 4 rows (a GQA group of 4 at q_len 1) and block_n keys per
        step (its key groups × DECODE_UNROLL).
        """
        if kind is Kind.BLOCK_MASK:  # FlexAttention's default block size; the reading kernel's tiles replace it
            return dict(block_m=128, block_n=128, num_warps=BLOCK_MASK_WARPS, stages=1), "rules"
        if kind is Kind.DECODE_SPLIT:
            _, lanes, _ = decode_lanes(head_dim, dtype)
            return dict(block_m=4, block_n=4 * 32 // lanes * DECODE_UNROLL, num_warps=4, stages=1), "rules"
        if kind in (Kind.BWD_PREPROCESS, Kind.BWD_CONVERT):  # a 16-byte chunk a thread, else a row a warp
            lanes = row_lanes(head_dim, dtype)
            rows = 32 * ROW_KERNEL_WARPS // lanes if lanes else ROW_KERNEL_WARPS
            return dict(block_m=max(rows, ROW_KERNEL_WARPS), block_n=32, num_warps=ROW_KERNEL_WARPS, stages=1), "rules"
        if kind in (Kind.BWD, Kind.BWD_DQ):
            return backward_tiles(kind, head_dim, arch), "rules"
        block_m = 64 if head_dim <= 128 else 32
        block_n = 64 if head_dim <= 128 else 32
        if dtype == "f32" and head_dim > 32:  # its q.k sums in double (context): 8 rows a warp hold them unspilled
            block_m = 32
        while smem_bytes(head_dim, block_m, block_n) > SMEM_LIMIT[arch]:
            if block_n > 32:
                block_n //= 2
            elif block_m > 16:
                block_m //= 2
            else:
                raise SpecError(f"head_dim {head_dim} does not fit {arch}'s shared memory")
        return dict(block_m=block_m, block_n=block_n, num_warps=4, stages=1), "rules"

    def smem_bytes(self, spec: KernelSpec) -> int:
        if spec.kind is Kind.DECODE_SPLIT:  # each warp's merged state: m, l and acc of block_m rows
            return 4 * spec.num_warps * spec.block_m * (spec.head_dim + 2)
        if spec.kind in (Kind.BWD_PREPROCESS, Kind.BWD_CONVERT, Kind.BLOCK_MASK):
            return 0
        if spec.kind in (Kind.BWD, Kind.BWD_DQ):
            return backward_smem_bytes(spec.kind, spec.head_dim, spec.block_m, spec.block_n, spec.num_warps)
        return smem_bytes(spec.head_dim, spec.block_m, spec.block_n)

    def context(self, spec: KernelSpec, *, masked: bool = False) -> dict:
        if spec.kind is Kind.DECODE_SPLIT:
            vec, lanes, vecs = decode_lanes(spec.head_dim, spec.dtype)
            return dict(
                decode_vec=vec,
                decode_lanes=lanes,
                decode_vecs=vecs,
                decode_min_blocks=decode_min_blocks(spec.head_dim, spec.num_warps, spec.dtype),
            )
        if spec.kind in (Kind.FORWARD, Kind.FORWARD_SPARSE):
            # float32 inputs sum q.k in double (products exact, one rounding): at scores in the hundreds a float sum
            # of 128 products missed FlashAttention's rule on the log-sum-exp by 1.1x (H200, 2026-11-27)
            return dict(qk_accumulator="double" if spec.dtype == "f32" else "float")
        if spec.kind in (Kind.BWD_PREPROCESS, Kind.BWD_CONVERT):
            row = row_lanes(spec.head_dim, spec.dtype)
            vector = row is not None and spec.block_m * row == 32 * spec.num_warps
            return dict(vector_rows=vector, row_lanes=row or 1)
        return {}

    def fits(self, arrays):
        """The decode split kernel reads (and appends) cache rows with 16-byte loads (decode_fits); the forward
        takes any strides."""
        return decode_fits(arrays) if "k_cache" in arrays else None


register(Simt())
