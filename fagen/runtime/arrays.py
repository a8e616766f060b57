"""What the launcher needs of an array, whatever library it came from (CuPy or PyTorch), without a copy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_DTYPES = {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}


@dataclass(frozen=True)
class Array:
    kind: str  # "cupy" or "torch"
    obj: Any  # the torch tensor or CuPy array itself
    ptr: int
    shape: tuple
    strides: tuple  # in elements
    dtype: str | None  # fagen dtype name, None if unsupported
    dtype_name: str
    device: int


_LIBRARY: dict[type, str | None] = {}  # an array type -> its library, learned on first sight (every call asks)


def library(x) -> str | None:
    """ "torch", "cupy", or None for anything else."""
    t = type(x)
    try:
        return _LIBRARY[t]
    except KeyError:
        mod = t.__module__
        lib = _LIBRARY[t] = "torch" if mod.startswith("torch") else "cupy" if mod.startswith("cupy") else None
        return lib


def describe(name: str, x) -> Array:
    lib = library(x)
    if lib == "torch":
        import torch

        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a CuPy array or a PyTorch CUDA tensor, got {type(x).__name__}")
        if not x.is_cuda:
            raise TypeError(
                f"{name}: expected a CUDA tensor, got a tensor on {x.device} (host memory); move it with .cuda()"
            )
        dname = str(x.dtype).replace("torch.", "")
        return Array(
            "torch", x, x.data_ptr(), tuple(x.shape), tuple(x.stride()), _DTYPES.get(dname), dname, x.device.index
        )
    if lib == "cupy":
        import cupy

        if not isinstance(x, cupy.ndarray):
            raise TypeError(f"{name}: expected a CuPy array or a PyTorch CUDA tensor, got {type(x).__name__}")
        item = x.dtype.itemsize
        if any(s % item for s in x.strides):
            raise ValueError(f"{name}: strides {x.strides} (bytes) are not multiples of the element size {item}")
        dname = x.dtype.name
        return Array(
            "cupy",
            x,
            x.data.ptr,
            tuple(x.shape),
            tuple(s // item for s in x.strides),
            _DTYPES.get(dname),
            dname,
            x.device.id,
        )
    if type(x).__module__ == "numpy":
        raise TypeError(
            f"{name}: expected a CuPy array or a PyTorch CUDA tensor, got a NumPy array "
            "(host memory); copy it to the GPU first (cupy.asarray)"
        )
    raise TypeError(f"{name}: expected a CuPy array or a PyTorch CUDA tensor, got {type(x).__name__}")


def empty(like: Array, shape, *, float32: bool = False):
    """A new array of `shape`, same library and device as `like`; dense in like's memory order when the
    shapes agree (so a [B, N, H, D] view gives an output laid out the same way)."""
    if like.kind == "torch":
        import torch

        if tuple(like.shape) == tuple(shape) and not float32:
            return torch.empty_like(like.obj)
        return torch.empty(shape, dtype=torch.float32 if float32 else like.obj.dtype, device=like.obj.device)
    import cupy

    with cupy.cuda.Device(like.device):
        if tuple(like.shape) == tuple(shape) and not float32:
            return cupy.empty_like(like.obj)
        return cupy.empty(shape, dtype=cupy.float32 if float32 else like.obj.dtype)


def dense_copy(x):
    """A copy of a torch or CuPy array in fresh, contiguous memory (so 16-byte aligned, with positive strides):
    for an input no tier's kernel can read as it is."""
    if library(x) == "torch":
        import torch

        return x.clone(memory_format=torch.contiguous_format)
    import cupy

    with cupy.cuda.Device(x.device.id):
        return cupy.array(x, order="C", copy=True)


def copy_into(into, x):
    """x's values written into the array `into` (of x's shape), on the caller's stream; returns `into`."""
    if library(into) == "torch":
        return into.copy_(x)
    import cupy

    with cupy.cuda.Device(into.device.id):
        into[...] = x
    return into


def as_bhsd(x):
    """[total, H, D] as a [1, H, total, D] view (no copy)."""
    lib = library(x)
    if lib == "torch":
        return x.permute(1, 0, 2).unsqueeze(0)
    if lib == "cupy":
        return x.transpose(1, 0, 2)[None]
    raise TypeError(f"expected a CuPy array or a PyTorch CUDA tensor, got {type(x).__name__}")


def from_bhsd(x):
    return x[0].permute(1, 0, 2) if library(x) == "torch" else x[0].transpose(1, 0, 2)


def current_stream(x) -> int | None:
    """The caller's current stream on the device of x (a CUDA tensor or CuPy array) as a raw handle; None for
    anything else (describe then says what was expected)."""
    lib = library(x)
    if lib == "torch":
        import torch

        device = x.get_device()
        if device < 0:
            return None
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        return raw(device) if raw is not None else torch.cuda.current_stream(device).cuda_stream
    if lib == "cupy":
        import cupy

        return cupy.cuda.get_current_stream(x.device.id).ptr
    return None


def stream_getter(a: Array):
    """A function returning the caller's current stream on a's device as a raw handle, bound once: the
    launch is ordered with the caller's work, and captured into a CUDA graph when the caller captures one."""
    device = a.device
    if a.kind == "torch":
        import torch

        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        if raw is not None:
            return lambda: raw(device)
        return lambda: torch.cuda.current_stream(device).cuda_stream
    import cupy

    return lambda: cupy.cuda.get_current_stream(device).ptr
