"""Correctness checks on a GPU (PyTorch), shared by the GPU tests, `fagen check` and the benchmark.

The rule is FlashAttention's own: against a float64 reference, the kernel's error must be at most twice
the error of the same attention computed naively in the input dtype, plus a small absolute floor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..ir import exprs
from ..passes import fuse
from ..passes.fuse import tensor_index
from ..runtime.kernel import Kernel
from . import executor

# The absolute floor of the tolerance, per dtype.
FLOOR = {"f32": 1e-5, "f16": 1e-4, "bf16": 1e-3}
TORCH_DTYPE = {"f16": "float16", "bf16": "bfloat16", "f32": "float32"}


def _torch():
    try:
        import torch
    except ImportError:
        raise RuntimeError("this check needs PyTorch for its float64 reference (pip install torch)") from None
    return torch


@dataclass(frozen=True)
class CheckResult:
    err: float  # max |O - O_ref|
    err_naive: float  # the same for naive attention in the input dtype
    bound: float
    lse_err: float
    lse_err_naive: float
    lse_bound: float
    lse_inf_match: bool
    finite: bool

    @property
    def ok(self) -> bool:
        return self.finite and self.lse_inf_match and self.err <= self.bound and self.lse_err <= self.lse_bound


def assert_ok(r: CheckResult, what: str) -> None:
    """Fail with the figures when a check misses FlashAttention's rule (for tests)."""
    assert r.finite, f"{what}: non-finite output"
    assert r.lse_inf_match, f"{what}: lse -inf/NaN pattern differs from the reference"
    assert r.err <= r.bound, f"{what}: max|O - ref| {r.err:.3e} > bound {r.bound:.3e} (naive {r.err_naive:.3e})"
    assert r.lse_err <= r.lse_bound, f"{what}: max|lse - ref| {r.lse_err:.3e} > {r.lse_bound:.3e}"


def call_tensors(kernel: Kernel, B: int, H: int, M: int | None = None, N: int | None = None, *, seed=None) -> dict:
    """Values for the call-time tensors a kernel's program reads, on the GPU: ALiBi's slopes for `slopes`, random
    positive float32 values for a per-head or per-batch vector; for any other tensor, of the kernel's dtype and
    rank, sized B, H, M, N along a dimension read by a bare b, h, q, k (else 2 max(M, N) + 1: reads past it
    clamp), with random values (floats in [0.1, 1), ids in [0, 4), bools); `seed` makes them repeatable."""
    from ..ir.variants import alibi_slopes

    torch = _torch()
    rng = np.random.default_rng(seed)
    out = {}
    extent = dict(b=B, h=H, q=M or 64, k=N or 64)
    other = 2 * max(M or 64, N or 64) + 1
    for arg in kernel.tensor_args:
        name = arg.name
        if arg.rank == 1 and tensor_index(kernel.program, name) in ("h", "b") and arg.dtype == "f32":
            n = B if tensor_index(kernel.program, name) == "b" else H
            values = alibi_slopes(n) if name == "slopes" else list(rng.uniform(0.1, 1.0, n))
            out[name] = torch.tensor(values, dtype=torch.float32, device="cuda")
            continue
        shape = tuple(extent.get(d, other) for d in (arg.dims or "." * arg.rank))
        if arg.dtype == "bool":
            values = torch.as_tensor(rng.random(shape) < 0.5)
        elif arg.dtype in ("i32", "i64"):
            values = torch.as_tensor(
                rng.integers(0, 4, shape), dtype=torch.int32 if arg.dtype == "i32" else torch.int64
            )
        else:
            values = torch.as_tensor(rng.uniform(0.1, 1.0, shape), dtype=getattr(torch, TENSOR_TORCH_DTYPE[arg.dtype]))
        out[name] = values.cuda()
    return out


TENSOR_TORCH_DTYPE = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}


def _env(kernel: Kernel, B, H, M, N, tensors, rows=None):
    """Index grids and sizes for evaluating the program's expressions; `rows` picks query rows."""
    dims = dict(B=B, H=H, M=M, N=N, D=kernel.spec.dim)
    grids = executor._index_grids(dims)
    if rows is not None:
        grids[exprs.INDICES["q"]] = np.asarray(rows).reshape(1, 1, -1, 1)
    return {
        **grids,
        **{exprs.DIMS[n]: v for n, v in dims.items()},
        **{name: t.double().cpu().numpy() for name, t in (tensors or {}).items()},
    }


