"""What a traced function captures, as issue 40 asks ("Python helper functions, and closures over ints, floats and
tensors"): a captured tensor the program never reads is left out of the kernel (no argument, no dtype); a list of
numbers a helper function reads is a constant table as in the traced function itself (nested lists too); and a
captured tensor is never named like a parameter of the kernel's calls (kernel(q, k, v, scale=..., **tensors))."""

import inspect

import pytest
import sympy as sp

import fagen
from fagen import flex, ops, pipeline, request
from fagen.ir import exprs, variants
from fagen.ir.exprs import ExprError
from fagen.runtime.kernel import Kernel

S = exprs.SCORE
q, k, b, h = (exprs.INDICES[n] for n in "qkbh")
OFFSETS = [0.0, 0.25]  # a module's list of numbers, read by a helper function
CUDA_ONLY = "expected a CUDA tensor"  # how far a call goes on the CPU: the launch describes q


def _table(i, values):
    """The constant table's expression: values[i], clamped to the list."""
    return sp.Piecewise(*[(v, sp.Le(i, n)) for n, v in enumerate(values[:-1])], (values[-1], True))


# --- a captured tensor the program does not read ----------------------------------------------------------------
def _unread_pair():
    torch = pytest.importorskip("torch")
    g = torch.tensor(0.5)
    shift = torch.tensor(2, dtype=torch.int32)

    def mod(s, b, g, sh):  # sh is passed but never read
        return s * g

    return g, lambda s, b, h, q_idx, kv_idx: mod(s, b, g, shift)


def test_a_captured_tensor_the_program_does_not_read_is_left_out(tmp_path):
    """Before: fagen.compile raised "ValueError: tensor_dtypes: the program reads no tensor 'shift' (it reads: g)".
    Now the kernel takes g alone: shift is no argument of it, has no dtype in it, and is not passed at call time."""
    g, score = _unread_pair()
    kern = fagen.compile(64, score_mod=score, arch="sm_90a", cache_dir=tmp_path)
    assert kern.tensors == ("g",) and {a.name: a.dtype for a in kern.tensor_args} == {"g": "f32"}
    assert set(kern.with_captured({})) == {"g"} and set(kern.capture_roles) == {"g"}
    req = request.for_compile(64, score_mod=score, arch="sm_90a")
    assert req.tensor_dtypes == (("shift", "i32"),)  # captured: its dtype known before the function is traced
    assert req.program_dtypes(req.program()) == ()
    again = fagen.compile(64, score_mod=score, arch="sm_90a", cache_dir=tmp_path)  # a cache hit: the same kernel
    assert again.tensors == ("g",) and again.name == kern.name


def test_a_given_dtype_of_a_tensor_the_program_does_not_read_is_still_an_error(tmp_path):
    _, score = _unread_pair()
    with pytest.raises(ValueError, match=r"tensor_dtypes: the program reads no tensor 'nope' \(it reads: g\)"):
        fagen.compile(64, score_mod=score, arch="sm_90a", cache_dir=tmp_path, tensor_dtypes={"nope": "i32"})


def test_an_unread_captured_tensor_of_a_dtype_no_kernel_takes_is_left_out_and_a_read_one_refused(tmp_path):
    """A float64 tensor the function names but does not read is no argument; read, its dtype is refused, naming it."""
    torch = pytest.importorskip("torch")
    wide = torch.zeros(4, dtype=torch.float64)

    def mod(s, t):
        return s

    kern = fagen.compile(64, score_mod=lambda s, b, h, q_idx, kv_idx: mod(s, wide), arch="sm_90a", cache_dir=tmp_path)
    assert kern.tensors == ()
    with pytest.raises(TypeError, match="wide: dtype float64 is not supported for a call-time tensor"):
        fagen.compile(64, score_mod=lambda s, b, h, q_idx, kv_idx: s + wide[h], arch="sm_90a", cache_dir=tmp_path)


def test_flex_attention_passes_only_the_captured_tensors_the_kernel_reads():
    """The call path of fagen.flex_attention on the CPU: the request, the op's tensors (ops.with_captured, ordered)
    and the fagen::attention op, as far as the launch, which wants CUDA tensors."""
    torch = pytest.importorskip("torch")
    g, score = _unread_pair()
    x = torch.randn(1, 2, 64, 64)
    key = ops.kernel_key(fagen.request.for_attention, **flex._request(x, score, None))
    tensors = ops.with_captured(key, {}, (score, None))
    assert set(tensors) == {"g"} and ops.ordered(ops.tensor_names(key), tensors) == [tensors["g"]]
    with pytest.raises(TypeError, match=CUDA_ONLY):
        fagen.flex_attention(x, x, x, score_mod=score)


def test_a_block_masks_kernel_reads_no_unread_captured_tensor():
    """The block-mask kernel of a mask_mod that captures an int tensor it does not read: no dtype for it (before:
    the same ValueError when the kernel was built), and only the tensors it reads are passed (flex._build)."""
    torch = pytest.importorskip("torch")
    doc = torch.zeros(64, dtype=torch.int32)
    unused = torch.zeros(3, dtype=torch.int64)

    def same_doc(d, q_idx, kv_idx, extra):
        return d[q_idx] == d[kv_idx]

    mask = lambda b, h, q_idx, kv_idx: same_doc(doc, q_idx, kv_idx, unused)  # noqa: E731
    req = request.for_block_mask(mask=mask, device=("torch", "cpu", None), tiles=(128, 128))
    fused, _, _, dtypes = pipeline.block_mask_program(req)
    assert dtypes == {"doc": "i32"} and request.tensors_read(fused) == {"doc"}


