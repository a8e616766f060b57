"""Rendering: a KernelSpec and a fused program become one standalone .cu file.

Every value is converted to its C spelling here (FlashInfer's habit); the Jinja templates only substitute
and do simple if/for. Templates are rendered with StrictUndefined: a missing value is an error.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from dataclasses import dataclass

import jinja2
import sympy as sp

from .. import resources, store
from ..ir import exprs
from ..math import backward as bw
from ..math import bounds, online_softmax
from ..passes import fuse
from ..passes.lowering import Lowering
from ..version import __version__
from . import contract, printer, tiers
from .plan import smem_bytes
from .spec import STORAGE_TYPE, KernelSpec

# Indices and sizes: their C names in every kernel and every rule function.
INDEX_NAMES = {
    exprs.INDICES["q"]: "q_idx",
    exprs.INDICES["k"]: "k_idx",
    exprs.INDICES["b"]: "b",
    exprs.INDICES["h"]: "h",
    exprs.DIMS["M"]: "seqlen_q",
    exprs.DIMS["N"]: "seqlen_k",
    exprs.DIMS["D"]: "HEAD_DIM",
    bounds.q_lo: "q_lo",
    bounds.q_hi: "q_hi",
    bounds.k_lo: "k_lo",
    bounds.k_hi: "k_hi",
}
# The rule's symbols are named in C as in the derivation (m_i, l_i, alpha, ...); constants as constexprs.
CONSTANTS = {online_softmax.kLog2e: "kLog2e", online_softmax.lazy_tau: "kTau"}
# What stays the same over a work tile's score elements (the rest of a rule function's symbols changes from one
# element to the next): products print these factors first, gathered, to be computed once (printer._gathered_Mul).
TILE_FIXED = (exprs.INDICES["b"], exprs.INDICES["h"], exprs.DIMS["M"], exprs.DIMS["N"], exprs.DIMS["D"])


def _varying(names, score) -> set:
    """The symbols of a rule function that change from one score element to the next, for programs with a score
    function. Where the score is q.k itself the rule prints as written: gathering saved nothing measurable there
    (H100, 2026-11-25) and moved NVRTC 13.5's registers of one kernel (d128 prefix-LM's backward) onto the stack;
    with ALiBi it saves a multiply and an integer add an element (d64 forward + backward 1.13-1.18x)."""
    if score == online_softmax.qk * online_softmax.scale_log2:
        return set()
    return set(names) - set(CONSTANTS) - set(TILE_FIXED) - {online_softmax.scale_log2}


INDEX_PARAMS = ("int b", "int h", "int q_idx", "int k_idx", "int seqlen_q", "int seqlen_k")
# The score's float copies of the indices, which the kernels compute with no int-to-float conversion per element:
# k - q and q as floats (printer.CPrinter._float_index).
FLOAT_INDEX_PARAMS = ("float k_minus_q", "float q_f")
# What a value computed once a work tile (fixed_0, ...) may read besides the call-time tensors.
FIXED_PARAMS = ("float scale_log2", "int b", "int h", "int seqlen_q", "int seqlen_k")


@dataclass(frozen=True)
class DeviceFunction:
    """One step of the proven rule as a named __device__ function: the templates call these."""

    name: str
    returns: str
    params: tuple[str, ...]
    body: str  # the C expression, printed by SymPy from the proven expression
    doc: str
    # called with the backward's one argument list (the templates' grad_args: dL/d(q.k) and the tensors' partials),
    # so it takes every fixed value of the table as well
    grad_args: bool = False


def fixed_functions(fixed: dict, tensor_params, done=()) -> list[DeviceFunction]:
    """A device function for each value of the `fixed` table (C text -> name) not in `done`: the kernels call it
    once a work tile, where they know the batch and head, and pass its value to the rule functions that read it."""
    return [
        DeviceFunction(
            name,
            "float",
            (*FIXED_PARAMS, *tensor_params),
            text,
            "a factor of the score that is the same for every element of a (batch, head): computed once, before the "
            "key loop",
        )
        for text, name in fixed.items()
        if name not in done
    ]


def _symbol_names(*symbols) -> dict:
    return {sym: str(sym) for sym in symbols}


def _tensor_params(tensors) -> tuple[str, ...]:
    """The C parameters through which a rule function reads the call-time tensors (address, strides, sizes)."""
    return tuple(p for t in tensors for p in contract.as_tensor_arg(t).c_params())


def _tensor_args(tensors) -> tuple[str, ...]:
    return tuple(a for t in tensors for a in contract.as_tensor_arg(t).c_args())


def _fma_form(raw: sp.Expr, varying) -> sp.Expr:
    """raw = qk + Σ c_i·t_i (c_i the same for every element, t_i not) as fma(c_1, t_1, fma(c_2, t_2, qk)), each
    multiply fused with the add that takes q.k (printer.fma); other terms are added as they are. The same value:
    checked here."""
    qk = online_softmax.qk
    out = qk
    for term in sp.Add.make_args(raw - qk):
        coeff, factors = term.as_coeff_mul()
        fixed = [f for f in factors if not (f.free_symbols & varying)]
        moving = [f for f in factors if f.free_symbols & varying]
        if moving and (fixed or coeff != 1):
            out = printer.fma(sp.Mul(coeff, *fixed), sp.Mul(*moving), out)
        else:
            out = out + term
    if sp.expand(out.replace(printer.fma, lambda a, b, c: a * b + c) - raw) != 0:  # pragma: no cover - by construction
        raise AssertionError(f"internal: the fused form of {raw} differs from it")
    return out


def _printer(names: dict, tier, varying: set):
    """The C printer of a rule's expressions for `tier`: c(expr, float_indices=False, fixed=None)."""

    def c(expr, float_indices=False, fixed=None):
        return printer.to_c(
            expr,
            names,
            exp2=tier.exp2,
            tanh=tier.tanh,
            constants=set(CONSTANTS),
            varying=varying,
            float_indices=float_indices,
            fixed=fixed,
        )

    return c


