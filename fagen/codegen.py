"""Rendering: a KernelSpec and a fused program become one standalone .cu file.

Every value is converted to its C spelling here (FlashInfer's habit); the Jinja templates only substitute
and do simple if/for. Templates are rendered with StrictUndefined: a missing value is an error.
"""
from __future__ import annotations

import functools

import jinja2
import sympy as sp

from . import __version__, bounds, exprs, fusion, resources
from .ir import Program
from . import plan
from .plan import smem_bytes
from .spec import STORAGE_TYPE, KernelSpec

# Proven rule fields the templates print, in the order the kernels run them.
RULE_FIELDS = ("score", "m_new", "m_use", "alpha", "p", "l_new", "acc_rescale", "inv_l", "out", "lse")

# C names of the rule's symbols in the simt tier (the template's variables).
SIMT_NAMES = {
    fusion.qk: "qk[r][c]", fusion.scale_log2: "scale_log2", fusion.kLog2e: "kLog2e", fusion.s: "s[c]",
    fusion.m_i: "m_i[r]", fusion.m_blk: "m_blk", fusion.m_new: "m_new", fusion.m_use: "m_use",
    fusion.l_i: "l_i[r]", fusion.l_blk: "l_blk", fusion.acc: "acc[r][e]", fusion.pv: "pv",
    fusion.alpha: "alpha", fusion.inv_l: "inv_l",
}
# Indices and sizes, the same in every tier.
INDEX_NAMES = {
    exprs.INDICES["q"]: "q_idx", exprs.INDICES["k"]: "k_idx", exprs.INDICES["b"]: "b", exprs.INDICES["h"]: "h",
    exprs.DIMS["M"]: "seqlen_q", exprs.DIMS["N"]: "seqlen_k", exprs.DIMS["D"]: "HEAD_DIM",
    bounds.q_lo: "q_lo", bounds.q_hi: "q_hi",
}
# ... and in the mma tier, where S_ij accumulator fragments become scores, then P_ij, in place.
MMA_NAMES = {
    fusion.qk: "S[t][jn][i]", fusion.scale_log2: "scale_log2", fusion.kLog2e: "kLog2e",
    fusion.s: "S[t][jn][2 * half + e]", fusion.m_i: "m_i[t][half]", fusion.m_blk: "m_blk",
    fusion.m_new: "m_new", fusion.m_use: "m_use", fusion.l_i: "l_i[t][half]", fusion.l_blk: "l_blk",
    fusion.acc: "O[t][dj][2 * half + e]", fusion.pv: "pv", fusion.alpha: "alpha", fusion.inv_l: "inv_l",
}
TIER_NAMES = {"simt": SIMT_NAMES, "mma": MMA_NAMES}


# 2^x in each tier: exp2f (full float accuracy) or the MUFU.EX2 instruction (ex2.approx.ftz, as FlashAttention).
TIER_EXP2 = {"simt": "exp2f", "mma": "fast_exp2"}
TIER_TANH = {"simt": "tanhf", "mma": "fast_tanh"}      # tanh.approx.f32 (MUFU.TANH) in the mma tier


def rule_c(rule: fusion.OnlineSoftmaxRule, names: dict, exp2: str = "exp2f", tanh: str = "tanhf") -> dict[str, str]:
    """The C of each proven update step, printed from the SymPy expressions themselves."""
    assert sp.expand(rule.acc_new - rule.acc_rescale - fusion.pv) == 0, "acc update must split as rescale + P V"
    out = {f: exprs.to_c(getattr(rule, f), {**names, **INDEX_NAMES}, exp2=exp2, tanh=tanh,
                         constants={fusion.kLog2e}) for f in RULE_FIELDS}
    out["tau"] = rule.tau
    for f in ("raw_max", "p_from_qk"):   # present when the score is a positive multiple of q.k
        e = getattr(rule, f)
        out[f] = None if e is None else exprs.to_c(e, {**names, **INDEX_NAMES, fusion.m_raw: "m_blk",
                                                        fusion.qk: names[fusion.s]}, exp2=exp2)
    return out


@functools.lru_cache(maxsize=1)
def _env() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(resources.templates_dir())),
                              undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True,
                              keep_trailing_newline=True, autoescape=False)


