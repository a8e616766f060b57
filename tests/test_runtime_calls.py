"""The runtime on the CPU: its one call-shape cache (fagen.runtime.calls.CallCache: what makes a call shape, the
bound on how many are kept, the prepared calls of calls captured into CUDA graphs), and each op's host path up
to the launch (forward, varlen, backward, varlen backward, decode)."""

import dataclasses
import functools
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from fagen.backend import contract, plan, tiers  # noqa: E402
from fagen.backend.contract import BACKWARD_KINDS, LOG2E, Kind  # noqa: E402
from fagen.runtime.calls import MAX_CALL_SHAPES, CallCache, ptr  # noqa: E402
from fagen.runtime.kernel import BackwardPlan, Kernel, Launch, Plan  # noqa: E402


def _prepare():
    return object()


def test_a_call_shape_is_the_arrays_layouts_the_tensor_names_and_the_flags():
    """Calls with other data of the same shapes, strides, dtypes and alignment share one prepared call; any of
    those, a tensor's name or an op's flag differing makes a new one."""
    cache = CallCache()
    q, k = torch.zeros(2, 3, 4, 8), torch.zeros(2, 1, 5, 8)
    key = CallCache.key((q, k, k, None, None), {"bias": torch.zeros(3)}, "forward")
    entry = cache.get(key, _prepare)
    same = CallCache.key((torch.ones(2, 3, 4, 8), k, k, None, None), {"bias": torch.ones(3)}, "forward")
    assert cache.get(same, _prepare) is entry
    buffer = torch.zeros(2 * 3 * 4 * 8 + 1)
    others = [
        ((q.transpose(1, 2).contiguous().transpose(1, 2), k, k, None, None), {"bias": torch.zeros(3)}, ("forward",)),
        ((q.half(), k, k, None, None), {"bias": torch.zeros(3)}, ("forward",)),
        ((buffer[1:].view(2, 3, 4, 8), k, k, None, None), {"bias": torch.zeros(3)}, ("forward",)),  # 4-byte aligned
        ((q, k, k, q, None), {"bias": torch.zeros(3)}, ("forward",)),  # out= given
        ((q, k, k, None, None), {"slopes": torch.zeros(3)}, ("forward",)),
        ((q, k, k, None, None), {"bias": torch.zeros(3)}, ("backward", False, None)),
    ]
    for given, tensors, flags in others:
        assert cache.get(CallCache.key(given, tensors, *flags), _prepare) is not entry, (given, tensors, flags)
    assert len(list(cache.values())) == 1 + len(others)


def test_past_the_bound_the_cache_starts_over():
    cache = CallCache()
    first = cache.get(("shape", 0), _prepare)
    for i in range(1, MAX_CALL_SHAPES + 1):
        cache.get(("shape", i), _prepare)
    assert MAX_CALL_SHAPES == 256 and len(list(cache.values())) == MAX_CALL_SHAPES + 1
    assert cache.get(("shape", 0), _prepare) is first
    cache.get(("shape", "one more"), _prepare)
    assert list(cache.values()) == [cache.get(("shape", "one more"), _prepare)]
    assert cache.get(("shape", 0), _prepare) is not first


def test_a_captured_call_gets_a_prepared_call_of_its_own_kept_alive():
    cache = CallCache()
    shared = cache.get(("shape",), _prepare)
    captured = [cache.get(("shape",), _prepare, captured=True) for _ in range(2)]
    assert shared not in captured and captured[0] is not captured[1]
    assert cache.captured == captured and list(cache.values()) == [shared]


# --- the ops' host path on the CPU ----------------------------------------------------------------------------
# Kernels of real plans whose binaries are never loaded: CPU tensors pass for device 0's, and Function.launch
# records what it would launch. This checks each op's checks, packing, workspaces and fallback up to the launch.
def _launch(tier: str, kind: Kind, tensors=(), tensor_grads=False, dim=64) -> Launch:
    t = tiers.get(tier)
    spec = plan.choose("causal", dim, "f16", "sm_80", tier, causal=True, kind=kind).spec
    spec = dataclasses.replace(spec, tensor_grads=tensor_grads)
    grid = t.decode_grid if kind is Kind.DECODE_SPLIT else t.backward_grid if kind in BACKWARD_KINDS else t.grid
    params = contract.params(kind, tuple(tensors), t.extra_params(spec))
    stub = SimpleNamespace(cubin=b"")
    return Launch(spec, "", stub, t.smem_bytes(spec), params, t.threads(spec), functools.partial(grid, spec))


