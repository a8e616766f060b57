"""Key ranges derived from masks: checked against brute force on random tile grids, and proven."""

import numpy as np
import pytest
import sympy as sp

from fagen.ir import exprs
from fagen.ir.exprs import parse_expr
from fagen.math import bounds
from fagen.tools import executor

MASKS = [
    "k <= q",
    "k <= q + N - M",
    "(k <= q) and (q - k <= 255)",
    "(k <= q + 3) and (k >= q - 7)",
    "(k < 16) or (k <= q)",
    "k >= q",
    "abs(q - k) <= 5",
    "True",
    "(k < 100) or (k >= q + 40)",
    "((k < 8) or (k <= q)) and (q - k <= 64)",
    "(k % 3 == 0) and (k <= q)",
    "k <= 2 * q",
]


def _eval_term(term, env):
    begin = max([0] + [int(b.xreplace(env)) for b in term.begins])
    end = min([env[exprs.DIMS["N"]]] + [int(e.xreplace(env)) for e in term.ends])
    if not term.exact:
        return begin, end, 0, 0
    fb = max([0] + [int(b.xreplace(env)) for b in term.full_begins])
    fe = min([env[exprs.DIMS["N"]]] + [int(e.xreplace(env)) for e in term.full_ends])
    return begin, end, fb, fe


def check_against_brute_force(keep, trials=60, gen=None):
    rng = bounds.key_range(keep)
    gen = gen or np.random.default_rng(11)
    for _ in range(trials):
        M, N = (int(x) for x in gen.integers(1, 300, 2))
        tile = int(gen.choice([1, 16, 64]))
        q_lo = int(gen.integers(0, M))
        q_hi = min(M, q_lo + tile) - 1
        env = {bounds.q_lo: q_lo, bounds.q_hi: q_hi, exprs.DIMS["M"]: M, exprs.DIMS["N"]: N}
        values = {
            exprs.INDICES["q"]: np.arange(q_lo, q_hi + 1)[:, None],
            exprs.INDICES["k"]: np.arange(N)[None, :],
            exprs.DIMS["M"]: M,
            exprs.DIMS["N"]: N,
        }
        visible = np.broadcast_to(executor._evaluate(keep, values), (q_hi - q_lo + 1, N))
        if not rng.masked:
            assert visible.all()
            continue
        hull = np.zeros(N, bool)
        for term in rng.terms:
            begin, end, fb, fe = _eval_term(term, env)
            if begin < end:
                hull[begin:end] = True
            if fb < fe:  # every query of the tile sees every key of a fully visible range
                assert visible[:, fb:fe].all(), ("full", keep, M, N, q_lo, q_hi, fb, fe)
        assert not visible[:, ~hull].any(), (keep, M, N, q_lo, q_hi)


@pytest.mark.parametrize("text", MASKS)
def test_derived_ranges_hold_on_random_tiles(text):
    keep = parse_expr(text, exprs.MASK_NAMES)
    check_against_brute_force(keep)
    bounds.prove(keep, bounds.key_range(keep))


def _random_affine_mask(gen):
    q, k = exprs.INDICES["q"], exprs.INDICES["k"]
    M, N = exprs.DIMS["M"], exprs.DIMS["N"]

    def comparison():
        a = int(gen.choice([-1, 1]))
        c = int(gen.integers(-50, 50))
        slope = int(gen.choice([0, 1, 1, -1]))
        rhs = slope * q + c + int(gen.choice([0, 1])) * (N - M)
        rel = gen.choice([sp.Le, sp.Lt, sp.Ge, sp.Gt])
        return rel(a * k, a * rhs) if a == 1 else rel(k, rhs)

    terms = [sp.And(*[comparison() for _ in range(int(gen.integers(1, 4)))]) for _ in range(int(gen.integers(1, 3)))]
    return sp.Or(*terms)


def test_random_affine_masks():
    gen = np.random.default_rng(1007)
    for _ in range(25):
        keep = _random_affine_mask(gen)
        check_against_brute_force(keep, trials=15, gen=gen)
        bounds.prove(keep, bounds.key_range(keep))


def test_causal_range_is_tight():
    (t,) = bounds.key_range(parse_expr("k <= q", exprs.MASK_NAMES)).terms
    assert t.begins == () and t.ends == (bounds.q_hi + 1,)
    assert t.full_begins == () and t.full_ends == (bounds.q_lo + 1,)
    (t,) = bounds.key_range(parse_expr("(k <= q) and (q - k <= 255)", exprs.MASK_NAMES)).terms
    assert t.begins == (bounds.q_lo - 255,) and t.ends == (bounds.q_hi + 1,)
    assert t.full_begins == (bounds.q_hi - 255,) and t.full_ends == (bounds.q_lo + 1,)


def test_prefix_lm_has_two_terms():
    rng = bounds.key_range(parse_expr("(k < 128) or (k <= q)", exprs.MASK_NAMES))
    assert len(rng.terms) == 2 and all(t.exact for t in rng.terms)
    assert {t.ends for t in rng.terms} == {(128,), (bounds.q_hi + 1,)}


def test_unsupported_forms():
    assert not bounds.key_range(sp.true).masked
    (t,) = bounds.key_range(parse_expr("(k % 2 == 0) and (k <= q)", exprs.MASK_NAMES)).terms
    assert not t.exact and t.ends == (bounds.q_hi + 1,) and t.full_ends == ()


@pytest.mark.parametrize("field, value", [("visible", bounds.q_hi), ("full", bounds.q_hi + 1)])
def test_a_wrong_bound_is_not_proven(field, value):
    """An end one key too early, or a fully visible range reaching past the diagonal, must fail the proof."""
    import dataclasses

    keep = parse_expr("k <= q", exprs.MASK_NAMES)
    (t,) = bounds.key_range(keep).terms
    (b,) = t.bounds
    with pytest.raises(bounds.BoundsError):
        bounds.check_bound(dataclasses.replace(b, **{field: value}))
