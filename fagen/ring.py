"""`fagen.ring_attention`: context parallelism, attention over a sequence sharded across the ranks of a
torch.distributed process group, exact, overlapped, and pruned by the proven key ranges.

    x_local = fagen.ring.shard(x, group, layout="zigzag")               # [B, H, T, D] -> [B, H, T/W, D]
    o = fagen.ring_attention(q, k, v, group, causal=True)              # q, k, v: this rank's shards
    o = fagen.ring_attention_varlen(q, k, v, cu_seqlens, group, causal=True)   # packed documents [T/W, H, D]
    y = fagen.ring.unshard(o, group, layout="zigzag")                  # the whole sequence, on every rank

The sequence of T tokens is cut into W shards (W the group's size): "contiguous" gives rank r the tokens
[r·T/W, (r+1)·T/W); "zigzag" cuts it into 2W chunks and gives rank r chunks r and 2W-1-r, which balances a
causal mask's work (Llama 3, Megatron-CP, ring-flash-attn). Masks, score functions and the tensors they read
(`doc[q]`) see global positions, as in `fagen.attention` on the whole sequence.

**The schedule.** Step i (0 ≤ i < W) attends this rank's queries to the keys of rank r-i (mod W): step 0 to
its own, then one step per other rank. The K/V a step needs travel straight from their owner (step i: rank r
sends its K/V to r+i and receives those of r-i), posted one step ahead so that the transfer of step i+1 runs
while step i's kernels run: by the GPUs' copy engines into the receiver's mapped memory where every rank is on
one host (fagen.ring_copy: no SM taken, no kernel spinning), else by NCCL's point-to-point (`batch_isend_irecv`;
`transport=`). Unpruned, this is a ring's traffic (one K/V shard in and out per rank and step); GQA K/V travel
with their own heads (no repeat).

**Pruning by the proofs.** A step is cut into pieces: a segment of this rank's queries against a segment of the
other rank's keys, with the global positions of both. The mask's key ranges (fagen.math.bounds, proven by
`bounds.prove` before use) give, for the query segment, the keys any query may see and those every query sees:
a piece is cut to the keys its queries may see and to the queries that may see them (the transposed ranges,
bounds.query_range); a piece left empty is dropped, a piece all of whose keys are visible runs the program with
no mask, and the rest run the program with the mask at the piece's positions (q -> q + q0, k -> k + k0,
M, N -> T). Every rank computes every rank's plan (pure Python), so a sender knows which rows of its K/V each
rank reads: only those travel, nothing for a dropped step. A 4096-token window over a long sequence sends its
left neighbour 4096 keys, not a shard.

**The merge.** Each piece gives (o, lse); they merge by the split-KV merge that fagen proves ((f),
online_softmax.make_merge / prove_merge), mirrored in float32 torch ops (`merge`; tests/test_ring.py checks it
against the proven rule's expressions, the empty state included). A pass starts from the rank's own step where that
is one piece over the whole shard (`schedule`): its (o, lse) are taken as the kernel gives them, and only the rows
other pieces write are merged, in float32 (a window's rank merges its first `window` rows; a rank with one step
merges nothing and converts nothing).

**The backward.** FlashAttention's backward of a piece needs the final o and lse: each step re-fetches the K/V (as
ring-flash-attn does) and runs the kernel's backward on the merged o and lse; dQ sums locally, and each piece's
dK/dV go straight back to their owner, which sums them, overlapped with the next step. Where every rank reads every
other's keys the own step runs last (`Ring.backward_order`), so the partials come back while it runs; its dQ, dK, dV
then add to the sums, and only the rows other parts add to are held in float32 (dK/dV are float32 as they come out
of the kernels). The kernels write dK/dV in float32 (Kernel.backward(float32_dkv=True)), the partials travel in
float32 and are rounded to the inputs' dtype once, at the end: W roundings of bf16 partials gave GQA's dK at W = 4
2.2x one GPU's error. The call-time tensors' gradients (ALiBi slopes, a score function's tensors) are each piece's,
summed over the steps and then over the group (tensor_grads='sum': every rank holds the whole sequence's, as one GPU
gives it; 'local': this rank's share). A tensor read as name[h] / [b] / [b, h] (ALiBi slopes) takes the kernels' row
correction sum_i E_i R_i (fagen.backend.contract: rowstat), a product of sums over a row's every key: each piece
gives its uncorrected sums and its row sums (Kernel.backward_rows), the rank sums E_i and R_i over the pieces of
each of its rows, and corrects once (`_Rows`).

**torch.compile.** `ring_attention` is an autograd.Function over torch.distributed calls, marked
torch.compiler.disable: inside a compiled model it runs eagerly, forward and backward, as a graph break (the
kernels inside are the fagen:: ops). It is not traceable with fullgraph=True: that would need the P2P steps as
traceable collectives.

**When the ring hides its communication, and when all-to-all wins**: see `model` (a model on paper from a
measured step time and link bandwidth) and docs/context_parallel.md.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, cast

LAYOUTS = ("zigzag", "contiguous")
TRANSPORTS = ("auto", "copy", "nccl")  # the links: copy engines where every rank can map the others' memory, or NCCL
TENSOR_GRADS = ("sum", "local")  # a call-time tensor's gradient: summed over the group, or this rank's share
NCCL_SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# One hardware queue a GPU (set before CUDA starts in a process): kernels and NCCL's transfers are dispatched in the
# order the CPU posts them, so the transfer of step i+1, posted before step i's kernel, is not held behind the
# persistent forward that takes every SM (Megatron sets it for its overlap). A recommendation, not a requirement:
# `fagen bench --context-parallel` sets it (setdefault) in the ranks it starts. 4 H200s, 2026-11-28, 256k tokens
# causal d128 forward + backward, one machine, two runs each in turn: the ring 843.8 / 842.3 ms with it, 856.4 /
# 852.9 without (1.2-1.5 % less, run by run); torch's context_parallel 944.9 / 939.9 and 952.9 / 954.4 ms (0.8-1.5 %
# less), so the ratio stays 1.12x. It puts every stream of the process on one queue, which may cost a training
# process other overlap: measured on the benchmark alone. The copy-engine links (the default on one host) do not
# need it (4 H200s, one machine: 843.5 ms with it, 841.8 without); the benchmark keeps it for torch's peer, 1 % faster
# with it (947.0 against 957.3 ms).
OVERLAP_ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}


# --- layouts ---------------------------------------------------------------------------------------------------
def segments(total: int, world: int, layout: str = "zigzag") -> tuple[tuple[tuple[int, int], ...], ...]:
    """Each rank's global token ranges [start, stop), in the order its shard holds them."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {', '.join(LAYOUTS)}, got {layout!r}")
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"group: expected at least one rank, got {world!r}")
    parts = 2 * world if layout == "zigzag" else world
    if total % parts:
        raise ValueError(f"the sequence of {total} tokens does not split into {parts} equal chunks ({layout} layout)")
    c = total // parts
    if layout == "contiguous":
        return tuple(((r * c, (r + 1) * c),) for r in range(world))
    return tuple(((r * c, (r + 1) * c), ((2 * world - 1 - r) * c, (2 * world - r) * c)) for r in range(world))


def _group_info(group) -> tuple[int, int]:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("group: torch.distributed is not initialized (call torch.distributed.init_process_group)")
    return dist.get_rank(group), dist.get_world_size(group)


def shard(x, group=None, *, layout: str = "zigzag", dim: int = 2, rank: int | None = None, world: int | None = None):
    """This rank's shard of the whole sequence x along `dim` (2 for [B, H, T, D], 0 for packed [T, H, D]), in
    `layout`: a new tensor (contiguous). rank/world: given, no process group is needed."""
    if rank is None or world is None:
        rank, world = _group_info(group)
    segs = segments(int(x.shape[dim]), world, layout)[rank]
    import torch

    return torch.cat([x.narrow(dim, a, b - a) for a, b in segs], dim=dim).contiguous()


