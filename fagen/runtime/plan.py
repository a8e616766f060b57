"""What a compiled op launches: its kernels (`Launch`), in order, and their workspaces (`Plan`, `BackwardPlan`).

The pipeline builds these; the ops (fagen.runtime.forward, decode, backward) pack and launch them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..backend.contract import Kind, Param
from ..backend.spec import KernelSpec
from .launch import Function

if TYPE_CHECKING:
    from ..backend.build import Binary

KernelLike = Any  # the fagen.runtime.kernel.Kernel an op serves (kernel.py imports the ops; they do not import it back)


@dataclass(frozen=True)
class Launch:
    """One kernel of a plan: what was compiled, and its parameter list."""

    spec: KernelSpec
    source: str
    binary: Binary
    smem_bytes: int
    params: tuple[Param, ...]
    threads: int
    # forward: (batch, heads, seqlen_q) -> grid; decode kinds: (batch, kv_heads, rows, num_splits) -> grid
    grid: Callable[..., tuple[int, int, int]]
    function: Function = field(init=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "function", Function(self.binary.cubin, self.spec.name, self.smem_bytes))


@dataclass(frozen=True)
class Plan:
    """The launches of an op, in order, and the workspaces they use (none for a forward; a decode's split kernel
    has ws_acc and ws_ml, float32, and split_count, int32, sized per call shape from its maxima)."""

    launches: tuple[Launch, ...]
    workspaces: tuple = ()
    blocks_per_sm: int = 1  # resident blocks per SM of the first launch, for the split-count heuristic

    @property
    def decode(self) -> bool:
        return self.launches[0].spec.kind is Kind.DECODE_SPLIT


@dataclass(frozen=True)
class BackwardPlan:
    """The backward's launches (FlashAttention-2's split; fagen.backend.contract's BWD kinds) and the call-time
    tensors whose gradients it computes, as (name, index) in the order of the dtensor workspace's slots."""

    preprocess: Launch
    main: Launch
    convert: Launch
    dq: Launch  # the deterministic mode's dQ kernel
    main_grads: Launch | None = None  # the main kernel that also sums `gradients` (run when they are asked for)
    # the main kernel over a block mask's transposed table (a block-sparse forward's backward, where its tier has one)
    main_sparse: Launch | None = None
    gradients: tuple[tuple[str, str], ...] = ()
    proofs: tuple[str, ...] = ()
    scatters: tuple[str, ...] = ()  # gathered float tensors: their gradients scatter-added by atomics
