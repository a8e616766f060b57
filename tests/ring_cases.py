"""What the ring's tests share, CPU (gloo, a float64 local step) and GPU (NCCL, fagen's kernels): the cases, the
float64 reference on the gathered sequence, and a launcher of W processes that each run one case.

A case runs on every rank: the whole sequence is made from one seed on every rank, sharded, attended by the ring,
and its output and gradients gathered (fagen.ring.unshard); rank 0 returns them with the P2P messages each rank
sent (recorded around torch.distributed.batch_isend_irecv), and the test compares them with the reference.
"""

from __future__ import annotations

import datetime
import math
import os
import socket
import traceback
from dataclasses import dataclass, field

for _name, _value in (
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
):
    os.environ.setdefault(_name, _value)  # NVLink multicast stays off in every process the tests start


@dataclass(frozen=True)
class Case:
    """One ring call: W ranks, the sequence of T tokens, heads H (Hkv for K/V), head dim D, the layout, the options
    (`docs`: packed documents' boundaries, run by ring_attention_varlen; `doc_mask`: a mask reading document ids)."""

    name: str
    world: int
    T: int
    layout: str = "zigzag"
    H: int = 2
    Hkv: int = 2
    D: int = 8
    B: int = 1
    causal: bool = False
    window: object = None
    softcap: float | None = None
    docs: tuple | None = None
    doc_mask: tuple | None = None
    alibi: bool = False  # ALiBi slopes[h]·(k - q) (fagen.attention's form), slopes from case_slopes
    key_bias: bool = False  # a score function s + kb[k], kb [T] captured (case_key_bias)
    grads: tuple = ()  # the call-time tensors ("slopes", "kb") that require grad: their gradients are checked
    tensor_grads: str = "sum"  # ring_attention's tensor_grads
    transport: str = "auto"  # ring_attention's transport (GPU: copy engines unless 'nccl')
    compiled: bool = False  # called inside a torch.compile'd function (backend "eager": no C++ compiler needed)
    extra: dict = field(default_factory=dict, compare=False)


def keep_matrix(case: Case, torch):
    """The mask on the gathered sequence, [T, T] bool, written out by hand (no fagen)."""
    T = case.T
    q = torch.arange(T)[:, None]
    k = torch.arange(T)[None, :]
    keep = torch.ones(T, T, dtype=torch.bool)
    if case.causal:
        keep &= k <= q
    if case.window is not None:
        left, right = case.window if isinstance(case.window, tuple) else (case.window, 0 if case.causal else None)
        right = left if right is None else right
        keep &= (q - k <= left) & (k - q <= right)
    for bounds in (case.docs, case.doc_mask):
        if bounds is not None:
            ids = doc_ids(bounds, T, torch)
            keep &= ids[:, None] == ids[None, :]
    return keep


def case_slopes(case: Case, torch, device):
    """ALiBi slopes, one a head (float32, as the kernels read them)."""
    import fagen

    return torch.tensor(fagen.alibi_slopes(case.H), dtype=torch.float32, device=device)


def case_key_bias(case: Case, torch, device, dtype):
    """A per-key score bias kb [T] (the same on every rank), float32 values (as the kernels read them) in `dtype`."""
    g = torch.Generator().manual_seed(77 + case.T)
    return torch.randn(case.T, generator=g, dtype=torch.float32).to(device=device, dtype=dtype)


def doc_ids(bounds, T, torch):
    lengths = torch.tensor([b - a for a, b in zip(bounds, bounds[1:])])
    return torch.repeat_interleave(torch.arange(len(lengths)), lengths).to(torch.int32)


def inputs(case: Case, torch, dtype, device):
    """q [B, H, T, D], k, v [B, Hkv, T, D] and dO, the same on every rank (one seed)."""
    g = torch.Generator().manual_seed(1000 + case.T + 7 * case.world)
    shapes = [(case.B, case.H, case.T, case.D), (case.B, case.Hkv, case.T, case.D), (case.B, case.Hkv, case.T, case.D)]
    q, k, v = (torch.randn(s, generator=g, dtype=torch.float64) for s in shapes)
    do = torch.randn(shapes[0], generator=g, dtype=torch.float64)
    return [x.to(device=device, dtype=dtype) for x in (q, k, v, do)]


def reference(case: Case, q, k, v, do, torch):
    """o, dq, dk, dv of attention on the gathered sequence, in q's dtype's arithmetic (float64 for the reference;
    the input dtype for FlashAttention's 'naive' term), by autograd of the formula."""
    return reference_with_tensors(case, q, k, v, do, torch)[0]