def unshard(x, group=None, *, layout: str = "zigzag", dim: int = 2):
    """The whole sequence from every rank's shard x (an all-gather over `group`), in global order. Not
    differentiable (for outputs and checks)."""
    import torch
    import torch.distributed as dist

    rank, world = _group_info(group)
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    segs = segments(int(x.shape[dim]) * world, world, layout)
    pieces = []
    for r, part in enumerate(parts):
        offset = 0
        for a, b in segs[r]:
            pieces.append((a, part.narrow(dim, offset, b - a)))
            offset += b - a
    return torch.cat([p for _, p in sorted(pieces, key=lambda t: t[0])], dim=dim)


# --- the program at a piece's positions ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Pieces:
    """The global program, split into its mask (`keep`, None: none) and score functions (`scores`), over a
    sequence of `total` tokens; `docs`: packed documents' boundaries (varlen), None otherwise."""

    keep: Any
    scores: tuple
    total: int
    docs: tuple[int, ...] | None = None

    @functools.cached_property
    def key_range(self):
        """The mask's key ranges, proven (bounds.prove raises if a bound does not hold)."""
        from .math import bounds

        if self.keep is None:
            return bounds.key_range(_sympy().true)
        return _proven_key_range(self.keep)

    @functools.cached_property
    def query_range(self):
        """The queries that may see a key tile, proven (bounds.prove_query_range)."""

        return _proven_query_range(self.keep if self.keep is not None else _sympy().true)

    @functools.cached_property
    def order_only(self) -> bool:
        """The mask is the causal mask alone (k <= q) and nothing reads a position or a document: it keeps a key by
        the order of the positions alone."""
        from .ir import exprs

        causal = _sympy().Le(exprs.INDICES["k"], exprs.INDICES["q"])
        dims = {exprs.DIMS["M"]: self.total, exprs.DIMS["N"]: self.total}
        keep = None if self.keep is None else self.keep.xreplace(dims)
        return keep is not None and _canonical(keep) == _canonical(causal) and self.position_free and self.docs is None

    @functools.cached_property
    def position_free(self) -> bool:
        """No score function reads a position (q, k, M, N): a full piece then runs one program at any position."""
        from .ir import exprs

        names = {exprs.INDICES["q"], exprs.INDICES["k"], exprs.DIMS["M"], exprs.DIMS["N"]}
        return not any(s.free_symbols & names for s in self.scores)


def _sympy():
    import sympy

    return sympy


@functools.lru_cache(maxsize=64)
def _proven_key_range(keep):
    from .math import bounds

    rng = bounds.key_range(keep)
    bounds.prove(keep, rng)
    return rng


@functools.lru_cache(maxsize=64)
def _proven_query_range(keep):
    from .math import bounds

    rng = bounds.query_range(keep)
    if rng.masked:
        bounds.prove_query_range(keep, rng)
    return rng


def split_program(program, total: int, docs=None) -> Pieces:
    """The mask and score functions of an attention program (fagen.ir.variants' form: scale, score functions,
    one mask, softmax, PV), for a sequence of `total` tokens."""
    from .ir import Op

    masks = [n.attr("keep") for n in program.nodes() if n.op is Op.MASK]
    scores = tuple(n.attr("fn") for n in program.nodes() if n.op is Op.SCORE_MOD)
    keep = masks[0] if masks else None
    if len(masks) > 1:
        keep = _sympy().And(*masks)
    return Pieces(keep, scores, total, None if docs is None else tuple(int(d) for d in docs))


def _canonical(expr):
    """expr with each comparison free of tensor reads written as (lhs - rhs) <op> 0: the same program text for
    pieces whose positions differ by the same amount (k + 1024 <= q + 1024 is k - q <= 0)."""
    sp = _sympy()

    def fix(rel):
        if rel.atoms(sp.Indexed) or not isinstance(rel, (sp.Le, sp.Lt, sp.Ge, sp.Gt)):
            return rel
        return type(rel)(sp.expand(rel.lhs - rel.rhs), 0)

    return expr.replace(lambda e: isinstance(e, sp.core.relational.Relational), fix)


def shifted(expr, q0: int, k0: int, total: int):
    """expr at a piece whose first query is global position q0 and first key k0, over `total` tokens."""
    from .ir import exprs

    q, k, M, N = exprs.INDICES["q"], exprs.INDICES["k"], exprs.DIMS["M"], exprs.DIMS["N"]
    return _canonical(expr.xreplace({q: q + q0, k: k + k0, M: total, N: total}))


# --- the plan: which pieces each step holds ----------------------------------------------------------------------
@dataclass(frozen=True)
class Piece:
    """Queries rows[0]:rows[1] of this rank's shard against keys keys[0]:keys[1] of the source's shard; q0, k0 the
    global positions of the first of each; `full`: the mask keeps every key for every query (proven), so the piece
    runs without it; `docs`: the piece spans packed documents and needs the document mask (varlen)."""

    rows: tuple[int, int]
    keys: tuple[int, int]
    q0: int
    k0: int
    full: bool
    docs: bool = False


NONE, FULL, PARTIAL = "none", "full", "partial"


def _terms(pieces: Pieces, a0: int, a1: int, transposed: bool = False):
    """Each term's visible keys [begin, end) and fully visible keys (None where the term is not exact) for the
    queries [a0, a1), in global positions, from the proven key ranges; `transposed`: the queries that see the keys
    [a0, a1), from the proven query ranges."""
    from .ir import exprs
    from .math import bounds

    lo, hi = (bounds.k_lo, bounds.k_hi) if transposed else (bounds.q_lo, bounds.q_hi)
    env = {lo: a0, hi: a1 - 1, exprs.DIMS["M"]: pieces.total, exprs.DIMS["N"]: pieces.total}

    def at(values, default, pick):
        return pick([default, *(int(e.xreplace(env)) for e in values)])

    for term in (pieces.query_range if transposed else pieces.key_range).terms:
        full = (at(term.full_begins, 0, max), at(term.full_ends, pieces.total, min)) if term.exact else None
        yield (at(term.begins, 0, max), at(term.ends, pieces.total, min)), full


def classify(pieces: Pieces, q0: int, q1: int, k0: int, k1: int) -> str:
    """Whether queries [q0, q1) see none, all or some of the keys [k0, k1) (global positions), from the proven key
    ranges: a term's visible keys [max begins, min ends), its fully visible ones when every comparison is affine."""
    if not pieces.key_range.masked:
        return FULL
    seen = False
    for (begin, end), full in _terms(pieces, q0, q1):
        if max(begin, k0) < min(end, k1):
            seen = True
            if full is not None and full[0] <= k0 and k1 <= full[1]:
                return FULL
    return PARTIAL if seen else NONE


def visible_keys(pieces: Pieces, q0: int, q1: int, k0: int, k1: int, transposed: bool = False) -> tuple[int, int]:
    """The keys of [k0, k1) that queries [q0, q1) may see, as one range (empty: lo >= hi): the hull of the terms'
    proven visible ranges (every key outside is masked for every query, bounds.prove), and within the documents the
    queries touch (varlen). `transposed`: the queries of [k0, k1) that may see keys [q0, q1) (bounds.query_range)."""
    lo, hi = k1, k0
    rng = pieces.query_range if transposed else pieces.key_range
    if not rng.masked:
        lo, hi = k0, k1
    for (begin, end), _ in _terms(pieces, q0, q1, transposed):
        if max(begin, k0) < min(end, k1):
            lo, hi = min(lo, max(begin, k0)), max(hi, min(end, k1))
    if pieces.docs is not None:
        first, last = _doc_span(pieces.docs, q0, q1)
        lo, hi = max(lo, pieces.docs[first]), min(hi, pieces.docs[last + 1])
    return lo, hi


def _doc_span(docs: tuple[int, ...], a: int, b: int) -> tuple[int, int]:
    """The documents [first, last] that tokens [a, b) touch (docs: cu_seqlens, ascending, docs[0] = 0)."""
    import bisect

    return bisect.bisect_right(docs, a) - 1, bisect.bisect_right(docs, b - 1) - 1


