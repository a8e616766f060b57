"""A test double of a compiled kernel with a backward, for the CPU tests of the autograd and API wiring.

It computes attention in float64 PyTorch on the CPU (FlashAttention's semantics: softcap, then mask, then
ALiBi's -slope·|i + N - M - j|; causal and window aligned bottom-right; an optional per-head `bias`), and
its backward by float64 autograd of the same formula. It stands in for `Kernel` with the agreed interface
(`__call__`, `varlen`, `backward`, `varlen_backward`, `has_backward`, `tensors`, `name`), so that the tests
of fagen.runtime.autograd, fagen.api and fagen.flash_attn run without a GPU and without the real backward.
`reference_kernel` puts it behind a real `Kernel` instead, in place of the launches of its ops, for the tests
of the Kernel's own calls. It lives in the tests only; the product never uses it.
"""

from __future__ import annotations

import itertools
import math
from collections import namedtuple
from types import SimpleNamespace

import pytest
import torch

from fagen.backend import contract, plan
from fagen.runtime.forward import Forward
from fagen.runtime.kernel import Kernel, Launch, Plan

Gradients = namedtuple("Gradients", "dq dk dv tensors")
_names = itertools.count()


def _scores(q, k, *, scale, causal, window, softcap, slopes, bias):
    """s [B, H, M, N] (masked: -inf), the kept mask, tanh(s0/C) (or None) and the ALiBi distance |i - j|."""
    B, H, M, D = q.shape
    N = k.shape[2]
    s = (q @ k.transpose(-1, -2)) * scale
    t = None
    if softcap:
        t = torch.tanh(s / softcap)
        s = softcap * t
    i = torch.arange(M, device=q.device)[:, None] + (N - M)  # the key query i faces, bottom-right aligned
    j = torch.arange(N, device=q.device)[None, :]
    keep = torch.ones(M, N, dtype=torch.bool, device=q.device)
    left, right = window
    if causal:
        keep &= j <= i
        right = -1
    if left >= 0:
        keep &= j >= i - left
    if right >= 0:
        keep &= j <= i + right
    dist = (i - j).abs().to(s.dtype)
    if slopes is not None:  # [H], or [B, H] per batch
        s = s - slopes.to(s.dtype).view(-1 if slopes.dim() == 2 else 1, H, 1, 1) * dist
    if bias is not None:
        s = s + bias.to(s.dtype).view(1, H, 1, 1)
    return s, keep, t, dist


def reference(q, k, v, *, scale=None, causal=False, window=(-1, -1), softcap=0.0, slopes=None, bias=None):
    """o, lse of q [B, H, M, D] over k, v [B, Hkv, N, D], in the inputs' dtype (float64 in the tests); rows
    that see no key give o = 0, lse = -inf. Differentiable by torch autograd (the tests' reference)."""
    D, group = q.shape[3], q.shape[1] // k.shape[1]
    scale = 1 / math.sqrt(D) if scale is None else scale
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s, keep, _, _ = _scores(q, k, scale=scale, causal=causal, window=window, softcap=softcap, slopes=slopes, bias=bias)
    empty = ~keep.any(-1, keepdim=True)
    s = s.masked_fill(~keep, -math.inf).masked_fill(empty, 0.0)
    p = torch.softmax(s, -1).masked_fill(empty, 0.0)
    lse = torch.logsumexp(s, -1).masked_fill(empty[:, 0], -math.inf)
    return p @ v, lse


def reference_backward(q, k, v, do, *, scale=None, causal=False, window=(-1, -1), softcap=0.0, slopes=None, bias=None):
    """FlashAttention-2's backward in closed form (float64): D = rowsum(dO∘O), dS = P∘(dO·Vᵀ − D), through
    the score chain (softcap: 1 − tanh²; ALiBi: −|i − j| for the slopes; bias: 1); GQA summed per group.
    Returns dq, dk, dv and the gradients of slopes and bias (or None)."""
    B, H, M, D = q.shape
    Hkv = k.shape[1]
    group = H // Hkv
    scale = 1 / math.sqrt(D) if scale is None else scale
    ke, ve = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s, keep, t, dist = _scores(
        q, ke, scale=scale, causal=causal, window=window, softcap=softcap, slopes=slopes, bias=bias
    )
    s = s.masked_fill(~keep, -math.inf)
    m = s.amax(-1, keepdim=True).nan_to_num(0.0, neginf=0.0)
    e = torch.exp(s - m)
    total = e.sum(-1, keepdim=True)
    p = torch.where(total > 0, e / total.clamp_min(1e-300), torch.zeros_like(e))
    o = p @ ve
    dp = do @ ve.transpose(-1, -2)
    ds = p * (dp - (do * o).sum(-1, keepdim=True))
    dslopes = (
        -(ds * dist).sum((2, 3) if slopes is not None and slopes.dim() == 2 else (0, 2, 3))
        if slopes is not None
        else None
    )
    dbias = ds.sum((0, 2, 3)) if bias is not None else None
    if t is not None:
        ds = ds * (1 - t * t)
    dq = (ds @ ke) * scale
    dk = ((ds.transpose(-1, -2) @ q) * scale).view(B, Hkv, group, -1, D).sum(2)
    dv = (p.transpose(-1, -2) @ do).view(B, Hkv, group, -1, D).sum(2)
    return dq, dk, dv, dslopes, dbias


