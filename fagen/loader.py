"""From compiled kernels to the op that runs them, and from the compile cache back to it.

A compiled kernel is a record (KernelSpec, source, Binary); an op keeps `Facts` of its program beside its kernels
(the fused program's text, the default scale, the tier's reason, the call-time tensors, what was proven). The
pipeline assembles a fresh compile's op here, and a compile-cache hit is read and assembled here alone: this
module imports no SymPy, networkx, Jinja or NVRTC, so a later process gets its kernel back without them. The
fused program is parsed (which loads the IR) only where someone asks for it (`Kernel.program`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from . import cache
from .backend import splits, tiers
from .backend.contract import BACKWARD_FAMILY, Kind, TensorArg, params
from .backend.spec import KernelSpec
from .runtime.kernel import BackwardPlan, Kernel, Launch, Plan

Record = tuple  # (KernelSpec, source, Binary): one compiled kernel, as the cache keeps it


@dataclass(frozen=True)
class Facts:
    """What an op keeps of its program beside its kernels, and the compile cache beside them."""

    program: str  # the fused program's text
    default_scale: float
    tier_reason: str
    tensors: tuple[TensorArg, ...]  # the call-time tensors the program reads
    tensor_index: dict  # name -> "h", "b" or "bh", or its reads in text
    proofs: tuple[str, ...]  # the statements proven for it

    @property
    def tensor_dtypes(self) -> dict:
        """The call-time tensors' dtypes other than float32, by name."""
        return {t.name: t.dtype for t in self.tensors if t.dtype != "f32"}

    def store(self, key: dict, cache_dir, records: Sequence[Record]) -> None:
        """Keep the op's kernels and these facts in the compile cache under `key`."""
        cache.store(
            key,
            cache_dir,
            list(records),
            tensors=self.tensors,
            proofs=self.proofs,
            default_scale=self.default_scale,
            tier_reason=self.tier_reason,
            tensor_index=self.tensor_index,
            program=self.program,
        )


@dataclass(frozen=True)
class Found:
    """A compile-cache entry, read: its kernels and the op's facts (a backward's entry: its gradient slots)."""

    records: list
    facts: Facts | None
    entry: dict


def load(key: dict | None, cache_dir=None) -> Found | None:
    """The cache's entry for `key` (None: missing, corrupt, or for another key)."""
    hit = cache.load(key, cache_dir) if key is not None else None
    if hit is None:
        return None
    facts = None
    if "default_scale" in hit:
        facts = Facts(
            hit["program"],
            hit["default_scale"],
            hit["tier_reason"],
            tuple(TensorArg(*row) for row in hit["tensors"]),
            hit["tensor_index"],
            tuple(hit["proofs"]),
        )
    return Found(hit["launches"], facts, hit)


def launch(spec: KernelSpec, source: str, binary, tensors: Sequence[TensorArg]) -> Launch:
    """One kernel of a plan: its parameters (the contract's list for its kind, the tensors', the tier's own) and
    its launch geometry, by kind."""
    t = tiers.get(spec.tier)
    grid: Callable[..., tuple[int, int, int]] = t.grid
    if spec.kind is Kind.DECODE_SPLIT:
        grid = t.decode_grid
    elif spec.kind in BACKWARD_FAMILY:
        grid = t.backward_grid
    kind_params = params(spec.kind, tuple(tensors), t.extra_params(spec))
    return Launch(spec, source, binary, t.smem_bytes(spec), kind_params, t.threads(spec), functools.partial(grid, spec))


def parse(text: str, name: str):
    """The fused program of a kernel from its text (what the cache keeps), parsed when first asked for."""
    from .ir import parse_program

    return parse_program(text, source=f"<{name}>")


def kernel(
    records: Sequence[Record],
    facts: Facts,
    *,
    scale: float | None = None,
    fused=None,
    fallback: Callable[[], Kernel] | None = None,
    backward: Callable[[], BackwardPlan] | None = None,
) -> Kernel:
    """The op of compiled kernels: a forward's one launch, or a split-KV decode's with its workspaces and the
    blocks an SM holds (which its split count plans). `fused`: the fused Program, where this process has it (else
    parsed from the facts on first need); `fallback` and `backward` build the fallback tier's kernel and the
    backward on first need."""
    launches = tuple(launch(spec, source, binary, facts.tensors) for spec, source, binary in records)
    first = launches[0]
    t = tiers.get(first.spec.tier)
    if first.spec.kind is Kind.DECODE_SPLIT:
        regs = first.binary.resources.registers  # the split count plans waves of the blocks an SM holds
        per_sm = splits.resident_blocks(regs, first.threads, first.smem_bytes) if regs else t.decode_blocks_per_sm
        plan = Plan(launches, workspaces=("ws_acc", "ws_ml", "split_count"), blocks_per_sm=per_sm)
    else:
        plan = Plan(launches)
    return Kernel(
        plan,
        fused if fused is not None else (lambda: parse(facts.program, first.spec.name)),
        default_scale=float(facts.default_scale if scale is None else scale),
        tier_reason=facts.tier_reason,
        fallback=fallback,
        backward=backward,
        fits=t.fits,
        tensors=facts.tensors,
        tensor_index=facts.tensor_index,
        proofs=facts.proofs,
    )


def backward_plan(
    records: Sequence[Record], tensors: Sequence[TensorArg], gradients=(), proofs=(), scatters=()
) -> BackwardPlan:
    """The backward's launches (preprocess, main, convert, the deterministic dQ, then the main kernel that sums the
    tensors' gradients and the block-sparse one, where there are) with the tensors' gradient slots, what was proven
    and the tensors whose gradients scatter."""
    launches = [launch(spec, source, binary, tensors) for spec, source, binary in records]
    preprocess, main, convert, dq = launches[:4]
    more = launches[4:]
    return BackwardPlan(
        preprocess,
        main,
        convert,
        dq,
        main_grads=next((x for x in more if x.spec.tensor_grads), None),
        main_sparse=next((x for x in more if x.spec.kind is Kind.BWD_SPARSE), None),
        gradients=tuple(tuple(g) for g in gradients),
        proofs=tuple(proofs),
        scatters=tuple(scatters),
    )


__all__ = ["Facts", "Found", "load", "launch", "kernel", "backward_plan", "parse"]
