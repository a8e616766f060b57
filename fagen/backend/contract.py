"""Kernel kinds and their argument contract: each kind's parameter list, declared once.

The templates render a kernel's signature from `params(kind, tensors)`, and the launcher packs its arguments
from the very same list (fagen.runtime.launch), so the two cannot disagree. A new kind (a backward piece,
split-KV decode) declares its parameters here and gets both for free.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

# log2(e): the kernels compute in base 2, and the launcher passes scale_log2 = scale * LOG2E (the kernels'
# kLog2e is this value too).
LOG2E = 1.0 / math.log(2.0)


class Kind(enum.Enum):
    """What a kernel computes. The value prefixes the kernel's name."""

    FORWARD = "flash_fwd"  # O = softmax(score(Q Kᵀ), mask) V and the row log-sum-exp
    DECODE_SPLIT = "flash_decode_split"  # split-KV decode: a key split's partial state; the last split merges: O, lse
    BWD_PREPROCESS = "flash_bwd_preprocess"  # D = rowsum(dO ∘ O) per row; zeroes the dQ accumulator's rows (varlen:
    # and dK's and dV's outside every sequence)
    BWD = "flash_bwd"  # per key tile: dK, dV; dQ by float32 atomics; the tensor-gradient partials
    BWD_CONVERT = "flash_bwd_convert"  # dQ: the float32 accumulator -> the storage dtype
    BWD_DQ = "flash_bwd_dq"  # deterministic dQ: per query tile, P and dS recomputed, no atomics
    BLOCK_MASK = "flash_block_mask"  # run-time block sparsity: per query tile, its non-empty key tiles (full or not)
    FORWARD_SPARSE = "flash_fwd_sparse"  # the forward over the key tiles a block mask lists
    BWD_SPARSE = "flash_bwd_sparse"  # BWD over the query tiles a block mask's transposed table lists per key tile


@dataclass(frozen=True)
class Param:
    name: str
    ctype: str  # the C type in the kernel's signature
    pack: str  # how the launcher passes it: ptr (device address), i64, i32 or f32

    def c(self) -> str:
        return f"{self.ctype} {self.name}"


PACKS = ("ptr", "i64", "i32", "f32", "tmap")  # tmap: a 128-byte TMA tensor map, by value


def _strides(tensor: str, dims: str) -> tuple[Param, ...]:
    return tuple(Param(f"{tensor}_stride_{d}", "long long", "i64") for d in dims)


# The forward: pointers, element strides of every array ([B, H, S, D]; lse [B, H, M]), sizes, the scale, the
# varlen offsets (null when not varlen) with the packed totals they must stay inside, then call-time tensors.
FORWARD = (
    Param("q", "const storage_t* __restrict__", "ptr"),
    Param("k", "const storage_t* __restrict__", "ptr"),
    Param("v", "const storage_t* __restrict__", "ptr"),
    Param("o", "storage_t* __restrict__", "ptr"),
    Param("lse", "float* __restrict__", "ptr"),
    *_strides("q", "bhmd"),
    *_strides("k", "bhnd"),
    *_strides("v", "bhnd"),
    *_strides("o", "bhmd"),
    *_strides("lse", "bhm"),
    Param("heads_per_kv", "int", "i32"),
    Param("seqlen_q", "int", "i32"),
    Param("seqlen_k", "int", "i32"),
    Param("scale_log2", "float", "f32"),
    Param("cu_seqlens_q", "const int* __restrict__", "ptr"),
    Param("cu_seqlens_k", "const int* __restrict__", "ptr"),
    Param("total_q", "int", "i32"),
    Param("total_k", "int", "i32"),
)

