"""`flash_attn_with_kvcache` in FlashAttention's signature and semantics, on fagen's split-KV decode.

    from fagen import flash_attn_with_kvcache
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=lens, block_table=table, causal=True)

The kernel of each request (head dim, dtype, device, causal, window, softcap, ALiBi and cache_leftpad:
fagen.request.for_flash_attn, FlashAttention's semantics as flash_attn_func has them) is compiled on first
use (seconds: the program is lowered and its rule proven) and kept in fagen.ops's memo; the softmax scale is a
call argument and needs no new kernel.

FlashAttention's conventions, as this module honours them:
- q [B, seqlen_q, H, D]; k_cache, v_cache [B_cache, seqlen_cache, Hkv, D], or with block_table [B, max_pages]
  (int32) [num_pages, page_size, Hkv, D] (any page_size); GQA/MQA by H a multiple of Hkv.
- cache_seqlens: an integer (any integer type) or [B] int32, the keys already cached (None: the whole cache).
  With k, v [B, seqlen_new, Hkv, D] the new keys are written into the caches in place at cache_seqlens[b] and
  attention covers cache_seqlens[b] + seqlen_new keys. cache_seqlens is only read, never incremented: as with
  FlashAttention, the caller adds seqlen_new for the next step. An integer or None makes a new [B] tensor per
  call: for CUDA graph capture pass a tensor.
- causal and window_size=(left, right) are aligned bottom-right: query i sees keys j with
  i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right (-1: unbounded; causal: right = 0).
- softcap > 0: softcap * tanh(score / softcap), score = q·k × softmax_scale; ALiBi (alibi_slopes [H] or [B, H],
  float32) then adds -slope * |i + seqlen_k - seqlen_q - j|, after the softcap, as FlashAttention does.
- cache_batch_idx [B] (int32): batch b reads and appends to cache row cache_batch_idx[b] (run as a paged cache of
  B_cache pages of seqlen_cache keys, page cache_batch_idx[b] for batch b: no copy). Not with block_table (as in
  FlashAttention: index the table instead).
- cache_leftpad [B] (int32): keys before cache_leftpad[b] are not attended (a mask of the kernel, which reads
  leftpad[b]); positions, masks and ALiBi distances are as without it, as in FlashAttention, where the shifted
  sequence keeps its bottom-right alignment. Paged caches take it too (FlashAttention's do not).
- rotary_cos, rotary_sin [seqlen_ro, rotary_dim / 2] (with k, v; rotary_dim <= D, even; seqlen_ro at least the
  cache's capacity): the first rotary_dim dims of the new keys are rotated at positions cache_seqlens[b] + i
  before they are written, and q's at cache_seqlens[b] + i with causal or a window (FlashAttention's rule:
  window sides at least the capacity count as none), else all at cache_seqlens[b]. rotary_interleaved pairs
  dims (0, 1), (2, 3), ..., else (i, i + rotary_dim / 2) (GPT-NeoX). Runs before the kernel, on the device with
  q's library (PyTorch or CuPy), in float32, rounded to q's dtype as FlashAttention's kernel rounds.
- block_table (and cache_batch_idx) checked: every page a sequence uses (the first ceil(length / page_size)
  entries of its row, length = cache_seqlens[b] + seqlen_new) in [0, num_pages), and no length past the row's
  capacity (max_pages × page_size). The check is one small reduction on the device and one read of two
  integers to the host (a sync, as FlashAttention's own check of the lengths); an error names the argument
  (BlockTableError: a ValueError and, as FlashAttention's, a RuntimeError). While a CUDA graph is captured or
  torch.compile traces, it is skipped (the kernel clamps every entry, so a bad one reads a wrong page, never
  outside the cache).
- Returns out [B, seqlen_q, H, D], and with return_softmax_lse the log-sum-exp [B, H, seqlen_q] (float32,
  natural log). A query row that sees no key gives out = 0 and lse = -inf.

Not supported (a clear error, never different numbers): inputs that need a grad (decode has no backward).
"""

from __future__ import annotations

import contextlib

from . import ops
from .request import as_int, as_real, flash_softcap, flash_window, for_flash_attn


