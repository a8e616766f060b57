"""Autograd and the fagen:: ops on the CPU, with a test double standing in for a compiled kernel and its
backward (tests/attention_double.py): gradients flow from Kernel calls and fagen.attention, torch.compile
(fullgraph) traces forward and backward through the ops, the ops pass torch.library.opcheck, and bad
arguments get errors naming them."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

import fagen  # noqa: E402
from fagen import ops  # noqa: E402
from fagen.request import for_attention, options_source  # noqa: E402
from fagen.runtime import autograd  # noqa: E402
from fagen.runtime.decode import no_grad  # noqa: E402

from .attention_double import (  # noqa: E402
    DoubleKernel,
    ReferenceForward,
    assert_close,
    install,
    reference,
    reference_kernel,
)


@pytest.fixture
def compiled(monkeypatch):
    """fagen.attention's compiler replaced by the double: the (request, kernel) pairs it made."""
    yield install(monkeypatch)
    torch._dynamo.reset()


def qkv(B=2, H=4, M=7, N=5, D=16, Hkv=None, dtype=torch.float32, layout="bhsd", grad=True, seed=0):
    g = torch.Generator().manual_seed(seed)

    def make(heads, S):
        if layout == "bshd":  # a [B, S, H, D] buffer viewed as [B, H, S, D]
            x = torch.randn(B, S, heads, D, generator=g, dtype=dtype).transpose(1, 2)
        else:
            x = torch.randn(B, heads, S, D, generator=g, dtype=dtype)
        return x.requires_grad_(grad)

    return make(H, M), make(Hkv or H, N), make(Hkv or H, N)


def grads_of(fn, inputs, do):
    out = fn(*inputs)
    return out, torch.autograd.grad(out, inputs, do)


# --- Kernel calls ----------------------------------------------------------------------------------------
def test_kernel_call_with_grad_routes_to_the_backward():
    """A Kernel call on tensors that require grad returns o with a grad_fn; backward runs kernel.backward."""
    double = DoubleKernel(tensors=("bias",), causal=True)
    kernel = reference_kernel(double)
    q, k, v = qkv(M=9, N=6, Hkv=2)
    bias = torch.rand(4, requires_grad=True)
    o, lse = kernel(q, k, v, return_lse=True, bias=bias)
    assert o.grad_fn is not None and not lse.requires_grad
    do = torch.randn_like(o)
    got = torch.autograd.grad(o, (q, k, v, bias), do)
    want = torch.autograd.grad(
        reference(q.double(), k.double(), v.double(), causal=True, bias=bias)[0], (q, k, v, bias), do.double()
    )
    for g, w, name in zip(got, want, ("dq", "dk", "dv", "dbias")):
        assert_close(g, w, what=name)
    assert double.backward_calls == [False]


def test_kernel_call_without_grad_takes_no_autograd_path(monkeypatch):
    """Under no_grad, or on detached tensors, the call goes to the kernel's own (CUDA) path."""

    class Probe(ReferenceForward):
        def launch(self, *args):
            raise LookupError("the kernel's own path")

    def through_autograd(*args):
        raise AssertionError("the call went through autograd")

    monkeypatch.setattr(autograd, "attention_with_grad", through_autograd)
    kernel = reference_kernel(DoubleKernel(), forward=Probe)
    q, k, v = qkv()
    with pytest.raises(AssertionError, match="through autograd"):  # inputs that require grad do
        kernel(q, k, v)
    with torch.no_grad(), pytest.raises(LookupError):
        kernel(q, k, v)
    with pytest.raises(LookupError):
        kernel(q.detach(), k.detach(), v.detach())


def test_kernel_without_a_backward_refuses_inputs_that_require_grad():
    kernel = reference_kernel(DoubleKernel(has_backward=False))
    with pytest.raises(RuntimeError, match=rf"kernel {kernel.name} has no backward.*torch.no_grad"):
        kernel(*qkv())


def test_kernel_call_with_grad_refuses_out_and_names_missing_tensors():
    kernel = reference_kernel(DoubleKernel(tensors=("bias",)))
    q, k, v = qkv()
    with pytest.raises(ValueError, match="out, out_lse"):
        kernel(q, k, v, out=torch.empty_like(q), bias=torch.rand(4))
    with pytest.raises(TypeError, match=r"bias: this kernel's program reads bias\[...\]; pass bias="):
        kernel(q, k, v)
    with pytest.raises(TypeError, match="nope: this kernel takes no tensor"):
        kernel(q, k, v, bias=torch.rand(4), nope=torch.rand(4))


def test_decode_refuses_grad():
    q, k, v = qkv()
    with pytest.raises(RuntimeError, match="decode kernel has no backward"):
        no_grad(q, k, v, {})
    no_grad(q.detach(), k.detach(), v.detach(), {})