# Split-KV decode over a KV cache (flash_attn_with_kvcache's convention): q [B, q_len, H, D] and either a
# contiguous cache k, v [B, Nmax, Hkv, D] (block_table null) or a paged one [num_pages, page_size, Hkv, D], where
# key n of sequence b is row n % page_size of page block_table[b, n / page_size] (block_table [B, max_pages],
# int32); the k/v strides' "b" is then the page stride. cache_seqlens [B] (int32) counts the cached keys. With
# k_new, v_new [B, seqlen_new, Hkv, D] (null when seqlen_new = 0) the new keys follow the cached ones: attention
# covers cache_seqlens[b] + seqlen_new keys, reading the new ones from k_new, v_new, and the blocks of row tile 0
# write them into the cache through k_append, v_append (the caches' addresses; null when not appending).
# The query heads of one KV head times the q_len tokens are the rows of a tile (row = token * heads_per_kv +
# head in group). Each thread block takes one (row tile, split, KV head, batch) and writes the split's partial
# state to the float32 workspace ws_acc [B, Hkv, num_splits, ws_rows, D] and ws_ml [B, Hkv, num_splits,
# ws_rows, 2] (m base 2, l), then counts itself in split_count [B, Hkv, row tiles] (int32, zeroed once: the last
# block of a row tile merges the splits (the proven merge), writes o [B, q_len, H, D] and lse [B, H, q_len]
# (natural log), and sets its count back to 0). max_seqlen_k: the cache's capacity (Nmax, or max_pages *
# page_size).
DECODE_SPLIT = (
    Param("q", "const storage_t* __restrict__", "ptr"),
    Param("k", "const storage_t* __restrict__", "ptr"),
    Param("v", "const storage_t* __restrict__", "ptr"),
    Param("ws_acc", "float* __restrict__", "ptr"),
    Param("ws_ml", "float* __restrict__", "ptr"),
    Param("split_count", "int* __restrict__", "ptr"),
    Param("o", "storage_t* __restrict__", "ptr"),
    Param("lse", "float* __restrict__", "ptr"),
    *_strides("q", "bmhd"),
    *_strides("k", "bnhd"),
    *_strides("v", "bnhd"),
    Param("cache_seqlens", "const int* __restrict__", "ptr"),
    Param("block_table", "const int* __restrict__", "ptr"),
    Param("block_table_stride_b", "long long", "i64"),
    Param("page_size", "int", "i32"),
    Param("max_pages", "int", "i32"),
    Param("num_pages", "int", "i32"),
    Param("k_new", "const storage_t* __restrict__", "ptr"),
    Param("v_new", "const storage_t* __restrict__", "ptr"),
    *_strides("k_new", "bnhd"),
    *_strides("v_new", "bnhd"),
    Param("seqlen_new", "int", "i32"),
    Param("k_append", "storage_t*", "ptr"),
    Param("v_append", "storage_t*", "ptr"),
    Param("heads_per_kv", "int", "i32"),
    Param("kv_heads", "int", "i32"),
    Param("seqlen_q", "int", "i32"),
    Param("max_seqlen_k", "int", "i32"),
    Param("num_splits", "int", "i32"),
    Param("ws_rows", "int", "i32"),
    Param("scale_log2", "float", "f32"),
    *_strides("o", "bmhd"),
    *_strides("lse", "bhm"),
)
BASE = {Kind.FORWARD: FORWARD, Kind.DECODE_SPLIT: DECODE_SPLIT}
# The kinds that evaluate the program's score and mask, and so take its call-time tensors.
READS_TENSORS = frozenset({Kind.FORWARD, Kind.DECODE_SPLIT})


