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
derivative that is not finite at a masked key never reaches the sums. Without a score function (f' = 1) the wgmma
backward instead puts -inf into a masked key's score: P = 0, and dqk = P (dP - D) scale = 0 where dP is finite.

f' is SymPy's derivative of the score function. Where it is only almost everywhere smooth it is taken as
SymPy gives it: max/min of the score differentiate to a Heaviside step (1/2 at a tie), abs to sign (0 at 0),
where(cond(s), a, b) branch by branch. A score function that is piecewise constant in the score (floor or %
of s: 0 almost everywhere, no gradient at all) or whose derivative SymPy cannot write in closed form is
refused with a BackwardError naming it and why; one whose derivative the C printer cannot print is refused, in the
same words, by the backend that prints it (fagen.backend.codegen).

`prove_backward(brule, chain, scale)` checks, symbolically (as online_softmax.prove does the forward):
  (g) the softmax Jacobian: on a row of three keys and a masked fourth, with P = softmax(T), O = Σ_j P_j v_j
      (two columns) and L = dO · O, SymPy's dL/dT_j of the unfused softmax equals the rule's ds, with P
      recomputed from lse = log Σ exp(T) and D = rowsum(dO ∘ O); the masked key's ds is 0;
  (h) P recomputed from the forward's own lse (its fold of two key blocks, one with a masked key, through
      lse_log2 and p) equals the forward's P_j = exp(T_j) / Σ exp(T);
  (i) the chain through the score function and the scale: dqk / ds equals d/d(q·k) of the original graph's
      pointwise chain (its scale and score_mod nodes) at the same point;
  (j) each tensor gradient's partial equals the derivative of that chain by the tensor element;
  (k) a fully masked row (the forward's lse = -inf): P = 0, ds = 0, dqk = 0, dqk_p = 0 and every tensor
      gradient 0, with no NaN;
  (l) the scale folded into D_i: dqk_p = P (dP scale - D_i scale) f', with D_i scale (d_scaled) made once a row,
      equals dqk of the rule's ds (one fused multiply-add and one multiply an element where dS, then dS f' scale,
      took three: the kernels that need dS itself, for a tensor's gradient, keep ds and dqk).
The kernels print these expressions (`codegen.backward_rule_functions`), once the backward pass has proven them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import sympy as sp

from ..ir import IRError, Node, Op, TensorType, exprs
from . import online_softmax as fwd
from .online_softmax import Identity, _is_zero, _require

# --- The symbols of the backward (named as the kernels name them) ---------------------------------------------
lse = sp.Symbol("lse", extended_real=True)  # the forward's row log-sum-exp, natural log (-inf: fully masked row)
lse_log2 = sp.Symbol("lse_log2", extended_real=True)  # the row's base-2 reference for P
dp = sp.Symbol("dp", real=True)  # dO_i · v_j
d_row = sp.Symbol("d_row", real=True)  # D_i = rowsum(dO_i ∘ O_i)
p = sp.Symbol("p", nonnegative=True)  # P_ij
ds = sp.Symbol("ds", real=True)  # dS_ij = dL/dT_ij
scale = sp.Symbol("scale", positive=True)  # the natural scale, scale_log2 / log2(e) (a kernel computes it once)
d_scaled = sp.Symbol("d_scaled", real=True)  # D_i scale, made once a row (d_scaled_of)


class BackwardError(IRError):
    """The program's backward cannot be derived (a score function SymPy cannot differentiate, ...)."""


@dataclass(frozen=True)
class TensorGradient:
    """The gradient of one call-time tensor read by the score: d tensor[index] += ds · partial."""

    name: str  # the tensor
    index: str  # 'h', 'b' or 'bh' for a per-head/batch/(batch, head) tensor (deterministic partials); 'g0', ... for
    # the gathered reads of any other tensor (scatter-added into a float32 gradient of the tensor's shape)
    partial: sp.Expr  # ∂T/∂tensor[index], over qk, scale_log2, kLog2e, the indices and the tensors
    read: sp.Indexed | None = None  # the element read, tensor[i0, ...]

    @property
    def gathered(self) -> bool:
        return self.index not in exprs.SLOT_INDICES


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
    score_derivative: sp.Expr = sp.S.One  # f' over exprs.SCORE, which dqk carries (named where it cannot print)
    p_raw: sp.Expr | None = None  # P from the raw value u where the forward's S = a u (raw_transform), over qk,
    # scale_log2 and lse_log2: one fused multiply-add (the same P: checked when the rule is made)
    dqk_p: sp.Expr = sp.S.Zero  # dqk from p, dp and d_scaled (the scale folded into D_i, (l)), over scale, qk, ...
    natural_scale: sp.Expr = sp.S.Zero  # scale over scale_log2 (and kLog2e)
    d_scaled_of: sp.Expr = sp.S.Zero  # d_scaled over d_row and scale

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
            tensors=tuple(TensorGradient(g.name, g.index, g.partial.xreplace(at), g.read) for g in self.tensors),
            score_derivative=self.score_derivative,
            p_raw=None if self.p_raw is None else self.p_raw.xreplace(at),
            dqk_p=self.dqk_p.xreplace(at),
            natural_scale=self.natural_scale.xreplace(at),
            d_scaled_of=self.d_scaled_of,
        )