def score_function(kernel: Kernel, B, H, M, N, tensors, rows=None):
    """The program's score function as a callable on scaled scores [B, H, M, N] (torch; [B, H, len(rows), N]
    with `rows`), or None."""
    fn = fuse.fused_node(kernel.program).attr("score")
    if fn == exprs.SCORE:
        return None
    torch = _torch()
    env = _env(kernel, B, H, M, N, tensors, rows)

    def apply(s):
        values = executor._evaluate(fn, {**env, exprs.SCORE: s.double().cpu().numpy()})
        return torch.as_tensor(np.broadcast_to(values, s.shape).copy(), device=s.device).to(s.dtype)

    return apply


def keep_matrix(kernel: Kernel, B: int, H: int, M: int, N: int, tensors: dict | None = None, rows=None):
    """The mask of the kernel's program as a boolean array broadcastable to [B, H, M, N] ([B, H, len(rows), N]
    with `rows`)."""
    keep = fuse.fused_node(kernel.program).attr("keep")
    values = _env(kernel, B, H, M, N, tensors, rows)
    shape = (B, H, M if rows is None else len(rows), N)
    return np.broadcast_to(np.asarray(executor._evaluate(keep, values), dtype=bool), shape)


def generator(seed=None, device="cuda"):
    """A torch random generator on `device`, seeded with `seed` (fresh entropy when None)."""
    g = _torch().Generator(device=device)
    g.manual_seed(int(seed) if seed is not None else int(np.random.SeedSequence().entropy % (2**62)))
    return g


def index_grids(B, H, L, S, device):
    """b, h, q_idx, kv_idx as broadcastable [B, 1, 1, 1] ... [1, 1, 1, S] torch index tensors: a mask or score
    function called on them gives its values on the whole [B, H, L, S] grid (as FlexAttention evaluates it)."""
    import torch

    return (
        torch.arange(B, device=device).view(B, 1, 1, 1),
        torch.arange(H, device=device).view(1, H, 1, 1),
        torch.arange(L, device=device).view(1, 1, L, 1),
        torch.arange(S, device=device).view(1, 1, 1, S),
    )


def random_qkv(B, H, M, N, D, dtype, *, Hkv=None, layout="bhsd", seed=None, device="cuda"):
    """Fresh random q, k, v (never zeros) as [B, H, S, D] tensors in the given memory layout:
    bhsd (contiguous), bshd (a [B, S, H, D] buffer viewed as [B, H, S, D]) or strided_d (every other element
    of a wider buffer along D)."""
    torch = _torch()
    g = generator(seed, device)
    dt = getattr(torch, TORCH_DTYPE[dtype])
    Hkv = Hkv or H

    def make(heads, S):
        if layout == "bhsd":
            return torch.randn(B, heads, S, D, generator=g, device=device).to(dt)
        if layout == "bshd":
            return torch.randn(B, S, heads, D, generator=g, device=device).to(dt).transpose(1, 2)
        if layout == "strided_d":
            return torch.randn(B, heads, S, 2 * D, generator=g, device=device).to(dt)[..., ::2]
        raise ValueError(f"layout: unknown {layout!r}")

    return make(H, M), make(Hkv, N), make(Hkv, N)


def reference(q, k, v, keep, scale, *, dtype=None, score=None):
    """Attention in `dtype` (float64 when None: the reference) with fully masked rows giving 0 and -inf;
    `score` (a callable) maps the scaled scores before the mask."""
    torch = _torch()
    dt = dtype or torch.float64
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    keep_t = torch.as_tensor(np.ascontiguousarray(keep), device=q.device)
    s = (q @ k.transpose(-1, -2)) * scale
    if score is not None:
        s = score(s)
    s = s.masked_fill(~keep_t, float("-inf"))
    lse = torch.logsumexp(s.float() if dt != torch.float64 else s, dim=-1)
    p = torch.softmax(s, dim=-1)
    o = p @ v
    empty = ~keep_t.any(dim=-1)
    o = o.masked_fill(empty[..., None], 0.0)
    return o, lse


