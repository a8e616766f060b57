"""Key ranges derived from masks, checked against brute force over random tiles."""
import numpy as np
import pytest
import sympy as sp

from fagen import bounds, exprs, executor
from fagen.exprs import parse_expr

MASKS = ["k <= q", "k <= q + N - M", "(k <= q) and (q - k <= 255)", "(k <= q + 3) and (k >= q - 7)",
         "(k < 16) or (k <= q)", "k >= q", "abs(q - k) <= 5", "True"]


def _range(rng, q_lo, q_hi, M, N, full=False):
    env = {bounds.q_lo: q_lo, bounds.q_hi: q_hi, exprs.DIMS["M"]: M, exprs.DIMS["N"]: N}
    begins, ends = (rng.full_begins, rng.full_ends) if full else (rng.begins, rng.ends)
    if full and not rng.exact:
        return 0, 0
    begin = max([0] + [int(b.xreplace(env)) for b in begins])
    end = min([N] + [int(e.xreplace(env)) for e in ends])
    return begin, end


@pytest.mark.parametrize("text", MASKS)
def test_no_visible_key_outside_the_derived_range(text):
    keep = parse_expr(text, exprs.MASK_NAMES)
    rng = bounds.key_range(keep)
    gen = np.random.default_rng()
    for _ in range(40):
        M, N = (int(x) for x in gen.integers(1, 300, 2))
        tile = int(gen.choice([1, 16, 64]))
        q_lo = int(gen.integers(0, M))
        q_hi = min(M, q_lo + tile) - 1
        begin, end = _range(rng, q_lo, q_hi, M, N)
        values = {exprs.INDICES["q"]: np.arange(q_lo, q_hi + 1)[:, None], exprs.INDICES["k"]: np.arange(N)[None, :],
                  exprs.DIMS["M"]: M, exprs.DIMS["N"]: N}
        visible = np.broadcast_to(executor._evaluate(keep, values), (q_hi - q_lo + 1, N))
        outside = np.ones(N, bool)
        outside[max(begin, 0):max(end, 0)] = False
        assert not visible[:, outside].any(), (text, M, N, q_lo, q_hi, begin, end)
        f_begin, f_end = _range(rng, q_lo, q_hi, M, N, full=True)
        if f_begin < f_end:
            assert visible[:, f_begin:f_end].all(), ("full", text, M, N, q_lo, q_hi, f_begin, f_end)


def test_causal_range_is_tight():
    rng = bounds.key_range(parse_expr("k <= q", exprs.MASK_NAMES))
    assert rng.begins == () and rng.ends == (bounds.q_hi + 1,)
    assert rng.full_begins == () and rng.full_ends == (bounds.q_lo + 1,)
    rng = bounds.key_range(parse_expr("(k <= q) and (q - k <= 255)", exprs.MASK_NAMES))
    assert rng.begins == (bounds.q_lo - 255,) and rng.ends == (bounds.q_hi + 1,)
    assert rng.full_begins == (bounds.q_hi - 255,) and rng.full_ends == (bounds.q_lo + 1,)


def test_unsupported_forms_give_the_full_range():
    assert bounds.key_range(parse_expr("(k <= q) or (k < 16)", exprs.MASK_NAMES)) == bounds.KeyRange(
        (), (), (), (), exact=False)
    assert bounds.key_range(sp.true) == bounds.KeyRange((), ())
