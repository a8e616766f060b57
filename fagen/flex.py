"""FlexAttention's and SDPA's signatures on fagen kernels, so code written for them switches by an import.

    from fagen import flex_attention, create_block_mask
    def document(b, h, q_idx, kv_idx):
        return (doc_id_of(q_idx) == doc_id_of(kv_idx)) & (q_idx >= kv_idx)
    block_mask = create_block_mask(document, None, None, 4096, 4096)
    o = flex_attention(q, k, v, score_mod=lambda score, b, h, q_idx, kv_idx: 30 * torch.tanh(score / 30),
                       block_mask=block_mask)

`mask_mod` and `score_mod` are traced once, at compile time (fagen.ir.variants: torch functions and Python
operators on symbolic indices), into the kernel's program, whose online softmax and key ranges are proven;
the kernel is compiled on the first call of a spec and kept (fagen.api). Where fagen and PyTorch differ:
- a BlockMask holds the mask function and its block tables, built on the GPU by a kernel fagen generates from
  the mask (contract.Kind.BLOCK_MASK: per (b, h, query tile), the non-empty key tiles and which of them are
  full), at the tile size of the kernel that reads it: create_block_mask builds it at BLOCK_SIZE on `device`,
  and flex_attention builds it at its kernel's tiles on first use (they differ by tier, head dim and tuning)
  and keeps it in the BlockMask, so it is reused across calls and layers (built once, from the tensors the mask
  captures as they are then, like FlexAttention's). The tables refine the key ranges the compiler derives and
  proves from the mask (fully masked tiles skipped, no mask on fully visible ones, for affine masks: causal,
  windows, prefix-LM): tiles outside the proven range are never evaluated nor visited. One list per query tile
  with a full flag replaces FlexAttention's two (fagen.runtime.block_mask; `BlockMask.flex_views` gives those);
- inputs that require grad run the block-sparse forward too, and its derived backward walks the block mask's
  transposed table (FlexAttention's q_num_blocks / q_indices, full_q_*: per key tile, the query tiles that see
  it, made at the backward's tiles on first use, from the forward's tables where the tiles nest, with no mask
  evaluated, and kept per stream like the forward's): empty tiles skipped,
  no mask on full ones (the wgmma tier: head dims 64 to 128 on Hopper; elsewhere the backward walks the proven
  ranges, evaluating the mask). Under torch.compile, such a call runs the dense kernel through the fagen::
  attention op (traced with no graph break; its backward walks the proven ranges);
- mask_mod and score_mod read tensors as FlexAttention's do: captured from their closure or module
  (`doc_id[q_idx] == doc_id[kv_idx]`, `bias[h, q_idx - kv_idx + 4096]`, `offsets[doc_id[q_idx]]`), indexed by
  integer expressions of b, h, q_idx, kv_idx, constants and integer tensors' values, gathered in the kernel. The
  object a captured variable holds is read at each call (its dtype and rank are part of the kernel, its values and
  sizes are not). Each index is clamped to its dimension, so a read never leaves the tensor (FlexAttention checks
  neither: an index out of range there reads out of bounds); a tensor reached only through another function is
  refused, saying so;
- scaled_dot_product_attention's attn_mask (bool: True attends, or additive float) is read in the kernel
  as attn_mask[b, h, q_idx, kv_idx] through a broadcast view (stride 0, no copy); a bool mask's block sparsity
  is computed at run time on each call, as a BlockMask's (for inputs that need no gradient); an additive
  mask is read on every key tile;
- a row that sees no key gives 0 (and lse -inf) in both; PyTorch gives NaN there (SDPA with a fully masked
  row of attn_mask; FlexAttention's lse is -inf).
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field
from typing import Any

from . import ops
from .request import for_attention, for_block_mask, function_key, tensors_read


@dataclass(frozen=True, eq=False)
class BlockMask:
    """What `create_block_mask` returns: the mask function, the sizes it was made for (B and H may be None:
    broadcast, the mask then evaluated at b = 0, h = 0 as FlexAttention does) and its block tables, one per tile
    size, built on the GPU and kept (`tiles`). Pass it to `flex_attention(block_mask=...)`; it is reused across
    calls and layers like FlexAttention's."""

    mask_mod: Any
    B: int | None
    H: int | None
    Q_LEN: int
    KV_LEN: int
    BLOCK_SIZE: tuple[int, int] = (128, 128)
    built: dict = field(default_factory=dict, repr=False)  # (block_m, block_n, library, device, stream) -> BlockTiles
    captured: list = field(default_factory=list, repr=False)  # tables built inside CUDA-graph captures (kept alive)

    @property
    def shape(self) -> tuple:
        return (self.B, self.H, self.Q_LEN, self.KV_LEN)

    def __repr__(self):
        name = getattr(self.mask_mod, "__name__", type(self.mask_mod).__name__)
        return f"BlockMask(mask_mod={name}, shape={self.shape})"

    def tiles(self, block_m: int, block_n: int, like=None):
        """The block tables at block_m x block_n (fagen.runtime.block_mask.BlockTiles), made on first use on
        `like`'s device and library (an Array of fagen.runtime.arrays; default: the current CUDA device, PyTorch)
        and the caller's current stream: derived from tables this stream holds at tiles that nest with these
        (`_derive`), else built by the block-mask kernel; then kept for that stream: a call on
        another stream, which nothing orders after the build, builds its own. Tables built inside a CUDA-graph
        capture are written when the graph runs: they serve that capture alone (and live as long as the mask)."""
        from .runtime import block_mask

        where = like if like is not None else _TorchDevice(_current_device())
        stream, capturing = block_mask.current_stream(where)
        if capturing:
            found = _build(self, block_m, block_n, where.kind, where.device)
            self.captured.append(found)
            return found
        key = (block_m, block_n, where.kind, where.device, stream)
        found = self.built.get(key)
        if found is None:
            with _lock:
                found = self.built.get(key)
                if found is None:
                    found = self.built[key] = self._derive(key) or _build(
                        self, block_m, block_n, where.kind, where.device
                    )
        return found

    def _derive(self, key: tuple):
        """The tables at key's tiles derived from ones this stream already holds at tiles that nest with them
        (block_mask.derive: a few array operations, the mask not evaluated again; a backward's tiles from the
        forward's), or None. Finer tables first: the union of finer tiles is exact, a part of a coarser one is
        partial where its tile is."""
        from .runtime import block_mask

        want = key[:2]
        have = [k for k in self.built if k[2:] == key[2:] and block_mask.nests(k[:2], want)]
        if not have:
            return None
        best = min(have, key=lambda k: (k[0] > want[0] or k[1] > want[1], k[0] * k[1]))
        return block_mask.derive(self.built[best], want[0], want[1], self.Q_LEN, self.KV_LEN)

    def flex_views(self):
        """FlexAttention's (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices) at BLOCK_SIZE."""
        return self.tiles(*self.BLOCK_SIZE).flex_views()


