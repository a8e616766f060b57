"""Gradients for fagen kernels in PyTorch: an autograd.Function for `Kernel` calls, and the `fagen::` ops
(torch.library.custom_op, with fake implementations and autograd) that `torch.compile(fullgraph=True)` traces
through, forward and backward, with no graph break.

    forward:  o, lse = kernel(q, k, v, scale=..., return_lse=True, **tensors)      saved: q, k, v, o, lse, tensors
    backward: dq, dk, dv, d(tensors) = kernel.backward(q, k, v, o, lse, do, ...)   (the compiler's derived backward)

lse is an output of the op (the backward recomputes P from it) but no gradient flows through it: the
autograd.Function marks it non-differentiable, and the public functions (fagen.attention, flash_attn_func)
return o alone.

An op's schema is static, so the kernel travels as a string key into `KERNELS`, a registry of the kernels
the ops may run (`register`), and the call-time tensors as a list in the kernel's order (`Kernel.tensors`).
This module imports PyTorch; fagen imports it only when a call needs it (never at `import fagen`).
"""

from __future__ import annotations

import threading

import torch

from . import arrays

KERNELS: dict = {}  # key -> Kernel (or anything with its call/backward interface): what the fagen:: ops run
_lock = threading.Lock()


def register(kernel, key: str | None = None) -> str:
    """The key under which the fagen:: ops find `kernel` (its name unless given): kernels of one name are
    one program on one spec, so the first one registered serves them all."""
    key = key or kernel.name
    with _lock:
        KERNELS.setdefault(key, kernel)
    return key


def kernel_of(key: str):
    try:
        return KERNELS[key]
    except KeyError:
        raise KeyError(f"fagen: no kernel registered under {key!r} (fagen.runtime.autograd.register)") from None


def _named(kernel, tensors) -> dict:
    return dict(zip(kernel.tensors, tensors))


def _like(x: torch.Tensor, packed: bool = False) -> torch.Tensor:
    """A new tensor of x's shape and dtype, laid out as fagen's kernels lay out an output for an input x:
    dense in x's memory order (a packed [total, H, D] array through its [1, H, total, D] view)."""
    if packed:
        return arrays.from_bhsd(torch.empty_like(arrays.as_bhsd(x)))
    return torch.empty_like(x)


def _as_layout(g: torch.Tensor, x: torch.Tensor, packed: bool = False) -> torch.Tensor:
    """g in the layout the fake implementations promise (_like(x)): the same tensor where it already is."""
    ref = _like(x, packed)
    if g.stride() == ref.stride() and g.dtype == ref.dtype:
        return g
    return ref.copy_(g)


