"""NVRTC (its C API, `nvrtc.py`): source → cubin, with no GPU needed, and an on-disk cache.

NVRTC releases the GIL while it compiles, so `compile_cubins` runs several compiles at once (the backward's
four kernels), and the proofs run beside it.

The cache is keyed by the source, the options, the NVRTC version, the arch and fagen's version. Entries
are written atomically (temporary file + rename), so processes compiling at once never see half a file;
an entry whose cubin does not match its recorded hash is rebuilt. `FAGEN_CACHE_DIR` moves the cache.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from ..store import atomic_write, default_cache_dir
from ..version import __version__
from . import nvrtc
from .spec import KernelSpec


class CompileError(RuntimeError):
    """NVRTC rejected the source; carries the compiler log."""


@dataclass(frozen=True)
class Resources:
    """A kernel's resources, read from the cubin itself (and ptxas's log for the spill byte counts).

    NVRTC honours the CUDA compute cache: on a cache hit ptxas does not run and its report is absent from
    the log. The cubin always says how many registers and how large a stack frame (where spills live) the
    kernel has, so those come from its ELF; spill byte counts exist only in the log (None without it).
    """

    registers: int
    stack_frame: int
    static_smem: int
    spill_stores: int | None = None
    spill_loads: int | None = None

    @property
    def spills(self) -> bool:
        return self.stack_frame > 0 or bool(self.spill_stores) or bool(self.spill_loads)

    def __str__(self):
        spill = (
            "spills n/a (no ptxas report)"
            if self.spill_stores is None
            else f"{self.spill_stores} B spill stores, {self.spill_loads} B spill loads"
        )
        return (
            f"{self.registers} registers, {spill}, {self.stack_frame} B stack frame, "
            f"{self.static_smem} B static shared memory"
        )


_EIATTR_REGCOUNT, _EIATTR_FRAME_SIZE = 0x2F, 0x11


def _elf_sections(cubin: bytes) -> dict:
    (shoff,) = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    raw = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names_off = raw[shstrndx][4]
    out = {}
    for name, typ, _flags, _addr, off, size, link, _info, _align, _entsize in raw:
        key = cubin[names_off + name :].split(b"\0", 1)[0].decode()
        out[key] = dict(type=typ, off=off, size=size, link=link)
    return out


def elf_resources(cubin: bytes, kernel: str) -> tuple[int, int, int]:
    """(registers, stack frame bytes, static shared memory bytes) of `kernel` from the cubin's ELF: the
    global .nv.info section holds per-symbol attributes (REGCOUNT 0x2f, FRAME_SIZE 0x11)."""
    try:
        secs = _elf_sections(cubin)
        symtab = next(s for s in secs.values() if s["type"] == 2)  # SHT_SYMTAB
        strtab = list(secs.values())[symtab["link"]]
        index = None
        for i in range(symtab["size"] // 24):
            (st_name,) = struct.unpack_from("<I", cubin, symtab["off"] + 24 * i)
            if cubin[strtab["off"] + st_name :].split(b"\0", 1)[0].decode() == kernel:
                index = i
        info = secs[".nv.info"]
        attrs, pos = {}, info["off"]
        while pos < info["off"] + info["size"]:
            fmt, attr, size = struct.unpack_from("<BBH", cubin, pos)
            if fmt == 0x04 and size == 8:
                sym, value = struct.unpack_from("<II", cubin, pos + 4)
                if sym == index:
                    attrs[attr] = value
            pos += 4 + (size if fmt == 0x04 else 0)
        smem = secs.get(f".nv.shared.{kernel}", {}).get("size", 0)
        return attrs[_EIATTR_REGCOUNT], attrs.get(_EIATTR_FRAME_SIZE, 0), smem
    except (struct.error, StopIteration, KeyError, UnicodeDecodeError) as e:
        raise CompileError(f"cannot read the resource attributes of {kernel} from its cubin ({e!r})") from None


@dataclass(frozen=True)
class Binary:
    cubin: bytes
    log: str
    resources: Resources
    compile_seconds: float  # NVRTC time when built; the load time when it came from the cache
    cached: bool
    key: str
    nvrtc_version: str
    options: tuple[str, ...]


def nvrtc_version() -> str:
    try:
        major, minor = nvrtc.version()
    except nvrtc.NvrtcError as e:
        raise CompileError(str(e)) from None
    return f"{major}.{minor}"


def options(spec: KernelSpec) -> tuple[str, ...]:
    """NVRTC's options. `-default-device`: a function without an execution space is a device function, as a
    generic lambda's call operator in a kernel (the wide wgmma backward's per-warpgroup step loop): NVRTC 13.0 takes
    it for a host function and refuses it, 13.5 does not."""
    return (f"--gpu-architecture={spec.arch}", "--std=c++17", "-default-device", "--ptxas-options=--verbose")


def parse_resources(log: str, cubin: bytes, kernel: str) -> Resources:
    registers, stack, smem = elf_resources(cubin, kernel)
    stores = re.search(r"(\d+) bytes spill stores", log)
    loads = re.search(r"(\d+) bytes spill loads", log)
    return Resources(
        registers, stack, smem, int(stores.group(1)) if stores else None, int(loads.group(1)) if loads else None
    )


def _nvrtc(source: str, name: str, opts: tuple[str, ...], *, ptx: bool = False) -> tuple[bytes, str]:
    try:
        return nvrtc.compile_program(source, f"{name}.cu", opts, ptx=ptx)
    except nvrtc.NvrtcError as e:
        if not e.log:
            raise CompileError(str(e)) from None
        raise CompileError(f"NVRTC failed to compile {name} ({e}):\n{e.log}") from None


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


def entry_base(cache: Path, name: str, key: str) -> Path:
    """Where the entry of kernel `name` with cache key `key` lives (plus .cubin / .json)."""
    return cache / f"{name}-{key[:16]}"


def read_binary(base: Path, key: str) -> Binary | None:
    """The cached Binary at `base` if its entry is valid and has this key, else None (no NVRTC involved)."""
    t0 = time.perf_counter()
    entry = _read_entry(base)
    if entry is None or entry[1].get("key") != key:
        return None
    cubin, meta = entry
    try:
        return Binary(
            cubin,
            meta["log"],
            Resources(**meta["resources"]),
            time.perf_counter() - t0,
            True,
            key,
            meta["nvrtc_version"],
            tuple(meta["options"]),
        )
    except (KeyError, TypeError):
        return None


def compile_cubins(
    jobs: Sequence[tuple[str, KernelSpec]],
    *,
    cache_dir: Path | None = None,
    use_cache: bool = True,
    meanwhile: Callable[[], object] | None = None,
) -> list[Binary]:
    """compile_cubin for each (source, spec), their NVRTC runs at once in threads (NVRTC releases the GIL). The
    binaries come back in the order of `jobs`; the first error raises. `meanwhile`: called on this thread while
    NVRTC runs (the pipeline proves the rewrite the sources were printed from); if it raises, its error is
    raised once the compiles have ended."""
    if len(jobs) == 1 and meanwhile is None:
        return [compile_cubin(*jobs[0], cache_dir=cache_dir, use_cache=use_cache)]
    from concurrent.futures import ThreadPoolExecutor  # here: cache.py imports this module on every hit

    nvrtc_version()  # import the binding once, here, not in each thread
    with ThreadPoolExecutor(max_workers=len(jobs), thread_name_prefix="fagen-nvrtc") as pool:
        futures = [
            pool.submit(compile_cubin, src, spec, cache_dir=cache_dir, use_cache=use_cache) for src, spec in jobs
        ]
        if meanwhile is not None:
            meanwhile()
        return [f.result() for f in futures]


def compile_cubin(source: str, spec: KernelSpec, *, cache_dir: Path | None = None, use_cache: bool = True) -> Binary:
    opts = options(spec)
    version = nvrtc_version()
    key = cache_key(source, opts, version)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    base = entry_base(cache, spec.name, key)
    if use_cache and (hit := read_binary(base, key)) is not None:
        return hit
    t0 = time.perf_counter()
    cubin, log = _nvrtc(source, spec.name, opts)
    seconds = time.perf_counter() - t0
    resources = parse_resources(log, cubin, spec.name)
    if use_cache:
        try:
            cache.mkdir(parents=True, exist_ok=True)
            atomic_write(base.with_suffix(".cubin"), cubin)
            meta = dict(
                key=key,
                log=log,
                resources=asdict(resources),
                compile_seconds=seconds,
                nvrtc_version=version,
                options=list(opts),
                cubin_sha256=hashlib.sha256(cubin).hexdigest(),
            )
            atomic_write(base.with_suffix(".json"), json.dumps(meta, indent=1).encode())
        except OSError:
            pass  # an unwritable cache costs a recompile next time, nothing else
    return Binary(cubin, log, resources, seconds, False, key, version, opts)
