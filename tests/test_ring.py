"""Context parallelism on the CPU: fagen.ring's layouts, its plan (the proven key ranges against brute force, the
pruned steps), its merge (against the proven split-KV merge) and the ring itself over gloo with W = 2 and 4
processes, each piece run by fagen's NumPy executor in float64 on the piece's own program (what the GPU's kernels
compile), against attention on the gathered sequence written out by hand, for outputs and gradients."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

import fagen
from fagen import ring
from fagen.request import options_source

from . import ring_cases
from .ring_cases import Case

_FUSED: dict = {}  # program text -> (fused, derived backward): made once, shared by forked ranks


class ExecutorStep:
    """A piece in float64 by fagen.tools.executor: the piece's program fused, run forward (o, lse) and through its
    derived backward from the final o and lse (what KernelStep does with the kernels)."""

    @staticmethod
    def programs(work):
        from fagen.passes import backward, fuse

        found = _FUSED.get(work.text)
        if found is None:
            fused = fuse.fuse(work.program)
            found = _FUSED[work.text] = (fused, backward.derive(fused, work.program))
        return found

    @staticmethod
    def _np(tensors: dict) -> dict:
        return {n: t.detach().cpu().numpy() for n, t in tensors.items()}

    def forward(self, q, k, v, work, scale, tensors, deterministic=False):
        import torch

        from fagen.tools import executor

        fused, _ = self.programs(work)
        ev = executor.run(fused, self._np(dict(q=q, k=k, v=v)), scale=scale, tensors=self._np(tensors))
        return torch.from_numpy(ev.outputs["o"]).to(q.dtype), torch.from_numpy(ev.lse["o"])

    def backward(self, q, k, v, o, lse, do, work, scale, tensors, deterministic=False, wanted=frozenset()):
        import torch

        from fagen.tools import executor

        _, derived = self.programs(work)
        args = self._np(dict(q=q, k=k, v=v, o=o, do=do, lse=lse))
        out = executor.run(derived, args, scale=scale, tensors=self._np(tensors)).outputs
        grads = tuple(torch.from_numpy(out[n]).to(x.dtype) for n, x in (("dq", q), ("dk", k), ("dv", v)))
        given = {n: torch.from_numpy(out[f"d{n}"]) for n in work.reads if n in wanted}
        return (*grads, given)


def distributed_torch():
    """torch, for a ring whose ranks run over gloo: a skip where torch or torch.distributed is missing."""
    torch = pytest.importorskip("torch")
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    return torch


def warm(case: Case) -> None:
    """Fuse every piece program of every rank's plan before the ranks fork (SymPy once, not once a rank)."""
    import torch

    for text, (piece, program, _) in ring_cases.piece_programs(case, torch).items():
        ExecutorStep.programs(ring.Work(piece, program, text, ring.tensors_read(program)))


def check(case: Case, tol=1e-9):
    """The ring's o, dq, dk, dv against the float64 formula on the gathered sequence, and the gradients of the
    case's call-time tensors (rank 0's: the group's sum with tensor_grads='sum'; every rank's summed with 'local')."""
    torch = distributed_torch()
    warm(case)
    grads: list = []
    got, counts, sends = ring_cases.launch(case, make_local=ExecutorStep, grads=grads)
    q, k, v, do = ring_cases.inputs(case, torch, torch.float64, "cpu")
    want, want_tensors = ring_cases.reference_with_tensors(case, q, k, v, do, torch)
    for name, x, y in zip(("o", "dq", "dk", "dv"), got, want):
        err = float((x - y).abs().max())
        assert err <= tol, f"{case.name}: {name} max error {err:.3e}"
    for i, name in enumerate(case.grads):
        ranks = [g[i] for g in grads]
        total = ranks[0] if case.tensor_grads == "sum" else sum(ranks)
        err = float((total - want_tensors[name]).abs().max())
        limit = 1e-6 * max(1.0, float(want_tensors[name].abs().max()))  # the tensors are float32, so are their grads
        assert err <= limit, f"{case.name}: d{name} max error {err:.3e} > {limit:.3e}"
        if case.tensor_grads == "sum":  # every rank holds the same, whole gradient
            assert all(torch.equal(r, ranks[0]) for r in ranks), name
    return counts, sends, grads