SLOPES = contract.TensorArg("slopes")  # read as slopes[h]


def _backward_plan(dim=64) -> BackwardPlan:
    preprocess, main, convert, dq = (_launch("simt", kind, (SLOPES,), dim=dim) for kind in BACKWARD_KINDS)
    grads = _launch("simt", Kind.BWD, (SLOPES,), tensor_grads=True, dim=dim)
    return BackwardPlan(preprocess, main, convert, dq, main_grads=grads, gradients=(("slopes", "h"),))


def _forward_kernel(tier: str, dim=64) -> Kernel:
    """A forward kernel reading slopes[h], with a backward; the mma tier's falls back to the simt tier's."""
    fallback = (lambda: _forward_kernel("simt", dim)) if tier == "mma" else None
    return Kernel(
        Plan((_launch(tier, Kind.FORWARD, (SLOPES,), dim=dim),)),
        None,
        default_scale=0.125,
        fallback=fallback,
        backward=lambda: _backward_plan(dim),
        fits=tiers.get(tier).fits,
        tensors=(SLOPES,),
        tensor_index={"slopes": "h"},
    )


@pytest.fixture
def launched(monkeypatch):
    """What Function.launch was asked to run, in order: (kernel name, grid, the packed arguments by name)."""
    from fagen.runtime import arrays, backward, checks, decode, forward
    from fagen.runtime.arrays import Array
    from fagen.runtime.launch import Function

    def describe(name, x):
        dname = str(x.dtype).replace("torch.", "")
        strides = tuple(x.stride())
        return Array("torch", x, x.data_ptr(), tuple(x.shape), strides, arrays._DTYPES.get(dname), dname, 0)

    for module in (forward, decode, backward, checks):
        monkeypatch.setattr(module, "describe", describe)
    monkeypatch.setattr(arrays, "stream_getter", lambda like: lambda: 7)
    monkeypatch.setattr(arrays, "current_stream", lambda x: 7)
    monkeypatch.setattr(decode, "capturing", lambda stream: False)
    monkeypatch.setattr(decode, "sm_count", lambda device: 132)
    calls = []

    def launch(self, device, stream, grid, block, pack, arch_check):
        assert (device, stream) == (0, 7)
        calls.append((self.name, grid, {p.name: getattr(v, "value", v) for p, v in zip(pack.params, pack.values)}))

    monkeypatch.setattr(Function, "launch", launch)
    return calls


def _qkv(B=2, H=4, Hkv=2, M=33, N=17, D=64):
    return (torch.randn(B, h, n, D, dtype=torch.float16) for h, n in ((H, M), (Hkv, N), (Hkv, N)))


def test_a_forward_call_packs_its_shape_once_and_writes_each_calls_addresses(launched):
    kernel = _forward_kernel("mma")
    q, k, v = _qkv()
    slopes = torch.rand(4)
    o = kernel(q, k, v, slopes=slopes)
    q2, k2, v2 = _qkv()
    o2, lse2 = kernel(q2, k2, v2, scale=0.5, return_lse=True, slopes=slopes)
    (name, grid, args), (_, grid2, args2) = launched
    assert name == kernel.name and grid == grid2 == (1, 4, 2) and len(list(kernel._calls.values())) == 1
    assert (args["q"], args["k"], args["o"], args["tensor_slopes"]) == tuple(map(ptr, (q, k, o, slopes)))
    assert (args2["q"], args2["v"], args2["o"], args2["lse"]) == tuple(map(ptr, (q2, v2, o2, lse2)))
    assert args["q_stride_h"] == 33 * 64 and args["heads_per_kv"] == 2 and args["seqlen_k"] == 17
    assert args["scale_log2"] == pytest.approx(0.125 * LOG2E) and args2["scale_log2"] == pytest.approx(0.5 * LOG2E)
    assert kernel._fallback is None
    kernel(torch.randn(2, 4, 33, 128, dtype=torch.float16)[..., ::2], k, v, slopes=slopes)  # strided along D
    assert kernel._fallback is not None and launched[-1][0] == kernel._fallback.name  # the simt tier's
    with pytest.raises(ValueError, match="slopes: expected a vector of at least 4"):
        kernel(q, k, v, slopes=torch.rand(3))
    with pytest.raises(ValueError, match="slopes: expected a vector of at least 4"):
        kernel(q, k, v, slopes=torch.rand(1))
    kernel(q, k, v, slopes=torch.rand(9))  # longer: the entries past H are never read


