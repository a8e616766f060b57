"""What traced functions capture, run on a GPU through fagen.flex_attention (issue 40; the CPU side:
tests/test_trace_captures.py): a captured tensor named like a keyword of the kernel's calls (`scale`), a captured
tensor the program does not read (a CPU tensor: passing it would fail), and lists of numbers read by helper functions
(nested ones too), against float64 references written out by hand (FlashAttention's error rule)."""

import math

import pytest

import fagen
from fagen.tools import testing

pytestmark = pytest.mark.gpu

OFFSETS = [0.0, 0.25, -0.5, 1.0]  # per head, read by a helper
WINDOWS = [(16, 0), (64, 8), (300, 300), (0, 0)]  # per head: (left, right), read by a helper


def _add_offset(s, h):
    return s + OFFSETS[h]


def _in_window(h, q_idx, kv_idx):
    return (q_idx - kv_idx <= WINDOWS[h][0]) & (kv_idx - q_idx <= WINDOWS[h][1])


def _run(score_mod, block_mask, keep, score, L=300, S=300, H=4, dtype="bf16", grad=False):
    """o (and lse) of fagen.flex_attention against the float64 reference of `keep` [B, H, L, S] and `score`."""
    import torch

    B, D = 2, 64
    q, k, v = testing.random_qkv(B, H, L, S, D, dtype)
    if grad:
        q, k, v = (x.requires_grad_() for x in (q, k, v))
    o, lse = fagen.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, return_lse=True)
    torch.cuda.synchronize()
    keep_np = keep.expand(B, H, L, S).cpu().numpy()
    scale = 1 / math.sqrt(D)
    ref = testing.reference(q.detach(), k.detach(), v.detach(), keep_np, scale, score=score)
    naive = testing.reference(q.detach(), k.detach(), v.detach(), keep_np, scale, dtype=q.dtype, score=score)
    testing.assert_ok(testing.compare(o.detach(), lse, ref, naive, dtype), f"L={L} S={S}")
    return q, k, v, o


def test_a_captured_tensor_named_scale_is_read_beside_the_calls_scale():
    """Before: kernel(q, k, v, scale=..., **tensors) raised "got multiple values for keyword argument 'scale'"."""
    import torch

    scale = torch.tensor(1.5, device="cuda")
    everything = torch.ones(1, 1, 300, 300, dtype=torch.bool, device="cuda")
    _run(lambda s, b, h, q_idx, kv_idx: s * scale, None, everything, lambda s: s * 1.5)


def test_a_captured_tensor_the_function_does_not_read_is_not_passed():
    """Before: compiling raised "tensor_dtypes: the program reads no tensor 'unused'". The unread tensor lives on
    the CPU: passing it to the kernel or the block-mask kernel would be refused."""
    import torch

    L = 300
    doc = (torch.arange(L, device="cuda") // 70).to(torch.int32)
    unused = torch.zeros(3, dtype=torch.int64)  # on the CPU
    g = torch.tensor(0.75, device="cuda")

    def same_doc(d, q_idx, kv_idx, extra):
        return d[q_idx] == d[kv_idx]

    def gain(s, g_, extra):
        return s * g_

    mask = lambda b, h, q_idx, kv_idx: same_doc(doc, q_idx, kv_idx, unused)  # noqa: E731
    bm = fagen.create_block_mask(mask, None, None, L, L)
    _, _, qi, ki = testing.index_grids(1, 1, L, L, "cuda")
    keep = doc[qi] == doc[ki]
    _run(lambda s, b, h, q_idx, kv_idx: gain(s, g, unused), bm, keep, lambda s: s * 0.75)


@pytest.mark.parametrize("grad", [False, True])
def test_lists_read_by_helpers_are_tables(grad):
    """Before: "a symbolic value was used as a Python integer". A helper's per-head offsets (score) and a helper's
    per-head windows, a list of tuples (mask); with grad, dq, dk, dv are finite and o.backward runs."""
    import torch

    L, S, H = 257, 300, 4
    b, h, qi, ki = testing.index_grids(1, H, L, S, "cuda")
    left = torch.tensor([w[0] for w in WINDOWS], device="cuda")[h]
    right = torch.tensor([w[1] for w in WINDOWS], device="cuda")[h]
    keep = (qi - ki <= left) & (ki - qi <= right)
    offsets = torch.tensor(OFFSETS, device="cuda", dtype=torch.float64)[h]

    def mask_mod(b_, h_, q_idx, kv_idx):
        return _in_window(h_, q_idx, kv_idx)

    bm = fagen.create_block_mask(mask_mod, None, H, L, S)  # per head: the mask reads h

    def score_mod(s, b_, h_, q_idx, kv_idx):
        return _add_offset(s, h_)

    q, k, v, o = _run(score_mod, bm, keep, lambda s: s + offsets.to(s.dtype), L, S, H, grad=grad)
    if grad:
        o.backward(torch.randn_like(o))
        assert all(torch.isfinite(x.grad).all() for x in (q, k, v))
