"""The NumPy executor, the oracle: plain and fused programs against an independent naive attention."""

import numpy as np
import pytest

from fagen import resources
from fagen.ir import parse_program
from fagen.passes import fuse
from fagen.tools import executor

PROGRAMS = {name: parse_program(path.read_text()) for name, path in resources.shipped_programs().items()}


def naive_attention(q, k, v, scale, keep):
    """softmax(scale · q kᵀ) v written out with NumPy; rows with no visible key give 0 and lse -inf."""
    s = scale * np.einsum("bhmd,bhnd->bhmn", q, k)
    s = np.where(keep, s, -np.inf)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    total = e.sum(-1, keepdims=True)
    o = np.einsum("bhmn,bhnd->bhmd", e / np.where(total > 0, total, 1.0), v)
    with np.errstate(divide="ignore"):
        lse = np.log(total[..., 0]) + m[..., 0]
    return o, lse


KEEP = {
    "full": lambda M, N: np.ones((M, N), bool),
    "causal": lambda M, N: np.arange(N)[None, :] <= np.arange(M)[:, None],
    "causal_br": lambda M, N: np.arange(N)[None, :] <= np.arange(M)[:, None] + N - M,
}


@pytest.mark.parametrize("name", sorted(KEEP))
@pytest.mark.parametrize("M, N", [(1, 1), (17, 17), (37, 23), (23, 37), (64, 5)])
@pytest.mark.parametrize("block_m, block_n", [(1, 1), (16, 16), (5, 7), (128, 128)])
def test_fused_and_plain_match_naive(name, M, N, block_m, block_n):
    rng = np.random.default_rng(1007)
    B, H, D = 2, 3, 8
    q, k, v = (rng.standard_normal((B, H, S, D)) for S in (M, N, N))
    scale = 1 / np.sqrt(D)
    o_ref, lse_ref = naive_attention(q, k, v, scale, KEEP[name](M, N))
    plain = PROGRAMS[name]
    fused = fuse.fuse(plain)
    for prog, kw in ((plain, {}), (fused, dict(block_m=block_m, block_n=block_n))):
        ev = executor.run(prog, dict(q=q, k=k, v=v), **kw)
        o, lse = ev.outputs["o"], ev.lse["o"]
        assert not np.isnan(o).any() and not np.isnan(lse).any()
        np.testing.assert_allclose(o, o_ref, rtol=1e-12, atol=1e-12)
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref))
        fin = np.isfinite(lse_ref)
        np.testing.assert_allclose(lse[fin], lse_ref[fin], rtol=1e-12, atol=1e-12)


def test_fully_masked_rows_give_zero_and_minus_infinity():
    """Bottom-right causal with M > N: the first M - N queries see no key."""
    rng = np.random.default_rng(2007)
    M, N = 40, 9
    q, k, v = (rng.standard_normal((1, 2, S, 8)) for S in (M, N, N))
    ev = executor.run(fuse.fuse(PROGRAMS["causal_br"]), dict(q=q, k=k, v=v), block_m=16, block_n=4)
    o, lse = ev.outputs["o"], ev.lse["o"]
    assert np.all(o[:, :, : M - N] == 0) and np.all(np.isneginf(lse[:, :, : M - N]))
    assert np.all(np.isfinite(lse[:, :, M - N :])) and np.abs(o[:, :, M - N :]).sum() > 0


def test_scale_override():
    rng = np.random.default_rng(3007)
    q, k, v = (rng.standard_normal((1, 1, 6, 8)) for _ in range(3))
    ev = executor.run(fuse.fuse(PROGRAMS["full"]), dict(q=q, k=k, v=v), scale=0.3, block_n=4)
    o_ref, _ = naive_attention(q, k, v, 0.3, np.ones((6, 6), bool))
    np.testing.assert_allclose(ev.outputs["o"], o_ref, rtol=1e-12)


def test_inconsistent_shapes_are_refused():
    rng = np.random.default_rng(4007)
    with pytest.raises(ValueError, match="dimension D is 4 here but 8 elsewhere"):
        executor.run(
            PROGRAMS["full"],
            dict(
                q=rng.standard_normal((1, 1, 3, 8)),
                k=rng.standard_normal((1, 1, 3, 4)),
                v=rng.standard_normal((1, 1, 3, 8)),
            ),
        )