def rule_functions(
    rule: online_softmax.OnlineSoftmaxRule,
    tier,
    tensors: tuple = (),
    merge: online_softmax.MergeRule | None = None,
    fixed: dict | None = None,
) -> list[DeviceFunction]:
    """The proven update rule as device functions, each body printed from the expression online_softmax.prove()
    checked: score, mask, the state update (m_new, m_use, alpha, p, l_new, acc_rescale) and finalize
    (inv_l, out, lse). The score and mask take the indices and the call-time tensors. With a `merge` (the
    split-KV kinds: the merge of two partial states, which online_softmax.prove_merge() checked), also merge_m,
    merge_w, merge_l and merge_acc. The score's factors that are the same for a whole (batch, head) are functions
    of their own (fixed_0, ...), named in `fixed` (a table the backward shares with its own functions;
    printer.CPrinter._fixed_value)."""
    f = online_softmax
    names = {
        **INDEX_NAMES,
        **CONSTANTS,
        **_symbol_names(
            f.qk, f.scale_log2, f.s, f.m_i, f.m_blk, f.m_new, f.m_use, f.l_i, f.l_blk, f.acc, f.alpha, f.inv_l, f.m_raw
        ),
    }
    if merge is not None:
        names.update(_symbol_names(f.m_a, f.m_b, f.m_x, f.l_a, f.l_b, f.acc_a, f.acc_b, f.w_a, f.w_b))
    varying = _varying(names, rule.score)
    c = _printer(names, tier, varying)
    fixed = {} if fixed is None else fixed  # the products computed once a work tile (printer.CPrinter._fixed_value)
    out = _score_functions(rule, c, varying, _tensor_params(tensors), fixed)
    out += _state_functions(rule, c)
    if merge is not None:
        out += _merge_functions(merge, c)
    return out


def _score_functions(rule, c, varying: set, tensor_params: tuple[str, ...], fixed: dict) -> list[DeviceFunction]:
    """The values computed once a work tile (fixed_0, ...), the score, the mask and, where the score is a positive
    multiple of a raw value (proof (e)), the raw value, the block max from the raw max and p from the raw value."""
    score = c(rule.score, float_indices=True, fixed=fixed)
    raw = c(_fma_form(rule.raw, varying), float_indices=True, fixed=fixed) if rule.raw_transform else None
    fixed_params = tuple(f"float {name}" for name in fixed.values())
    out = fixed_functions(fixed, tensor_params)
    floats = FLOAT_INDEX_PARAMS if re.search(r"\b(k_minus_q|q_f)\b", score) else ()  # the names only it prints
    out.append(
        DeviceFunction(
            "score",
            "float",
            ("float qk", "float scale_log2", *INDEX_PARAMS, *floats, *tensor_params, *fixed_params),
            score,
            "S_ij in base 2: the program's score of scale * q.k, times log2(e)",
        )
    )
    if rule.keep != sp.true:
        out.append(
            DeviceFunction(
                "keep", "bool", (*INDEX_PARAMS, *tensor_params), c(rule.keep), "the mask: may query q_idx see key k_idx"
            )
        )
    if raw is not None:
        floats = FLOAT_INDEX_PARAMS if re.search(r"\b(k_minus_q|q_f)\b", raw) else ()
        out.append(
            DeviceFunction(
                "raw",
                "float",
                ("float qk", "float scale_log2", *INDEX_PARAMS, *floats, *tensor_params, *fixed_params),
                raw,
                "the raw value u of q.k with S = a u, a > 0 (proven (e)): the block max is taken over u",
            )
        )
    if rule.raw_max is not None:
        what = "the raw values" if rule.raw_transform else "raw q.k"
        out += [
            DeviceFunction(
                "raw_max",
                "float",
                ("float m_raw", "float scale_log2"),
                c(rule.raw_max),
                f"the block max of S from the max of {what} (proven (e))",
            ),
            DeviceFunction(
                "p_from_qk",
                "float",
                ("float qk", "float scale_log2", "float m_use"),
                c(rule.p_from_qk),
                f"p = 2^(S - m) from {what}: one fused multiply-add",
            ),
        ]
    return out