def reference_with_tensors(case: Case, q, k, v, do, torch):
    """reference's (o, dq, dk, dv), and the gradients of the case's call-time tensors in `grads` (by name)."""
    q, k, v = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    rep = case.H // case.Hkv
    kk, vv = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = (q @ kk.transpose(-1, -2)) * (1 / math.sqrt(case.D))
    if case.softcap is not None:
        s = case.softcap * torch.tanh(s / case.softcap)
    given = {}
    if case.alibi:
        given["slopes"] = case_slopes(case, torch, q.device).to(s.dtype).requires_grad_("slopes" in case.grads)
        pos = torch.arange(case.T, device=q.device)
        s = s + given["slopes"].view(1, -1, 1, 1) * (pos[None, :] - pos[:, None])
    if case.key_bias:
        given["kb"] = case_key_bias(case, torch, q.device, s.dtype).requires_grad_("kb" in case.grads)
        s = s + given["kb"]
    keep = keep_matrix(case, torch).to(q.device)
    s = s.masked_fill(~keep, -math.inf)
    p = torch.softmax(s.float() if s.dtype in (torch.float16, torch.bfloat16) else s, dim=-1).to(q.dtype)
    o = p @ vv
    o.backward(do)
    return (o.detach(), q.grad, k.grad, v.grad), {n: given[n].grad for n in case.grads}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def record_sends(torch):
    """Wrap batch_isend_irecv (NCCL's, gloo's links) and the copy engines' sends (fagen.ring_copy) so that every
    tensor's peer and rows (dim 2) are recorded (the list it returns)."""
    from fagen import ring_copy

    dist = torch.distributed
    sent: list = []
    original, copied = dist.batch_isend_irecv, ring_copy.CopyPass._send

    def batch(ops):
        sent.extend((int(op.peer), int(op.tensor.shape[2])) for op in ops if op.op is dist.isend)
        return original(ops)

    def send(self, channel, i, dst, tensors):
        sent.extend((dst, int(x.shape[2])) for x in tensors)
        return copied(self, channel, i, dst, tensors)

    dist.batch_isend_irecv = batch
    ring_copy.CopyPass._send = send
    return sent


def run_case(case: Case, rank: int, device, dtype, local, torch):
    """One rank's part: shard, ring, backward, gather. Returns (o, dq, dk, dv, this rank's gradients of the case's
    `grads` tensors, messages sent by each rank, the peers and rows this rank sent)."""
    import fagen
    from fagen import ring

    dist = torch.distributed
    q, k, v, do = inputs(case, torch, dtype, device)
    packed = case.docs is not None
    dim = 0 if packed else 2

    def to_local(x, grad=True):
        x = x[0].permute(1, 0, 2) if packed else x  # packed: [T, H, D] of the batch's one sequence
        return ring.shard(x, layout=case.layout, dim=dim).requires_grad_(grad)

    ql, kl, vl, dol = to_local(q), to_local(k), to_local(v), to_local(do, grad=False)
    sent = record_sends(torch)
    opts = dict(causal=case.causal, window=case.window, softcap=case.softcap, layout=case.layout, local=local)
    opts["tensor_grads"], opts["transport"] = case.tensor_grads, case.transport
    given = {}
    if case.alibi:
        opts["alibi"] = given["slopes"] = case_slopes(case, torch, device).requires_grad_("slopes" in case.grads)
    if case.key_bias:
        kb = given["kb"] = case_key_bias(case, torch, device, torch.float32).requires_grad_("kb" in case.grads)
        opts["score_mod"] = lambda s, b, h, q, k: s + kb[k]
    if packed:
        o = fagen.ring_attention_varlen(ql, kl, vl, torch.tensor(case.docs), **opts)
    elif case.doc_mask is not None:
        o = fagen.ring_attention(ql, kl, vl, mask=case_mask(case, torch, device), **opts)
    elif case.compiled:
        o = torch.compile(lambda q, k, v: fagen.ring_attention(q, k, v, **opts) * 1.0, backend="eager")(ql, kl, vl)
    else:
        o = fagen.ring_attention(ql, kl, vl, **opts)
    o.backward(dol)
    counts = torch.tensor([len(sent)], device=device)
    everyone = [torch.zeros_like(counts) for _ in range(case.world)]
    dist.all_gather(everyone, counts)
    out = [ring.unshard(x.detach(), layout=case.layout, dim=dim) for x in (o, ql.grad, kl.grad, vl.grad)]
    if packed:
        out = [x.permute(1, 0, 2).unsqueeze(0) for x in out]
    grads = [given[n].grad for n in case.grads]
    return (*out, grads, [int(c) for c in everyone], list(sent))