def test_a_varlen_call_packs_the_offsets_and_no_batch_stride(launched):
    kernel = _forward_kernel("simt")
    q, k, v = (torch.randn(total, h, 64, dtype=torch.float16) for total, h in ((12, 4), (9, 2), (9, 2)))
    cu_q, cu_k = torch.tensor([0, 5, 12], dtype=torch.int32), torch.tensor([0, 6, 9], dtype=torch.int32)
    o, lse = kernel.varlen(q, k, v, cu_q, cu_k, 7, 6, return_lse=True, slopes=torch.rand(4))
    ((name, grid, args),) = launched
    assert o.shape == q.shape and lse.shape == (4, 12) and grid == (1, 4, 2)
    assert (args["cu_seqlens_q"], args["cu_seqlens_k"]) == (ptr(cu_q), ptr(cu_k)) and args["q_stride_b"] == 0
    assert (args["seqlen_q"], args["total_q"], args["q_stride_m"]) == (7, 12, 4 * 64)
    with pytest.raises(ValueError, match="cu_seqlens_q, cu_seqlens_k: need the same number of sequences"):
        kernel.varlen(q, k, v, cu_q, cu_k[:2], 7, 6, slopes=torch.rand(4))


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_backward_call_runs_its_launches_with_one_workspace_per_shape(launched, deterministic):
    kernel = _forward_kernel("simt")
    q, k, v = _qkv()
    o, do = torch.randn_like(q), torch.randn_like(q)
    lse = torch.randn(2, 4, 33)
    for tensor_grads in (True, False):
        g = kernel.backward(
            q, k, v, o, lse, do, deterministic=deterministic, tensor_grads=tensor_grads, slopes=torch.rand(4)
        )
        assert (g.dq.shape, g.dk.shape, g.dv.shape) == (q.shape, k.shape, v.shape)
        assert {n: tuple(t.shape) for n, t in g.tensors.items()} == ({"slopes": (4,)} if tensor_grads else {})
    bp = kernel.backward_plan
    last = bp.dq if deterministic else bp.convert
    assert [name for name, _, _ in launched] == [bp.preprocess.spec.name, bp.main_grads.spec.name, last.spec.name] + [
        bp.preprocess.spec.name,
        bp.main.spec.name,
        last.spec.name,
    ]
    (entry,) = kernel._calls.values()
    args = launched[1][2]
    assert (args["q"], args["dout"], args["delta"]) == (ptr(q), ptr(do), ptr(entry.delta))
    assert args["dq_accum"] == (0 if deterministic else ptr(entry.dq_accum)) and args["rowstat"] != 0
    assert launched[4][2]["rowstat"] == 0  # tensor_grads=False: the main kernel skips the tensors' sums
    with pytest.raises(ValueError, match=r"lse: expected a float32 array of shape \(2, 4, 33\)"):
        kernel.backward(q, k, v, o, lse[:, :, :5], do, slopes=torch.rand(4))