# --- The backward (FlashAttention-2's split), appended: the lists above are untouched -------------------------
# Given dO, the forward's O and its lse (natural log):
#   BWD_PREPROCESS  one warp per row: D = rowsum(dO ∘ O) (float32, `delta`), and the row of the dQ accumulator
#                   zeroed (when dq_accum is not null); a varlen call's (cu_seqlens_k not null) rows of dK and dV
#                   before its first sequence and after its last set to 0; the persistent main kernel's work-unit
#                   counter set to 0 (when tile_counter is not null)
#   BWD             one block per (key tile, KV head, batch): loops over the query heads of its GQA group and over
#                   the query tiles that can see the tile (the transposed key ranges), keeps dK and dV in float32
#                   registers and writes them once (in the storage dtype, or in float32 where `dkv_float32` is
#                   1: dk, dv then address floats, their strides packed in storage_t elements); adds dQ into the
#                   float32 accumulator by atomicAdd (skipped when dq_accum is null: the deterministic mode);
#                   writes its share of each call-time tensor's gradient into its own slot of `dtensor`
#   BWD_CONVERT     one warp per row: dQ = the float32 accumulator in the storage dtype, at dq's strides
#   BWD_DQ          deterministic dQ: one block per (query tile, head, batch) recomputes P and dS over the keys
#                   the tile sees and writes dQ once, with no atomics
# `dtensor` is [T, B, H, key tiles] float32 (T: the tensors the score reads, in the backward rule's order): one
# partial per (block, head), written by that block alone; the runtime sums it in a fixed order.
# `rowstat` is [1 + T, B, H, max_q] float32, zeroed by the runtime, indexed by a sequence's own row (varlen too):
# stat 0 is E_i = sum_j dS_ij, stat 1 + t is R_i = sum_j P_ij g_ij (g: what tensor t's gradient multiplies dS by),
# each over every key the row sees. D_i comes from O rounded to 16 bits, so E_i is not 0, and a tensor whose slot
# is the same along a row (name[h], name[b]) would gather E_i R_i; the runtime takes sum_i E_i R_i off, leaving
# sum_ij P_ij (dP_ij - sum_k P_ik dP_ik) g_ij (D consistent with the kernel's own P). BWD adds the row sums by
# float32 atomics (when dq_accum is not null); BWD_DQ, which sees whole rows, writes them in deterministic mode,
# so the tensor gradients are reproducible bit for bit there. Arrays are [B, H, S, D] by strides (lse, delta
# [B, H, M]); varlen as the forward (cu_seqlens, each offset clamped to the packed totals).
MAX_ROW_GRADIENTS = 3  # the main kernels reserve shared memory for the row sums of this many tensors (1 + 3 stats)
_VARLEN_Q = (
    Param("cu_seqlens_q", "const int* __restrict__", "ptr"),
    Param("total_q", "int", "i32"),
)
BWD_PREPROCESS = (
    Param("o", "const storage_t* __restrict__", "ptr"),
    Param("dout", "const storage_t* __restrict__", "ptr"),
    Param("delta", "float* __restrict__", "ptr"),
    Param("dq_accum", "float* __restrict__", "ptr"),
    *_strides("o", "bhmd"),
    *_strides("dout", "bhmd"),
    *_strides("delta", "bhm"),
    *_strides("dq_accum", "bhmd"),
    Param("seqlen_q", "int", "i32"),
    *_VARLEN_Q,
    Param("dk", "storage_t* __restrict__", "ptr"),
    Param("dv", "storage_t* __restrict__", "ptr"),
    *_strides("dk", "bhnd"),
    *_strides("dv", "bhnd"),
    Param("cu_seqlens_k", "const int* __restrict__", "ptr"),
    Param("sequences", "int", "i32"),
    Param("heads_kv", "int", "i32"),
    Param("total_k", "int", "i32"),
    Param("tile_counter", "int* __restrict__", "ptr"),
)
_BWD_INPUTS = (
    Param("q", "const storage_t* __restrict__", "ptr"),
    Param("k", "const storage_t* __restrict__", "ptr"),
    Param("v", "const storage_t* __restrict__", "ptr"),
    Param("dout", "const storage_t* __restrict__", "ptr"),
    Param("lse", "const float* __restrict__", "ptr"),
    Param("delta", "const float* __restrict__", "ptr"),
)
_BWD_SIZES = (
    Param("heads_per_kv", "int", "i32"),
    Param("seqlen_q", "int", "i32"),
    Param("seqlen_k", "int", "i32"),
    Param("scale_log2", "float", "f32"),
    Param("cu_seqlens_q", "const int* __restrict__", "ptr"),
    Param("cu_seqlens_k", "const int* __restrict__", "ptr"),
    Param("total_q", "int", "i32"),
    Param("total_k", "int", "i32"),
)
_BWD_INPUT_STRIDES = (
    *_strides("q", "bhmd"),
    *_strides("k", "bhnd"),
    *_strides("v", "bhnd"),
    *_strides("dout", "bhmd"),
    *_strides("lse", "bhm"),
    *_strides("delta", "bhm"),
)
BWD = (
    *_BWD_INPUTS,
    Param("dk", "storage_t* __restrict__", "ptr"),
    Param("dv", "storage_t* __restrict__", "ptr"),
    Param("dq_accum", "float* __restrict__", "ptr"),
    Param("dtensor", "float* __restrict__", "ptr"),
    Param("rowstat", "float* __restrict__", "ptr"),
    *_BWD_INPUT_STRIDES,
    *_strides("rowstat", "sbhm"),
    *_strides("dk", "bhnd"),
    *_strides("dv", "bhnd"),
    *_strides("dq_accum", "bhmd"),
    *_BWD_SIZES,
    Param("dkv_float32", "int", "i32"),
)
BWD_CONVERT = (
    Param("dq_accum", "const float* __restrict__", "ptr"),
    Param("dq", "storage_t* __restrict__", "ptr"),
    *_strides("dq_accum", "bhmd"),
    *_strides("dq", "bhmd"),
    Param("seqlen_q", "int", "i32"),
    *_VARLEN_Q,
)
BWD_DQ = (
    *_BWD_INPUTS,
    Param("dq", "storage_t* __restrict__", "ptr"),
    Param("rowstat", "float* __restrict__", "ptr"),
    *_BWD_INPUT_STRIDES,
    *_strides("rowstat", "sbhm"),
    *_strides("dq", "bhmd"),
    *_BWD_SIZES,
)
BASE.update({Kind.BWD_PREPROCESS: BWD_PREPROCESS, Kind.BWD: BWD, Kind.BWD_CONVERT: BWD_CONVERT, Kind.BWD_DQ: BWD_DQ})
READS_TENSORS = READS_TENSORS | {Kind.BWD, Kind.BWD_DQ}
BACKWARD_KINDS = (Kind.BWD_PREPROCESS, Kind.BWD, Kind.BWD_CONVERT, Kind.BWD_DQ)


