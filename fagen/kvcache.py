"""`flash_attn_with_kvcache` in FlashAttention's signature and semantics, on fagen's split-KV decode.

    from fagen import flash_attn_with_kvcache
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=lens, block_table=table, causal=True)

The kernel of each request (head dim, dtype, device, causal, window, softcap and ALiBi:
fagen.request.for_flash_attn, FlashAttention's semantics as flash_attn_func has them) is compiled on first
use (seconds: the program is lowered and its rule proven) and kept in fagen.ops's memo; the softmax scale is a
call argument and needs no new kernel.

FlashAttention's conventions, as this module honours them:
- q [B, seqlen_q, H, D]; k_cache, v_cache [B, seqlen_cache, Hkv, D], or with block_table [B, max_pages]
  (int32) [num_pages, page_size, Hkv, D] (any page_size); GQA/MQA by H a multiple of Hkv.
- cache_seqlens: an int or [B] int32, the keys already cached (None: the whole cache). With k, v
  [B, seqlen_new, Hkv, D] the new keys are written into the caches in place at cache_seqlens[b] and attention
  covers cache_seqlens[b] + seqlen_new keys. cache_seqlens is only read, never incremented: as with
  FlashAttention, the caller adds seqlen_new for the next step. An int or None makes a new [B] tensor per call:
  for CUDA graph capture pass a tensor.
- causal and window_size=(left, right) are aligned bottom-right: query i sees keys j with
  i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right (-1: unbounded; causal: right = 0).
- softcap > 0: softcap * tanh(score / softcap), score = q·k × softmax_scale; ALiBi (alibi_slopes [H] or [B, H],
  float32)
  then adds -slope * |i + seqlen_k - seqlen_q - j|, after the softcap, as FlashAttention does.
- Returns out [B, seqlen_q, H, D], and with return_softmax_lse the log-sum-exp [B, H, seqlen_q] (float32,
  natural log). A query row that sees no key gives out = 0 and lse = -inf.

Not supported (a clear error, never different numbers): rotary embeddings (rotary_cos, rotary_sin),
cache_batch_idx, cache_leftpad, per-batch ALiBi slopes [B, H], and inputs that need a grad.
"""

from __future__ import annotations

from . import ops
from .request import flash_softcap, flash_window, for_flash_attn


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
    module's docstring for the conventions and what is not supported)."""
    for name, value in (
        ("rotary_cos", rotary_cos),
        ("rotary_sin", rotary_sin),
        ("cache_batch_idx", cache_batch_idx),
        ("cache_leftpad", cache_leftpad),
    ):
        if value is not None:
            raise NotImplementedError(f"{name}: not supported by fagen's flash_attn_with_kvcache; pass None")
    del rotary_interleaved  # only meaningful with rotary embeddings
    if (k is None) != (v is None):
        raise ValueError("k, v: pass both (the new keys and values to append) or neither")
    splits = _num_splits(num_splits)
    q_shape = tuple(getattr(q, "shape", ()))
    if len(q_shape) != 4:
        raise ValueError(f"q: expected 4 dimensions [B, seqlen_q, H, D], got shape {q_shape}")
    tensors = {}
    if alibi_slopes is not None:
        tensors["slopes"] = _slopes(alibi_slopes, q_shape[0], q_shape[2])
    kernel = ops.kernel_of(ops.kernel_key(for_flash_attn, **_request(q, causal, window_size, softcap, tensors)))
    lens = _seqlens(cache_seqlens, q, k_cache, block_table)
    return kernel.decode(
        q,
        k_cache,
        v_cache,
        lens,
        block_table=block_table,
        k_new=k,
        v_new=v,
        num_splits=splits,
        scale=softmax_scale,
        return_lse=bool(return_softmax_lse),
        **tensors,
    )


def _request(q, causal, window_size, softcap, tensors: dict) -> dict:
    """The arguments of the decode kernel's request (fagen.request.for_flash_attn), checked: FlashAttention's
    options, the ALiBi slopes' layout ('h': [H], 'bh': [B, H])."""
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
    )


def _num_splits(num_splits):
    """FlashAttention's num_splits: 0 picks by heuristic, n >= 1 uses n."""
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"num_splits: expected an int >= 0 (0: heuristic), got {num_splits!r}")
    return None if num_splits == 0 else num_splits


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


def _seqlens(cache_seqlens, q, k_cache, block_table):
    """cache_seqlens as a [B] int32 array of q's library: as given, from an int, or the whole cache (None)."""
    if isinstance(cache_seqlens, bool):
        raise TypeError(f"cache_seqlens: expected an int or a [B] int32 array, got {cache_seqlens!r}")
    if cache_seqlens is not None and not isinstance(cache_seqlens, int):
        return cache_seqlens  # an array: Kernel.decode checks it
    if cache_seqlens is None:
        value = int(k_cache.shape[1]) * (int(block_table.shape[1]) if block_table is not None else 1)
    elif cache_seqlens < 0:
        raise ValueError(f"cache_seqlens: expected a length >= 0, got {cache_seqlens}")
    else:
        value = cache_seqlens
    B = q.shape[0]
    if type(q).__module__.startswith("torch"):
        import torch

        return torch.full((B,), value, dtype=torch.int32, device=q.device)
    import cupy

    with cupy.cuda.Device(q.device.id):
        return cupy.full((B,), value, dtype=cupy.int32)
