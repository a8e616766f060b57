"""Key ranges derived from the mask: which keys a tile of queries can see at all, and which it sees whole.

The mask is put in disjunctive normal form; each conjunction ("term") whose comparisons are affine in the
key index k (unit coefficient) and the query index q bounds k from above or below by an affine function of
q. Over a query tile q ∈ [q_lo, q_hi] such a function is extreme at an end of the tile, so a term's visible
keys lie in [begin, end) with

    end   = min over upper bounds U(q) of  U(q at its largest) + 1
    begin = max over lower bounds L(q) of  L(q at its smallest)

and the keys every query of the tile sees lie in [full_begin, full_end), the extremes taken the other way
round. The kernels loop over the hull of the terms' visible ranges and evaluate the mask only on key tiles
that lie in no term's fully visible range. Comparisons of any other form only widen a term's visible range
(still correct) and leave it no fully visible keys. `prove` checks both claims with SymPy for each term.

At a tile of one query (q_lo = q_hi = q) an exact term's two ranges coincide, so that its range there holds
exactly the keys query q sees by the term (one_query; transposed, one_key); `prove` checks that too, and the
Hopper kernels test a masked tile's elements against those ranges in place of the mask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import sympy as sp

from ..ir import exprs

q = exprs.INDICES["q"]
k = exprs.INDICES["k"]
q_lo = exprs.TILE["q_lo"]
q_hi = exprs.TILE["q_hi"]


class BoundsError(ValueError):
    pass


@dataclass(frozen=True)
class Bound:
    """One affine comparison of a term, as a bound on k over a query tile."""

    kind: str  # "upper" (k <= U(q)) or "lower" (k >= L(q))
    conjunct: sp.Basic  # the comparison itself
    visible: sp.Expr  # upper: keys from here on are masked; lower: keys before here are masked
    full: sp.Expr  # upper: keys before here are kept; lower: keys from here on are kept


@dataclass(frozen=True)
class Term:
    """One conjunction of the mask: visible keys [max(0, *begins), min(N, *ends)); fully visible ones
    [max(0, *full_begins), min(N, *full_ends)) when `exact` (every comparison affine)."""

    bounds: tuple[Bound, ...]
    exact: bool = True
    conjuncts: tuple = ()

    def _pick(self, kind, field):
        return tuple(dict.fromkeys(getattr(b, field) for b in self.bounds if b.kind == kind))

    @property
    def begins(self):
        return self._pick("lower", "visible")

    @property
    def ends(self):
        return self._pick("upper", "visible")

    @property
    def full_begins(self):
        return self._pick("lower", "full") if self.exact else ()

    @property
    def full_ends(self):
        return self._pick("upper", "full") if self.exact else ()


@dataclass(frozen=True)
class KeyRange:
    terms: tuple[Term, ...]  # empty: no mask (every key visible, none masked)

    @property
    def masked(self) -> bool:
        return bool(self.terms)


def _bound(rel):
    """A comparison as ('upper'|'lower', affine expression of q), or None if not of the supported form."""
    if isinstance(rel, (sp.Le, sp.Lt)):
        e = rel.lhs - rel.rhs  # e <= 0  (or < 0)
    elif isinstance(rel, (sp.Ge, sp.Gt)):
        e = rel.rhs - rel.lhs
    else:
        return None
    e = sp.expand(e)
    if e.atoms(sp.Indexed) or e.free_symbols - {k, q, exprs.DIMS["M"], exprs.DIMS["N"]}:
        return None
    # e <= 0 in integer coefficients (k/50 - q/50 + 1 <= 0 as k - q + 50 <= 0): exact fractions for float
    # constants, then times the positive LCM of the denominators
    e = e.xreplace({f: sp.Rational(float(f)) for f in e.atoms(sp.Float)})
    dens = [t.as_coeff_Mul()[0].q for t in sp.Add.make_args(e) if t.as_coeff_Mul()[0].is_Rational]
    e = sp.expand(e * math.lcm(*dens)) if dens else e
    if isinstance(rel, (sp.Lt, sp.Gt)):
        e = e + 1  # integers: e < 0  <=>  e + 1 <= 0
    a = e.coeff(k)
    rest = sp.expand(e - a * k)
    if (
        a not in (1, -1)
        or rest.has(k)
        or not rest.is_polynomial(q)
        or sp.degree(rest, q) > 1
        or not all(c.is_Integer for c in sp.Poly(rest, q, exprs.DIMS["M"], exprs.DIMS["N"]).coeffs())
    ):
        return None
    lo, hi = exprs.int_range(rest)
    if max(abs(lo), abs(hi)) > exprs.MAX_INDEX_CONSTANT + 2 * exprs.INDEX_MAX:  # near 64 bits: widen instead
        return None
    return ("upper", -rest) if a == 1 else ("lower", rest)


def _term(conjuncts) -> Term:
    out, exact = [], True
    for c in conjuncts:
        if c == sp.true:
            continue
        if c == sp.false:  # nothing visible; nothing to keep
            out.append(Bound("upper", c, sp.Integer(0), sp.Integer(0)))
            continue
        b = _bound(c)
        if b is None:
            exact = False
            continue
        kind, f = b
        up, down = (q_hi, q_lo) if f.coeff(q) >= 0 else (q_lo, q_hi)
        if kind == "upper":
            out.append(Bound("upper", c, sp.expand(f.xreplace({q: up}) + 1), sp.expand(f.xreplace({q: down}) + 1)))
        else:
            out.append(Bound("lower", c, sp.expand(f.xreplace({q: down})), sp.expand(f.xreplace({q: up}))))
    return Term(tuple(out), exact, tuple(conjuncts))


MAX_TERMS = 8


def key_range(keep: sp.Basic) -> KeyRange:
    if keep == sp.true:
        return KeyRange(())
    if keep == sp.false:
        return KeyRange((Term((Bound("upper", sp.false, sp.Integer(0), sp.Integer(0)),), True, (sp.false,)),))
    dnf = sp.to_dnf(keep, simplify=False)
    terms = dnf.args if isinstance(dnf, sp.Or) else (dnf,)
    if len(terms) > MAX_TERMS:  # too many to emit: one term with no bounds (mask everywhere)
        return KeyRange((Term((), False, ()),))
    return KeyRange(tuple(_term(t.args if isinstance(t, sp.And) else (t,)) for t in terms))


# --- proofs ----------------------------------------------------------------------------------------------
def _decide(rel) -> sp.Basic:
    """A condition's truth value: SymPy often settles a comparison of integers with sign assumptions when it
    builds it; simplify (slower: its first call imports much of SymPy) only where it did not."""
    return rel if rel in (sp.true, sp.false) else sp.simplify(rel)


def check_bound(bound: Bound) -> None:
    """Prove, for every query q = q_lo + a of a tile [q_lo, q_hi = q_lo + a + b], that the comparison masks every
    key past `visible` (before it, for a lower bound) and keeps every key short of `full` (from it on)."""
    a, b, c = (sp.Symbol(n, integer=True, nonnegative=True) for n in "abc")
    tile = {q_hi: q_lo + a + b}
    at_q = {q: q_lo + a}
    visible, full = bound.visible.xreplace(tile), bound.full.xreplace(tile)
    if bound.kind == "upper":
        outside, inside = visible + c, full - 1 - c
    else:
        outside, inside = visible - 1 - c, full + c
    if _decide(bound.conjunct.xreplace({k: outside}).xreplace(at_q)) != sp.false:
        raise BoundsError(
            f"cannot prove that {exprs.to_text(bound.conjunct)} masks every key "
            f"{'from' if bound.kind == 'upper' else 'before'} {exprs.to_text(bound.visible)}"
        )
    if bound.conjunct != sp.false and _decide(bound.conjunct.xreplace({k: inside}).xreplace(at_q)) != sp.true:
        raise BoundsError(
            f"cannot prove that {exprs.to_text(bound.conjunct)} keeps every key "
            f"{'before' if bound.kind == 'upper' else 'from'} {exprs.to_text(bound.full)}"
        )


_ONE_QUERY = {q_lo: q, q_hi: q}  # a query tile of one query, q


def _at(term: Term, tile: dict) -> tuple[tuple[sp.Expr, ...], tuple[sp.Expr, ...]]:
    return tuple(e.xreplace(tile) for e in term.begins), tuple(e.xreplace(tile) for e in term.ends)


def one_query(term: Term) -> tuple[tuple[sp.Expr, ...], tuple[sp.Expr, ...]]:
    """A term's (begins, ends) for the query tile [q, q]: functions of q (and seqlen_q, seqlen_k). For an exact term
    they bound exactly the keys query q sees (`prove` proves it)."""
    return _at(term, _ONE_QUERY)


def _prove_one_row(term: Term, n: int, one: dict, row: str, what: str) -> str:
    """At a tile of one row (`one`) an exact term's visible and full ranges coincide: with check_bound's two claims,
    the range is then exactly the term's. The statement proven."""
    for b in term.bounds:
        if sp.expand((b.visible - b.full).xreplace(one)) != 0:
            raise BoundsError(
                f"cannot prove that {exprs.to_text(b.conjunct)} bounds exactly the {what}: "
                f"{exprs.to_text(b.visible)} and {exprs.to_text(b.full)} differ at a tile of one {row}"
            )
    begins, ends = _at(term, one)
    extent = "M" if row == "key" else "N"  # the rows seen: queries (M) by a key, keys (N) by a query
    lo = f"max(0, {', '.join(map(exprs.to_text, begins))})" if begins else "0"
    hi = f"min({extent}, {', '.join(map(exprs.to_text, ends))})" if ends else extent
    return f"term {n} ({'transposed, ' if row == 'key' else ''}one {row}): [{lo}, {hi}) are the {what} by this term"


