"""flash_attn.layers.rotary.apply_rotary_emb, written in plain PyTorch for FlashAttention's tests."""

import torch


def _positions(x, seqlen_offsets, cu_seqlens):
    """The position of each token: [B, S] (offset_b + s), or [total] with cu_seqlens (offset_b + r - cu[b])."""
    device = x.device
    if cu_seqlens is None:
        batch, seqlen = x.shape[0], x.shape[1]
        offsets = torch.as_tensor(seqlen_offsets, device=device).long().reshape(-1)
        return offsets.expand(batch)[:, None] + torch.arange(seqlen, device=device)[None, :]
    rows = torch.arange(x.shape[0], device=device)
    starts = cu_seqlens.long()
    seq = (torch.searchsorted(starts[1:].contiguous(), rows, right=True)).clamp(max=starts.shape[0] - 2)
    offsets = torch.as_tensor(seqlen_offsets, device=device).long().reshape(-1).expand(starts.shape[0] - 1)
    return offsets[seq] + rows - starts[seq]


def apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None, max_seqlen=None):
    """x [B, S, H, D] (or [total, H, D] with cu_seqlens [B + 1]) with its first rotary_dim = 2·cos.shape[1] dims
    rotated: the token at position p (offset_b + its index in its sequence; seqlen_offsets an int or [B]) takes
    angles cos[p], sin[p] (cos, sin [seqlen_ro, rotary_dim / 2]; no rotation past seqlen_ro), the pair (x1, x2) ->
    (x1·cos - x2·sin, x1·sin + x2·cos), pairs (2i, 2i + 1) if `interleaved` else (i, i + rotary_dim / 2).
    Computed in float32, rounded to x's dtype; the other dims are kept. `inplace` writes into x and returns it."""
    half = cos.shape[-1]
    rotary_dim = 2 * half
    if rotary_dim > x.shape[-1]:
        raise ValueError(f"cos: rotary_dim {rotary_dim} is larger than the head dim {x.shape[-1]}")
    pos = _positions(x, seqlen_offsets, cu_seqlens)
    inside = pos < cos.shape[0]
    pos = pos.clamp(0, cos.shape[0] - 1)
    c = torch.where(inside[..., None], cos[pos].float(), 1.0).unsqueeze(-2)  # [..., 1, half]: every head alike
    s = torch.where(inside[..., None], sin[pos].float(), 0.0).unsqueeze(-2)
    part = x[..., :rotary_dim].float()
    if interleaved:
        x1, x2 = part[..., 0::2], part[..., 1::2]
    else:
        x1, x2 = part[..., :half], part[..., half:]
    r1, r2 = x1 * c - x2 * s, x1 * s + x2 * c
    turned = torch.stack((r1, r2), -1).flatten(-2) if interleaved else torch.cat((r1, r2), -1)
    turned = turned.to(x.dtype)
    if inplace:
        x[..., :rotary_dim] = turned
        return x
    return torch.cat((turned, x[..., rotary_dim:]), -1)
