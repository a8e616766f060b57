"""Outputs checked before they are timed: FlashAttention's rule against float64 on a slice of rows (all keys, the
first heads), the semantics (mask, score) those of the fagen kernel's program."""

from __future__ import annotations

from .. import testing
from .cases import Case, cu_seqlens


def check_slice(o, q, k, v, kernel, tensors, scale, dtype, rows=256, heads=2) -> tuple[float, float]:
    """(max error, bound) of `o` ([B, H, M, D]) on rows spread over the sequence of batch 0 and the first `heads`
    query heads; k and v may have fewer heads (GQA: query head h reads head h // (H / Hkv))."""
    torch = testing._torch()
    N = q.shape[2]
    H, group = q.shape[1], q.shape[1] // k.shape[1]
    idx = torch.linspace(0, N - 1, min(rows, N), device=q.device).round().long().unique()
    kv_heads = -(-heads // group)  # the KV heads those query heads read (the reference repeats them)
    qs, ks, vs = q[:1, :heads, idx], k[:1, :kv_heads], v[:1, :kv_heads]
    rows_np = idx.cpu().numpy()
    keep = testing.keep_matrix(kernel, 1, H, N, N, tensors, rows=rows_np)[:, :heads]
    score = testing.score_function(
        kernel, 1, heads, N, N, {n: t[:heads] if t.shape[0] == H else t for n, t in tensors.items()}, rows=rows_np
    )
    ref, _ = testing.reference(qs, ks, vs, keep, scale, score=score)
    naive, _ = testing.reference(qs, ks, vs, keep, scale, dtype=q.dtype, score=score)
    err = float((o[:1, :heads, idx].double() - ref).abs().max())
    err_naive = float((naive.double() - ref).abs().nan_to_num(0.0).max())
    return err, 2 * err_naive + testing.FLOOR[dtype]


def check_case(o, q, k, v, case: Case, kernel, tensors, scale) -> tuple[float, float]:
    """check_slice on a case's output in its own layout; packed documents each on their own, the worst kept."""
    if not case.documents:
        return check_slice(o, q, k, v, kernel, tensors, scale, case.dtype)
    offsets = cu_seqlens(case.documents)

    def seq(x, start: int, end: int):
        return x[start:end].transpose(0, 1)[None]  # a document as [1, H, L, D]

    results = [
        check_slice(seq(o, s, e), seq(q, s, e), seq(k, s, e), seq(v, s, e), kernel, tensors, scale, case.dtype)
        for s, e in zip(offsets, offsets[1:])
    ]
    return max(results, key=lambda r: r[0] - r[1])  # the document nearest its bound, or furthest past it
