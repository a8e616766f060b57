"""wgmma: Hopper's tensor cores (sm_90a), FlashAttention-3's design.

A producer warpgroup issues TMA loads of Q_i once and of K_j, V_j into a STAGES-deep shared-memory ring
(completion on mbarriers); consumer warpgroups of 64 query rows each (two, or three at d64) run
`wgmma.mma_async` — S = Q K^T from shared-memory descriptors, O += P V with P from registers — with the next
tile's QK^T overlapping this tile's softmax, and take turns (pingpong, round robin) so one's softmax hides under
the others' matmuls; `setmaxnreg` moves registers from the producer to the consumers. O goes back through shared
memory (each consumer warpgroup's 64 rows of the Q tile, free after its last QK^T) by TMA stores. The tensor maps
of q, k, v and o are built on the host per call shape (fagen.runtime), passed by value as `__grid_constant__`
parameters. The forward is persistent where O's own shared-memory tile fits (d64 to d128): a block per SM takes work
tiles in turn, the K/V ring and Q's mbarrier phases running on, so the next tile's Q_i and first K/V load under this
one's last softmax, PV and stores (H100, 2026-11-25: 1.01-1.04x the same tiles launched a block per tile at d128,
2k-16k, without a mask). Blocks draw work tiles from a counter as they come free (dynamic scheduling); under a
mask that shortens early query tiles, the longest go first, so what is left at the end is short (d64 causal, 192
rows: 1.06x at 2k and 1.04x at 16k over static pairs of query tiles of about equal cost, H100 and H200,
2026-11-26; d128 causal within 2 %).

It takes f16/bf16, head dims 64, 96, 128, 192 and 256, any mask or score function, GQA and varlen batches; inputs
and outputs TMA cannot describe (strides not multiples of 16 bytes, unaligned bases, a head dim that is not
contiguous) go to the mma tier, which says so. A varlen batch writes O directly (the map cannot stop at a
sequence's end). In a varlen batch the maps cover the packed arrays, so a key tile that runs past its
sequence's end loads the next sequence's rows; the mask gives them P = 0 (as it gives rows past the array's
end, which TMA reads as zeros).

The backward's main kernel (Kind.BWD; head dims 64 to 256, 96 on 128's tiles) is here too, warp-specialized like the
forward (FlashAttention-3's backward): a producer warpgroup loads K_j, V_j once and streams Q_i, dO_i (TMA) and
lse_i (in base 2), D_i through a 2-deep ring (full / empty mbarriers), and adds each step's dQ_i into the float32
accumulator by TMA reductions from shared memory; two consumer warpgroups own a 128-key tile (64 keys each, a key an
accumulator row): S^T and dP^T are wgmma from shared memory, dV += P^T dO and dK += dS^T Q take P^T and dS^T from
registers, dQ = dS K reads dS^T from shared memory (two buffers by step parity; the consumers meet once a step, when
both halves of dS^T are written). A step takes 64 query rows, 128 at d64, and 80 at d96 and d128 without a mask
(ROWS80_HEAD_DIMS; dQ^T = K^T dS^T there); at d96 with 64 rows, warpgroup 0 alone computes dQ (DQ_SINGLE_HEAD_DIMS).
At d192 and d256 they share a 64-key tile and split dK, dV by columns, P^T and dS^T through shared memory
(wide_parts); at d256 dQ_i's float32 parts are staged in the step's own dO_i and Q_i, which leaves room for a ring 2
deep (DQ_RING_HEAD_DIMS). Inputs TMA cannot describe take the fallback tier's backward (Kernel.backward). A score
function that makes it spill past its budget steps down (`lighter`: d64 from 128 query rows a step to 64, d96 and d128
from 80 to 64, then the mma tier's kernel). H100, 2026-11-25: forward + backward 1.12-1.37x the cp.async kernel it
replaced (one block of two warpgroups meeting at every step), 0.95-1.02x SDPA's
cuDNN backend (`bench/results/h100-2026-11-25-backward/`). A block-sparse forward's backward adds Kind.BWD_SPARSE:
the same kernel, whose producer walks the block mask's transposed table (per key tile, the query tiles listed for
it) and hands each step's query head and entry to the consumers in shared memory; it orders no dQ additions
(deterministic calls run BWD) and sums no tensor gradients (the _grads kernel does).
"""

from __future__ import annotations

import ctypes
import functools

from ..contract import BWD_MAINS, MAX_ROW_GRADIENTS, Kind, Param
from ..spec import KernelSpec, SpecError
from . import SMEM_LIMIT, Tier, check, register

BLOCK_M = 128  # two consumer warpgroups of 64 rows
# A block is a producer warpgroup and a consumer warpgroup per 64 query rows. Two consumers take 240 registers each
# (the producer keeps 24); three (192 rows, FlashAttention-3's tile at d64) take 160, which holds d64's O, S and P.
CONSUMER_REGS = {128: 240, 192: 160}


