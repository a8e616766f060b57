"""FlashAttention's Python interface on fagen kernels: code written for `flash_attn` switches by an import.

    from fagen import flash_attn_func, flash_attn_varlen_func
    from fagen.flash_attn import flash_attn_qkvpacked_func, flash_attn_kvpacked_func  # and their varlen twins

The layout is FlashAttention's, [B, N, H, D] (packed [total, H, D] for varlen), taken as strided
[B, H, N, D] views with no copy, and so are the semantics (fagen.request.Flash, whose program
fagen.ir.variants.flash_attn_program builds):
- `softmax_scale` scales QKᵀ (default 1/sqrt(D)); `softcap` > 0 gives C·tanh(s/C) of the scaled scores;
- `causal` and `window_size` are aligned bottom-right: query i faces key i + N - M, and sees keys
  i + N - M - left <= j <= i + N - M + right (left or right -1: unbounded on that side; (-1, -1): no window;
  causal makes right 0). Rows that see no key give 0;
- `alibi_slopes` ([H] or [B, H], float32) adds -slope·|i + N - M - j| to the scores, after the softcap, causal or
  not;
- MQA/GQA when k, v have fewer heads than q (a divisor); dk, dv are summed over each group;
- the packed forms take qkv [B, S, 3, H, D] (kv [B, S, 2, Hkv, D]; [total, 3, H, D] for varlen) as views of
  its parts, no copy; the gradient of the packed tensor is assembled by autograd from its parts';
- `return_attn_probs=True` returns (out, softmax_lse, None): softmax_lse [B, H, M] ([H, total_q] for varlen),
  float32, the natural log of each row's sum of exp(scores); like FlashAttention's without dropout, no
  probabilities come back (None) and no gradient flows through softmax_lse.
- flash_attn_varlen_func's block_table: k, v are paged caches [num_pages, page_size, Hkv, D], sequence b's keys
  the first cu_seqlens_k[b + 1] - cu_seqlens_k[b] keys of its pages (gathered on the device: see its docstring);
- window sizes, max_seqlen_q/k, softcap, softmax_scale and dropout_p may be NumPy numbers or 0-d tensors (a window
  also a 2-element tensor), as FlashAttention's tests pass them (fagen.request.as_int, as_real).
Gradients flow through the `fagen::attention` op (fagen.runtime.autograd); `deterministic=True` asks for a
reproducible backward. Not done: dropout (`dropout_p` > 0) is refused with an error saying so.
"""

from __future__ import annotations

import math

from . import _FLASH_ATTN, kvcache, ops
from .kvcache import flash_attn_with_kvcache  # noqa: F401  (FlashAttention's decode entry point)
from .request import as_int, as_real, flash_softcap, flash_window, for_flash_attn
from .runtime import arrays


def _refuse(dropout_p, return_attn_probs) -> None:
    try:
        p = as_real(dropout_p, "dropout_p")
    except (TypeError, ValueError):
        p = math.nan
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p: expected a probability in [0, 1), got {dropout_p!r}")
    dropout_p = p
    if dropout_p != 0.0:
        raise NotImplementedError(
            f"dropout_p: fagen has no attention dropout yet (got {dropout_p}); pass dropout_p=0.0 "
            "(e.g. apply dropout to the output instead)"
        )
    if not isinstance(return_attn_probs, bool):
        raise TypeError(f"return_attn_probs: expected True or False, got {return_attn_probs!r}")


def _slopes(alibi_slopes, batch: int, heads: int) -> dict:
    """The call-time tensors for alibi_slopes: {'slopes': [H] float32} (a [1, H] array is viewed as [H]), or
    {'slopes': [B, H]} for per-batch slopes (the program reads slopes[b, h])."""
    if alibi_slopes is None:
        return {}
    if arrays.library(alibi_slopes) is None:
        raise TypeError(f"alibi_slopes: expected a tensor of shape [H] or [B, H], got {type(alibi_slopes).__name__}")
    shape = tuple(alibi_slopes.shape)
    if str(alibi_slopes.dtype).replace("torch.", "") != "float32":
        raise TypeError(f"alibi_slopes: expected float32 (FlashAttention's), got {alibi_slopes.dtype}")
    if len(shape) == 2 and shape[1] == heads and shape[0] == 1:
        alibi_slopes = alibi_slopes[0]
    elif shape != (heads,) and shape != (batch, heads):
        raise ValueError(f"alibi_slopes: expected shape [{heads}] or [{batch}, {heads}], got {list(shape)}")
    if _torch(alibi_slopes):
        alibi_slopes = alibi_slopes.contiguous()  # the same tensor where it is contiguous already
    elif not alibi_slopes.flags.c_contiguous:
        alibi_slopes = alibi_slopes.copy()
    return {"slopes": alibi_slopes}


