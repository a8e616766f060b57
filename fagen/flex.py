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
- a BlockMask here holds the mask function, not a precomputed block table: the key tiles each query tile can
  see are derived from the mask at compile time and proven where it is affine in the indices (causal, sliding
  windows, prefix-LM, offsets: fully masked tiles are skipped and the mask is not evaluated on fully visible
  ones). A mask that is not affine (a document mask with //) is evaluated on every key tile in the hull of
  its affine parts; FlexAttention computes such masks' block sparsity at run time, fagen does not yet;
- mask_mod and score_mod read tensors as FlexAttention's do: captured from their closure or module
  (`doc_id[q_idx] == doc_id[kv_idx]`, `bias[h, q_idx - kv_idx + 4096]`), indexed by integer expressions of
  b, h, q_idx, kv_idx and constants, gathered in the kernel. The object a captured variable holds is read at
  each call (its dtype and rank are part of the kernel, its values and sizes are not). Each index is clamped
  to its dimension, so a read never leaves the tensor (FlexAttention checks neither: an index out of range
  there reads out of bounds); a tensor reached only through another function is refused, saying so;
- scaled_dot_product_attention's attn_mask (bool: True attends, or additive float) is read in the kernel
  as attn_mask[b, h, q_idx, kv_idx] through a broadcast view (stride 0, no copy); its block sparsity is not
  computed at run time yet (every key tile is visited);
- a row that sees no key gives 0 (and lse -inf) in both; PyTorch gives NaN there (SDPA with a fully masked
  row of attn_mask; FlexAttention's lse is -inf).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import api


@dataclass(frozen=True, eq=False)
class BlockMask:
    """What `create_block_mask` returns: the mask function and the sizes it was made for (B and H may be None:
    any). Pass it to `flex_attention(block_mask=...)`; it is reused across calls and layers like
    FlexAttention's, and its program is compiled once per spec."""

    mask_mod: Any
    B: int | None
    H: int | None
    Q_LEN: int
    KV_LEN: int
    BLOCK_SIZE: tuple[int, int] = (128, 128)

    @property
    def shape(self) -> tuple:
        return (self.B, self.H, self.Q_LEN, self.KV_LEN)

    def __repr__(self):
        name = getattr(self.mask_mod, "__name__", type(self.mask_mod).__name__)
        return f"BlockMask(mask_mod={name}, shape={self.shape})"


def _size(name, value, allow_none=False):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected a positive int{' or None' if allow_none else ''}, got {value!r}")
    return value


def create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device="cuda", BLOCK_SIZE=128, _compile=False) -> BlockMask:
    """FlexAttention's create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN): mask_mod(b, h, q_idx, kv_idx) -> bool.
    The function is traced here (a construct fagen cannot compile is refused now, naming it); `device` and
    `_compile` are accepted for compatibility and not used (nothing is computed on the device)."""
    from .ir import variants

    variants.trace_mask(mask_mod)  # refuse early, with the reason
    bs = (BLOCK_SIZE, BLOCK_SIZE) if isinstance(BLOCK_SIZE, int) else tuple(BLOCK_SIZE)
    return BlockMask(
        mask_mod,
        _size("B", B, True),
        _size("H", H, True),
        _size("Q_LEN", Q_LEN),
        _size("KV_LEN", KV_LEN),
        bs,
    )


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
    return _run(query, key, value, scale, score_mod, mask, ("options", False, None, False, None), return_lse)


# SDPA's attn_mask as the kernel reads it: a parameter of the traced functions, read at [b, h, q_idx, kv_idx]
def _sdpa_bool_mask(b, h, q_idx, kv_idx, attn_mask):
    return attn_mask[b, h, q_idx, kv_idx]  # a bool tensor read as a condition: True attends


def _sdpa_additive_mask(score, b, h, q_idx, kv_idx, attn_mask):
    return score + attn_mask[b, h, q_idx, kv_idx]


def _broadcast_mask(attn_mask, B, H, L, S):
    """attn_mask as a [B, H, L, S] view (stride 0 along broadcast dimensions: no copy), PyTorch's broadcasting."""
    shape = tuple(getattr(attn_mask, "shape", ()))
    if not hasattr(attn_mask, "dtype") or not 1 <= len(shape) <= 4:
        raise TypeError(f"attn_mask: expected a tensor broadcastable to [B, H, L, S] = {[B, H, L, S]}, got {shape}")
    want = (B, H, L, S)[4 - len(shape) :]
    if any(n not in (1, w) for n, w in zip(shape, want)):
        raise ValueError(f"attn_mask: shape {list(shape)} does not broadcast to [B, H, L, S] = {[B, H, L, S]}")
    view = attn_mask.reshape((1,) * (4 - len(shape)) + shape)
    if api._is_torch(view):
        return view.expand(B, H, L, S)
    import cupy

    return cupy.broadcast_to(view, (B, H, L, S))


def scaled_dot_product_attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """torch.nn.functional.scaled_dot_product_attention's signature and semantics: is_causal aligned top-left
    (query i sees keys j <= i), scale default 1/sqrt(E), enable_gqa for Hq != Hkv. attn_mask: a bool tensor
    (True: the query attends the key) or a float one added to the scaled scores, broadcastable to [B, H, L, S]
    and read in the kernel through a broadcast view (no copy); its dtype is part of the kernel. A row that sees
    no key (every attn_mask entry False, or -inf) gives 0 here, where PyTorch gives NaN. Not yet: dropout_p > 0,
    which is refused."""
    if dropout_p:
        raise NotImplementedError(f"dropout_p: fagen has no dropout yet, got {dropout_p!r}")
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal: expected True or False, got {is_causal!r}")
    _check_heads(query, key, value, enable_gqa)
    if attn_mask is None:
        return _run(query, key, value, scale, None, None, ("options", is_causal, None, False, None), False)
    if is_causal:
        raise ValueError("attn_mask, is_causal: pass one of them (PyTorch refuses both too)")
    B, H, L, _ = query.shape
    mask = _broadcast_mask(attn_mask, B, H, L, key.shape[2])
    is_bool = str(mask.dtype).replace("torch.", "") == "bool"
    fns = (None, _sdpa_bool_mask) if is_bool else (_sdpa_additive_mask, None)
    dtypes = api._tensor_dtypes({"attn_mask": mask})
    program = ("options", False, None, False, None) + ((dtypes,) if dtypes else ())
    return _run(query, key, value, scale, *fns, program, False, tensors={"attn_mask": mask})


def _run(q, k, v, scale, score_mod, mask, program, return_lse, tensors=None):
    from .runtime import arrays

    if arrays.library(q) is None:
        raise TypeError(f"query: expected a PyTorch tensor or a CuPy array, got {type(q).__name__}")
    request = (int(q.shape[3]), api._dtype(q), api._device(q), program)
    tensors = dict(tensors or {})
    if not return_lse:
        return api.run(request, q, k, v, scale=scale, deterministic=False, tensors=tensors, fns=(score_mod, mask))
    if api._is_torch(q):
        autograd = api._torch_side()
        key = autograd.constant_key(*request, score_mod, mask)
        tensors = api.with_captured(key, tensors, (score_mod, mask))
        values = api._ordered(autograd.constant_names(key), tensors)
        o, lse = autograd.attention_with_lse(q, k, v, key, scale, False, values)
        return o, lse
    key = api.kernel_key(*request, score_mod, mask)
    kernel = api.kernel_of(key)
    tensors = api.with_captured(key, tensors, (score_mod, mask))
    api._ordered(tuple(kernel.tensors), tensors)
    return kernel(q, k, v, scale=scale, return_lse=True, **tensors)


__all__ = ["BlockMask", "create_block_mask", "flex_attention", "scaled_dot_product_attention"]