def _t_of_qk() -> sp.Expr:
    """t = scale · q·k, in the kernels' symbols: scale = scale_log2 / log2(e)."""
    return fwd.qk * fwd.scale_log2 / fwd.kLog2e


# Functions that are piecewise constant in their argument: where that argument depends on the variable, the
# derivative is 0 almost everywhere and a Dirac delta at each step, so no gradient flows through them.
_STEPS = (sp.floor, sp.ceiling, sp.Mod, sp.frac, sp.sign, sp.Heaviside)


def _freeze_remainders(e: sp.Expr, var: sp.Basic) -> tuple[sp.Expr, dict]:
    """e with each remainder of an expression in var by a divisor free of it (Mod(a, c), fmod(a, c): a - c·n with n
    an integer, piecewise constant in var) written a + r, r a stand-in for the rest: its derivative by var is a's
    almost everywhere, as torch's remainder and fmod backward give; and r -> its value, to put back."""
    frozen: dict = {}

    def freeze(m):
        r = sp.Dummy("r", real=True)
        frozen[r] = m - m.args[0]
        return m.args[0] + r

    def is_remainder(m):
        return isinstance(m, (sp.Mod, exprs.fmod)) and m.args[0].has(var) and not m.args[1].has(var)

    return e.replace(is_remainder, freeze), frozen


def _thawed(d: sp.Expr, frozen: dict) -> sp.Expr:
    while frozen and d.has(*frozen):  # a remainder inside another's: its stand-in is in the outer one's value
        d = d.xreplace(frozen)
    return d


def _diff(e: sp.Expr, var: sp.Basic) -> sp.Expr:
    """sp.diff, a remainder by a divisor free of var differentiated as its dividend (_freeze_remainders)."""
    e, frozen = _freeze_remainders(e, var)
    return _thawed(sp.diff(e, var), frozen)


def _derivative(score_fn: sp.Expr, var: sp.Basic, what: str, back: dict | None = None) -> sp.Expr:
    """d score_fn / d var; `back` maps a stand-in variable back to what it stands for (in messages). A remainder by
    a divisor free of var has the derivative of its dividend (almost everywhere: torch's rule)."""
    back = back or {}
    where = f"score function {exprs.to_text(score_fn.xreplace(back))}"
    score_fn, frozen = _freeze_remainders(score_fn, var)
    for step in sorted(score_fn.atoms(*_STEPS, exprs.fmod), key=str):
        if step.has(var) and isinstance(step, (sp.Mod, exprs.fmod)):
            raise BackwardError(
                f"{where}: the divisor of {exprs.to_text(step.xreplace(back))} depends on {what}; no gradient is "
                "derived through a remainder by it"
            )
        if step.has(var):
            raise BackwardError(
                f"{where}: {exprs.to_text(step.xreplace(back))} is piecewise constant in {what}: its derivative "
                "is 0 almost everywhere and undefined at each step, so no gradient would flow through it"
            )
    try:
        d = _thawed(sp.diff(score_fn, var), frozen)
    except Exception as e:  # SymPy raises assorted errors for what it cannot differentiate
        raise BackwardError(f"{where}: cannot differentiate by {what}: {e}") from e
    if d.has(sp.Derivative, sp.Subs, sp.nan, sp.zoo, sp.DiracDelta):
        raise BackwardError(f"{where}: its derivative by {what} has no closed form SymPy can print")
    return d