# --- lists of numbers a helper function reads -----------------------------------------------------------------------
def _add_offset(s, i):
    return s + OFFSETS[i]


def test_a_list_a_helper_reads_is_a_constant_table():
    """Before: a helper's list indexed by a symbolic index raised "ExprError: a symbolic value was used as a Python
    integer", though the same list indexed in the traced function itself was a table. Now a helper's closure list, a
    module's list read by a helper, nested lists (rows of tuples) and the lists of the masks torch's and_masks
    composes are tables, and the caller's objects are untouched."""
    pytest.importorskip("torch")
    from torch.nn.attention.flex_attention import and_masks

    offsets = [0.0, 0.25]

    def closure_helper(s, i):
        return s + offsets[i]

    assert variants.trace_score(lambda s, b_, h_, q_idx, kv_idx: closure_helper(s, b_)) == S + _table(b, [0.0, 0.25])
    assert variants.trace_score(lambda s, b_, h_, q_idx, kv_idx: _add_offset(s, h_)) == S + _table(h, [0.0, 0.25])
    windows = [(16, 0), (64, 8)]  # per head: (left, right)

    def in_window(h_, q_idx, kv_idx):
        return (q_idx - kv_idx <= windows[h_][0]) & (kv_idx - q_idx <= windows[h_][1])

    got = variants.trace_mask(lambda b_, h_, q_idx, kv_idx: in_window(h_, q_idx, kv_idx))
    assert got == sp.And(q - k <= _table(h, [16, 64]), k - q <= _table(h, [0, 8]))
    limits = [3, 5]
    composed = and_masks(
        lambda b_, h_, q_idx, kv_idx: q_idx >= kv_idx, lambda b_, h_, q_idx, kv_idx: kv_idx < limits[h_]
    )
    assert variants.trace_mask(composed) == sp.And(q >= k, k < _table(h, [3, 5]))
    assert type(offsets) is list and type(windows[0]) is tuple and type(limits) is list and OFFSETS == [0.0, 0.25]


def test_a_nested_list_is_a_table_indexed_a_level_at_a_time():
    rows = [[1, 2, 3], [4, 5, 6]]
    got = variants.trace_mask(lambda b_, h_, q_idx, kv_idx: kv_idx < rows[h_][q_idx % 3])
    assert got == (k < sp.Piecewise((_table(sp.Mod(q, 3), [1, 2, 3]), h <= 0), (_table(sp.Mod(q, 3), [4, 5, 6]), True)))
    assert variants.trace_mask(lambda b_, h_, q_idx, kv_idx: kv_idx < rows[1][q_idx % 3]) == (
        k < _table(sp.Mod(q, 3), [4, 5, 6])
    )
    for used_whole in (lambda s, b_, h_, q_idx, kv_idx: s + rows[h_], lambda s, b_, h_, q_idx, kv_idx: rows[h_] * 2):
        with pytest.raises(ExprError, match=r"the list rows is used as a number; index it"):
            variants.trace_score(used_whole)
    big = [[0] * 40, [1] * 40]
    with pytest.raises(ExprError, match=r"the list big \(80 numbers\) is indexed by a symbolic value; at most 64"):
        variants.trace_mask(lambda b_, h_, q_idx, kv_idx: kv_idx < big[h_][0])


def test_a_helper_past_the_depth_limit_is_refused_naming_the_construct():
    """Helpers are followed MAX_HELPER_DEPTH deep, as for captured tensors; a list read deeper is refused (the
    message tracing gives a list indexed by a symbolic value), never an internal exception."""
    table = [1, 2]

    def deepest(i):
        return table[i]

    chain = deepest
    for _ in range(variants.MAX_HELPER_DEPTH):
        chain = (lambda inner: lambda i: inner(i))(chain)
    with pytest.raises(ExprError, match="a symbolic value was used as a Python integer"):
        variants.trace_mask(lambda b_, h_, q_idx, kv_idx: kv_idx < chain(h_))
    shallower = (lambda inner: lambda i: inner(i))(deepest)
    assert variants.trace_mask(lambda b_, h_, q_idx, kv_idx: kv_idx < shallower(h_)) == (k < _table(h, [1, 2]))


def test_a_recursive_helper_reads_its_table_at_every_level():
    def shifted(s, i, n):
        return s if n == 0 else shifted(s + OFFSETS[i], i, n - 1)

    got = variants.trace_score(lambda s, b_, h_, q_idx, kv_idx: shifted(s, q_idx % 2, 2))
    assert got == S + 2 * _table(sp.Mod(q, 2), [0.0, 0.25])


def test_a_helpers_table_compiles_and_nested_closure_lists_key_by_value(tmp_path):
    kern = fagen.compile(
        64, score_mod=lambda s, b_, h_, q_idx, kv_idx: _add_offset(s, h_), arch="sm_90a", cache_dir=tmp_path
    )
    assert kern.tensors == ()

    def make(rows):
        return lambda b_, h_, q_idx, kv_idx: kv_idx < rows[h_][0]

    key = request.function_key
    assert key(make([[1], [2]])) == key(make([[1], [2]])) != key(make([[1], [3]]))


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
    torch = pytest.importorskip("torch")
    space: dict = {}
    exec(f"def make(t):\n    {var} = t\n    return lambda s, b, h, q_idx, kv_idx: s * {var}[h]", space)
    fn = space["make"](torch.ones(4))
    assert [c.name for c in variants.captured(fn)] == [f"captured_{var}"]
    assert variants.trace_score(fn) == S * exprs.tensor(f"captured_{var}")[h]


def test_a_kernel_call_takes_a_captured_scale_beside_its_own_scale(tmp_path):
    torch = pytest.importorskip("torch")
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