def _grad_out(do: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """dO as the backward kernels read it: o's layout (autograd may hand an expanded or permuted tensor)."""
    if do.dtype != o.dtype:
        do = do.to(o.dtype)
    return do if do.stride() == o.stride() else torch.empty_like(o).copy_(do)


def _tensor_grads(kernel, grads, tensors) -> list:
    """The gradients of the call-time tensors, in the kernel's order (zeros where the backward gave none)."""
    given = grads.tensors
    return [
        given[n].reshape(t.shape).to(torch.float32) if n in given else torch.zeros_like(t, dtype=torch.float32)
        for n, t in zip(kernel.tensors, tensors)
    ]


def _backward(
    kernel, q, k, v, o, lse, do, scale, deterministic, tensors, varlen=None, tensor_grads=True, block_mask=None
):
    """Run the kernel's backward; dq, dk, dv in the layouts the fakes promise, and the tensors' gradients (zeros
    for those of name[h] / [b] / [b, h] reads when tensor_grads is False: none of them requires grad). A
    block-sparse kernel's backward takes its forward's `block_mask`."""
    if not kernel.has_backward:
        raise RuntimeError(
            f"kernel {kernel.name} has no backward (this build of fagen has no backward kernels); "
            "call it under torch.no_grad()"
        )
    do = _grad_out(do, o)
    named = _named(kernel, tensors)
    if varlen is None:
        sparse = {} if block_mask is None else {"block_mask": block_mask}
        g = kernel.backward(
            q, k, v, o, lse, do, scale=scale, deterministic=deterministic, tensor_grads=tensor_grads, **sparse, **named
        )
    else:
        g = kernel.varlen_backward(
            q, k, v, o, lse, do, *varlen, scale=scale, deterministic=deterministic, tensor_grads=tensor_grads, **named
        )
    packed = varlen is not None
    dq, dk, dv = (_as_layout(d, x, packed) for d, x in ((g.dq, q), (g.dk, k), (g.dv, v)))
    return dq, dk, dv, _tensor_grads(kernel, g, tensors)


# --- Kernel calls: an autograd.Function ------------------------------------------------------------------
class AttentionFunction(torch.autograd.Function):
    """kernel(q, k, v) with its backward; lse comes out non-differentiable. `call`: (varlen, block_mask), either
    None (varlen: the offsets, sizes and validate flag; block_mask: a block-sparse kernel's)."""

    @staticmethod
    def forward(ctx, kernel, scale, deterministic, call, q, k, v, *tensors):
        named = _named(kernel, tensors)
        varlen, block_mask = call
        if block_mask is not None:
            o, lse = kernel(q, k, v, scale=scale, return_lse=True, block_mask=block_mask, **named)
        elif varlen is None:
            o, lse = kernel(q, k, v, scale=scale, return_lse=True, **named)
        else:
            cu_q, cu_k, max_q, max_k, validate = varlen
            o, lse = kernel.varlen(
                q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, return_lse=True, validate=validate, **named
            )
        ctx.kernel, ctx.scale, ctx.deterministic = kernel, scale, deterministic
        ctx.varlen = None if varlen is None else varlen[:4]
        ctx.block_mask = block_mask
        ctx.save_for_backward(q, k, v, o, lse, *tensors)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse, *tensors = ctx.saved_tensors
        want = ctx.needs_input_grad
        grads = any(want[7:])  # a tensor's gradient is asked for: the kernels sum them
        dq, dk, dv, dts = _backward(
            ctx.kernel, q, k, v, o, lse, do, ctx.scale, ctx.deterministic, tensors, ctx.varlen, grads, ctx.block_mask
        )
        dts = [d if want[7 + i] else None for i, d in enumerate(dts)]
        return (None, None, None, None, dq if want[4] else None, dk if want[5] else None, dv if want[6] else None, *dts)


def ordered(kernel, tensors: dict) -> list:
    """The call-time tensors in the kernel's order; a missing or unknown name is an error naming it."""
    unknown = [n for n in tensors if n not in kernel.tensors]
    if unknown:
        raise TypeError(
            f"{unknown[0]}: this kernel takes no tensor of that name (it takes: {', '.join(kernel.tensors) or 'none'})"
        )
    missing = [n for n in kernel.tensors if n not in tensors]
    if missing:
        raise TypeError(f"{missing[0]}: this kernel's program reads {missing[0]}[...]; pass {missing[0]}=...")
    return [tensors[n] for n in kernel.tensors]


def attention_with_grad(kernel, q, k, v, scale, tensors: dict, deterministic: bool = False, block_mask=None):
    """Kernel.__call__ with inputs that require grad: (o, lse), o carrying the grad_fn (a block-sparse kernel's
    backward walking the block mask's transposed table)."""
    call = (None, block_mask)
    return AttentionFunction.apply(kernel, scale, deterministic, call, q, k, v, *ordered(kernel, tensors))


def varlen_with_grad(kernel, q, k, v, cu_q, cu_k, max_q, max_k, scale, validate, tensors: dict, deterministic=False):
    """Kernel.varlen with inputs that require grad: (o, lse), o carrying the grad_fn."""
    call = ((cu_q, cu_k, max_q, max_k, validate), None)
    return AttentionFunction.apply(kernel, scale, deterministic, call, q, k, v, *ordered(kernel, tensors))


# --- the fagen:: ops, for torch.compile --------------------------------------------------------------------
@torch.library.custom_op("fagen::attention", mutates_args=())
def attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key: str,
    scale: float | None,
    deterministic: bool,
    tensors: list[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """o, lse = the registered kernel `key` on q [B, H, M, D], k, v [B, Hkv, N, D]; `deterministic` is for
    the backward."""
    kernel = kernel_of(key)
    with torch.no_grad():
        return kernel(q, k, v, scale=scale, return_lse=True, **_named(kernel, tensors))


@attention_op.register_fake
def _(q, k, v, key, scale, deterministic, tensors):
    return _like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("fagen::attention_backward", mutates_args=())
def attention_backward_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    do: torch.Tensor,
    key: str,
    scale: float | None,
    deterministic: bool,
    tensors: list[torch.Tensor],
    tensor_grads: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """dq, dk, dv (q, k, v's shapes, dtypes and layouts) and the gradients of the call-time tensors (float32)."""
    return _backward(kernel_of(key), q, k, v, o, lse, do, scale, deterministic, tensors, None, tensor_grads)


@attention_backward_op.register_fake
def _(q, k, v, o, lse, do, key, scale, deterministic, tensors, tensor_grads=True):
    return _like(q), _like(k), _like(v), [torch.empty_like(t, dtype=torch.float32) for t in tensors]


def _setup(ctx, inputs, output):
    q, k, v, key, scale, deterministic, tensors = inputs
    o, lse = output
    ctx.key, ctx.scale, ctx.deterministic, ctx.count = key, scale, deterministic, len(tensors)
    ctx.tensor_grads = any(t.requires_grad for t in tensors)
    ctx.save_for_backward(q, k, v, o, lse, *tensors)
    ctx.mark_non_differentiable(lse)


def _attention_grad(ctx, do, _dlse):
    q, k, v, o, lse, *tensors = ctx.saved_tensors
    dq, dk, dv, dts = torch.ops.fagen.attention_backward(
        q, k, v, o, lse, do, ctx.key, ctx.scale, ctx.deterministic, tensors, ctx.tensor_grads
    )
    return dq, dk, dv, None, None, None, list(dts)


attention_op.register_autograd(_attention_grad, setup_context=_setup)


@torch.library.custom_op("fagen::attention_varlen", mutates_args=())
def attention_varlen_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    key: str,
    scale: float | None,
    deterministic: bool,
    tensors: list[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """o [total_q, H, D], lse [H, total_q] = the registered kernel `key`'s varlen call."""
    kernel = kernel_of(key)
    with torch.no_grad():
        return kernel.varlen(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            scale=scale,
            return_lse=True,
            **_named(kernel, tensors),
        )


@attention_varlen_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, key, scale, deterministic, tensors):
    return _like(q, packed=True), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("fagen::attention_varlen_backward", mutates_args=())
def attention_varlen_backward_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    do: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    key: str,
    scale: float | None,
    deterministic: bool,
    tensors: list[torch.Tensor],
    tensor_grads: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    varlen = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return _backward(kernel_of(key), q, k, v, o, lse, do, scale, deterministic, tensors, varlen, tensor_grads)


@attention_varlen_backward_op.register_fake
def _(q, k, v, o, lse, do, cu_q, cu_k, max_q, max_k, key, scale, deterministic, tensors, tensor_grads=True):
    packed = [_like(x, packed=True) for x in (q, k, v)]
    return (*packed, [torch.empty_like(t, dtype=torch.float32) for t in tensors])


def _setup_varlen(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, key, scale, deterministic, tensors = inputs
    o, lse = output
    ctx.key, ctx.scale, ctx.deterministic, ctx.sizes = key, scale, deterministic, (max_q, max_k)
    ctx.tensor_grads = any(t.requires_grad for t in tensors)
    ctx.save_for_backward(q, k, v, o, lse, cu_q, cu_k, *tensors)
    ctx.mark_non_differentiable(lse)


def _attention_varlen_grad(ctx, do, _dlse):
    q, k, v, o, lse, cu_q, cu_k, *tensors = ctx.saved_tensors
    dq, dk, dv, dts = torch.ops.fagen.attention_varlen_backward(
        q, k, v, o, lse, do, cu_q, cu_k, *ctx.sizes, ctx.key, ctx.scale, ctx.deterministic, tensors, ctx.tensor_grads
    )
    return dq, dk, dv, None, None, None, None, None, None, None, list(dts)


attention_varlen_op.register_autograd(_attention_varlen_grad, setup_context=_setup_varlen)


def attention(q, k, v, key: str, scale, deterministic: bool, tensors: list):
    """o of the registered kernel `key` through the fagen::attention op (traceable, differentiable)."""
    return torch.ops.fagen.attention(q, k, v, key, scale, deterministic, tensors)[0]


def attention_with_lse(q, k, v, key: str, scale, deterministic: bool, tensors: list):
    """o and lse [B, H, M] (float32, natural log; no gradient flows through it) through the fagen::attention op."""
    return torch.ops.fagen.attention(q, k, v, key, scale, deterministic, tensors)


def attention_varlen(q, k, v, cu_q, cu_k, max_q: int, max_k: int, key: str, scale, deterministic: bool, tensors):
    return torch.ops.fagen.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, key, scale, deterministic, tensors)[0]


def attention_varlen_with_lse(q, k, v, cu_q, cu_k, max_q, max_k, key: str, scale, deterministic: bool, tensors):
    """o and lse [H, total_q] (float32, natural log; no gradient flows through it) through the op."""
    return torch.ops.fagen.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, key, scale, deterministic, tensors)