def _state_functions(rule, c) -> list[DeviceFunction]:
    """The state update (m_new, m_use, alpha, p, l_new, acc_rescale) and finalize (inv_l, out, lse)."""
    return [
        DeviceFunction(
            "m_new",
            "float",
            ("float m_i", "float m_blk"),
            c(rule.m_new),
            "the new reference max: moves only when the block max passes it by more than kTau",
        ),
        DeviceFunction(
            "m_use",
            "float",
            ("float m_new",),
            c(rule.m_use),
            "0 while the row has seen only masked keys, so no -inf - (-inf) = NaN is formed",
        ),
        DeviceFunction(
            "alpha",
            "float",
            ("float m_i", "float m_use"),
            c(rule.alpha),
            "the rescale factor exp(m_old - m_new), in base 2",
        ),
        DeviceFunction("p", "float", ("float s", "float m_use"), c(rule.p), "P_ij = 2^(S_ij - m)"),
        DeviceFunction(
            "l_new",
            "float",
            ("float alpha", "float l_i", "float l_blk"),
            c(rule.l_new),
            "l_i = alpha * l_i + rowsum(P_ij)",
        ),
        DeviceFunction(
            "acc_rescale",
            "float",
            ("float alpha", "float acc"),
            c(rule.acc_rescale),
            "acc = alpha * acc, before acc += P_ij V_j",
        ),
        DeviceFunction("inv_l", "float", ("float l_i",), c(rule.inv_l), "1 / l_i, and 0 for a fully masked row"),
        DeviceFunction("out", "float", ("float acc", "float inv_l"), c(rule.out), "O_i = acc / l_i"),
        DeviceFunction(
            "lse",
            "float",
            ("float m_i", "float l_i"),
            c(rule.lse),
            "lse_i = (m_i + log2(l_i)) / log2(e), the natural log-sum-exp; -inf for a fully masked row",
        ),
    ]


def _merge_functions(mr: online_softmax.MergeRule, c) -> list[DeviceFunction]:
    """The merge of two partial states of key splits (the split-KV kinds)."""
    return [
        DeviceFunction(
            "merge_m", "float", ("float m_a", "float m_b"), c(mr.m), "the merged state's reference: the larger max"
        ),
        DeviceFunction(
            "merge_w",
            "float",
            ("float m_x", "float m_use"),
            c(mr.w),
            "a state's weight in the merge, 2^(m_x - m_use): 0 for an empty split (m_x = -inf)",
        ),
        DeviceFunction(
            "merge_l",
            "float",
            ("float w_a", "float l_a", "float w_b", "float l_b"),
            c(mr.l_sum),
            "l = w_a l_a + w_b l_b",
        ),
        DeviceFunction(
            "merge_acc",
            "float",
            ("float w_a", "float acc_a", "float w_b", "float acc_b"),
            c(mr.acc),
            "acc = w_a acc_a + w_b acc_b",
        ),
    ]


def slot_gradients(brule, tensors) -> list:
    """The tensor gradients the backward kernels reduce into dtensor slots (a float per-head, per-batch or
    per-(batch, head) tensor read once as name[h], name[b] or name[b, h]), in slot order."""
    float_names = {t.name for t in map(contract.as_tensor_arg, tensors) if t.dtype in contract.FLOAT_TENSOR_DTYPES}
    return [g for g in brule.tensors if not g.gathered and g.name in float_names]


def scatter_gradients(brule, tensors) -> list:
    """The tensor gradients the backward kernels scatter-add (atomics) into grad_<name>: every read of a float
    tensor whose TensorArg says `grad`."""
    grad_names = {t.name for t in map(contract.as_tensor_arg, tensors) if t.grad}
    return [g for g in brule.tensors if g.gathered and g.name in grad_names]


def _dense_offset(read, names) -> str:
    """The element `read` reads, as an offset into a dense row-major array of the tensor's shape (its
    gradient): each index clamped as the read clamps it."""
    name = contract.c_tensor_name(str(read.base.label))
    text = ""
    for d, i in enumerate(read.indices):
        at = f"fagen_clamp({printer.to_c(i, names)}, {name}_size_{d})"
        text = at if not text else f"({text}) * {name}_size_{d} + {at}"
    return text


