"""flash_attn.bert_padding's pad_input and unpad_input, written in plain PyTorch for FlashAttention's tests (the
semantics of FlashAttention's, which the tests rely on: row-major token order, int32 offsets, a Python int
maximum; differentiable both ways)."""

import torch


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """hidden_states [B, S, ...] and a [B, S] mask (bool or 0/1; unused_mask: tokens kept though unused) ->
    (the kept tokens [total, ...] in row-major order, their flat indices b·S + s [total], cu_seqlens [B + 1] int32,
    the longest sequence as an int, the tokens of attention_mask alone per sequence [B] int32)."""
    used = attention_mask.bool()
    kept = used if unused_mask is None else used | unused_mask.bool()
    lengths = kept.sum(-1, dtype=torch.int32)
    cu_seqlens = torch.zeros(lengths.shape[0] + 1, dtype=torch.int32, device=lengths.device)
    cu_seqlens[1:] = torch.cumsum(lengths, 0)
    indices = torch.nonzero(kept.reshape(-1)).reshape(-1)
    rows = hidden_states.reshape(-1, *hidden_states.shape[2:])[indices]
    return rows, indices, cu_seqlens, int(lengths.max().item()), used.sum(-1, dtype=torch.int32)


def pad_input(hidden_states, indices, batch, seqlen):
    """The inverse of unpad_input: rows [total, ...] put back at their flat indices of a zero [batch, seqlen, ...]."""
    flat = hidden_states.new_zeros(batch * seqlen, *hidden_states.shape[1:])
    return flat.index_put((indices,), hidden_states).reshape(batch, seqlen, *hidden_states.shape[1:])