def _piece(pieces: Pieces, rows, keys, q0: int, k0: int) -> Piece | None:
    """The piece of queries `rows` (global q0 on) against keys `keys` (global k0 on), its keys cut to those the
    queries may see; None where they see none."""
    q1 = q0 + rows[1] - rows[0]
    lo, hi = visible_keys(pieces, q0, q1, k0, k0 + keys[1] - keys[0])
    if lo >= hi:
        return None
    keys, k0 = (keys[0] + lo - k0, keys[0] + hi - k0), lo
    first, last = visible_keys(pieces, lo, hi, q0, q1, transposed=True)  # the queries that may see those keys
    if first >= last:
        return None
    rows, q0, q1 = (rows[0] + first - q0, rows[0] + last - q0), first, last
    docs = False
    if pieces.docs is not None:
        (qa, qb), (ka, kb) = _doc_span(pieces.docs, q0, q1), _doc_span(pieces.docs, lo, hi)
        docs = not (qa == qb == ka == kb)  # inside one document the document mask holds everywhere
    kind = classify(pieces, q0, q1, lo, hi)
    if kind == NONE:
        return None
    return Piece(rows, keys, q0, k0, kind == FULL, docs)


def _joined(a: Piece, b: Piece, free: bool) -> Piece | None:
    """One piece for two full pieces side by side (the same keys and adjacent rows, or the reverse) when the
    score functions read no position: one kernel call instead of two."""
    if not (a.full and b.full and free) or a.docs or b.docs:
        return None
    if a.keys == b.keys and a.rows[1] == b.rows[0]:
        return Piece((a.rows[0], b.rows[1]), a.keys, a.q0, a.k0, True)
    if a.rows == b.rows and a.keys[1] == b.keys[0]:
        return Piece(a.rows, (a.keys[0], b.keys[1]), a.q0, a.k0, True)
    return None


def step_pieces(pieces: Pieces, mine, theirs) -> tuple[Piece, ...]:
    """The pieces of queries in segments `mine` against keys in segments `theirs` (global ranges, in shard order)."""
    out: list[Piece] = []
    row = 0
    for qa, qb in mine:
        key = 0
        for ka, kb in theirs:
            p = _piece(pieces, (row, row + qb - qa), (key, key + kb - ka), qa, ka)
            if p is not None:
                out.append(p)
            key += kb - ka
        row += qb - qa
    joined = True
    while joined:  # join full pieces into rectangles while any two can be
        joined = False
        for i in range(len(out)):
            for j in range(len(out)):
                if i != j and (p := _joined(out[i], out[j], pieces.position_free)) is not None:
                    out = [x for n, x in enumerate(out) if n not in (i, j)] + [p]
                    joined = True
                    break
            if joined:
                break
    return tuple(sorted(out, key=lambda p: (p.rows, p.keys)))


@dataclass(frozen=True)
class Plan:
    """Every rank's pieces against every rank's keys: `pieces[r][s]`, the pieces of rank r's queries against the
    keys of rank s (empty: rank r needs nothing of rank s, and nothing travels)."""

    world: int
    pieces: tuple[tuple[tuple[Piece, ...], ...], ...]

    def needs(self, r: int, s: int) -> bool:
        return bool(self.pieces[r][s])

    def span(self, r: int, s: int) -> tuple[int, int]:
        """The rows of rank s's shard that rank r's pieces read (what travels from s to r): their keys' hull."""
        got = self.pieces[r][s]
        return (min(p.keys[0] for p in got), max(p.keys[1] for p in got)) if got else (0, 0)

    def sent_rows(self) -> int:
        """The K/V rows sent over the group in one forward."""
        return sum(
            self.span(r, s)[1] - self.span(r, s)[0] for r in range(self.world) for s in range(self.world) if r != s
        )

    def source(self, r: int, i: int) -> int:
        return (r - i) % self.world

    def exchanges(self, r: int) -> dict[int, tuple[int | None, int | None]]:
        """Step i -> (the rank r sends its K/V to, the rank it receives K/V from), for the steps 1..W-1 where
        rank r does either (None: not that way). The backward's dK/dV go the other way round."""
        out = {}
        for i in range(1, self.world):
            dst, src = (r + i) % self.world, (r - i) % self.world
            send = dst if self.needs(dst, r) else None
            recv = src if self.needs(r, src) else None
            if send is not None or recv is not None:
                out[i] = (send, recv)
        return out

    def messages(self) -> int:
        """The K/V shards sent over the group in one forward (W(W-1) unpruned)."""
        return sum(self.needs(r, s) for r in range(self.world) for s in range(self.world) if r != s)


def plan(total: int, world: int, layout: str = "zigzag", *, causal=False, window=None, mask=None) -> Plan:
    """The ring's plan for a sequence of `total` tokens over `world` ranks under these options (no process group
    needed): which pieces each rank runs against each rank's keys, and which K/V travel (Plan.messages)."""
    source = _source(causal, window, None, None, mask, None)
    return make_plan(split_program(source.build(), total), world, layout)


def make_plan(pieces: Pieces, world: int, layout: str) -> Plan:
    """Every rank's pieces against every rank's keys. A causal mask and nothing else (no window, no tensor, no
    position in a score) keeps a key by the order of positions alone, which a shard keeps (its segments ascend):
    a rank's own step is then one piece, its shard against itself with the causal mask (as the pieces at its
    diagonal, q - k positions apart by 0), instead of one a pair of segments."""
    segs = segments(pieces.total, world, layout)

    def own(r: int) -> tuple[Piece, ...]:
        if not pieces.order_only:
            return step_pieces(pieces, segs[r], segs[r])
        rows = (0, sum(b - a for a, b in segs[r]))
        return (Piece(rows, rows, 0, 0, False),)

    return Plan(
        world,
        tuple(
            tuple(own(r) if s == r else step_pieces(pieces, segs[r], segs[s]) for s in range(world))
            for r in range(world)
        ),
    )


# --- the merge of partial results ----------------------------------------------------------------------------------
def merge(out, lse, o_piece, lse_piece):
    """Merge the partial result (o_piece, lse_piece) into (out, lse) in place (float32; lse natural log, -inf:
    the empty state). The proven split-KV merge ((f), fagen.math.online_softmax.make_merge) on states with
    reference m = lse, l = 1, acc = o:  m = max(m_a, m_b), m_use = 0 where m = -inf, w = exp(m_x - m_use),
    l = w_a + w_b, acc = w_a·o_a + w_b·o_b; finished as o = acc / l (0 where l = 0), lse = m_use + log(l). The
    weights are divided by l before they scale the outputs (w_a/l·o_a + w_b/l·o_b: the same values), so that the
    [.., D] tensors are read and written once each: out·(w_a/l), then += o_piece·(w_b/l)."""
    import torch

    lp = lse_piece.to(lse.dtype)
    m = torch.maximum(lse, lp)
    m_use = torch.where(m == -math.inf, torch.zeros_like(m), m)
    w_a, w_b = torch.exp(lse - m_use), torch.exp(lp - m_use)
    l_sum = w_a + w_b
    seen = l_sum > 0
    safe = torch.where(seen, l_sum, torch.ones_like(l_sum))
    out.mul_((w_a / safe).unsqueeze(-1)).addcmul_(o_piece, (w_b / safe).unsqueeze(-1))
    lse.copy_(torch.where(seen, m_use + torch.log(safe), torch.full_like(m, -math.inf)))


# --- the program a piece runs --------------------------------------------------------------------------------------
DOC_Q, DOC_K = "ring_doc_q", "ring_doc_k"  # the document ids of a piece's queries and keys (varlen)


def piece_program(pieces: Pieces, piece: Piece):
    """The attention program of one piece, at its positions: the score functions shifted, and the mask shifted
    (none where the piece is full; with the document mask `ring_doc_q[q] == ring_doc_k[k]` where the piece spans
    documents). A fagen.ir.Program, compiled like any other."""
    from .ir import exprs, variants

    sp = _sympy()
    q, k = exprs.INDICES["q"], exprs.INDICES["k"]
    scores = [shifted(s, piece.q0, piece.k0, pieces.total) for s in pieces.scores]
    keeps = []
    if not piece.full and pieces.keep is not None:
        keeps.append(shifted(pieces.keep, piece.q0, piece.k0, pieces.total))
    if piece.docs:
        keeps.append(sp.Eq(exprs.tensor(DOC_Q)[q], exprs.tensor(DOC_K)[k]))
    keeps = [c for c in keeps if c != sp.true]
    return variants.program(keeps, scores, ["ring"], custom=True)