def check_printable(brule: bw.BackwardRule) -> None:
    """Refuse a backward whose derivatives the C printer cannot print (the score function's, each tensor read's),
    with a BackwardError naming the derivative: the backward pass derives what SymPy can, the kernels print C."""
    where = f"score function {exprs.to_text(brule.score_fn)}"
    derivatives = [("the score", brule.score_derivative)]
    derivatives += [(f"tensor {g.read}", g.partial) for g in brule.tensors if g.read is not None]
    for what, d in derivatives:
        names = {sym: f"x{n}" for n, sym in enumerate(sorted(d.free_symbols, key=str))}
        try:
            printer.to_c(d, names)
        except Exception as e:  # the printer refuses with assorted errors: name the derivative and why
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise bw.BackwardError(
                f"{where}: its derivative by {what}, {exprs.to_text(d)}, cannot be printed as C: {reason}"
            ) from None


def backward_rule_functions(
    brule: bw.BackwardRule, tier, tensors: tuple = (), fold_scale: bool = False
) -> list[DeviceFunction]:
    """The backward's device functions (fagen.math.backward), printed from the rule the backward pass proved
    ((g)-(l)): the forward's score and mask, then P from the saved lse, dS, dL/d(q·k) through the score function,
    and one d_<tensor>_<index> per call-time tensor read (with, for a gathered one, at_<tensor>_<index>: where in
    its gradient the read element sits). With `fold_scale`, also dL/d(q·k) from P with the scale folded into D_i
    ((l): natural_scale, d_scaled, dqk_p), for a kernel that needs no dS of its own."""
    check_printable(brule)
    f = online_softmax
    names = {
        **INDEX_NAMES,
        **CONSTANTS,
        **_symbol_names(f.qk, f.scale_log2, f.s, bw.lse, bw.lse_log2, bw.dp, bw.d_row, bw.p, bw.ds),
        **_symbol_names(bw.scale, bw.d_scaled),
    }
    tensor_params = _tensor_params(tensors)
    c = _printer(names, tier, _varying(names, brule.forward.score))
    # dL/d(q.k) gathers its fixed factors at every score (the scale's scale_log2 (1/kLog2e) once, outside the element
    # loop: one multiply an element where (ds*scale_log2)*(1.0f/kLog2e) took two)
    c_dqk = _printer(names, tier, set(names) - set(CONSTANTS) - set(TILE_FIXED) - {f.scale_log2})
    fixed: dict = {}  # the forward's fixed values, and those of dL/d(q.k) and the tensors' partials (fixed_functions)
    out = [
        fn
        for fn in rule_functions(brule.forward, tier, tensors, fixed=fixed)
        if fn.name in ("score", "keep", "raw") or fn.name.startswith("fixed_")
    ]
    done = {fn.name for fn in out}
    if brule.p_raw is not None:  # S = a u (the forward's proof (e)): P from u by one fused multiply-add
        out.append(
            DeviceFunction(
                "p_from_raw",
                "float",
                ("float qk", "float scale_log2", "float lse_log2"),
                c(brule.p_raw),
                "P_ij = 2^(a u - lse_i log2(e)) from the raw value u (S = a u, proven (e)): one fused multiply-add",
            )
        )
    out += [
        DeviceFunction(
            "lse_log2",
            "float",
            ("float lse",),
            c(brule.lse_log2),
            "the row's base-2 reference from the saved lse; +inf for a fully masked row, so every P is 0",
        ),
        DeviceFunction(
            "p_from_lse", "float", ("float s", "float lse_log2"), c(brule.p), "P_ij = 2^(S_ij - lse_i log2(e))"
        ),
        DeviceFunction(
            "ds", "float", ("float p", "float dp", "float d_row"), c(brule.ds), "dS_ij = P_ij (dP_ij - D_i)"
        ),
        DeviceFunction(
            "dqk",
            "float",
            ("float ds", "float qk", "float scale_log2", *INDEX_PARAMS, *tensor_params),
            c_dqk(brule.dqk, fixed=fixed),
            "dL/d(q.k) = dS f'(t) scale: the chain through the score function and the scale",
            grad_args=True,
        ),
    ]
    if fold_scale:
        out += _folded_scale_functions(brule, c, c_dqk(brule.dqk_p, fixed=fixed), tensor_params)
    out += _tensor_gradient_functions(brule, tensors, c, names, fixed)
    # dL/d(q.k) and the tensors' partials (called with one argument list, grad_args) take every fixed value: the
    # forward's, and those their own bodies added to the table
    taken = tuple(f"float {name}" for name in fixed.values())
    out = [dataclasses.replace(f, params=f.params + taken) if f.grad_args else f for f in out]
    return fixed_functions(fixed, tensor_params, done) + out