class BlockTableError(ValueError, RuntimeError):
    """A page table (block_table, cache_batch_idx) that names a page outside the cache, or a sequence longer than
    its row can address: a ValueError, and a RuntimeError as FlashAttention raises it."""


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    block_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
):
    """Attention of q over a KV cache, appending k, v first; FlashAttention's flash_attn_with_kvcache (see the
    module's docstring for the conventions)."""
    if (k is None) != (v is None):
        raise ValueError("k, v: pass both (the new keys and values to append) or neither")
    if not isinstance(rotary_interleaved, bool):
        raise TypeError(f"rotary_interleaved: expected True or False, got {rotary_interleaved!r}")
    splits = _num_splits(num_splits)
    scale = None if softmax_scale is None else as_real(softmax_scale, "softmax_scale")
    _check_shapes(q, k_cache, v_cache, k)
    tensors = {}
    if alibi_slopes is not None:
        tensors["slopes"] = _slopes(alibi_slopes, q.shape[0], q.shape[2])
    if cache_leftpad is not None:
        tensors["leftpad"] = per_batch(cache_leftpad, "cache_leftpad", q)
    name = "block_table"
    if cache_batch_idx is not None:  # the cache as B_cache pages of seqlen_cache keys, cache_batch_idx the table
        block_table, name = _batch_table(cache_batch_idx, block_table, q), "cache_batch_idx"
    if block_table is not None:
        check_table(block_table, name, q)
    capacity = int(k_cache.shape[1]) * (int(block_table.shape[1]) if block_table is not None else 1)
    rotary = rotary_cos is not None or rotary_sin is not None
    if rotary:
        _rotary_tables(rotary_cos, rotary_sin, q, k, capacity)
    fields = _request(q, causal, window_size, softcap, tensors)
    with on_device(q):
        lens = _seqlens(cache_seqlens, q, capacity)
    kernel = ops.kernel_of(ops.kernel_key(for_flash_attn, **fields))
    with on_device(q):
        if block_table is not None:
            added = int(k.shape[1]) if k is not None else 0
            check_pages(block_table, name, lambda: lens + added, k_cache.shape[0], k_cache.shape[1])
        if rotary:  # FlashAttention's rule: q rotated row by row with causal or a window narrower than the cache
            per_row = causal or any(0 <= side < capacity for side in fields["window_size"])
            q, k = _rotate(q, k, rotary_cos, rotary_sin, lens, rotary_interleaved, per_row)
    return kernel.decode(
        q,
        k_cache,
        v_cache,
        lens,
        block_table=block_table,
        k_new=k,
        v_new=v,
        num_splits=splits,
        scale=scale,
        return_lse=bool(return_softmax_lse),
        **tensors,
    )


def _request(q, causal, window_size, softcap, tensors: dict) -> dict:
    """The arguments of the decode kernel's request (fagen.request.for_flash_attn), checked: FlashAttention's
    options, the ALiBi slopes' layout ('h': [H], 'bh': [B, H]), whether the program reads leftpad[b]."""
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected True or False, got {causal!r}")
    slopes = tensors.get("slopes")
    return dict(
        dim=q.shape[3],
        dtype=str(getattr(q, "dtype", "")).replace("torch.", ""),
        device=ops.device_of(q),
        causal=causal,
        window_size=flash_window(window_size),
        softcap=flash_softcap(softcap),
        alibi=None if slopes is None else "bh" if len(slopes.shape) == 2 else "h",
        decode=True,
        leftpad="leftpad" in tensors,
    )


def _num_splits(num_splits):
    """FlashAttention's num_splits (any integer type): 0 picks by heuristic, n >= 1 uses n."""
    try:
        value = as_int(num_splits, "num_splits")
    except (TypeError, ValueError):
        raise ValueError(f"num_splits: expected an int >= 0 (0: heuristic), got {num_splits!r}") from None
    if value < 0:
        raise ValueError(f"num_splits: expected an int >= 0 (0: heuristic), got {num_splits!r}")
    return None if value == 0 else value