class DoubleKernel:
    """Stands in for fagen.runtime.kernel.Kernel (forward, varlen and their backwards)."""

    capture_roles: dict = {}  # a double captures no tensor (fagen.ops.with_captured reads this)

    def __init__(self, *, tensors=(), has_backward=True, **semantics):
        self.name = f"double{next(_names)}"
        self.tensors = tuple(tensors)
        self.has_backward = has_backward
        self.semantics = semantics  # causal, window, softcap
        self.calls, self.backward_calls, self.tensor_grads_calls = [], [], []

    def _ref(self, q, k, v, scale, tensors):
        return reference(q, k, v, scale=scale, slopes=tensors.get("slopes"), bias=tensors.get("bias"), **self.semantics)

    def _check(self, tensors):
        assert set(tensors) == set(self.tensors), (sorted(tensors), self.tensors)

    def __call__(self, q, k, v, *, scale=None, return_lse=False, **tensors):
        self._check(tensors)
        self.calls.append(("call", tuple(q.shape), scale))
        o, lse = self._ref(q.double(), k.double(), v.double(), scale, tensors)
        o = torch.empty_like(q).copy_(o)  # the output takes q's layout, as the kernels do
        return (o, lse.float()) if return_lse else o

    def backward(self, q, k, v, o, lse, do, *, scale=None, deterministic=False, tensor_grads=True, **tensors):
        self._check(tensors)
        assert do.shape == o.shape and lse.dtype == torch.float32 and lse.shape == q.shape[:3]
        self.backward_calls.append(deterministic)
        self.tensor_grads_calls.append(tensor_grads)
        grads = self._bwd(q.double(), k.double(), v.double(), do.double(), scale, tensors)
        return self._gradients(grads, (q, k, v), tensor_grads)

    def _bwd(self, q, k, v, do, scale, tensors):
        slopes, bias = tensors.get("slopes"), tensors.get("bias")
        return reference_backward(q, k, v, do, scale=scale, slopes=slopes, bias=bias, **self.semantics)

    def _gradients(self, grads, qkv, tensor_grads=True):
        dq, dk, dv, dslopes, dbias = grads
        named = {n: g.float() for n, g in (("slopes", dslopes), ("bias", dbias)) if g is not None and tensor_grads}
        dq, dk, dv = (g.to(x.dtype).contiguous() for g, x in zip((dq, dk, dv), qkv))  # contiguous: not x's layout
        return Gradients(dq, dk, dv, named)

    # varlen: packed [total, H, D], sequence b = rows cu[b]:cu[b + 1]; lse [H, total_q]; slopes [B, H]: row b
    @staticmethod
    def _sequence(tensors, b):
        slopes = tensors.get("slopes")
        return {**tensors, "slopes": slopes[b : b + 1]} if slopes is not None and slopes.dim() == 2 else tensors

    def _varlen_ref(self, q, k, v, cu_q, cu_k, scale, tensors):
        total, H, _ = q.shape
        outs, lses, at = [], [], 0
        for b in range(len(cu_q) - 1):
            (q0, q1), (k0, k1) = (int(cu_q[b]), int(cu_q[b + 1])), (int(cu_k[b]), int(cu_k[b + 1]))
            if q1 == q0:
                continue
            outs.append(q.new_zeros(q0 - at, *q.shape[1:]))  # rows outside every sequence
            lses.append(q.new_full((H, q0 - at), -math.inf))
            view = (x.permute(1, 0, 2)[None] for x in (q[q0:q1], k[k0:k1], v[k0:k1]))
            ob, lb = self._ref(*view, scale, self._sequence(tensors, b))
            outs.append(ob[0].permute(1, 0, 2))
            lses.append(lb[0])
            at = q1
        outs.append(q.new_zeros(total - at, *q.shape[1:]))
        lses.append(q.new_full((H, total - at), -math.inf))
        return torch.cat(outs, 0), torch.cat(lses, 1)

    def varlen(self, q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, return_lse=False, validate=None, **tensors):
        self._check(tensors)
        self.calls.append(("varlen", tuple(q.shape), scale, max_q, max_k))
        o, lse = self._varlen_ref(q.double(), k.double(), v.double(), cu_q, cu_k, scale, tensors)
        o = torch.empty_like(q).copy_(o)
        return (o, lse.float()) if return_lse else o

    def varlen_backward(
        self,
        q,
        k,
        v,
        o,
        lse,
        do,
        cu_q,
        cu_k,
        max_q,
        max_k,
        *,
        scale=None,
        deterministic=False,
        tensor_grads=True,
        **tensors,
    ):
        self._check(tensors)
        self.backward_calls.append(deterministic)
        self.tensor_grads_calls.append(tensor_grads)
        dq, dk, dv = (torch.zeros(x.shape, dtype=torch.float64) for x in (q, k, v))
        dslopes = dbias = None
        slopes = tensors.get("slopes")
        if slopes is not None and slopes.dim() == 2:  # per batch: each sequence's row gets its own gradient
            dslopes = torch.zeros(slopes.shape, dtype=torch.float64)
        for b in range(len(cu_q) - 1):
            (q0, q1), (k0, k1) = (int(cu_q[b]), int(cu_q[b + 1])), (int(cu_k[b]), int(cu_k[b + 1]))
            if q1 == q0 or k1 == k0:
                continue
            view = [x.double().permute(1, 0, 2)[None] for x in (q[q0:q1], k[k0:k1], v[k0:k1], do[q0:q1])]
            g = self._bwd(*view, scale, self._sequence(tensors, b))
            if slopes is not None and slopes.dim() == 2:
                dslopes[b] += g[3][0]
                g = (*g[:3], 0.0, g[4])
            dq[q0:q1] += g[0][0].permute(1, 0, 2)
            dk[k0:k1] += g[1][0].permute(1, 0, 2)
            dv[k0:k1] += g[2][0].permute(1, 0, 2)
            dslopes = g[3] if dslopes is None else dslopes + g[3]
            dbias = g[4] if dbias is None else dbias + g[4]
        return self._gradients((dq, dk, dv, dslopes, dbias), (q, k, v), tensor_grads)

    # decode: q [B, M, H, D] over a cache (contiguous [B, N, Hkv, D], or pages with a block_table), k_new, v_new
    # appended in place first; leftpad[b]: the keys before it are dropped (the shifted sequence keeps its
    # bottom-right alignment, as FlashAttention computes it)
    def decode(
        self,
        q,
        k_cache,
        v_cache,
        cache_seqlens,
        *,
        block_table=None,
        k_new=None,
        v_new=None,
        num_splits=None,
        scale=None,
        return_lse=False,
        **tensors,
    ):
        self._check(tensors)
        table = None if block_table is None else block_table.tolist()
        self.calls.append(("decode", tuple(q.shape), scale, table))
        B, M, H, D = q.shape
        new, page = (0 if k_new is None else k_new.shape[1]), k_cache.shape[1]

        def at(b, n):  # where key n of sequence b lives in the cache
            return (table[b][n // page], n % page) if table is not None else (b, n)

        outs, lses = [], []
        for b in range(B):
            length = int(cache_seqlens[b])
            for i in range(new):
                k_cache[at(b, length + i)] = k_new[b, i]
                v_cache[at(b, length + i)] = v_new[b, i]
            start = int(tensors["leftpad"][b]) if "leftpad" in tensors else 0
            rows = [at(b, n) for n in range(start, length + new)]
            named = {n: t for n, t in self._sequence(tensors, b).items() if n != "leftpad"}
            if not rows:
                outs.append(torch.zeros(1, H, M, D, dtype=torch.float64))
                lses.append(torch.full((1, H, M), -math.inf, dtype=torch.float64))
                continue
            kb, vb = (torch.stack([c[r] for r in rows])[None].transpose(1, 2).double() for c in (k_cache, v_cache))
            o, lse = self._ref(q[b : b + 1].transpose(1, 2).double(), kb, vb, scale, named)
            outs.append(o)
            lses.append(lse)
        o = torch.cat(outs).transpose(1, 2).to(q.dtype).contiguous()
        lse = torch.cat(lses).float()
        return (o, lse) if return_lse else o


# --- a real Kernel whose ops launch the double ----------------------------------------------------------------
class ReferenceForward(Forward):
    """The forward op with its launches replaced by the double's float64 reference (its checks and its way
    through autograd are the op's own)."""

    def __init__(self, kernel, double):
        super().__init__(kernel, kernel._calls)
        self.double = double

    def launch(self, q, k, v, scale, return_lse, out, out_lse, block_mask, tensors):
        return self.double(q, k, v, scale=scale, return_lse=return_lse, **tensors)

    def launch_varlen(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, return_lse, validate, tensors):
        return self.double.varlen(
            q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, return_lse=return_lse, validate=validate, **tensors
        )


class ReferenceBackward:
    """The backward op: the double's float64 backward."""

    def __init__(self, double):
        self.double = double
        self.block_masks: list = []  # the block mask of each call (None: a dense kernel's)

    def __call__(
        self, q, k, v, o, lse, do, scale, deterministic, tensor_grads, tensors, block_mask=None, float32_dkv=False
    ):
        self.block_masks.append(block_mask)
        g = self.double.backward(
            q, k, v, o, lse, do, scale=scale, deterministic=deterministic, tensor_grads=tensor_grads, **tensors
        )
        if float32_dkv:  # (the kernels' float32 sums: the double's, at least float32)
            dk, dv = (x.to(torch.promote_types(x.dtype, torch.float32)) for x in (g.dk, g.dv))
            g = g._replace(dk=dk, dv=dv)
        return g

    def varlen(self, q, k, v, o, lse, do, cu_q, cu_k, max_q, max_k, scale, deterministic, tensor_grads, tensors):
        return self.double.varlen_backward(
            q,
            k,
            v,
            o,
            lse,
            do,
            cu_q,
            cu_k,
            max_q,
            max_k,
            scale=scale,
            deterministic=deterministic,
            tensor_grads=tensor_grads,
            **tensors,
        )


def reference_kernel(double: DoubleKernel, forward=ReferenceForward, kind=contract.Kind.FORWARD) -> Kernel:
    """A real Kernel (a plan of one simt launch that is never loaded: its spec only names it) reading the double's
    tensors, with a backward when the double has one, whose ops launch the double instead of CUDA kernels.
    `forward`: the forward op's class (given the kernel and the double); `kind`: FORWARD_SPARSE for a block-sparse
    kernel's (which takes a block mask, and ignores it)."""
    spec = plan.choose("full", 64, "f32", "sm_80", "simt", kind=kind).spec
    params = contract.params(spec.kind, double.tensors)
    launch = Launch(spec, "", SimpleNamespace(cubin=b""), 0, params, 128, lambda B, H, M: (1, 1, 1))
    no_plan = (lambda: pytest.fail("the double's backward op builds no plan")) if double.has_backward else None
    kernel = Kernel(Plan((launch,)), None, default_scale=0.125, tensors=double.tensors, backward=no_plan)
    kernel._forward = forward(kernel, double)
    kernel._backward = ReferenceBackward(double)
    return kernel


def install(monkeypatch) -> list:
    """Replace the compiler behind fagen's memo of ops (fagen.ops) by doubles (for a test, with pytest's
    monkeypatch); returns the list of (request, kernel) pairs it makes. The memo, the ops' registry and
    torch.compile's caches start empty."""
    from fagen import ops
    from fagen.request import Flash
    from fagen.runtime import autograd

    made = []

    def fake_compile(request):
        src = request.source
        if isinstance(src, Flash):
            names = ("leftpad",) * src.leftpad + ("slopes",) * bool(src.alibi)
            kernel = DoubleKernel(tensors=names, causal=src.causal, window=src.window, softcap=src.softcap)
        else:
            assert src.causal in (False, "bottom_right") and src.window is None, "the double does bottom-right only"
            names = ("slopes",) if src.alibi else ("bias",) if src.score_mod is not None else ()
            kernel = DoubleKernel(tensors=names, causal=bool(src.causal), softcap=src.softcap or 0.0)
        made.append((request, kernel))
        return kernel

    monkeypatch.setattr(ops, "_compile", fake_compile)
    monkeypatch.setattr(ops, "_MEMO", {})
    monkeypatch.setattr(ops, "_KERNELS", {})
    monkeypatch.setattr(autograd, "KERNELS", {})
    torch._dynamo.reset()
    return made


def assert_close(a, b, tol=1e-5, what=""):
    assert a.shape == b.shape, (what, a.shape, b.shape)
    err = (a.double() - b.double()).abs().max().item()
    assert err <= tol, f"{what}: max error {err:.3e} > {tol:.1e}"