def _folded_scale_functions(brule: bw.BackwardRule, c, dqk_p_body: str, tensor_params: tuple) -> list[DeviceFunction]:
    """dL/d(q.k) from P with the scale folded into D_i (proven (l)): the scale, made once; D_i times it, made once a
    row where D_i is loaded; and dqk_p, one fused multiply-add and one multiply an element."""
    return [
        DeviceFunction(
            "natural_scale",
            "float",
            ("float scale_log2",),
            c(brule.natural_scale),
            "the scale of q.k, scale_log2 / log2(e) (made once)",
        ),
        DeviceFunction(
            "d_scaled",
            "float",
            ("float d_row", "float scale"),
            c(brule.d_scaled_of),
            "D_i scale, made once a row where D_i is loaded (the scale folded into D_i, proven (l))",
        ),
        DeviceFunction(
            "dqk_p",
            "float",
            ("float p", "float dp", "float d_scaled", "float scale", "float qk", "float scale_log2")
            + (*INDEX_PARAMS, *tensor_params),
            dqk_p_body,
            "dL/d(q.k) = P_ij (dP_ij scale - D_i scale) f'(t): dS f'(t) scale with the scale folded into D_i (l)",
            grad_args=True,
        ),
    ]


def _tensor_gradient_functions(brule, tensors, c, names: dict, fixed: dict) -> list[DeviceFunction]:
    """One d_<tensor>_<index> per tensor read whose gradient the kernels sum, and for a gathered one where in its
    gradient the read element sits (at_<tensor>_<index>)."""
    tensor_params = _tensor_params(tensors)
    out = []
    for g in slot_gradients(brule, tensors) + scatter_gradients(brule, tensors):
        read = exprs.to_text(g.read) if g.read is not None else f"{g.name}[{g.index}]"
        out.append(
            DeviceFunction(
                f"d_{g.name}_{g.index}",
                "float",
                ("float ds", "float qk", "float scale_log2", *INDEX_PARAMS, *tensor_params),
                c(bw.ds * g.partial, fixed=fixed),
                f"this position's share of d{g.name} at {read}: dS times the score's partial by {read}",
                grad_args=True,
            )
        )
        if g.gathered:
            out.append(
                DeviceFunction(
                    f"at_{g.name}_{g.index}",
                    "long long",
                    (*INDEX_PARAMS, *tensor_params),
                    _dense_offset(g.read, names),
                    f"where {read} sits in d{g.name} (float32, dense, the tensor's shape), clamped as the read is",
                )
            )
    return out


class _TemplateBytecode(jinja2.FileSystemBytecodeCache):
    """The templates as Jinja compiled them, kept on disk so that a new process does not compile them again
    (about 10 ms for a forward kernel's). Jinja reuses an entry only for the same template text (it stores the
    text's hash); the file names carry fagen's fingerprint (fagen.store), so that another fagen, or other
    Environment settings below, never read them."""

    def dump_bytecode(self, bucket):
        try:
            super().dump_bytecode(bucket)
        except OSError:
            pass  # an unwritable cache costs a template compile next time, nothing else


@functools.lru_cache(maxsize=4)
def _env(bytecode_dir: str | None = None) -> jinja2.Environment:
    # templates are package data, read through importlib.resources (a wheel has no templates/ directory path)
    bytecode = None
    if bytecode_dir is not None:
        try:
            os.makedirs(bytecode_dir, exist_ok=True)
            bytecode = _TemplateBytecode(bytecode_dir, f"%s.{store.fingerprint()[:16]}.cache")
        except OSError:
            pass
    return jinja2.Environment(
        loader=jinja2.FunctionLoader(resources.read_template),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
        bytecode_cache=bytecode,
    )


def template_cache(cache_dir=None, use_cache: bool = True) -> str | None:
    """Where render keeps the compiled templates: `templates/` in the compile cache (None: not kept)."""
    if not use_cache:
        return None
    from pathlib import Path

    return os.fspath((Path(cache_dir) if cache_dir is not None else store.default_cache_dir()) / "templates")


def regenerate_command(spec: KernelSpec) -> str:
    """The CLI line that writes this file again (for the shipped variants)."""
    causal = {"full": "", "causal": " --causal", "causal_br": " --causal bottom_right"}
    program = causal.get(spec.variant, f" --ir <{spec.variant}.ir>")
    decode = " --decode" if spec.kind is contract.Kind.DECODE_SPLIT else ""
    backward = " --backward" if spec.kind in contract.BACKWARD_FAMILY else ""
    return (
        f"fagen compile --dim {spec.dim}{program} --dtype {spec.dtype} --arch {spec.arch} --tier {spec.tier}"
        f"{decode}{backward}"
    )


def p_from_qk(spec: KernelSpec, rule) -> bool:
    """Whether the simt kernels compute P_ij from raw q.k, 2^(q.k scale_log2 - m) in one fused multiply-add
    (rule::p_from_qk), rather than from the score rounded to float: for f32, whose users chose it for accuracy, where
    the score is a positive multiple of q.k (proof (e)). At large logits the rounded score costs P (and through the
    reference max, the log-sum-exp) up to a unit in the last place of the score; the fused form leaves the max's
    rounding to cancel between l_i and m_i. (The tensor-core tiers, f16 and bf16 only, fuse it always.)"""
    return spec.dtype == "f32" and rule.p_from_qk is not None and not rule.raw_transform


