"""fagen as an attention implementation of Hugging Face transformers.

    import fagen.hf
    fagen.hf.register()  # adds "fagen" to transformers' AttentionInterface and AttentionMaskInterface
    model = LlamaForCausalLM(config)  # config._attn_implementation = "fagen", or attn_implementation="fagen"
                                      # in from_pretrained / from_config, or model.set_attn_implementation("fagen")

transformers hands the attention function q [B, H, M, D] and k, v [B, Hkv, N, D] (views); fagen takes them as
they are, through `fagen.flash_attn_func` / `fagen.flash_attn_varlen_func`, with FlashAttention's semantics, as
transformers' own flash_attention_2 integration does:
- causal attention from the layer's `is_causal` (bottom-right aligned, so a KV cache longer than the queries
  is right: query i sees keys j <= i + N - M); GQA/MQA with no copy of K/V; `scaling`, `softcap`; a causal
  `sliding_window` w as FlashAttention's window (w - 1 keys back, j > i - w, which is transformers' mask);
- packed documents (padding-free batches: several documents concatenated in a row, position_ids restarting
  at each one, as transformers' DataCollatorWithFlattening gives) run as varlen over cu_seqlens
  (block-diagonal causal): a document starts where position_ids does not follow the previous token's by one,
  which is how transformers' masks find them (masking_utils.find_packed_sequence_indices). Or pass
  cu_seq_lens_q/k and max_length_q/k to the model (FlashAttention's kwargs), which are used as they are.
  fagen takes the documents transformers' own mask found (it looks for them without a cache and without a 2-D
  attention_mask, use_cache=False, as for "sdpa" and "eager"): the mask interface reads them from the mask
  function, right after transformers' own synchronization, and hands them to the layers in place of a mask
  tensor (`Documents`), so the layers read nothing on the host. An attention call that did not come through the
  mask interface derives them from position_ids instead (a synchronization, kept for the position_ids tensor
  the layers share) whenever the queries and the keys are the same tokens (M == N), as flash_attention_2 does.

What fagen cannot express is refused with NotImplementedError, never computed wrongly and never sent
elsewhere silently: a padding mask (a 2-D attention_mask with zeros: pack the documents instead, or use
attn_implementation="sdpa"), a 4-D attention_mask or BlockMask given to the model, mask functions a model adds
(or_mask_function/and_mask_function, block_sequence_ids, chunked attention: the mask function must be built
from causal, bidirectional, sliding-window and packed-document parts only), a non-causal sliding window
(transformers' mask |i - j| <= w and FlashAttention's window |i - j| < w disagree), attention dropout in
training (dropout > 0), attention sinks (s_aux) and position biases. Rows that see no key give 0.

transformers stays optional (`pip install fagen[hf]`): this module imports it only in `register`.
"""

from __future__ import annotations

NAME = "fagen"

# The parts of transformers.masking_utils a mask function may be built from (qualnames, across 5.x): causal,
# bidirectional, causal sliding window, packed documents (and the `and` that combines them).
_MASK_PARTS = frozenset(
    {
        "causal_mask_function",
        "bidirectional_mask_function",
        "and_masks.<locals>.and_mask",
        "sliding_window_overlay.<locals>.inner_mask",
        "packed_sequence_mask_function.<locals>.inner_mask",
        "remap_positions_for_packed_sequence.<locals>.inner_mask",
    }
)
_ALLOWED = frozenset(f"transformers.masking_utils.{part}" for part in _MASK_PARTS)


