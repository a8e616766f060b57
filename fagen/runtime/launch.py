"""Launching a compiled kernel: load its cubin once per device, pack its arguments from the contract.

The argument buffer is built from the kernel kind's parameter list (fagen.backend.contract) — the same list
the template rendered the signature from — once per call shape, and reused: a call only writes the new
device addresses into it and calls cuLaunchKernel on the caller's stream. That keeps the host cost of a
call to a few microseconds and makes calls capturable into CUDA graphs.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import Any

from ..backend.contract import Param

_CTYPES: dict[str, type] = {
    "ptr": ctypes.c_uint64,
    "i64": ctypes.c_int64,
    "i32": ctypes.c_int32,
    "f32": ctypes.c_float,
    "tmap": ctypes.c_ubyte * 128,  # a TMA tensor map, passed by value
}


class ArgPack:
    """Storage for one launch's arguments, in the parameter list's order."""

    def __init__(self, params: tuple[Param, ...]):
        self.params = params
        self.values = [_CTYPES[p.pack]() for p in params]
        self.index = {p.name: i for i, p in enumerate(params)}
        self.pointers = (ctypes.c_void_p * len(params))(*[ctypes.addressof(v) for v in self.values])
        self.address = ctypes.addressof(self.pointers)
        self.lock = threading.Lock()

    def set(self, values: dict) -> None:
        """Write arguments by name; every parameter must be given (a missing one is a bug, not a zero), but for
        tensor maps, which their tier fills (Tier.prepare)."""
        missing = [p.name for p in self.params if p.name not in values and p.pack != "tmap"]
        extra = [n for n in values if n not in self.index]
        if missing or extra:
            raise TypeError(
                f"internal: arguments do not match the kernel's parameters (missing {missing}, unknown {extra})"
            )
        for name, value in values.items():
            self.values[self.index[name]].value = value

    def update(self, values: dict) -> None:
        for name, value in values.items():
            self.values[self.index[name]].value = value


class Function:
    """A kernel of a cubin, loaded on each device it is called on."""

    def __init__(self, cubin: bytes, name: str, smem_bytes: int):
        self.cubin, self.name, self.smem_bytes = cubin, name, smem_bytes
        self._handles: dict[int, tuple[int, int]] = {}
        self._launch: Callable[..., Any] | None = None  # cupy.cuda.driver.launchKernel, bound on first launch
        self._current: Callable[[], int] | None = None  # cupy.cuda.runtime.getDevice

    def handle(self, device: int, arch_check) -> int:
        found = self._handles.get(device)
        if found is None:
            import cupy
            from cupy.cuda import driver

            with cupy.cuda.Device(device):
                cc = cupy.cuda.Device(device).compute_capability  # e.g. "90"
                arch_check(int(cc[:-1]), int(cc[-1]), device)
                module = driver.moduleLoadData(self.cubin)
                fn = driver.moduleGetFunction(module, self.name)
                driver.funcSetAttribute(fn, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, self.smem_bytes)
            found = self._handles[device] = (module, fn)
        return found[1]

    def launch(self, device: int, stream: int, grid, block: int, pack: ArgPack, arch_check) -> None:
        found = self._handles.get(device)
        fn = found[1] if found is not None else self.handle(device, arch_check)
        if self._launch is None or self._current is None:
            from cupy.cuda import driver, runtime

            self._launch, self._current = driver.launchKernel, runtime.getDevice
        if self._current() != device:  # the function's context must be current
            import cupy

            with cupy.cuda.Device(device):
                self._launch(fn, grid[0], grid[1], grid[2], block, 1, 1, self.smem_bytes, stream, pack.address, 0)
            return
        self._launch(fn, grid[0], grid[1], grid[2], block, 1, 1, self.smem_bytes, stream, pack.address, 0)