@dataclass(frozen=True)
class Work:
    """A piece with its program, the program's text (the key a local step compiles it under) and the call-time
    tensors it reads (by name)."""

    piece: Piece
    program: object = field(compare=False)
    text: str
    reads: tuple[str, ...] = ()


def tensors_read(program) -> tuple[str, ...]:
    """The names of the call-time tensors a program reads (request.tensors_read), sorted."""
    from .request import tensors_read as reads

    return tuple(sorted(reads(program)))


# --- the local step: (out, lse) of a piece and its backward --------------------------------------------------------
class KernelStep:
    """A piece on fagen's kernels: the piece's program compiled for the inputs' head dim, dtype and GPU on first use
    (fagen.ops's memo, the compile cache); the forward through the fagen:: op, the backward by Kernel.backward
    (float32 dK/dV). Any object with these two methods can stand in for it (ring_attention(local=...)); the CPU tests
    give a float64 one."""

    def __init__(self):
        self._keys: dict = {}

    def _key(self, work: Work, q, tensors: dict) -> tuple[str, list]:
        from . import ops
        from .request import for_attention

        tensors = {n: tensors[n] for n in work.reads}
        dtypes = ops.tensor_dtypes(tensors)
        memo = (work.text, q.dtype, q.device, dtypes, q.shape[-1])
        key = self._keys.get(memo)
        if key is None:
            ops._torch_side()
            fields = dict(dim=int(q.shape[-1]), dtype=ops.dtype_of(q), device=ops.device_of(q), tensor_dtypes=dtypes)
            key = self._keys[memo] = ops.kernel_key(for_attention, ir=work.program, **fields)
        return key, [tensors[n] for n in ops.tensor_names(key)]

    def forward(self, q, k, v, work: Work, scale, tensors: dict, deterministic: bool = False):
        """o (q's dtype) and lse (float32, natural log) of q against k, v under the piece's program."""
        import torch

        key, values = self._key(work, q, tensors)
        return torch.ops.fagen.attention(q, k, v, key, scale, deterministic, values)

    def backward(self, q, k, v, o, lse, do, work: Work, scale, tensors: dict, deterministic=False, wanted=frozenset()):
        """dq (q's dtype), dk, dv (float32: summed over pieces and ranks, rounded once) of the piece, from the final
        (merged) o and lse, and the float32 gradients of the call-time tensors named in `wanted` that the piece reads
        (by name; the kernels sum them only when one is asked for).
        Where one is asked for, a fifth item: the piece's row sums (runtime.backward.RowSums, or None), the gradients
        of the tensors read as name[h] / [b] / [b, h] then left uncorrected: their correction is a product of
        sums over a row's every key, which the ring applies once over the pieces (`_Grads.rows`)."""
        from . import ops

        key, values = self._key(work, q, tensors)
        kernel, named = ops.kernel_of(key), dict(zip(ops.tensor_names(key), values))
        if not wanted & set(work.reads):
            g = kernel.backward(
                q,
                k,
                v,
                o,
                lse,
                do,
                scale=scale,
                deterministic=deterministic,
                tensor_grads=False,
                float32_dkv=True,
                **named,
            )
            return g.dq, g.dk, g.dv, {}
        g, rows = kernel.backward_rows(
            q, k, v, o, lse, do, scale=scale, deterministic=deterministic, float32_dkv=True, **named
        )
        given = {n: g.tensors[n] for n in named if n in wanted and n in g.tensors}
        return g.dq, g.dk, g.dv, given, rows


# --- point-to-point ------------------------------------------------------------------------------------------------
class Links:
    """The ring's links over a group, by group rank: batch_isend_irecv (NCCL, gloo), or the copy engines of one
    host's GPUs (fagen.ring_copy) where `transport` allows and every rank can map the others' memory; `open` starts a
    pass on either. `sent` counts the tensors this rank has sent."""

    _ready: set = set()
    _mailboxes: dict = {}  # (group, device) -> (the group's ring_copy.Mailboxes, or None and why it cannot have them)

    def __init__(self, group, rank: int, world: int, transport: str = "auto"):
        import torch.distributed as dist

        self.group, self.rank, self.world, self.transport = group, rank, world, transport
        self.peers = [r if group is None else dist.get_global_rank(group, r) for r in range(world)]
        self.sent = 0
        if id(group) not in Links._ready:  # NCCL: the group's first P2P call must involve every rank
            dist.barrier(group=group)
            Links._ready.add(id(group))

    def mailboxes(self, device):
        """The group's copy-engine mailboxes on `device`, or None (NCCL's links then): decided by every rank together
        on the group's first pass on that device."""
        if self.transport == "nccl" or self.world == 1 or device.type != "cuda":
            if self.transport == "copy":
                raise ValueError(
                    f"transport: 'copy' needs CUDA tensors and a group of two ranks or more, got {device.type} "
                    f"tensors and {self.world} rank(s)"
                )
            return None
        key = (id(self.group), device)
        if key not in Links._mailboxes:
            from .ring_copy import try_mailboxes

            Links._mailboxes[key] = try_mailboxes(self.group, self.rank, self.world, device)
        boxes, why = Links._mailboxes[key]
        if boxes is None and self.transport == "copy":
            raise RuntimeError(
                "transport: 'copy' needs an NCCL group whose ranks are on one host, each able to map the others' GPU "
                f"memory (CUDA IPC); use transport='auto' or 'nccl' (here: {why})"
            ) from why
        return boxes

    def open(self, device, backward: bool, shared, layout):
        """A pass's exchanges: ring_copy.CopyPass where the copy engines serve (`layout()`: its slots' sizes), else
        _Inflight (NCCL; `shared`: the K/V spans several ranks read)."""
        boxes = self.mailboxes(device)
        if boxes is None:
            return _Inflight(self, shared)
        from .ring_copy import CopyPass

        return CopyPass(boxes, layout(), backward, self)

    def post(self, sends: list, recvs: list) -> list:
        """Post sends [(rank, tensor)] and receives [(rank, buffer)] as one batch; the works to wait on."""
        import torch.distributed as dist

        ops = [dist.P2POp(dist.isend, t, self.peers[p], self.group) for p, t in sends]
        ops += [dist.P2POp(dist.irecv, t, self.peers[p], self.group) for p, t in recvs]
        self.sent += len(sends)
        return dist.batch_isend_irecv(ops) if ops else []

    def all_reduce(self, x) -> None:
        """Sum x over the group, in place."""
        import torch.distributed as dist

        dist.all_reduce(x, group=self.group)