def _slopes(alibi_slopes, batch: int, heads: int):
    """alibi_slopes as the kernel reads them: [H], or [B, H] per batch (a [1, H] array is viewed as [H])."""
    shape = tuple(getattr(alibi_slopes, "shape", ()))
    if shape == (1, heads):
        alibi_slopes, shape = alibi_slopes[0], (heads,)
    if shape != (heads,) and shape != (batch, heads):
        raise ValueError(
            f"alibi_slopes: expected shape ({heads},) or ({batch}, {heads}) (a slope per query head, or per batch "
            f"and head), got {shape}"
        )
    if str(getattr(alibi_slopes, "dtype", "")).replace("torch.", "") != "float32":
        raise TypeError(f"alibi_slopes: expected float32, got {getattr(alibi_slopes, 'dtype', None)}")
    return alibi_slopes if _contiguous(alibi_slopes) else alibi_slopes.contiguous()


def _contiguous(x) -> bool:
    return x.is_contiguous() if hasattr(x, "is_contiguous") else x.flags.c_contiguous


def _torch(x) -> bool:
    return type(x).__module__.startswith("torch")


def on_device(x):
    """A context in which CuPy works on x's device (PyTorch names the device in each call: nothing to enter)."""
    if _torch(x):
        return contextlib.nullcontext()
    import cupy

    return cupy.cuda.Device(x.device.id)


def same_place(x, q, name: str) -> None:
    """x is an array of q's library on q's device."""
    if type(x).__module__.split(".")[0] != type(q).__module__.split(".")[0]:
        raise TypeError(f"{name}: expected an array of q's library ({type(q).__module__.split('.')[0]})")
    if str(x.device) != str(q.device):
        raise TypeError(f"{name}: expected an array on q's device ({q.device}), got one on {x.device}")


def per_batch(x, name: str, q):
    """A [B] int32 vector of q's library on q's device (cache_leftpad, cache_batch_idx), contiguous."""
    B = q.shape[0]
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name}: expected a [B={B}] int32 tensor, got {type(x).__name__}")
    if tuple(x.shape) != (B,) or str(x.dtype).replace("torch.", "") != "int32":
        raise ValueError(f"{name}: expected a [B={B}] int32 tensor, got shape {list(x.shape)} {x.dtype}")
    same_place(x, q, name)
    return x if _contiguous(x) else x.contiguous() if _torch(x) else x.copy()


def _check_shapes(q, k_cache, v_cache, k) -> None:
    """q, the caches and the new keys have 4 dimensions (Kernel.decode checks the rest)."""
    for name, x, layout in (
        ("q", q, "[B, seqlen_q, H, D]"),
        ("k_cache", k_cache, "[B, seqlen, Hkv, D]"),
        ("v_cache", v_cache, "[B, seqlen, Hkv, D]"),
        ("k", k, "[B, seqlen_new, Hkv, D]"),
    ):
        if x is not None and len(getattr(x, "shape", ())) != 4:
            raise ValueError(f"{name}: expected 4 dimensions {layout}, got shape {tuple(getattr(x, 'shape', ()))}")


def _seqlens(cache_seqlens, q, capacity: int):
    """cache_seqlens as a [B] int32 array of q's library: as given, from an integer (any integer type, a 0-d tensor
    included), or the whole cache (None: its capacity)."""
    B = q.shape[0]
    if hasattr(cache_seqlens, "shape") and len(cache_seqlens.shape) > 0:
        shape, dtype = tuple(cache_seqlens.shape), str(getattr(cache_seqlens, "dtype", "")).replace("torch.", "")
        if shape != (B,) or dtype != "int32":
            raise ValueError(f"cache_seqlens: expected a contiguous int32 vector of {B} lengths, got {shape} {dtype}")
        same_place(cache_seqlens, q, "cache_seqlens")
        return cache_seqlens  # Kernel.decode checks the rest (contiguous)
    if cache_seqlens is None:
        value = capacity
    else:
        try:
            value = as_int(cache_seqlens, "cache_seqlens")
        except TypeError:
            raise TypeError(f"cache_seqlens: expected an int or a [B] int32 array, got {cache_seqlens!r}") from None
        if value < 0:
            raise ValueError(f"cache_seqlens: expected a length >= 0, got {cache_seqlens}")
    if _torch(q):
        import torch

        return torch.full((B,), value, dtype=torch.int32, device=q.device)
    import cupy

    return cupy.full((B,), value, dtype=cupy.int32)