def check_kernel(kernel: Kernel, *, B, H, M, N, Hkv=None, layout="bhsd", scale=None, seed=None) -> CheckResult:
    torch = _torch()
    D = kernel.spec.dim
    q, k, v = random_qkv(B, H, M, N, D, kernel.spec.dtype, Hkv=Hkv, layout=layout, seed=seed)
    tensors = call_tensors(kernel, B, H, M, N)
    keep = keep_matrix(kernel, B, H, M, N, tensors)
    score = score_function(kernel, B, H, M, N, tensors)
    sc = kernel.default_scale if scale is None else scale
    out = torch.full((B, H, M, D), float("nan"), dtype=q.dtype, device=q.device)  # poisoned
    out_lse = torch.full((B, H, M), float("nan"), dtype=torch.float32, device=q.device)
    o, lse = kernel(q, k, v, scale=scale, return_lse=True, out=out, out_lse=out_lse, **tensors)
    torch.cuda.synchronize()
    o_ref, lse_ref = reference(q, k, v, keep, sc, score=score)
    o_naive, lse_naive = reference(q, k, v, keep, sc, dtype=q.dtype, score=score)
    return compare(o, lse, (o_ref, lse_ref), (o_naive, lse_naive), kernel.spec.dtype)


def compare(o, lse, ref, naive, dtype: str) -> CheckResult:
    """FlashAttention's rule: the kernel's (o, lse) against the float64 reference, with the naive computation in
    the same dtype setting the bound; -inf in lse must match the reference's and no NaN may appear."""
    torch = _torch()
    (o_ref, lse_ref), (o_naive, lse_naive) = ref, naive
    finite = bool(torch.isfinite(o).all())
    err = float((o.double() - o_ref).abs().max())
    err_naive = float((o_naive.double() - o_ref).abs().nan_to_num(0.0).max())
    ref_inf = torch.isneginf(lse_ref)
    inf_match = bool((torch.isneginf(lse) == ref_inf).all()) and not bool(torch.isnan(lse).any())
    fin = ~ref_inf
    lse_err = float((lse.double() - lse_ref)[fin].abs().max()) if fin.any() else 0.0
    lse_err_naive = float((lse_naive.double() - lse_ref)[fin].abs().max()) if fin.any() else 0.0
    floor = FLOOR[dtype]
    return CheckResult(
        err, err_naive, 2 * err_naive + floor, lse_err, lse_err_naive, 2 * lse_err_naive + floor, inf_match, finite
    )


def check_decode(kernel: Kernel, *, B, M, H, Hkv, N, seqlens, num_splits=None, seed=None) -> CheckResult:
    """Kernel.decode on random caches [B, N, Hkv, D] of lengths `seqlens` against a float64 reference, with
    FlashAttention's rule; the outputs and the workspace are poisoned with NaN before the call."""
    torch = _torch()
    D = kernel.spec.dim
    q4, k4, v4 = random_qkv(B, H, M, N, D, kernel.spec.dtype, Hkv=Hkv, layout="bshd", seed=seed)
    q, k_cache, v_cache = q4.transpose(1, 2), k4.transpose(1, 2), v4.transpose(1, 2)  # [B, S, H, D] dense
    lens = torch.tensor(seqlens, dtype=torch.int32, device=q.device)
    tensors = call_tensors(kernel, B, H, M, N)
    out = torch.full((B, M, H, D), float("nan"), dtype=q.dtype, device=q.device)
    out_lse = torch.full((B, H, M), float("nan"), dtype=torch.float32, device=q.device)
    kernel.decode(q, k_cache, v_cache, lens, num_splits=num_splits, out=out, out_lse=out_lse, **tensors)
    for entry in kernel._calls.values():  # the workspace too: every byte the merge reads must be written
        if hasattr(entry, "ws_acc"):
            entry.ws_acc.fill_(float("nan"))
            entry.ws_ml.fill_(float("nan"))
    out.fill_(float("nan"))
    out_lse.fill_(float("nan"))
    o, lse = kernel.decode(
        q, k_cache, v_cache, lens, num_splits=num_splits, out=out, out_lse=out_lse, return_lse=True, **tensors
    )
    torch.cuda.synchronize()
    sc = kernel.default_scale
    refs, naives = [], []
    for b, L in enumerate(seqlens):
        qb, kb, vb = q4[b : b + 1], k4[b : b + 1, :, :L], v4[b : b + 1, :, :L]
        keep = keep_matrix(kernel, 1, H, M, L, tensors)
        score = score_function(kernel, 1, H, M, L, tensors)
        refs.append(reference(qb, kb, vb, keep, sc, score=score))
        naives.append(reference(qb, kb, vb, keep, sc, dtype=q.dtype, score=score))
    o_ref = torch.cat([r[0] for r in refs]).transpose(1, 2)
    lse_ref = torch.cat([r[1] for r in refs])
    o_naive = torch.cat([r[0] for r in naives]).transpose(1, 2)
    lse_naive = torch.cat([r[1] for r in naives])
    return compare(o, lse, (o_ref, lse_ref), (o_naive, lse_naive), kernel.spec.dtype)


