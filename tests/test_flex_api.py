"""fagen.flex_attention, create_block_mask and scaled_dot_product_attention: FlexAttention's and SDPA's
signatures on the CPU, with a test double standing in for the compiled kernel (tests/attention_double.py)."""

import pytest

torch = pytest.importorskip("torch")

import fagen  # noqa: E402
from fagen import ops  # noqa: E402
from fagen.ir.exprs import ExprError  # noqa: E402
from fagen.request import options_source  # noqa: E402
from fagen.runtime import autograd  # noqa: E402

from .attention_double import DoubleKernel, assert_close, reference  # noqa: E402


@pytest.fixture
def requests(monkeypatch):
    """The compiler behind fagen's memo replaced: records each request's source and returns a plain double."""
    made = []

    def fake_compile(request):
        made.append(request.source)
        return DoubleKernel()

    monkeypatch.setattr(ops, "_compile", fake_compile)
    monkeypatch.setattr(ops, "_MEMO", {})
    monkeypatch.setattr(ops, "_KERNELS", {})
    monkeypatch.setattr(autograd, "KERNELS", {})
    torch._dynamo.reset()
    return made


def _qkv(B=1, H=2, Hkv=2, L=9, S=11, D=16):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(B, n, m, D, generator=g, dtype=torch.float32) for n, m in ((H, L), (Hkv, S), (Hkv, S)))


def document(b, h, q_idx, kv_idx):
    return (q_idx // 4 == kv_idx // 4) & (q_idx >= kv_idx)


def test_flex_attention_compiles_the_mask_and_score_functions(requests):
    q, k, v = _qkv()
    score = lambda score, b, h, q_idx, kv_idx: 30 * torch.tanh(score / 30)  # noqa: E731
    bm = fagen.create_block_mask(document, None, None, 9, 11)
    o = fagen.flex_attention(q, k, v, score_mod=score, block_mask=bm)
    (source,) = requests
    assert source == options_source(score_mod=score, mask=document) and not source.causal and source.alibi is False
    assert source.score_mod is score and source.mask is document
    assert_close(o, reference(q, k, v)[0], what="the double's output")
    fagen.flex_attention(q, k, v, score_mod=score, block_mask=bm)
    assert len(requests) == 1  # compiled once per spec


def test_flex_attention_returns_lse(requests):
    q, k, v = _qkv()
    o, lse = fagen.flex_attention(q, k, v, return_lse=True)
    want_o, want_lse = reference(q, k, v)
    assert_close(o, want_o)
    assert lse.shape == (1, 2, 9) and lse.dtype == torch.float32
    assert_close(lse, want_lse.float(), tol=1e-4)


def test_flex_attention_is_differentiable(requests):
    q, k, v = (x.requires_grad_() for x in _qkv())
    fagen.flex_attention(q, k, v).sum().backward()
    assert q.grad is not None and k.grad is not None and v.grad is not None


def test_gqa_needs_enable_gqa_as_in_flexattention(requests):
    q, k, v = _qkv(H=4, Hkv=2)
    with pytest.raises(ValueError, match="pass enable_gqa=True"):
        fagen.flex_attention(q, k, v)
    assert fagen.flex_attention(q, k, v, enable_gqa=True).shape == q.shape
    q3, k3, v3 = _qkv(H=3, Hkv=2)
    with pytest.raises(ValueError, match="not a multiple"):
        fagen.flex_attention(q3, k3, v3, enable_gqa=True)


_IDS = torch.arange(11)


def _ids_of(i):
    return _IDS[i]  # reached through a helper function: captured from its module


def test_block_mask_checks():
    with pytest.raises(ValueError, match="Q_LEN: expected a positive int"):
        fagen.create_block_mask(document, None, None, 0, 11)
    with pytest.raises(ExprError, match="mask: Python's and/or/not"):
        fagen.create_block_mask(lambda b, h, q, k: q >= k and q < 5, None, None, 9, 11)
    ids = torch.arange(11)
    fagen.create_block_mask(lambda b, h, q, k: ids[q] == ids[k], None, None, 9, 11)  # a captured tensor: read
    fagen.create_block_mask(lambda b, h, q, k: _ids_of(q) == _ids_of(k), None, None, 9, 11)  # through a helper
    with pytest.raises(ExprError, match="neither a parameter of the function nor a variable"):
        fagen.create_block_mask(lambda b, h, q, k: torch.arange(11)[q] == k, None, None, 9, 11)  # made in it
    bm = fagen.create_block_mask(document, 1, None, 9, 11)
    assert bm.shape == (1, None, 9, 11) and "document" in repr(bm)


def test_block_mask_must_fit_the_inputs(requests):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"block_mask: made for .* \(1, 2, 9, 11\)"):
        fagen.flex_attention(q, k, v, block_mask=fagen.create_block_mask(document, None, None, 9, 12))
    with pytest.raises(TypeError, match="block_mask: expected a fagen.BlockMask"):
        fagen.flex_attention(q, k, v, block_mask=document)


def test_sdpa_signature(requests):
    q, k, v = _qkv()
    fagen.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5)
    fagen.scaled_dot_product_attention(q, k, v)
    assert requests == [options_source(causal=True), options_source(causal=False)]
    with pytest.raises(ValueError, match="attn_mask, is_causal: pass one of them"):
        fagen.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(9, 11, dtype=torch.bool), is_causal=True)
    with pytest.raises(ValueError, match=r"attn_mask: shape \[3, 11\] does not broadcast"):
        fagen.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(3, 11, dtype=torch.bool))
    with pytest.raises(NotImplementedError, match="dropout_p"):
        fagen.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
    with pytest.raises(ValueError, match="enable_gqa"):
        fagen.scaled_dot_product_attention(*_qkv(H=4, Hkv=2))


