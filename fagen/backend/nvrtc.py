"""NVRTC's C API through ctypes, on the library cuda-pathfinder finds (the one CuPy loads too).

A compile needs no GPU and no CuPy: importing CuPy costs 0.15-0.3 s, which this way runs beside NVRTC (or
not at all, for `fagen compile`) instead of before it. ctypes releases the GIL during each call, so
compiles in threads run at once. Where cuda-pathfinder is missing, CuPy's own binding of the same library
is used.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path


class NvrtcError(RuntimeError):
    """An NVRTC call failed; `code` is its nvrtcResult and `log` the program log where there is one."""

    def __init__(self, message: str, code: int = -1, log: str = ""):
        super().__init__(message)
        self.code, self.log = code, log


@functools.cache
def _library():
    """The loaded libnvrtc (ctypes), or None where cuda-pathfinder is not installed. `FAGEN_NVRTC_LIBRARY` names
    another libnvrtc.so to use (CI compiles every kind of kernel with the oldest NVRTC fagen supports)."""
    path = os.environ.get("FAGEN_NVRTC_LIBRARY")
    try:
        if path:
            for builtins in sorted(Path(path).parent.glob("libnvrtc-builtins.so.*")):  # it opens them by name
                ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
            lib = ctypes.CDLL(path)
        else:
            try:
                from cuda.pathfinder import load_nvidia_dynamic_lib
            except ImportError:
                return None
            lib = ctypes.CDLL(load_nvidia_dynamic_lib("nvrtc").abs_path)
    except Exception as e:  # DynamicLibNotFoundError, OSError
        where = f"FAGEN_NVRTC_LIBRARY={path}: " if path else ""
        raise NvrtcError(f"{where}NVRTC is not available ({e}); install nvidia-cuda-nvrtc") from None
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    return lib


def _check(lib, result: int, what: str) -> None:
    if result != 0:
        raise NvrtcError(f"{what}: {lib.nvrtcGetErrorString(result).decode()} ({result})", result)


def version() -> tuple[int, int]:
    lib = _library()
    if lib is None:
        from cupy.cuda import nvrtc

        return tuple(nvrtc.getVersion())
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check(lib, lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    return major.value, minor.value


def _strings(items) -> ctypes.Array:
    return (ctypes.c_char_p * len(items))(*(s.encode() for s in items))


def compile_program(source: str, filename: str, options: tuple[str, ...], *, ptx: bool = False) -> tuple[bytes, str]:
    """(cubin, or PTX where `ptx`; the program log). A rejected source raises NvrtcError with the log."""
    lib = _library()
    if lib is None:
        return _compile_cupy(source, filename, options, ptx=ptx)
    prog = ctypes.c_void_p()
    _check(
        lib,
        lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), filename.encode(), 0, None, None),
        "nvrtcCreateProgram",
    )
    try:
        result = lib.nvrtcCompileProgram(prog, len(options), _strings(options))
        size = ctypes.c_size_t()
        _check(lib, lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size)), "nvrtcGetProgramLogSize")
        buf = ctypes.create_string_buffer(size.value)
        _check(lib, lib.nvrtcGetProgramLog(prog, buf), "nvrtcGetProgramLog")
        log = buf.raw.rstrip(b"\0").decode(errors="replace")
        if result != 0:
            raise NvrtcError(f"{lib.nvrtcGetErrorString(result).decode()} ({result})", result, log)
        get_size, get = (lib.nvrtcGetPTXSize, lib.nvrtcGetPTX) if ptx else (lib.nvrtcGetCUBINSize, lib.nvrtcGetCUBIN)
        _check(lib, get_size(prog, ctypes.byref(size)), "the output's size")
        buf = ctypes.create_string_buffer(size.value)
        _check(lib, get(prog, buf), "the output")
        return (buf.raw.rstrip(b"\0") if ptx else buf.raw), log
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _compile_cupy(source: str, filename: str, options: tuple[str, ...], *, ptx: bool) -> tuple[bytes, str]:
    from cupy.cuda import nvrtc

    prog = nvrtc.createProgram(source, filename, [], [])
    try:
        try:
            nvrtc.compileProgram(prog, list(options))
        except nvrtc.NVRTCError as e:
            raise NvrtcError(str(e), -1, nvrtc.getProgramLog(prog).rstrip("\x00")) from None
        log = nvrtc.getProgramLog(prog).rstrip("\x00")
        if ptx:
            text = nvrtc.getPTX(prog)
            return (text if isinstance(text, bytes) else text.encode()).rstrip(b"\x00"), log
        return nvrtc.getCUBIN(prog), log
    finally:
        nvrtc.destroyProgram(prog)
