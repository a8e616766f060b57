"""The GPU tier of context parallelism: fagen.ring_attention on 2 and 4 GPUs with fagen's kernels, against attention on
the gathered sequence (skipped, saying why, where there are fewer GPUs). The ranks share one host, so the ring's links
are the copy engines (fagen.ring_copy) but in the case that asks for NCCL's.

Rule, for o and each of dq, dk, dv (FlashAttention's): max |x_ring - x_ref| <= 2 · max |x_naive - x_ref| + floor, x_ref
the float64 formula on the gathered sequence, x_naive the same formula in bf16; and the same bound with single-GPU
fagen.attention on the gathered sequence in place of the naive formula (the ring is as exact as one GPU). Every piece
program is compiled before the ranks start (one compile, not one per rank). NVLink multicast stays off in every
process (tests/ring_cases.py sets NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import fagen  # noqa: E402

from .. import ring_cases  # noqa: E402
from ..ring_cases import Case  # noqa: E402

pytestmark = pytest.mark.gpu
FLOOR = 1e-3  # bf16
D = 128

CASES = [
    Case("causal_gqa", 2, 4096, causal=True, H=4, Hkv=2, D=D),
    Case("causal", 4, 8192, causal=True, H=4, Hkv=4, D=D),
    Case("causal_nccl", 4, 8192, causal=True, H=4, Hkv=4, D=D, transport="nccl"),  # the links that leave one host
    Case("causal_gqa", 4, 8192, causal=True, H=4, Hkv=2, D=D),
    Case("window_pruned", 4, 8192, layout="contiguous", causal=True, window=512, H=4, Hkv=2, D=D),
    Case("doc_mask", 2, 4096, layout="contiguous", causal=True, doc_mask=(0, 700, 2500, 2600, 4096), D=D),
    Case("softcap", 2, 4096, causal=True, softcap=30.0, D=D),
    Case("varlen", 2, 4096, causal=True, docs=(0, 1000, 1024, 3000, 4096), H=4, Hkv=2, D=D),
    Case("varlen", 4, 8192, causal=True, docs=(0, 3000, 3001, 7000, 8192), D=D),
    Case("varlen_mqa", 2, 4096, causal=True, docs=(0, 1000, 1024, 3000, 4096), H=4, Hkv=1, D=D),  # [1, 1, T, D] views
    Case("causal_batch2", 2, 4096, causal=True, B=2, H=4, Hkv=2, D=D),
    # call-time tensors that require grad: their gradients summed over the pieces, the steps and the ranks
    Case("alibi_slopes_grad", 2, 4096, causal=True, alibi=True, grads=("slopes",), H=4, Hkv=2, D=D),
    Case("bias_grad_pruned", 4, 8192, layout="contiguous", causal=True, window=512, key_bias=True, grads=("kb",), D=D),
]


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def single_gpu(case: Case, q, k, v, do):
    """fagen.attention on the gathered sequence, on one GPU: (o, dq, dk, dv) and the case's tensors' gradients."""
    q, k, v = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    mask = score_mod = None
    bounds = case.doc_mask if case.doc_mask is not None else case.docs
    if bounds is not None:
        doc = ring_cases.doc_ids(bounds, case.T, torch).to(q.device)

        def mask(b, h, q, k):
            return fagen.eq(doc[q], doc[k])

    given = {}
    opts = dict(causal=case.causal, window=case.window, softcap=case.softcap, mask=mask)
    if case.alibi:
        opts["alibi"] = given["slopes"] = ring_cases.case_slopes(case, torch, q.device).requires_grad_(True)
    if case.key_bias:
        kb = given["kb"] = ring_cases.case_key_bias(case, torch, q.device, torch.float32).requires_grad_(True)

        def score_mod(s, b, h, q, k):
            return s + kb[k]

    o = fagen.attention(q, k, v, score_mod=score_mod, **opts)
    o.backward(do)
    return (o.detach(), q.grad, k.grad, v.grad), {n: given[n].grad for n in case.grads}


def check(case: Case, got, dev, grads=()):
    """got: the ring's (o, dq, dk, dv); grads: its gradients of the case's tensors (rank 0's, summed over the
    group), each held to the rule against the float64 formula."""
    q, k, v, do = ring_cases.inputs(case, torch, torch.float64, dev)
    ref, ref_t = ring_cases.reference_with_tensors(case, q, k, v, do, torch)
    low = [x.to(torch.bfloat16) for x in (q, k, v, do)]
    naive, naive_t = ring_cases.reference_with_tensors(case, *low, torch)
    one, one_t = single_gpu(case, *low)
    names = ["o", "dq", "dk", "dv", *(f"d{n}" for n in case.grads)]
    got = [*got, *grads]
    ref, naive, one = (list(x) + [t[n] for n in case.grads] for x, t in ((ref, ref_t), (naive, naive_t), (one, one_t)))
    for name, x, r, n, f in zip(names, got, ref, naive, one):
        x = x.to(dev)
        assert torch.isfinite(x).all(), f"{case.name}: {name} has non-finite values"
        err = float((x.double() - r).abs().max())
        for what, other in (("naive bf16", n), ("single-GPU fagen", f)):
            limit = 2 * float((other.double() - r).abs().max()) + FLOOR
            assert err <= limit, f"{case.name}: {name} error {err:.3e} > {limit:.3e} (2x {what} + floor)"


# Known to fail, each with why (strict: a pass is reported, so that the entry goes once it is fixed)
KNOWN: dict[str, str] = {}


def _params():
    for c in CASES:
        name = f"{c.name}_w{c.world}"
        marks = [pytest.mark.xfail(strict=True, reason=KNOWN[name])] if name in KNOWN else []
        yield pytest.param(c, id=name, marks=marks)


@pytest.mark.parametrize("case", list(_params()))
def test_ring_against_one_gpu(case):
    if _gpus() < case.world:
        pytest.skip(f"needs {case.world} GPUs, this machine has {_gpus()}")
    ring_cases.precompile(case, torch, D, "bf16")
    grads: list = []
    got, counts, sends = ring_cases.launch(
        case, backend="nccl", dtype="bfloat16", start="spawn", timeout=600, grads=grads
    )
    check(case, got, torch.device("cuda", 0), grads[0] if case.grads else ())
    if case.name == "window_pruned":  # the window's keys only, to the right neighbour (forward, backward) and back
        W, L = case.world, case.window
        for r, sent in enumerate(sends):
            want = ([(r + 1, L)] * 4 if r < W - 1 else []) + ([(r - 1, L)] * 2 if r > 0 else [])
            assert sorted(map(tuple, sent)) == sorted(want), (r, sent)