# spec fields the header leaves out at these values (those of most kernels: a _grads kernel's, a padded one's)
OPTIONAL_FIELDS = {"tensor_grads": False, "input_dim": None}


def padding_note(spec: KernelSpec) -> str:
    """What the header says of a kernel whose inputs the runtime pads to its head dim."""
    d, k = spec.dim, spec.head_dim
    return (
        f"inputs of head dim {d}, padded to {k}: the runtime gives q, k, v (and o, dO) {k - d} zero "
        f"column{'s' if k - d > 1 else ''}, which "
        f"change no score and give zero columns of O, dQ, dK, dV, and returns their first {d}; scale 1/sqrt({d})"
    )


def bound_c(e: sp.Expr) -> str:
    """A key-range bound in C: computed in 64 bits, its symbols being long long copies of q_lo, q_hi, seqlen_q,
    seqlen_k (templates/key_range.cu.jinja)."""
    return printer.to_c(e, INDEX_NAMES, index_type="long long")


def context(spec: KernelSpec, low: Lowering, command: str | None = None, tensor_dtypes=None) -> dict:
    """What the templates substitute, for `spec` and the values the passes proved for its program (`low`: the rule,
    the key ranges, and for a split-KV kind the merge, for a backward kind the backward rule and the query ranges).
    `tensor_dtypes`: the call-time tensors' dtypes by name (default float32)."""
    rule, rng = low.rule, low.key_range
    keep = low.node.attr("keep")
    tier = tiers.get(spec.tier)
    tensors = contract.tensor_args(fuse.tensor_reads(low.program), tensor_dtypes)
    merge = None
    if spec.kind is contract.Kind.DECODE_SPLIT:
        if low.merge is None:
            raise ValueError(f"{spec.name}: a split-KV kernel prints the proven merge; lower with lowering.with_merge")
        merge = low.merge
    padding = "" if spec.input_dim is None else padding_note(spec)
    backward = dict(writes_dkv=spec.kind in contract.BWD_MAINS)  # dK, dV: the storage dtype or float32 (store_grad)
    if spec.kind in contract.BACKWARD_FAMILY:  # the main kernel sums the tensors' gradients in its _grads variant
        sums = spec.kind not in contract.BWD_MAINS or spec.tensor_grads
        backward.update(backward_context(spec, low, tier, tensors, grads=sums))
    ctx = dict(
        kernel_name=spec.name,
        version=__version__,
        regenerate=(command or regenerate_command(spec)) + (f" (pads head dim {spec.dim})" if padding else ""),
        padding=padding,
        spec_fields=[(f, v) for f, v in spec.to_dict().items() if OPTIONAL_FIELDS.get(f, ...) is not v],
        program_lines=str(low.program).strip().splitlines(),
        dtype=spec.dtype,
        storage_type=STORAGE_TYPE[spec.dtype],
        head_dim=spec.head_dim,
        block_m=spec.block_m,
        block_n=spec.block_n,
        num_warps=spec.num_warps,
        stages=spec.stages,
        smem_bytes=smem_bytes(spec),
        rule_functions=rule_functions(rule, tier, tensors, merge=merge),
        masked=keep != sp.true,
        fuse_raw_max=rule.raw_max is not None,
        p_from_qk=p_from_qk(spec, rule),
        raw_transform=rule.raw_transform,
        log2e=f"{contract.LOG2E!r}f",
        tau=rule.tau,
        index_args=", ".join(["b", "h", "q_idx", "k_idx", "seqlen_q", "seqlen_k", *_tensor_args(tensors)]),
        tensor_reads=bool(tensors),
        signature=contract.signature(spec.kind, tuple(tensors), tier.extra_params(spec)),
        **_key_ranges(rng),
        block_sparse=spec.kind in (contract.Kind.FORWARD_SPARSE, contract.Kind.BWD_SPARSE),
        **tier.context(spec, masked=keep != sp.true),
    )
    ctx.update(backward)  # the backward kinds: their rule functions in place of the forward's, and their ranges
    ctx.update(_masked_step(ctx))
    if backward.get("derivative_reads_score"):
        # f'(t) reads the score (softcap's 1 - tanh^2): a live value more an element, so the wgmma backward keeps its
        # lse_i, D_i loads 8 bytes wide (16-byte row pairs spilled 56 bytes at d128 softcap, 8 without)
        ctx["rows_v4"] = False
    # the score's float indices (k - q and q as floats), where its printed value reads them
    # (and the raw value's, where the forward takes its block max over raw values)
    readers = {f.name: f for f in ctx["rule_functions"] if f.name in ("score", "raw")}
    ctx["float_indices"] = any(FLOAT_INDEX_PARAMS[0] in f.params for f in readers.values())
    fixed = [f.name for f in ctx["rule_functions"] if f.name.startswith("fixed_")]

    def fixed_args(f: DeviceFunction) -> list[str]:  # the fixed values a rule function takes, last
        return [p.split()[-1] for p in f.params if p.split()[-1] in fixed]

    for name, f in readers.items():
        float_args = [p.split()[-1] for p in FLOAT_INDEX_PARAMS] if FLOAT_INDEX_PARAMS[0] in f.params else []
        ctx[f"{name}_args"] = ", ".join(
            ["b", "h", "q_idx", "k_idx", "seqlen_q", "seqlen_k", *float_args, *_tensor_args(tensors), *fixed_args(f)]
        )
    # dL/d(q.k) and the tensors' partials: the index arguments, and the fixed values they take
    grads = [f for f in ctx["rule_functions"] if f.grad_args]
    ctx["grad_args"] = ", ".join([ctx["index_args"], *(fixed_args(grads[0]) if grads else [])])
    # the fixed values, each computed once a work tile where the kernel knows its batch and head (fixed_values loops)
    call_args = ", ".join([p.split()[-1] for p in FIXED_PARAMS] + list(_tensor_args(tensors)))
    ctx["fixed_values"] = [dict(name=n, call=f"rule::{n}({call_args})") for n in fixed]
    # the small-power helpers (printer: x**2 .. x**4 as fagen_pow2..4) that the rule functions call
    bodies = " ".join(f.body for f in ctx["rule_functions"])
    ctx["pow_helpers"] = sorted({int(n) for n in re.findall(r"\bfagen_pow([234])\(", bodies)})
    # the helper of reads inside another read's index (printer: offsets[doc[q]]'s doc[q] as fagen_index(...))
    ctx["index_reads"] = bool(re.search(r"\bfagen_index\(", bodies))
    return ctx