def _batch_table(cache_batch_idx, block_table, q):
    """cache_batch_idx [B] as the page table [B, 1] of the cache seen as B_cache pages of seqlen_cache keys (a
    view: no copy)."""
    if block_table is not None:
        raise ValueError(
            "cache_batch_idx: a paged cache (block_table) takes no cache_batch_idx (as in FlashAttention); "
            "reorder the block_table's rows instead"
        )
    idx = per_batch(cache_batch_idx, "cache_batch_idx", q)
    return idx.reshape(q.shape[0], 1)


def check_table(table, name: str, q, batch: int | None = None) -> None:
    """A page table's layout: [B, max_pages] int32 of q's library on q's device (B: q's batch, or `batch`)."""
    B = q.shape[0] if batch is None else batch
    shape = tuple(getattr(table, "shape", ()))
    if len(shape) != 2 or shape[0] != B or str(getattr(table, "dtype", "")).replace("torch.", "") != "int32":
        raise ValueError(f"{name}: expected an int32 array [B={B}, max_pages], got shape {list(shape)}")
    same_place(table, q, name)


def _library(x):
    if _torch(x):
        import torch

        return torch
    import cupy

    return cupy


def _skip_checks(x) -> bool:
    """Whether a check that reads the device must be skipped: a CUDA graph being captured, or torch.compile
    tracing."""
    if _torch(x):
        import torch

        if torch.compiler.is_compiling():
            return True
        return x.is_cuda and torch.cuda.is_current_stream_capturing()
    from .runtime.arrays import current_stream
    from .runtime.calls import capturing

    stream = current_stream(x)
    return stream is not None and capturing(stream)


def check_pages(table, name: str, lengths, num_pages: int, page_size: int, extra=()) -> list[int] | None:
    """The page table checked against the sequences' lengths (`lengths()`: [B] on the device, computed only
    where the check runs): every entry that a sequence uses (the first ceil(length / page_size) of its row) names a
    page in [0, num_pages), and no length passes the row's capacity (max_pages × page_size). One reduction on the
    device and one read to the host, with the 0-d device values `extra()`, returned as ints; None (nothing
    computed or read) while a CUDA graph is captured or torch.compile traces."""
    if _skip_checks(table):
        return None
    xp = _library(table)
    max_pages = int(table.shape[1])
    lengths = lengths().long() if _torch(table) else lengths().astype(xp.int64)
    cols = xp.arange(max_pages, device=table.device) if _torch(table) else xp.arange(max_pages)
    used = cols[None, :] < (lengths[:, None] + page_size - 1) // page_size
    bad = used & ((table < 0) | (table >= num_pages))
    as_long = (lambda a: a.long()) if _torch(table) else (lambda a: a.astype(xp.int64))
    found = xp.stack([bad.sum(), lengths.max(), *(as_long(e.reshape(())) for e in (extra() if extra else ()))])
    count, longest, *values = (int(n) for n in found.tolist())
    capacity = max_pages * page_size
    if longest > capacity:
        raise BlockTableError(
            f"{name}: a sequence of {longest} keys passes the {capacity} keys its row of {max_pages} pages of "
            f"{page_size} can address; give {name} more columns (pages)"
        )
    if count:
        what = "cache rows" if name == "cache_batch_idx" else "pages"
        raise BlockTableError(
            f"{name}: {count} of the entries in use name {what} outside [0, {num_pages}) (the cache has "
            f"{num_pages} {what})"
        )
    return values


def _rotary_tables(rotary_cos, rotary_sin, q, k, capacity: int) -> None:
    """rotary_cos, rotary_sin checked: both, with new keys k to rotate, [seqlen_ro, rotary_dim / 2] floating arrays
    of q's library and device, rotary_dim <= D, seqlen_ro at least the cache's capacity."""
    if rotary_cos is None or rotary_sin is None:
        raise ValueError("rotary_cos, rotary_sin: pass both or neither")
    if k is None:
        raise ValueError("rotary_cos: rotary embeddings rotate the new keys: pass k, v (as FlashAttention requires)")
    D = q.shape[3]
    for name, x in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        shape = tuple(getattr(x, "shape", ()))
        if len(shape) != 2 or not 1 <= shape[1] <= D // 2:
            raise ValueError(f"{name}: expected shape [seqlen_ro, rotary_dim / 2] with rotary_dim <= {D}, got {shape}")
        if "float" not in str(x.dtype) and "half" not in str(x.dtype):
            raise TypeError(f"{name}: expected a floating tensor, got {x.dtype}")
        if shape[0] < capacity:
            raise ValueError(f"{name}: {shape[0]} positions, fewer than the cache's {capacity} (FlashAttention's rule)")
        same_place(x, q, name)
    if tuple(rotary_cos.shape) != tuple(rotary_sin.shape):
        raise ValueError(
            f"rotary_cos, rotary_sin: shapes {tuple(rotary_cos.shape)} and {tuple(rotary_sin.shape)} differ"
        )