class _Inflight:
    """The exchanges of one pass over NCCL: posted ahead, waited on when their step comes; `spans`, the rows of this
    rank's K/V made dense for sending that more than one rank reads (`shared`), kept for the pass and copied once (a
    zigzag rank's first chunk: every rank after it reads that alone); a span one rank reads is copied for its send
    alone. The methods post_kv ... done_dkv are a pass's interface (fagen.ring_copy.CopyPass has the same)."""

    def __init__(self, links: Links, shared=frozenset()):
        self.links = links
        self.posted: dict = {}
        self.shared = shared
        self.spans: dict = {}

    def dense(self, span: tuple[int, int], k, v):
        """Rows span[0]:span[1] of k and v, dense (P2P sends dense tensors; a view of the whole shard is one)."""
        found = self.spans.get(span)
        if found is None:
            found = tuple(x[:, :, span[0] : span[1]].contiguous() for x in (k, v))
            if span in self.shared:
                self.spans[span] = found
        return found

    def post(self, step, sends: list, recvs: list) -> None:
        self.posted[step] = (self.links.post(sends, recvs), [b for _, b in recvs])

    def take(self, step) -> list:
        works, buffers = self.posted.pop(step, ([], []))
        for w in works:
            w.wait()
        return buffers

    def post_kv(self, i: int, send, recv, k, v) -> None:
        """Step i's K/V: rows send[1] of k, v to rank send[0]; rows recv[1] of rank recv[0]'s in (None: no such)."""
        sends, recvs = [], []
        if send is not None:
            kd, vd = self.dense(send[1], k, v)
            sends = [(send[0], kd), (send[0], vd)]
        if recv is not None:
            recvs = [(recv[0], _rows_like(k, recv[1])), (recv[0], _rows_like(v, recv[1]))]
        self.post(("kv", i), sends, recvs)

    def take_kv(self, i: int) -> list:
        return self.take(("kv", i))

    def done_kv(self, i: int) -> None:
        """Step i's K/V are no longer read (the copy-engine links free the slot; nothing to do here)."""

    def post_dkv(self, i: int, send, recv, like) -> None:
        """Step i's dK/dV return: send = (owner, (dk, dv)); recv = (rank, rows, dtype) in, shaped like `like`."""
        sends = [(send[0], send[1][0]), (send[0], send[1][1])] if send is not None else []
        recvs = [(recv[0], _rows_like(like, recv[1], recv[2])) for _ in range(2)] if recv is not None else []
        if sends or recvs:
            self.post(("dkv", i), sends, recvs)

    def take_dkv(self, i: int) -> list:
        return self.take(("dkv", i))

    def done_dkv(self, i: int) -> None:
        """Step i's dK/dV return is summed."""

    def close(self) -> None:
        """The pass's end (its sends were waited for with their steps' receives)."""


def _rows_like(x, span: tuple[int, int], dtype=None):
    """A new dense tensor for rows span[0]:span[1] of x [B, H, M, D] (dim 2), in x's dtype or `dtype`."""
    import torch

    shape = (x.shape[0], x.shape[1], span[1] - span[0], x.shape[3])
    return torch.empty(shape, dtype=dtype or x.dtype, device=x.device)


def _accumulator(x):
    """The dtype partial results sum in: float32 (float64 for float64 inputs, the CPU tests' reference)."""
    import torch

    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _hull(ranges) -> tuple[int, int] | None:
    """The smallest range [lo, hi) holding every non-empty range given; None where there is none."""
    ranges = [r for r in ranges if r[0] < r[1]]
    return (min(a for a, _ in ranges), max(b for _, b in ranges)) if ranges else None


class _Sum:
    """A [B, H, M, D] result summed from parts: the base part (`start`: a kernel's output over every row) taken as it
    is, and float32 (float64 for float64 inputs) over the rows `rows` = [lo, hi) where other parts add (None: none
    do). A base in the inputs' dtype (o, dQ) is converted there and `result` writes the sums back; one already in
    float32 (dK, dV: KernelStep.backward) is added into where it lies. Parts that come before the base (the backward
    runs the own step last) start the sums from zeros, and the base adds to them."""

    def __init__(self, rows: tuple[int, int] | None):
        self.rows = rows
        self.value: Any = None
        self.acc: Any = None
        self.inplace = False  # acc is the base's own rows

    def start(self, value) -> None:
        self.value = value
        if self.rows is None:
            return
        part = value[:, :, self.rows[0] : self.rows[1]]
        if self.acc is not None:
            self.acc.add_(part)
        elif value.dtype == _accumulator(value):
            self.acc, self.inplace = part, True
        else:
            self.acc = part.to(_accumulator(value))

    def rows_of(self, a: int, b: int):
        """The sums of rows a:b (inside `rows`, by the schedule)."""
        assert self.rows is not None and self.rows[0] <= a and b <= self.rows[1], (a, b, self.rows)
        return self.acc[:, :, a - self.rows[0] : b - self.rows[0]]

    def add(self, a: int, b: int, part) -> None:
        if self.acc is None:  # before the base
            assert self.rows is not None
            shape = (*part.shape[:2], self.rows[1] - self.rows[0], part.shape[3])
            self.acc = part.new_zeros(shape, dtype=_accumulator(part))
        self.rows_of(a, b).add_(part)

    def result(self):
        if self.acc is not None and not self.inplace:
            self.value[:, :, self.rows[0] : self.rows[1]].copy_(self.acc)
        return self.value


@dataclass(frozen=True)
class Schedule:
    """What a rank's passes start from and where they sum. `base`: the rank's first piece where it covers every row
    and every own key of the shard (its results are taken as they are: nothing to merge them with yet); `rows`: the
    rows the other pieces write (the forward merges there, the backward sums dQ there); `keys`: the rows of this
    rank's dK/dV that other pieces add to (its own step's other pieces, and what the other ranks send back).
    Without a base, every row sums (`rows` = `keys` = the whole shard, from zeros)."""

    base: Piece | None
    rows: tuple[int, int] | None
    keys: tuple[int, int] | None


def schedule(plan: Plan, rank: int, length: int) -> Schedule:
    """Rank `rank`'s schedule in `plan`, its shard `length` tokens long. A causal zigzag ring's own step is its
    base and every other step writes every row; a window's rank writes its first `window` rows again (its left
    neighbour's keys), and its dK/dV take its right neighbour's return on its last `window` rows: there alone
    anything is merged or summed in float32."""
    order = [(i, p) for i in range(plan.world) for p in plan.pieces[rank][plan.source(rank, i)]]
    whole = (0, length)
    if not order or order[0][0] != 0 or not order[0][1].rows == order[0][1].keys == whole:
        return Schedule(None, whole, whole)
    rest = order[1:]
    back = [plan.span((rank + i) % plan.world, rank) for i in range(1, plan.world)]
    keys = _hull([p.keys for i, p in rest if i == 0] + back)
    return Schedule(order[0][1], _hull([p.rows for _, p in rest]), keys)


class _Rows:
    """The row sums E_i and R_i (runtime.backward.RowSums) of this rank's query rows, summed over the pieces that
    cover each row (float64): the correction of a tensor read as name[h] / [b] / [b, h] is sum_i E_i R_i over whole
    rows, so a piece's keys alone cannot give it (sum_pieces E_i R_i is not (sum E_i)(sum R_i))."""

    def __init__(self, q):
        self.like = q
        self.e: Any = None
        self.r: dict = {}
        self.shapes: dict = {}

    def _zeros(self):
        import torch

        return torch.zeros(self.like.shape[:3], dtype=torch.float64, device=self.like.device)

    def add(self, rows: tuple[int, int], sums) -> None:
        """Add one piece's row sums (its query rows `rows` of the shard)."""
        a, b = rows
        if self.e is None:
            self.e = self._zeros()
        self.e[:, :, a:b] += sums.e
        for key, stat in sums.r.items():
            if key not in self.r:
                self.r[key] = self._zeros()
            self.r[key][:, :, a:b] += stat
        self.shapes.update(sums.shapes)

    def corrected(self, tensors: dict) -> dict:
        """The tensors' gradients summed over the pieces, less sum_i E_i R_i over the rows' summed E and R."""
        if self.e is None:
            return tensors
        from .runtime.backward import corrected

        return corrected(tensors, self.e, self.r, self.shapes)


