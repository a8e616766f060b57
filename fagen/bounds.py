"""Key ranges derived from the mask: which keys a tile of queries can see at all.

For a mask that is a conjunction of comparisons affine in the key index k (with unit coefficient) and in
the query index q — causal, sliding windows, prefix-LM and their combinations — each comparison bounds k
from above or below by an affine function of q. Over a query tile q ∈ [q_lo, q_hi] such a function is
extreme at an end of the tile, so the keys any query of the tile can see lie in [begin, end) with

    end   = min over upper bounds U(q) of  U(q at its largest) + 1
    begin = max over lower bounds L(q) of  L(q at its smallest)

Conjuncts of any other form are left out of the range (which only widens it: still correct, and the
kernel evaluates the whole mask per element anyway). Likewise the keys that *every* query of the tile sees
lie in [full_begin, full_end), with the extremes taken the other way round; on key tiles inside it the kernels
skip the mask. With a conjunct of another form, no key is known to be fully visible.
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy as sp

from . import exprs

q = exprs.INDICES["q"]
k = exprs.INDICES["k"]
q_lo = sp.Symbol("q_lo", integer=True, nonnegative=True)
q_hi = sp.Symbol("q_hi", integer=True, nonnegative=True)


@dataclass(frozen=True)
class KeyRange:
    """Keys a query tile [q_lo, q_hi] can see, and keys every query of it sees (no mask needed there)."""
    begins: tuple[sp.Expr, ...]        # visible keys start at max(0, *begins)
    ends: tuple[sp.Expr, ...]          # and end before min(N, *ends)
    full_begins: tuple[sp.Expr, ...] = ()   # keys seen by every query start at max(0, *full_begins)
    full_ends: tuple[sp.Expr, ...] = ()     # and end before min(N, *full_ends)
    exact: bool = True                 # False: some conjunct is not affine; no key is known fully visible


def _bound(rel):
    """A comparison as ('upper'|'lower', affine expression of q), or None if not of the supported form."""
    if isinstance(rel, (sp.Le, sp.Lt)):
        e = rel.lhs - rel.rhs                 # e <= 0  (or < 0)
    elif isinstance(rel, (sp.Ge, sp.Gt)):
        e = rel.rhs - rel.lhs
    else:
        return None
    if isinstance(rel, (sp.Lt, sp.Gt)):
        e = e + 1                             # integers: e < 0  <=>  e + 1 <= 0
    e = sp.expand(e)
    a = e.coeff(k)
    rest = sp.expand(e - a * k)
    if a not in (1, -1) or rest.has(k) or not rest.is_polynomial(q) or sp.degree(rest, q) > 1:
        return None
    if not rest.coeff(q).is_Integer:
        return None
    return ("upper", -rest) if a == 1 else ("lower", rest)


def key_range(keep: sp.Basic) -> KeyRange:
    """Visible: an upper bound U(q) at its largest over the tile, a lower bound at its smallest.
    Fully visible (every query of the tile sees the key): U at its smallest, L at its largest."""
    if keep == sp.true:
        return KeyRange((), ())
    conjuncts = keep.args if isinstance(keep, sp.And) else (keep,)
    begins, ends, full_begins, full_ends, exact = [], [], [], [], True
    for c in conjuncts:
        b = _bound(c)
        if b is None:
            exact = False
            continue
        kind, f = b
        up, down = (q_hi, q_lo) if f.coeff(q) >= 0 else (q_lo, q_hi)
        if kind == "upper":
            ends.append(sp.expand(f.xreplace({q: up}) + 1))
            full_ends.append(sp.expand(f.xreplace({q: down}) + 1))
        else:
            begins.append(sp.expand(f.xreplace({q: down})))
            full_begins.append(sp.expand(f.xreplace({q: up})))
    if not exact:
        full_begins, full_ends = [], []
    return KeyRange(tuple(begins), tuple(ends), tuple(full_begins), tuple(full_ends), exact)