def _rotate(q, k, rotary_cos, rotary_sin, lens, interleaved: bool, per_row: bool):
    """q and the new keys k rotated (FlashAttention's rotary embedding, module docstring): k at positions
    lens[b] + i, q at lens[b] + i where `per_row`, else at lens[b]. Positions past the tables are clamped."""
    xp = _library(q)
    last = int(rotary_cos.shape[0]) - 1
    base = lens.long() if _torch(q) else lens.astype(xp.int64)

    def positions(n: int, step: int):
        steps = xp.arange(n, device=q.device) if _torch(q) else xp.arange(n)
        return (base[:, None] + steps[None, :] * step).clip(0, last)

    q_pos, k_pos = positions(q.shape[1], 1 if per_row else 0), positions(k.shape[1], 1)
    return rotary(q, rotary_cos, rotary_sin, q_pos, interleaved), rotary(k, rotary_cos, rotary_sin, k_pos, interleaved)


def rotary(x, cos, sin, positions, interleaved: bool):
    """x [B, S, H, D] with its first rotary_dim = 2 · cos.shape[1] dims rotated by the angles of rows positions[b, s]
    of cos, sin: pairs (x1, x2) -> (x1·cos - x2·sin, x2·cos + x1·sin), the pairs (2i, 2i + 1) where
    `interleaved`, else (i, i + rotary_dim / 2); computed in float32, rounded to x's dtype."""
    xp = _library(x)
    torch_side = _torch(x)
    f32 = (lambda a: a.float()) if torch_side else (lambda a: a.astype(xp.float32))
    half = int(cos.shape[1])
    c, s = (f32(t[positions])[:, :, None, :] for t in (cos, sin))
    part = f32(x[..., : 2 * half])
    x1, x2 = (part[..., 0::2], part[..., 1::2]) if interleaved else (part[..., :half], part[..., half:])
    r1, r2 = x1 * c - x2 * s, x2 * c + x1 * s
    cat = xp.cat if torch_side else xp.concatenate
    turned = xp.stack([r1, r2], -1).reshape(part.shape) if interleaved else cat([r1, r2], -1)
    turned = turned.to(x.dtype) if torch_side else turned.astype(x.dtype)
    return cat([turned, x[..., 2 * half :]], -1)


def gather_pages(k_cache, v_cache, block_table, cu_seqlens_k, rows: int):
    """Paged keys and values packed as varlen's k, v [rows, Hkv, D]: packed row cu_seqlens_k[b] + j is row
    j % page_size of page block_table[b, j // page_size]. On the device (an index computation and a gather per
    cache, differentiable for PyTorch); indices are clamped, so rows outside every sequence copy some row and
    bad offsets never read outside the cache."""
    xp = _library(k_cache)
    torch_side = _torch(k_cache)
    B, max_pages = int(block_table.shape[0]), int(block_table.shape[1])
    num_pages, page_size = int(k_cache.shape[0]), int(k_cache.shape[1])
    cu = cu_seqlens_k.long() if torch_side else cu_seqlens_k.astype(xp.int64)
    r = xp.arange(rows, device=k_cache.device) if torch_side else xp.arange(rows)
    ends = cu[1:].contiguous() if torch_side else cu[1:]
    b = (xp.searchsorted(ends, r, right=True) if torch_side else xp.searchsorted(ends, r, side="right")).clip(0, B - 1)
    j = r - cu[b]
    page = block_table[b, (j // page_size).clip(0, max_pages - 1)].clip(0, num_pages - 1)
    row = j % page_size
    return k_cache[page, row], v_cache[page, row]