class _Grads:
    """A backward pass's sums: dQ, dK, dV (`_Sum`s over the schedule's rows and keys) and the call-time tensors'
    gradients (`tensors`, by name, summed over the pieces; those of name[h] / [b] / [b, h] reads corrected once over
    the row sums the pieces give, `rows`)."""

    def __init__(self, plan: Schedule, q, k, v):
        import torch

        self.plan, self.tensors, self.rows = plan, dict[str, Any](), _Rows(q)
        self.dq, self.dk, self.dv = _Sum(plan.rows), _Sum(plan.keys), _Sum(plan.keys)
        if plan.base is None:
            for s, x in ((self.dq, q), (self.dk, k), (self.dv, v)):
                s.start(torch.zeros_like(x, dtype=_accumulator(x)))

    def add(self, i: int, piece: Piece, grads, parts, base: int, span: tuple[int, int], alone: bool):
        """Sum one piece's gradients (step i; its keys from row `base` of the source's shard); returns the step's
        dK/dV partials for the source (i > 0), float32 (float64 for float64 inputs): the piece's own where it is the
        step's only piece (`alone`), else sums over `span`."""
        import torch

        dq, dk, dv, given, *rows = grads
        for name, g in given.items():
            self.tensors[name] = self.tensors[name] + g if name in self.tensors else g
        if rows and rows[0] is not None:
            self.rows.add(piece.rows, rows[0])
        if piece is self.plan.base:
            for s, x in ((self.dq, dq), (self.dk, dk), (self.dv, dv)):
                s.start(x)
            return None
        self.dq.add(*piece.rows, dq)
        c, e = piece.keys[0] - base, piece.keys[1] - base
        if i == 0:
            self.dk.add(c, e, dk)
            self.dv.add(c, e, dv)
            return None
        if alone:  # sent as the kernel wrote them (dense: P2P sends dense tensors)
            return tuple(x.to(_accumulator(x)).contiguous() for x in (dk, dv))
        if parts is None:
            parts = tuple(torch.zeros_like(_rows_like(x, span, _accumulator(x))) for x in (dk, dv))
        parts[0][:, :, c:e] += dk  # the step's keys were received from row span[0] = base on
        parts[1][:, :, c:e] += dv
        return parts


# --- the ring --------------------------------------------------------------------------------------------------------
class Ring:
    """One configuration (sequence length, group, layout, program) and its plan: forward and backward passes."""

    def __init__(self, pieces: Pieces, plan: Plan, layout: str, links: Links, local, deterministic=False, grads="sum"):
        self.pieces, self.plan, self.layout, self.links, self.local = pieces, plan, layout, links, local
        self.rank, self.world, self.deterministic, self.tensor_grads = links.rank, links.world, deterministic, grads
        self.schedule = schedule(plan, self.rank, pieces.total // self.world)
        self.works: dict = {}
        self.doc_ids: Any = None  # varlen: the document id of every token (int32, on the inputs' device)

    def work(self, piece: Piece) -> Work:
        found = self.works.get(piece)
        if found is None:
            program = piece_program(self.pieces, piece)
            found = self.works[piece] = Work(piece, program, str(program), tensors_read(program))
        return found

    def _tensors(self, piece: Piece, tensors: dict) -> dict:
        if not piece.docs:
            return tensors
        n, m = piece.rows[1] - piece.rows[0], piece.keys[1] - piece.keys[0]
        ids = self.doc_ids
        return {**tensors, DOC_Q: ids[piece.q0 : piece.q0 + n], DOC_K: ids[piece.k0 : piece.k0 + m]}

    def _fetch(self, inflight, order: tuple, j: int, k, v) -> None:
        """Post the K/V exchange of the pass's j-th step (ring step i = order[j]: this rank's K/V out to r+i, those
        of r-i in) as the pass's message j, if it has one."""
        if j >= len(order):
            return
        ex = self.plan.exchanges(self.rank).get(order[j])
        if ex is None:
            return
        send, recv = ex
        inflight.post_kv(
            j,
            None if send is None else (send, self.plan.span(send, self.rank)),  # the rows of this rank's K/V r+i reads
            None if recv is None else (recv, self.plan.span(self.rank, recv)),
            k,
            v,
        )

    def _open(self, backward: bool, k):
        """A pass's exchanges, on the links this group has (ring_copy's slots sized from the plan: every rank's)."""

        def layout():
            from .ring_copy import Layout

            plane = k.shape[0] * k.shape[1] * k.shape[3]
            W = self.world
            spans = [self.plan.span(r, s) for r in range(W) for s in range(W) if r != s and self.plan.needs(r, s)]
            most = max((b - a for a, b in spans), default=0) * plane  # the largest message, in elements
            summed = _accumulator(k).itemsize  # dK/dV partials go in float32 (float64: the CPU's)
            return Layout(most * k.element_size(), most * summed if backward else 0)

        return self.links.open(k.device, backward, self.shared_spans, layout)

    @functools.cached_property
    def backward_order(self) -> tuple:
        """The ring steps of a backward pass in the order it runs them (the same on every rank: a pass's messages
        pair up by position). Where every rank reads every other's keys (a dense plan: causal, a document mask over
        the ranks), the own step goes last, so that the others' dK/dV partials (whole shards, in float32) come back
        while it runs rather than after the last kernel: 857.4 against 862.3 ms on 4 H200s, causal 256k tokens. A
        pruned plan (a window) keeps it first: there the returns are small, and the first K/V exchange then waited
        for cost more (64.4 against 63.6 ms, window 4096 at 512k tokens)."""
        W = self.world
        dense = all(self.plan.needs(r, s) for r in range(W) for s in range(W) if r != s)
        return (*range(1, W), 0) if dense else tuple(range(W))

    @functools.cached_property
    def shared_spans(self) -> frozenset:
        """The rows of this rank's K/V that more than one rank reads (each sent in one pass)."""
        spans = [
            self.plan.span(send, self.rank) for send, _ in self.plan.exchanges(self.rank).values() if send is not None
        ]
        return frozenset(span for span in spans if spans.count(span) > 1)

    def _step(self, inflight, order: tuple, j: int, k, v):
        """The pass's j-th step (ring step order[j]): its pieces, K/V and first row received; the next step's
        transfer posted first (it runs while this step's kernels do), then this step's K/V waited for."""
        self._fetch(inflight, order, j + 1, k, v)
        got = inflight.take_kv(j)
        i = order[j]
        kk, vv = got if got else (k, v)  # step 0, or a step with nothing to receive (and no piece)
        source = self.plan.source(self.rank, i)
        base = self.plan.span(self.rank, source)[0] if i else 0
        return self.plan.pieces[self.rank][source], kk, vv, base

    def forward(self, q, k, v, scale, tensors: dict):
        """o (q's dtype) and lse [B, H, M] (float32) of this rank's queries over the whole sequence: the base piece's
        results as they are, the other pieces merged into them in float32 over the rows they write."""
        import torch

        B, H, M, _ = q.shape
        k, v = k.contiguous(), v.contiguous()  # what P2P sends (a no-op unless they are views, as varlen's are)
        plan, inflight = self.schedule, self._open(False, k)
        out, lse = _Sum(plan.rows), cast(Any, None)
        if plan.base is None:
            out.start(torch.zeros((B, H, M, v.shape[-1]), dtype=q.dtype, device=q.device))
            lse = torch.full((B, H, M), -math.inf, dtype=_accumulator(q), device=q.device)
        order = tuple(range(self.world))
        for j in range(self.world):
            pieces, kk, vv, base = self._step(inflight, order, j, k, v)
            for piece in pieces:
                (a, b), (c, d) = piece.rows, (piece.keys[0] - base, piece.keys[1] - base)
                work, given = self.work(piece), self._tensors(piece, tensors)
                o_p, lse_p = self.local.forward(q[:, :, a:b], kk[:, :, c:d], vv[:, :, c:d], work, scale, given)
                if piece is plan.base:  # the first result of every row: nothing to merge with
                    out.start(o_p)
                    lse = lse_p.to(_accumulator(q))
                else:
                    merge(out.rows_of(a, b), lse[:, :, a:b], o_p, lse_p)
            inflight.done_kv(j)
        inflight.close()
        return out.result(), lse

    def _give_back(self, inflight, j: int, i: int, parts, k) -> None:
        """Post ring step i's dK/dV return as the pass's message j: this step's partials to their owner r-i, those of
        rank r+i in (float32; float64 for float64 inputs)."""
        r, W = self.rank, self.world
        src, dst = (r - i) % W, (r + i) % W
        recv = None
        if self.plan.needs(dst, r):
            recv = (dst, self.plan.span(dst, r), _accumulator(k))
        inflight.post_dkv(j, None if parts is None else (src, parts), recv, k)

    def backward(self, q, k, v, o, lse, do, scale, tensors: dict, wanted=frozenset()):
        """dq, dk, dv (the inputs' dtypes, or float32 where summed in it) of this rank's shards, dQ summed here and
        dK/dV by their owners, and the gradients of the call-time tensors named in `wanted` over this rank's pieces
        (float32, by name). The steps run in `backward_order`."""
        o, do = o.contiguous(), do.to(o.dtype).contiguous()
        k, v = k.contiguous(), v.contiguous()
        inflight, sums = self._open(True, k), _Grads(self.schedule, q, k, v)
        order = self.backward_order
        self._fetch(inflight, order, 0, k, v)
        for j, i in enumerate(order):
            pieces, kk, vv, base = self._step(inflight, order, j, k, v)
            span, parts = self.plan.span(self.rank, self.plan.source(self.rank, i)), None
            for piece in pieces:
                g = self._piece_backward(piece, (q, kk, vv, o, lse, do), scale, tensors, wanted, base)
                parts = sums.add(i, piece, g, parts, base, span, len(pieces) == 1)
            inflight.done_kv(j)
            if i > 0:
                self._give_back(inflight, j, i, parts, k)
            self._collect(inflight, order, j - 1, sums)
        self._collect(inflight, order, self.world - 1, sums)
        inflight.close()
        found = sums.rows.corrected(sums.tensors)
        return sums.dq.result(), sums.dk.result(), sums.dv.result(), self._tensor_grads(found, tensors, wanted)

    def _piece_backward(self, piece: Piece, inputs, scale, tensors: dict, wanted, base: int):
        """One piece's dq, dk, dv (its rows, and its keys from row `base` of the source's shard on) and the
        gradients of the tensors in `wanted` it reads."""
        q, k, v, o, lse, do = inputs
        (a, b), (c, e) = piece.rows, (piece.keys[0] - base, piece.keys[1] - base)
        rows = (q[:, :, a:b], k[:, :, c:e], v[:, :, c:e], o[:, :, a:b], lse[:, :, a:b].contiguous(), do[:, :, a:b])
        work, given = self.work(piece), self._tensors(piece, tensors)
        return self.local.backward(*rows, work, scale, given, self.deterministic, wanted)

    def _collect(self, inflight, order: tuple, j: int, sums: _Grads) -> None:
        """Wait for the dK/dV return of the pass's j-th step (ring step i = order[j]), and sum what rank r+i sent
        into the rows it read."""
        if j < 0:
            return
        got = inflight.take_dkv(j)
        if got:
            lo, hi = self.plan.span((self.rank + order[j]) % self.world, self.rank)
            sums.dk.add(lo, hi, got[0])
            sums.dv.add(lo, hi, got[1])
        inflight.done_dkv(j)

    def _tensor_grads(self, found: dict, tensors: dict, wanted) -> dict:
        """The gradients of the tensors in `wanted`, in each tensor's shape (zeros where no piece read it), each
        summed over the group where self.tensor_grads is 'sum' (every rank then holds the whole sequence's)."""
        import torch

        out = {}
        for name in sorted(wanted):  # every rank reduces the same names in the same order
            t = tensors[name]
            g = found.get(name)
            dtype = torch.promote_types(t.dtype, torch.float32)
            g = torch.zeros(t.shape, dtype=dtype, device=t.device) if g is None else g.reshape(t.shape).to(dtype)
            if self.tensor_grads == "sum" and self.world > 1:
                self.links.all_reduce(g)
            out[name] = g
        return out


def _autograd_function():
    import torch

    class RingFunction(torch.autograd.Function):
        """The ring's forward and backward; lse comes out non-differentiable."""

        @staticmethod
        def forward(ctx, ring, scale, names, q, k, v, *values):
            tensors = dict(zip(names, values))
            o, lse = ring.forward(q, k, v, scale, tensors)
            ctx.ring, ctx.scale, ctx.names = ring, scale, names
            ctx.save_for_backward(q, k, v, o, lse, *values)
            ctx.mark_non_differentiable(lse)
            return o, lse

        @staticmethod
        def backward(ctx, do, _dlse):
            q, k, v, o, lse, *values = ctx.saved_tensors
            wanted = frozenset(n for n, want in zip(ctx.names, ctx.needs_input_grad[6:]) if want)
            tensors = dict(zip(ctx.names, values))
            dq, dk, dv, given = ctx.ring.backward(q, k, v, o, lse, do, ctx.scale, tensors, wanted)
            grads = (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype))
            dts = (given[n].to(t.dtype) if n in wanted else None for n, t in zip(ctx.names, values))
            return (None, None, None, *grads, *dts)

    return RingFunction