def test_varlen_calls_of_a_persistent_forward_share_a_prepared_call_and_its_counter(launched, monkeypatch):
    """Varlen calls of one call shape share one prepared call (packs, tensor maps, the work-tile counter per stream,
    which its last block sets back to zero), each writing its offsets' addresses and maxima, and the work tiles'
    grid they and its number of sequences give. Before: prepared, and a counter zeroed, each call."""
    from fagen.backend.tiers import wgmma
    from fagen.runtime import forward

    spec = plan.choose("causal", 128, "bf16", "sm_90a", "wgmma", causal=True).spec
    assert spec.persistent
    t = tiers.get("wgmma")
    params = contract.params(Kind.FORWARD, (), t.extra_params(spec))
    grid = functools.partial(t.grid, spec)
    fwd = Launch(spec, "", SimpleNamespace(cubin=b""), t.smem_bytes(spec), params, t.threads(spec), grid)
    kernel = Kernel(Plan((fwd,)), None, default_scale=0.125, fits=t.fits)
    monkeypatch.setattr(wgmma, "sm_count", lambda device: 132)
    maps = SimpleNamespace(update=lambda *ptrs: None)  # (the tensor maps are encoded by the driver)
    monkeypatch.setattr(wgmma.Wgmma, "prepare", lambda self, slots, arrays, spec: maps)
    monkeypatch.setattr(forward, "capturing", lambda stream: False)
    made, zeros = [], forward.zeros
    monkeypatch.setattr(forward, "zeros", lambda like, shape, dtype: made.append(shape) or zeros(like, shape, dtype))
    q, k, v = (torch.randn(300, 4, 128, dtype=torch.bfloat16) for _ in range(3))
    offsets = [torch.tensor(cu, dtype=torch.int32) for cu in ([0, 20, 300], [0, 250, 280, 300])]
    for cu, longest in zip(offsets, (280, 250)):
        o, lse = kernel.varlen(q, k, v, cu, cu, longest, longest, return_lse=True)
        assert o.shape == q.shape and lse.shape == (4, 300)
    (_, grid, args), (_, grid2, args2) = launched
    assert len(list(kernel._calls.values())) == 1
    assert (grid, grid2) == ((3 * 4 * 2, 1, 1), (2 * 4 * 3, 1, 1))  # work tiles: query tiles x H x B
    assert (args["grid_m"], args2["grid_m"], args2["grid_b"], args["seqlen_q"], args2["seqlen_k"]) == (
        3,
        2,
        3,
        280,
        250,
    )
    assert (args["cu_seqlens_q"], args2["cu_seqlens_k"]) == (ptr(offsets[0]), ptr(offsets[1]))
    assert made == [(2,)] and args["tile_counter"] == args2["tile_counter"] != 0