# --- Call-time tensors ----------------------------------------------------------------------------------------
# A tensor the program reads as name[i0, ..., i{r-1}] reaches each kind of READS_TENSORS as its address, its
# element strides and its sizes (tensor_<name>, tensor_<name>_stride_<d>, tensor_<name>_size_<d>): the kernel
# clamps each index to [0, size_d - 1] and reads the element at sum_d index_d * stride_d (so strides may be 0:
# a broadcast dimension, no copy). Its dtype is part of the kernel; values, sizes and strides are not. The
# element types below are distinct C types (f16 and bf16 both 16 bits), so one overloaded `fagen_read` converts
# each: float for f32/f16/bf16, int, long long, and bool for a bool tensor.
TENSOR_DTYPES = {  # fagen dtype -> the C element type the kernel reads through
    "f32": "float",
    "f16": "fagen_f16",
    "bf16": "fagen_bf16",
    "i32": "int",
    "i64": "long long",
    "bool": "fagen_bool",
}
FLOAT_TENSOR_DTYPES = ("f32", "f16", "bf16")  # the tensors a backward gives gradients for
INDEX_TENSOR_DTYPES = ("i32", "i64")  # the tensors a read may read inside another read's index (offsets[doc[q]])
TENSOR_DTYPE_ALIASES = {  # library dtype names -> fagen's
    "float32": "f32",
    "float": "f32",
    "f32": "f32",
    "float16": "f16",
    "half": "f16",
    "f16": "f16",
    "bfloat16": "bf16",
    "bf16": "bf16",
    "int32": "i32",
    "i32": "i32",
    "int": "i32",
    "int64": "i64",
    "i64": "i64",
    "long": "i64",
    "bool": "bool",
}


def tensor_dtype(dtype, what: str = "tensor") -> str:
    """fagen's name of a call-time tensor's dtype ('f32', 'f16', 'bf16', 'i32', 'i64', 'bool'), from a name or
    a library dtype (torch.int32, numpy.dtype('int64'), ...)."""
    key = str(dtype).lower().replace("torch.", "")
    if key not in TENSOR_DTYPE_ALIASES:
        raise TypeError(
            f"{what}: dtype {dtype} is not supported for a call-time tensor; expected float32, float16, bfloat16, "
            "int32, int64 or bool"
        )
    return TENSOR_DTYPE_ALIASES[key]