def test_kernel_varlen_with_grad():
    """Kernel.varlen on packed tensors that require grad: gradients of every sequence, GQA summed."""
    kernel = reference_kernel(DoubleKernel(causal=True))
    g = torch.Generator().manual_seed(1)
    q = torch.randn(12, 4, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(9, 2, 16, generator=g, requires_grad=True) for _ in range(2))
    cu_q, cu_k = torch.tensor([0, 5, 12], dtype=torch.int32), torch.tensor([0, 6, 9], dtype=torch.int32)
    o = kernel.varlen(q, k, v, cu_q, cu_k, 7, 6)
    do = torch.randn_like(o)
    got = torch.autograd.grad(o, (q, k, v), do)

    def per_sequence(q, k, v):
        outs = []
        for (q0, q1), (k0, k1) in (((0, 5), (0, 6)), ((5, 12), (6, 9))):
            view = (x.permute(1, 0, 2)[None] for x in (q[q0:q1], k[k0:k1], v[k0:k1]))
            outs.append(reference(*view, causal=True)[0][0].permute(1, 0, 2))
        return torch.cat(outs)

    want = torch.autograd.grad(per_sequence(q.double(), k.double(), v.double()), (q, k, v), do.double())
    for a, b, name in zip(got, want, ("dq", "dk", "dv")):
        assert_close(a, b, what=name)


# --- fagen.attention ------------------------------------------------------------------------------------------
def test_attention_gradients_match_float64_autograd(compiled):
    """GQA, bottom-right causal with M > N (rows with no key: zero gradients, no NaN), a learnable bias[h]."""
    q, k, v = qkv(M=9, N=4, Hkv=2, layout="bshd")
    bias = torch.rand(4, requires_grad=True)
    fn = lambda s, b, h, q, k, bias: s + bias[h]  # noqa: E731
    o = fagen.attention(q, k, v, causal="bottom_right", score_mod=fn, bias=bias)
    assert o.stride() == q.stride(), "the output takes q's layout"
    do = torch.randn_like(o)
    got = torch.autograd.grad(o, (q, k, v, bias), do)
    want = torch.autograd.grad(
        reference(q.double(), k.double(), v.double(), causal=True, bias=bias)[0], (q, k, v, bias), do.double()
    )
    for a, b, name in zip(got, want, ("dq", "dk", "dv", "dbias")):
        assert torch.isfinite(a).all(), name
        assert_close(a, b, what=name)
    assert got[0][:, :, :5].abs().max() == 0, "queries that see no key have zero dq"
    for x, g in zip((q, k, v), got):
        assert g.stride() == x.stride(), "gradients take their input's layout"


def test_attention_compiles_once_per_spec(compiled):
    """The memo: one compile per (dim, dtype, device, options); an inline lambda of the same code is one spec."""
    q, k, v = qkv(grad=False)
    for _ in range(3):
        fagen.attention(q, k, v, score_mod=lambda s, b, h, q, k, bias: s + bias[h], bias=torch.rand(4))
    fagen.attention(q, k, v)
    fagen.attention(*qkv(D=32, grad=False))
    assert [r.dim for r, _ in compiled] == [16, 16, 32]
    assert [r.source for r, _ in compiled][1:] == [options_source()] * 2
    assert compiled[0][0].source.score_mod is not None and compiled[0][0].source.is_traced


def test_attention_argument_errors(compiled):
    q, k, v = qkv(grad=False)
    with pytest.raises(TypeError, match="alibi, slopes"):
        fagen.attention(q, k, v, alibi=torch.rand(4), slopes=torch.rand(4))
    with pytest.raises(TypeError, match="bias: this attention takes no tensor"):
        fagen.attention(q, k, v, bias=torch.rand(4))
    with pytest.raises(TypeError, match=r"bias: the program reads bias\[...\]; pass bias="):
        fagen.attention(q, k, v, score_mod=lambda s, b, h, q, k, bias: s + bias[h])
    with pytest.raises(ValueError, match=r"q: expected 4 dimensions \[B, H, M, D\]"):
        fagen.attention(q[0], k[0], v[0])
    with pytest.raises(TypeError, match="q: dtype int64 is not supported"):
        fagen.attention(q.long(), k, v)
    with pytest.raises(TypeError, match="q: expected a PyTorch tensor or a CuPy array, got list"):
        fagen.attention([1], k, v)
    with pytest.raises(TypeError, match="deterministic: expected True or False"):
        fagen.attention(q, k, v, deterministic="yes")


def test_attention_deterministic_reaches_the_backward(compiled):
    q, k, v = qkv()
    fagen.attention(q, k, v, deterministic=True).sum().backward()
    assert compiled[0][1].backward_calls == [True]


