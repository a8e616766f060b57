"""The GPU tier for index math: // and % masks and huge windows/prefixes, against the float64 reference
(whose mask is evaluated in integers too), with sizes where the boundary keys matter."""

import functools

import pytest

import fagen
from fagen.tools import testing

pytestmark = pytest.mark.gpu

MASKS = {
    # SymPy rewrites this to k/50 - q/50 >= -1; printed as k_idx - q_idx >= -50
    "floor_band": dict(mask=lambda b, h, q, k: ((k - q) // 50) >= -1),
    "block_causal": dict(mask=lambda b, h, q, k: q // 64 >= k // 64),
    "mod_stripes": dict(mask=lambda b, h, q, k: (q >= k) & fagen.ne((q - k) % 7, 3)),
    "mod_negative": dict(mask=lambda b, h, q, k: ((k - q) % 5) < 3),
    "floor_and_mod": dict(mask=lambda b, h, q, k: fagen.ne(((q - k) // 3) % 4, 1)),
    "half_slope": dict(mask=lambda b, h, q, k: k < q / 2 + 1),
    "window_int_max": dict(window=2**31 - 1),
    "window_causal_huge": dict(causal=True, window=2147483000),
    "prefix_huge": dict(prefix=99999999999),
}


@functools.cache
def kernel(name, dim, dtype, tier):
    return fagen.compile(dim, dtype=dtype, tier=tier, **MASKS[name])


@pytest.mark.parametrize("name", sorted(MASKS))
@pytest.mark.parametrize(
    "tier, dtype, dim", [("mma", "bf16", 128), ("mma", "f16", 64), ("simt", "f32", 64), ("simt", "bf16", 64)]
)
@pytest.mark.parametrize("M, N", [(1000, 1000), (4097, 4097), (700, 1333)])
def test_index_math_masks_match_reference(name, tier, dtype, dim, M, N):
    k = kernel(name, dim, dtype, tier)
    testing.assert_ok(testing.check_kernel(k, B=1, H=2, M=M, N=N), f"{k.name} M={M} N={N}")