@dataclass(frozen=True)
class TensorArg:
    """A call-time tensor of a kernel: its name, dtype (TENSOR_DTYPES), rank, and whether the backward
    scatter-adds a gradient for it (`grad`: a float tensor the score reads other than as name[h] / name[b] / name[b, h],
    whose gradient goes to grad_<name>, float32 of the tensor's shape, by atomics)."""

    name: str
    dtype: str = "f32"
    rank: int = 1
    grad: bool = False
    dims: str = ""  # per dimension, the bare index every read puts there (b, h, q or k), else '.': for checks

    def __post_init__(self):
        if self.dtype not in TENSOR_DTYPES:
            raise ValueError(f"tensor {self.name}: dtype {self.dtype!r} is not one of {', '.join(TENSOR_DTYPES)}")
        if not 1 <= self.rank <= 4:
            raise ValueError(f"tensor {self.name}: rank {self.rank} is not 1 to 4")

    @property
    def c_name(self) -> str:
        return c_tensor_name(self.name)

    def strides(self) -> tuple[str, ...]:
        return tuple(f"{self.c_name}_stride_{d}" for d in range(self.rank))

    def sizes(self) -> tuple[str, ...]:
        return tuple(f"{self.c_name}_size_{d}" for d in range(self.rank))

    def c_params(self) -> tuple[str, ...]:
        """The C parameters of a rule function that reads this tensor (and the kernel's, in this order)."""
        return (
            f"const {TENSOR_DTYPES[self.dtype]}* __restrict__ {self.c_name}",
            *(f"long long {n}" for n in self.strides()),
            *(f"long long {n}" for n in self.sizes()),
        )

    def c_args(self) -> tuple[str, ...]:
        return (self.c_name, *self.strides(), *self.sizes())


# --- Run-time block sparsity (FlexAttention's create_block_mask), appended -----------------------------------
# BLOCK_MASK: one block per (query tile, head, batch) of the block mask (heads and batch 1 where the mask is
# broadcast over them) evaluates the program's mask on every (q, k) of each key tile inside the tile's proven
# key range (key tiles outside it are empty without evaluation, those inside a proven fully visible range full)
# and writes the non-empty key tiles in ascending order: kv_list [B', H', query tiles, key tiles] (int32, one
# row per query tile; entry 2 j + 1 for a full key tile j, 2 j for a partial one) and their count kv_count
# [B', H', query tiles] (int32). Both arrays are contiguous; the grid gives B', H' and the query tiles.
BLOCK_MASK = (
    Param("kv_count", "int* __restrict__", "ptr"),
    Param("kv_list", "int* __restrict__", "ptr"),
    Param("seqlen_q", "int", "i32"),
    Param("seqlen_k", "int", "i32"),
)
# FORWARD_SPARSE: the forward's parameters, then the block mask built at this kernel's tiles, read at
# (b, h, query tile) through its element strides (0 along a broadcast batch or head dimension).
FORWARD_SPARSE = (
    *FORWARD,
    Param("kv_count", "const int* __restrict__", "ptr"),
    Param("kv_list", "const int* __restrict__", "ptr"),
    *_strides("kv_count", "bh"),
    *_strides("kv_list", "bhm"),
)
BASE.update({Kind.BLOCK_MASK: BLOCK_MASK, Kind.FORWARD_SPARSE: FORWARD_SPARSE})
READS_TENSORS = READS_TENSORS | {Kind.BLOCK_MASK, Kind.FORWARD_SPARSE}
FORWARD_KINDS = (Kind.FORWARD, Kind.FORWARD_SPARSE)  # the forward's kernels: the same tiles, templates, launch
# BWD_SPARSE: BWD's parameters, then the block mask's transposed table at this kernel's tiles (block_m x block_n):
# per (b, h, key tile), the query tiles that see some key of it, in ascending order, q_list [B', H', key tiles,
# query tiles] (entry 2 i + 1 for a full query tile i, where the mask is not evaluated, 2 i for a partial one) and
# their count q_count [B', H', key tiles] (int32; fagen.runtime.block_mask.transpose). h is the query head (a
# block reads the rows of each query head of its GQA group), read through element strides (0 along a broadcast
# batch or head dimension). No ordered-dQ parameters: a deterministic call runs BWD (its proven ranges count the
# key tiles that add into a query tile before a block's own).
BWD_SPARSE = (
    *BWD,
    Param("q_count", "const int* __restrict__", "ptr"),
    Param("q_list", "const int* __restrict__", "ptr"),
    *_strides("q_count", "bh"),
    *_strides("q_list", "bhn"),
)
BASE[Kind.BWD_SPARSE] = BWD_SPARSE
READS_TENSORS = READS_TENSORS | {Kind.BWD_SPARSE}
BWD_MAINS = (Kind.BWD, Kind.BWD_SPARSE)  # the backward's main kernels: a block per (key tile, KV head, batch)
BACKWARD_FAMILY = (*BACKWARD_KINDS, Kind.BWD_SPARSE)  # every kind a backward plan may hold