@functools.lru_cache(maxsize=64)
def make_backward_rule(score_fn: sp.Expr, keep: sp.Basic) -> BackwardRule:
    """The backward for scores T = score_fn(t), t = scale · q·k (exprs.SCORE in score_fn), masked by `keep`."""
    forward = fwd.make_rule(score_fn, keep)
    t = _t_of_qk()
    derivative = _derivative(score_fn, exprs.SCORE, "the score")
    dscore = derivative.xreplace({exprs.SCORE: t})
    grads = []
    # the reads inside an index (bias[h, bucket[q - k]]: bucket[q - k]) are integers, with no gradient: the score is
    # piecewise constant in them
    reads = sorted((r for r in score_fn.atoms(sp.Indexed) if not exprs.is_index_read(r)), key=str)
    by_name: dict[str, list] = {}
    for read in reads:
        by_name.setdefault(str(read.base.label), []).append(read)
    for name, mine in sorted(by_name.items()):
        slot = exprs.slot_index(mine)
        for n, read in enumerate(mine):
            stand_in = sp.Dummy(name, real=True)
            partial = _derivative(
                score_fn.xreplace({read: stand_in}), stand_in, f"tensor {read}", {stand_in: read}
            ).xreplace({stand_in: read, exprs.SCORE: t})
            grads.append(TensorGradient(name, slot or f"g{n}", partial, read))
    p_lse = 2 ** (fwd.s - lse_log2)
    return BackwardRule(
        forward=forward,
        score_fn=score_fn,
        lse_log2=sp.Piecewise((sp.oo, sp.Eq(lse, -sp.oo)), (lse * fwd.kLog2e, True)),
        p=p_lse,
        ds=p * (dp - d_row),
        dqk=ds * dscore * fwd.scale_log2 / fwd.kLog2e,
        tensors=tuple(grads),
        score_derivative=derivative,
        p_raw=_p_from_raw(forward, p_lse) if forward.raw_transform else None,
        dqk_p=p * (dp * scale - d_scaled) * dscore,
        natural_scale=fwd.scale_log2 / fwd.kLog2e,
        d_scaled_of=d_row * scale,
    )


def _p_from_raw(forward: fwd.OnlineSoftmaxRule, p_lse: sp.Expr) -> sp.Expr:
    """P from the raw value u = q.k + r where the forward's S = a u (its proof (e)): 2^(a u - lse_log2), with u in
    the place of q.k. Checked to be P from the score, 2^(S - lse_log2), or a ProofError."""
    a = sp.diff(forward.raw_max, fwd.m_raw)
    p_raw = p_lse.xreplace({fwd.s: a * fwd.qk})
    same = p_raw.xreplace({fwd.qk: forward.raw}) - p_lse.xreplace({fwd.s: forward.score})
    if not _is_zero(same.xreplace({fwd.kLog2e: 1 / sp.log(2)})):
        raise fwd.ProofError(f"P from the raw value differs from P from the score: {same}")
    return p_raw


# --- Proofs ------------------------------------------------------------------------------------------------
_scale = sp.Symbol("scale", positive=True)  # the scale where no graph gives one: any positive value


def fused_chain(scale: sp.Expr, score_fn: sp.Expr) -> tuple[Node, ...]:
    """The pointwise chain a fused node stands for (fusion's (c) proved it equal to the original graph's):
    scale(·, factor=scale) then score_mod(·, fn=score_fn)."""
    t = TensorType("f32", ("B", "H", "M", "N"))
    return (
        Node("t", Op.SCALE, ("s",), t, (("factor", scale),)),
        Node("c", Op.SCORE_MOD, ("t",), t, (("fn", score_fn),)),
    )


def _differs_somewhere(e: sp.Expr) -> bool:
    """True where e is clearly nonzero at one point (a quick refusal before SymPy's slower simplification
    tries, and fails, to show e = 0); False where that point says nothing."""
    import random

    rnd = random.Random(20261122)
    at = {}
    for x in sorted(e.atoms(sp.Indexed), key=str):
        at[x] = sp.Rational(rnd.randint(1, 9), 7)
    for x in sorted(e.free_symbols - set(at), key=str):
        if x.is_integer:
            at[x] = sp.Integer(rnd.randint(1, 5))
        elif x.is_nonnegative:
            at[x] = sp.Rational(rnd.randint(1, 9), 5)
        else:
            at[x] = sp.Rational(rnd.randint(-9, 9), 7)
    try:
        value = complex(e.xreplace(at).evalf(30))
    except (TypeError, ValueError, ZeroDivisionError):
        return False
    return abs(value) > 1e-12