def test_a_varlen_backward_call_packs_the_offsets(launched):
    kernel = _forward_kernel("simt")
    q, k, v = (torch.randn(total, h, 64, dtype=torch.float16) for total, h in ((12, 4), (9, 2), (9, 2)))
    cu_q, cu_k = torch.tensor([0, 5, 12], dtype=torch.int32), torch.tensor([0, 6, 9], dtype=torch.int32)
    o, do, lse = torch.randn_like(q), torch.randn_like(q), torch.randn(4, 12)
    g = kernel.varlen_backward(q, k, v, o, lse, do, cu_q, cu_k, 7, 6, slopes=torch.rand(4))
    assert (g.dq.shape, g.dk.shape) == (q.shape, k.shape)
    assert len(launched) == 3 and launched[1][2]["cu_seqlens_q"] == ptr(cu_q) and launched[1][1][1:] == (2, 2)
    assert launched[1][2]["q_stride_b"] == 0 and launched[1][2]["rowstat_stride_b"] == 4 * 7
    # the preprocess and the convert go row by row over all 12 packed rows as one sequence (every row of dQ written)
    rows = -(-12 // kernel.backward_plan.convert.spec.block_m)
    for _, grid, args in (launched[0], launched[2]):
        assert grid == (rows, 4, 1) and (args["cu_seqlens_q"], args["seqlen_q"], args["total_q"]) == (0, 12, 12)
    # the preprocess also takes the key offsets, the number of sequences and dk, dv (it zeroes their rows outside every
    # sequence): the 9 packed keys of 2 KV heads
    pre = launched[0][2]
    assert (pre["cu_seqlens_k"], pre["sequences"], pre["heads_kv"], pre["total_k"]) == (ptr(cu_k), 2, 2, 9)
    assert (pre["dk"], pre["dv"]) == (ptr(g.dk), ptr(g.dv)) and pre["dk_stride_n"] == 2 * 64
    with pytest.raises(ValueError, match=r"lse: expected 2 dimensions \[H, total_q\]"):
        kernel.varlen_backward(q, k, v, o, lse[None], do, cu_q, cu_k, 7, 6, slopes=torch.rand(4))


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_varlen_backward_zeroes_only_the_outputs_no_kernel_writes_in_full(launched, monkeypatch, deterministic):
    """A varlen call's dq starts as zeros where the dQ kernel writes it (deterministic, on a tier whose main kernel
    cannot order its additions: simt's); else the convert writes every row of dq. dk and dv are not filled: the
    preprocess writes 0 into their rows outside every sequence, the main kernel the others. The prototypes a call
    packs its strides from are only described. A zero fill is a pass over the array's memory (64 MiB each for 16k
    tokens of 16 heads at d128): 6 of them a call at first, then 2 (dk, dv: 41 us of 1454 on packed documents, H200)."""
    kernel = _forward_kernel("simt")
    q, k, v = (torch.randn(total, h, 64, dtype=torch.float16) for total, h in ((12, 4), (9, 2), (9, 2)))
    cu_q, cu_k = torch.tensor([0, 5, 12], dtype=torch.int32), torch.tensor([0, 6, 9], dtype=torch.int32)
    o, do, lse = torch.randn_like(q), torch.randn_like(q), torch.randn(4, 12)
    zeroed, zeros_like = [], torch.zeros_like
    monkeypatch.setattr(torch, "zeros_like", lambda x, **kw: zeroed.append(tuple(x.shape)) or zeros_like(x, **kw))
    for _ in range(2):
        g = kernel.varlen_backward(
            q, k, v, o, lse, do, cu_q, cu_k, 7, 6, deterministic=deterministic, tensor_grads=False, slopes=torch.rand(4)
        )
        assert not (deterministic and g.dq.any())  # no kernel wrote it
    assert zeroed == ([(1, 4, 12, 64)] if deterministic else []) * 2


@pytest.mark.parametrize("deterministic", [False, True])
def test_varlen_backward_calls_share_a_prepared_call_and_write_their_offsets(launched, deterministic):
    """Varlen calls of one call shape and stream share one prepared call (workspaces, packs, tensor maps), whatever
    their offsets, number of sequences and maxima: each writes its offsets' addresses and maxima into the launches
    over sequences, with the grids they give; the row passes take every packed row. Before: prepared each call."""
    bp = BackwardPlan(*(_launch("simt", kind, ()) for kind in BACKWARD_KINDS))
    forward = Plan((_launch("simt", Kind.FORWARD, ()),))
    kernel = Kernel(forward, None, default_scale=0.125, backward=lambda: bp, fits=tiers.get("simt").fits)
    q, k, v = (torch.randn(total, h, 64, dtype=torch.float16) for total, h in ((200, 4), (180, 2), (180, 2)))
    o, do, lse = torch.randn_like(q), torch.randn_like(q), torch.randn(4, 200)
    calls = [([0, 50, 200], [0, 60, 180], 150, 120), ([0, 190, 195, 200], [0, 10, 100, 180], 190, 90)]
    calls = [
        (torch.tensor(cq, dtype=torch.int32), torch.tensor(ck, dtype=torch.int32), mq, mk) for cq, ck, mq, mk in calls
    ]
    for call in calls:
        g = kernel.varlen_backward(q, k, v, o, lse, do, *call, deterministic=deterministic)
        assert (g.dq.shape, g.dk.shape, g.dv.shape) == (q.shape, k.shape, v.shape)
    assert len(list(kernel._calls.values())) == 1
    last = bp.dq if deterministic else bp.convert  # (simt's main kernel orders no additions: the dQ kernel's)
    assert [name for name, _, _ in launched] == [bp.preprocess.spec.name, bp.main.spec.name, last.spec.name] * 2
    rows = (-(-200 // bp.convert.spec.block_m), 4, 1)
    for (cu_q, cu_k, max_q, max_k), (pre, main, end) in zip(calls, (launched[:3], launched[3:])):
        for (_, grid, args), launch in ((main, bp.main),) + (((end, bp.dq),) if deterministic else ()):
            assert grid == launch.grid(len(cu_q) - 1, 4, 2, max_q, max_k)
            assert (args["cu_seqlens_q"], args["cu_seqlens_k"]) == (ptr(cu_q), ptr(cu_k))
            assert (args["seqlen_q"], args["seqlen_k"]) == (max_q, max_k)
        for _, grid, args in (pre,) + (() if deterministic else (end,)):
            assert grid == rows and (args["cu_seqlens_q"], args["seqlen_q"], args["total_q"]) == (0, 200, 200)
        # the preprocess zeroes dK's and dV's rows outside this call's sequences: its key offsets and their number
        assert (pre[2]["cu_seqlens_k"], pre[2]["sequences"]) == (ptr(cu_k), len(cu_k) - 1)


def test_a_decode_call_packs_its_workspace_per_shape_and_stream(launched):
    split = _launch("simt", Kind.DECODE_SPLIT, (SLOPES,))
    plan_ = Plan((split,), workspaces=("ws_acc", "ws_ml", "split_count"))
    kernel = Kernel(
        plan_, None, default_scale=0.125, fits=tiers.get("simt").fits, tensors=(SLOPES,), tensor_index={"slopes": "h"}
    )
    q = torch.randn(2, 1, 4, 64, dtype=torch.float16)
    k_cache, v_cache = (torch.randn(2, 100, 2, 64, dtype=torch.float16) for _ in range(2))
    lens = torch.tensor([50, 99], dtype=torch.int32)
    o = kernel.decode(q, k_cache, v_cache, lens, num_splits=3, slopes=torch.rand(4))
    kernel.decode(q, k_cache, v_cache, lens, num_splits=3, slopes=torch.rand(4))
    (entry,) = kernel._calls.values()
    (name, grid, args), _ = launched
    assert o.shape == q.shape and entry.num_splits == args["num_splits"] == 3 and entry.ws_acc.shape[2] == 3
    assert (args["ws_acc"], args["ws_ml"], args["split_count"]) == tuple(
        map(ptr, (entry.ws_acc, entry.ws_ml, entry.split_count))
    )
    assert (args["q"], args["cache_seqlens"], args["block_table"], args["k_append"]) == (ptr(q), ptr(lens), 0, 0)
    assert grid == split.grid(2, 2, 2, 3) and args["max_seqlen_k"] == 100
    with pytest.raises(TypeError, match="is a forward: compile with decode=True"):
        _forward_kernel("simt").decode(q, k_cache, v_cache, lens)
    with pytest.raises(TypeError, match="was compiled with decode=True"):
        kernel(q, k_cache, v_cache)


# --- head dims the kernels do not take: padded on the way in, cut back on the way out (fagen.runtime.pad) -------
def test_a_forward_of_a_padded_head_dim_launches_on_zero_padded_copies_and_returns_q_s_columns(launched):
    kernel = _forward_kernel("mma", dim=59)
    assert (kernel.spec.head_dim, kernel.spec.input_dim, kernel.spec.dim) == (64, 59, 59)
    q, k, v = _qkv(D=59)
    o, lse = kernel(q, k, v, return_lse=True, slopes=torch.rand(4))
    ((_, _, args),) = launched
    assert o.shape == q.shape and o.stride() == q.stride() and lse.shape == (2, 4, 33)
    assert args["q"] != ptr(q) and args["q_stride_h"] == 33 * 64 and args["o"] != ptr(o)  # the padded copies
    out = torch.empty_like(q)
    assert kernel(q, k, v, out=out, slopes=torch.rand(4)) is out
    with pytest.raises(ValueError, match="out: expected shape"):
        kernel(q, k, v, out=torch.empty(2, 4, 33, 64, dtype=torch.float16), slopes=torch.rand(4))
    with pytest.raises(ValueError, match="k: head dim 64 differs from the compiled head_dim 59"):
        kernel(q, *list(_qkv())[1:], slopes=torch.rand(4))


def test_a_backward_and_a_varlen_call_of_a_padded_head_dim_return_the_inputs_shapes(launched):
    kernel = _forward_kernel("simt", dim=37)
    q, k, v = _qkv(D=37)
    o, do, lse = torch.randn_like(q), torch.randn_like(q), torch.randn(2, 4, 33)
    g = kernel.backward(q, k, v, o, lse, do, slopes=torch.rand(4))
    assert (g.dq.shape, g.dk.shape, g.dv.shape) == (q.shape, k.shape, v.shape)
    assert launched[1][2]["q_stride_m"] == 40  # the main kernel's: 37 padded to 40
    launched.clear()
    qp, kp, vp = (torch.randn(total, h, 37, dtype=torch.float16) for total, h in ((12, 4), (9, 2), (9, 2)))
    cu_q, cu_k = torch.tensor([0, 5, 12], dtype=torch.int32), torch.tensor([0, 6, 9], dtype=torch.int32)
    o, lse = kernel.varlen(qp, kp, vp, cu_q, cu_k, 7, 6, return_lse=True, slopes=torch.rand(4))
    assert o.shape == qp.shape and lse.shape == (4, 12) and launched[0][2]["q_stride_m"] == 4 * 40
    g = kernel.varlen_backward(qp, kp, vp, o, lse, torch.randn_like(o), cu_q, cu_k, 7, 6, slopes=torch.rand(4))
    assert (g.dq.shape, g.dk.shape, g.dv.shape) == (qp.shape, kp.shape, vp.shape)


def test_a_decode_of_a_padded_head_dim_writes_the_appended_caches_back():
    """The split kernel appends k_new, v_new into the padded copies of the caches: their first columns go back
    into the caller's caches (here the launch itself is a stand-in that appends as the kernel would)."""
    from fagen.runtime import decode

    split = _launch("simt", Kind.DECODE_SPLIT, (), dim=16)
    kernel = Kernel(Plan((split,), workspaces=("ws_acc", "ws_ml", "split_count")), None, default_scale=0.25)
    q = torch.randn(2, 1, 4, 16, dtype=torch.float16)
    k_cache, v_cache = (torch.zeros(2, 10, 2, 16, dtype=torch.float16) for _ in range(2))
    k_new, v_new = (torch.randn(2, 1, 2, 16, dtype=torch.float16) for _ in range(2))
    lens = torch.tensor([3, 7], dtype=torch.int32)

    def appending(self, q, k_cache, v_cache, seqlens, table, k_new, v_new, *rest):
        assert k_cache.shape[-1] == q.shape[-1] == k_new.shape[-1] == 32
        for b, n in enumerate(seqlens.tolist()):
            k_cache[b, n], v_cache[b, n] = k_new[b, 0], v_new[b, 0]
        o = torch.zeros_like(q)
        return o, torch.zeros(2, 4, 1)

    orig = decode.Decode.launch
    decode.Decode.launch = appending
    try:
        o = kernel.decode(q, k_cache, v_cache, lens, k_new=k_new, v_new=v_new)
    finally:
        decode.Decode.launch = orig
    assert o.shape == q.shape
    assert torch.equal(k_cache[0, 3], k_new[0, 0]) and torch.equal(v_cache[1, 7], v_new[1, 0])


def test_a_decode_on_caches_no_split_kernel_reads_runs_on_dense_copies_written_back(launched, monkeypatch):
    """Caches (or k_new, v_new) 2 elements past a 16-byte boundary: no split kernel reads them with its 16-byte
    loads, so the call runs on dense copies, and the caches the kernel appended to are written back (here the
    copies differ from the caches by 1, standing in for what the kernel appends)."""
    from fagen.runtime import arrays

    monkeypatch.setattr(arrays, "dense_copy", lambda x: x.clone() + 1)
    split = _launch("simt", Kind.DECODE_SPLIT)
    kernel = Kernel(Plan((split,), workspaces=("ws_acc", "ws_ml", "split_count")), None, default_scale=0.125)
    kernel._fits = tiers.get("simt").fits
    q = torch.randn(2, 1, 4, 64, dtype=torch.float16)
    buffers = [torch.randn(2 * 100 * 2 * 64 + 2, dtype=torch.float16) for _ in range(2)]
    k_cache, v_cache = (b[2:].view(2, 100, 2, 64) for b in buffers)  # 4 bytes past the allocation's start
    k_new, v_new = (torch.randn(2, 1, 2, 64, dtype=torch.float16) for _ in range(2))
    lens = torch.tensor([50, 99], dtype=torch.int32)
    before, v_before = k_cache.clone(), v_cache.clone()
    o = kernel.decode(q, k_cache, v_cache, lens, k_new=k_new, v_new=v_new, num_splits=2)
    ((_, _, args),) = launched
    assert o.shape == q.shape and args["k"] != ptr(k_cache) and args["k"] % 16 == 0 and args["k_append"] == args["k"]
    assert torch.equal(k_cache, before + 1) and torch.equal(v_cache, v_before + 1)
    kernel.decode(q, k_cache, v_cache, lens, num_splits=2)  # no append: the caches are left alone
    assert torch.equal(k_cache, before + 1)
    with pytest.raises(ValueError, match="k_cache: head dim 32 differs"):  # other errors still raise
        kernel.decode(q, k_cache[..., :32], v_cache[..., :32], lens)


def test_a_slot_gradient_takes_its_tensors_shape():
    """name[h] / name[b] read from a longer vector: the entries past H / B get gradient 0; a size-1 dimension (every
    head read it) gets the sum."""
    from fagen.runtime.backward import _fit

    g = torch.tensor([1.0, 2.0, 3.0])
    assert _fit(g, (3,)).tolist() == [1.0, 2.0, 3.0]
    assert _fit(g, (5,)).tolist() == [1.0, 2.0, 3.0, 0.0, 0.0]
    assert _fit(g, (1,)).tolist() == [6.0]
    assert _fit(torch.ones(2, 3), (4, 1)).tolist() == [[3.0], [3.0], [0.0], [0.0]]
