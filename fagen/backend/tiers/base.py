"""The tier interface: one class per tier owns every decision about its kernels.

What it supports, its tiles (rules and the tuning table), its shared memory, lighter configurations to fall
back to, its template and render context, whether call-time inputs fit it, and its launch geometry. Nothing
outside a tier's module compares tier names: the planner asks the registry, in priority order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import ClassVar, Protocol

from ..contract import BWD_MAINS, Kind
from ..spec import KernelSpec, SpecError


class Strided(Protocol):
    """What a tier reads of a call's array to say whether its kernel takes it (fits); the runtime's Array has it."""

    @property
    def ptr(self) -> int: ...  # the device address

    @property
    def shape(self) -> tuple: ...

    @property
    def strides(self) -> tuple: ...  # in elements

    @property
    def dtype(self) -> str | None: ...  # fagen's name (f16, bf16, f32)


# Shared memory one thread block may use (opt-in maximum), bytes.
SMEM_LIMIT = {"sm_80": 163 * 1024, "sm_86": 99 * 1024, "sm_89": 99 * 1024, "sm_90": 227 * 1024, "sm_90a": 227 * 1024}


class Tier:
    name: ClassVar[str]
    priority: ClassVar[int] = 0  # the planner's default is the supporting tier of highest priority
    templates: ClassVar[dict]  # per kernel kind: a template's name in templates/ (or a file's path)
    exp2: ClassVar[str] = "exp2f"  # C function for 2^x
    tanh: ClassVar[str] = "tanhf"  # C function for tanh
    fallback: ClassVar[str | None] = None  # the tier that takes inputs this one cannot (see fits)
    describe: ClassVar[str] = ""  # why the planner picks it by default (`fagen compile` shows it)

    # --- what it compiles ---
    def supports(self, kind: Kind, head_dim: int, dtype: str, arch: str) -> str | None:
        """None if this tier compiles such a kernel, else why not (shown to the user)."""
        raise NotImplementedError

    def validate(self, spec: KernelSpec) -> str | None:
        """None if `spec`'s tiles are a configuration of this tier, else what is wrong."""
        return None

    @staticmethod
    def powers_of_two(spec: KernelSpec) -> str | None:
        """What is not a power of two among block_m, block_n and num_warps (the simt and mma templates' tiling)."""
        for f in ("block_m", "block_n", "num_warps"):
            v = getattr(spec, f)
            if v & (v - 1):
                return f"{f} must be a power of two, got {v}"
        return None

    def configure(self, kind: Kind, head_dim: int, dtype: str, arch: str, masked: bool) -> tuple[dict, str]:
        """(tile fields for the KernelSpec, where they came from: 'rules' or 'tuning table')."""
        raise NotImplementedError

    def smem_bytes(self, spec: KernelSpec) -> int:
        raise NotImplementedError

    def lighter(self, spec: KernelSpec) -> KernelSpec | None:
        """The next configuration to try when `spec` spills; None when there is nothing lighter."""
        return None

    def tight(self, spec: KernelSpec) -> bool:
        """Whether a score function (beyond the plain scaled q·k) is likely to spill `spec`'s registers: the
        pipeline then compiles its `lighter` tiles beside it, at once, so that a step down costs no second wait."""
        return False

    # The backward's main kernel (Kind.BWD) steps down to `lighter` tiles while its stack frame (spills) is larger
    # than this many bytes: a tier whose large tiles spill a reload or two a step, and gain more from the tiles
    # than they lose, raises it.
    backward_stack_budget = 0

    def orders_key_tiles(self, spec) -> bool:
        """Whether this tier's backward main kernel `spec` starts its key tiles in the heavy-first order where early
        key tiles see more query tiles (codegen.backward_context's heavy_key_tiles_first)."""
        return False

    def takes_heads_inner(self, spec) -> bool:
        """Whether this tier's backward main kernel `spec` may take a GQA group's query heads inner where early key
        tiles see more query tiles (codegen.backward_context's heads_inner)."""
        return False

    def folds_scale(self, spec) -> bool:
        """Whether this tier's backward main kernel `spec` takes dL/d(q.k) from P with the scale folded into D_i
        (codegen.backward_context's fold_scale: rule::natural_scale, d_scaled and dqk_p, proven (l))."""
        return False

    def backward_key(self) -> dict:
        """What, beside the program and the spec, a backward built on this tier depends on (module settings that
        change its source): part of the backward's compile-cache key."""
        return {}

    def too_heavy(self, spec: KernelSpec, resources) -> str | None:
        """Why a compiled kernel steps down to `lighter` tiles, or None: a forward or split-KV decode kernel that
        spills; a backward main kernel whose stack frame passes `backward_stack_budget`. The backward's other
        kernels and the block-mask kernel keep their tiles."""
        if spec.kind in BWD_MAINS:
            if resources.stack_frame <= self.backward_stack_budget:
                return None
            return f"{spec.name}'s stack frame ({resources.stack_frame} B) is over {self.backward_stack_budget} B"
        if spec.kind in (Kind.FORWARD, Kind.FORWARD_SPARSE, Kind.DECODE_SPLIT) and resources.spills:
            return f"{spec.name} spilled ({resources.stack_frame} B stack frame), so lighter tiles"
        return None

    def candidates(self, kind: Kind, head_dim: int, dtype: str, arch: str) -> list[dict]:
        """Tile fields `fagen tune` times (valid, fitting shared memory); whether they run persistent is
        `persistent`'s decision, as for the tier's own tiles."""
        return []

    def persistent(self, kind: Kind, head_dim: int, arch: str, masked: bool, tiles: dict) -> bool:
        """Whether a kernel of these tiles runs a block per SM taking work tiles in turn (a persistent_kinds
        kind only)."""
        return False

    # --- rendering ---
    def context(self, spec: KernelSpec, *, masked: bool = False) -> dict:
        """Tier-specific values the template substitutes (already spelled as C); `masked`: the program masks keys."""
        return {}

    # --- launching ---
    # the kinds whose kernel can be persistent (KernelSpec.persistent): a block per SM taking work tiles in turn
    persistent_kinds: ClassVar[tuple] = ()

    def extra_params(self, spec: KernelSpec) -> tuple:
        """This tier's own kernel parameters beside the kind's (fagen.backend.contract), e.g. tensor maps."""
        return ()

    def launch_grid(self, spec: KernelSpec, grid: tuple[int, int, int], device: int):
        """(the grid to launch, the values of extra parameters it needs) for `grid`, the kind's grid of work tiles,
        on `device`: a persistent kernel launches fewer blocks and is told the work tiles' grid."""
        return grid, {}

    def prepare(self, slots: dict, arrays: dict, spec: KernelSpec):
        """Fill the extra parameters' slots for a call shape; returns an object whose update(q, k, v) refreshes
        them per call (the addresses), or None."""
        return None

    def fits(self, arrays: Mapping[str, Strided]) -> str | None:
        """None if this tier's kernel takes these arrays (q, k, v, o, lse), else why not."""
        return None

    def backward_fits(self, arrays: Mapping[str, Strided]) -> str | None:
        """None if this tier's backward main kernel takes these arrays (q, k, v, dout), else why not."""
        return None

    def threads(self, spec: KernelSpec) -> int:
        return 32 * spec.num_warps

    def grid(self, spec: KernelSpec, batch: int, heads: int, seqlen_q: int) -> tuple[int, int, int]:
        return (-(-seqlen_q // spec.block_m), heads, batch)

    decode_blocks_per_sm: ClassVar[int] = 1  # resident split-KV blocks per SM (the split-count heuristic's)

    def decode_grid(self, spec: KernelSpec, batch: int, kv_heads: int, rows: int, num_splits: int):
        """Split-KV decode: (row tiles × splits, KV heads, batch), row tiles fastest (the blocks that read one
        split's keys run side by side and share them in L2)."""
        return (-(-rows // spec.block_m) * num_splits, kv_heads, batch)

    def backward_grid(self, spec: KernelSpec, batch: int, heads: int, kv_heads: int, seqlen_q: int, seqlen_k: int):
        """The backward kinds. BWD: (key tiles, KV heads, batch), a block looping over its group's query heads;
        BWD_DQ: (query tiles, heads, batch); the preprocess and convert: (rows / block_m, heads, batch)."""
        if spec.kind in BWD_MAINS:
            return (-(-seqlen_k // spec.block_n), kv_heads, batch)
        return (-(-seqlen_q // spec.block_m), heads, batch)

    def check(self, spec: KernelSpec) -> KernelSpec:
        """`spec`, where this tier takes it: persistent only for a kind of `persistent_kinds`, and tiles `validate`
        accepts; else a SpecError saying what is wrong (`tiers.check` calls it for a spec of this tier)."""
        if spec.persistent and spec.kind not in self.persistent_kinds:
            raise SpecError(f"KernelSpec: persistent: the {spec.tier} tier has no persistent {spec.kind.value} kernel")
        problem = self.validate(spec)
        if problem is not None:
            raise SpecError(f"KernelSpec: {spec.tier} tier: {problem}")
        return spec

    def replace(self, spec: KernelSpec, **fields) -> KernelSpec:
        """`spec` with other fields, checked by this tier."""
        return self.check(dataclasses.replace(spec, **fields))

    def main_variant(self, spec: KernelSpec, **fields) -> KernelSpec:
        """The backward main kernel `spec`'s variant with `fields` (tensor_grads=True, or kind=Kind.BWD_SPARSE),
        checked: the same tiles, unless the tier says otherwise."""
        return self.replace(spec, **fields)
