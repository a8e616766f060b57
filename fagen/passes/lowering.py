"""What the kernels print, as values the passes made and proved: a fused program's attention node, its update rule,
the key tiles each query tile sees and, where a kernel needs them, the split-KV merge, the backward rule and the
query tiles that see each key tile.

The backend takes a `Lowering` and only prints it (fagen.backend.codegen): nothing under fagen/backend proves. A
value is made before it is proven: `forward` and `with_merge` return the record and the function that proves what
they added, which `compile` runs while NVRTC compiles the kernels printed from it (nothing built from the record is
loaded, cached or returned unless that function returns); `with_backward` takes what the backward pass proved
(backward.prove_rule).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from ..ir import Node, Program
from ..math import bounds, online_softmax
from ..math.backward import BackwardRule
from ..math.bounds import KeyRange
from ..math.online_softmax import MergeRule, OnlineSoftmaxRule
from . import backward, fuse

Proof = Callable[[], tuple[str, ...]]  # proves what a value adds; returns the statements, or raises


@dataclass(frozen=True)
class Lowering:
    """A fused program and what its kernels print, each value proven once by the pass that made it."""

    program: Program  # the fused program
    node: Node  # its online_softmax node
    rule: OnlineSoftmaxRule  # the node's update rule: fuse proved (a)-(e) for the rewrite that made the node
    key_range: KeyRange  # the key tiles each query tile sees (bounds.prove)
    merge: MergeRule | None = None  # split-KV decode: how two partial states merge ((f), online_softmax.prove_merge)
    backward: BackwardRule | None = None  # the backward kernels' rule ((g)-(k), math.backward.prove_backward)
    query_range: KeyRange | None = None  # the query tiles that see a key tile (bounds.prove_query_range)


def _nothing() -> tuple[str, ...]:
    return ()


def forward(fused: Program, key_range: KeyRange | None = None) -> tuple[Lowering, Proof]:
    """The record of a fused program, and the function that proves its key ranges where they are derived here. A
    given `key_range` is one a pass proved already (pipeline.rewrite's key-range step): nothing is left to prove."""
    node = fuse.fused_node(fused)
    rule = fuse.rule_of(node)
    if key_range is not None:
        return Lowering(fused, node, rule, key_range), _nothing
    keep = node.attr("keep")
    rng = bounds.key_range(keep)
    return Lowering(fused, node, rule, rng), lambda: tuple(bounds.prove(keep, rng))


def with_merge(low: Lowering) -> tuple[Lowering, Proof]:
    """`low` with the split-KV merge of its rule, and the function that proves the merge is the state update (f)."""

    def prove() -> tuple[str, ...]:
        return tuple(f"{i.name}: {i.statement}" for i in online_softmax.prove_merge(low.rule))

    return replace(low, merge=online_softmax.make_merge(low.rule)), prove


def with_backward(low: Lowering, proven: backward.ProvenRule) -> Lowering:
    """`low` with the backward rule and query ranges the backward pass proved (backward.prove_rule)."""
    return replace(low, backward=proven.rule, query_range=proven.query_range)