def register_split(block_m: int, persistent: bool, masked: bool) -> tuple[int, int]:
    """(producer, consumer) registers a thread after setmaxnreg: the consumers take what the producer leaves of the
    block's registers (what __launch_bounds__(threads, 1) allows each thread), in 8s, up to CONSUMER_REGS. A
    persistent kernel under a mask keeps 32 for its producer, which holds a work tile's key range beside the
    counter's next draw (at 24 it spills 8 B under NVRTC 13.0, and 12 B when tiles went in pairs), which leaves two
    consumers 232 and three 160."""
    producer = 32 if persistent and masked else 24
    threads = 128 + 2 * block_m  # the producer warpgroup, and a consumer warpgroup per 64 rows
    block = 65536 // threads // 8 * 8 * threads
    return producer, min(CONSUMER_REGS[block_m], (block - 128 * producer) // (2 * block_m) // 8 * 8)


# A 192-row kernel that spills first narrows its key tiles to 96 (S and P give back 24 registers a thread): softcap at
# d64 spills 8 / 40 bytes at 128 keys (non-causal / causal) and none at 96, and 192 x 96 ran 1.05-1.14x / 1.02-1.05x
# the 128 x 128 kernel (H100, 2026-11-24, 2k and 8k).
WIDE_STEP_N = 96


def consumers_fit(block_m: int, head_dim: int, block_n: int) -> bool:
    """Whether a consumer thread's registers hold O (o_cols / 2 floats), S and P (3 block_n / 4) and ~30 more. Always
    at 240 (two consumers); at 160 (three), 128 keys at d64, 96 at d96 (O over 96 columns) and 80 at d128 compile
    without spills, wider tiles spill or do not compile (ptxas C7602; d96 at 112 keys: 12-40 bytes, causal and
    softcap, NVRTC 13, 2026-11-28)."""
    return block_m == BLOCK_M or 3 * block_n // 4 + o_cols(head_dim) // 2 <= CONSUMER_REGS[block_m] - 30


def num_warps(block_m: int) -> int:
    return 4 * (block_m // 64 + 1)


NUM_WARPS = num_warps(BLOCK_M)
HEAD_DIMS = (64, 96, 128, 192, 256)
# Tiles measured fastest on an H100 (bench/hopper_prototype/NOTES.md): (BLOCK_N, STAGES) per head dim; 96 runs
# on d128's tiles (its rows are padded to 128 columns in shared memory).
RULE = {64: (128, 3), 96: (128, 2), 128: (128, 2), 192: (112, 2), 256: (80, 2)}


def tile_dim(head_dim: int) -> int:
    """The head dim rounded up to whole 64-column (128-byte) swizzle blocks: the shared-memory tiles' width.
    TMA fills the columns past the head dim with zeros; S = Q Kᵀ stops at the head dim, and O = P V at the head dim
    rounded up to 32 (o_cols)."""
    return -(-head_dim // 64) * 64


# The backward's main kernel (Kind.BWD): a producer warpgroup and two consumer warpgroups of 64 keys (a 128-key tile),
# block_m query rows a step. A consumer thread (240 registers) holds dK and dV (head_dim floats), S^T, P^T and dP^T
# (block_m / 2 floats each): at d128, 64 rows a step (192 accumulators), 80 without a mask (208; d96 too:
# ROWS80_HEAD_DIMS); at d64, 128 rows a step, which halves the fixed cost of a step per tensor-core FLOP.
# At d192 and d256 dK and dV alone would take 192 and 256 registers a thread: there the two warpgroups share a 64-key
# tile and split dK, dV over the head dim instead (FlashAttention-3's and -4's split, BWD_STUDY.md section 5): each
# computes S^T and dP^T for the 64 keys and half the step's 64 queries, P^T and dqk^T go through shared memory, and
# dV += P^T dO, dK += dqk^T Q are wgmma from shared memory over the warpgroup's columns (wide_parts).
BWD_HEAD_DIMS = (64, 96, 128, 192, 256)  # 96 on 128's tiles (TMA zero-fills columns 96-127)
BWD_BLOCK_N, BWD_NUM_WARPS, BWD_STAGES = 128, 12, 2
# (A ring 3 deep fits at d96 and d128 with 64 rows a step; not kept: H200, 2026-11-29, bench/ab_bwd_main.py, main
# kernel against 2 stages, two runs: d128 causal 2k and 8k, a 256-key window, GQA 32/8 0.99-1.02x, d96 causal
# 0.96-1.01x.)
WIDE_BWD_BLOCK_N = 64
# The ring's depth at the wide head dims, what fits 227 KB beside K_j, V_j, one buffer each of P^T and dqk^T and
# dQ_i's float32 parts (FlashAttention-4's sm90 configurations: d192 Q and dO 2 deep, d256 1); d256 takes 2 where
# DQ_RING_HEAD_DIMS puts those parts in the ring.
WIDE_BWD_STAGES = {192: 2, 256: 1}
# A module setting: False sends d192 and d256 to the fallback family's backward (simt), as before the wide kernel,
# for an A/B in one process (bench/ab_bwd_wide.py); the backward's cache key holds it where it is False.
BWD_WIDE = True
# At d256 the wide backward stages dQ_i's float32 parts in the step's own dO_i and Q_i, not in 64 KB of their own: a
# warpgroup's part over its 128 columns of dO_i once its dV has read them (while dK's wgmma runs), then of Q_i once
# its dK has; the producer's warp 1 frees the stage once TMA has read them. The room left holds a second stage of
# the ring (DQ_RING_STAGES; with one, Nsight Compute had counted 9.7 long-scoreboard stalls an issued instruction
# against FlashAttention-4's 4.8). Measured against one stage and the buffer (H200, 2026-11-29, bench/ab_bwd_main.py,
# two runs): main kernel 1.20x causal 2k, 1.27-1.28x causal 8k, 1.30-1.31x full 8k, 1.24-1.25x GQA 32/8 causal 8k;
# the whole backward 1.18-1.31x. Written whole after dK's wgmma, not half while it runs: 0.98-1.00x the speed of
# that (one run). Not kept: dQ_i added from registers by red.global.add.v2.f32 (no buffer, 2 stages):
# 0.92-0.97x at d256 and 0.67-0.71x at d192 against the default; with one stage 0.76-0.80x and 0.54-0.57x.
# A module setting (`--set DQ_RING_HEAD_DIMS=`: none); the backward's cache key holds it where it differs. d192's
# parts do not lie over the warpgroups' own columns (wide_parts), and it keeps 2 stages beside its buffer.
DQ_RING_HEAD_DIMS = (256,)
DQ_RING_STAGES = 2


def dq_ring(head_dim: int) -> bool:
    """Whether the wide backward stages dQ_i's parts in the step's own dO_i and Q_i (each warpgroup's 128 columns)."""
    return wide_backward(head_dim) and head_dim in DQ_RING_HEAD_DIMS and tile_dim(head_dim) == 256


def wide_backward(head_dim: int) -> bool:
    """Whether the backward's two warpgroups split dK, dV by columns (d192, d256) rather than by keys."""
    return head_dim > 128


def wide_parts(head_dim: int) -> dict[str, tuple[tuple[int, int], tuple[int, int]]]:
    """(first column, columns) of each warpgroup's part of dK_j, dV_j ("kv") and of dQ_i ("dq") at a wide head dim.
    A part starts at a 64-column block (wgmma's B is MN-major there: an N range cannot start inside a 128-byte
    swizzled row). d256: 128 columns each. d192: the first warpgroup takes 128 columns of dK, dV and 64 of dQ, the
    second 64 and 128 (64-column blocks of products a step past S^T and dP^T: 5 and 4)."""
    width = tile_dim(head_dim)
    if width % 128 == 0:
        half = ((0, width // 2), (width // 2, width // 2))
        return {"kv": half, "dq": half}
    big = -(-width // 128) * 64  # the larger part, in whole 64-column blocks (128 of 192)
    return {"kv": ((0, big), (big, width - big)), "dq": ((big, width - big), (0, big))}


# The order of a backward step's wgmma (the template's bwd_overlap_p, bwd_overlap_dq). "serial": S^T and dP^T as one
# group, waited for before the element-wise steps; then dV, dK, dQ, all three waited for before dQ's part is written
# out. "overlap_dq": dV, then dQ, then dK, dQ's part written out while dK's wgmma runs. "overlap" (FlashAttention-3's
# and -4's order): that, and S^T, then dP^T as two groups, P^T formed from S^T while dP^T's wgmma runs. A module
# setting, so that a script can time them (bench/ab_backward_pipeline.py); the backward's cache key holds it.
# H200, 2026-11-27, backward alone at FlashAttention's shapes: overlap_dq 1.01-1.07x serial at d64, d96 and d128,
# causal and not, 2k and 8k; overlap 0.93-1.02x (P under dP keeps S^T, dP^T and P^T live at once). Again against
# overlap_dq on the tree of 2026-11-28 (H200, bench/ab_bwd_main.py --set BWD_PIPELINE=overlap, main kernel, two
# passes): d128 causal 0.94-0.97x (2k, 8k, GQA 32/8), a 1024-key window 0.98-0.99x, d96 causal, d64 and d128 full
# 0.99-1.02x; with dqk^T stored first at every row count too, d128 causal 0.95-0.98x.
# Again on the tree of 2026-11-29 (H200, two runs of the base): d128 causal 8k 1.01x, 2k 0.99x, full 8k 0.99x, d64
# causal 8k 1.02x, main kernel; all within the base's own spread (0.98-1.01x), so overlap_dq stays.
# Tried and not kept: S^T a step ahead (the next step's issued once dK's wgmma is, or after dQ's write-out, into S^T's
# registers, dead by then, so that it is in flight over the step loop's back edge): ptxas serialized every wgmma of
# the kernel (C7512, "insufficient register resources") at d64 and d128, in both places (NVRTC 13, 2026-11-28).
# Tried and not kept: "dq_halves", dQ's wgmma over the warpgroup's own 64 keys issued once those keys of dqk^T are
# written (a barrier of its 128 threads), the other's after BAR_DS: main kernel 0.95-1.04x overlap_dq's speed, whole
# backward 0.96-1.01x (H100, 2026-11-28, two rounds).
# Where a step's cycles go (bench/trace_bwd.py, H200, 2026-11-29, d128 causal 8k, about 4100 a step with the stamps):
# S^T and dP^T landed ~950, the element-wise steps ~800, dV + dqk^T stored + BAR_DS ~400-600, dV's and dQ's wgmma ~700,
# dQ's part written out ~660 (its stores alone ~340), dK ~90. With dQ's write-out left out (wrong sums, timed only)
# the step took ~3350, but that figure is not the write-out's cost: with write_dq gone dQ's accumulators are never
# read and ptxas drops dQ's wgmma too (d128 causal's SASS: 36 HGMMA to 29; the traced wait for dV's and dQ's groups
# fell from ~670 to ~190 cycles, 2026-11-29). Leaving out only the wait for dQ's buffer (dq_empty) moved the traced
# step by -1.4 % (d128 full 8k) and +0.6 % (causal 8k). With dQ's stores alone left out (its wgmma kept: the
# accumulators summed into a store no run takes), d128 causal 8k's step took 3895 cycles against 4138 and its write-out
# 377 against 662: the stores cost some 6 % of a 64-row step (at 80 rows that edit made ptxas schedule the step anew,
# 5900 cycles against 4987: no reading). Tried and not kept, each against overlap_dq (two runs,
# main kernel): the part written at the next step's top, under S^T's wgmma with dP^T issued after it (with dP^T
# also in flight ptxas spilled 384 bytes) 0.95-1.01x at d128, 0.99-1.02x at d64; that and P under dP 0.93-1.00x at
# d128, 0.98-1.01x at d64. A flat layout of 16-byte stores (FlashAttention-4's), no proxy fence, or both parts' TMA
# reductions issued before either is waited for: the traced step within 2 % of the default's.
# Tried and not kept: "pingpong", the warpgroups never meeting within a step (dQ_{i-1} issued a step late, once both
# warpgroups' counts in shared memory say their dqk^T of it is stored; three dqk^T buffers; warpgroup 1 starting
# half a step behind): correct, but the main kernel 0.96-0.98x overlap_dq's at d128 causal 2k and 8k and d96 causal
# 8k, 0.90-0.96x without the late start (H200, 2026-11-29, one round).
# Tried and not kept (H200, 2026-11-29, bench/ab_bwd_main.py, main kernel against overlap_dq, two runs each): dV's wgmma
# issued as soon as P^T is formed (overlap's two phases, dqk formed while dV's runs; bench/hopper_prototype/NOTES.md
# had found no gain in it on 2026-11-24): 0.92-1.00x at d128 causal, 0.90-0.91x under a 256-key window, 0.92-0.96x at
# d64, 0.98-1.02x at d96 causal, and the 80-row and softcap kernels step down (their stack frames); dV's wgmma issued
# after dQ's, so that dQ's part is written out under both dV's and dK's: 0.94-1.01x (d64 to d128, causal and not, GQA,
# a window), dQ's group then landing ~1550 cycles after BAR_DS at 80 rows where it took ~950.
# Tried and not kept: every n-th P of a thread's tile on the FMA pipe (2^x by a degree-3 polynomial and the exponent's
# bits) beside MUFU.EX2, whose 8 cycles a warp both warpgroups' element-wise steps share. H200, 2026-11-29,
# bench/ab_bwd_main.py, main kernel, n = 6 against none, four pairs on two GPUs: GQA 32/8 1.005-1.016x, d64 full 2k
# 0.998-1.033x, d128 causal 2k 0.988-1.004x, causal 8k 0.967-1.052x, d96 causal 8k 0.971-0.995x; at 80 rows a step
# (d128 without a mask) it spilled and ptxas serialised the wgmma (0.86-0.89x). Patch kept outside the tree.
BWD_PIPELINES = ("serial", "overlap_dq", "overlap")
BWD_PIPELINE = "overlap_dq"

# The order the backward's key tiles start in (a module setting, timed by bench/ab_backward_order.py; the backward's
# cache key holds it). "natural": the grid's, key tiles fastest. "heavy_first": where the mask lets early key tiles see
# more query tiles (causal: the queries a key tile sees begin at a bound that grows with it and end at the sequence's
# end), the long blocks start first, within chunks of heads whose Q, dO and dq_accum fit in L2 (Wgmma.orders_key_tiles
# says at which head dims).
BWD_ORDERS = ("natural", "heavy_first")
BWD_ORDER = "heavy_first"
# Tried and not kept: each key tile starting at its own query tile (index tile_n mod the tiles, then wrapping; not in
# a deterministic call), so that a head's key tiles side by side add into different dQ tiles at once. H200,
# 2026-11-29, bench/ab_bwd_main.py, main kernel against the default, two runs: a 256-key window 1.01-1.04x (d128 4k,
# 8k, 16k; d64 8k), everywhere else 0.97-1.03x (d64 to d128 full and causal 2k to 16k, GQA 32/8, softcap, a 1024-key
# window): no contention in dQ's additions to remove.
# Tried and not kept: a varlen call's real key tiles first, in the grid's order, and those past their sequence's end
# (which only leave) last, each warp scanning the sequences' tile counts: packed documents' backward 1013-1018 us
# against 1013-1016 (max_seqlen the longest) and 1046-1069 against 1040-1068 (twice it), H200, 2026-11-29, 3 rounds
# on 2 GPUs in turn: what an empty block costs is its launch, not its place in the order.
# Tried and not kept: heavy-first chunks of at least the pairs whose key tiles fill a wave (132 blocks), where L2's
# budget gives fewer (GQA: one pair, 64 blocks at d128 causal 8k with 4 query heads a KV head). H200, 2026-11-28,
# bench/ab_bwd_main.py, main kernel old / new, two passes: 16 heads over 4 KV heads, batch 2 (8 pairs) 1.05x at 8k,
# 0.99-1.04x at 16k, 0.99x at 2k; but `fagen bench --backward`'s GQA case (32 over 8, batch 2, 16 pairs), forward +
# backward, 0.98-0.99x (two runs each, in turn). Chunks of 4 pairs (L2_KV_BYTES 128 MB) gave the 8-pair case 1.10x.
# (That rule took 3 pairs, 192 blocks, at 32/8 8k; BWD_WAVE_BLOCKS below takes 4, 256 blocks.)

# Tried and not kept (H200, 2026-11-29; bench/trace_blocks.py, bench/ab_bwd_main.py against the tree before, two runs
# on two GPUs): a block spends some 2,500-4,700 cycles from its start to K_j, V_j landed (1,100-2,100 of them before
# the producer is past setmaxnreg: naming the work tile, 500 in the grid's order and 1,300 heavy-first, then the
# ranges and mbarriers), and 1,900-3,800 in its dK/dV epilogue (1,700-2,700 copying out): 26 % of an SM's time under
# a 256-key window (6 steps a block), 11 % at d64 and d128 causal 2k, 3 % at d128 causal 8k. Edits at the block's
# start, level: K_j and V_j of the block an SM's launch later brought into L2 once a block's loads are issued (main
# kernel 0.98-1.02x; K/V landed 350-630 cycles sooner, the first step's Q_i, dO_i no sooner); then, together, K_j, V_j
# asked for by thread 0 as soon as the tile is named and heavy-first's chunk divided in 32 bits (no 64-bit division
# call): 0.98-1.01x (window 4k and 16k, d64 and d128 causal 2k, d128 causal 8k, full 2k, GQA 32/8, d96, d256; K/V
# landed some 500-700 cycles sooner and the step loop took them back waiting for its first Q_i, dO_i). What a block's
# start and end cost would go with a persistent backward that loads the next tile while this one's last steps and
# epilogue run.
# Tried and not kept (H200, 2026-11-30, bench/ab_bwd_main.py, main kernel, two runs in turn against the tree before and
# with the setting off): dK_j and dV_j written by TMA (a 4-D store a 64-column block from the staged epilogue tiles,
# then a wait for the reads), not the 16-byte stores, and the producer's last dQ wait for its reads only: 0.99-1.03x
# (window 256 at 4k and 16k, d64 and d128 causal 2k, d128 causal 8k and full 2k, d64 full 8k, GQA 32/8, d96 causal
# 8k); the trace's copy out took 2,730 cycles either way. Tier and sanitizers clean.
# On the way to BWD_PERSISTENT below (H200, 2026-11-30, bench/ab_bwd_main.py, main kernel against the tree before, with
# the step-down budget raised): at the producer's 24 registers and the consumers' 240, its roles, naming their tile
# after setmaxnreg, spilled 88-232 bytes and ran 0.79-1.01x (window 1.01x, d128 causal 0.94-0.96x, GQA 32/8 0.84x);
# at 40 and 232 with the next key tile drawn a tile ahead, GQA's long tiles ran 0.88x (drawn once the last tile's loads
# are asked for: 1.02x); at 80 rows (no mask) and at d64 the consumers spilled at 232 (0.42x, 0.93x). What would let
# the producer keep 24: the consumers work out the next tile's KeyTile into shared memory for it.

# BWD_PERSISTENT: the dense backward main kernel at 64 rows a step, d96 to d128 (not d64, whose 64 rows are a step-down
# spare that was not timed so; not block sparse, not the wide one), runs a block per SM, each block drawing key tiles
# from a counter (zeroed by the preprocess) as it comes free, in the heavy-first order (a varlen call: the grid's; a
# deterministic one: det_tile's, every unit drawn, so that a key tile waits only on units that running blocks hold):
# the producer loads the next tile's K_j, V_j once the consumers' step loop is done with this one's, and its first Q_i,
# dO_i as the ring frees, while the consumers write dK_j, dV_j out (staged over the dqk^T buffers and dQ_i's parts, free
# by then, not the ring). Its producer keeps 40 registers and its consumers 232
# (BWD_PERSISTENT_REGS): each role names its tile, ranges and steps after setmaxnreg, which at 24 spilled. At 80 and 128
# rows a step the consumers spill at 232; where dqk^T and dQ_i's parts do not hold the two tiles (d96 at 64 rows), a
# block per tile; and under the other step orders (BWD_PIPELINE), whose consumers keep more (softcap's under "overlap"
# spilled past the budget at 232). H200, 2026-11-30, bench/ab_bwd_main.py, main kernel against the kernel of a block per
# tile, two runs on two GPUs in turn: window 256 at 16k 1.09x and at 4k 1.07x, d128 causal 2k 1.03x and 8k 1.04x, GQA
# 32/8 1.02x, softcap 8k 1.00x (whole backward 1.06, 1.05, 1.03, 1.03, 1.01, 1.02); compute-sanitizer clean over 2
# blocks of many tiles each. Again on 2026-11-30 (after the tier, tests/gpu/test_backward_persistent_gpu.py among it,
# ran whole on it): window 256 at 16k 1.12x, d128 causal 2k 1.03x and 8k 1.04x, GQA 32/8 1.01x (whole backward 1.08,
# 1.02, 1.01, 1.03). Its deterministic calls, first launched a block per unit (no counter), ran 0.94-0.98x the kernel
# of a block per tile (window 16k 0.94, causal 2k and 8k 0.97-0.98, GQA 32/8 0.97-0.98, main kernel, two runs); drawn
# from the counter: 1.04, 1.00, 0.985 (window, causal 2k, GQA; one run). In the backward's cache key where on.
BWD_PERSISTENT = True
BWD_PERSISTENT_REGS = (40, 232)  # (producer, consumer) registers a thread of the persistent kernel (setmaxnreg)
# BWD_PERSISTENT_BLOCKS: the persistent launch's blocks at most (0: an SM each); the tests take a few, so that each
# block runs many work tiles. Not in the cache key (the runtime's).
BWD_PERSISTENT_BLOCKS = 0


def backward_persistent(kind: Kind, head_dim: int, block_m: int) -> bool:
    """Whether a backward main kernel is persistent (BWD_PERSISTENT): the dense kind at 64 rows a step under the
    default step order, past d64 and not the wide backward, where both warpgroups' 64 keys of dK_j and dV_j (16-bit)
    fit over the dqk^T buffers and dQ_i's float32 parts."""
    if not BWD_PERSISTENT or kind is not Kind.BWD or wide_backward(head_dim) or block_m != 64 or head_dim <= 64:
        return False
    if backward_pipeline() != "overlap_dq":
        return False
    parts, cols = dq_parts(head_dim, block_m)
    staged = 4 * 64 * tile_dim(head_dim) * 2
    return staged <= 2 * 2 * backward_block_n(head_dim) * block_m + parts * dq_rows(block_m) * cols * 4


# BWD_WAVE_BLOCKS: a heavy-first chunk takes at least about this many blocks (BWD_WAVE_BLOCKS // key tiles pairs, at
# least one; 256 is about two waves of 132 SMs): L2's budget counts every query head of a pair, so that a GQA pair's
# chunk shrinks by its query heads (4 a KV head at d128 causal 8k: one pair, 64 blocks, half a wave), where without GQA
# it gives about 256 blocks at d128 (2k to 16k) and is never below BWD_WAVE_BLOCKS // key tiles (d96 to d256), so that
# only GQA's chunks change. 0: L2's budget alone. In the backward's cache key. H200, 2026-11-28, bench/ab_bwd_main.py
# (rounding to the nearest pair, the same chunks), main kernel at 0 / at 256, two passes in turn: GQA 32/8 (batch 16384
# / N) 8k 1.04, 1.04; 2k 1.08, 0.99; 16k 1.03, 1.01; GQA 16/4 8k 1.11, 1.08 (128: 1.01-1.05, 1.01, 1.00-1.01,
# 1.08-1.11); fagen bench's GQA case, forward + backward, 535, 535 TF/s at 0, 548, 525 at 256 (the bench's cells move by
# 4 % a run). GQA 32/8 d96 8k 1.04, 1.04; d192 (16/4) 0.96, 1.01 and d256 (8/2) 8k and 16k 0.99-1.00, where d192 without
# GQA (the same chunk either way) read 0.97, 1.00.
BWD_WAVE_BLOCKS = 256

# BWD_DET_PAIRS: deterministic calls take the key tiles first-first over chunks of this many (batch, KV head) pairs
# (0: the default mode's order), so that fewer key tiles of one pair run at once and wait on each other, while a
# chunk's Q_i and dO_i still share L2. In the backward's cache key. H100, 2026-11-28, backward alone at
# FlashAttention's shapes (d64 and d128, causal and not, 2k and 8k), deterministic time / default mode's: 16 pairs
# 1.04-1.20x; 0 (the default order) 1.11-1.45x; 4: 1.03-1.34x; 8: 1.04-1.33x; 12: 1.04-1.23x; 24: 1.07-1.24x.
# d128 took chunks of 8, which ran its backward 1.00-1.08x faster than 16 (two rounds; d96 0.99-1.02x, so 16), until
# BWD_DET_BLOCKS_MASKED; d192 and d256 (the wide backward) 1.08-1.23x faster with 16 than with the default order
# (H100, 2026-11-28).
# Tried and not kept: one chunk of every pair, so that the blocks that run at once wait on none of each other: forward
# + backward 1.11-1.77x the default mode's time, where the default order gave 1.09-1.40x (H100, 2026-11-28; d64 causal
# 8k and GQA gained, 2k lost most: Q_i and dO_i of some hundred heads at once were no longer shared in L2).
BWD_DET_PAIRS = 16
# BWD_DET_BLOCKS: without a mask (every key tile takes every query tile), deterministic calls take chunks of about this
# many blocks (BWD_DET_BLOCKS // key tiles pairs, at least one) in place of BWD_DET_PAIRS: a pair's key tiles then wait
# on each other only as they start. H200, 2026-11-28, bench/ab_bwd_main.py, deterministic main kernel / the default
# mode's, two passes, chunks of 1, 2, 4, 8, 16 pairs: d64 full 2k (16 key tiles) 1.32, 1.25, 1.16, 1.02, 1.01-1.02;
# d64 full 8k (64) 1.13, 1.00-1.01, 1.01-1.02, 1.03-1.05, 1.05-1.07; d128 full 2k 1.25, 1.20, 1.11, 1.05-1.09,
# 1.07-1.10; d128 full 8k 1.11, 1.03-1.04, 1.03, 1.04, 1.08. Under a mask not so (d64 causal 8k: 1.39, 1.35, 1.15,
# 1.06-1.07, 1.05; d128 causal 2k 1.44, 1.38, 1.27, 1.15-1.16, 1.14-1.15), so BWD_DET_PAIRS there, but at
# BWD_DET_BLOCKS_MASKED's head dims (d128 causal 2k: 256 blocks are 16 pairs, as fast as 8). Against those
# pairs (16; 8 at d128), deterministic main kernel: d64 full 8k 1.04x faster, d64 and d128 full 2k, d128 full and
# softcap 8k 0.98-1.01x (one run). 0: BWD_DET_PAIRS everywhere. In the backward's cache key.
BWD_DET_BLOCKS = 256
# BWD_DET_BLOCKS_MASKED: the head dims at which a masked program's deterministic calls take BWD_DET_BLOCKS too (2k: 16
# pairs; 8k: 4; 16k: 2). H200, 2026-11-28, bench/ab_bwd_main.py, deterministic main kernel in chunks of 8 pairs / in
# DET_BLOCKS, two passes in turn: d128 causal 2k 1.00, 1.00; 8k 0.99, 1.01; 16k 1.01, 1.02; GQA 32/8 (batch 16384 / N)
# 2k 1.02, 1.02; 8k 1.04, 1.05; 16k 1.09, 1.09; GQA 16/4 8k 1.03, 1.06; a 1024-key window 8k 1.01, 1.01. (Chunks of 4
# and 2 pairs, against 8: d128 causal 2k 0.92, 0.84; 8k 1.00, 0.97.) d96, against 16 pairs, one pass: causal 2k 1.00,
# 8k 1.01, GQA 32/8 8k 1.04, window 8k 0.99. d64 keeps its pairs (above: 256 blocks lost there).
BWD_DET_BLOCKS_MASKED: tuple[int, ...] = (96, 128)
# Tried and not kept (H200, 2026-11-30, bench/ab_bwd_main.py, main kernel, two runs in turn against the tree before):
# where a mask's first query rises with the key tile, deterministic calls adding into each query tile of dQ last key
# tile first, every key tile taking its query tiles first first and det_tile drawing a chunk's last key tiles first
# (key tile j + 1 reaches each query tile it shares with key tile j steps before j does, so that none waits on the one
# before it, where now each waits a step on the one before it). Deterministic: d64 causal 2k 1.08x, packed documents
# 1.07x, d192 causal 2k 1.04x, d96 causal 2k 1.02x, window 256 at 16k 1.01-1.02x; d128 causal 2k and 8k 0.96-0.98x, d64
# causal 8k 0.98x, d256 causal 2k 0.85x, GQA 32/8 causal 8k 0.67x (each key tile of a pair at its own query tile, the
# pair's Q_i, dO_i and dQ rows no longer shared in L2 as the last-first order's key tiles, side by side at one query
# tile, share them). And the default mode's steps, their query tile picked by the call's order at run time: d64 causal
# 8k 0.97x, 2k 0.99x.

# BWD_HEADS_INNER: where early key tiles see more query tiles (causal: codegen.backward_context's heads_inner, the
# range shape heavy_key_tiles_first reads), a GQA group's steps take the query heads inner (query tile outer, last
# first; each head's tile in turn), not each head's tiles in turn. A deterministic call adds into a query tile of head
# h in key-tile order: with heads outer, key tile j, with fewer query tiles a head than j - 1, reaches the next head
# before j - 1 does and waits there, head after head. H100, 2026-11-28, bench/ab_bwd_main.py, 4 query heads a KV head,
# deterministic, heads outer's time / inner's, whole backward (two runs): d128 causal 8k 1.06-1.07x, d128 causal 2k
# 1.27-1.28x, d64 causal 8k 1.06-1.07x, so that a deterministic call's backward takes 1.12x the default's (1.19x
# before) at d128 causal 8k and 1.18x (1.51x) at 2k; without a mask (every key tile as many steps a head) 0.98x, so
# heads outer there, and under a window (not measured); the default mode 0.99-1.01x (one run). Heads outer also in
# the kernels that sum a tensor's gradient over a head's tiles (their deterministic calls leave dQ to the dQ kernel,
# and wait on nothing), in the block-sparse kernel (it walks each head's list) and in the wide backward (d192, d256:
# it compiles with heads inner, but was not run so). A module setting, so that a script can time it
# (bench/ab_bwd_main.py --set); the backward's cache key holds it where it differs.
BWD_HEADS_INNER = True


# dL/d(q.k) from P with the scale folded into D_i (math.backward's (l): P (dP scale - D_i scale) f', one fused
# multiply-add and one multiply an element where dS = P (dP - D_i) and then dS f' scale took three), where no tensor's
# gradient needs dS. A module setting, so that a script can time it (bench/ab_bwd_main.py); the cache key holds it.
BWD_FOLD_SCALE = True


# dK_j and dV_j's wgmma at a head dim that is not whole 64-column blocks (d96 on d128's tiles): N = the head dim
# rounded up to 32, one wgmma a k-step whose B (MN-major) spans one and a half 128-byte swizzle blocks, where the
# tile's width (False) also multiplies TMA's zero columns 96-127, a third more of those products' work. H100,
# 2026-11-27, bench/ab_bwd_main.py, d96 causal and not, 2k and 8k, two rounds: main kernel 1.006-1.040x; an N = 64
# and an N = 32 wgmma a k-step instead ran 0.95-1.00x. A module setting, so that a script can time it; the backward's
# cache key holds it.
BWD_NARROW_KV = True


# DS_FIRST_ROWS: at these query rows a step (128: d64), dqk^T goes to shared memory before dV's wgmma is issued, whose
# issue then covers the stores before the fence and BAR_DS (FlashAttention-3's order; its comment: faster at d64). A
# module setting, so that a script can time it (bench/ab_bwd_main.py --set); the backward's cache key holds it where it
# differs. H100, 2026-11-28, backward alone at FlashAttention's shapes, three rounds: d64 main kernel 1.03-1.06x causal
# and 0.99-1.02x not (2k and 8k); at d128 (64 rows) 0.98-0.99x, so 64 rows keep the stores after dV's issue; at 80
# rows (d128 full 2k and 8k, two runs) main kernel 0.99-1.02x and whole backward 0.97-0.99x, so 80 rows keep them too.
# Tried and not kept: the consumers' arrivals on a stage's empty mbarrier and on dq_full by each warp's lane 0 after
# __syncwarp (FlashAttention-4's consumer group: 8 arrivals a step for 256): d64 causal 0.87-0.90x, d128 1.00-1.01x
# (H100, 2026-11-28); racecheck reported 48 hazards with it and dqk^T stored first, none with dqk^T stored first alone.
DS_FIRST_ROWS = (128,)
# Tried and not kept: a consumer's lse_i loads (8 bytes a row pair) issued while S^T's and dP^T's wgmma run, not after
# their wait (FlashAttention-4 loads its lse there; the short-scoreboard stalls on them were 6 % of the d128 causal main
# kernel's warp samples). H200, 2026-11-29, bench/ab_bwd_main.py, two runs: 64 rows (d128 causal 2k and 8k, GQA 32/8,
# a 1024-key window) main kernel 0.99-1.03x, within the runs' spread; 80 rows spilled 16 bytes and ran 0.80-0.82x.

# DQ_BARRIER_HEAD_DIMS: a consumer warpgroup's dQ part and the producer's warp 1 hand it over at named barriers
# (bar.arrive and bar.sync of the warpgroup's 128 threads and the warp's 32; FlashAttention-3's dQFull / dQEmpty), where
# the dq_full / dq_empty mbarriers take 128 arrivals and a try_wait spin a step (not at d192 and d256), at the head dims
# DQ_BARRIER_HEAD_DIMS. H100, 2026-11-28, bench/ab_bwd_main.py, mbarriers' time / named barriers', two runs: d64 full
# and causal 8k main kernel 1.02-1.05x, whole backward 1.02-1.04x; d128 (80 rows full, 64 causal) main 0.99-1.01x, whole
# 0.97-0.99x, so d128 keeps the mbarriers. A module setting, so that a script can time it (`--set
# DQ_BARRIER_HEAD_DIMS=64:128`); the backward's cache key holds it where it differs.
DQ_BARRIER_HEAD_DIMS = (64,)
# Tried and not kept: reading a consumer thread's lse_i and D_i of its first 2 row groups while S^T's and dP^T's wgmma
# run, not after they land (Nsight Compute put 6.6 % of the d128 causal main kernel's stall samples on the short
# scoreboard of the first products that read them). H200, 2026-11-28, bench/ab_bwd_main.py, main kernel, two passes:
# d128 causal 8k 1.017 / 0.944x, d96 causal 8k 0.979 / 0.959x, d128 causal 2k, window 1024 and GQA 32/8 0.99-1.01x;
# softcap d128 spilled 20 bytes with it.


def o_cols(head_dim: int) -> int:
    """The columns of O = P V the forward's wgmma compute: the head dim rounded up to 32, one wgmma a k-step over
    V's 128-byte swizzle blocks (at d96 one and a half), not TMA's zero columns past it."""
    return -(-head_dim // 32) * 32


def kv_cols(head_dim: int) -> int:
    """The columns of dK_j and dV_j a warpgroup's wgmma compute: O's (o_cols; the chunked store takes 16 columns at a
    time), or the tile's width (BWD_NARROW_KV off)."""
    return o_cols(head_dim) if BWD_NARROW_KV else tile_dim(head_dim)


def backward_order() -> str:
    """The key-tile order the backward's main kernel is built with (BWD_ORDER, checked)."""
    if BWD_ORDER not in BWD_ORDERS:
        raise SpecError(f"wgmma.BWD_ORDER must be one of {BWD_ORDERS}, not {BWD_ORDER!r}")
    return BWD_ORDER


def backward_pipeline() -> str:
    """The wgmma order the backward's main kernel is built with (BWD_PIPELINE, checked)."""
    if BWD_PIPELINE not in BWD_PIPELINES:
        raise SpecError(f"wgmma.BWD_PIPELINE must be one of {BWD_PIPELINES}, not {BWD_PIPELINE!r}")
    return BWD_PIPELINE


# ROWS80_HEAD_DIMS: without a mask, d96 and d128 take 80 query rows a step (FlashAttention-3's and -4's non-causal d128
# tile): a step's fixed costs (its waits, the meeting at BAR_DS, dQ's write-out) spread over 1.25x the products. dQ_i is
# then computed transposed, dQ_i^T = K_j^T dqk_ij^T (80 rows cannot be split into two warpgroups' 64), from dqk stored
# [queries][keys] (dq_swap). Under a mask or a score function (builders.backward_masked), or where a step must hold more
# (the tensor gradients' row sums, the block mask's step table: shared memory is full at 80 rows), 64. H100, 2026-11-28,
# bench/ab_bwd_main.py, d128 without a mask, 64 rows' time / 80 rows': main kernel 1.02-1.04x, whole backward 1.02-1.07x
# (2k and 8k, two runs); softcap 0.84-0.87x (it spills 4 bytes at 80 rows), so a score function keeps 64 (as
# FlashAttention-3's softcap tiles; ALiBi and other score functions were not timed at 80). d96 without a mask, same
# measure: main kernel 1.01-1.04x, whole backward 1.02-1.03x (2k and 8k, two runs, 2026-11-28). Under a mask, 80 rows
# compile without spills (d128 causal: 168 registers) but lose at d128: 64 rows' time / 80 rows', main kernel 0.79-0.80x
# causal 2k, 0.83-0.87x causal 8k, 0.75-0.77x window 1024 at 8k; d96 causal 8k 1.01-1.02x (whole backward 1.01-1.05x;
# H100, 2026-11-28, two runs), too little to split masked d96 from d128. A module setting, so that a script can time it
# (`--set ROWS80_HEAD_DIMS=`: none); the backward's cache key holds it where it differs.
ROWS80_HEAD_DIMS = (96, 128)


def rows80(kind: Kind, head_dim: int, masked: bool) -> bool:
    """Whether a backward main kernel takes 80 query rows a step: the dense kernel (not the block-sparse one; the
    variant that sums the tensors' gradients takes 64 too, Wgmma.main_variant: shared memory) at ROWS80_HEAD_DIMS, for
    a program without a mask or a score function (`masked`: either, builders.backward_masked)."""
    return kind is Kind.BWD and not masked and head_dim in ROWS80_HEAD_DIMS


def backward_block_m(kind: Kind, head_dim: int, masked: bool) -> int:
    """Query rows a backward step takes: 128 at d64 (S^T, dP^T and dK, dV fit 240 registers), 80 where rows80 says,
    else 64."""
    if head_dim <= 64:
        return 128
    return 80 if rows80(kind, head_dim, masked) else 64


def backward_block_n(head_dim: int) -> int:
    return WIDE_BWD_BLOCK_N if wide_backward(head_dim) else BWD_BLOCK_N


def backward_stages(head_dim: int) -> int:
    if dq_ring(head_dim):
        return DQ_RING_STAGES
    return WIDE_BWD_STAGES.get(head_dim, BWD_STAGES)


def det_order(kind: Kind, head_dim: int, masked: bool) -> dict:
    """How the dense backward's deterministic calls chunk the (batch, KV head) pairs: det_blocks (about that many blocks
    a chunk) without a mask and at BWD_DET_BLOCKS_MASKED's head dims, det_pairs (that many pairs) under a mask
    elsewhere; both 0 in the block-sparse kernel (unordered)."""
    if kind is not Kind.BWD:
        return dict(det_pairs=0, det_blocks=0)
    if BWD_DET_BLOCKS and (not masked or head_dim in BWD_DET_BLOCKS_MASKED):
        return dict(det_pairs=0, det_blocks=BWD_DET_BLOCKS)
    return dict(det_pairs=BWD_DET_PAIRS, det_blocks=0)


# DQ_SINGLE_HEAD_DIMS: at these head dims, where a step takes 64 rows, warpgroup 0 alone computes dQ_i, over every
# column of the head dim and every key of K_j (FlashAttention-4's dQ_single_wg at d96), and warpgroup 1 issues dK's
# wgmma straight after the meeting. Split by 64-column blocks, d96's second block is a half of TMA's zero columns: a
# third of dQ's products there are zeros. H200, 2026-11-29, bench/ab_bwd_main.py, the split's time / warpgroup 0's, two
# runs: main kernel d96 causal 2k 1.026-1.029x, 8k 1.044-1.047x, a 256-key window at 8k 1.017-1.018x; whole backward
# 1.017-1.024x, 1.038-1.046x, 1.015-1.017x. Without a mask, 64 rows with warpgroup 0's dQ against 80 rows (the split,
# transposed): 0.954-1.002x at 2k, 0.982-0.994x at 8k, so 80 rows stay (ROWS80_HEAD_DIMS). The backward's cache key
# holds the setting where it differs.
DQ_SINGLE_HEAD_DIMS = (96,)


# Tried and not kept: at d96 (64 rows a step), dQ split by keys over 96 columns, each warpgroup alone with no meeting
# before it (dQ parts 64 x 96): 0.83-0.87x the columns split's speed (H100, 2026-11-28; twice the additions into
# dq_accum).
def dq_split(head_dim: int, block_m: int) -> str:
    """How the two warpgroups share dQ_i = dS K_j: by rows where a step has 128 (64 each), not at all at
    DQ_SINGLE_HEAD_DIMS (64 rows: warpgroup 0 takes every column), by columns where the head dim has two 64-column
    blocks or more (at 80 rows, transposed: dq_swap), else by keys (each its own 64, both adding into dq_accum)."""
    if block_m == 128:
        return "rows"
    if block_m == 64 and head_dim in DQ_SINGLE_HEAD_DIMS:
        return "single"
    return "cols" if tile_dim(head_dim) >= 128 else "keys"


def dq_swap(block_m: int) -> bool:
    """Whether a step's dQ_i is computed transposed (dQ_i^T = K_j^T dqk^T, 80 rows a step: wgmma's M is 64 rows of the
    head dim and N the step's rows), dqk stored [queries][keys]."""
    return block_m == 80


def dq_rows(block_m: int) -> int:
    """Rows of a consumer warpgroup's float32 part of dQ_i (and of dq_accum's TMA boxes): half a 128-row step, else
    the step's."""
    return 64 if block_m == 128 else block_m


def dq_parts(head_dim: int, block_m: int) -> tuple[int, int]:
    """The consumers' float32 parts of dQ_i in shared memory: how many (one where warpgroup 0 alone computes dQ) and
    the columns of each (a warpgroup's part: half the tile's width split by columns, the head dim's own columns
    alone, else the tile's width)."""
    split, width = dq_split(head_dim, block_m), tile_dim(head_dim)
    return (1, o_cols(head_dim)) if split == "single" else (2, width // 2 if split == "cols" else width)


def backward_smem_bytes(
    head_dim: int, block_m: int, stages: int = BWD_STAGES, tensor_grads: bool = True, persistent: bool = False
) -> int:
    """BWD: K_j and V_j, a `stages`-deep ring of Q_i and dO_i, two dqk^T buffers (all 16-bit), the consumers'
    float32 parts of dQ_i (dq_parts: two, or one at d96, of dq_rows rows), the ring's lse_i and D_i (block_m floats
    each), a float per consumer warp, the mbarriers (K/V's, full and empty per stage, dQ's full and empty per part),
    1024 bytes to align the swizzled tiles at run time, and, where `tensor_grads`, the row sums of the tensor
    gradients (the kernel's static rowsum_s: up to 4 x 8 consumer warps x block_m floats, contract.MAX_ROW_GRADIENTS).
    At a wide head dim: 64 keys, one buffer each of P^T and dqk^T, dQ_i's parts over every column (64 rows; none
    where dq_ring stages them in the ring), and one more mbarrier, where the two consumer warpgroups (each its own
    copy of the step loop) meet. A `persistent` kernel: three more mbarriers (a work tile named, read; K_j, V_j
    free) and the named work tile (16 bytes)."""
    m, n = block_m, backward_block_n(head_dim)
    mbarriers = 5 + 2 * stages + (3 + 2 if persistent else 0)
    if wide_backward(head_dim):
        tiles = 2 * tile_dim(head_dim) * (2 * n + 2 * stages * m) + 2 * 2 * n * m
        tiles += 0 if dq_ring(head_dim) else 64 * tile_dim(head_dim) * 4
        mbarriers += 1
    else:
        parts, cols = dq_parts(head_dim, m)
        tiles = 2 * tile_dim(head_dim) * (2 * n + 2 * stages * m) + 2 * 2 * n * m + parts * dq_rows(m) * cols * 4
    rowsum = 4 * 8 * (1 + MAX_ROW_GRADIENTS) * m if tensor_grads else 0
    return tiles + 4 * 2 * stages * m + 4 * 8 + 8 * mbarriers + 1024 + rowsum


def smem_bytes(head_dim: int, block_n: int, stages: int, block_m: int = BLOCK_M, persistent: bool = False) -> int:
    """Q_i, a ring of K_j and V_j tiles (16-bit), O_i's own tile where the kernel is persistent (else O goes over
    Q_i), 256 bytes of mbarriers, a scratch word per consumer thread (2 block_m of them), and 1024 bytes to align
    the swizzled tiles at run time."""
    rows = block_m * (2 if persistent else 1) + 2 * stages * block_n
    return 2 * tile_dim(head_dim) * rows + 256 + 4 * 2 * block_m + 1024


@functools.cache
def sm_count(device: int) -> int:
    from cupy.cuda import runtime

    return runtime.deviceGetAttribute(runtime.cudaDevAttrMultiProcessorCount, device)


# wgmma's shared-memory forms beside `ss` (A and B K-major): (name, comment, A transposed, B transposed).
SS_FORMS = {
    "mn_major": ("ss_mn", "A = 64x16 and B = 16x{n} both MN-major (transposed) in shared memory", 1, 1),
    "k_mn": ("ss_kmn", "A = 64x16 K-major and B = 16x{n} MN-major (transposed) in shared memory", 0, 1),
    "mn_k": ("ss_mnk", "A = 64x16 MN-major (transposed) and B = 16x{n} K-major in shared memory", 1, 0),
}


def _ss(name: str, comment: str, n: int, t: str, tnsp_a: int, tnsp_b: int) -> str:
    """One shared-memory wgmma of m64n{n}k16 as an inline-asm method (`accumulate` 0: d = A B)."""
    r = n // 2
    acc = ", ".join(f"%{i}" for i in range(r))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(r))
    return (
        f"    // d (+)= A * B, {comment}\n"
        f"    static __device__ __forceinline__ void {name}(float (&d)[{r}], unsigned long long da, "
        f"unsigned long long db, int accumulate) {{\n"
        f'        asm volatile("{{ .reg .pred p; setp.ne.b32 p, %{r + 2}, 0;\\n"\n'
        f'            "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{t}.{t} {{{acc}}}, '
        f'%{r}, %{r + 1}, p, 1, 1, {tnsp_a}, {tnsp_b}; }}"\n'
        f"            : {outs}\n"
        f'            : "l"(da), "l"(db), "r"(accumulate));\n'
        f"    }}\n"
    )


def wgmma_helpers(
    ns: tuple[int, ...],
    dtype: str,
    mn_major: tuple[int, ...] = (),
    k_mn: tuple[int, ...] = (),
    mn_k: tuple[int, ...] = (),
) -> str:
    """The `Wgmma<N>` specialisations for the N the kernel uses: each wgmma shape needs its own asm string with
    N/2 accumulator operands, so they are written here rather than typed. The N in `mn_major` also get `ss_mn`
    (A and B both MN-major in shared memory: the backward's dQ = dS K from dSᵀ and K as stored), those in `k_mn`
    `ss_kmn` (A K-major, B MN-major: the wide backward's dV = Pᵀ dO and dK = dSᵀ Q from shared memory), those in
    `mn_k` `ss_mnk` (A MN-major, B K-major: the backward's dQᵀ = Kᵀ dSᵀ at 80 rows a step, from K and dS as stored)."""
    t = {"bf16": "bf16", "f16": "f16"}[dtype]
    forms = {"mn_major": mn_major, "k_mn": k_mn, "mn_k": mn_k}
    out = [f"template <int N> struct Wgmma;   // m64nNk16 {t} -> f32 wgmma, one specialisation per N"]
    for n in sorted(set(ns) | set(mn_major) | set(k_mn) | set(mn_k)):
        r = n // 2
        acc = ", ".join(f"%{i}" for i in range(r))
        outs = ", ".join(f'"+f"(d[{i}])' for i in range(r))
        out.append(
            f"template <> struct Wgmma<{n}> {{\n"
            + _ss("ss", f"A = 64x16 and B = 16x{n} both K-major in shared memory (descriptors)", n, t, 0, 0)
            + f"    // d += A * B, A = 64x16 from registers (mma.sync A-fragment layout), "
            f"B = 16x{n} MN-major (transposed)\n"
            f"    static __device__ __forceinline__ void rs(float (&d)[{r}], const unsigned (&a)[4], "
            f"unsigned long long db, int accumulate) {{\n"
            f'        asm volatile("{{ .reg .pred p; setp.ne.b32 p, %{r + 5}, 0;\\n"\n'
            f'            "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{t}.{t} {{{acc}}}, '
            f'{{%{r}, %{r + 1}, %{r + 2}, %{r + 3}}}, %{r + 4}, p, 1, 1, 1; }}"\n'
            f"            : {outs}\n"
            f'            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate));\n'
            f"    }}\n"
            + "".join(
                _ss(name, comment.format(n=n), n, t, a, b)
                for form, (name, comment, a, b) in SS_FORMS.items()
                if n in forms[form]
            )
            + "};"
        )
    return "\n".join(out)


# --- tensor maps (cuTensorMapEncodeTiled through the driver, no headers) -------------------------------------
_DTYPE = {"f16": 6, "bf16": 9, "f32": 7}  # CU_TENSOR_MAP_DATA_TYPE_FLOAT16, _BFLOAT16, _FLOAT32
_SWIZZLE_128B, _L2_256B = 3, 3
MAPPED = ("q", "k", "v", "o")  # the arrays the forward's TMA reads (q, k, v) and writes (o)
BWD_MAPPED = ("q", "k", "v", "dout")  # the arrays the backward's main kernel reads by TMA (and adds dQ into dq_accum)


def _map_params(names):
    return tuple(Param(f"{n}_map", "const __grid_constant__ TmaMap", "tmap") for n in names)


TMAP_PARAMS, BWD_TMAP_PARAMS = _map_params(MAPPED), _map_params(BWD_MAPPED + ("dq_accum",))
# the backward's deterministic mode: a counter per (sequence, query head, query tile), zero before a launch (null: the
# additions into dq_accum come in any order), and the query tiles a head has (the counters' row length)
BWD_ORDER_PARAMS = (Param("dq_semaphore", "int* __restrict__", "ptr"), Param("dq_sem_tiles", "int", "i32"))
# a persistent forward's grid of work tiles (query tiles, heads, batch or sequences) and the counter its blocks draw
# work tiles from (two int32, zero before a launch and set back to zero by its last block: one per call shape and
# stream, kept by the runtime)
GRID_PARAMS = (*(Param(f"grid_{n}", "int", "i32") for n in ("m", "h", "b")), Param("tile_counter", "int*", "ptr"))
# a persistent backward's grid of work tiles (key tiles, KV heads, batch) and the counter its blocks draw from (one
# int32, zeroed by the preprocess; null: a block per work tile, the grid's blocks in its order)
BWD_GRID_PARAMS = (*(Param(f"grid_{n}", "int", "i32") for n in ("n", "h", "b")), Param("tile_counter", "int*", "ptr"))
# the K and V bytes a chunk of heads may keep in L2 while a masked persistent forward runs the chunk's tiles longest
# first (H100 and H200: 50 MB of L2)
L2_KV_BYTES = 32 << 20


def _driver():
    lib = getattr(_driver, "lib", None)
    if lib is None:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuTensorMapEncodeTiled.restype = ctypes.c_int
        lib.cuTensorMapReplaceAddress.restype = ctypes.c_int
        lib.cuTensorMapReplaceAddress.argtypes = (ctypes.c_void_p, ctypes.c_void_p)
        _driver.lib = lib
    return lib


def encode_map(buf, array, rows: int, dtype: str) -> None:
    """A 4-D map (D, S, H, B) of a [B, H, S, D] array with its own strides, into the 128-byte `buf`: boxes of
    128 bytes of columns (64 16-bit values, 32 floats) x `rows` rows of one head, 128-byte swizzled; rows past S
    read as zeros (and are not written)."""
    B, H, S, D = array.shape
    size = 4 if dtype == "f32" else 2
    dims = (ctypes.c_uint64 * 4)(D, S, H, B)
    strides = (ctypes.c_uint64 * 3)(*map_strides(array.shape, array.strides, size))
    box = (ctypes.c_uint32 * 4)(128 // size, rows, 1, 1)
    one = (ctypes.c_uint32 * 4)(1, 1, 1, 1)
    err = _driver().cuTensorMapEncodeTiled(
        ctypes.byref(buf),
        _DTYPE[dtype],
        4,
        ctypes.c_void_p(array.ptr),
        dims,
        strides,
        box,
        one,
        0,
        _SWIZZLE_128B,
        _L2_256B,
        0,
    )
    if err:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed (CUresult {err}) for an array of shape {array.shape}")


class TensorMaps:
    """The tensor maps of a prepared call shape (the forward's q, k, v and o; the backward's q, k, v and dout, and
    its float32 dq_accum where `arrays` has one): encoded once into the argument pack, then only the global
    addresses of q, k, v and o / dout are replaced on each call (dq_accum is the call shape's own). Boxes are the
    kernel's tiles: block_m rows of q (and dout), block_n of k and v, one consumer warpgroup's 64 rows of o, and
    the rows of its part of dQ (dq_rows)."""

    def __init__(self, slots: dict, arrays: dict, spec):
        self.slots = slots
        names = BWD_MAPPED if spec.kind in BWD_MAINS else MAPPED
        rows = {"q": spec.block_m, "dout": spec.block_m, "k": spec.block_n, "v": spec.block_n, "o": 64}
        for name in names:
            encode_map(slots[f"{name}_map"], arrays[name], rows[name], spec.dtype)
        if spec.kind in BWD_MAINS and "dq_accum" in arrays:
            encode_map(slots["dq_accum_map"], arrays["dq_accum"], dq_rows(spec.block_m), "f32")
        self.maps = [ctypes.addressof(slots[f"{n}_map"]) for n in names]
        self.last = tuple(arrays[n].ptr for n in names)
        self.replace = _driver().cuTensorMapReplaceAddress

    def update(self, *ptrs: int) -> None:
        """The arrays' addresses, in the order of the kernel's maps (MAPPED, or BWD_MAPPED)."""
        if ptrs == self.last:  # the usual repeated call: nothing moved
            return
        for i, ptr in enumerate(ptrs):
            if ptr != self.last[i]:  # a map is rewritten only when its array moved
                err = self.replace(self.maps[i], ptr)
                if err:
                    raise RuntimeError(f"cuTensorMapReplaceAddress failed (CUresult {err})")
        self.last = ptrs


class Wgmma(Tier):
    name = "wgmma"
    priority = 20
    templates = {
        Kind.FORWARD: "flash_fwd_wgmma.cu.jinja",
        Kind.FORWARD_SPARSE: "flash_fwd_wgmma.cu.jinja",
        Kind.BWD: "flash_bwd_wgmma.cu.jinja",
        Kind.BWD_SPARSE: "flash_bwd_wgmma.cu.jinja",
    }
    exp2 = "fast_exp2"
    tanh = "fast_tanh"
    fallback = "mma"
    describe = "default for f16/bf16 on sm_90a (Hopper: wgmma, TMA, warp specialization)"
    # The backward's main kernel steps down (d64: 128 -> 64 query rows a step, d96 and d128: 80 -> 64, then the mma
    # tier's kernel) where its stack passes 32 bytes (more than 64 rows a step) or 64 (64 rows). At 240 registers a
    # consumer thread, NVRTC 13.0 and 13.5 each leave a few words of per-thread constants (addresses) in local memory
    # for some variants, reloaded a few times a step from L1: d64 causal at 128 rows with 44 bytes of them ran
    # 1.11-1.12x the 64-row kernel forward + backward (H100, 2026-11-25, 2k and 8k). A kernel of more than 64 rows a
    # step steps down to the 64-row one past LARGE_STEP_STACK_BUDGET: a gathered document mask (causal within documents)
    # at d64 and 128 rows has 40 bytes (NVRTC 13, since the masked steps evaluate the mask beside its selects) and its
    # main kernel ran 5.27 ms against 4.49 at 64 rows (H200, 2026-11-28, 8k, two passes), where d64 ALiBi, a 256-key
    # window and softcapped ALiBi under a 300-key window (16 bytes) keep 128.
    backward_stack_budget = 64
    LARGE_STEP_STACK_BUDGET = 32

    def too_heavy(self, spec, resources):
        if spec.kind in BWD_MAINS and spec.block_m > 64 and resources.stack_frame > self.LARGE_STEP_STACK_BUDGET:
            return f"{spec.name}'s stack frame ({resources.stack_frame} B) is over {self.LARGE_STEP_STACK_BUDGET} B"
        return super().too_heavy(spec, resources)

    def orders_key_tiles(self, spec) -> bool:
        # measured (H100, 2026-11-27, bench/ab_backward_order.py, backward alone, against the natural order): d128
        # causal 2k and 8k 1.03x, GQA 32/8 1.01x, d256 1.01x, d128 16k 1.00x; d64 causal 0.98-1.00x and packed
        # documents 0.98x (the kernel keeps the grid's order for varlen calls), so not below 128 columns
        return backward_order() == "heavy_first" and tile_dim(spec.head_dim) >= 128

    def takes_heads_inner(self, spec) -> bool:
        # BWD_HEADS_INNER: the dense kernel that sums no tensor's gradient over a head's tiles, not the wide one
        return BWD_HEADS_INNER and spec.kind is Kind.BWD and not spec.tensor_grads and not wide_backward(spec.head_dim)

    def folds_scale(self, spec) -> bool:
        return BWD_FOLD_SCALE and spec.kind in (Kind.BWD, Kind.BWD_SPARSE)

    def backward_key(self):
        return {
            "step_order": backward_pipeline(),
            "order": backward_order(),
            **({} if BWD_WIDE else {"wide": False}),
            **({} if BWD_FOLD_SCALE else {"fold_scale": False}),
            **({} if BWD_NARROW_KV else {"narrow_kv": False}),
            **({"det_pairs": BWD_DET_PAIRS} if BWD_DET_PAIRS else {}),
            **({"det_blocks": BWD_DET_BLOCKS} if BWD_DET_BLOCKS else {}),
            **({} if BWD_DET_BLOCKS_MASKED == (96, 128) else {"det_blocks_masked": BWD_DET_BLOCKS_MASKED}),
            **({"wave_blocks": BWD_WAVE_BLOCKS} if BWD_WAVE_BLOCKS else {}),
            **({} if BWD_HEADS_INNER else {"heads_inner": False}),
            **({} if DS_FIRST_ROWS == (128,) else {"ds_first_rows": DS_FIRST_ROWS}),
            **({} if ROWS80_HEAD_DIMS == (96, 128) else {"rows80": ROWS80_HEAD_DIMS}),
            **({} if DQ_BARRIER_HEAD_DIMS == (64,) else {"dq_bars": DQ_BARRIER_HEAD_DIMS}),
            **({} if DQ_SINGLE_HEAD_DIMS == (96,) else {"dq_single": DQ_SINGLE_HEAD_DIMS}),
            **({} if DQ_RING_HEAD_DIMS == (256,) else {"dq_ring": DQ_RING_HEAD_DIMS}),
            **({"persistent": True} if BWD_PERSISTENT else {}),
            **({} if BWD_PERSISTENT_REGS == (40, 232) else {"persistent_regs": BWD_PERSISTENT_REGS}),
        }

    def supports(self, kind, head_dim, dtype, arch):
        if kind not in self.templates:
            return f"no {kind.value} kernel in this tier"
        if arch != "sm_90a":
            return f"wgmma and setmaxnreg need sm_90a, not {arch}"
        if dtype not in ("f16", "bf16"):
            return f"{dtype} inputs have no 16-bit tensor-core path"
        if kind in BWD_MAINS and head_dim not in BWD_HEAD_DIMS:
            return f"the backward's wgmma kernel takes head dims {BWD_HEAD_DIMS}, not {head_dim}"
        if kind is Kind.BWD_SPARSE and wide_backward(head_dim):
            return f"the block-sparse backward takes head dims up to 128, not {head_dim} (the dense backward runs)"
        if kind is Kind.BWD and wide_backward(head_dim) and not BWD_WIDE:
            return f"the backward's wgmma kernel at head dim {head_dim} is off (wgmma.BWD_WIDE)"
        if head_dim not in HEAD_DIMS:
            return f"head dim {head_dim} is not one of {', '.join(map(str, HEAD_DIMS))}"
        return None

    def validate(self, spec):
        if spec.kind in BWD_MAINS:
            block_n = backward_block_n(spec.head_dim)
            if spec.block_m not in (64, 80, 128) or (spec.block_n, spec.num_warps) != (block_n, BWD_NUM_WARPS):
                return (
                    f"the backward takes block_m=64, 80 or 128, block_n={block_n} at head dim {spec.head_dim} and "
                    f"num_warps={BWD_NUM_WARPS} (a producer warpgroup and two consumer warpgroups of 64 keys)"
                )
            if spec.block_m == 128 and spec.head_dim != 64:  # dK, dV, S^T, dP^T alone would take 256 registers
                return f"the backward takes block_m=128 at head dim 64 only, not {spec.head_dim}"
            if spec.block_m == 80 and (spec.head_dim not in ROWS80_HEAD_DIMS or spec.kind is not Kind.BWD):
                return (
                    f"the backward takes block_m=80 at head dims {ROWS80_HEAD_DIMS} in its dense kernel only, not "
                    f"{spec.kind.value} at head dim {spec.head_dim}"
                )
            if spec.block_m == 80 and spec.tensor_grads:
                return "the tensor gradients' row sums do not fit shared memory beside 80 rows' tiles: block_m=64"
            least = 1 if wide_backward(spec.head_dim) else 2
            if spec.stages < least or self.smem_bytes(spec) > SMEM_LIMIT[spec.arch]:
                return f"the backward's ring of {spec.stages} stages must be {least} deep or more and fit shared memory"
            return self.supports(spec.kind, spec.head_dim, spec.dtype, spec.arch)
        if spec.block_m not in CONSUMER_REGS or spec.num_warps != num_warps(spec.block_m):
            return (
                f"block_m must be one of {tuple(CONSUMER_REGS)} with num_warps = 4 (block_m / 64 + 1) "
                "(a producer and a consumer warpgroup per 64 rows)"
            )
        if not consumers_fit(spec.block_m, spec.head_dim, spec.block_n):
            return (
                f"block_m={spec.block_m} leaves {CONSUMER_REGS[spec.block_m]} registers a thread: too few for head "
                f"dim {spec.head_dim} with block_n={spec.block_n}"
            )
        if spec.block_n % 16 or not 16 <= spec.block_n <= 256 or spec.stages < 2:
            return f"block_n={spec.block_n} must be a multiple of 16 up to 256, with at least 2 stages"
        if spec.persistent and self.smem_bytes(spec) > SMEM_LIMIT[spec.arch]:
            return f"a persistent kernel's own O tile does not fit {spec.arch}'s shared memory beside these tiles"
        return self.supports(spec.kind, spec.head_dim, spec.dtype, spec.arch)

    def configure(self, kind, head_dim, dtype, arch, masked):
        from ..tuned import tuned_entry

        if kind in BWD_MAINS:
            block_m = backward_block_m(kind, head_dim, masked)
            block_n, stages = backward_block_n(head_dim), backward_stages(head_dim)
            return dict(block_m=block_m, block_n=block_n, num_warps=BWD_NUM_WARPS, stages=stages), "rules"
        entry = tuned_entry(self.name, arch, head_dim, dtype, masked)
        block_m = BLOCK_M
        if entry:
            block_n, stages, source = entry["block_n"], entry["stages"], "tuning table"
            if entry.get("block_m") in CONSUMER_REGS and consumers_fit(entry["block_m"], head_dim, block_n):
                block_m = entry["block_m"]
        else:
            (block_n, stages), source = RULE[head_dim], "rules"
        if smem_bytes(head_dim, block_n, stages, block_m) > SMEM_LIMIT[arch]:
            raise SpecError(f"head_dim {head_dim}: the wgmma tiles do not fit {arch}'s shared memory")
        tiles = dict(block_m=block_m, block_n=block_n, num_warps=num_warps(block_m), stages=stages)
        return dict(tiles, persistent=self.persistent(kind, head_dim, arch, masked, tiles)), source

    def persistent(self, kind, head_dim, arch, masked, tiles):
        """A block per SM taking work tiles in turn hides a tile's first loads under the last one's softmax and
        stores: persistent where O's own tile fits. Without a mask every work tile costs the same; under one, blocks
        draw work tiles from a counter as they come free, the longest query tiles first (H100, 2026-11-25, d128 causal
        128 x 128 at 2 stages, then in static pairs of query tiles: 1.04-1.14x the tuned 3-stage tiles launched a
        block per tile at 1k-8k, 1.00x at 16k). At three consumer warpgroups (d64's 192 rows) static pairs were
        uneven (11 query tiles at 2k); drawn from the counter, d64 causal 192 x 128 at 2k runs in 0.94x the time of
        the pairs (339 against 361 us, H100 and H200, 2026-11-26)."""
        return (
            kind in self.persistent_kinds
            and smem_bytes(head_dim, tiles["block_n"], tiles["stages"], tiles["block_m"], True) <= SMEM_LIMIT[arch]
        )

    def smem_bytes(self, spec):
        if spec.kind in BWD_MAINS:  # (block sparse: a stage's query head and table entry beside the mbarriers)
            extra = 8 * spec.stages if spec.kind is Kind.BWD_SPARSE else 0
            persistent = backward_persistent(spec.kind, spec.head_dim, spec.block_m)
            return backward_smem_bytes(spec.head_dim, spec.block_m, spec.stages, spec.tensor_grads, persistent) + extra
        return smem_bytes(spec.head_dim, spec.block_n, spec.stages, spec.block_m, spec.persistent)

    def main_variant(self, spec, **fields):
        """The main kernel's variant with `fields` (tensor_grads, or kind BWD_SPARSE), checked: 64 rows a step where
        the main kernel takes 80 (their row sums and step table do not fit beside 80 rows' tiles)."""
        if spec.block_m == 80:
            fields = {"block_m": 64, **fields}
        return self.replace(spec, **fields)

    def tight(self, spec):
        """Three consumer warpgroups hold 160 registers a thread: d64 softcap spills there at 128 keys. The backward
        at d64 takes 128 query rows a step and at d96 and d128 80: a score function may spill there and step down to
        64."""
        if spec.kind in BWD_MAINS:
            return spec.block_m > 64
        return spec.kind is Kind.FORWARD and spec.block_m > BLOCK_M

    def lighter(self, spec):
        """Narrower key tiles when a score function's registers spill (a gathered bias read per element): S and
        P take block_n / 2 registers a thread, so halving block_n frees them; down to 64 keys. Three consumer
        warpgroups (192 rows) first try 96 keys, then two warpgroups. The backward has two configurations at d64
        (128 or 64 query rows a step) and at d96 and d128 (80 or 64), one at d192 and d256: where a score function
        makes the last spill, its main kernel goes to the first tier of the fallback family that takes the head dim
        (mma at d64 and d128, else simt). The block-sparse backward steps down to 64 rows only (no other tier has
        one: the runtime runs the dense backward where it is missing)."""
        if spec.kind in BWD_MAINS:
            if spec.block_m > 64:
                return self.replace(spec, block_m=64)
            if spec.kind is Kind.BWD_SPARSE:
                return None
            from . import get

            name = self.fallback
            while get(name).supports(Kind.BWD, spec.head_dim, spec.dtype, spec.arch) is not None:
                name = get(name).fallback
            tiles, _ = get(name).configure(Kind.BWD, spec.head_dim, spec.dtype, spec.arch, False)
            return check(
                KernelSpec(
                    spec.variant,
                    spec.head_dim,
                    spec.dtype,
                    spec.arch,
                    name,
                    kind=Kind.BWD,
                    tensor_grads=spec.tensor_grads,
                    **tiles,
                )
            )
        if spec.block_m > BLOCK_M:  # three consumer warpgroups at 160 registers: 96 keys, then two warpgroups at 240
            if spec.kind is Kind.FORWARD and spec.block_n > WIDE_STEP_N:
                return self.replace(spec, block_n=WIDE_STEP_N)
            return self.replace(spec, block_m=BLOCK_M, num_warps=NUM_WARPS)
        if spec.kind is Kind.FORWARD and spec.block_n > 64:
            return self.replace(spec, block_n=max(64, spec.block_n // 2 // 16 * 16))
        return None

    def candidates(self, kind, head_dim, dtype, arch):
        return [
            dict(block_m=bm, block_n=bn, num_warps=num_warps(bm), stages=st)
            for bm in CONSUMER_REGS
            for bn in (64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224)
            for st in (2, 3)
            if consumers_fit(bm, head_dim, bn) and smem_bytes(head_dim, bn, st, bm) <= SMEM_LIMIT[arch]
        ]

    def context(self, spec, *, masked=False):
        width = tile_dim(spec.head_dim)
        if spec.kind is Kind.BWD and wide_backward(spec.head_dim):
            return self.wide_context(spec, width)
        if spec.kind in BWD_MAINS:
            split, swap = dq_split(spec.head_dim, spec.block_m), dq_swap(spec.block_m)
            parts, dq_cols = dq_parts(spec.head_dim, spec.block_m)  # the float32 parts of dQ_i, a warpgroup's each
            dq_keys = spec.block_n // 2 if split == "keys" else spec.block_n  # the keys it sums over
            ns = (spec.block_m, width, kv_cols(spec.head_dim))
            if swap:  # dQ_i^T: m64 (the warpgroup's 64 columns of the head dim) x n block_m (the step's rows)
                helpers = wgmma_helpers(ns, spec.dtype, mn_k=(spec.block_m,))
            else:
                helpers = wgmma_helpers(ns, spec.dtype, mn_major=(dq_cols,))
            return dict(
                wgmma_helpers=helpers,
                mma_type=spec.dtype,
                tile_dim=width,
                kv_cols=kv_cols(spec.head_dim),
                dq_split=split,
                dq_cols=dq_cols,
                dq_keys=dq_keys,
                dq_parts=parts,
                dq_swap=swap,
                dq_rows=dq_rows(spec.block_m),
                dq_regs=(spec.block_m if swap else dq_cols) // 2,  # dQ_i's (or dQ_i^T's) accumulators a thread
                bwd_overlap_p=backward_pipeline() == "overlap",
                bwd_overlap_dq=backward_pipeline() != "serial",
                **det_order(spec.kind, spec.head_dim, masked),
                ds_first=spec.block_m in DS_FIRST_ROWS,
                dq_bars=spec.head_dim in DQ_BARRIER_HEAD_DIMS,
                wide_bwd=False,
                l2_bytes=L2_KV_BYTES,
                wave_blocks=BWD_WAVE_BLOCKS,
                # a thread's lse_i and D_i of two rows in one 16-byte load; two 8-byte loads at 128 rows a step (d64),
                # at 80 (d96 and d128 without a mask) and in the block-sparse kernel, where the 16-byte ones spilled (44
                # bytes; 36 with a doc mask; 16 at 80 rows, none with the 8-byte loads, NVRTC 13, 2026-11-28)
                rows_v4=spec.block_m == 64 and spec.kind is Kind.BWD,
                dq_ring=False,
                bwd_persistent=(persistent := backward_persistent(spec.kind, spec.head_dim, spec.block_m)),
                bwd_regs=BWD_PERSISTENT_REGS if persistent else (24, 240),
                # a varlen call's units past their sequence's end drawn again by the producer (where no tensor's
                # gradient needs its slots written 0 by each unit)
                redraw_past_end=persistent and not spec.tensor_grads,
            )
        producer_regs, consumer_regs = register_split(spec.block_m, spec.persistent, masked)
        return dict(
            wgmma_helpers=wgmma_helpers((spec.block_n, width, o_cols(spec.head_dim)), spec.dtype),
            mma_type=spec.dtype,
            tile_dim=width,
            o_cols=o_cols(spec.head_dim),
            producer_regs=producer_regs,
            consumer_regs=consumer_regs,
            # a warpgroup skips the leading key tiles its own rows cannot see where the block's other rows span a
            # whole key tile (the first warpgroup then has one on a causal diagonal): d64's 192 x 128, d256's 128 x 64
            warpgroup_skips=spec.block_m - 64 >= spec.block_n,
            persistent=spec.persistent,
            l2_kv_bytes=L2_KV_BYTES,
        )

    def wide_context(self, spec, width: int) -> dict:
        """The backward at d192 and d256: the warpgroups' columns of dK, dV and dQ (wide_parts) and the wgmma shapes
        they take: S^T and dP^T m64 x block_m / 2, dV and dK from shared memory (A K-major, B MN-major: `ss_kmn`), dQ
        (both MN-major: `ss_mn`)."""
        parts = wide_parts(spec.head_dim)
        kv_ns, dq_ns = tuple(n for _, n in parts["kv"]), tuple(n for _, n in parts["dq"])
        helpers = wgmma_helpers((spec.block_m // 2,), spec.dtype, mn_major=dq_ns, k_mn=kv_ns)
        return dict(
            wgmma_helpers=helpers,
            mma_type=spec.dtype,
            tile_dim=width,
            wide_bwd=True,
            kv_parts=parts["kv"],
            dq_parts=parts["dq"],
            dq_split="cols",
            dq_cols=max(dq_ns),
            dq_keys=spec.block_n,
            dq_swap=False,
            dq_rows=64,
            dq_regs=max(dq_ns) // 2,
            bwd_overlap_p=False,
            bwd_overlap_dq=True,
            det_pairs=BWD_DET_PAIRS,
            det_blocks=0,  # (not timed in the wide backward)
            ds_first=False,
            dq_bars=False,
            l2_bytes=L2_KV_BYTES,
            wave_blocks=BWD_WAVE_BLOCKS,
            rows_v4=True,
            dq_ring=dq_ring(spec.head_dim),
            # dK_j, dV_j through the stage the last step left, in 16-byte chunks of rows (one stage: value by value)
            dkv_staged=spec.stages >= 2,
            bwd_persistent=False,
            bwd_regs=(24, 240),
        )

    persistent_kinds = (Kind.FORWARD,)

    def extra_params(self, spec):
        if spec.kind is Kind.BWD:
            grid = BWD_GRID_PARAMS if backward_persistent(spec.kind, spec.head_dim, spec.block_m) else ()
            return BWD_TMAP_PARAMS + BWD_ORDER_PARAMS + grid
        if spec.kind is Kind.BWD_SPARSE:  # unordered: a deterministic call runs BWD
            return BWD_TMAP_PARAMS
        if spec.kind not in (Kind.FORWARD, Kind.FORWARD_SPARSE):
            return ()
        return TMAP_PARAMS + (GRID_PARAMS if spec.persistent else ())

    def launch_grid(self, spec, grid, device):
        """A persistent kernel: a block per SM (one fits: shared memory and threads), each drawing work tiles
        from a counter (the runtime's `tile_counter`) as it comes free."""
        if not spec.persistent:
            return grid, {}
        blocks = max(1, min(grid[0] * grid[1] * grid[2], sm_count(device)))
        return (blocks, 1, 1), dict(grid_m=grid[0], grid_h=grid[1], grid_b=grid[2])

    def prepare(self, slots: dict, arrays: dict, spec) -> TensorMaps:
        return TensorMaps(slots, arrays, spec)

    def fits(self, arrays):
        """TMA reads q, k, v and writes o: unit stride along D, other strides multiples of 16 bytes, 16-byte aligned
        bases."""
        return _tma_fits(arrays, MAPPED)

    def backward_fits(self, arrays):
        """The backward's main kernel reads q, k, v and dout by TMA (its dq_accum is the runtime's own, dense)."""
        return _tma_fits(arrays, BWD_MAPPED)


def _tma_fits(arrays, names) -> str | None:
    """What a tensor map cannot describe (cuTensorMapEncodeTiled): a base that is not 16-byte aligned, a stride
    along D other than 1, and along B, H or S (of more than one entry; encode_map sets the others) a stride that is
    not a positive multiple of 16 bytes below 2^40: negative strides (a reversed view) and zero ones (expand())."""
    for name in names:
        t = arrays[name]
        if t.strides[-1] != 1 or t.ptr % 16:
            return f"{name} is not 16-byte aligned with unit stride along D (TMA)"
        for n, s in zip(t.shape[:-1], t.strides[:-1]):
            if n > 1 and not (0 < 2 * s < 2**40 and 2 * s % 16 == 0):
                return f"{name} has a stride of {s} elements, not a positive multiple of 16 bytes (TMA)"
    return None


def map_strides(shape: tuple, strides: tuple, size: int) -> tuple[int, int, int]:
    """The byte strides of a [B, H, S, D] array's tensor map along S, H and B (its dims D, S, H, B): the array's
    own, and along a dim of one entry (whose stride no address uses, and may be 0, negative or odd) a stride the
    encoder takes, a multiple of 16 bytes: what a dense array would have there."""
    out, dense = [], shape[3] * size
    for i in (2, 1, 0):
        out.append(strides[i] * size if shape[i] > 1 else -(-dense // 16) * 16)
        dense = max(dense, abs(strides[i]) * size) * shape[i]
    return out[0], out[1], out[2]


register(Wgmma())