# --- the backward ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GradCheckResult:
    """Per gradient (dq, dk, dv, and d<tensor> for each call-time tensor the score reads): (max |g - ref|, the
    same for the naive computation in the input dtype, the bound 2 x naive + floor)."""

    errors: dict
    finite: bool

    @property
    def ok(self) -> bool:
        return self.finite and all(err <= bound for err, _, bound in self.errors.values())

    def __str__(self) -> str:
        return ", ".join(f"{n} {e:.2e} (bound {b:.2e})" for n, (e, _, b) in self.errors.items())


def assert_grads_ok(r: GradCheckResult, what: str) -> None:
    """Fail with the figures when a gradient misses FlashAttention's rule (for tests)."""
    assert r.finite, f"{what}: non-finite gradient"
    for name, (err, naive, bound) in r.errors.items():
        assert err <= bound, f"{what}: max|{name} - ref| {err:.3e} > bound {bound:.3e} (naive {naive:.3e})"


def _differentiable_score(kernel: Kernel, B, H, M, N, names: tuple[str, ...]):
    """The program's score function as a torch autograd Function of the scaled scores and the call-time tensors
    (float64 evaluation by the executor; derivatives by central differences in float64, so the reference does not
    reuse the backward rule it checks), or None for the identity."""
    fn = fuse.fused_node(kernel.program).attr("score")
    if fn == exprs.SCORE:
        return None
    torch = _torch()

    def f(s, tvals):
        env = _env(kernel, B, H, M, N, dict(zip(names, tvals)))
        values = executor._evaluate(fn, {**env, exprs.SCORE: s.double().cpu().numpy()})
        return torch.as_tensor(np.broadcast_to(values, s.shape).copy(), device=s.device, dtype=torch.float64)

    function: Any = torch.autograd.Function  # torch is imported on first use: its classes are values here

    class Score(function):
        @staticmethod
        def forward(ctx, s, *tvals):
            ctx.save_for_backward(s, *tvals)
            return f(s, tvals).to(s.dtype)

        @staticmethod
        def backward(ctx, g):
            s, *tvals = ctx.saved_tensors
            s64, g64 = s.double(), g.double()
            h = 1e-6 * (1 + s64.abs())
            ds = (f(s64 + h, tvals) - f(s64 - h, tvals)) / (2 * h)
            grads = []
            for i, t in enumerate(tvals):
                gt = torch.zeros_like(t, dtype=torch.float64)
                for j in np.ndindex(tuple(t.shape)):  # each element (name[h]: [H]; name[b, h]: [B, H])
                    eps = 1e-6 * (1 + abs(float(t[j])))
                    up, down = list(tvals), list(tvals)
                    up[i], down[i] = t.double().clone(), t.double().clone()
                    up[i][j] += eps
                    down[i][j] -= eps
                    gt[j] = ((f(s64, up) - f(s64, down)) * g64).sum() / (2 * eps)
                grads.append(gt.to(t.dtype))
            return (g64 * ds).to(s.dtype), *grads

    return Score.apply