_FUNCTION: list = []
_RINGS: dict = {}


def _check(q, k, v, packed: bool) -> None:
    rank = 3 if packed else 4
    form = "[T, H, D]" if packed else "[B, H, M, D]"
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not type(x).__module__.startswith("torch"):
            raise TypeError(f"{name}: expected a PyTorch tensor, got {type(x).__name__}")
        if x.dim() != rank:
            raise ValueError(f"{name}: expected {rank} dimensions {form}, got shape {tuple(x.shape)}")
    seq = 0 if packed else 2
    if not (q.shape[seq] == k.shape[seq] == v.shape[seq]):
        raise ValueError(
            f"k: the ring attends a sequence to itself; q, k and v shards must hold the same tokens, got "
            f"{q.shape[seq]}, {k.shape[seq]} and {v.shape[seq]}"
        )


def _ring_for(source, total: int, docs, group, layout: str, local, modes: tuple[bool, str, str]) -> Ring:
    """The Ring of a configuration, built (program traced, key ranges proven, plan made) on its first call;
    `modes`: (deterministic, tensor_grads, transport)."""
    from .request import function_key

    rank, world = _group_info(group)
    traced = (function_key(source.mask), function_key(source.score_mod))
    key = (
        source,
        total,
        docs,
        id(group),
        rank,
        world,
        layout,
        id(local) if local is not None else 0,
        modes,
        traced,
    )
    ring = _RINGS.get(key)
    if ring is None:
        pieces = split_program(source.build(), total, docs)
        plan = make_plan(pieces, world, layout)
        links = Links(group, rank, world, modes[2])
        ring = _RINGS[key] = Ring(pieces, plan, layout, links, local or KernelStep(), *modes[:2])
    return ring


def _run(ring: Ring, q, k, v, scale, tensors: dict):
    if not _FUNCTION:
        _FUNCTION.append(_autograd_function())
    names = tuple(sorted(tensors))
    return _FUNCTION[0].apply(ring, scale, names, q, k, v, *(tensors[n] for n in names))


def _source(causal, window, alibi, softcap, mask, score_mod):
    from .request import options_source

    if causal == "bottom_right":  # the ring's queries and keys are one sequence: M = N, the alignments agree
        causal = True
    return options_source(
        causal=causal, window=window, alibi=alibi is not None, softcap=softcap, mask=mask, score_mod=score_mod
    )


def _tensors(source, alibi, tensors: dict) -> dict:
    from .request import captures

    if alibi is not None:
        if "slopes" in tensors:
            raise TypeError("alibi, slopes: the ALiBi slopes are given by alibi=...; drop slopes=")
        tensors = {**tensors, "slopes": alibi}
    return {**{n: c.value(fn) for n, (fn, c, _) in captures(source).items()}, **tensors}


def _ring_attention(
    q,
    k,
    v,
    group=None,
    *,
    causal=False,
    window=None,
    alibi=None,
    softcap=None,
    score_mod=None,
    mask=None,
    scale=None,
    deterministic=False,
    layout="zigzag",
    return_lse=False,
    tensor_grads="sum",
    transport="auto",
    local=None,
    **tensors,
):
    """Attention of the whole sequence to itself, sharded over `group` (None: the default group): q [B, H, M, D]
    and k, v [B, Hkv, M, D] are this rank's shards (fagen.ring.shard, in `layout`: 'zigzag' or 'contiguous'),
    the sequence W·M tokens long. The options and traced functions are fagen.attention's, at global positions
    (causal 'bottom_right' is top-left here: M = N). Returns o like q (and lse [B, H, M], float32, with
    return_lse); differentiable in q, k, v and the call-time tensors (ALiBi slopes, tensors a score function reads,
    captured or passed by name). `tensor_grads`: 'sum' (default), a tensor's gradient summed over the group, the
    whole sequence's on every rank, as one GPU gives it; 'local', this rank's queries' share alone, for a trainer
    that sums gradients over the group itself (FSDP over a mesh that holds the context dimension). `transport`:
    'auto' (default), the GPUs' copy engines where every rank of the group is on one host and maps the others'
    memory (fagen.ring_copy), else NCCL; 'copy' or 'nccl' insists on one. `local`: the step that computes a piece
    (KernelStep: fagen's kernels)."""
    _check(q, k, v, packed=False)
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {', '.join(LAYOUTS)}, got {layout!r}")
    source = _source(causal, window, alibi, softcap, mask, score_mod)
    _, world = _group_info(group)
    modes = (bool(deterministic), _grads_mode(tensor_grads), _transport(transport))
    ring = _ring_for(source, int(q.shape[2]) * world, None, group, layout, local, modes)
    o, lse = _run(ring, q, k, v, scale, _tensors(source, alibi, tensors))
    return (o, lse) if return_lse else o