_lock = threading.Lock()


def _current_device() -> int:
    import torch

    return torch.cuda.current_device()


def _build(bm: BlockMask, block_m: int, block_n: int, kind: str, device: int):
    """The block tables of `bm` at block_m x block_n, built by its block-mask kernel on `device`."""
    from . import pipeline
    from .ir import variants
    from .runtime import block_mask

    fields = dict(mask=bm.mask_mod, device=(kind, "cuda", device), tiles=(block_m, block_n))
    lowered = ops.cached(  # traced, fused and proven once a mask function, whatever the tiles
        ("block_mask_program", function_key(bm.mask_mod)),
        lambda: pipeline.block_mask_program(for_block_mask(**fields)),
    )
    launch = ops.cached(
        ops.memo_key(for_block_mask, fields),
        lambda: pipeline.block_mask_launch(for_block_mask(**fields), lowered),
    )
    # the tensors mask_mod captures and reads, as its variables hold them now (the tables are built once, like
    # FlexAttention's)
    reads = tensors_read(lowered[0])
    captured = variants.captured(bm.mask_mod, "mask_mod")
    tensors = {c.name: c.value(bm.mask_mod) for c in captured if c.name in reads}
    return block_mask.build(launch, bm.B or 1, bm.H or 1, bm.Q_LEN, bm.KV_LEN, kind, device, tensors)


def _reads(mask_mod) -> set:
    """The names of the indices and tensors mask_mod reads (traced once a function: a construct fagen cannot
    compile is refused here, naming it)."""
    from .ir import variants

    def trace() -> set:
        keep = variants.trace_mask(mask_mod)
        return {str(s) for s in getattr(keep, "free_symbols", ())}

    return ops.cached(("mask_reads", function_key(mask_mod)), trace)