def c_tensor_name(name: str) -> str:
    """The C name of the call-time tensor `name` (a kernel parameter; prefixed so it cannot clash)."""
    return f"tensor_{name}"


def c_grad_name(name: str) -> str:
    """The C name of a gathered float tensor's gradient (BWD: float32, dense, the tensor's shape)."""
    return f"grad_{name}"


def tensor_args(reads, dtypes: dict | None = None) -> tuple[TensorArg, ...]:
    """The call-time tensors of a fused program as kernel arguments, from how it reads them (`reads`:
    passes.fuse.tensor_reads) and their dtypes (`dtypes` by name, default float32): the backward scatter-adds the
    gradient of a float tensor the score reads other than as the one read name[h] / name[b] / name[b, h]."""
    dtypes = dict(dtypes or {})
    unknown = sorted(set(dtypes) - {r.name for r in reads})
    if unknown:
        names = ", ".join(sorted(r.name for r in reads)) or "none"
        raise ValueError(f"tensor_dtypes: the program reads no tensor {unknown[0]!r} (it reads: {names})")
    out = []
    for r in reads:
        dtype = tensor_dtype(dtypes.get(r.name, "f32"), r.name)
        if r.index and dtype not in INDEX_TENSOR_DTYPES:
            raise TypeError(
                f"tensor {r.name} indexes another tensor ({r.index} inside an index), so it must hold integers "
                f"(int32 or int64); its dtype is {dtype}: pass an integer tensor, or compile with "
                f"tensor_dtypes={{{r.name!r}: 'i32'}}"
            )
        out.append(TensorArg(r.name, dtype, r.rank, r.gathered and dtype in FLOAT_TENSOR_DTYPES, r.dims))
    return tuple(out)


def as_tensor_arg(t) -> TensorArg:
    return t if isinstance(t, TensorArg) else TensorArg(str(t))


def tensor_params(t: TensorArg, kind: Kind) -> tuple[Param, ...]:
    """A call-time tensor's parameters in a kernel of `kind`: address, strides, sizes (and in BWD the address of
    its gradient, where the backward scatter-adds one)."""
    out = (
        Param(t.c_name, f"const {TENSOR_DTYPES[t.dtype]}* __restrict__", "ptr"),
        *(Param(n, "long long", "i64") for n in t.strides()),
        *(Param(n, "long long", "i64") for n in t.sizes()),
    )
    if t.grad and kind in (Kind.BWD, Kind.BWD_SPARSE):
        out += (Param(c_grad_name(t.name), "float* __restrict__", "ptr"),)
    return out


def params(kind: Kind, tensors: tuple = (), extra: tuple[Param, ...] = ()) -> tuple[Param, ...]:
    """The parameter list of a kernel of `kind` whose program reads the call-time tensors `tensors` (TensorArgs;
    a bare name is a float32 vector); `extra` are a tier's own parameters (Tier.extra_params: the wgmma tier's
    tensor maps)."""
    reads: tuple[Param, ...] = ()
    if kind in READS_TENSORS:
        reads = tuple(p for t in tensors for p in tensor_params(as_tensor_arg(t), kind))
    return BASE[kind] + tuple(extra) + reads


def signature(kind: Kind, tensors: tuple = (), extra: tuple[Param, ...] = ()) -> str:
    """The parameter list as C, one parameter a line (what the templates substitute)."""
    return ",\n    ".join(p.c() for p in params(kind, tensors, extra))
