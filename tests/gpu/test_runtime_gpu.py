"""The runtime on a GPU: prepared call shapes, CUDA graph capture, inputs that require grad, varlen offsets."""

import numpy as np
import pytest

import fagen
from fagen.tools import testing

pytestmark = pytest.mark.gpu


def _kernel(**kw):
    return fagen.compile(64, dtype="bf16", **kw)


def test_repeated_calls_of_one_shape_use_each_calls_inputs():
    """The second call of a shape takes the prepared path: it must read the new inputs and write a new output."""
    import torch

    k_ = _kernel(causal=True)
    results = []
    for _ in range(3):
        q, k, v = testing.random_qkv(2, 3, 200, 300, 64, "bf16")
        o, lse = k_(q, k, v, return_lse=True)
        keep = testing.keep_matrix(k_, 2, 3, 200, 300)
        ref, _ = testing.reference(q, k, v, keep, k_.default_scale)
        naive, _ = testing.reference(q, k, v, keep, k_.default_scale, dtype=torch.bfloat16)
        err = float((o.double() - ref).abs().max())
        assert err <= 2 * float((naive.double() - ref).abs().max()) + testing.FLOOR["bf16"]
        results.append(o)
    assert results[0].data_ptr() != results[1].data_ptr()


def test_calls_are_captured_into_cuda_graphs():
    import torch

    k_ = _kernel(causal=True, alibi=True)
    q, k, v = testing.random_qkv(2, 4, 333, 333, 64, "bf16")
    slopes = torch.tensor(fagen.alibi_slopes(4), device="cuda")
    out = torch.empty_like(q)
    k_(q, k, v, out=out, slopes=slopes)  # warm-up: load the module outside the capture
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        k_(q, k, v, out=out, slopes=slopes)
    for _ in range(2):
        with torch.no_grad():
            q.copy_(torch.randn_like(q.float()).to(q.dtype))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        expected = k_(q, k, v, slopes=slopes)
        torch.cuda.synchronize()
        assert torch.equal(out, expected)


def test_captured_persistent_launches_have_work_tile_counters_of_their_own():
    """A persistent forward's work-tile counter must be zero when a launch starts. A launch captured into a CUDA
    graph gets a counter of its own, zeroed by the graph: two graphs captured on a stream no call ran on before (the
    first call of their call shape inside the capture), an eager call on that stream between the captures and the
    replays, and the graphs replayed in the opposite order, twice each, all give the bits of an eager call on
    another stream, into outputs poisoned with NaN."""
    import torch

    k_ = _kernel(causal=True)
    assert k_.spec.persistent, k_.name
    q, k, v = testing.random_qkv(1, 40, 1000, 1000, 64, "bf16")  # 6 query tiles x 40 heads: 240 work tiles
    want = k_(q, k, v)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    outs = [torch.full_like(q, float("nan")) for _ in range(3)]
    graphs = [torch.cuda.CUDAGraph() for _ in range(2)]
    with torch.cuda.stream(s):
        for g, out in zip(graphs, outs):
            with torch.cuda.graph(g, stream=s):
                k_(q, k, v, out=out)
        k_(q, k, v, out=outs[2])
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    assert torch.equal(outs[2], want)
    for g, out in zip(graphs[::-1], outs[1::-1]):
        for _ in range(2):
            out.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, want)


def _on_two_streams(call_a, call_b, reps=4):
    """call_a on one stream and call_b on another, `reps` times. Each pair waits on one event, recorded after a
    spin of about a millisecond that outlasts queueing both calls: their kernels start together and overlap on the
    GPU. Returns the pairs of results."""
    import torch

    streams = torch.cuda.Stream(), torch.cuda.Stream()
    pairs = []
    for _ in range(reps):
        torch.cuda._sleep(2_000_000)
        gate = torch.cuda.Event()
        gate.record()
        pair = []
        for s, call in zip(streams, (call_a, call_b)):
            s.wait_event(gate)
            with torch.cuda.stream(s):
                pair.append(call())
        pairs.append(pair)
    torch.cuda.synchronize()
    return pairs