def regenerate_command(spec: KernelSpec) -> str:
    """The CLI line that writes this file again (for the shipped variants)."""
    causal = {"full": "", "causal": " --causal", "causal_br": " --causal bottom_right"}
    program = causal.get(spec.variant, f" --ir <{spec.variant}.ir>")
    return (f"fagen compile --dim {spec.head_dim}{program} --dtype {spec.dtype} --arch {spec.arch} "
            f"--tier {spec.tier}")


def tensors_of(program: Program) -> tuple[str, ...]:
    """The call-time tensors of a fused program (kernel parameters, in this order)."""
    node = fusion.fused_node(program)
    return tuple(sorted(set(exprs.tensors_in(node.attr("score"))) | set(exprs.tensors_in(node.attr("keep")))))


def tensor_index(program: Program, name: str) -> str:
    """'h' or 'b': what a call-time tensor is indexed by (so its length is heads or batch)."""
    node = fusion.fused_node(program)
    for e in (node.attr("score"), node.attr("keep")):
        for i in e.atoms(sp.Indexed):
            if str(i.base.label) == name:
                return str(i.indices[0])
    raise KeyError(f"program {program.name!r} reads no tensor {name!r}")


def is_masked(program: Program) -> bool:
    return fusion.fused_node(program).attr("keep") != sp.true


def bound_c(e: sp.Expr) -> str:
    """A key-range bound in C: computed in 64 bits, its symbols being long long copies of q_lo, q_hi, seqlen_q,
    seqlen_k (templates/key_range.cu.jinja)."""
    return exprs.to_c(e, INDEX_NAMES, index_type="long long")


def context(spec: KernelSpec, program: Program, command: str | None = None) -> dict:
    node = fusion.fused_node(program)
    rule = fusion.rule_of(node)
    keep = node.attr("keep")
    rng = bounds.key_range(keep)
    bounds.prove(keep, rng)            # refuse to emit a loop bound that was not shown to be safe
    names = INDEX_NAMES
    score = node.attr("score")
    return dict(
        kernel_name=spec.name,
        version=__version__,
        regenerate=command or regenerate_command(spec),
        spec_fields=list(spec.to_dict().items()),
        program_lines=str(program).strip().splitlines(),
        dtype=spec.dtype,
        storage_type=STORAGE_TYPE[spec.dtype],
        head_dim=spec.head_dim,
        block_m=spec.block_m,
        block_n=spec.block_n,
        num_warps=spec.num_warps,
        stages=spec.stages,
        smem_bytes=smem_bytes(spec),
        rule=rule_c(rule, TIER_NAMES[spec.tier], TIER_EXP2[spec.tier], TIER_TANH[spec.tier]),
        mask=None if keep == sp.true else exprs.to_c(keep, names, tanh=TIER_TANH[spec.tier]),
        key_terms=[dict(text=exprs.to_text(sp.And(*t.conjuncts)) if t.conjuncts else "no affine bound",
                        begins=[bound_c(e) for e in t.begins], ends=[bound_c(e) for e in t.ends],
                        full_begins=[bound_c(e) for e in t.full_begins],
                        full_ends=[bound_c(e) for e in t.full_ends], exact=t.exact) for t in rng.terms],
        tensor_params=[exprs.c_tensor_name(n) for n in tensors_of(program)],
        score_uses_q=exprs.INDICES["q"] in score.free_symbols,
        score_uses_k=exprs.INDICES["k"] in score.free_symbols,
        heavy_tiles_first=any(t.ends and any(e.has(bounds.q_hi) for e in t.ends) for t in rng.terms),
        **(mma_context(spec) if spec.tier == "mma" else {}),
    )


def mma_context(spec: KernelSpec) -> dict:
    mask, shift = plan.swizzle(spec.head_dim)
    return dict(swizzle_mask=mask, swizzle_shift=shift, mma_type=spec.dtype,
                q_in_registers="true" if plan.q_in_registers(spec) else "false")


def render(spec: KernelSpec, program: Program, command: str | None = None) -> str:
    """The .cu for `spec` and the fused `program`; `command` is the header's "Regenerate:" line."""
    return _env().get_template(f"flash_fwd_{spec.tier}.cu.jinja").render(**context(spec, program, command))