def _same(a: sp.Expr, b: sp.Expr) -> bool:
    """a = b for expressions mixing exp, log and powers of 2."""
    e = a - b
    if _differs_somewhere(e):
        return False
    if _is_zero(e):
        return True
    return _is_zero(sp.expand_log(e.rewrite(sp.exp), force=True))


def _nan_free(*es) -> bool:
    return not any(sp.sympify(e).has(sp.nan, sp.zoo) for e in es)


@functools.lru_cache(maxsize=64)
def prove_backward(
    brule: BackwardRule, chain: tuple[Node, ...] | None = None, scale_default: sp.Expr | None = None
) -> tuple[Identity, ...]:
    """(g)-(k) of the module docstring; raises ProofError at the first that fails. `chain` is the original
    graph's pointwise chain (scale, score_mod and mask nodes, as fusion matched it) and `scale_default` its
    scale; without them, the fused node's own (`fused_chain`) at a symbolic positive scale."""
    if scale_default is None:
        scale_default = _scale
    if chain is None:
        chain = fused_chain(scale_default, brule.score_fn)
    rule = brule.concrete()
    proven = [_prove_jacobian(rule), _prove_p_from_lse(rule)]
    proven += _prove_chain(rule, chain, scale_default)
    proven.append(_prove_folded_scale(rule))
    proven.append(_prove_masked_row(rule))
    return tuple(proven)


# A row of dO (two columns) and the values the proofs fold; x: base-2 scores of three keys.
_G = sp.symbols("g1:3", real=True)
_X = sp.symbols("x1:4", real=True)
_VALS = sp.symbols("w1:5", real=True)
_Z = sp.Symbol("z", real=True)  # a raw dot product q · k


def _prove_jacobian(rule: BackwardRule) -> Identity:
    """(g) the softmax Jacobian, on natural scores T_j of three keys and a masked fourth."""
    T = sp.symbols("T1:4", real=True)
    g = _G
    V = [sp.symbols(f"v{j}_1:3", real=True) for j in range(1, 5)]  # the keys' rows of V
    Z = sum(sp.exp(t) for t in T)
    P = [sp.exp(t) / Z for t in T]
    out_row = [sum(P[j] * V[j][c] for j in range(3)) for c in range(2)]
    L = sum(g[c] * out_row[c] for c in range(2))
    row_lse = sp.Symbol("lse_row", real=True)  # finite: the row sees a key
    ref_log2 = rule.lse_log2.xreplace({lse: row_lse})
    D = sum(g[c] * out_row[c] for c in range(2))
    ok = True
    for j in range(4):
        s_j = T[j] / sp.log(2) if j < 3 else -fwd.oo  # base 2; the masked key's score is -inf
        p_j = rule.p.xreplace({fwd.s: s_j, lse_log2: ref_log2}).xreplace({row_lse: sp.log(Z)})
        ds_j = rule.ds.xreplace({p: p_j, dp: sum(g[c] * V[j][c] for c in range(2)), d_row: D})
        ok = ok and _nan_free(ds_j) and (_same(ds_j, sp.diff(L, T[j])) if j < 3 else ds_j == 0)
    return _require(
        ok,
        "(g) softmax Jacobian",
        "dL/dT_j = P_j (dO·v_j - rowsum(dO ∘ O)) for L = dO · softmax(T) V, with P_j from the saved lse; "
        "a masked key gets 0",
    )


def _prove_p_from_lse(rule: BackwardRule) -> Identity:
    """(h) P from the forward's own lse: two key blocks folded by the forward rule, the second with a masked key."""
    fw, x, vals = rule.forward, _X, _VALS
    state = fwd._fold_block(fw, fwd._INIT, x[:2], vals[:2])
    state = fwd._fold_block(fw, state, [x[2], -fwd.oo], vals[2:])
    mu = sp.Symbol("mu", real=True)  # the forward's reference max cancels; name it to help SymPy
    fwd_lse = fwd._finish(fw, state)[1].xreplace(fwd._AT_LN2).xreplace({state[0]: mu})
    ref = rule.lse_log2.xreplace({lse: fwd_lse})
    total = sum(2**xj for xj in x)
    ok = all(_same(rule.p.xreplace({fwd.s: xj, lse_log2: ref}), 2**xj / total) for xj in x)
    ok = ok and rule.p.xreplace({fwd.s: -fwd.oo, lse_log2: ref}) == 0
    return _require(
        ok,
        "(h) P from lse",
        "2^(S_j - lse_log2(lse)) with the forward's own lse = 2^(S_j) / Σ_k 2^(S_k), the forward's P "
        "(exp(T_j) / Σ exp(T)); a masked key's P is 0",
    )


