"""The call-shape cache every op shares, and what each call does beside its checks.

An op checks a call's arguments and packs its kernels' arguments once per call shape (the shapes, strides,
dtypes, devices and alignment of its arrays, and the op's own flags), and keeps the result, a prepared call,
in its kernel's `CallCache`; a repeated call only allocates its outputs, writes the new addresses and launches.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ..backend.contract import TensorArg
from . import arrays
from .arrays import Array

MAX_CALL_SHAPES = 256  # past this many prepared calls, the cache starts over


class CallCache:
    """A kernel's prepared calls by call shape, shared by its ops (forward, backward, decode), at most
    MAX_CALL_SHAPES + 1 of them. A call made inside a CUDA-graph capture gets a prepared call of its own,
    never a shared one, kept alive as long as the kernel (the graph reads its workspaces on every replay)."""

    def __init__(self) -> None:
        self._entries: dict = {}
        self.captured: list = []  # the prepared calls of captured calls

    @staticmethod
    def key(given: tuple, tensors: dict, *flags) -> tuple:
        """What decides a call's checks, tier and static arguments: the op's `flags` (its name, its options, the
        stream), the tensors' names, and the shape, strides, dtype, device and alignment of each array given
        (None where an optional one is not)."""
        return flags, tuple(tensors), tuple([_key_part(x) for x in given] + [_key_part(x) for x in tensors.values()])

    def get(self, key: tuple, prepare: Callable[..., Any], *args, captured: bool = False) -> Any:
        """The prepared call of `key`, made by prepare(*args) on first need (and every time when `captured`)."""
        if captured:
            entry = prepare(*args)
            self.captured.append(entry)
            return entry
        entry = self._entries.get(key)
        if entry is None:
            entry = prepare(*args)
            if len(self._entries) > MAX_CALL_SHAPES:
                self._entries.clear()
            self._entries[key] = entry
        return entry

    def values(self):
        """The prepared calls kept by call shape (not those of captured calls)."""
        return self._entries.values()


def _key_part(x):
    if x is None:
        return None
    lib = arrays.library(x)
    if lib == "torch":  # get_device(): the index as an int (-1 on the host), cheaper than a torch.device
        return (x.shape, x.stride(), x.dtype, x.get_device(), x.data_ptr() & 15)
    if lib == "cupy":
        return (x.shape, x.strides, x.dtype, x.device.id, x.data.ptr & 15)
    return type(x)


def tensor_values(args: tuple[TensorArg, ...], described: dict[str, Array]) -> dict:
    """The static arguments of the call-time tensors: each one's element strides and sizes."""
    values: dict = {}
    for arg in args:
        t = described[arg.name]
        values.update(zip(arg.strides(), t.strides))
        values.update(zip(arg.sizes(), t.shape))
    return values


def ptr(x) -> int:
    """The device address of a torch or CuPy array."""
    return x.data_ptr() if arrays.library(x) == "torch" else x.data.ptr


def zeros(like: Array, shape, dtype: str = "float32"):
    """An array of zeros (float32, or `dtype`: a name both libraries know) on like's device and library."""
    if like.kind == "torch":
        import torch

        return torch.zeros(shape, dtype=getattr(torch, dtype), device=like.obj.device)
    import cupy

    with cupy.cuda.Device(like.device):
        return cupy.zeros(shape, dtype=dtype)


@functools.cache
def _capture_query():
    """CuPy's cudaStreamIsCapturing and its 'not capturing' status, bound once (a call asks on every launch)."""
    from cupy.cuda import runtime

    return runtime.streamIsCapturing, runtime.streamCaptureStatusNone


def capturing(stream: int) -> bool:
    """Whether `stream` (a raw handle) is capturing a CUDA graph."""
    is_capturing, none = _capture_query()
    return is_capturing(stream) != none


def requires_grad(q, k, v, tensors) -> bool:
    """Whether grad mode is on and an input requires grad."""
    if not (
        getattr(q, "requires_grad", False)
        or getattr(k, "requires_grad", False)
        or getattr(v, "requires_grad", False)
        or any(getattr(x, "requires_grad", False) for x in tensors.values())
    ):
        return False
    import torch

    return torch.is_grad_enabled()