def _transport(transport) -> str:
    if transport not in TRANSPORTS:
        raise ValueError(f"transport: expected one of {', '.join(TRANSPORTS)}, got {transport!r}")
    return transport


def _grads_mode(tensor_grads) -> str:
    if tensor_grads not in TENSOR_GRADS:
        raise ValueError(f"tensor_grads: expected one of {', '.join(TENSOR_GRADS)}, got {tensor_grads!r}")
    return tensor_grads


def _documents(cu_seqlens, total: int) -> tuple[int, ...]:
    values = cu_seqlens.tolist() if hasattr(cu_seqlens, "tolist") else list(cu_seqlens)
    docs = tuple(int(x) for x in values)
    if len(docs) < 2 or docs[0] != 0 or docs[-1] != total or any(b < a for a, b in zip(docs, docs[1:])):
        raise ValueError(
            f"cu_seqlens: expected the documents' boundaries 0 = c0 <= c1 <= ... = {total} (the whole packed "
            f"sequence), got {list(docs)[:8]}{' ...' if len(docs) > 8 else ''}"
        )
    return docs


def _ring_attention_varlen(
    q,
    k,
    v,
    cu_seqlens,
    group=None,
    *,
    causal=False,
    window=None,
    alibi=None,
    softcap=None,
    scale=None,
    deterministic=False,
    layout="zigzag",
    return_lse=False,
    tensor_grads="sum",
    transport="auto",
    local=None,
):
    """Packed documents (FlashAttention's varlen form), sharded over `group`: q [T/W, H, D], k, v [T/W, Hkv, D]
    this rank's shards of the packed sequence of T tokens (fagen.ring.shard(x, dim=0)); cu_seqlens [n + 1] the
    documents' boundaries in the whole packed sequence (read once on the host). Each token attends within its
    document, under causal / window / softcap / ALiBi at positions within it. Returns o like q (and lse [H, T/W]
    with return_lse; tensor_grads: the ALiBi slopes' gradient, and transport, as ring_attention's). Pieces that
    share no document are skipped; pieces inside one document run without the document mask."""
    import torch

    _check(q, k, v, packed=True)
    _, world = _group_info(group)
    total = int(q.shape[0]) * world
    docs = _documents(cu_seqlens, total)
    source = _source(causal, window, alibi, softcap, None, None)
    modes = (bool(deterministic), _grads_mode(tensor_grads), _transport(transport))
    ring = _ring_for(source, total, docs, group, layout, local, modes)
    if ring.doc_ids is None or ring.doc_ids.device != q.device:
        lengths = torch.tensor([b - a for a, b in zip(docs, docs[1:])], device=q.device)
        ring.doc_ids = torch.repeat_interleave(torch.arange(len(lengths), device=q.device), lengths).to(torch.int32)
    four = [x.permute(1, 0, 2).unsqueeze(0) for x in (q, k, v)]  # [1, H, T/W, D] views
    o, lse = _run(ring, *four, scale, _tensors(source, alibi, {}))
    o = o[0].permute(1, 0, 2)
    return (o, lse[0]) if return_lse else o


# --- a model on paper: when the ring hides its communication, when all-to-all (Ulysses) wins ----------------------
NODE_GPUS = 8  # GPUs a host links by NVLink; beyond, steps and all-to-alls cross the network
NETWORK = 50e9  # bytes/s a GPU across hosts (a 400 Gb/s NIC a GPU)


def model(tokens, gpus, *, step_seconds, step_tokens, link, heads=32, kv_heads=None, dim=128, itemsize=2):
    """Forward + backward seconds of causal attention over `tokens` on `gpus` GPUs, by the zigzag ring and by
    Ulysses (all-to-all of heads for sequence), from one measured ring step (`step_seconds` for a zigzag causal step
    of `step_tokens` queries against as many keys, forward + backward) and the P2P bandwidth `link` (bytes/s) inside
    a host (NETWORK across hosts, past NODE_GPUS).

    Ring: W steps, each computing n²/2 pairs (n = tokens / W; a zigzag step's share) while the next step's K/V
    (forward; K/V again, backward, in the inputs' dtype, and dK/dV back in float32) travel: a step
    costs max(compute, transfer), the first transfer is exposed. Ulysses: the same compute (all heads / W over the
    whole sequence) plus all-to-alls of Q, K, V and O (forward) and dO, dQ, dK, dV (backward), each moving (W-1)/W
    of a GPU's shard, not overlapped; it needs W <= heads (K/V heads repeated up to W where fewer). Returns the two
    times, the ring's compute and transfer a step, and whether the ring hides its transfers."""
    kv = kv_heads or heads
    n = tokens / gpus
    compute = step_seconds * (n / step_tokens) ** 2  # the pairs of a step grow as n²
    bandwidth = link if gpus <= NODE_GPUS else NETWORK
    transfer = n * kv * dim * (4 * itemsize + 2 * 4) / bandwidth  # K, V twice (fwd, bwd) and dK, dV back (float32)
    ring = gpus * max(compute, transfer) + transfer
    ulysses = None
    if gpus <= heads:
        kv_sent = max(kv, gpus) if kv < gpus else kv
        moved = 2 * (2 * heads + 2 * kv_sent) * n * dim * itemsize * (gpus - 1) / gpus
        ulysses = gpus * compute + moved / bandwidth
    return dict(ring=ring, ulysses=ulysses, step_compute=compute, step_transfer=transfer, hides=transfer <= compute)


def model_table(*, step_seconds, step_tokens, link, gpus=(8, 16, 32, 64), tokens=(131072, 262144, 524288, 1048576)):
    """The model as markdown lines: ring / Ulysses seconds for each GPU count and sequence length, the faster
    marked, and '(exposed)' where the ring's transfers outlast its compute."""
    head = "| tokens | " + " | ".join(f"{g} GPUs: ring / Ulysses s" for g in gpus) + " |"
    lines = [head, "|---|" + "---|" * len(gpus)]
    for t in tokens:
        cells = []
        for g in gpus:
            m = model(t, g, step_seconds=step_seconds, step_tokens=step_tokens, link=link)
            ring = f"{m['ring']:.3g}" + ("" if m["hides"] else " (exposed)")
            if m["ulysses"] is None:
                cells.append(f"**{ring}** / - (W > heads)")
            elif m["ring"] <= m["ulysses"]:
                cells.append(f"**{ring}** / {m['ulysses']:.3g}")
            else:
                cells.append(f"{ring} / **{m['ulysses']:.3g}**")
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    return lines


_EAGER: dict = {}


def _eager(fn):
    """fn under torch.compiler.disable: torch.compile runs the ring eagerly (a graph break) rather than trace through
    torch.distributed and the plan's SymPy."""
    found = _EAGER.get(fn)
    if found is None:
        import torch

        found = _EAGER[fn] = torch.compiler.disable(fn)
    return found


@functools.wraps(_ring_attention)
def ring_attention(q, k, v, group=None, **options):
    return _eager(_ring_attention)(q, k, v, group, **options)


@functools.wraps(_ring_attention_varlen)
def ring_attention_varlen(q, k, v, cu_seqlens, group=None, **options):
    return _eager(_ring_attention_varlen)(q, k, v, cu_seqlens, group, **options)
