"""What the backend prints, for the tests that render kernels: a program lowered by the passes with every value
proven, as a compile lowers it (fagen.passes.lowering.Lowering)."""

from __future__ import annotations

from fagen import pipeline
from fagen.ir import Program
from fagen.passes import backward as backward_pass
from fagen.passes import lowering


def lowered(program, dtype: str = "bf16", *, decode: bool = False, backward: bool = False) -> lowering.Lowering:
    """The Lowering of `program`: the options of pipeline.load_program (a dict), lowered by pipeline.lower at
    `dtype`, or a fused Program (its key ranges proven here); with `decode` the split-KV merge, with `backward` the
    backward rule and query ranges, each proven here."""
    if isinstance(program, Program):
        low, prove = lowering.forward(program)
        prove()
    else:
        low = pipeline.lower(pipeline.load_program(**program), dtype)[-1].facts["lowering"]
    if decode:
        low, prove = lowering.with_merge(low)
        prove()
    if backward:
        low = lowering.with_backward(low, backward_pass.prove_rule(low.program))
    return low
