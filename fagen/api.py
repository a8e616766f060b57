"""`fagen.attention`: attention as a function, compiled on first use and cached per spec.

    o = fagen.attention(q, k, v, causal=True)                          # q [B, H, M, D], k, v [B, Hkv, N, D]
    o = fagen.attention(q, k, v, softcap=30.0, alibi=slopes)           # slopes [H], float32
    o = fagen.attention(q, k, v, score_mod=lambda s, b, h, q, k, bias: s + bias[h], bias=bias)

The first call for a spec (head dim, dtype, GPU arch, program) compiles a kernel with `fagen.compile` (a
hit in the disk cache in a later process) and keeps it in a memo; later calls look it up. PyTorch tensors go
through the `fagen::attention` op (fagen.runtime.autograd), so the call is differentiable and
`torch.compile(fullgraph=True)` traces it, forward and backward, with no graph break; CuPy arrays call the
kernel directly (forward only). `fagen.flash_attn_func` is built on the same memo.
"""

from __future__ import annotations

import threading

from .runtime import arrays

_MEMO: dict = {}  # request -> the registered key of its kernel
_KERNELS: dict = {}  # key -> Kernel
_lock = threading.Lock()


# --- the spec of a call ---------------------------------------------------------------------------------------
def _array_key(x):
    """A captured tensor as part of a request: its library, dtype and rank (its values and sizes are read at each
    call, so a new tensor of the same dtype and rank reuses the kernel)."""
    return ("array", type(x).__module__.split(".")[0], str(x.dtype), len(x.shape))


def _is_array(x) -> bool:
    return type(x).__module__.split(".")[0] in ("torch", "cupy", "numpy") and hasattr(x, "dtype")


def _fn_key(fn):
    """A traced function as part of a request: its code, defaults and closure values where they are hashable
    (so a lambda written inline in a model's forward compiles once, not on every call), else the function.
    Captured tensors (closure cells and the globals its code names) count by dtype and rank only."""
    if fn is None:
        return None
    try:
        cells = tuple(
            _array_key(c.cell_contents) if _is_array(c.cell_contents) else c.cell_contents
            for c in (fn.__closure__ or ())
        )
        module = fn.__globals__
        arrays_ = tuple(
            (n, _array_key(module[n])) for n in fn.__code__.co_names if n in module and _is_array(module[n])
        )
        key = (fn.__code__, fn.__defaults__, cells, arrays_)
        hash(key)
        return key
    except (AttributeError, TypeError, ValueError):
        return fn


def _tensor_dtypes(tensors: dict) -> tuple:
    """The dtypes of the tensors passed by name, as part of a request (fagen's names; float32 left out)."""
    from .backend.contract import tensor_dtype

    out = []
    for name in sorted(tensors):  # string keys: torch.compile traces this
        t = tensors[name]
        if _is_array(t):
            d = tensor_dtype(t.dtype, name)
            if d != "f32":
                out.append((name, d))
    return tuple(out)


def with_captured(key: str, tensors: dict, fns: tuple) -> dict:
    """The call's tensors with each tensor the traced functions (score_mod, mask) capture, read from the
    functions of this call (their current objects)."""
    roles = getattr(_KERNELS[key], "capture_roles", None)
    if not roles:
        return tensors
    by_role = {"score_mod": fns[0], "mask": fns[1]}
    return {**{n: c.value(by_role[role]) for n, (role, c) in roles.items()}, **tensors}


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


def _dtype(x) -> str:
    name = str(x.dtype).replace("torch.", "")
    dtype = arrays._DTYPES.get(name)
    if dtype is None:
        raise TypeError(f"q: dtype {name} is not supported; expected bfloat16, float16 or float32")
    return dtype


def _device(x) -> tuple:
    """(library, device index): what decides the arch the kernel is compiled for."""
    if _is_torch(x):
        return ("torch", x.device.type, x.device.index)
    return ("cupy", "cuda", x.device.id)


