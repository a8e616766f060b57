"""The memo of compiled ops, and calling them: what every front-end that compiles on first use goes through.

A front-end names its request by a builder of fagen.request and the builder's arguments (`make`, `fields`):
`kernel_key(make, **fields)` compiles `make(**fields)` on the first call of those arguments and keeps the op;
later calls find it by the arguments alone, without building the request again (a dictionary lookup on the
hot path). Traced functions among the arguments count by `request.function_key` (their code, defaults and
closure values), so a lambda written inline compiles once.

PyTorch tensors go through the `fagen::attention` ops (fagen.runtime.autograd): the call is differentiable,
and `torch.compile(fullgraph=True)` traces it with no graph break, running `kernel_key` once while tracing
(`torch.compiler.assume_constant_result`) and keeping its result, the kernel's name, as a constant. CuPy arrays
call the kernel directly (forward only).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from .request import Request, function_key, is_array
from .runtime import arrays

_MEMO: dict = {}  # (make, its arguments) -> the compiled op's name (a Kernel) or the op itself (other ops)
_KERNELS: dict = {}  # kernel name -> Kernel
_TORCH: dict = {}  # "key", "names": kernel_key and tensor_names as torch.compile keeps them (filled on first use)
_lock = threading.Lock()


def _compile(request: Request):
    """The compiled op of a request (fagen.pipeline's driver; tests put a double here)."""
    from .pipeline import compile_request

    return compile_request(request)


def memo_key(make: Callable[..., Request], fields: dict) -> tuple:
    return (make, *((n, function_key(v) if callable(v) else v) for n, v in fields.items()))


def cached(key: tuple, build: Callable[[], Any]) -> Any:
    """The memo's entry for `key`, built once (under the lock) on first use."""
    found = _MEMO.get(key)
    if found is None:
        with _lock:
            found = _MEMO.get(key)
            if found is None:
                found = _MEMO[key] = build()
    return found


def kernel_key(make: Callable[..., Request], **fields) -> str:
    """The name of the kernel of the request `make(**fields)`, compiling it on the request's first use; kernels
    for PyTorch tensors are registered for the fagen:: ops. torch.compile runs this once while tracing and keeps
    the string."""

    def build() -> str:
        request = make(**fields)
        kernel = _compile(request)
        name = kernel.name
        _KERNELS.setdefault(name, kernel)
        if str(fields.get("device", ("",))[0]) == "torch":
            from .runtime import autograd

            autograd.register(_KERNELS[name], name)
        return name

    return cached(memo_key(make, fields), build)


def kernel_of(key: str):
    return _KERNELS[key]


def tensor_names(key: str) -> tuple[str, ...]:
    return tuple(_KERNELS[key].tensors)


def _torch_side():
    """fagen.runtime.autograd (imports PyTorch), and the two lookups as torch.compile keeps them: run once while
    tracing, their results (strings) constants of the graph."""
    from .runtime import autograd

    if not _TORCH:
        import torch

        _TORCH["key"] = torch.compiler.assume_constant_result(kernel_key)
        _TORCH["names"] = torch.compiler.assume_constant_result(tensor_names)
    return autograd


def with_captured(key: str, tensors: dict, fns: tuple) -> dict:
    """The call's tensors with each tensor the traced functions (score_mod, mask) capture, read from the
    functions of this call (their current objects)."""
    roles = _KERNELS[key].capture_roles
    if not roles:
        return tensors
    by_role = {"score_mod": fns[0], "mask": fns[1]}
    return {**{n: c.value(by_role[role]) for n, (role, c) in roles.items()}, **tensors}


def ordered(names: tuple, tensors: dict, slopes: str = "") -> list:
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


def is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


def tensor_dtypes(tensors: dict) -> tuple:
    """The dtypes of the tensors passed by name, as part of a request (fagen's names; float32 left out)."""
    from .backend.contract import tensor_dtype

    out = []
    for name in sorted(tensors):  # string keys: torch.compile traces this
        t = tensors[name]
        if is_array(t):
            d = tensor_dtype(t.dtype, name)
            if d != "f32":
                out.append((name, d))
    return tuple(out)


def dtype_of(x) -> str:
    """fagen's name of an input's dtype; an unsupported one is an error naming q."""
    name = str(x.dtype).replace("torch.", "")
    dtype = arrays._DTYPES.get(name)
    if dtype is None:
        raise TypeError(f"q: dtype {name} is not supported; expected bfloat16, float16 or float32")
    return dtype


def device_of(x) -> tuple:
    """(library, device type, index): what decides the arch the kernel is compiled for."""
    if is_torch(x):
        return ("torch", x.device.type, x.device.index)
    return ("cupy", "cuda", x.device.id)


def run(make, fields: dict, q, k, v, *, scale, deterministic, tensors: dict, slopes="", return_lse=False):
    """o (and lse [B, H, M] with return_lse) for the request make(**fields): through the fagen::attention op for
    PyTorch (autograd, torch.compile; no gradient flows through lse), the kernel itself for CuPy."""
    fns = (fields.get("score_mod"), fields.get("mask"))
    if is_torch(q):
        autograd = _torch_side()
        key = _TORCH["key"](make, **fields)
        tensors = with_captured(key, tensors, fns)
        values = ordered(_TORCH["names"](key), tensors, slopes)
        run_op = autograd.attention_with_lse if return_lse else autograd.attention
        return run_op(q, k, v, key, scale, deterministic, values)
    key = kernel_key(make, **fields)
    kernel = kernel_of(key)
    tensors = with_captured(key, tensors, fns)
    ordered(tuple(kernel.tensors), tensors, slopes)
    return kernel(q, k, v, scale=scale, return_lse=return_lse, **tensors)


def run_varlen(make, fields: dict, q, k, v, cu_q, cu_k, max_q, max_k, *, scale, deterministic, tensors, **kw):
    """o [total_q, H, D] (and lse [H, total_q] with return_lse) for the request make(**fields) on packed sequences
    (FlashAttention's varlen convention)."""
    slopes, return_lse = kw.get("slopes", ""), kw.get("return_lse", False)
    if is_torch(q):
        autograd = _torch_side()
        key = _TORCH["key"](make, **fields)
        values = ordered(_TORCH["names"](key), tensors, slopes)
        run_op = autograd.attention_varlen_with_lse if return_lse else autograd.attention_varlen
        return run_op(q, k, v, cu_q, cu_k, max_q, max_k, key, scale, deterministic, values)
    kernel = kernel_of(kernel_key(make, **fields))
    ordered(tuple(kernel.tensors), tensors, slopes)
    return kernel.varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, return_lse=return_lse, **tensors)


__all__ = ["kernel_key", "kernel_of", "cached", "run", "run_varlen"]