def reference_grads(kernel: Kernel, q, k, v, do, tensors: dict, keep, scale, *, dtype=None) -> dict:
    """Gradients of sum(O * dO) by torch autograd on the naive program in `dtype` (float64 when None: the
    reference): dq, dk, dv (GQA through repeat_interleave) and d<name> for each call-time tensor. Fully masked rows
    give P = 0 and gradients 0, not NaN."""
    torch = _torch()
    dt = dtype or torch.float64
    B, H, M, _ = q.shape
    N = k.shape[2]
    names = tuple(tensors)
    leaves = [x.detach().to(dt).requires_grad_() for x in (q, k, v)]
    tleaves = [
        t.detach().to(torch.float64 if dtype is None else torch.float32).requires_grad_() for t in tensors.values()
    ]
    qq, kk, vv = leaves
    group = H // kk.shape[1]
    kr, vr = kk.repeat_interleave(group, dim=1), vv.repeat_interleave(group, dim=1)
    keep_t = torch.as_tensor(np.ascontiguousarray(keep), device=q.device)
    s = (qq @ kr.transpose(-1, -2)) * scale
    score = _differentiable_score(kernel, B, H, M, N, names)
    if score is not None:
        s = score(s, *tleaves)
    s = s.masked_fill(~keep_t, float("-inf"))
    m = s.amax(dim=-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    denom = e.sum(dim=-1, keepdim=True)
    p = e / torch.where(denom == 0, torch.ones_like(denom), denom)
    o = p @ vr
    (o * do.to(dt)).sum().backward()
    out = {"dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}
    for name, t in zip(names, tleaves):
        if t.grad is not None:
            out[f"d{name}"] = t.grad
    return out


def check_backward(
    kernel: Kernel, *, B, H, M, N, Hkv=None, layout="bhsd", deterministic=False, seed=None, tensor_grads=True
) -> GradCheckResult:
    """Kernel.backward on fresh random inputs against float64 autograd of the naive program, with FlashAttention's
    rule per gradient: err <= 2 x the naive same-dtype error + FLOOR x max(1, max |ref|). tensor_grads=False:
    the call-time tensors' gradients are not asked for, nor checked."""
    torch = _torch()
    D = kernel.spec.dim
    q, k, v = random_qkv(B, H, M, N, D, kernel.spec.dtype, Hkv=Hkv, layout=layout, seed=seed)
    tensors = call_tensors(kernel, B, H, M, N, seed=seed)
    keep = keep_matrix(kernel, B, H, M, N, tensors)
    sc = kernel.default_scale
    o, lse = kernel(q, k, v, return_lse=True, **tensors)
    # dO from the seed + 1: a seeded check draws the same inputs every time
    do = torch.randn(q.shape, device=q.device, generator=generator(None if seed is None else seed + 1, q.device))
    do = do.to(q.dtype)
    g = kernel.backward(q, k, v, o, lse, do, deterministic=deterministic, tensor_grads=tensor_grads, **tensors)
    torch.cuda.synchronize()
    got = {"dq": g.dq, "dk": g.dk, "dv": g.dv, **{f"d{n}": t for n, t in g.tensors.items()}}
    ref = reference_grads(kernel, q, k, v, do, tensors, keep, sc)
    naive = reference_grads(kernel, q, k, v, do, tensors, keep, sc, dtype=q.dtype)
    finite = all(bool(torch.isfinite(x).all()) for x in got.values())
    errors = {}
    for name, r in ref.items():
        if not tensor_grads and name not in ("dq", "dk", "dv"):
            continue
        x = got.get(name)
        if x is None:
            errors[name] = (float("inf"), 0.0, 0.0)
            continue
        if tuple(x.shape) != tuple(r.shape):
            raise AssertionError(f"{name}: shape {tuple(x.shape)}, expected {tuple(r.shape)}")
        err = float((x.double() - r).abs().max()) if r.numel() else 0.0
        err_naive = float((naive[name].double() - r).abs().nan_to_num(0.0).max()) if r.numel() else 0.0
        floor = FLOOR[kernel.spec.dtype] * max(1.0, float(r.abs().max()) if r.numel() else 1.0)
        errors[name] = (err, err_naive, 2 * err_naive + floor)
    return GradCheckResult(errors, finite)