def _arch(device: tuple) -> str | None:
    lib, kind, index = device
    if kind != "cuda":
        return None
    if lib == "torch":
        import torch

        major, minor = torch.cuda.get_device_capability(index)
    else:
        import cupy

        major, minor = divmod(int(cupy.cuda.Device(index).compute_capability), 10)
    return f"sm_{major}{minor}{'a' if major == 9 else ''}"


def _compile(dim: int, dtype: str, device: tuple, program: tuple, score_mod=None, mask=None):
    """The kernel of a request. program: ("options", causal, window, alibi, softcap) for fagen.compile's
    options (with score_mod, mask; "sparse" in place of "options": the block-sparse forward), or
    ("flash", causal, window_size, softcap, alibi, alibi_per_batch) for FlashAttention's
    semantics (fagen.ir.variants.flash_attn_program)."""
    from .pipeline import compile as compile_kernel

    arch = _arch(device)
    if program[0] == "flash":
        from .ir.variants import flash_attn_program

        _, causal, window, softcap, alibi, per_batch = program
        ir = flash_attn_program(causal=causal, window=window, softcap=softcap, alibi=alibi, alibi_per_batch=per_batch)
        return compile_kernel(dim, dtype=dtype, arch=arch, ir=ir)
    sparse, causal, window, alibi, softcap, *rest = program  # "options", or "sparse": the block-sparse forward
    return compile_kernel(
        dim,
        dtype=dtype,
        arch=arch,
        causal=causal,
        window=window,
        alibi=alibi,
        softcap=softcap,
        score_mod=score_mod,
        mask=mask,
        block_sparse=sparse == "sparse",
        tensor_dtypes=dict(rest[0]) if rest else None,
    )


def kernel_key(dim: int, dtype: str, device: tuple, program: tuple, score_mod=None, mask=None) -> str:
    """The key of the request's kernel (its name), compiling it on the request's first use; kernels for
    PyTorch tensors are registered for the fagen:: ops. torch.compile runs this once while tracing
    (assume_constant_result) and keeps the string."""
    request = (dim, dtype, device, program, _fn_key(score_mod), _fn_key(mask))
    key = _MEMO.get(request)
    if key is not None:
        return key
    with _lock:
        key = _MEMO.get(request)
        if key is None:
            kernel = _compile(dim, dtype, device, program, score_mod, mask)
            key = kernel.name
            _KERNELS.setdefault(key, kernel)
            if device[0] == "torch":
                from .runtime import autograd

                autograd.register(_KERNELS[key], key)
            _MEMO[request] = key
    return key


def kernel_of(key: str):
    return _KERNELS[key]


def tensor_names(key: str) -> tuple[str, ...]:
    return tuple(_KERNELS[key].tensors)


def _ordered(names: tuple, tensors: dict, slopes: str = "") -> list:
    """The call-time tensors in the kernel's order; a missing or unknown name is an error naming it."""
    unknown = [n for n in tensors if n not in names]
    if unknown:
        raise TypeError(
            f"{unknown[0]}: this attention takes no tensor of that name (it takes: {', '.join(names) or 'none'})"
        )
    missing = [n for n in names if n not in tensors]
    if missing:
        what = slopes if missing[0] == "slopes" and slopes else missing[0]
        raise TypeError(f"{what}: the program reads {missing[0]}[...]; pass {what}=...")
    return [tensors[n] for n in names]


def _torch_side():
    """fagen.runtime.autograd (imports PyTorch), with the key lookups wrapped so that torch.compile runs them
    once while tracing and keeps their result (a string) in the graph."""
    from .runtime import autograd

    if not hasattr(autograd, "constant_key"):
        import torch

        autograd.constant_key = torch.compiler.assume_constant_result(kernel_key)
        autograd.constant_names = torch.compiler.assume_constant_result(tensor_names)
    return autograd