# --- layouts -------------------------------------------------------------------------------------------------------
def test_zigzag_gives_rank_r_chunks_r_and_2w_minus_1_minus_r():
    torch = pytest.importorskip("torch")
    assert ring.segments(16, 2, "zigzag") == (((0, 4), (12, 16)), ((4, 8), (8, 12)))
    assert ring.segments(16, 4, "contiguous")[3] == ((12, 16),)
    x = torch.arange(16).view(1, 1, 16, 1)
    assert ring.shard(x, layout="zigzag", rank=1, world=2).flatten().tolist() == [4, 5, 6, 7, 8, 9, 10, 11]


def test_layout_errors_name_the_argument():
    with pytest.raises(ValueError, match="layout"):
        ring.segments(16, 2, "striped")
    with pytest.raises(ValueError, match="equal chunks"):
        ring.segments(18, 2, "zigzag")


# --- the plan --------------------------------------------------------------------------------------------------------
def _brute(keep, q0, q1, k0, k1) -> str:
    block = keep[q0:q1, k0:k1]
    return ring.FULL if bool(block.all()) else ring.PARTIAL if bool(block.any()) else ring.NONE


@pytest.mark.parametrize(
    "opts", [dict(causal=True), dict(causal=True, window=5), dict(window=(3, 6)), dict(softcap=5.0), dict()]
)
def test_classify_matches_brute_force(opts):
    """Visible-nowhere, visible-everywhere and partly visible key blocks, from the proven key ranges, agree with the
    mask evaluated on every (query, key) pair; only 'partial' may be conservative (never here: these masks are
    exact)."""
    torch = pytest.importorskip("torch")
    T = 40
    pieces = ring.split_program(options_source(**opts).build(), T)
    case = Case("c", 1, T, causal=opts.get("causal", False), window=opts.get("window"))
    keep = ring_cases.keep_matrix(case, torch)
    rnd = random.Random(7)
    for _ in range(300):
        q0, k0 = rnd.randrange(T), rnd.randrange(T)
        q1, k1 = rnd.randrange(q0 + 1, T + 1), rnd.randrange(k0 + 1, T + 1)
        assert ring.classify(pieces, q0, q1, k0, k1) == _brute(keep, q0, q1, k0, k1), (q0, q1, k0, k1)


def test_a_window_exchanges_with_its_left_neighbour_only():
    """causal + window 64 over 4 contiguous shards of 256: rank r needs rank r-1 and no other; 3 messages of W(W-1)."""
    pieces = ring.split_program(options_source(causal=True, window=64).build(), 1024)
    plan = ring.make_plan(pieces, 4, "contiguous")
    assert plan.messages() == 3
    assert plan.sent_rows() == 3 * 64  # the 64 keys before each shard's first query, not its 256
    for r in range(4):
        assert [s for s in range(4) if plan.needs(r, s)] == sorted({r, max(r - 1, 0)})
        assert set(plan.exchanges(r)) == ({1} if r in (0, 3) else {1})


def test_causal_zigzag_needs_every_rank_and_joins_full_pieces():
    """Zigzag causal: every rank needs every other (each sees half of each other shard), one kernel call a step."""
    plan = ring.make_plan(ring.split_program(options_source(causal=True).build(), 64), 4, "zigzag")
    assert plan.messages() == 12
    for r in range(4):
        for s in range(4):
            if s != r:
                (piece,) = plan.pieces[r][s]
                assert piece.full
                assert piece.rows[1] - piece.rows[0] + piece.keys[1] - piece.keys[0] == 24  # 16 x 8 or 8 x 16


def test_schedule_sums_in_float32_only_where_pieces_overlap():
    """A pass starts from its own step's result where that covers the shard; only the rows other pieces write (the
    forward's merge, dQ) and the keys they or other ranks add to (dK/dV) are held in float32: for a 64-token window
    over shards of 256, the first 64 rows and the last 64 keys, not the shard (no full-size float32 buffers)."""
    plan = ring.plan(1024, 4, "contiguous", causal=True, window=64)
    assert ring.schedule(plan, 0, 256) == ring.Schedule(plan.pieces[0][0][0], None, (192, 256))  # nothing to merge
    assert ring.schedule(plan, 2, 256) == ring.Schedule(plan.pieces[2][2][0], (0, 64), (192, 256))
    assert ring.schedule(plan, 3, 256) == ring.Schedule(plan.pieces[3][3][0], (0, 64), None)  # nobody reads rank 3
    causal = ring.plan(1024, 4, "zigzag", causal=True)  # every step writes every row: the shard sums
    assert ring.schedule(causal, 1, 256) == ring.Schedule(causal.pieces[1][1][0], (0, 256), (0, 256))
    alibi = ring.make_plan(ring.split_program(options_source(causal=True, alibi=True).build(), 1024), 4, "zigzag")
    assert ring.schedule(alibi, 1, 256) == ring.Schedule(None, (0, 256), (0, 256))  # own step in pieces: from 0