@pytest.mark.parametrize("bias_grad", [True, False])
def test_tensor_gradients_are_summed_only_when_asked_for(compiled, bias_grad):
    """The backward sums a call-time tensor's gradient (its row sums cost the main kernel time) only where one
    requires grad: a Kernel call (autograd.Function) and fagen.attention (the fagen:: ops) alike."""
    bias = torch.rand(4, requires_grad=bias_grad)
    double = DoubleKernel(tensors=("bias",), causal=True)
    q, k, v = qkv(M=6, N=5, Hkv=2)
    reference_kernel(double)(q, k, v, bias=bias).sum().backward()
    assert double.tensor_grads_calls == [bias_grad] and (bias.grad is not None) == bias_grad
    fagen.attention(q, k, v, score_mod=lambda s, b, h, q, k, bias: s + bias[h], bias=bias).sum().backward()
    assert compiled[0][1].tensor_grads_calls == [bias_grad]


def test_attention_under_torch_compile_fullgraph(compiled):
    """torch.compile(fullgraph=True) traces fagen.attention, forward and backward, with no graph break; the
    gradients are the eager ones, and the kernel is compiled once."""
    bias = torch.rand(4, requires_grad=True)

    def step(q, k, v, bias):
        o = fagen.attention(q, k, v, score_mod=lambda s, b, h, q, k, bias: s + bias[h], bias=bias)
        return (o * o).sum()

    q, k, v = qkv(M=6, N=6, Hkv=2)
    eager = torch.autograd.grad(step(q, k, v, bias), (q, k, v, bias))
    compiled_step = torch.compile(step, fullgraph=True, backend="aot_eager")
    traced = torch.autograd.grad(compiled_step(q, k, v, bias), (q, k, v, bias))
    for a, b, name in zip(traced, eager, ("dq", "dk", "dv", "dbias")):
        assert_close(a, b, what=name)
    assert len(compiled) == 1
    kernel = compiled[0][1]
    assert [c[0] for c in kernel.calls] == ["call", "call"] and len(kernel.backward_calls) == 2


def test_explain_finds_no_graph_break(compiled):
    def f(q, k, v):
        return fagen.attention(q, k, v, causal="bottom_right").sum()

    explanation = torch._dynamo.explain(f)(*qkv())
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1


def test_opcheck_attention_ops(compiled):
    """The fagen:: ops: schema, fake implementation (shapes, dtypes and strides the real one gives),
    autograd registration, AOT dispatch."""
    q, k, v = qkv(Hkv=2, layout="bshd")
    bias = torch.rand(4, requires_grad=True)
    key = ops.kernel_key(
        for_attention,
        dim=16,
        dtype="f32",
        device=("torch", "cpu", None),
        score_mod=lambda s, b, h, q, k, bias: s + bias[h],
    )
    torch.library.opcheck(torch.ops.fagen.attention.default, (q, k, v, key, None, False, [bias]))
    q, k, v, bias = (x.detach() for x in (q, k, v, bias))  # the backward op has no backward of its own
    o, lse = torch.ops.fagen.attention(q, k, v, key, 0.3, False, [bias])
    do = torch.randn_like(o)
    torch.library.opcheck(torch.ops.fagen.attention_backward.default, (q, k, v, o, lse, do, key, 0.3, False, [bias]))


def test_opcheck_varlen_op(compiled):
    kernel = DoubleKernel(causal=True)
    key = autograd.register(kernel)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(10, 4, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(8, 4, 16, generator=g, requires_grad=True) for _ in range(2))
    cu_q, cu_k = torch.tensor([0, 3, 10], dtype=torch.int32), torch.tensor([0, 5, 8], dtype=torch.int32)
    torch.library.opcheck(torch.ops.fagen.attention_varlen.default, (q, k, v, cu_q, cu_k, 7, 5, key, None, False, []))


def test_scale_is_passed_through(compiled):
    q, k, v = qkv()
    o = fagen.attention(q, k, v, scale=0.5)
    want = reference(q.double(), k.double(), v.double(), scale=0.5)[0]
    assert_close(o, want)
    assert compiled[0][1].calls[0][2] == 0.5


def test_importing_the_api_loads_no_torch():
    from .test_startup import HEAVY, loaded_after

    loaded = loaded_after("import fagen\nfagen.attention\nfagen.flash_attn_func\nfagen.flash_attn_varlen_func")
    assert not loaded & {*HEAVY, "torch"}, sorted(loaded & {*HEAVY, "torch"})


def test_no_nan_when_every_row_is_masked(compiled):
    """M > N with a bottom-right causal mask and a window of 0: most rows see no key; nothing is NaN."""
    q, k, v = qkv(M=8, N=2)
    o = fagen.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
    (o.sum() * math.pi).backward()
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))
    assert o.transpose(1, 2)[:, :, :6].abs().max() == 0
