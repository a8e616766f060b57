"""NVRTC through CuPy's low-level binding: source → cubin, with no GPU needed, and an on-disk cache.

The cache is keyed by the source, the options, the NVRTC version, the arch and fagen's version. Entries
are written atomically (temporary file + rename), so processes compiling at once never see half a file;
an entry whose cubin does not match its recorded hash is rebuilt. `FAGEN_CACHE_DIR` moves the cache.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from . import __version__
from .spec import KernelSpec


class CompileError(RuntimeError):
    """NVRTC rejected the source; carries the compiler log."""


@dataclass(frozen=True)
class Resources:
    """ptxas's resource report for the kernel."""
    registers: int
    spill_stores: int
    spill_loads: int
    stack_frame: int
    static_smem: int

    def __str__(self):
        return (f"{self.registers} registers, {self.spill_stores} B spill stores, {self.spill_loads} B spill loads, "
                f"{self.stack_frame} B stack frame, {self.static_smem} B static shared memory")


@dataclass(frozen=True)
class Binary:
    cubin: bytes
    log: str
    resources: Resources
    compile_seconds: float    # NVRTC time when built; the load time when it came from the cache
    cached: bool
    key: str
    nvrtc_version: str
    options: tuple[str, ...]


def default_cache_dir() -> Path:
    env = os.environ.get("FAGEN_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fagen"


def nvrtc_version() -> str:
    from cupy.cuda import nvrtc
    major, minor = nvrtc.getVersion()
    return f"{major}.{minor}"


def options(spec: KernelSpec) -> tuple[str, ...]:
    return (f"--gpu-architecture={spec.arch}", "--std=c++17", "--ptxas-options=--verbose")


_RES = {
    "registers": r"Used (\d+) registers",
    "spill_stores": r"(\d+) bytes spill stores",
    "spill_loads": r"(\d+) bytes spill loads",
    "stack_frame": r"(\d+) bytes stack frame",
    "static_smem": r"(\d+) bytes smem",
}


def parse_resources(log: str) -> Resources:
    values = {}
    for key, pattern in _RES.items():
        m = re.search(pattern, log)
        values[key] = int(m.group(1)) if m else 0
    if not re.search(_RES["registers"], log):
        raise CompileError("no resource report in the NVRTC log (NVRTC 13.0 leaves it out after a front-end "
                           f"warning):\n{log.strip()[-2000:]}")
    return Resources(**values)


def _nvrtc(source: str, name: str, opts: tuple[str, ...], *, ptx: bool = False) -> tuple[bytes, str]:
    try:
        from cupy.cuda import nvrtc
    except ImportError as e:  # pragma: no cover - cupy is a dependency
        raise CompileError(f"CuPy's NVRTC binding is not importable: {e}") from None
    try:
        prog = nvrtc.createProgram(source, f"{name}.cu", [], [])
    except Exception as e:  # the NVRTC library itself is missing
        raise CompileError(f"NVRTC is not available ({e}); install nvidia-cuda-nvrtc") from None
    try:
        try:
            nvrtc.compileProgram(prog, list(opts))
        except nvrtc.NVRTCError as e:
            log = nvrtc.getProgramLog(prog).rstrip("\x00")
            raise CompileError(f"NVRTC failed to compile {name} ({e}):\n{log}") from None
        log = nvrtc.getProgramLog(prog).rstrip("\x00")
        if ptx:
            text = nvrtc.getPTX(prog)
            out = (text if isinstance(text, bytes) else text.encode()).rstrip(b"\x00")
        else:
            out = nvrtc.getCUBIN(prog)
        return out, log
    finally:
        nvrtc.destroyProgram(prog)


def compile_ptx(source: str, spec: KernelSpec) -> str:
    """PTX for the virtual arch (compute_XX), for --emit ptx."""
    arch = spec.arch.replace("sm_", "compute_")
    out, _ = _nvrtc(source, spec.name, (f"--gpu-architecture={arch}", "--std=c++17"), ptx=True)
    return out.decode()


def cache_key(source: str, opts: tuple[str, ...], version: str) -> str:
    h = hashlib.sha256()
    for part in (source, "\0".join(opts), version, __version__):
        h.update(part.encode())
        h.update(b"\1")
    return h.hexdigest()


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _read_entry(base: Path):
    """A valid cache entry as (cubin, meta), or None if missing or corrupt."""
    try:
        meta = json.loads(base.with_suffix(".json").read_text())
        cubin = base.with_suffix(".cubin").read_bytes()
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or meta.get("cubin_sha256") != hashlib.sha256(cubin).hexdigest():
        return None
    return cubin, meta


def compile_cubin(source: str, spec: KernelSpec, *, cache_dir: Path | None = None, use_cache: bool = True) -> Binary:
    opts = options(spec)
    version = nvrtc_version()
    key = cache_key(source, opts, version)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    base = cache / f"{spec.name}-{key[:16]}"
    if use_cache:
        t0 = time.perf_counter()
        entry = _read_entry(base)
        if entry is not None and entry[1].get("key") == key:
            cubin, meta = entry
            return Binary(cubin, meta["log"], Resources(**meta["resources"]), time.perf_counter() - t0, True,
                          key, version, opts)
    t0 = time.perf_counter()
    cubin, log = _nvrtc(source, spec.name, opts)
    seconds = time.perf_counter() - t0
    resources = parse_resources(log)
    if use_cache:
        try:
            cache.mkdir(parents=True, exist_ok=True)
            _atomic_write(base.with_suffix(".cubin"), cubin)
            meta = dict(key=key, log=log, resources=asdict(resources), compile_seconds=seconds,
                        nvrtc_version=version, options=list(opts), cubin_sha256=hashlib.sha256(cubin).hexdigest())
            _atomic_write(base.with_suffix(".json"), json.dumps(meta, indent=1).encode())
        except OSError:
            pass  # an unwritable cache costs a recompile next time, nothing else
    return Binary(cubin, log, resources, seconds, False, key, version, opts)