def prove(keep: sp.Basic, rng: KeyRange) -> list[str]:
    """Check every bound the kernels will use (check_bound), and that the terms are the mask's: the mask
    is the disjunction of the terms' conjunctions. Returns the statements proven; raises BoundsError."""
    if rng.terms and not (len(rng.terms) == 1 and not rng.terms[0].conjuncts):
        terms = sp.Or(*[sp.And(*t.conjuncts) for t in rng.terms])
        if not (terms == keep or sp.to_dnf(keep, simplify=False) == terms):
            raise BoundsError(f"the terms {exprs.to_text(terms)} are not the mask {exprs.to_text(keep)}")
    proven = []
    for n, term in enumerate(rng.terms, 1):
        for bound in term.bounds:
            check_bound(bound)
            v, f = exprs.to_text(bound.visible), exprs.to_text(bound.full)
            what = (
                f"masks every key from {v} on and keeps every key before {f}"
                if bound.kind == "upper"
                else f"masks every key before {v} and keeps every key from {f} on"
            )
            proven.append(f"term {n}: {exprs.to_text(bound.conjunct)} {what}, for every query of the tile")
        if term.exact:
            proven.append(_prove_one_row(term, n, _ONE_QUERY, "query", "keys query q sees"))
    return proven


# --- transposed: the query tiles that can see a key tile (the backward) -------------------------------------
# The backward's blocks own a key tile [k_lo, k_hi] and loop over query tiles. The same analysis gives their
# range with the roles of q and k exchanged: in the mask with q and k swapped, "the keys a query tile can see"
# reads "the queries that can see a key tile". A comparison affine in q with unit coefficient (k <= q, the
# causal mask; q <= k + W, a window) bounds the visible queries; any other only widens a term's range.
k_lo = sp.Symbol("k_lo", integer=True, nonnegative=True)
k_hi = sp.Symbol("k_hi", integer=True, nonnegative=True)
_EXCHANGE = {q: k, k: q}
_TILES = {q_lo: k_lo, q_hi: k_hi, k_lo: q_lo, k_hi: q_hi}