def _prove_chain(rule: BackwardRule, chain: tuple[Node, ...], scale_default: sp.Expr) -> list[Identity]:
    """(i) the chain through the score function and the scale, and (j) the call-time tensors the score reads."""
    z = _Z
    at_scale = {fwd.scale_log2: scale_default / sp.log(2)}
    graph_t = fwd._element(chain, z)
    dqk_z = rule.dqk.xreplace({ds: sp.S.One, fwd.qk: z}).xreplace(at_scale)
    proven = [
        _require(
            _nan_free(dqk_z) and _same(dqk_z, _diff(graph_t, z)),
            "(i) chain rule",
            "dL/d(q·k) = dS · f'(scale·q·k) · scale: the rule's dqk is the derivative of the graph's scale and "
            "score functions by q·k, times dL/dT",
        )
    ]
    reads = sorted((r for r in graph_t.atoms(sp.Indexed) if not exprs.is_index_read(r)), key=str)
    ok = sorted(map(str, reads)) == sorted(str(gr.read) for gr in rule.tensors)
    for gr in rule.tensors:
        read = gr.read
        stand_in = sp.Dummy(gr.name, real=True)
        want = _diff(graph_t.xreplace({read: stand_in}), stand_in).xreplace({stand_in: read})
        got = gr.partial.xreplace({fwd.qk: z}).xreplace(at_scale)
        ok = ok and _nan_free(got) and _same(got, want)
    if rule.tensors or reads:
        proven.append(
            _require(
                ok,
                "(j) tensor gradients",
                "d tensor[idx] = Σ dS · ∂T/∂tensor[idx]: each partial is the derivative of the graph's score by "
                "that tensor element, and every tensor the score reads has one",
            )
        )
    return proven


def _prove_folded_scale(rule: BackwardRule) -> Identity:
    """(l) dqk_p, at D_i's scaled value and the kernels' scale, is dqk of the rule's ds."""
    at = {d_scaled: rule.d_scaled_of}
    got = rule.dqk_p.xreplace(at).xreplace({scale: rule.natural_scale})
    want = rule.dqk.xreplace({ds: rule.ds})
    return _require(
        _nan_free(got) and _same(got, want),
        "(l) scale folded into D_i",
        "P (dP scale - D_i scale) f' = dS f' scale, with scale = scale_log2 / log2(e) and D_i scale made once a "
        "row: one fused multiply-add and one multiply an element",
    )


def _prove_masked_row(rule: BackwardRule) -> Identity:
    """(k) a fully masked row: the forward's own fold of masked keys gives lse = -inf."""
    g, x, z = _G, _X, _Z
    masked = fwd._fold_block(rule.forward, fwd._INIT, [-fwd.oo, -fwd.oo], _VALS[:2])
    out, dead_lse = fwd._finish(rule.forward, masked)
    ref = rule.lse_log2.xreplace({lse: dead_lse})
    ps = [rule.p.xreplace({fwd.s: s_j, lse_log2: ref}) for s_j in (x[0], -fwd.oo)]  # a score, a masked key
    d_masked = sum(g[c] * 0 for c in range(2))  # D = dO · O with O = 0
    dss = [rule.ds.xreplace({p: p_j, dp: g[0], d_row: d_masked}) for p_j in ps]
    dqks = [rule.dqk.xreplace({ds: d, fwd.qk: z}) for d in dss]
    dqks += [rule.dqk_p.xreplace({p: p_j, dp: g[0], d_scaled: d_masked, fwd.qk: z}) for p_j in ps]
    tgs = [(ds * gr.partial).xreplace({ds: d, fwd.qk: z}) for gr in rule.tensors for d in dss]
    ok = out == 0 and dead_lse == -fwd.oo and all(e == 0 for e in (*ps, *dss, *dqks, *tgs))
    return _require(
        ok and _nan_free(*ps, *dss, *dqks, *tgs),
        "(k) fully masked row",
        "lse = -inf gives lse_log2 = +inf, P = 0, dS = 0, dL/d(q·k) = 0 (from dS, and folded) and no tensor "
        "gradient, with no NaN",
    )
