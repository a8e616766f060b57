"""The backward of fused attention, derived from the forward's proven rule.

For one query row with natural scores T_j = f(t_j) (t_j = scale · q·k_j, f the program's score function, masked
keys dropped), P_j = exp(T_j - lse) and O = Σ_j P_j v_j. Given dO (the gradient of the loss by O):

    D     = rowsum(dO ∘ O)                    once per row (the preprocess kernel)
    P_j   = 2^(S_j - lse · log2(e))           recomputed from the saved lse: no N×N storage (S_j base 2)
    dP_j  = dO · v_j
    dS_j  = P_j (dP_j - D)                    dL/dT_j: the softmax Jacobian applied to dP
    dqk_j = dS_j · f'(t_j) · scale            dL/d(q·k_j): the chain through the score function and the scale
    dQ = Σ_j dqk_j k_j,   dK_j = Σ_i dqk_ij q_i,   dV_j = Σ_i P_ij dO_i
    d tensor[idx] = Σ dS_j · ∂f/∂tensor[idx]  over the positions that read that element (a learnable bias[h])

A fully masked row has lse = -inf; its base-2 reference is taken as +inf, so every P_j = 2^(S_j - inf) = 0 and
its gradients are 0 with no NaN. f' is evaluated before the mask; the kernels select 0 for masked keys, so a
derivative that is not finite at a masked key never reaches the sums.

The kernels print these expressions (`codegen.backward_rule_functions`); `prove_backward` checks them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import sympy as sp

from ..ir import IRError, exprs
from . import online_softmax as fwd

# --- The symbols of the backward (named as the kernels name them) ---------------------------------------------
lse = sp.Symbol("lse", extended_real=True)  # the forward's row log-sum-exp, natural log (-inf: fully masked row)
lse_log2 = sp.Symbol("lse_log2", extended_real=True)  # the row's base-2 reference for P
dp = sp.Symbol("dp", real=True)  # dO_i · v_j
d_row = sp.Symbol("d_row", real=True)  # D_i = rowsum(dO_i ∘ O_i)
p = sp.Symbol("p", nonnegative=True)  # P_ij
ds = sp.Symbol("ds", real=True)  # dS_ij = dL/dT_ij


class BackwardError(IRError):
    """The program's backward cannot be derived (a score function SymPy cannot differentiate, ...)."""


@dataclass(frozen=True)
class TensorGradient:
    """The gradient of one call-time tensor read by the score: d tensor[index] += ds · partial."""

    name: str  # the tensor
    index: str  # 'h' or 'b': what the read element is indexed by
    partial: sp.Expr  # ∂T/∂tensor[index], over qk, scale_log2, kLog2e, the indices and the tensors


@dataclass(frozen=True)
class BackwardRule:
    """The backward's expressions, each a SymPy expression over the symbols above and the forward's."""

    forward: fwd.OnlineSoftmaxRule
    score_fn: sp.Expr  # f, over exprs.SCORE (t = scale · q·k), natural units
    lse_log2: sp.Expr  # over lse
    p: sp.Expr  # over s (base-2 score, fwd.s) and lse_log2
    ds: sp.Expr  # over p, dp, d_row
    dqk: sp.Expr  # over ds, qk, scale_log2, kLog2e (and indices, tensors through f')
    tensors: tuple[TensorGradient, ...] = ()

    def concrete(self) -> BackwardRule:
        """kLog2e at 1/log(2): what the executor and the proofs take (the kernels print the named constant)."""
        at = {fwd.kLog2e: 1 / sp.log(2)}
        return BackwardRule(
            forward=self.forward.concrete(),
            score_fn=self.score_fn,
            lse_log2=self.lse_log2.xreplace(at),
            p=self.p,
            ds=self.ds,
            dqk=self.dqk.xreplace(at),
            tensors=tuple(TensorGradient(g.name, g.index, g.partial.xreplace(at)) for g in self.tensors),
        )


def _t_of_qk() -> sp.Expr:
    """t = scale · q·k, in the kernels' symbols: scale = scale_log2 / log2(e)."""
    return fwd.qk * fwd.scale_log2 / fwd.kLog2e


def _derivative(score_fn: sp.Expr, var: sp.Basic, what: str) -> sp.Expr:
    try:
        d = sp.diff(score_fn, var)
    except Exception as e:  # SymPy raises assorted errors for what it cannot differentiate
        raise BackwardError(f"score function {exprs.to_text(score_fn)}: cannot differentiate by {what}: {e}") from e
    if d.has(sp.Derivative, sp.Subs, sp.nan, sp.zoo):
        raise BackwardError(
            f"score function {exprs.to_text(score_fn)}: its derivative by {what} has no closed form SymPy can print"
        )
    return d


def _index_of(read: sp.Indexed) -> str:
    (index,) = read.indices
    for name in ("h", "b"):
        if index == exprs.INDICES[name]:
            return name
    raise BackwardError(f"tensor read {read}: expected an index h or b")


@functools.lru_cache(maxsize=64)
def make_backward_rule(score_fn: sp.Expr, keep: sp.Basic) -> BackwardRule:
    """The backward for scores T = score_fn(t), t = scale · q·k (exprs.SCORE in score_fn), masked by `keep`."""
    forward = fwd.make_rule(score_fn, keep)
    t = _t_of_qk()
    dscore = _derivative(score_fn, exprs.SCORE, "the score").xreplace({exprs.SCORE: t})
    grads = []
    for read in sorted(score_fn.atoms(sp.Indexed), key=str):
        stand_in = sp.Dummy(str(read.base.label), real=True)
        partial = _derivative(score_fn.xreplace({read: stand_in}), stand_in, f"tensor {read}").xreplace(
            {stand_in: read, exprs.SCORE: t}
        )
        grads.append(TensorGradient(str(read.base.label), _index_of(read), partial))
    return BackwardRule(
        forward=forward,
        score_fn=score_fn,
        lse_log2=sp.Piecewise((sp.oo, sp.Eq(lse, -sp.oo)), (lse * fwd.kLog2e, True)),
        p=2 ** (fwd.s - lse_log2),
        ds=p * (dp - d_row),
        dqk=ds * dscore * fwd.scale_log2 / fwd.kLog2e,
        tensors=tuple(grads),
    )