def test_piece_programs_are_shared_by_pieces_at_the_same_distance():
    """The diagonal pieces of every rank run one program (k - q <= 0 after the shift), not one per position."""
    pieces = ring.split_program(options_source(causal=True).build(), 64)
    plan = ring.make_plan(pieces, 4, "zigzag")
    texts = {str(ring.piece_program(pieces, p)) for r in range(4) for p in plan.pieces[r][r] if not p.full}
    assert len(texts) == 1


# --- the merge -------------------------------------------------------------------------------------------------------
def test_a_pass_makes_each_sent_span_dense_once():
    """A zigzag rank's first chunk goes to every rank after it: one dense copy a pass, not one a send; a span one rank
    reads is copied for that send alone (not kept), and a span that is the whole (dense) shard is sent as it is."""
    torch = pytest.importorskip("torch")
    k, v = torch.randn(2, 3, 8, 4), torch.randn(2, 3, 8, 4)
    inflight = ring._Inflight(links=None, shared=frozenset({(0, 4)}))
    first = inflight.dense((0, 4), k, v)
    assert inflight.dense((0, 4), k, v) is first
    assert all(x.is_contiguous() and torch.equal(x, y[:, :, 0:4]) for x, y in zip(first, (k, v)))
    once = inflight.dense((4, 6), k, v)
    assert inflight.dense((4, 6), k, v) is not once and (4, 6) not in inflight.spans
    whole = inflight.dense((0, 8), k, v)
    assert whole[0].data_ptr() == k.data_ptr() and whole[1].data_ptr() == v.data_ptr()


def test_the_spans_kept_a_pass_are_those_several_ranks_read():
    from types import SimpleNamespace

    def shared(plan, rank):
        return ring.Ring.shared_spans.func(SimpleNamespace(plan=plan, rank=rank))

    zigzag = ring.plan(64, 4, "zigzag", causal=True)  # chunks of 8: rank 0 holds 0 and 7, ranks 1-3 read chunk 0
    assert shared(zigzag, 0) == {(0, 8)}
    assert shared(zigzag, 3) == {(0, 16)}  # every rank reads both of its chunks: the whole shard (sent as it is)
    window = ring.plan(64, 4, "contiguous", causal=True, window=4)  # the right neighbour alone reads each rank
    assert all(shared(window, r) == frozenset() for r in range(4))


def test_the_backward_runs_its_own_step_last_where_every_rank_reads_every_other():
    """A dense plan (causal zigzag: every rank reads every other's keys) runs the own step last, so that the whole
    shards' dK/dV partials come back while it runs; a pruned one (a window) keeps it first. The order is the plan's,
    the same on every rank (a pass's messages pair up by position)."""
    from types import SimpleNamespace

    def order(plan):
        return ring.Ring.backward_order.func(SimpleNamespace(plan=plan, world=plan.world))

    assert order(ring.plan(64, 4, "zigzag", causal=True)) == (1, 2, 3, 0)
    assert order(ring.plan(64, 4, "contiguous", causal=True, window=4)) == (0, 1, 2, 3)
    assert order(ring.plan(64, 1, "zigzag", causal=True)) == (0,)


