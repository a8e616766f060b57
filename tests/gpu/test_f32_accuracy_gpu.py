"""float32 at large logits, against float64 with FlashAttention's rule: softmax scales 1 to 2 and inputs of amplitude
3 put the scores in the hundreds, where rounding the score before 2^(S - m) cost P (and through the max, the
log-sum-exp) a unit in the last place of the score; the f32 kernels compute P from raw q.k in one fused
multiply-add (fagen.backend.codegen.p_from_qk). Hundreds of random shapes, forward and decode."""

from __future__ import annotations

import functools

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import fagen  # noqa: E402
from fagen.tools import testing  # noqa: E402

pytestmark = pytest.mark.gpu


@functools.cache
def kernel(dim, causal, decode=False):
    return fagen.compile(dim, causal=causal, dtype="f32", decode=decode)


def _uniform(g, *shape):
    return (torch.rand(*shape, generator=g, device="cuda") * 6 - 3).float()  # amplitude 3


@pytest.mark.parametrize("dim", [32, 64, 128, 59])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_at_large_logits(dim, causal):
    k_ = kernel(dim, causal)
    rng = np.random.default_rng(dim + causal)
    g = torch.Generator(device="cuda").manual_seed(dim)
    misses = []
    for case in range(60):
        B, H = int(rng.integers(1, 3)), int(rng.integers(1, 5))
        M, N = int(rng.integers(1, 400)), int(rng.integers(1, 400))
        scale = float(rng.uniform(1.0, 2.0))
        q, k, v = (
            _uniform(g, B, H, M, dim),
            _uniform(g, B, H, N, dim),
            torch.randn(B, H, N, dim, generator=g, device="cuda"),
        )
        o, lse = k_(q, k, v, scale=scale, return_lse=True)
        keep = testing.keep_matrix(k_, B, H, M, N)
        ref = testing.reference(q, k, v, keep, scale)
        naive = testing.reference(q, k, v, keep, scale, dtype=torch.float32)
        r = testing.compare(o, lse, ref, naive, "f32")
        if not r.ok:
            misses.append(f"case {case} ({B}, {H}, {M}, {N}) scale {scale:.3f}: {r}")
    assert not misses, "\n".join(misses)


@pytest.mark.parametrize("causal", [False, True])
def test_decode_at_large_logits(causal):
    k_ = kernel(128, causal, decode=True)
    g = torch.Generator(device="cuda").manual_seed(7)
    B, M, H, Hkv, N = 3, 2, 8, 2, 700
    seqlens = [1, 333, 700]
    for scale in (1.0, 1.5, 2.0):
        q = _uniform(g, B, M, H, 128)
        kc, vc = _uniform(g, B, N, Hkv, 128), torch.randn(B, N, Hkv, 128, generator=g, device="cuda")
        lens = torch.tensor(seqlens, dtype=torch.int32, device="cuda")
        o, lse = k_.decode(q, kc, vc, lens, scale=scale, return_lse=True, num_splits=3)
        refs, naives = [], []
        for b, L in enumerate(seqlens):
            q4, k4, v4 = (
                q[b : b + 1].transpose(1, 2),
                kc[b : b + 1, :L].transpose(1, 2),
                vc[b : b + 1, :L].transpose(1, 2),
            )
            keep = testing.keep_matrix(k_, 1, H, M, L)
            refs.append(testing.reference(q4, k4, v4, keep, scale))
            naives.append(testing.reference(q4, k4, v4, keep, scale, dtype=torch.float32))
        ref = torch.cat([r[0] for r in refs]).transpose(1, 2), torch.cat([r[1] for r in refs])
        naive = torch.cat([r[0] for r in naives]).transpose(1, 2), torch.cat([r[1] for r in naives])
        testing.assert_ok(testing.compare(o, lse, ref, naive, "f32"), f"decode f32 scale {scale}")