def _torch(x) -> bool:
    return type(x).__module__.startswith("torch")


def _transpose(x):
    """[B, N, H, D] as [B, H, N, D] (a view)."""
    return x.transpose(1, 2) if _torch(x) else x.swapaxes(1, 2)


def _check_dims(want: int, layout: str, **named) -> None:
    for name, x in named.items():
        if arrays.library(x) is None:
            raise TypeError(f"{name}: expected a PyTorch tensor or a CuPy array, got {type(x).__name__}")
        if len(x.shape) != want:
            raise ValueError(f"{name}: expected {want} dimensions {layout}, got shape {list(x.shape)}")


def _request(q, causal, window_size, softcap, tensors: dict) -> dict:
    """The arguments of q's request (fagen.request.for_flash_attn), checked: FlashAttention's options, the
    ALiBi slopes' layout ('h': [H], 'bh': [B, H])."""
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected True or False, got {causal!r}")
    slopes = tensors.get("slopes")
    alibi = None if slopes is None else "bh" if len(slopes.shape) == 2 else "h"
    return dict(
        dim=int(q.shape[-1]),
        dtype=ops.dtype_of(q),
        device=ops.device_of(q),
        causal=causal,
        window_size=flash_window(window_size),
        softcap=flash_softcap(softcap),
        alibi=alibi,
    )


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """FlashAttention's flash_attn_func: q [B, M, H, D], k, v [B, N, Hkv, D] -> out [B, M, H, D], or
    (out, softmax_lse [B, H, M], None) with return_attn_probs=True (module docstring for the semantics).
    PyTorch tensors (differentiable, torch.compile-traceable) or CuPy arrays (forward only)."""
    _refuse(dropout_p, return_attn_probs)
    _check_dims(4, "[B, S, H, D]", q=q, k=k, v=v)
    tensors = _slopes(alibi_slopes, q.shape[0], q.shape[2])
    request = _request(q, causal, window_size, softcap, tensors)
    o = ops.run(
        for_flash_attn,
        request,
        _transpose(q),
        _transpose(k),
        _transpose(v),
        scale=_scale(softmax_scale),
        deterministic=bool(deterministic),
        tensors=tensors,
        slopes="alibi_slopes",
        return_lse=return_attn_probs,
    )
    if return_attn_probs:
        o, lse = o
        return _transpose(o), lse, None
    return _transpose(o)


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    """FlashAttention's flash_attn_varlen_func: q [total_q, H, D], k, v [total_k, Hkv, D] packed, sequence b
    being rows cu_seqlens[b]:cu_seqlens[b + 1] (int32, B + 1 offsets); the masks and ALiBi apply within each
    sequence, aligned bottom-right with that sequence's own lengths; per-batch alibi_slopes [B, H] give sequence b
    row b. Returns out [total_q, H, D], or (out, softmax_lse [H, total_q], None) with return_attn_probs=True.

    With block_table [B, max_pages] (int32), k, v are paged caches [num_pages, page_size, Hkv, D] (any
    page_size): sequence b's keys are its first cu_seqlens_k[b + 1] - cu_seqlens_k[b] keys, key j being row
    j % page_size of page block_table[b, j // page_size]. It runs as the packed call on the pages gathered on the
    device (fagen.kvcache.gather_pages: one gather per cache, differentiable, so the caches get their gradients),
    after the table is checked as flash_attn_with_kvcache checks it (fagen.kvcache.check_pages: one reduction and
    one read to the host, which also sizes the gather)."""
    _refuse(dropout_p, return_attn_probs)
    max_seqlen_q, max_seqlen_k = as_int(max_seqlen_q, "max_seqlen_q"), as_int(max_seqlen_k, "max_seqlen_k")
    if block_table is not None:
        k, v = _paged(q, k, v, block_table, cu_seqlens_k, max_seqlen_k)
    _check_dims(3, "[total, H, D]", q=q, k=k, v=v)
    batch = int(cu_seqlens_q.shape[0]) - 1 if len(getattr(cu_seqlens_q, "shape", ())) == 1 else 0
    tensors = _slopes(alibi_slopes, batch, q.shape[1])
    request = _request(q, causal, window_size, softcap, tensors)
    out = ops.run_varlen(
        for_flash_attn,
        request,
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        scale=_scale(softmax_scale),
        deterministic=bool(deterministic),
        tensors=tensors,
        slopes="alibi_slopes",
        return_lse=return_attn_probs,
    )
    return (*out, None) if return_attn_probs else out