def worker(rank, case, port, backend, queue, make_local, dtype_name, timeout):
    """A process of the launcher: join the group, run the case, send rank 0's results (or the error) home."""
    import torch

    try:
        device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        torch.set_num_threads(1)  # a forked rank never enters the parent's OpenMP pool (it would hang there)
        if backend == "nccl":
            torch.cuda.set_device(device)
        torch.distributed.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=case.world,
            timeout=datetime.timedelta(seconds=timeout),
        )
        local = make_local() if make_local is not None else None
        result = run_case(case, rank, device, getattr(torch, dtype_name), local, torch)
        sends, grads = [None] * case.world, [None] * case.world
        torch.distributed.all_gather_object(sends, result[-1])
        # NumPy arrays by value (a torch tensor would travel as a shared-memory handle that dies with the rank)
        torch.distributed.all_gather_object(grads, [g.detach().cpu().double().numpy() for g in result[4]])
        if rank == 0:
            arrays = [x.detach().cpu().to(torch.promote_types(x.dtype, torch.float32)).numpy() for x in result[:4]]
            queue.put(("ok", (arrays, grads), result[5], sends))
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    except Exception:
        queue.put(("error", f"rank {rank}: {traceback.format_exc()}", None, None))


def launch(case: Case, backend="gloo", make_local=None, dtype="float64", start="fork", timeout=300, grads=None):
    """Run `case` on case.world processes; rank 0's (o, dq, dk, dv), the number of P2P sends per rank, and the
    peers each rank sent to. `grads`: a list that takes every rank's gradients of the case's `grads` tensors (a
    list a rank, in the order of case.grads)."""
    import multiprocessing as mp

    ctx = mp.get_context(start)
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=worker, args=(r, case, port, backend, queue, make_local, dtype, timeout // 2))
        for r in range(case.world)
    ]
    for p in procs:
        p.start()
    try:
        status, tensors, counts, sends = queue.get(timeout=timeout)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    if status != "ok":
        raise AssertionError(tensors)
    import torch

    arrays, given = tensors
    if grads is not None:
        grads.extend([torch.from_numpy(g) for g in rank] for rank in given)
    return [torch.from_numpy(x) for x in arrays], counts, sends


def case_mask(case: Case, torch, device):
    """The traced mask of a case with `doc_mask` (fagen.eq(doc[q], doc[k]) over captured document ids), else None."""
    if case.doc_mask is None:
        return None
    import fagen

    doc = doc_ids(case.doc_mask, case.T, torch).to(device)
    return lambda b, h, q, k: fagen.eq(doc[q], doc[k])


def piece_programs(case: Case, torch, device="cpu"):
    """Every piece program of every rank's plan, with the call-time tensors' dtypes each reads (fagen's names)."""
    from fagen import ring

    alibi = case_slopes(case, torch, device) if case.alibi else None
    score = None
    if case.key_bias:
        kb = case_key_bias(case, torch, device, torch.float32)
        score = lambda s, b, h, q, k: s + kb[k]  # noqa: E731
    source = ring._source(case.causal, case.window, alibi, case.softcap, case_mask(case, torch, device), score)
    pieces = ring.split_program(source.build(), case.T, case.docs)
    plan = ring.make_plan(pieces, case.world, case.layout)
    out = {}
    for row in plan.pieces:
        for group in row:
            for piece in group:
                program = ring.piece_program(pieces, piece)
                dtypes = {n: "i32" for n in ring.tensors_read(program) if n not in ("slopes", "kb")}  # document ids
                out[str(program)] = (piece, program, dtypes)
    return out


def precompile(case: Case, torch, dim: int, dtype: str) -> int:
    """Compile (forward and backward) every piece program of `case` into the disk cache before the ranks start, so
    that W processes do not compile the same kernels at once. Returns how many."""
    import fagen

    programs = piece_programs(case, torch)
    for _, program, dtypes in programs.values():
        kernel = fagen.compile(dim, ir=program, dtype=dtype, tensor_dtypes=dtypes or None)
        assert kernel.backward_plan is not None  # built now, into the cache
    return len(programs)
