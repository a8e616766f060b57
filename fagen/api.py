"""`fagen.attention`: attention as a function, compiled on first use and cached per spec.

    o = fagen.attention(q, k, v, causal=True)                          # q [B, H, M, D], k, v [B, Hkv, N, D]
    o = fagen.attention(q, k, v, softcap=30.0, alibi=slopes)           # slopes [H], float32
    o = fagen.attention(q, k, v, score_mod=lambda s, b, h, q, k, bias: s + bias[h], bias=bias)

The first call of a request (head dim, dtype, GPU arch, options: fagen.request.for_attention) compiles a
kernel (a hit in the disk cache in a later process) and keeps it in fagen.ops's memo; later calls look it up.
PyTorch tensors go through the `fagen::attention` op (fagen.runtime.autograd), so the call is differentiable
and `torch.compile(fullgraph=True)` traces it, forward and backward, with no graph break; CuPy arrays call the
kernel directly (forward only). The other front-ends (`fagen.flash_attn_func`, `fagen.flex_attention` ...) go
through the same memo.
"""

from __future__ import annotations

from . import ops
from .request import for_attention
from .runtime import arrays


def attention(
    q,
    k,
    v,
    *,
    causal=False,
    window=None,
    alibi=None,
    softcap=None,
    score_mod=None,
    mask=None,
    scale=None,
    deterministic=False,
    **tensors,
):
    """Attention of q [B, H, M, D] over k, v [B, Hkv, N, D] (any strides; GQA when Hkv divides H), returning
    o like q. The options are `fagen.compile`'s: causal (False, True / 'top_left', 'bottom_right'),
    window (LEFT or (LEFT, RIGHT)), softcap (C·tanh(s/C)), score_mod(s, b, h, q, k[, tensors...]) and
    mask(b, h, q, k) traced functions; `alibi`: the ALiBi slopes, a float32 vector of H, added as
    slopes[h]·(k - q) after the softcap (fagen.compile(alibi=True)'s form; `flash_attn_func` has
    FlashAttention's). `tensors`: the call-time tensors a score_mod/mask reads, by name (their dtypes part of
    the kernel); tensors the functions capture from their scope are read at each call. scale: default
    1/sqrt(D). deterministic: a reproducible backward (bitwise equal across runs).

    The kernel is compiled on the first call of a spec (head dim, dtype, GPU, options) and kept. PyTorch
    tensors: differentiable (o has a grad_fn when an input requires grad) and traceable by
    torch.compile(fullgraph=True); CuPy arrays: forward only."""
    if arrays.library(q) is None:
        raise TypeError(f"q: expected a PyTorch tensor or a CuPy array, got {type(q).__name__}")
    if len(q.shape) != 4:
        raise ValueError(f"q: expected 4 dimensions [B, H, M, D], got shape {tuple(q.shape)}")
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic: expected True or False, got {deterministic!r}")
    if alibi is not None:
        if "slopes" in tensors:
            raise TypeError("alibi, slopes: the ALiBi slopes are given by alibi=...; drop slopes=")
        tensors = {**tensors, "slopes": alibi}
    request = dict(
        dim=int(q.shape[3]),
        dtype=ops.dtype_of(q),
        device=ops.device_of(q),
        causal=causal,
        window=tuple(window) if isinstance(window, list) else window,
        alibi=alibi is not None,
        softcap=softcap,
        score_mod=score_mod,
        mask=mask,
        tensor_dtypes=ops.tensor_dtypes(tensors),  # the tensors' dtypes other than float32 are part of the kernel
    )
    return ops.run(
        for_attention, request, q, k, v, scale=scale, deterministic=deterministic, tensors=tensors, slopes="alibi"
    )


__all__ = ["attention"]