def _paged(q, k_cache, v_cache, block_table, cu_seqlens_k, max_seqlen_k: int):
    """Varlen's k, v packed from paged caches (flash_attn_varlen_func's block_table), the table checked first."""
    _check_dims(4, "[num_pages, page_size, Hkv, D] (with block_table)", k=k_cache, v=v_cache)
    _check_dims(3, "[total, H, D]", q=q)
    if tuple(k_cache.shape) != tuple(v_cache.shape):
        raise ValueError(f"k, v: the paged caches' shapes {list(k_cache.shape)} and {list(v_cache.shape)} differ")
    cu_shape = tuple(getattr(cu_seqlens_k, "shape", ()))
    if len(cu_shape) != 1 or cu_shape[0] < 2 or str(cu_seqlens_k.dtype).replace("torch.", "") != "int32":
        raise ValueError(f"cu_seqlens_k: expected an int32 vector of B + 1 offsets, got shape {list(cu_shape)}")
    kvcache.check_table(block_table, "block_table", q, batch=cu_shape[0] - 1)
    kvcache.same_place(cu_seqlens_k, q, "cu_seqlens_k")
    with kvcache.on_device(q):
        found = kvcache.check_pages(
            block_table,
            "block_table",
            lambda: cu_seqlens_k[1:] - cu_seqlens_k[:-1],
            k_cache.shape[0],
            k_cache.shape[1],
            extra=lambda: (cu_seqlens_k[-1],),
        )
        # the packed rows: the last offset where the check read it, else B x max_seqlen_k (enough by the contract)
        rows = max(found[0], 1) if found is not None else (cu_shape[0] - 1) * max_seqlen_k
        return kvcache.gather_pages(k_cache, v_cache, block_table, cu_seqlens_k, rows)


def _scale(softmax_scale):
    return None if softmax_scale is None else as_real(softmax_scale, "softmax_scale")


def _unpack(x, name: str, count: int, layout: str):
    """The `count` parts of a packed tensor along its dimension -3 (qkv [..., 3, H, D], kv [..., 2, H, D]), as
    views (no copy)."""
    if arrays.library(x) is None:
        raise TypeError(f"{name}: expected a PyTorch tensor or a CuPy array, got {type(x).__name__}")
    shape = tuple(x.shape)
    if len(shape) != len(layout.split(",")) or shape[-3] != count:
        raise ValueError(f"{name}: expected shape {layout} with {count} at dimension -3, got {list(shape)}")
    return tuple(x[(Ellipsis, i, slice(None), slice(None))] for i in range(count))


def flash_attn_qkvpacked_func(
    qkv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """FlashAttention's flash_attn_qkvpacked_func: qkv [B, S, 3, H, D] -> out [B, S, H, D] (flash_attn_func on
    the views qkv[:, :, 0], [:, :, 1], [:, :, 2])."""
    q, k, v = _unpack(qkv, "qkv", 3, "[B, S, 3, H, D]")
    return flash_attn_func(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs
    )


def flash_attn_kvpacked_func(
    q,
    kv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """FlashAttention's flash_attn_kvpacked_func: q [B, M, H, D], kv [B, N, 2, Hkv, D] -> out [B, M, H, D]."""
    k, v = _unpack(kv, "kv", 2, "[B, S, 2, H, D]")
    return flash_attn_func(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs
    )


def flash_attn_varlen_qkvpacked_func(
    qkv,
    cu_seqlens,
    max_seqlen,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """FlashAttention's flash_attn_varlen_qkvpacked_func: qkv [total, 3, H, D], sequence b being rows
    cu_seqlens[b]:cu_seqlens[b + 1] of q, k and v alike -> out [total, H, D]."""
    q, k, v = _unpack(qkv, "qkv", 3, "[total, 3, H, D]")
    return flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens,
        cu_seqlens,
        max_seqlen,
        max_seqlen,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
    )


def flash_attn_varlen_kvpacked_func(
    q,
    kv,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """FlashAttention's flash_attn_varlen_kvpacked_func: q [total_q, H, D], kv [total_k, 2, Hkv, D] -> out
    [total_q, H, D]."""
    k, v = _unpack(kv, "kv", 2, "[total, 2, H, D]")
    return flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
    )


__all__ = list(_FLASH_ATTN)  # the names fagen exports from here (fagen/__init__.py lists them once)