def register(name: str = NAME) -> str:
    """Register fagen's attention (and its mask function) with transformers under `name` (default "fagen");
    returns the name. Call it once before building or loading a model with attn_implementation=name."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"name: expected a non-empty string, got {name!r}")
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as e:
        raise ImportError(f"fagen.hf.register needs Hugging Face transformers (pip install fagen[hf]): {e}") from e
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, attention_mask)
    return name


# --- the mask function: what create_causal_mask & co. call for this implementation ---------------------------
def _functions(fn) -> list:
    """fn and, through its closure (and_masks keeps a tuple of functions), every function it calls."""
    seen, out, todo = set(), [], [fn]
    while todo:
        f = todo.pop()
        if id(f) in seen:
            continue
        seen.add(id(f))
        out.append(f)
        for cell in getattr(f, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            values = value if isinstance(value, (tuple, list)) else (value,)
            todo.extend(v for v in values if callable(v) and not hasattr(v, "shape"))
    return out


def _name(f) -> str:
    return f"{getattr(f, '__module__', '?')}.{getattr(f, '__qualname__', type(f).__name__)}"


def mask_parts(fn) -> list[str]:
    """The functions a transformers mask function is built from, as 'module.qualname'."""
    return [_name(f) for f in _functions(fn)]


_PACKED_PART = "transformers.masking_utils.packed_sequence_mask_function.<locals>.inner_mask"


def _packed_part(mask_function):
    """transformers' packed-document part of a mask function, or None where it has none (transformers found one
    document a row, or did not look: a cache or a 2-D attention_mask)."""
    parts = _functions(mask_function) if mask_function is not None else ()
    return next((f for f in parts if _name(f) == _PACKED_PART), None)


def packed_sequence_ids(mask_function):
    """The [B, M] document index of each token that the packed-document part of a mask function compares
    (find_packed_sequence_indices' result), or None where there is no such part or it keeps them elsewhere."""
    part = _packed_part(mask_function)
    cells = dict(zip(part.__code__.co_freevars, part.__closure__ or ())) if part is not None else {}
    return cells["packed_sequence_mask"].cell_contents if "packed_sequence_mask" in cells else None


class Documents:
    """What fagen's mask interface returns to the layers in place of a mask tensor: the packed documents of the
    model's mask, as FlashAttention's varlen arguments over the rows flattened (cu_seqlens int32 [docs + 1] and
    the longest document), or `cu_seqlens=None` for one document a row. The attention takes them as they are."""

    __slots__ = ("cu_seqlens", "longest", "shape")

    def __init__(self, cu_seqlens=None, longest: int = 0, shape: tuple = ()):
        self.cu_seqlens, self.longest, self.shape = cu_seqlens, longest, shape

    def __repr__(self) -> str:
        docs = "one a row" if self.cu_seqlens is None else f"{self.cu_seqlens.numel() - 1}"
        return f"fagen.hf.Documents({docs}, rows x tokens {self.shape})"


def check_mask_function(mask_function) -> None:
    """Refuse a mask function built from parts other than causal, bidirectional, causal sliding window and
    packed documents (what fagen reads from is_causal, sliding_window and position_ids)."""
    if mask_function is None:
        return
    refused = [part for part in mask_parts(mask_function) if part not in _ALLOWED]
    if refused:
        raise NotImplementedError(
            f"mask_function: this model's attention mask uses {', '.join(refused)}, which fagen's transformers "
            "integration does not express (it reads causal, causal sliding-window and packed-document masks from "
            "is_causal, sliding_window and position_ids); use attn_implementation='sdpa' for this model"
        )


def attention_mask(
    batch_size=None,
    q_length=None,
    kv_length=None,
    q_offset=0,
    kv_offset=0,
    mask_function=None,
    attention_mask=None,
    use_vmap=False,
    **kwargs,
):
    """transformers' mask interface for fagen: checks the mask function, and returns None (no tensor mask:
    causality, windows and documents are the kernel's) or the 2-D attention_mask where it holds padding, which
    the attention refuses. Like flash_attention_2's mask function, it builds no [B, 1, M, N] tensor: it returns
    the packed documents the mask function holds (`Documents`), found here once for all the layers."""
    check_mask_function(mask_function)
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            return attention_mask
        attention_mask = attention_mask[:, -kv_length:] if kv_length else attention_mask
        if not ((kv_length is None or attention_mask.shape[1] == kv_length) and bool(attention_mask.all())):
            return attention_mask
    if _packed_part(mask_function) is None:
        return Documents()
    ids = packed_sequence_ids(mask_function)
    if ids is None:  # a packed-document part that keeps its ids elsewhere: the layers find them in position_ids
        return None
    import torch

    starts = torch.ones(ids.shape, dtype=torch.bool, device=ids.device)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    found = _cu_seqlens_from_starts(starts)
    return Documents(*found, shape=tuple(ids.shape)) if found else Documents(shape=tuple(ids.shape))


# --- the attention --------------------------------------------------------------------------------------------
_REFUSED_KWARGS = {
    "s_aux": "attention sinks (s_aux)",
    "sinks": "attention sinks",
    "position_bias": "a position bias tensor (position_bias)",
}

_documents_memo: list = []  # [(position_ids, its _version, B, M, result)]: the last one, which the layers share


def _refuse_mask(mask, kv_length: int) -> None:
    shape = list(getattr(mask, "shape", ()))
    if len(shape) == 2:
        if shape[1] == kv_length and bool(mask.all()):
            return
        raise NotImplementedError(
            f"attention_mask: a padding mask (shape {shape}, with padded positions) is not supported by fagen's "
            "transformers integration; pack the sequences without padding (position_ids restarting per document, "
            "e.g. DataCollatorWithFlattening) or use attn_implementation='sdpa'"
        )
    raise NotImplementedError(
        f"attention_mask: a {len(shape)}-D mask ({type(mask).__name__}, shape {shape}) is not supported by fagen's "
        "transformers integration (it takes causal, sliding-window and packed-document masks only); "
        "use attn_implementation='sdpa' for custom masks"
    )


def _cu_seqlens_from_positions(position_ids, B: int, M: int):
    """(cu_seqlens int32 [docs + 1], max length) of the documents in position_ids [B or 1, M] flattened row by
    row, or None when each row is one document. A document starts at each row's first token and wherever the
    position does not follow the previous one by one (transformers' find_packed_sequence_indices)."""
    import torch

    if position_ids.dim() != 2 or position_ids.shape[1] != M or position_ids.shape[0] not in (1, B):
        raise ValueError(
            f"position_ids: expected shape [{B}, {M}] (or [1, {M}]) to find packed documents, got "
            f"{list(position_ids.shape)}"
        )
    memo = _documents_memo[0] if _documents_memo else None
    if memo is not None and memo[0] is position_ids and memo[1:4] == (position_ids._version, B, M):
        return memo[4]
    pos = position_ids.expand(B, M)
    starts = torch.ones(B, M, dtype=torch.bool, device=pos.device)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    result = _cu_seqlens_from_starts(starts)
    _documents_memo[:] = [(position_ids, position_ids._version, B, M, result)]
    return result


def _cu_seqlens_from_starts(starts):
    """(cu_seqlens int32 [docs + 1], longest) of the rows of `starts` [B, M] (True where a document begins, at
    least at each row's first token) flattened, or None when each row is one document."""
    import torch

    B, M = starts.shape
    begin = starts.reshape(-1).nonzero().reshape(-1)  # one synchronization
    if begin.numel() == B:
        return None
    end = torch.tensor([B * M], device=starts.device, dtype=begin.dtype)
    cu = torch.cat([begin, end]).to(torch.int32)
    return cu, int(cu.diff().max())


def _documents(kwargs: dict, B: int, M: int, N: int, mask=None):
    """(cu_q, cu_k, max_q, max_k) when the rows hold packed documents, else None: FlashAttention's kwargs where
    the model passes them, else the documents of fagen's mask interface (`mask`), else position_ids'."""
    given = [kwargs.get(n) for n in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")]
    if all(x is not None for x in given):
        import torch

        cu_q, cu_k, max_q, max_k = given
        assert cu_q is not None and cu_k is not None and max_q is not None and max_k is not None
        return cu_q.to(torch.int32), cu_k.to(torch.int32), int(max_q), int(max_k)
    if isinstance(mask, Documents):
        if mask.cu_seqlens is None:
            return None
        if mask.shape != (B, M) or M != N:
            raise ValueError(
                f"attention_mask: the mask's packed documents cover rows x tokens {mask.shape}, but this layer "
                f"attends {B} x {M} queries to {N} keys"
            )
        return mask.cu_seqlens, mask.cu_seqlens, mask.longest, mask.longest
    position_ids = kwargs.get("position_ids")
    if position_ids is None or M != N or M == 1:
        return None
    found = _cu_seqlens_from_positions(position_ids, B, M)
    if found is None:
        return None
    cu, longest = found
    return cu, cu, longest, longest


def attention_forward(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
):
    """transformers' attention interface: query [B, H, M, D], key, value [B, Hkv, N, D] -> (out [B, M, H, D],
    None). Module docstring for what it runs and what it refuses."""
    from .flash_attn import flash_attn_func, flash_attn_varlen_func

    for name, what in _REFUSED_KWARGS.items():
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"{name}: {what} is not supported by fagen's transformers integration")
    if dropout:
        raise NotImplementedError(
            f"dropout: fagen has no attention dropout (the model asks for {dropout} in training); set the config's "
            "attention_dropout to 0.0"
        )
    B, H, M, D = query.shape
    Hkv, N = key.shape[1], key.shape[2]
    if attention_mask is not None and not isinstance(attention_mask, Documents):
        _refuse_mask(attention_mask, N)
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    window = (-1, -1)
    if sliding_window is not None and sliding_window < N:
        if not causal:
            raise NotImplementedError(
                f"sliding_window: a non-causal sliding window ({sliding_window}) is not supported: transformers' "
                "mask keeps |i - j| <= w, FlashAttention's window |i - j| < w"
            )
        window = (int(sliding_window) - 1, 0)
    options = dict(softmax_scale=scaling, causal=causal, window_size=window, softcap=float(softcap or 0.0))
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))  # [B, S, H, D] views, no copies
    docs = _documents(kwargs, B, M, N, attention_mask)
    if docs is None:
        return flash_attn_func(q, k, v, **options), None
    out = flash_attn_varlen_func(q.reshape(-1, H, D), k.reshape(-1, Hkv, D), v.reshape(-1, Hkv, D), *docs, **options)
    return out.view(B, M, H, D), None


__all__ = [
    "NAME",
    "Documents",
    "register",
    "attention_forward",
    "attention_mask",
    "check_mask_function",
    "mask_parts",
    "packed_sequence_ids",
]