def _size(name, value, allow_none=False):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected a positive int{' or None' if allow_none else ''}, got {value!r}")
    return value


def create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device="cuda", BLOCK_SIZE=128, _compile=False) -> BlockMask:
    """FlexAttention's create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN): mask_mod(b, h, q_idx, kv_idx) -> bool.
    The function is traced here (a construct fagen cannot compile is refused now, naming it), and on a CUDA
    `device` the block tables are built there at BLOCK_SIZE (an int or (rows, keys)) by the block-mask kernel
    generated from it; elsewhere (no GPU) they are built on the first flex_attention call that reads them.
    flex_attention builds them again at its kernel's tiles where those differ from BLOCK_SIZE. `_compile` is
    accepted for compatibility and not used."""
    given = BLOCK_SIZE
    pair = (given, given) if isinstance(given, int) and not isinstance(given, bool) else given
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
        raise ValueError(f"BLOCK_SIZE: expected a positive int or (rows, keys), got {BLOCK_SIZE!r}")
    bs: tuple[int, int] = (_size("BLOCK_SIZE", pair[0]), _size("BLOCK_SIZE", pair[1]))
    bm = BlockMask(
        mask_mod,
        _size("B", B, True),
        _size("H", H, True),
        _size("Q_LEN", Q_LEN),
        _size("KV_LEN", KV_LEN),
        bs,
    )
    reads = _reads(mask_mod)  # refuse early, with the reason
    for name, size, index in (("B", B, "b"), ("H", H, "h")):
        if size is None and index in reads:
            raise ValueError(
                f"{name}: mask_mod reads {index}, so its block mask differs along that dimension; pass {name} "
                f"(None builds one table for {index} = 0 and applies it to all)"
            )
    cuda = _cuda_index(device)
    if cuda is not None:
        bm.tiles(bs[0], bs[1], _TorchDevice(cuda))
    return bm


class _TorchDevice:
    """Where tables go when built ahead of a call: PyTorch arrays on CUDA device `device`."""

    kind = "torch"

    def __init__(self, device: int):
        self.device = device


def _cuda_index(device) -> int | None:
    """The CUDA device index `device` names where PyTorch has a GPU, else None (built later, on first use)."""
    if device is None or str(device).split(":")[0] != "cuda":
        return None
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    d = torch.device(device)
    return d.index if d.index is not None else torch.cuda.current_device()


def _check_heads(query, key, value, enable_gqa: bool) -> None:
    for name, x in (("query", query), ("key", key), ("value", value)):
        if len(getattr(x, "shape", ())) != 4:
            raise ValueError(f"{name}: expected 4 dimensions [B, H, L, E], got shape {tuple(getattr(x, 'shape', ()))}")
    hq, hkv = query.shape[1], key.shape[1]
    if hq != hkv:
        if not enable_gqa:
            raise ValueError(
                f"query, key: {hq} and {hkv} heads differ; pass enable_gqa=True for grouped-query attention"
            )
        if hq % hkv:
            raise ValueError(f"query, key: {hq} query heads are not a multiple of {hkv} key/value heads")


def flex_attention(
    query,
    key,
    value,
    score_mod=None,
    block_mask: BlockMask | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    kernel_options=None,
):
    """FlexAttention's flex_attention: query [B, Hq, L, E], key, value [B, Hkv, S, E] (PyTorch CUDA tensors or
    CuPy arrays); score_mod(score, b, h, q_idx, kv_idx) and block_mask.mask_mod as in FlexAttention. Returns
    the output [B, Hq, L, E], and with return_lse the log-sum-exp [B, Hq, L] (float32, natural log). PyTorch
    tensors: differentiable and traceable by torch.compile(fullgraph=True) (the fagen::attention op).
    kernel_options is accepted and ignored (fagen picks its tiles). See the module's notes on differences."""
    _check_heads(query, key, value, enable_gqa)
    if block_mask is not None and not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask: expected a fagen.BlockMask from fagen.create_block_mask, got {type(block_mask)}")
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse: expected True or False, got {return_lse!r}")
    B, H, L, _ = query.shape
    S = key.shape[2]
    if block_mask is not None:
        bm = block_mask
        if (bm.Q_LEN, bm.KV_LEN) != (L, S) or bm.B not in (None, 1, B) or bm.H not in (None, 1, H):
            raise ValueError(
                f"block_mask: made for (B, H, Q_LEN, KV_LEN) = {bm.shape}, but the inputs are ({B}, {H}, {L}, {S})"
            )
    mask = block_mask.mask_mod if block_mask is not None else None
    if block_mask is not None and _block_sparse(query, key, value, with_grad=True) and not _score_masks(score_mod):
        fields = _request(query, score_mod, mask, block_sparse=True)
        return _run_block_sparse(query, key, value, fields, scale=scale, return_lse=return_lse, block_mask=block_mask)
    return _run(query, key, value, scale, _request(query, score_mod, mask), return_lse)