def test_merge_is_the_proven_split_kv_merge():
    """The torch merge against the proven rule's expressions (online_softmax.make_merge on states m = lse·log2(e),
    l = 1, acc = o), the empty state (lse = -inf) included."""
    torch = pytest.importorskip("torch")
    import sympy as sp

    from fagen.math import online_softmax as osm
    from fagen.pipeline import lower

    steps = lower(fagen.ir.variants.build(causal=True), "f32")
    rule = steps[-1].facts["lowering"].rule.concrete()
    rule_merge = osm.make_merge(rule)
    cases = [(0.3, -1.2), (5.0, 5.0), (-math.inf, 2.0), (1.5, -math.inf), (-math.inf, -math.inf)]
    for la, lb in cases:
        oa, ob = 0.7, -0.4
        out, lse = torch.tensor([[oa]]), torch.tensor([la])
        if la == -math.inf:
            out.zero_()
        ring.merge(out, lse, torch.tensor([[ob if lb != -math.inf else 0.0]]), torch.tensor([lb]))
        log2e = 1 / math.log(2)
        a = (sp.Float(la * log2e) if la > -math.inf else -sp.oo, sp.Integer(1 if la > -math.inf else 0), sp.Float(oa))
        b = (sp.Float(lb * log2e) if lb > -math.inf else -sp.oo, sp.Integer(1 if lb > -math.inf else 0), sp.Float(ob))
        m, l_sum, acc = rule_merge.apply(a, b)
        m_use = float(rule_merge.m_use.xreplace({osm.m_new: m}))
        if float(l_sum) == 0:
            assert lse.item() == -math.inf and out.item() == 0.0
        else:
            assert out.item() == pytest.approx(float(acc) / float(l_sum), rel=1e-6)
            assert lse.item() == pytest.approx((m_use + math.log2(float(l_sum))) * math.log(2), rel=1e-6, abs=1e-6)


# --- the ring over gloo ----------------------------------------------------------------------------------------------
def test_ring_causal_zigzag_w2_gqa():
    counts, _, _ = check(Case("causal", 2, 32, causal=True, H=4, Hkv=2))
    assert counts == [6, 6]  # K, V in the forward and again in the backward, then dK, dV: to the one other rank


def test_ring_causal_zigzag_w4_softcap():
    counts, _, _ = check(Case("causal_softcap", 4, 64, causal=True, softcap=3.0))
    assert counts == [3 * 6] * 4


def test_ring_window_is_pruned_w4():
    """causal + window 6 over 4 contiguous shards of 16: K/V go to the right neighbour only, dK/dV back to the left;
    no message for the steps the key ranges rule out."""
    counts, sends, _ = check(Case("window", 4, 64, layout="contiguous", causal=True, window=6))
    assert counts == [4, 6, 6, 2]
    for r, sent in enumerate(sends):  # only the 6 keys of a shard the right neighbour's window reaches travel
        want = ([(r + 1, 6)] * 4 if r < 3 else []) + ([(r - 1, 6)] * 2 if r > 0 else [])
        assert sorted(map(tuple, sent)) == sorted(want), (r, sent)


def test_ring_under_torch_compile_w2():
    """Inside a torch.compile'd function the ring runs eagerly (a graph break), forward and backward."""
    check(Case("compiled", 2, 32, causal=True, compiled=True))


def test_ring_alibi_zigzag_w2():
    """ALiBi reads positions: every piece runs its score at its own positions (no piece joined, no shortcut)."""
    check(Case("alibi", 2, 32, causal=True, alibi=True))


def test_ring_alibi_slopes_gradient_w2():
    """ALiBi slopes that require grad: each piece's dslopes (at its own positions), summed over the steps and the
    ranks, is the gathered sequence's."""
    check(Case("alibi_grad", 2, 32, causal=True, alibi=True, grads=("slopes",), H=4, Hkv=2))


def test_ring_captured_tensor_gradient_pruned_window_w4():
    """A score function's captured tensor kb[k] that requires grad, under a pruned window: each piece reads kb at its
    keys' global positions (kb[k + k0]) and scatters its gradient there; the sum over pieces and ranks is the
    gathered sequence's."""
    check(Case("bias_grad", 4, 64, layout="contiguous", causal=True, window=6, key_bias=True, grads=("kb",)))


def test_ring_tensor_grads_local_is_each_ranks_share_w2():
    """tensor_grads='local': each rank keeps its own queries' share (no reduction); the shares sum to the gathered
    sequence's gradient."""
    torch = pytest.importorskip("torch")
    case = Case("bias_local", 2, 32, causal=True, key_bias=True, alibi=True, grads=("kb", "slopes"))
    _, _, grads = check(dataclasses.replace(case, tensor_grads="local"))
    assert not torch.allclose(grads[0][0], grads[1][0])  # two different shares, not the whole twice


def test_ring_document_mask_w2():
    check(Case("doc_mask", 2, 32, layout="contiguous", causal=True, doc_mask=(0, 5, 20, 21, 32)))