def test_gathers_of_gathers_reach_create_block_mask_and_flex_attention(requests):
    """A mask written from offsets (offsets[doc[q_idx]]) and a score reading table[h, dist[q, k]], captured: traced
    for create_block_mask (a b read only inside an index counts as a read of b) and compiled by flex_attention."""
    doc = torch.tensor([0, 0, 0, 1, 2, 2, 2, 2, 3, 3, 3], dtype=torch.int32)
    offsets = torch.tensor([0, 3, 4, 8, 11], dtype=torch.int64)
    table = torch.randn(2, 5)
    dist = torch.randint(0, 5, (9, 11), dtype=torch.int32)

    def from_offsets(b, h, q_idx, kv_idx):
        return (kv_idx >= offsets[doc[q_idx]]) & (kv_idx <= q_idx)

    def score(s, b, h, q_idx, kv_idx):
        return s + table[h, dist[q_idx, kv_idx]]

    bm = fagen.create_block_mask(from_offsets, None, None, 9, 11)
    docs = torch.zeros(2, 11, dtype=torch.int32)
    with pytest.raises(ValueError, match="B: mask_mod reads b"):
        fagen.create_block_mask(lambda b, h, q, k: k >= offsets[docs[b, q]], None, None, 9, 11)
    q, k, v = _qkv()
    fagen.flex_attention(q, k, v, score_mod=score, block_mask=bm)
    (source,) = requests
    assert source.mask is from_offsets and source.score_mod is score


def test_two_masks_of_one_program_read_their_own_captured_tensors(monkeypatch):
    """Two document masks written alike over different doc_id tensors trace to one program, so the compiler gives
    them one kernel (one name), whose own captured variables are the first function's. Before, the block-sparse
    call passed no tensor and the kernel read the first mask's doc_id on the second call's partial tiles: a wrong
    dq of 3.4 against a bound of 0.05 in the GPU tier (test_block_mask_gpu, H100). Now each call passes the tensors
    its own functions capture."""
    from fagen import flex
    from fagen.ir import variants

    seen = []

    class SharedKernel(DoubleKernel):  # what the compiler gives both masks: one kernel, the first mask's captures
        def __init__(self, mask):
            super().__init__(tensors=("doc_id",))
            self.name = "one_program"
            self.capture_roles = {c.name: ("mask", c) for c in variants.captured(mask, "mask")}

        def __call__(self, q, k, v, *, scale=None, return_lse=False, block_mask=None, **tensors):
            seen.append(tensors.get("doc_id"))
            return super().__call__(q, k, v, scale=scale, return_lse=return_lse, **tensors)

    monkeypatch.setattr(ops, "_compile", lambda request: SharedKernel(request.source.mask))
    monkeypatch.setattr(ops, "_MEMO", {})
    monkeypatch.setattr(ops, "_KERNELS", {})
    monkeypatch.setattr(autograd, "KERNELS", {})
    monkeypatch.setattr(flex, "_block_sparse", lambda *a, **kw: True)  # the CUDA path, on the CPU

    def documents(doc_id):
        def doc_causal(b, h, q_idx, kv_idx):
            return (doc_id[q_idx] == doc_id[kv_idx]) & (q_idx >= kv_idx)

        return doc_causal

    first = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 2], dtype=torch.int32)
    second = torch.tensor([0, 1, 1, 1, 1, 1, 1, 2, 2, 3, 3], dtype=torch.int32)
    q, k, v = _qkv(L=11)
    for doc_id in (first, second):
        mask = documents(doc_id)
        fagen.flex_attention(q, k, v, block_mask=fagen.create_block_mask(mask, None, None, 11, 11))
    assert seen[0] is first and seen[1] is second


def test_sdpa_bool_masks_of_one_shape_are_each_read_on_their_own_call(monkeypatch):
    """SDPA's bool attn_mask on the block-sparse path (CUDA inputs that need no gradient) is a mask_mod made on each
    call, capturing that call's mask: every call's function is keyed alike (the captured tensor by dtype and rank),
    so all share the first call's kernel. Before, the kernel was called without the tensor and read the first call's
    mask on partial tiles; now each call passes its own."""
    from fagen import flex
    from fagen.ir import variants

    seen = []

    class SharedKernel(DoubleKernel):
        def __init__(self, mask):
            super().__init__(tensors=("attn_mask",))
            self.capture_roles = {c.name: ("mask", c) for c in variants.captured(mask, "mask")}

        def __call__(self, q, k, v, *, scale=None, return_lse=False, block_mask=None, **tensors):
            seen.append(tensors.get("attn_mask"))
            return super().__call__(q, k, v, scale=scale, return_lse=return_lse, **tensors)

    made = []
    monkeypatch.setattr(ops, "_compile", lambda request: made.append(1) or SharedKernel(request.source.mask))
    monkeypatch.setattr(ops, "_MEMO", {})
    monkeypatch.setattr(ops, "_KERNELS", {})
    monkeypatch.setattr(autograd, "KERNELS", {})
    monkeypatch.setattr(flex, "_block_sparse", lambda *a, **kw: True)  # the CUDA path, on the CPU
    q, k, v = _qkv(L=9, S=11)
    masks = [torch.rand(9, 11, generator=torch.Generator().manual_seed(n)) < 0.5 for n in (1, 2)]
    for m in masks:
        fagen.scaled_dot_product_attention(q, k, v, attn_mask=m)
    assert len(made) == 1 and len(seen) == 2  # one kernel for both calls
    for got, m in zip(seen, masks):
        assert torch.equal(got[0, 0], m)