def _key_ranges(rng) -> dict:
    """The keys a query tile sees (key_terms), each exact term's keys of one query (one_query_ranges), and whether a
    term's last key grows with the tile's last query (heavy_tiles_first: later query tiles see more keys)."""
    return dict(
        key_terms=_range_terms(rng),
        one_query_ranges=_one_row_ranges(rng, bounds.one_query),
        heavy_tiles_first=any(t.ends and any(e.has(bounds.q_hi) for e in t.ends) for t in rng.terms),
    )


def _query_bound_c(e: sp.Expr) -> str:
    """A transposed bound in C: k_lo, k_hi take the place of q_lo, q_hi for the printer's integer ranges (both
    are tile ends in [0, 2^31 - 1]); computed in 64 bits as bound_c's."""
    names = {**INDEX_NAMES, bounds.q_lo: "k_lo", bounds.q_hi: "k_hi"}
    stand_in = e.xreplace({bounds.k_lo: bounds.q_lo, bounds.k_hi: bounds.q_hi})
    return printer.to_c(stand_in, names, index_type="long long")


def _range_terms(rng, bound_c=bound_c) -> list[dict]:
    return [
        dict(
            text=exprs.to_text(sp.And(*t.conjuncts)) if t.conjuncts else "no affine bound",
            begins=[bound_c(e) for e in t.begins],
            ends=[bound_c(e) for e in t.ends],
            full_begins=[bound_c(e) for e in t.full_begins],
            full_ends=[bound_c(e) for e in t.full_ends],
            exact=t.exact,
        )
        for t in rng.terms
    ]


def _one_row_ranges(rng, at) -> list[dict]:
    """Each term's range at a tile of one row (`at`: bounds.one_query, the keys of query q_idx, or bounds.one_key, the
    queries of key k_idx), begins and ends in C over long long q_idx or k_idx, seqlen_q, seqlen_k; where every term is
    exact, those ranges are the mask (proven), and a masked tile may test an element against them in place of the
    mask; an empty list otherwise."""
    if not rng.terms or not all(t.exact for t in rng.terms):
        return []
    return [
        dict(text=exprs.to_text(sp.And(*t.conjuncts)), begins=[bound_c(e) for e in b], ends=[bound_c(e) for e in e_])
        for t, (b, e_) in zip(rng.terms, map(at, rng.terms))
    ]


def _lengthens_early(term) -> bool:
    """Whether a term of the transposed range gives early key tiles more query tiles: its first query grows with
    the key tile [k_lo, k_hi], its last does not."""
    tile = (bounds.k_lo, bounds.k_hi)
    return any(e.has(*tile) for e in term.begins) and not any(e.has(*tile) for e in term.ends)


def _mask_first(ctx: dict) -> bool:
    """Whether the wgmma backward's masked steps put -inf into q.k (so into the score) and select nothing after:
    where dL/d(q.k) = P (dP scale - D_i scale) (the scale folded into D_i, and no score function: f' is 1) and P is
    formed from the score in one pass (not from S^T while dP^T's wgmma runs)."""
    return bool(
        ctx.get("fold_scale")
        and ctx.get("derivative_one")
        and not ctx.get("raw_transform")
        and not ctx.get("bwd_overlap_p")
    )


