"""A NumPy interpreter for IR programs, in float64: the oracle of the CPU tests.

It runs any program, before or after the fusion pass, and the backward programs fagen.passes.backward
derives. The fused node runs as a tiled loop with arbitrary block sizes, through the very expressions the
pass proved (lambdified), so a wrong update rule shows up here too, not only on the GPU; the fused backward
(online_softmax_grad) runs as the backward kernels do, a key tile at a time with every query tile, through
the backward rule's expressions.

GQA/MQA: an input may have fewer heads (dimension H) than another, a divisor of them; query head h reads
head h // (H / H_kv) of it, and the gradient of such an input is summed over the heads of its group.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np
import sympy as sp
from sympy.printing.numpy import NumPyPrinter

from ..backend.contract import LOG2E
from ..ir import IRError, Op, Program, exprs
from ..math import backward as bw
from ..math import bounds, online_softmax
from ..passes import backward as backward_pass
from ..passes import fuse


@dataclass(frozen=True)
class Evaluation:
    outputs: dict  # output name -> float64 array
    lse: dict  # attention node name -> row log-sum-exp [.., M] (natural log)
    # run(rows=True): the fused backward's row sums, the kernels' rowstat (fagen.backend.contract): "E" -> E_i =
    # sum_j dS_ij and (name, index) -> R_i = sum_j P_ij g_ij of each tensor read as name[h] / [b] / [b, h], [.., M]
    rows: dict = field(default_factory=dict)


def bind_dims(program: Program, inputs: dict) -> dict:
    """Unify the inputs' shapes with the program's symbolic dimensions."""
    dims: dict[str, int] = {}
    for node in program.find(Op.INPUT):
        if node.name not in inputs:
            raise IRError(f"input {node.name!r} was not given")
        shape = np.shape(inputs[node.name])
        if len(shape) != len(node.type.shape):
            raise IRError(
                f"input {node.name!r}: expected rank {len(node.type.shape)} "
                f"[{', '.join(node.type.shape)}], got shape {shape}"
            )
        for name, size in zip(node.type.shape, shape):
            if name == "H":  # heads may differ (GQA): checked below
                dims[name] = max(dims.get(name, size), size)
            elif dims.setdefault(name, size) != size:
                raise IRError(f"input {node.name!r}: dimension {name} is {size} here but {dims[name]} elsewhere")
    for node in program.find(Op.INPUT):
        if "H" in node.type.shape:
            heads = np.shape(inputs[node.name])[node.type.shape.index("H")]
            if heads == 0 or dims["H"] % heads:
                raise IRError(
                    f"input {node.name!r}: {heads} heads do not divide the {dims['H']} heads of another input "
                    "(GQA: the key/value heads must divide the query heads)"
                )
    return dims


def _expand_heads(x: np.ndarray, shape: tuple[str, ...], dims: dict) -> np.ndarray:
    """A GQA operand with its heads repeated to the program's H (query head h reads head h // group)."""
    if "H" not in shape or x.ndim != len(shape):
        return x
    axis = shape.index("H")
    return np.repeat(x, dims["H"] // x.shape[axis], axis=axis) if x.shape[axis] != dims["H"] else x


def _sum_heads(g: np.ndarray, heads: int, axis: int) -> np.ndarray:
    """The gradient of a GQA operand: summed over the query heads of each group."""
    if g.shape[axis] == heads:
        return g
    shape = g.shape[:axis] + (heads, g.shape[axis] // heads) + g.shape[axis + 1 :]
    return g.reshape(shape).sum(axis=axis + 1)


def _index_grids(dims):
    B, H, M, N = (dims.get(n, 1) for n in "BHMN")
    return {
        exprs.INDICES["b"]: np.arange(B).reshape(B, 1, 1, 1),
        exprs.INDICES["h"]: np.arange(H).reshape(1, H, 1, 1),
        exprs.INDICES["q"]: np.arange(M).reshape(1, 1, M, 1),
        exprs.INDICES["k"]: np.arange(N).reshape(1, 1, 1, N),
    }


def _tensor_array(values: dict, name: str) -> np.ndarray:
    """A call-time tensor as the executor reads it: floats in float64, integers in int64 (exact ids), bools 0/1."""
    x = np.asarray(values[name])
    return x.astype(np.int64) if x.dtype.kind in "iub" else x.astype(np.float64)


def gather_indices(read: sp.Indexed, values: dict, size: tuple) -> tuple:
    """The element indices a tensor read reads at every position of the index grids in `values`: each index
    expression evaluated in integers and clamped to [0, size - 1] of its dimension, as the kernels clamp."""
    out = []
    for d, index in enumerate(read.indices):
        at = np.asarray(_evaluate(index, values))
        if at.dtype.kind == "f":  # integer-valued by construction (exprs.check_tensor_index)
            at = np.rint(at)
        out.append(np.clip(at.astype(np.int64), 0, size[d] - 1))
    return tuple(out)


def _evaluate(expr, values: dict):
    """Evaluate a SymPy expression over NumPy arrays; `values` maps every free symbol, and each call-time
    tensor's name to its array (gathered at the index grids its reads compute, each index clamped)."""
    expr = exprs.exact_relations(expr)  # comparisons of indices in integers, as the kernels compute them
    expr = _integer_floors(expr)  # floor(a/b) of indices in integers, as the kernels compute them
    # outer reads first (a read's text holds those inside its indices): an inner read is evaluated inside its outer
    # one's index (gather_indices), and on its own only where it is also read elsewhere
    for n, ind in enumerate(sorted(expr.atoms(sp.Indexed), key=lambda r: (-len(str(r)), str(r)))):
        if not expr.has(ind):
            continue
        name = str(ind.base.label)
        if name not in values:
            raise IRError(f"cannot evaluate {expr}: no tensor {name!r} given")
        stand_in = sp.Symbol(f"tensor_{name}_read{n}", real=True)
        table = _tensor_array(values, name)
        if table.ndim != len(ind.indices):
            raise IRError(f"tensor {name}: read with {len(ind.indices)} indices, given shape {table.shape}")
        read = table[gather_indices(ind, values, table.shape)]
        if exprs.is_index_read(ind):  # an integer, saturated as the kernels take it (printer: fagen_index)
            read = np.clip(np.rint(read), -exprs.INDEX_READ_MAX, exprs.INDEX_READ_MAX).astype(np.int64)
        values = {**values, stand_in: read}
        expr = expr.xreplace({ind: stand_in})
    syms = tuple(sorted(expr.free_symbols, key=str))
    missing = [s for s in syms if s not in values]
    if missing:
        raise IRError(f"cannot evaluate {expr}: no value for {', '.join(map(str, missing))}")
    fn = _lambdify(syms, expr)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        return fn(*[values[s] for s in syms])


class _FloorDiv(sp.Function):
    """floor(a / b) for integers a and b > 0, evaluated with integer floor division (never through a float
    a / b, which can land a hair below an integer: -1/3 + 4/3 is 0.9999999999999999 in float64)."""

    nargs = 2


def _integer_floors(expr: sp.Basic) -> sp.Basic:
    def exact(e):
        num, den = sp.fraction(sp.together(e.args[0]))
        if den.is_Integer and den > 0 and exprs.is_int_valued(num):
            return _FloorDiv(num, den)
        return e

    return expr.replace(lambda e: isinstance(e, sp.floor), exact) if expr.has(sp.floor) else expr


class _Printer(NumPyPrinter):
    """NumPy printing with broadcasting binary and/or/max/min (SymPy's reduce over a tuple needs equal shapes)."""

    def _nested(self, fn, args):
        text = self._print(args[0])
        for a in args[1:]:
            text = f"numpy.{fn}({text}, {self._print(a)})"
        return text

    def _print_And(self, e):
        return self._nested("logical_and", e.args)

    def _print_Or(self, e):
        return self._nested("logical_or", e.args)

    def _print_Max(self, e):
        return self._nested("maximum", e.args)

    def _print_Min(self, e):
        return self._nested("minimum", e.args)

    def _print__FloorDiv(self, e):
        return f"numpy.floor_divide({self._print(e.args[0])}, {self._print(e.args[1])})"

    def _binary(self, fn, e):
        return f"numpy.{fn}({self._print(e.args[0])}, {self._print(e.args[1])})"

    def _print_bitwise_and(self, e):  # integer bit operations and C's fmod (fagen.ir.exprs)
        return self._binary("bitwise_and", e)

    def _print_bitwise_or(self, e):
        return self._binary("bitwise_or", e)

    def _print_bitwise_xor(self, e):
        return self._binary("bitwise_xor", e)

    def _print_fmod(self, e):
        return self._binary("fmod", e)

    def _print_erf(self, e):  # NumPy has no erf: math.erf, element by element
        return f"numpy.vectorize(math.erf, otypes=[float])({self._print(e.args[0])})"


@functools.lru_cache(maxsize=256)
def _lambdify(syms, expr):
    return sp.lambdify(syms, expr, modules=[{"math": math}, "numpy"], printer=_Printer)


def _dim_values(dims):
    return {exprs.DIMS[n]: v for n, v in dims.items() if n in exprs.DIMS}


def run(
    program: Program,
    inputs: dict,
    *,
    scale: float | None = None,
    block_m: int = 16,
    block_n: int = 16,
    tensors: dict | None = None,
    rows: bool = False,
) -> Evaluation:
    """Run `program` on `inputs` (name -> array) in float64.

    `scale` overrides the program's default scale (as the kernels' scale argument does).
    `block_m`/`block_n` are the tile sizes of fused nodes. `tensors` gives the call-time tensors by name.
    `rows`: the fused backward's row sums too (Evaluation.rows).
    """
    dims = bind_dims(program, inputs)
    named = dict(tensors or {})
    values: dict[str, np.ndarray] = {}
    lse: dict[str, np.ndarray] = {}
    grads: dict[tuple, dict] = {}
    row_sums: dict = {}
    for node in program.nodes():
        ins = [_expand_heads(values[i], program.node(i).type.shape, dims) for i in node.inputs]
        if node.op is Op.INPUT:
            values[node.name] = np.asarray(inputs[node.name], dtype=np.float64)
        elif node.op is Op.MATMUL:
            b = ins[1].swapaxes(-1, -2) if node.attr("transpose_b") else ins[1]
            values[node.name] = ins[0] @ b
        elif node.op is Op.SCALE:
            factor = scale if scale is not None else float(node.attr("factor").xreplace(_dim_values(dims)))
            values[node.name] = ins[0] * factor
        elif node.op is Op.SCORE_MOD:
            env = {exprs.SCORE: ins[0], **_index_grids(dims), **_dim_values(dims), **named}
            values[node.name] = np.broadcast_to(_evaluate(node.attr("fn"), env), ins[0].shape).copy()
        elif node.op is Op.MASK:
            keep = _evaluate(node.attr("keep"), {**_index_grids(dims), **_dim_values(dims), **named})
            values[node.name] = np.where(keep, ins[0], -np.inf)
        elif node.op is Op.SOFTMAX:
            x = ins[0]
            m = x.max(axis=-1, keepdims=True)
            m_safe = np.where(np.isneginf(m), 0.0, m)
            e = np.exp(x - m_safe)
            total = e.sum(axis=-1, keepdims=True)
            values[node.name] = np.divide(e, total, out=np.zeros_like(e), where=total > 0)
            with np.errstate(divide="ignore"):
                row_lse = np.where(total[..., 0] > 0, np.log(total[..., 0]) + m_safe[..., 0], -np.inf)
            for user in program.consumers(node.name):
                lse[user.name] = row_lse
        elif node.op is Op.ONLINE_SOFTMAX:
            q, k, v = ins
            values[node.name], lse[node.name] = _online_softmax(node, q, k, v, dims, scale, block_m, block_n, named)
        elif node.op is Op.ROW_DOT:
            values[node.name] = (ins[0] * ins[1]).sum(axis=-1)
        elif node.op is Op.ONLINE_SOFTMAX_GRAD:
            key = (node.inputs, node.attrs[:-1])  # one computation for the group (passes.backward.grad_group)
            if key not in grads:
                q, k, v, do, row_lse, delta = ins
                grads[key] = _online_softmax_grad(
                    node, q, k, v, do, row_lse, delta, dims, scale, block_m, block_n, named, row_sums if rows else None
                )
            g = grads[key][node.attr("wrt")]
            if node.attr("wrt") in ("k", "v"):  # GQA: summed over the query heads of each key/value head
                given = values[node.inputs["qkv".index(node.attr("wrt"))]]
                g = _sum_heads(g, given.shape[-3], g.ndim - 3)
            values[node.name] = g
        else:
            raise IRError(f"node {node.name!r}: the executor has no rule for {node.op.value}")
    return Evaluation({o: values[o] for o in program.outputs}, lse, row_sums)


def _online_softmax(node, q, k, v, dims, scale, block_m, block_n, named):
    """The fused node as the kernels run it: query tiles × key tiles, the proven update per key tile."""
    rule = fuse.rule_of(node).concrete()  # the proven expressions, named constants at their values
    if scale is None:
        scale = float(node.attr("scale").xreplace(_dim_values(dims)))
    consts = {online_softmax.kLog2e: LOG2E, online_softmax.scale_log2: scale * LOG2E, **_dim_values(dims), **named}
    M, N = q.shape[-2], k.shape[-2]
    out = np.empty(q.shape[:-1] + (v.shape[-1],))
    lse = np.empty(q.shape[:-1])
    grids = _index_grids(dims)
    for i0 in range(0, M, block_m):
        i1 = min(M, i0 + block_m)
        m_i = np.full(q.shape[:-2] + (i1 - i0,), -np.inf)
        l_i = np.zeros_like(m_i)
        acc = np.zeros(q.shape[:-2] + (i1 - i0, v.shape[-1]))
        for j0 in range(0, N, block_n):
            j1 = min(N, j0 + block_n)
            qk = q[..., i0:i1, :] @ k[..., j0:j1, :].swapaxes(-1, -2)
            idx = {
                **grids,
                exprs.INDICES["q"]: grids[exprs.INDICES["q"]][..., i0:i1, :],
                exprs.INDICES["k"]: grids[exprs.INDICES["k"]][..., j0:j1],
            }
            s = np.broadcast_to(_evaluate(rule.score, {online_softmax.qk: qk, **idx, **consts}), qk.shape)
            keep = np.broadcast_to(_evaluate(rule.keep, {**idx, **consts}), qk.shape)
            s = np.where(keep, s, -np.inf)
            m_blk = s.max(axis=-1)
            m_new = _evaluate(rule.m_new, {online_softmax.m_i: m_i, online_softmax.m_blk: m_blk})
            m_use = _evaluate(rule.m_use, {online_softmax.m_new: m_new})
            alpha = _evaluate(rule.alpha, {online_softmax.m_i: m_i, online_softmax.m_use: m_use})
            p = _evaluate(rule.p, {online_softmax.s: s, online_softmax.m_use: m_use[..., None]})
            l_i = _evaluate(
                rule.l_new, {online_softmax.alpha: alpha, online_softmax.l_i: l_i, online_softmax.l_blk: p.sum(axis=-1)}
            )
            acc = _evaluate(
                rule.acc_new,
                {
                    online_softmax.alpha: alpha[..., None],
                    online_softmax.acc: acc,
                    online_softmax.pv: p @ v[..., j0:j1, :],
                },
            )
            m_i = m_new
        inv_l = _evaluate(rule.inv_l, {online_softmax.l_i: l_i})
        out[..., i0:i1, :] = _evaluate(rule.out, {online_softmax.acc: acc, online_softmax.inv_l: inv_l[..., None]})
        lse[..., i0:i1] = _evaluate(rule.lse, {online_softmax.m_i: m_i, online_softmax.l_i: l_i, **consts})
    return out, lse


def gradients(
    fused: Program,
    inputs: dict,
    do: np.ndarray,
    *,
    scale: float | None = None,
    tensors: dict | None = None,
    block_m: int = 16,
    block_n: int = 16,
) -> dict:
    """The float64 gradients of L = Σ dO ∘ O for a fused forward program: its forward, then the backward
    program fagen.passes.backward derives (proven), both run here. Returns {"d<input>": ..., "d<tensor>": ...,
    "o": O, "lse": lse}."""
    node = fuse.fused_node(fused)
    ev = run(fused, inputs, scale=scale, tensors=tensors, block_m=block_m, block_n=block_n)
    o, lse = ev.outputs[node.name], ev.lse[node.name]
    derived = backward_pass.derive(fused)
    args = {**inputs, node.name: o, f"d{node.name}": do, "lse": lse}
    grads = run(derived, args, scale=scale, tensors=tensors, block_m=block_m, block_n=block_n)
    return {**grads.outputs, "o": o, "lse": lse}


def _online_softmax_grad(node, q, k, v, do, lse, delta, dims, scale, block_m, block_n, named, rows=None) -> dict:
    """The fused backward as the kernels run it (FlashAttention-2's split): for each key tile, every query
    tile; P recomputed from the saved lse, dS, dL/d(q·k) through the score function, and the sums
    dV_j += Pᵀ dO, dK_j += dQKᵀ Q, dQ_i += dQK K and d tensor[idx] += Σ dS ∂T/∂tensor, each through the
    backward rule's expressions. Masked keys contribute 0 (selected, as the kernels do). Returns every
    gradient of the group by its `wrt` name (k and v over the query heads; the caller sums GQA groups). `rows`: a
    dict that takes the row sums (Evaluation.rows)."""
    rule = backward_pass.rule_of(node).concrete()
    fw = rule.forward
    f = online_softmax
    if scale is None:
        scale = float(node.attr("scale").xreplace(_dim_values(dims)))
    consts = {f.kLog2e: LOG2E, f.scale_log2: scale * LOG2E, **_dim_values(dims), **named}
    M, N = q.shape[-2], k.shape[-2]
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    lead = np.broadcast_shapes(q.shape[:-2], k.shape[:-2])
    dt = {
        g.name: np.zeros(np.shape(named[g.name]) if g.gathered else tuple(dims[i.upper()] for i in g.index))
        for g in rule.tensors
    }
    sum_axes = {"h": (0, 2, 3), "b": (1, 2, 3), "bh": (2, 3)}
    if rows is not None:
        keys = ["E", *((g.name, g.index) for g in rule.tensors if not g.gathered)]
        rows.update({key: np.zeros(lead + (M,)) for key in keys})
    grids = _index_grids(dims)
    lse_log2 = _evaluate(rule.lse_log2, {bw.lse: lse, **consts})
    for j0 in range(0, N, block_n):
        j1 = min(N, j0 + block_n)
        kj, vj = k[..., j0:j1, :], v[..., j0:j1, :]
        for i0 in range(0, M, block_m):
            i1 = min(M, i0 + block_m)
            qi, doi = q[..., i0:i1, :], do[..., i0:i1, :]
            idx = {
                **grids,
                exprs.INDICES["q"]: grids[exprs.INDICES["q"]][..., i0:i1, :],
                exprs.INDICES["k"]: grids[exprs.INDICES["k"]][..., j0:j1],
            }
            qk = qi @ kj.swapaxes(-1, -2)
            shape = lead + qk.shape[-2:]
            keep = np.broadcast_to(_evaluate(fw.keep, {**idx, **consts}), shape)
            s = np.where(keep, np.broadcast_to(_evaluate(fw.score, {f.qk: qk, **idx, **consts}), shape), -np.inf)
            p = _evaluate(rule.p, {f.s: s, bw.lse_log2: lse_log2[..., i0:i1, None]})
            dp = doi @ vj.swapaxes(-1, -2)
            ds = _evaluate(rule.ds, {bw.p: p, bw.dp: dp, bw.d_row: delta[..., i0:i1, None]})
            at = {bw.ds: ds, f.qk: qk, **idx, **consts}
            dqk = np.where(keep, np.broadcast_to(_evaluate(rule.dqk, at), shape), 0.0)
            dv[..., j0:j1, :] += p.swapaxes(-1, -2) @ doi
            dk[..., j0:j1, :] += dqk.swapaxes(-1, -2) @ qi
            dq[..., i0:i1, :] += dqk @ kj
            if rows is not None:
                _add_row_sums(rows, rule.tensors, np.where(keep, ds, 0.0), np.where(keep, p, 0.0), at, (i0, i1))
            for g in rule.tensors:
                share = np.where(keep, np.broadcast_to(_evaluate(bw.ds * g.partial, at), shape), 0.0)
                if g.gathered:  # scatter-added at the (clamped) element each position reads
                    where = gather_indices(g.read, at, dt[g.name].shape)
                    np.add.at(dt[g.name], tuple(np.broadcast_to(w, shape) for w in where), share)
                else:
                    dt[g.name] += share.sum(axis=sum_axes[g.index])
    for g in rule.tensors:  # a [B, H] gradient in its tensor's shape: summed where it broadcasts, 0 past B or H
        if g.index == "bh" and dt[g.name].shape != np.shape(named[g.name]):
            want = np.shape(named[g.name])
            fit = dt[g.name].sum(axis=tuple(a for a, n in enumerate(want) if n == 1), keepdims=True)
            dt[g.name] = np.pad(fit, [(0, n - m) for n, m in zip(want, fit.shape)])
    return {"q": dq, "k": dk, "v": dv, **dt}


def _add_row_sums(rows: dict, tensors, ds, p, at: dict, span: tuple[int, int]) -> None:
    """Add a tile's sums to the row sums: E_i += sum_j dS_ij, R_i += sum_j P_ij g_ij (g: the partial of the score in
    a tensor read as name[h] / [b] / [b, h]; ds and p zero where masked)."""
    i0, i1 = span
    rows["E"][..., i0:i1] += ds.sum(axis=-1)
    for g in tensors:
        if not g.gathered:
            rows[g.name, g.index][..., i0:i1] += (p * np.broadcast_to(_evaluate(g.partial, at), p.shape)).sum(axis=-1)


def block_mask(fused: Program, B: int, H: int, M: int, N: int, block_m: int, block_n: int, *, tensors=None):
    """The block-mask kernel (contract.Kind.BLOCK_MASK, templates/flash_block_mask.cu.jinja) in NumPy: for each
    (b, h, query tile), the key tiles inside the tile's proven key range (fagen.math.bounds) that hold a kept
    (q, k) pair, in ascending order, 2 j + 1 for a full tile j (proven fully visible, or every pair kept) and 2 j
    for a partial one. B, H: 1 where the mask is broadcast (evaluated at b = 0, h = 0). Returns kv_count
    [B, H, tiles_m] and kv_list [B, H, tiles_m, tiles_n] (int32; -1 past the count)."""
    keep = fuse.fused_node(fused).attr("keep")
    rng = bounds.key_range(keep)
    dims = dict(B=B, H=H, M=M, N=N)
    tiles_m, tiles_n = -(-M // block_m), -(-N // block_n)
    count = np.zeros((B, H, tiles_m), np.int32)
    listed = np.full((B, H, tiles_m, tiles_n), -1, np.int32)
    grids = _index_grids(dims)
    named = dict(tensors or {})
    for i in range(tiles_m):
        q_lo, q_hi = i * block_m, min(M, (i + 1) * block_m) - 1
        env = {bounds.q_lo: q_lo, bounds.q_hi: q_hi, exprs.DIMS["M"]: M, exprs.DIMS["N"]: N}
        hull_begin, hull_end, full = (N, 0, []) if rng.terms else (0, N, [(0, N)])
        for term in rng.terms:
            begin = max([0] + [int(e.xreplace(env)) for e in term.begins])
            end = min([N] + [int(e.xreplace(env)) for e in term.ends])
            if begin < end:
                hull_begin, hull_end = min(hull_begin, begin), max(hull_end, end)
            if term.exact:
                full.append(
                    (
                        max([0] + [int(e.xreplace(env)) for e in term.full_begins]),
                        min([N] + [int(e.xreplace(env)) for e in term.full_ends]),
                    )
                )
        j_begin = hull_begin // block_n
        j_end = -(-hull_end // block_n) if hull_end > hull_begin else j_begin
        for j in range(j_begin, j_end):
            n0 = j * block_n
            if any(n0 >= fb and n0 + block_n <= fe for fb, fe in full):  # proven fully visible: not evaluated
                cls = np.full((B, H), 2)
            else:
                idx = {
                    **grids,
                    exprs.INDICES["q"]: grids[exprs.INDICES["q"]][..., q_lo : q_hi + 1, :],
                    exprs.INDICES["k"]: grids[exprs.INDICES["k"]][..., n0 : min(N, n0 + block_n)],
                }
                shape = (B, H, q_hi + 1 - q_lo, min(N, n0 + block_n) - n0)
                kept = np.broadcast_to(np.asarray(_evaluate(keep, {**idx, **_dim_values(dims), **named}), bool), shape)
                cls = np.where(kept.all(axis=(2, 3)), 2, np.where(kept.any(axis=(2, 3)), 1, 0))
            for b in range(B):
                for h in range(H):
                    if cls[b, h]:
                        listed[b, h, i, count[b, h, i]] = 2 * j + (cls[b, h] == 2)
                        count[b, h, i] += 1
    return count, listed
