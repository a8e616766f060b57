"""Document masks (`fagen bench --variant document`): packed sequences in FlexAttention's mask_mod form, documents of
`size` tokens, causal inside; `--variant document_offsets` writes the same mask from offsets, as FlexAttention users
do (`kv_idx >= offsets[doc[q_idx]]`: a gather of a gather, over captured int32 tensors).

The block-sparse forward (fagen.flex_attention's path: create_block_mask's tables at the kernel's tiles) against
compiled FlexAttention with the same mask_mod and torch's create_block_mask, the dense fagen kernel (the mask
evaluated on every key tile of its proven range) beside them; and block-mask construction, fagen.create_block_mask
against torch's (eager and _compile=True), each a whole call with a synchronize. Outputs are checked against float64
on a slice of rows first.
"""

from __future__ import annotations

import math
import sys

from .. import testing
from . import timing
from .check import check_slice

DOCUMENT_SIZES = (1000,)  # not tile-aligned: partial tiles on every document boundary


def document_mask(size: int, causal: bool, form: str = "divide", n: int = 0, device: str = "cuda"):
    """mask_mod of documents of `size` tokens (causal inside them, or not): form "divide" compares q // size and
    k // size; form "offsets" reads the document's first key from captured tensors on the GPU, offsets[doc[q]] (doc:
    [n] int32 document ids, offsets: their first tokens and n, int32, on `device`), and without `causal` its end,
    offsets[doc[q] + 1]."""
    if form == "offsets":
        torch = testing._torch()
        doc = torch.arange(n, dtype=torch.int32, device=device) // size
        offsets = torch.arange(0, n + size, size, dtype=torch.int32, device=device).clamp(max=n)

        def document_offsets(b, h, q_idx, kv_idx):
            start = offsets[doc[q_idx]]
            if causal:
                return (kv_idx >= start) & (kv_idx <= q_idx)
            return (kv_idx >= start) & (kv_idx < offsets[doc[q_idx] + 1])

        return document_offsets
    if form != "divide":
        raise ValueError(f"form: expected 'divide' or 'offsets', got {form!r}")

    def document(b, h, q_idx, kv_idx):
        same = q_idx // size == kv_idx // size
        return same & (q_idx >= kv_idx) if causal else same

    return document


def _construction_ms(torch, mask_mod, N: int, tiles) -> dict:
    """A whole create_block_mask call (the tables on the GPU, synchronized): fagen's, torch's, torch's compiled."""
    from torch.nn.attention.flex_attention import create_block_mask

    import fagen

    sync = torch.cuda.synchronize
    out: dict = {
        "build_fagen_ms": 1e3
        * timing.median_seconds(lambda: fagen.create_block_mask(mask_mod, None, None, N, N, BLOCK_SIZE=tiles), sync),
        "build_torch_ms": 1e3
        * timing.median_seconds(lambda: create_block_mask(mask_mod, None, None, N, N, device="cuda"), sync),
    }
    try:
        out["build_torch_compiled_ms"] = 1e3 * timing.median_seconds(
            lambda: create_block_mask(mask_mod, None, None, N, N, device="cuda", _compile=True), sync
        )
    except Exception as e:  # reported, not fatal
        out["build_torch_compiled_ms"] = f"{type(e).__name__}: {str(e)[:80]}"
    return out


def document_row(torch, flex, mask_mod, sparse, dense, N: int, dim: int, dtype: str, row: dict) -> dict:
    """One length's figures: each forward checked then timed, the speed ratios, and block-mask construction."""
    from torch.nn.attention.flex_attention import create_block_mask

    import fagen

    bench = timing.timer(torch)
    tiles = (sparse.spec.block_m, sparse.spec.block_n)
    B, H = row["batch"], row["heads"]
    q, k, v = testing.random_qkv(B, H, N, N, dim, dtype)
    bm = fagen.create_block_mask(mask_mod, None, None, N, N, BLOCK_SIZE=tiles)
    tbm = create_block_mask(mask_mod, None, None, N, N, device="cuda")
    row["visited_tiles"] = int(bm.tiles(*tiles).kv_count.sum())
    row["dense_tiles"] = None
    fns = {
        "fagen": lambda: sparse(q, k, v, block_mask=bm),
        "fagen_dense": lambda: dense(q, k, v),
        "flex": lambda: flex(q, k, v, block_mask=tbm),
    }
    captured = sparse.with_captured({})  # the tensors an offsets mask reads, for the float64 check
    for name, fn in fns.items():
        o = fn()
        torch.cuda.synchronize()
        err, bound = check_slice(o, q, k, v, sparse, captured, 1 / math.sqrt(dim), dtype)
        row[f"{name}_err"], row[f"{name}_ok"] = err, err <= bound
        row[f"{name}_ms"] = bench(fn) if err <= bound else math.nan
    row["fagen_vs_flex"] = row["flex_ms"] / row["fagen_ms"]
    row["fagen_vs_dense"] = row["fagen_dense_ms"] / row["fagen_ms"]
    return {**row, **_construction_ms(torch, mask_mod, N, tiles)}


def run_document(
    seqlens=(4096, 16384),
    dim=128,
    dtype="bf16",
    sizes=DOCUMENT_SIZES,
    causal=(True, False),
    tokens=16384,
    hidden=2048,
    forms=("divide",),
) -> list[dict]:
    """Rows of figures for each mask form (document_mask), document size, mask and length (module docstring)."""
    from torch.nn.attention.flex_attention import flex_attention

    import fagen

    torch = testing._torch()
    flex = torch.compile(flex_attention, dynamic=False)
    rows = []
    for form in forms:
        for size in sizes:
            for c in causal:
                for N in seqlens:
                    mask_mod = document_mask(size, c, form, N)  # an offsets mask's tensors are N long
                    sparse = fagen.compile(dim, dtype=dtype, mask=mask_mod, block_sparse=True)  # compiled once a form
                    dense = fagen.compile(dim, dtype=dtype, mask=mask_mod)
                    B, H = max(1, tokens // N), max(1, hidden // dim)
                    tiles = (sparse.spec.block_m, sparse.spec.block_n)
                    row = dict(form=form, size=size, causal=c, seqlen=N, batch=B, heads=H, kernel=sparse.name)
                    row["tiles"] = tiles
                    rows.append(document_row(torch, flex, mask_mod, sparse, dense, N, dim, dtype, row))
                    print(document_line(rows[-1]), file=sys.stderr, flush=True)
    return rows


def document_line(r: dict) -> str:
    compiled = r["build_torch_compiled_ms"]
    compiled = f"{compiled:.3f}" if isinstance(compiled, float) else compiled
    return (
        f"doc {r.get('form', 'divide'):7s} {r['size']:5d} {'causal' if r['causal'] else 'full  '} N={r['seqlen']:6d} "
        f"B={r['batch']} "
        f"H={r['heads']} tiles {r['tiles'][0]}x{r['tiles'][1]} visited {r['visited_tiles']}: "
        f"fagen {r['fagen_ms']:.3f} ms, fagen dense {r['fagen_dense_ms']:.3f} ms, flex {r['flex_ms']:.3f} ms "
        f"-> fagen/flex {r['fagen_vs_flex']:.2f}x, sparse/dense {r['fagen_vs_dense']:.2f}x; block mask: fagen "
        f"{r['build_fagen_ms']:.3f} ms, torch {r['build_torch_ms']:.3f} ms, torch _compile {compiled} ms "
        f"(checks: {r['fagen_ok']}, {r['fagen_dense_ok']}, {r['flex_ok']})"
    )