def test_ring_packed_documents_w4():
    check(Case("varlen", 4, 64, causal=True, docs=(0, 9, 30, 31, 50, 64), H=2, Hkv=1))


def test_errors_name_the_argument():
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match="q: expected 4 dimensions"):
        fagen.ring_attention(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="cu_seqlens"):
        ring._documents([0, 5, 3, 8], 8)
    with pytest.raises(ValueError, match="tensor_grads"):
        ring._grads_mode("mean")
    with pytest.raises(ValueError, match="transport: expected one of auto, copy, nccl"):
        ring._transport("rdma")
    links = ring.Links.__new__(ring.Links)  # (no process group needed to refuse)
    links.transport, links.world = "copy", 2
    with pytest.raises(ValueError, match="transport: 'copy' needs CUDA tensors"):
        links.mailboxes(torch.device("cpu"))
    links.transport = "auto"
    assert links.mailboxes(torch.device("cpu")) is None  # NCCL's (gloo's) links


# --- the benchmark's arithmetic and the model ----------------------------------------------------------------------
def test_bench_counts_the_pairs_a_causal_window_keeps():
    torch = pytest.importorskip("torch")
    from fagen.tools.bench import context_parallel as cp

    for T, L in ((10, None), (10, 3), (64, 63), (64, 64), (100, 7)):
        keep = ring_cases.keep_matrix(Case("p", 1, T, causal=True, window=L), torch)
        assert cp.pairs(T, L) == int(keep.sum())


def _bench_row(**changes):
    row = dict(world=2, tokens=1024, per_gpu=512, ring=0.010, torch_cp=0.0125, one_whole=0.019, one_shard=0.005)
    row.update(
        torch_cp_rotation="alltoall", torch_cp_error=0.004, torch_cp_times=dict(allgather=0.013, alltoall=0.0125)
    )
    row.update(window=64, window_tokens=2048, ring_window=0.0033, one_window_shard=0.003, bandwidth=4e11)
    return {**row, "gpu": "NVIDIA H100 80GB HBM3", **changes}


def test_bench_table_reports_speedup_efficiency_and_the_peer():
    from fagen.tools.bench import context_parallel as cp

    text = "\n".join(cp.table([_bench_row(), dict(world=4, error="rank 1: Traceback ...\nRuntimeError: boom")]))
    assert "| 2 | 1024 | 10.0 |" in text and "1.90×" in text and "95%" in text and "1.25×" in text
    assert "alltoall, 0.004" in text and "allgather 13.0 ms" in text  # the faster rotation, its output checked
    assert "1.10×" in text  # the pruned window against one GPU's shard
    assert "RuntimeError: boom" in text
    assert "⚠" not in text  # every figure plausible
    assert "ring / Ulysses" in "\n".join(cp.model_lines([_bench_row()]))