def _run_block_sparse(query, key, value, fields: dict, **kw):
    """The block-sparse kernel of the request `fields` on this call, reading the tensors that this call's functions
    capture. Functions that trace to one program share one kernel (one name), and the kernel's own captured
    variables are those of the first function compiled: a second document mask, over another doc_id, read the
    first one's on its partial tiles (a wrong dq of 3.4 against a bound of 0.05, H100, 2026-11-27)."""
    op = ops.kernel_key(for_attention, **fields)
    tensors = ops.with_captured(op, {}, (fields["score_mod"], fields["mask"]))
    return ops.kernel_of(op)(query, key, value, **kw, **tensors)


def _request(q, score_mod, mask, tensors=None, block_sparse=False) -> dict:
    """The arguments of q's request (fagen.request.for_attention): FlexAttention's functions, the dtypes of
    the tensors passed by name."""
    from .runtime import arrays

    if arrays.library(q) is None:
        raise TypeError(f"query: expected a PyTorch tensor or a CuPy array, got {type(q).__name__}")
    return dict(
        dim=int(q.shape[3]),
        dtype=ops.dtype_of(q),
        device=ops.device_of(q),
        score_mod=score_mod,
        mask=mask,
        tensor_dtypes=ops.tensor_dtypes(tensors or {}),
        block_sparse=block_sparse,
    )


@functools.lru_cache(maxsize=256)
def _score_masks(score_mod) -> bool:
    """Whether a score function masks keys itself (gives -inf on some): its mask is not the block mask's, whose full
    tiles the block-sparse forward reads no mask on, so such a call runs the dense kernel (the whole mask, its key
    ranges proven)."""
    if score_mod is None:
        return False
    from .ir import variants

    return variants.trace_score_and_mask(score_mod)[1] is not None


def _block_sparse(q, k, v, with_grad: bool = False) -> bool:
    """Whether a call runs the block-sparse kernel: CUDA inputs that need no gradient, and with `with_grad`
    (flex_attention: a BlockMask, built once and reused) inputs that do, whose backward walks the block mask's
    transposed table (Kernel.backward), except while torch.compile traces (the dense kernel's fagen:: op is
    traced whole). SDPA's bool attn_mask, whose tables are built on each call, runs inputs that need a gradient
    through the dense kernel."""
    from .runtime import arrays

    lib = arrays.library(q)
    if lib == "cupy":
        return True
    if lib != "torch" or not q.is_cuda:
        return False
    import torch

    if not (torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))):
        return True
    return with_grad and not torch.compiler.is_compiling()


# SDPA's attn_mask as the kernel reads it: a parameter of the traced functions, read at [b, h, q_idx, kv_idx]
def _sdpa_bool_mask(b, h, q_idx, kv_idx, attn_mask):
    return attn_mask[b, h, q_idx, kv_idx]  # a bool tensor read as a condition: True attends


def _sdpa_additive_mask(score, b, h, q_idx, kv_idx, attn_mask):
    return score + attn_mask[b, h, q_idx, kv_idx]


def _sdpa_mask_mod(attn_mask, per_b: bool, per_h: bool):
    """A bool attn_mask as FlexAttention's mask_mod, capturing it (so the block-mask kernel and the attention
    kernel both gather it): indexed by b and h only where it varies along them, so that a mask broadcast over
    the batch or the heads gets one block table for all of them."""
    if per_b and per_h:

        def attn_mask_mod(b, h, q_idx, kv_idx):
            return attn_mask[b, h, q_idx, kv_idx]

    elif per_b:

        def attn_mask_mod(b, h, q_idx, kv_idx):
            return attn_mask[b, 0, q_idx, kv_idx]

    elif per_h:

        def attn_mask_mod(b, h, q_idx, kv_idx):
            return attn_mask[0, h, q_idx, kv_idx]

    else:

        def attn_mask_mod(b, h, q_idx, kv_idx):
            return attn_mask[0, 0, q_idx, kv_idx]

    return attn_mask_mod