def test_decode_calls_of_one_shape_on_two_streams_at_once():
    """A decode call's workspace (partial states, split counts) belongs to its call shape and stream: two calls
    of one shape running at once on two streams give each the bits of a call run alone."""
    import torch

    k_ = fagen.compile(128, causal=True, dtype="bf16", decode=True)
    kc = torch.randn(1, 65536, 2, 128, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    lens = torch.tensor([65536], dtype=torch.int32, device="cuda")
    qa, qb = (torch.randn(1, 1, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    want = [k_.decode(q, kc, vc, lens, num_splits=4) for q in (qa, qb)]
    for a, b in _on_two_streams(
        lambda: k_.decode(qa, kc, vc, lens, num_splits=4), lambda: k_.decode(qb, kc, vc, lens, num_splits=4)
    ):
        assert torch.equal(a, want[0]) and torch.equal(b, want[1])


def test_persistent_forward_calls_of_one_shape_on_two_streams_at_once():
    """A persistent forward's blocks draw work tiles from a counter of its call shape and stream, which the last
    block sets back to zero: calls one after another, and two calls of one shape at once on two streams, each into
    an output poisoned with NaN, give the bits of the first call, itself checked against float64. 1040 work tiles
    (5 query tiles of 192 rows, 208 heads), so that every block draws several."""
    import torch

    k_ = _kernel(causal=True)
    assert k_.spec.persistent, k_.name
    B, H, M, D = 2, 104, 900, 64
    qs = [testing.random_qkv(B, H, M, M, D, "bf16") for _ in range(2)]

    def run(i):
        out = torch.full((B, H, M, D), float("nan"), dtype=torch.bfloat16, device="cuda")
        return k_(*qs[i], out=out)

    want = [run(0), run(1)]
    torch.cuda.synchronize()
    q, k, v = qs[0]
    keep = testing.keep_matrix(k_, B, H, M, M)
    ref, _ = testing.reference(q, k, v, keep, k_.default_scale)
    naive, _ = testing.reference(q, k, v, keep, k_.default_scale, dtype=torch.bfloat16)
    assert (
        float((want[0].double() - ref).abs().max())
        <= 2 * float((naive.double() - ref).abs().max()) + testing.FLOOR["bf16"]
    )
    for _ in range(3):
        assert torch.equal(run(0), want[0]) and torch.equal(run(1), want[1])
    for a, b in _on_two_streams(lambda: run(0), lambda: run(1)):
        assert torch.equal(a, want[0]) and torch.equal(b, want[1])


def test_backward_calls_of_one_shape_on_two_streams_at_once():
    """The backward's workspaces (D, the dQ accumulator, the tensor-gradient partials) belong to a call shape
    and stream: two deterministic backward calls at once on two streams give the bits of each run alone."""
    import torch

    k_ = _kernel(causal=True, alibi=True)
    q, k, v = testing.random_qkv(1, 2, 2048, 2048, 64, "bf16")
    slopes = torch.tensor(fagen.alibi_slopes(2), device="cuda")
    o, lse = k_(q, k, v, return_lse=True, slopes=slopes)
    dos = [torch.randn_like(q) for _ in range(2)]

    def grads(do):
        g = k_.backward(q, k, v, o, lse, do, deterministic=True, slopes=slopes)
        return (g.dq, g.dk, g.dv, g.tensors["slopes"])

    want = [grads(do) for do in dos]
    for pair in _on_two_streams(lambda: grads(dos[0]), lambda: grads(dos[1])):
        for got, expected in zip(pair, want):
            for a, b in zip(got, expected):
                assert torch.equal(a, b)


def test_a_decode_and_a_backward_on_two_streams_at_once():
    """A decode on one stream and a backward on another, released together, each give the bits of the call run
    alone (their workspaces belong to their call shape and stream)."""
    import torch

    dec = fagen.compile(128, causal=True, dtype="bf16", decode=True)
    kc = torch.randn(1, 65536, 2, 128, device="cuda", dtype=torch.bfloat16)
    vc, lens = torch.randn_like(kc), torch.tensor([65536], dtype=torch.int32, device="cuda")
    qd = torch.randn(1, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
    fwd = _kernel(causal=True, alibi=True)
    q, k, v = testing.random_qkv(1, 2, 2048, 2048, 64, "bf16")
    slopes = torch.tensor(fagen.alibi_slopes(2), device="cuda")
    o, lse = fwd(q, k, v, return_lse=True, slopes=slopes)
    do = torch.randn_like(q)

    def grads():
        g = fwd.backward(q, k, v, o, lse, do, deterministic=True, slopes=slopes)
        return (g.dq, g.dk, g.dv, g.tensors["slopes"])

    want_o, want_g = dec.decode(qd, kc, vc, lens, num_splits=4), grads()
    for a, b in _on_two_streams(lambda: dec.decode(qd, kc, vc, lens, num_splits=4), grads):
        assert torch.equal(a, want_o)
        assert all(torch.equal(x, y) for x, y in zip(b, want_g))


def test_a_block_mask_first_used_on_two_streams_at_once():
    """A block mask's tables belong to the stream that built them: a block mask first used by two flex_attention
    calls released together on two streams (the first stream's build still waiting behind the gate when the second
    call is queued) gives each the output of a call run alone."""
    import torch

    def mask(b, h, q, k):
        return (q // 300 == k // 300) & (q >= k)

    q, k, v = testing.random_qkv(1, 4, 2000, 2000, 64, "bf16")
    want = fagen.flex_attention(q, k, v, block_mask=fagen.create_block_mask(mask, 1, 1, 2000, 2000, device="cpu"))
    masks = iter([fagen.create_block_mask(mask, 1, 1, 2000, 2000, device="cpu") for _ in range(4)])
    shared: list = []

    def first_use():
        shared.append(next(masks))
        return fagen.flex_attention(q, k, v, block_mask=shared[-1])

    for a, b in _on_two_streams(first_use, lambda: fagen.flex_attention(q, k, v, block_mask=shared[-1])):
        assert torch.equal(a, want) and torch.equal(b, want)


def test_inputs_that_require_grad_get_a_grad_fn_and_the_fast_path_stays():
    import torch

    k_ = _kernel()
    q, k, v = testing.random_qkv(1, 2, 64, 64, 64, "bf16")
    q.requires_grad_()
    o = k_(q, k, v)
    assert o.grad_fn is not None
    o.float().sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
    with torch.no_grad():
        assert k_(q, k, v).grad_fn is None
    assert k_(q.detach(), k, v).grad_fn is None


def _packed(lens_q, lens_k, H=2, D=64):
    import torch

    q = torch.randn(sum(lens_q), H, D, device="cuda").bfloat16()
    k = torch.randn(sum(lens_k), H, D, device="cuda").bfloat16()
    v = torch.randn(sum(lens_k), H, D, device="cuda").bfloat16()

    def cu(lens):
        return torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device="cuda")

    return q, k, v, cu(lens_q), cu(lens_k)


def test_varlen_offsets_are_validated_on_request(monkeypatch):
    import torch

    k_ = _kernel(causal=True)
    q, k, v, cu_q, cu_k = _packed([5, 7], [5, 9])
    bad = [
        (torch.tensor([0, 5, 40], dtype=torch.int32, device="cuda"), cu_k, 7, 9, "cu_seqlens_q: the last offset 40"),
        (torch.tensor([0, 9, 5], dtype=torch.int32, device="cuda"), cu_k, 9, 9, "cu_seqlens_q: offsets must"),
        (cu_q, cu_k, 6, 9, "max_seqlen_q: 6 is below the longest sequence"),
    ]
    for cq, ck, mq, mk, fragment in bad:
        with pytest.raises(ValueError, match=fragment):
            k_.varlen(q, k, v, cq, ck, mq, mk, validate=True)
    monkeypatch.setenv("FAGEN_VALIDATE", "1")
    with pytest.raises(ValueError, match="max_seqlen_q"):
        k_.varlen(q, k, v, cu_q, cu_k, 6, 9)


def test_varlen_offsets_past_the_arrays_never_read_or_write_outside_them():
    """Without validate, bad offsets are clamped in the kernel: no illegal access, and the context stays
    usable (a later call is right)."""
    import torch

    k_ = _kernel(causal=True)
    q, k, v, cu_q, cu_k = _packed([5, 7], [5, 9])
    wild = torch.tensor([0, 5, 1 << 30], dtype=torch.int32, device="cuda")
    k_.varlen(q, k, v, wild, torch.tensor([-7, 3, 1 << 30], dtype=torch.int32, device="cuda"), 64, 64)
    torch.cuda.synchronize()  # an illegal access would raise here
    r = testing.check_kernel(k_, B=1, H=2, M=100, N=100)
    assert r.ok, r
