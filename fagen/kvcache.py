"""`flash_attn_with_kvcache` in FlashAttention's signature and semantics, on fagen's split-KV decode.

    from fagen import flash_attn_with_kvcache
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=lens, block_table=table, causal=True)

The kernel for each combination of head dim, dtype, device, causal, window, softcap and ALiBi is compiled on
first use (seconds: the program is lowered and its rule proven) and kept in a small in-process memo; the
softmax scale is a call argument and needs no new kernel.

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

import threading

_KERNELS: dict = {}
_LOCK = threading.Lock()
_MAX_KERNELS = 64


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
    options = _options(causal, window_size, softcap, tensors.get("slopes"))
    kernel = _kernel(q, q_shape[3], options)
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


def _options(causal, window_size, softcap, alibi_slopes) -> tuple:
    """(causal, left, right, softcap, alibi) after FlashAttention's rules, checked; -1 = unbounded. alibi: None,
    "h" (slopes [H]) or "bh" (slopes [B, H])."""
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected True or False, got {causal!r}")
    if not (isinstance(window_size, (tuple, list)) and len(window_size) == 2):
        raise ValueError(f"window_size: expected a pair (left, right), got {window_size!r}")
    left, right = window_size
    for side, value in (("left", left), ("right", right)):
        if isinstance(value, bool) or not isinstance(value, int) or value < -1:
            raise ValueError(f"window_size ({side}): expected an int >= -1 (-1: unbounded), got {value!r}")
        if value >= 2**31:
            raise ValueError(f"window_size ({side}): expected below 2^31, got {value!r}")
    if causal:
        right = 0  # FlashAttention's: a causal window ends at the query
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not softcap >= 0.0:
        raise ValueError(f"softcap: expected a number >= 0 (0: none), got {softcap!r}")
    if softcap != softcap or softcap == float("inf"):
        raise ValueError(f"softcap: expected a finite number, got {softcap!r}")
    alibi = None if alibi_slopes is None else "bh" if len(alibi_slopes.shape) == 2 else "h"
    return causal, left, right, float(softcap), alibi


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


def program(causal: bool, left: int, right: int, softcap: float, alibi):
    """The attention program of FlashAttention's options: scaled score, softcap, ALiBi (FlashAttention's
    symmetric bias; alibi "h": slopes[h], "bh": slopes[b, h]), then the bottom-right aligned causal and window
    masks."""
    import sympy as sp

    from .ir import exprs, variants

    q, k, b, h = exprs.INDICES["q"], exprs.INDICES["k"], exprs.INDICES["b"], exprs.INDICES["h"]
    at = q + exprs.DIMS["N"] - exprs.DIMS["M"]  # query q's place among the keys: bottom-right
    keeps, scores, tags = [], [], ["kvcache"]
    if causal:
        keeps.append(variants.causal_mask("bottom_right"))
        tags.append("causal")
    if left >= 0:
        keeps.append(sp.Le(at - k, left))
        tags.append(f"left{left}")
    if right >= 0 and not causal:
        keeps.append(sp.Le(k - at, right))
        tags.append(f"right{right}")
    if softcap > 0.0:
        scores.append(variants.softcap_score(softcap))
        tags.append(f"softcap{softcap:g}".replace(".", "p").replace("+", ""))
    if alibi:
        slope = exprs.tensor("slopes")[b, h] if alibi == "bh" else exprs.tensor("slopes")[h]
        scores.append(exprs.SCORE - slope * sp.Abs(at - k))
        tags.append("alibi" if alibi == "h" else "alibi_bh")
    return variants.program(keeps, scores, tags)


def _kernel(q, dim, options):
    """The decode kernel for q's dtype and device and these options: compiled on first use, then memoized."""
    from .pipeline import compile as compile_kernel

    dtype = str(getattr(q, "dtype", "")).replace("torch.", "")
    lib = type(q).__module__.split(".")[0]
    device = q.device.index if lib == "torch" else q.device.id
    key = (lib, device, dim, dtype, options)
    kernel = _KERNELS.get(key)
    if kernel is None:
        with _LOCK:
            kernel = _KERNELS.get(key)
            if kernel is None:
                if isinstance(dim, bool) or not isinstance(dim, int):
                    raise ValueError(f"q: expected an int head dim, got {dim!r}")
                arch = None
                if lib == "torch" and getattr(q, "is_cuda", False):
                    import torch

                    major, minor = torch.cuda.get_device_capability(q.device)
                    arch = f"sm_{major}{minor}{'a' if (major, minor) == (9, 0) else ''}"
                kernel = compile_kernel(dim, ir=program(*options), dtype=dtype, arch=arch, decode=True)
                if len(_KERNELS) >= _MAX_KERNELS:
                    _KERNELS.clear()
                _KERNELS[key] = kernel
    return kernel