def _sdpa_block_sparse(query, key, value, scale, given, view):
    """A bool attn_mask with its block sparsity found at run time: the block-mask kernel gathers the mask over
    each (query tile, key tile) at the attention kernel's tiles (built on this call), and the block-sparse
    forward skips the empty tiles and reads no mask on the full ones. `view` is the [B, H, L, S] broadcast view
    of the `given` mask."""
    B, H, L, _ = query.shape
    shape = (1,) * (4 - len(given.shape)) + tuple(given.shape)
    per_b, per_h = shape[0] != 1 and B > 1, shape[1] != 1 and H > 1
    mask_mod = _sdpa_mask_mod(view, per_b, per_h)
    block_mask = create_block_mask(mask_mod, B if per_b else None, H if per_h else None, L, key.shape[2], device=None)
    fields = _request(query, None, mask_mod, block_sparse=True)
    return _run_block_sparse(query, key, value, fields, scale=scale, block_mask=block_mask)


def _broadcast_mask(attn_mask, B, H, L, S):
    """attn_mask as a [B, H, L, S] view (stride 0 along broadcast dimensions: no copy), PyTorch's broadcasting."""
    shape = tuple(getattr(attn_mask, "shape", ()))
    if not hasattr(attn_mask, "dtype") or not 1 <= len(shape) <= 4:
        raise TypeError(f"attn_mask: expected a tensor broadcastable to [B, H, L, S] = {[B, H, L, S]}, got {shape}")
    want = (B, H, L, S)[4 - len(shape) :]
    if any(n not in (1, w) for n, w in zip(shape, want)):
        raise ValueError(f"attn_mask: shape {list(shape)} does not broadcast to [B, H, L, S] = {[B, H, L, S]}")
    view = attn_mask.reshape((1,) * (4 - len(shape)) + shape)
    if ops.is_torch(view):
        return view.expand(B, H, L, S)
    import cupy

    return cupy.broadcast_to(view, (B, H, L, S))


def scaled_dot_product_attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """torch.nn.functional.scaled_dot_product_attention's signature and semantics: is_causal aligned top-left
    (query i sees keys j <= i), scale default 1/sqrt(E), enable_gqa for Hq != Hkv. attn_mask: a bool tensor
    (True: the query attends the key) or a float one added to the scaled scores, broadcastable to [B, H, L, S]
    and read in the kernel through a broadcast view (no copy); its dtype is part of the kernel. A bool mask on
    CUDA inputs that need no gradient has its block sparsity found at run time, like a BlockMask's (a block
    table built on each call at the kernel's tiles: empty tiles skipped, no mask read on full ones); an additive
    mask, and inputs that require grad, are read on every key tile. A row that sees no key (every attn_mask
    entry False, or -inf) gives 0 here, where PyTorch gives NaN. Not yet: dropout_p > 0, which is refused."""
    if dropout_p:
        raise NotImplementedError(f"dropout_p: fagen has no dropout yet, got {dropout_p!r}")
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal: expected True or False, got {is_causal!r}")
    _check_heads(query, key, value, enable_gqa)
    if attn_mask is None:
        return _run(query, key, value, scale, {**_request(query, None, None), "causal": is_causal}, False)
    if is_causal:
        raise ValueError("attn_mask, is_causal: pass one of them (PyTorch refuses both too)")
    B, H, L, _ = query.shape
    mask = _broadcast_mask(attn_mask, B, H, L, key.shape[2])
    is_bool = str(mask.dtype).replace("torch.", "") == "bool"
    if is_bool and _block_sparse(query, key, value):
        return _sdpa_block_sparse(query, key, value, scale, attn_mask, mask)
    score_mod, mask_mod = (None, _sdpa_bool_mask) if is_bool else (_sdpa_additive_mask, None)
    tensors = {"attn_mask": mask}
    return _run(query, key, value, scale, _request(query, score_mod, mask_mod, tensors), False, tensors)


def _run(q, k, v, scale, request: dict, return_lse, tensors=None):
    tensors = dict(tensors or {})
    return ops.run(
        for_attention, request, q, k, v, scale=scale, deterministic=False, tensors=tensors, return_lse=return_lse
    )


__all__ = ["BlockMask", "create_block_mask", "flex_attention", "scaled_dot_product_attention"]
