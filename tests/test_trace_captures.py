"""What a traced function captures, as issue 40 asks ("Python helper functions, and closures over ints, floats and
tensors"): a captured tensor is never named like a parameter of the kernel's calls (kernel(q, k, v, scale=...,
**tensors))."""

import inspect

import pytest

torch = pytest.importorskip("torch")

import fagen  # noqa: E402
from fagen.ir import exprs, variants  # noqa: E402
from fagen.ir.exprs import ExprError  # noqa: E402
from fagen.runtime.kernel import Kernel  # noqa: E402

S = exprs.SCORE
h = exprs.INDICES["h"]
CUDA_ONLY = "expected a CUDA tensor"  # how far a call goes on the CPU: the launch describes q


# --- captured tensors are never named like a parameter of the kernel's calls ------------------------------------------
def _kernel_calls() -> dict:
    """Kernel's methods that take the call-time tensors by name (**tensors), by name."""
    return {
        name: fn
        for name, fn in inspect.getmembers(Kernel, inspect.isfunction)
        if any(p.kind is p.VAR_KEYWORD for p in inspect.signature(fn).parameters.values())
    }


def test_call_keywords_cover_every_parameter_of_the_kernels_calls():
    """variants.CALL_KEYWORDS (fagen/ir, which may not import the runtime) holds every named parameter of each Kernel
    method that takes tensors by name: a new keyword there cannot reopen the collision."""
    calls = _kernel_calls()
    assert {"__call__", "varlen", "decode", "backward", "varlen_backward", "backward_rows"} <= set(calls)
    for name, fn in calls.items():
        params = list(inspect.signature(fn).parameters.values())[1:]  # self
        named = {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
        assert named <= variants.CALL_KEYWORDS, f"Kernel.{name}: {sorted(named - variants.CALL_KEYWORDS)}"


@pytest.mark.parametrize("var", ["scale", "out", "block_mask", "v", "lse", "return_lse", "cache_seqlens"])
def test_a_captured_tensor_named_like_a_call_keyword_is_renamed(var):
    """Before: a closure tensor named `scale` was the kernel's tensor `scale`, and kernel(q, k, v, scale=...,
    **tensors) failed with "got multiple values for keyword argument 'scale'" (3 entries of FlexAttention's own test
    file). Now it is captured_<var>."""
    space: dict = {}
    exec(f"def make(t):\n    {var} = t\n    return lambda s, b, h, q_idx, kv_idx: s * {var}[h]", space)
    fn = space["make"](torch.ones(4))
    assert [c.name for c in variants.captured(fn)] == [f"captured_{var}"]
    assert variants.trace_score(fn) == S * exprs.tensor(f"captured_{var}")[h]


def test_a_kernel_call_takes_a_captured_scale_beside_its_own_scale(tmp_path):
    scale = torch.tensor(2.0)
    score = lambda s, b, h, q_idx, kv_idx: s * scale  # noqa: E731
    kern = fagen.compile(64, score_mod=score, arch="sm_90a", cache_dir=tmp_path)
    assert kern.tensors == ("captured_scale",)
    x = torch.randn(1, 2, 64, 64)
    tensors = kern.with_captured({})
    for fn in _kernel_calls().values():  # every call binds the captured tensors beside its own keywords
        sig = inspect.signature(fn)
        own = {p.name: None for p in list(sig.parameters.values())[1:] if p.kind is not p.VAR_KEYWORD}
        sig.bind(kern, **own, **tensors)
    with pytest.raises(TypeError, match=CUDA_ONLY):  # the op's kernel(q, k, v, scale=..., **tensors), then the launch
        fagen.flex_attention(x, x, x, score_mod=score, scale=0.125)


def test_a_parameter_named_like_a_call_keyword_is_refused():
    with pytest.raises(ExprError, match=r"score_mod: the parameter 'scale' names a tensor passed by name at call time"):
        variants.trace_score(lambda s, b, h, q_idx, kv_idx, scale: s * scale[h])
