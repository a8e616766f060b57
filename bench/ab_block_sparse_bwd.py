"""A/B of the block-sparse backward (contract.Kind.BWD_SPARSE: per key tile, the query tiles of the block mask's
transposed table) against the dense backward (every tile of the proven ranges, the mask evaluated there), and
against PyTorch's compiled FlexAttention where it is importable, on one GPU, in one process. bf16, d128, 16k tokens
(one sequence, 16 heads: H·D = 2048), two masks: causal documents of 1000 tokens, and a causal sliding window
(left 256). Each figure is the median over rotated rounds of triton's do_bench (L2 flushed between runs), in µs.

    fagen sparse       the block-sparse forward and backward (kernel(..., block_mask=bm); kernel.backward(...,
                       block_mask=bm)): what fagen.flex_attention runs for inputs that require grad
    fagen dense bwd    the same forward, the dense backward (kernel.backward without the block mask)
    fagen dense        the dense kernel's forward and backward (what flex_attention ran for inputs that require grad
                       before the block-sparse backward)
    fagen flex         fagen.flex_attention through autograd (torch.autograd.grad)
    torch flex         torch.nn.attention.flex_attention compiled, through autograd
    bwd alone          the backward alone, block-sparse and dense
    table              what a new BlockMask costs the backward once: its table at the backward's tiles, derived
                       from the forward's where the tiles nest (else the block-mask kernel), and the transposition
                       (kept per stream for later calls and layers); "by the kernel": the block-mask kernel's
                       evaluating the mask again at the backward's tiles, as a mask with no forward's tables does

    python3 bench/ab_block_sparse_bwd.py               # both masks, 16k
    python3 bench/ab_block_sparse_bwd.py 8192 64       # another length and head dim"""

from __future__ import annotations

import statistics
import sys

import torch
from triton.testing import do_bench

import fagen
from fagen.runtime.block_mask import BlockTiles

DOC = 1000
WINDOW = 256


def documents(b, h, q_idx, kv_idx):
    return (q_idx // DOC == kv_idx // DOC) & (q_idx >= kv_idx)


def sliding_window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= WINDOW)


def median_us(fn) -> float:
    try:
        ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
    except TypeError:  # an older triton: no return_mode
        ms = do_bench(fn, warmup=25, rep=100)
    return 1000 * float(ms)


def fagen_runs(mask, q, k, v, do, N: int) -> dict:
    """The fagen variants (see the module's notes), each a function of no arguments."""
    D = q.shape[-1]
    sparse = fagen.compile(D, mask=mask, dtype="bf16", block_sparse=True)
    dense = fagen.compile(D, mask=mask, dtype="bf16")
    bm = fagen.create_block_mask(mask, None, None, N, N)
    main = sparse.backward_plan.main_sparse
    print(f"  kernels: {sparse.name}; backward {main.spec.name if main else 'none block-sparse (dense)'}")

    def sparse_both():
        o, lse = sparse(q, k, v, block_mask=bm, return_lse=True)
        sparse.backward(q, k, v, o, lse, do, block_mask=bm)

    def sparse_fwd_dense_bwd():
        o, lse = sparse(q, k, v, block_mask=bm, return_lse=True)
        sparse.backward(q, k, v, o, lse, do)

    def dense_both():
        o, lse = dense(q, k, v, return_lse=True)
        dense.backward(q, k, v, o, lse, do)

    o, lse = sparse(q, k, v, block_mask=bm, return_lse=True)
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))

    def flex():
        out = fagen.flex_attention(qg, kg, vg, block_mask=bm)
        torch.autograd.grad(out, (qg, kg, vg), do)

    spec = main.spec if main else sparse.backward_plan.main.spec

    # what a new BlockMask holds after its first forward: its tables at BLOCK_SIZE and at the forward's tiles
    held = dict(bm.built)

    def tables():  # the backward's own on a new BlockMask: its tables at the backward's tiles and their transposition
        fresh = fagen.create_block_mask(mask, None, None, N, N, device=None)
        for key, t in held.items():  # the forward's tables, without what they keep for later calls
            fresh.built[key] = BlockTiles(t.block_m, t.block_n, t.kv_count, t.kv_list)
        fresh.tiles(spec.block_m, spec.block_n).transposed()

    def tables_by_kernel():  # the same with no forward's tables to derive from: the block-mask kernel at its tiles
        fresh = fagen.create_block_mask(mask, None, None, N, N, device=None)
        fresh.tiles(spec.block_m, spec.block_n).transposed()

    return {
        "fagen sparse": sparse_both,
        "fagen dense bwd": sparse_fwd_dense_bwd,
        "fagen dense": dense_both,
        "fagen flex": flex,
        "bwd alone: sparse": lambda: sparse.backward(q, k, v, o, lse, do, block_mask=bm),
        "bwd alone: dense": lambda: sparse.backward(q, k, v, o, lse, do),
        "table (once a mask)": tables,
        "table by the kernel": tables_by_kernel,
    }


def torch_run(mask, q, k, v, do, N: int):
    """PyTorch's compiled FlexAttention forward and backward, or None where it is not importable."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    compiled = torch.compile(flex_attention)
    bm = create_block_mask(mask, None, None, N, N, device=q.device)
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))

    def run():
        out = compiled(qg, kg, vg, block_mask=bm)
        torch.autograd.grad(out, (qg, kg, vg), do)

    return run


def case(mask, N: int, D: int, rounds: int = 3) -> None:
    H = 2048 // D
    q, k, v = (torch.randn(1, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    do = torch.randn_like(q)
    runs = fagen_runs(mask, q, k, v, do, N)
    peer = torch_run(mask, q, k, v, do, N)
    if peer is not None:
        runs["torch flex"] = peer
    for fn in runs.values():  # compile, build the tables, warm up
        fn()
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {n: [] for n in runs}
    names = list(runs)
    for r in range(rounds):
        for n in names[r % len(names) :] + names[: r % len(names)]:
            times[n].append(median_us(runs[n]))
    t = {n: statistics.median(x) for n, x in times.items()}
    for n in names:
        alone = n.startswith(("bwd alone", "table"))
        ratio = "" if alone else f"{t['fagen dense bwd'] / t[n]:5.2f}x dense bwd"
        peer = "torch flex" in t and n != "torch flex" and not alone
        peer_ratio = f"  {t['torch flex'] / t[n]:5.2f}x torch flex" if peer else ""
        print(f"  {n:20} {t[n]:9.0f} us  {ratio}{peer_ratio}", flush=True)
    print(f"  backward alone: sparse {t['bwd alone: dense'] / t['bwd alone: sparse']:.2f}x dense", flush=True)


if __name__ == "__main__":
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, fagen {fagen.__version__}")
    N = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
    D = int(sys.argv[2]) if len(sys.argv) > 2 else 128
    for mask in (documents, sliding_window):
        print(f"{mask.__name__}, N={N}, d{D}, bf16, {2048 // D} heads", flush=True)
        case(mask, N, D)