def _masked_step(ctx: dict) -> dict:
    """mask_first (_mask_first), and the terms' ranges for one key (one_key_ranges) only with it: the other masked
    path selects twice an entry, and with the columns ALiBi d128 spilled 8 bytes (630 to 621 instructions a masked
    step; softcap d128 672 to 661). score_first: mask_first without a mask (only rows or keys past the sequences'
    ends are hidden), whose boundary steps put -inf into the score in a pass of their own: with the select inside
    the score's FFMA, ptxas scheduled the interior steps anew (d128 at 80 rows a step: 1.19-1.21x the main kernel's
    time, H200, 2026-11-29)."""
    first = _mask_first(ctx)
    return dict(
        mask_first=first,
        score_first=first and not ctx.get("masked"),
        one_key_ranges=ctx.get("one_key_ranges", []) if first else [],
    )


def backward_context(spec: KernelSpec, low: Lowering, tier, tensors: tuple = (), grads: bool = True) -> dict:
    """What the backward kinds substitute beside the forward's: the backward rule's device functions (in place of
    the forward's), the transposed ranges (the query tiles that see a key tile) and the tensor gradients, each with
    its slot in the dtensor workspace (none where not `grads`); `low` holds the rule and ranges the backward pass
    proved."""
    if low.backward is None or low.query_range is None:
        raise ValueError(
            f"{spec.name}: a backward kernel prints the proven backward; lower with lowering.with_backward"
        )
    brule, qrng = low.backward, low.query_range
    # early key tiles see more query tiles (a term's first query grows with the key tile and its last does not:
    # causal, not a window)
    early = any(_lengthens_early(t) for t in qrng.terms)
    slots = slot_gradients(brule, tensors) if grads else []
    if len(slots) > contract.MAX_ROW_GRADIENTS:
        raise bw.BackwardError(
            f"the score reads {len(slots)} tensors as name[h], name[b] or name[b, h] ("
            + ", ".join(f"{g.name}[{g.index}]" for g in slots)
            + f"); the backward computes the gradients of at most {contract.MAX_ROW_GRADIENTS} such tensors"
        )
    raw = brule.forward.raw_transform  # the tensor-core kernels form P from the raw value (S = a u)
    scatters = scatter_gradients(brule, tensors)
    # dL/d(q.k) straight from P, the scale folded into D_i ((l)), where the tier's kernel takes it and no tensor's
    # gradient needs dS itself
    fold_scale = tier.folds_scale(spec) and not slots and not scatters
    return dict(
        rule_functions=backward_rule_functions(brule, tier, tensors, fold_scale),
        fold_scale=fold_scale,
        raw_transform=raw,
        p_from="p_from_raw" if raw else "p_from_lse",
        p_args="scale_log2, " if raw else "",
        tau=None,  # the backward has no running max: no lazy-rescaling threshold
        query_terms=_range_terms(qrng, _query_bound_c),
        one_key_ranges=_one_row_ranges(qrng, bounds.one_key),
        derivative_reads_score=brule.score_derivative.has(exprs.SCORE),
        derivative_one=brule.score_derivative == 1,  # no score function
        # where early key tiles see more query tiles, the tier may start the long blocks first, and take a GQA group's
        # query heads inner (a deterministic call's key tiles then reach each head's query tile at about the same step)
        heavy_key_tiles_first=tier.orders_key_tiles(spec) and early,
        heads_inner=tier.takes_heads_inner(spec) and early,
        tensor_grads=[
            dict(function=f"d_{g.name}_{g.index}", name=g.name, index=g.index, slot=i) for i, g in enumerate(slots)
        ],
        tensor_scatters=[
            dict(
                function=f"d_{g.name}_{g.index}",
                offset=f"at_{g.name}_{g.index}",
                grad=contract.c_grad_name(g.name),
                name=g.name,
            )
            for g in scatters
        ],
    )


def render(
    spec: KernelSpec,
    low: Lowering,
    command: str | None = None,
    tensor_dtypes=None,
    *,
    bytecode_dir: str | None = None,
) -> str:
    """The .cu for `spec`, printed from `low` (the fused program and what the passes proved of it); `command` is the
    header's "Regenerate:" line; `tensor_dtypes` the call-time tensors' dtypes by name (default float32);
    `bytecode_dir` where the compiled templates are kept between processes (template_cache; None: not kept)."""
    template = tiers.get(spec.tier).templates[spec.kind]  # a template's name, or a file a tier brings along
    env = _env(bytecode_dir)
    t = env.get_template(template) if isinstance(template, str) else env.from_string(template.read_text())
    return t.render(**context(spec, low, command, tensor_dtypes))