def _transpose(rng: KeyRange) -> KeyRange:
    """Exchange the roles of q and k in a range: conjuncts q <-> k, tile ends q_lo <-> k_lo, q_hi <-> k_hi (its own
    inverse)."""

    def bound(b: Bound) -> Bound:
        return Bound(b.kind, b.conjunct.xreplace(_EXCHANGE), b.visible.xreplace(_TILES), b.full.xreplace(_TILES))

    return KeyRange(
        tuple(
            Term(tuple(bound(b) for b in t.bounds), t.exact, tuple(c.xreplace(_EXCHANGE) for c in t.conjuncts))
            for t in rng.terms
        )
    )


def query_range(keep: sp.Basic) -> KeyRange:
    """The queries that can see a key tile [k_lo, k_hi]: terms whose bounds are functions of k_lo, k_hi (and
    seqlen_q, seqlen_k), bounding q; the conjuncts are the mask's own. begins/ends: the visible queries'
    range; full_begins/full_ends: the queries that see every key of the tile."""
    return _transpose(key_range(keep.xreplace(_EXCHANGE)))


_ONE_KEY = {k_lo: k, k_hi: k}  # a key tile of one key, k


def one_key(term: Term) -> tuple[tuple[sp.Expr, ...], tuple[sp.Expr, ...]]:
    """A transposed term's (begins, ends) for the key tile [k, k]: functions of k (and seqlen_q, seqlen_k). For an
    exact term they bound exactly the queries that see key k (prove_query_range proves it)."""
    return _at(term, _ONE_KEY)


def prove_query_range(keep: sp.Basic, rng: KeyRange) -> list[str]:
    """Prove the transposed range: `prove` on the mask with q and k exchanged, which checks that every bound
    hides from the key tile every query past it (visible) and shows it every key of the tile (full), and that the
    terms are the mask's. For an exact term it also proves that at a tile of one key the two coincide, so that the
    term's range at key k holds exactly the queries that see k (one_key). Returns the statements proven; raises
    BoundsError."""
    prove(keep.xreplace(_EXCHANGE), _transpose(rng))
    proven = []
    for n, term in enumerate(rng.terms, 1):
        if term.exact:
            proven.append(_prove_one_row(term, n, _ONE_KEY, "key", "queries that see key k"))
        for b in term.bounds:
            v, f = exprs.to_text(b.visible), exprs.to_text(b.full)
            what = (
                f"no query from {v} on sees a key of the tile, and every query before {f} sees all of them"
                if b.kind == "upper"
                else f"no query before {v} sees a key of the tile, and every query from {f} on sees all of them"
            )
            proven.append(
                f"term {n} (transposed): {exprs.to_text(b.conjunct)}: {what}, for every key tile [k_lo, k_hi]"
            )
    return proven