def test_bench_flags_a_figure_past_the_gpus_peak_and_a_peer_with_another_output():
    """A time that implies more TFLOP/s a GPU than the GPU's peak (torch's peer at 221 ms on 2 H200s for 128k
    tokens: over 1,100) is marked, with a warning, never reported silently; so is a peer whose output is not
    fagen's ring's."""
    from fagen.tools.bench import context_parallel as cp

    assert cp.peak_tflops("NVIDIA H200") == 989 and cp.peak_tflops("NVIDIA H100 PCIe") == 756
    assert cp.peak_tflops("Some GPU") is None
    T = 131072
    fast = _bench_row(tokens=T, per_gpu=T // 2, ring=0.478, torch_cp=0.221, one_whole=0.9, one_shard=0.25)
    fast.update(window_tokens=2 * T, ring_window=0.08, one_window_shard=0.07, gpu="NVIDIA H200")
    assert cp.tflops(T, 0.221, gpus=2) > 989
    assert set(cp.implausible(fast)) == {"torch CP"}
    text = "\n".join(cp.table([fast]))
    assert "221.0 ⚠" in text and "past the NVIDIA H200's peak of 989" in text
    wrong = _bench_row(torch_cp_error=0.6)
    assert set(cp.implausible(wrong)) == {"torch CP output"}
    assert "alltoall, 0.6 ⚠" in "\n".join(cp.table([wrong]))
    unchecked = _bench_row()
    del unchecked["torch_cp_error"]
    assert "was not checked" in cp.implausible(unchecked)["torch CP output"]
    assert cp.implausible(_bench_row(gpu="Some GPU", ring=1e-6)) == {}  # no peak known: no check


def test_model_ring_hides_long_sequences_and_ulysses_needs_heads():
    """Compute grows as n², a step's transfer as n: the ring hides its transfers past a length; all-to-all needs a
    head a GPU."""
    step = dict(step_seconds=0.25, step_tokens=65536, link=400e9)
    long = ring.model(1 << 20, 8, **step)
    short = ring.model(1 << 14, 8, **step)
    assert long["hides"] and not short["hides"]
    assert ring.model(1 << 20, 64, **step)["ulysses"] is None  # 64 GPUs > 32 heads
    assert short["ulysses"] < short["ring"]  # exposed transfers: all-to-all wins
    assert len(ring.model_table(**step)) == 6


# --- the ring through fagen's ops: KernelStep and the fagen:: torch ops, the executor in the kernels' place ----------
class ExecutorKernel:
    """A compiled kernel's interface (call with return_lse, backward from o and lse, backward_rows) over the
    executor, in float64: what ops._compile returns in the test below, so that KernelStep, ops.kernel_key and
    torch.ops.fagen run as they do on a GPU. `round_o`: the backward reads o rounded to bfloat16, as a 16-bit kernel's
    D does (contract: rowstat), so that E_i = sum_j dS_ij is not 0; backward then takes sum_i E_i R_i off each
    name[h] tensor's sums, over the call's keys, as Kernel.backward does, and backward_rows leaves them to the ring."""

    has_backward = True
    capture_roles: dict = {}

    def __init__(self, program, round_o=False):
        self.step, self.text, self.round_o = ExecutorStep(), str(program), round_o
        self.work = ring.Work(None, program, self.text, ring.tensors_read(program))
        self.name, self.tensors = f"ring_exec_{abs(hash(self.text)):x}", self.work.reads

    def __call__(self, q, k, v, *, scale=None, return_lse=False, **tensors):
        o, lse = self.step.forward(q, k, v, self.work, scale, tensors)
        return (o, lse) if return_lse else o

    def _run(self, q, k, v, o, lse, do, scale, tensors, float32_dkv=False):
        """dq, dk, dv (float32 or wider where float32_dkv), the tensors' uncorrected sums and the row sums
        (fagen.runtime.backward.RowSums or None)."""
        from types import SimpleNamespace

        import torch

        from fagen.runtime.backward import RowSums
        from fagen.tools import executor

        _, derived = ExecutorStep.programs(self.work)
        o = o.to(torch.bfloat16).to(o.dtype) if self.round_o else o
        args = ExecutorStep._np(dict(q=q, k=k, v=v, o=o, do=do, lse=lse))
        ev = executor.run(derived, args, scale=scale, tensors=ExecutorStep._np(tensors), rows=True)
        wide = (lambda x: torch.promote_types(x.dtype, torch.float32)) if float32_dkv else (lambda x: x.dtype)
        dq, dk, dv = (
            torch.from_numpy(ev.outputs[n]).to(t(x))
            for n, x, t in (("dq", q, lambda x: x.dtype), ("dk", k, wide), ("dv", v, wide))
        )
        raw = {n: torch.from_numpy(ev.outputs[f"d{n}"]) for n in self.tensors if f"d{n}" in ev.outputs}
        r = {key: torch.from_numpy(x) for key, x in ev.rows.items() if key != "E"}
        shapes = {n: tuple(t.shape) for n, t in tensors.items()}
        rows = RowSums(torch.from_numpy(ev.rows["E"]), r, shapes) if r else None
        return SimpleNamespace(dq=dq, dk=dk, dv=dv, tensors=raw), rows

    def backward(
        self, q, k, v, o, lse, do, *, scale=None, deterministic=False, tensor_grads=True, float32_dkv=False, **tensors
    ):
        from fagen.runtime.backward import corrected

        g, rows = self._run(q, k, v, o, lse, do, scale, tensors, float32_dkv)
        if rows is not None:
            g.tensors = corrected(g.tensors, *rows)
        g.tensors = g.tensors if tensor_grads else {}
        return g

    def backward_rows(self, q, k, v, o, lse, do, *, scale=None, deterministic=False, float32_dkv=False, **tensors):
        return self._run(q, k, v, o, lse, do, scale, tensors, float32_dkv)


@pytest.mark.parametrize(
    "case",
    [
        Case("kernel_step", 2, 32, layout="zigzag", causal=True, softcap=4.0, H=4, Hkv=2),
        Case("kernel_step_grads", 2, 32, layout="contiguous", causal=True, window=5, key_bias=True, grads=("kb",)),
        # O read in 16 bits: E_i != 0, and the slopes' correction spans a row's pieces (its keys over the steps)
        Case("kernel_step_rows", 2, 32, causal=True, alibi=True, grads=("slopes",), H=4, Hkv=2, extra={"bf16_o": 1}),
        # kb's gradient asked for, not the slopes': their row sums come back and correct nothing
        Case("kernel_step_kb_not_slopes", 2, 32, causal=True, alibi=True, key_bias=True, grads=("kb",)),
    ],
    ids=lambda c: c.name,
)
def test_ring_through_fagen_ops_w2(monkeypatch, case):
    """The default local step (KernelStep): each piece's program compiled through ops.kernel_key and run by
    torch.ops.fagen.attention and Kernel.backward (float32 dK, dV), or Kernel.backward_rows where a tensor's gradient
    is asked for;
    here the compiler returns the executor behind a kernel's interface. kernel_step_rows: the backward reads o in
    bfloat16, as a 16-bit kernel does, so that the slopes' gradient is right only where the ring corrects it with
    the row sums of every piece of a row at once (dq, dk, dv then carry o's rounding: a looser bound)."""
    torch = distributed_torch()
    from fagen import ops

    bf16_o = bool(case.extra.get("bf16_o"))
    monkeypatch.setattr(ops, "_MEMO", {})
    monkeypatch.setattr(ops, "_KERNELS", {})
    monkeypatch.setattr(ops, "_compile", lambda request: ExecutorKernel(request.program(), round_o=bf16_o))
    warm(case)
    grads: list = []
    got, _, _ = ring_cases.launch(case, dtype="float32", grads=grads)  # a dtype fagen compiles for (float32 sums)
    inputs = ring_cases.inputs(case, torch, torch.float64, "cpu")
    want, want_tensors = ring_cases.reference_with_tensors(case, *inputs, torch)
    for name, x, y in zip(("o", "dq", "dk", "dv"), got, want):
        assert float((x.double() - y).abs().max()) <= (2e-2 if bf16_o and name != "o" else 2e-5), name
    for i, name in enumerate(case.grads):
        assert float((grads[0][i] - want_tensors[name]).abs().max()) <= 2e-5 * float(want_tensors[name].abs().max())


def test_bench_context_parallel_parses_and_is_its_own_mode():
    from fagen.tools import cli
    from fagen.tools.bench import cases

    args = cli.parser().parse_args(
        ["bench", "--context-parallel", "--gpus", "2,4", "--seqlen", "65536", "--window", "0"]
    )
    assert cases.selection(args) == ("context_parallel", [])
    assert (args.gpus, args.seqlen, args.window) == ((2, 4), (65536,), 0)


def test_bench_times_the_ring_and_torchs_rotations_in_turn_in_rotated_order():
    """BENCH.md: several rounds in rotated order, so that drift between the contenders (clocks, heat) falls on all."""
    from types import SimpleNamespace

    from fagen.tools.bench import context_parallel as cp

    assert cp.rotated(["ring", "allgather", "alltoall"], 4) == [
        ("ring", "allgather", "alltoall"),
        ("allgather", "alltoall", "ring"),
        ("alltoall", "ring", "allgather"),
        ("ring", "allgather", "alltoall"),
    ]
    calls: list = []
    reduced: list = []
    fake = SimpleNamespace(
        distributed=SimpleNamespace(
            barrier=lambda: None, all_reduce=lambda t, op: reduced.append(op), ReduceOp=SimpleNamespace(MAX="max")
        ),
        cuda=SimpleNamespace(synchronize=lambda: None),
        tensor=lambda values, device, dtype: SimpleNamespace(tolist=lambda: list(values)),
        float64="float64",
    )
    steps = {name: (lambda name=name: calls.append(name)) for name in ("ring", "allgather")}
    got = cp._timed_in_turn(fake, steps, rounds=3)
    assert set(got) == {"ring", "allgather"} and all(t >= 0 for t in got.values())
    timed = calls[2 * cp.WARMUP :]
    assert timed == ["ring", "allgather", "allgather", "ring", "ring", "allgather"]
    assert reduced == ["max"]  # the slowest rank's medians, in one reduction
