"""The online-softmax rule and the identities the fusion pass (fagen.passes.fuse) proves before it applies it.

Notation (the seeds' and FlashAttention's): for one query row, scores arrive a key block at a time.
The running state is the row max `m_i`, the row sum `l_i` and the accumulator `acc` (a row of O, not yet
divided). All of it lives in base 2: scores are multiplied by log2(e) once (folded into the scale), so the
kernels call exp2 — one instruction — instead of exp. A key block with row max `m_blk` updates the state:

    m_new = m_i if m_blk <= m_i + tau, else max(m_i, m_blk)     (tau = 0: the running max)
    alpha = 2^(m_i - m_new)                  the rescale factor exp(m_old - m_new), in base 2
    p     = 2^(s - m_new)                    per score s of the block
    l_i   = alpha · l_i + Σ p
    acc   = alpha · acc + Σ p · v
    O     = acc / l_i,   lse = (m_i + log2 l_i) / log2(e)       after the last block

A row whose scores are all masked has m_new = -inf; `m_use` replaces it by 0 there so that no
-inf - (-inf) = NaN is formed, leaving l_i = 0, O = 0 and lse = -inf.

m_i need not be the exact running max: any reference works for the identities below. With tau > 0 it moves
only when a block's max exceeds it by more than tau (lazy rescaling, as in FlashAttention-4), so p stays
below 2^tau and most key blocks leave the state's scale alone — and the kernels then skip rescaling acc.
For a score affine in q·k with a positive constant slope, S = a·(qk + r) (r = 0: a positive multiple of q·k;
ALiBi: r = slopes[h]·(k - q)·log2(e) / a), the block max is taken over the raw values u = qk + r (`raw`, one
fused multiply-add where r is a per-tile factor times an index) and scaled once (`raw_max`), and
p = 2^(a·u - m) is one fused multiply-add (`p_from_qk`).

`prove(rule)` checks, symbolically:
  (a) folding two key blocks (one with a masked key) gives exactly the softmax sum and the weighted sum
      over their concatenation;
  (b) merging two partial states is commutative and associative (as values l·2^m, acc·2^m), so any tiling
      or split order is valid;
  (c) the final division and the log-sum-exp reproduce the original graph (scale, score function, mask,
      softmax in base e, matmul);
  (d) a fully masked row gives l = 0, O = 0 and lse = -inf, with no NaN on the way;
  (e) where the rule takes the block max over raw values u = raw(qk): S = a·u with a > 0, so
      max_j S_j = a·max_j u_j, and p from u is p from S;
  (f) for split-KV decode (`prove_merge`): the merge of two partial states stands for the state update (b),
      is commutative and associative, an empty split (m = -inf, l = 0, acc = 0) drops out exactly, and all
      splits empty finish to O = 0, lse = -inf, with no NaN.
The kernels print their update code from these same expressions (`codegen.rule_functions`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass

import sympy as sp

from ..ir import IRError, Node, Op, exprs
from . import memo


class ProofError(IRError):
    """An identity the rewrite depends on does not hold (or SymPy could not show it)."""


# --- The symbols of the online-softmax state (named as the kernels name them) -----------------------------
_R = dict(real=True)
qk = sp.Symbol("qk", **_R)  # raw dot product q · k
scale_log2 = sp.Symbol("scale_log2", positive=True)  # scale · log2(e), a kernel argument
kLog2e = sp.Symbol("kLog2e", positive=True)  # log2(e), a named constant in the kernel
# Scores and maxima may be -inf (masked keys, a row with nothing seen yet): extended reals.
s = sp.Symbol("s", extended_real=True)  # one score, base 2, after score function and mask
m_i, m_blk, m_new, m_use = (sp.Symbol(n, extended_real=True) for n in ("m_i", "m_blk", "m_new", "m_use"))
l_i, l_blk = (sp.Symbol(n, nonnegative=True) for n in ("l_i", "l_blk"))
acc, pv, alpha = (sp.Symbol(n, **_R) for n in ("acc", "pv", "alpha"))
inv_l = sp.Symbol("inv_l", nonnegative=True)
m_raw = sp.Symbol("m_raw", extended_real=True)  # the block's max of raw q·k (when the score allows)

lazy_tau = sp.Symbol("tau", positive=True)  # the lazy-rescale threshold, a named constant (kTau) in the kernel
oo = sp.oo
LAZY_TAU = 8  # log2 units: p <= 2^8 between rescales


class log2(sp.Function):
    """log base 2, kept whole so the kernels print log2f(x); proofs read it as log(x) / log(2)."""

    nargs = 1


@dataclass(frozen=True)
class OnlineSoftmaxRule:
    """The update expressions the kernels run, each a SymPy expression over the symbols above."""

    score: sp.Expr  # s as a function of qk (and indices), base 2
    keep: sp.Basic  # mask predicate over q, k (True: unmasked)
    m_new: sp.Expr
    m_use: sp.Expr
    alpha: sp.Expr
    p: sp.Expr
    l_new: sp.Expr
    acc_new: sp.Expr
    inv_l: sp.Expr
    out: sp.Expr
    lse: sp.Expr
    tau: int = 0
    raw_max: sp.Expr | None = None  # m_blk from m_raw, when the score is a·raw with a positive constant a
    p_from_qk: sp.Expr | None = None  # p straight from the raw value (named qk), for the same scores
    raw: sp.Expr | None = None  # the raw value u of qk (and indices, tensors) with score = a·u: qk, or qk + r

    @property
    def raw_transform(self) -> bool:
        """True where the kernels turn q.k into the raw value u before the block max (S = a u with u != q.k: a bias
        added to a positive multiple of q.k, ALiBi's); False for S = a q.k (u is q.k) or no raw max at all."""
        return self.raw is not None and self.raw != qk

    @property
    def acc_rescale(self) -> sp.Expr:
        """acc_new without the block's contribution: the kernels rescale, then accumulate Σ p·v."""
        return self.acc_new.xreplace({pv: 0})

    def concrete(self) -> OnlineSoftmaxRule:
        """The rule with its named constant tau at its value and log2(x) as log(x) / log(2): what the proofs
        and the executor take (the kernels print the named forms)."""

        def sub(e):
            if e is None or not isinstance(e, sp.Basic):
                return e
            return e.xreplace({lazy_tau: sp.Integer(self.tau)}).replace(log2, lambda x: sp.log(x) / sp.log(2))

        return OnlineSoftmaxRule(**{f: sub(getattr(self, f)) for f in self.__dataclass_fields__})


@functools.lru_cache(maxsize=64)  # fuse and the backward pass ask for the same rule
def make_rule(score_fn: sp.Expr, keep: sp.Basic, tau: int = LAZY_TAU) -> OnlineSoftmaxRule:
    """The rule for scores t = score_fn(s = scale · qk), masked by `keep`.

    In base 2: s2 = log2(e) · score_fn(qk · scale_log2 / log2(e)), which is qk · scale_log2 when
    score_fn is the identity — the multiplication by log2(e) is folded into the scale.
    """
    # expanded, so log2(e) cancels against the scale wherever the score is a sum (ALiBi: s + bias)
    score = sp.expand(kLog2e * score_fn.xreplace({exprs.SCORE: qk * scale_log2 / kLog2e}), deep=False)
    m_new_e = sp.Max(m_i, m_blk)
    if tau:
        m_new_e = sp.Piecewise((m_i, m_blk <= m_i + lazy_tau), (m_new_e, True))
    # affine in qk with a positive constant slope a: score = a·(qk + rest / a), the raw value u = qk + rest / a
    slope = sp.diff(score, qk)
    rest = score - slope * qk  # kept unexpanded where it cancels at once (ALiBi's (k - q) stays whole for the printer)
    if rest.has(qk):
        rest = sp.expand(rest)
    affine = (
        not slope.has(qk)
        and not rest.has(qk)
        and slope.is_positive is True
        and not (slope.free_symbols - {scale_log2, kLog2e})
    )
    raw = (qk if rest == 0 else qk + rest / slope) if affine else None
    p_e = 2 ** (s - m_use)
    return OnlineSoftmaxRule(
        score=score,
        keep=keep,
        tau=tau,
        raw=raw,
        raw_max=slope * m_raw if affine else None,
        p_from_qk=p_e.xreplace({s: slope * qk}) if affine else None,
        m_new=m_new_e,
        m_use=sp.Piecewise((0, sp.Eq(m_new, -oo)), (m_new, True)),
        alpha=2 ** (m_i - m_use),
        p=p_e,
        l_new=alpha * l_i + l_blk,
        acc_new=alpha * acc + pv,
        inv_l=sp.Piecewise((0, sp.Eq(l_i, 0)), (1 / l_i, True)),
        out=acc * inv_l,
        lse=sp.Piecewise((-oo, sp.Eq(l_i, 0)), ((m_i + log2(l_i)) / kLog2e, True)),
    )


# --- Proofs ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Identity:
    name: str
    statement: str


def _is_zero(e: sp.Expr) -> bool:
    if e == 0:
        return True
    e = sp.expand(sp.powsimp(sp.expand(e), force=True))
    if e == 0:
        return True
    e = sp.powsimp(sp.expand(sp.expand_power_exp(e)), force=True)
    if e == 0:
        return True
    rational = _in_powers_of_two(e)
    if rational is not None and sp.cancel(rational) == 0:
        return True
    return sp.simplify(e) == 0


def _in_powers_of_two(e: sp.Expr) -> sp.Expr | None:
    """`e` as a rational function of positive variables w_x = 2^x, one per symbol x in an exponent, when every
    power of two (and exp) in it has an exponent that is a sum of rational multiples of symbols; else None.

    The map 2^(c1 x1 + ... ) -> w_x1^c1 ... is a ring homomorphism on such expressions, so a rational function
    that cancels to 0 stands for an expression that is 0: an exact decision, cheaper than simplify."""
    e = e.replace(lambda x: isinstance(x, sp.exp), lambda x: 2 ** (x.args[0] / sp.log(2)))
    e = sp.expand(sp.expand_power_exp(e))
    w: dict = {}

    def monomial(exponent):
        out = sp.Integer(1)
        for term in sp.Add.make_args(sp.expand(exponent)):
            coeff, rest = term.as_coeff_Mul()
            if not (coeff.is_Rational and isinstance(rest, sp.Symbol)):
                raise ValueError(term)
            out *= w.setdefault(rest, sp.Symbol(f"w_{rest}", positive=True)) ** coeff
        return out

    try:
        return e.replace(
            lambda x: isinstance(x, sp.Pow) and x.base == 2 and not x.exp.is_Number,
            lambda x: monomial(x.exp),
        )
    except ValueError:
        return None


def _require(ok: bool, name: str, statement: str) -> Identity:
    if not ok:
        raise ProofError(f"proof failed: {name}: {statement} does not hold for this rule")
    return Identity(name, statement)


def _state_update(
    rule: OnlineSoftmaxRule, m_old, l_old, acc_old, m_other, l_other, acc_other
) -> tuple[sp.Expr, sp.Expr, sp.Expr]:
    """Combine a state with a second one (a key block's own sums at its max, or another partial state)."""
    mn = rule.m_new.xreplace({m_i: m_old, m_blk: m_other})
    mu = rule.m_use.xreplace({m_new: mn})
    a_old = rule.alpha.xreplace({m_i: m_old, m_use: mu})
    a_other = rule.alpha.xreplace({m_i: m_other, m_use: mu})
    l_new = rule.l_new.xreplace({alpha: a_old, l_i: l_old, l_blk: a_other * l_other})
    acc_new = rule.acc_new.xreplace({alpha: a_old, acc: acc_old, pv: a_other * acc_other})
    return mn, l_new, acc_new


def _fold_block(rule, state, scores, values):
    """Fold one key block into the running state the way the kernels do."""
    m_old, l_old, acc_old = state
    mb = sp.Max(*scores)
    mn = rule.m_new.xreplace({m_i: m_old, m_blk: mb})
    mu = rule.m_use.xreplace({m_new: mn})
    a = rule.alpha.xreplace({m_i: m_old, m_use: mu})
    ps = [rule.p.xreplace({s: x, m_use: mu}) for x in scores]
    l_new = rule.l_new.xreplace({alpha: a, l_i: l_old, l_blk: sp.Add(*ps)})
    acc_new = rule.acc_new.xreplace({alpha: a, acc: acc_old, pv: sp.Add(*[p * v for p, v in zip(ps, values)])})
    return mn, l_new, acc_new


_INIT = (-oo, sp.Integer(0), sp.Integer(0))


def _finish(rule, state):
    m_f, l_f, acc_f = state
    il = rule.inv_l.xreplace({l_i: l_f})
    return rule.out.xreplace({acc: acc_f, inv_l: il}), rule.lse.xreplace({m_i: m_f, l_i: l_f})


@functools.lru_cache(maxsize=64)
def prove_algebra(rule: OnlineSoftmaxRule) -> tuple[Identity, ...]:
    """(a), (b), (d): the state algebra, for any scores ((e), which reads the score, is prove's)."""
    proven = []
    x = sp.symbols("x1:5", real=True)  # base-2 scores of keys 1..4; key 5 is masked (-inf)
    v = sp.symbols("v1:6", real=True)  # one column of V
    state = _fold_block(rule, _INIT, x[:2], v[:2])
    state = _fold_block(rule, state, [x[2], x[3], -oo], v[2:])
    M = state[0]  # the state's reference: the max, or lagging it by < tau
    if rule.tau == 0:
        proven.append(
            _require(M == sp.Max(*x), "(a) running max", "two key blocks folded give m = max over their concatenation")
        )
    proven.append(
        _require(
            _is_zero(state[1] - sum(2 ** (xj - M) for xj in x)),
            "(a) row sum",
            "l = Σ_j 2^(s_j - m) over the unmasked keys of both blocks, m the state's reference",
        )
    )
    proven.append(
        _require(
            _is_zero(state[2] - sum(2 ** (xj - M) * vj for xj, vj in zip(x, v))),
            "(a) output",
            "acc = Σ_j 2^(s_j - m) v_j over the unmasked keys of both blocks",
        )
    )

    ms = sp.symbols("m1:4", real=True)
    ls = sp.symbols("l1:4", positive=True)
    accs = sp.symbols("acc1:4", real=True)
    S = list(zip(ms, ls, accs))

    def value(state):  # what a state stands for: l·2^m and acc·2^m (the reference m itself is free)
        return state[1] * 2 ** state[0], state[2] * 2 ** state[0]

    comm = [a - b for a, b in zip(value(_state_update(rule, *S[0], *S[1])), value(_state_update(rule, *S[1], *S[0])))]
    proven.append(_require(all(_is_zero(d) for d in comm), "(b) commutative", "merge(S1, S2) = merge(S2, S1)"))
    left = value(_state_update(rule, *_state_update(rule, *S[0], *S[1]), *S[2]))
    right = value(_state_update(rule, *S[0], *_state_update(rule, *S[1], *S[2])))
    proven.append(
        _require(
            all(_is_zero(a - b) for a, b in zip(left, right)),
            "(b) associative",
            "merge(merge(S1, S2), S3) = merge(S1, merge(S2, S3))",
        )
    )

    masked = _fold_block(rule, _fold_block(rule, _INIT, [-oo, -oo], v[:2]), [-oo], v[2:3])
    out, lse = _finish(rule, masked)
    ok = masked[1] == 0 and masked[2] == 0 and out == 0 and lse == -oo
    ok = ok and not any(e.has(sp.nan) for e in (*masked, out, lse))
    proven.append(_require(ok, "(d) fully masked row", "all keys masked give l = 0, O = 0, lse = -inf, no NaN"))
    return tuple(proven)


def _raw_max_holds(rule: OnlineSoftmaxRule) -> bool:
    """Check that the score is a·raw with a > 0 (raw_max = a·m_raw); that max_j a·u_j = raw_max(max_j u_j) for
    three raw values in every order (ties included: with u = y, y + d1, y + d1 + d2 (d >= 0) permuted, SymPy
    evaluates both maxima outright); and that p_from_qk(raw) = p(score)."""
    import itertools

    if rule.raw_max is None or rule.p_from_qk is None:
        return False
    a = sp.diff(rule.raw_max, m_raw)
    raw = qk if rule.raw is None else rule.raw
    if a.has(m_raw) or a.is_positive is not True or not _is_zero(rule.score - a * raw):
        return False
    if not _is_zero(rule.p_from_qk.xreplace({qk: raw}) - rule.p.xreplace({s: rule.score})):
        return False
    y = sp.Symbol("y", real=True)
    d1, d2 = sp.symbols("d1 d2", nonnegative=True)
    chain = (y, y + d1, y + d1 + d2)
    for order in itertools.permutations(chain):
        lhs = sp.Max(*[a * u for u in order])
        rhs = rule.raw_max.xreplace({m_raw: sp.Max(*order)})
        if not _is_zero(lhs - rhs):
            return False
    return True


def _element(chain: tuple[Node, ...], z):
    """The original graph's pointwise chain (scale and score functions) applied to one raw score z."""
    t = z
    for node in chain:
        if node.op is Op.SCALE:
            t = t * node.attr("factor")
        elif node.op is Op.SCORE_MOD:
            t = node.attr("fn").xreplace({exprs.SCORE: t})
    return t


_AT_LN2 = {kLog2e: 1 / sp.log(2)}


@functools.lru_cache(maxsize=64)
def prove_output(rule: OnlineSoftmaxRule) -> tuple[Identity, ...]:
    """(c), for any base-2 scores x_j: O = Σ 2^x_j v_j / Σ 2^x_j and exp(lse) = Σ 2^x_j."""
    x = sp.symbols("x1:5", real=True)
    v = sp.symbols("v1:6", real=True)
    state = _fold_block(rule, _fold_block(rule, _INIT, x[:2], v[:2]), [x[2], x[3], -oo], v[2:])
    out, lse = (e.xreplace(_AT_LN2) for e in _finish(rule, state))
    mu = sp.Symbol("mu", real=True)  # the running max cancels; name it to help SymPy
    out, lse = out.xreplace({state[0]: mu}), lse.xreplace({state[0]: mu})
    w = [2**xj for xj in x]
    ref_out = sum(wj * vj for wj, vj in zip(w, v)) / sum(w)
    return (
        _require(
            _is_zero(sp.together(out - ref_out)),
            "(c) output",
            "O = acc / l = Σ_j 2^(s_j) v_j / Σ_j 2^(s_j) over the unmasked keys (key 5 masked)",
        ),
        _require(
            _is_zero(sp.expand_log(sp.exp(lse), force=True) - sum(w)),
            "(c) log-sum-exp",
            "exp(lse) = Σ_j 2^(s_j) over the unmasked keys",
        ),
    )


@functools.lru_cache(maxsize=64)
def prove_graph(rule: OnlineSoftmaxRule, chain: tuple[Node, ...], scale_default: sp.Expr) -> tuple[Identity, ...]:
    """(c), the link to the original graph: 2^(s) = exp(t) for each key, t the graph's score of q·k.

    With prove_output this gives O = softmax(t) V and lse = log Σ exp(t): the original graph's values.
    """
    z = sp.Symbol("z", real=True)  # a raw dot product q · k
    s2 = rule.score.xreplace({qk: z}).xreplace({**_AT_LN2, scale_log2: scale_default / sp.log(2)})
    t = _element(chain, z)
    return (
        _require(
            _is_zero(sp.log(2) * s2 - t),
            "(c) scores",
            "2^(s) = exp(t): the kernel's base-2 score (log2(e) folded into the scale) is the graph's "
            "score function of scale * q.k",
        ),
    )


_FRESH = [False]


@contextlib.contextmanager
def fresh_proofs():
    """Prove every identity afresh inside this block, ignoring the proof memo (what `fagen ir` shows)."""
    _FRESH.append(True)
    try:
        yield
    finally:
        _FRESH.pop()


def _state_only(rule: OnlineSoftmaxRule) -> OnlineSoftmaxRule:
    """`rule` without its score and mask: what the state algebra (a), (b), (d) and (c)'s output half read."""
    return dataclasses.replace(rule, score=qk, keep=sp.true, raw_max=None, p_from_qk=None, raw=None)


def prove_state(rule: OnlineSoftmaxRule) -> tuple[Identity, ...]:
    """(a), (b), (d) and (c)'s output half, which read only the state update; from the proof memo when these
    very expressions were proven before (fagen.math.memo), unless inside fresh_proofs()."""
    state = _state_only(rule)

    def run():
        return [(i.name, i.statement) for i in prove_algebra(state) + prove_output(state)]

    if _FRESH[-1]:
        return tuple(Identity(n, st) for n, st in run())
    fields = tuple(sp.srepr(getattr(state, f)) for f in state.__dataclass_fields__)
    return tuple(Identity(n, st) for n, st in memo.proof_memo(fields, run))


def prove(rule: OnlineSoftmaxRule, chain: tuple[Node, ...], scale_default: sp.Expr) -> tuple[Identity, ...]:
    """Every identity the rewrite relies on; raises ProofError at the first that fails."""
    rule = rule.concrete()
    state = prove_state(rule)
    algebra = tuple(i for i in state if not i.name.startswith("(c)"))
    raw: tuple[Identity, ...] = ()
    if rule.raw_max is not None:
        raw = (
            _require(
                _raw_max_holds(rule),
                "(e) max of raw scores",
                "S = a·raw(qk), a > 0: max_j S_j = a·max_j raw_j, and p from raw is p from S: the block max may be "
                "taken over the raw values",
            ),
        )
    return algebra + raw + tuple(i for i in state if i.name.startswith("(c)")) + prove_graph(rule, chain, scale_default)


# --- Split-KV: merging the partial states of key splits ------------------------------------------------------
# A split of the keys leaves its own state (m, l, acc) — base-2 reference, row sum, unnormalized output —
# and the combine merges them. The merge, as expressions over the two states a and b:
#     m   = max(m_a, m_b)
#     m_u = m_use(m)                          0 where both splits are empty (m = -inf): no -inf - (-inf)
#     w_a = 2^(m_a - m_u),  w_b = 2^(m_b - m_u)
#     l   = w_a · l_a + w_b · l_b,   acc = w_a · acc_a + w_b · acc_b
# An empty split (no key, or every key masked) has m = -inf, l = 0, acc = 0: its weight is 2^(-inf) = 0.
m_a, m_b, m_x = (sp.Symbol(n, extended_real=True) for n in ("m_a", "m_b", "m_x"))
l_a, l_b = (sp.Symbol(n, nonnegative=True) for n in ("l_a", "l_b"))
acc_a, acc_b = (sp.Symbol(n, **_R) for n in ("acc_a", "acc_b"))
w_a, w_b = (sp.Symbol(n, nonnegative=True) for n in ("w_a", "w_b"))


@dataclass(frozen=True)
class MergeRule:
    """The merge of two partial states, each piece a SymPy expression the kernels print (`rule::merge_*`)."""

    m: sp.Expr  # over m_a, m_b
    m_use: sp.Expr  # over m_new
    w: sp.Expr  # over m_x (a state's reference) and m_use
    l_sum: sp.Expr  # over w_a, l_a, w_b, l_b
    acc: sp.Expr  # over w_a, acc_a, w_b, acc_b

    def apply(self, a, b):
        """merge(a, b) for states a = (m, l, acc) and b, as expressions."""
        m_new_ = self.m.xreplace({m_a: a[0], m_b: b[0]})
        mu = self.m_use.xreplace({m_new: m_new_})
        wa = self.w.xreplace({m_x: a[0], m_use: mu})
        wb = self.w.xreplace({m_x: b[0], m_use: mu})
        return (
            m_new_,
            self.l_sum.xreplace({w_a: wa, l_a: a[1], w_b: wb, l_b: b[1]}),
            self.acc.xreplace({w_a: wa, acc_a: a[2], w_b: wb, acc_b: b[2]}),
        )


def make_merge(rule: OnlineSoftmaxRule) -> MergeRule:
    """The merge for `rule`: its own m_use and alpha (2^(m_x - m_use)), the exact max (no lazy threshold: a
    merge happens once per split, not per key block)."""
    return MergeRule(
        m=sp.Max(m_a, m_b),
        m_use=rule.m_use,
        w=rule.alpha.xreplace({m_i: m_x}),
        l_sum=w_a * l_a + w_b * l_b,
        acc=w_a * acc_a + w_b * acc_b,
    )


EMPTY = _INIT  # the state of a split that saw no visible key


@functools.lru_cache(maxsize=64)
def prove_merge(rule: OnlineSoftmaxRule, merge: MergeRule | None = None) -> tuple[Identity, ...]:
    """(f) the split-KV merge: it stands for the same values as the state update (b) checks, so it is
    commutative and associative; an empty split drops out exactly (no NaN); two empty splits stay empty, and
    finish to O = 0, lse = -inf."""
    rule = rule.concrete()
    merge = merge or make_merge(rule)
    ms = sp.symbols("m1:4", real=True)
    ls = sp.symbols("l1:4", positive=True)
    accs = sp.symbols("acc1:4", real=True)
    S = list(zip(ms, ls, accs))

    def value(state):
        return state[1] * 2 ** state[0], state[2] * 2 ** state[0]

    def same_values(x, y):
        return all(_is_zero(p - q) for p, q in zip(value(x), value(y)))

    proven = [
        _require(
            same_values(merge.apply(S[0], S[1]), _state_update(rule, *S[0], *S[1])),
            "(f) merge is the state update",
            "merge(S1, S2) stands for the values l·2^m, acc·2^m of the state update (b) checks",
        ),
        _require(
            same_values(merge.apply(S[0], S[1]), merge.apply(S[1], S[0])),
            "(f) merge commutative",
            "merge(S1, S2) = merge(S2, S1)",
        ),
        _require(
            same_values(merge.apply(merge.apply(S[0], S[1]), S[2]), merge.apply(S[0], merge.apply(S[1], S[2]))),
            "(f) merge associative",
            "merge(merge(S1, S2), S3) = merge(S1, merge(S2, S3)): splits merge in any order and grouping",
        ),
    ]
    dropped = [merge.apply(S[0], EMPTY), merge.apply(EMPTY, S[0])]
    ok = all(all(_is_zero(x - y) for x, y in zip(d, S[0])) for d in dropped)
    ok = ok and not any(e.has(sp.nan) for d in dropped for e in d)
    proven.append(_require(ok, "(f) empty split", "merge(S, E) = merge(E, S) = S exactly, E = (-inf, 0, 0): no NaN"))
    both = merge.apply(EMPTY, EMPTY)
    out, lse = _finish(rule, both)
    ok = tuple(both) == EMPTY and out == 0 and lse == -oo and not any(e.has(sp.nan) for e in (*both, out, lse))
    proven.append(_require(ok, "(f) all splits empty", "merge(E, E) = E, which finishes to O = 0, lse = -inf"))
    return tuple(proven)