def run(
    request: tuple,
    q,
    k,
    v,
    *,
    scale,
    deterministic,
    tensors: dict,
    fns=(None, None),
    slopes="alibi",
    return_lse: bool = False,
):
    """o (and lse [B, H, M] with return_lse) for a request (dim, dtype, device, program): through the
    fagen::attention op for PyTorch (autograd, torch.compile; no gradient flows through lse), the kernel itself
    for CuPy."""
    if _is_torch(q):
        autograd = _torch_side()
        key = autograd.constant_key(*request, *fns)
        tensors = with_captured(key, tensors, fns)
        values = _ordered(autograd.constant_names(key), tensors, slopes)
        run_op = autograd.attention_with_lse if return_lse else autograd.attention
        return run_op(q, k, v, key, scale, deterministic, values)
    key = kernel_key(*request, *fns)
    kernel = kernel_of(key)
    tensors = with_captured(key, tensors, fns)
    _ordered(tuple(kernel.tensors), tensors, slopes)
    return kernel(q, k, v, scale=scale, return_lse=return_lse, **tensors)


def run_varlen(
    request: tuple, q, k, v, cu_q, cu_k, max_q, max_k, *, scale, deterministic, tensors, slopes="", return_lse=False
):
    """o [total_q, H, D] (and lse [H, total_q] with return_lse) for a request on packed sequences
    (FlashAttention's varlen convention)."""
    if _is_torch(q):
        autograd = _torch_side()
        key = autograd.constant_key(*request)
        values = _ordered(autograd.constant_names(key), tensors, slopes)
        run_op = autograd.attention_varlen_with_lse if return_lse else autograd.attention_varlen
        return run_op(q, k, v, cu_q, cu_k, max_q, max_k, key, scale, deterministic, values)
    kernel = kernel_of(kernel_key(*request))
    _ordered(tuple(kernel.tensors), tensors, slopes)
    return kernel.varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, return_lse=return_lse, **tensors)


# --- the public function ------------------------------------------------------------------------------------
def attention(
    q,
    k,
    v,
    *,
    causal=False,
    window=None,
    alibi=None,
    softcap=None,
    score_mod=None,
    mask=None,
    scale=None,
    deterministic=False,
    **tensors,
):
    """Attention of q [B, H, M, D] over k, v [B, Hkv, N, D] (any strides; GQA when Hkv divides H), returning
    o like q. The options are `fagen.compile`'s: causal (False, True / 'top_left', 'bottom_right'),
    window (LEFT or (LEFT, RIGHT)), softcap (C·tanh(s/C)), score_mod(s, b, h, q, k[, tensors...]) and
    mask(b, h, q, k) traced functions; `alibi`: the ALiBi slopes, a float32 vector of H, added as
    slopes[h]·(k - q) after the softcap (fagen.compile(alibi=True)'s form; `flash_attn_func` has
    FlashAttention's). `tensors`: the call-time tensors a score_mod/mask reads, by name (their dtypes part of
    the kernel); tensors the functions capture from their scope are read at each call. scale: default
    1/sqrt(D). deterministic: a reproducible backward (bitwise equal across runs).

    The kernel is compiled on the first call of a spec (head dim, dtype, GPU, options) and kept. PyTorch
    tensors: differentiable (o has a grad_fn when an input requires grad) and traceable by
    torch.compile(fullgraph=True); CuPy arrays: forward only."""
    if arrays.library(q) is None:
        raise TypeError(f"q: expected a PyTorch tensor or a CuPy array, got {type(q).__name__}")
    if len(q.shape) != 4:
        raise ValueError(f"q: expected 4 dimensions [B, H, M, D], got shape {tuple(q.shape)}")
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic: expected True or False, got {deterministic!r}")
    if alibi is not None:
        if "slopes" in tensors:
            raise TypeError("alibi, slopes: the ALiBi slopes are given by alibi=...; drop slopes=")
        tensors = {**tensors, "slopes": alibi}
    window = tuple(window) if isinstance(window, list) else window
    dtypes = _tensor_dtypes(tensors)  # the tensors' dtypes other than float32 are part of the kernel
    program = ("options", causal, window, alibi is not None, softcap) + ((dtypes,) if dtypes else ())
    request = (int(q.shape[3]), _dtype(q), _device(q), program)
    return run(request, q, k, v, scale=scale, deterministic=deterministic, tensors=tensors, fns=(score_mod, mask))


__all__ = ["attention"]
