"""The compile-result cache: a whole `fagen.compile` kept on disk, so a later process gets its kernel back
without SymPy, networkx, Jinja, CuPy or NVRTC.

An entry is keyed by the normalized request (head dim, dtype, arch, tier and the program: the options for a
program built from options, the text for an .ir program or a Program, the traced program's text for
mask=/score_mod= functions) and by what could change the answer: fagen's version and a fingerprint of its
own files (the package's modules, tuned.json, the templates and the shipped programs), the tier modules'
settings as they stand in the process (a script may set them: `bench/ab.py --set`), SymPy's version (the
prover) and the installed CuPy and NVRTC distributions (NVRTC's version is CuPy's to read, and importing
CuPy is what a hit must not do). The entry holds each launch's spec and rendered source (a forward kernel has
one launch, a decode op two, a backward four), the metadata (default scale, tier reason, call-time tensors and
what each is indexed by, the fused program's text; a backward's tensor-gradient slots) and the statements SymPy
proved; the cubins and their resources stay in build.py's cache, which the entry names and whose hash check it
goes through. A backward is keyed by its forward kernel's program text, variant and tier. Entries are written
atomically (temporary file + rename); one that does not parse, names a missing or corrupt cubin or disagrees with
its key is rebuilt.

Traced Python functions are still traced (with SymPy) on every compile, since the function, not its
text, is what the user passes: only the steps after tracing (fusion, proofs, render, NVRTC) are cached.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

from .backend import build, tiers
from .backend.spec import KernelSpec
from .store import atomic_write, default_cache_dir, fingerprint, sympy_version
from .version import __version__

FORMAT = 3  # 3: an entry holds a list of launches (a forward's one, a decode's two, a backward's four)
_PLAIN = (bool, int, float, str, type(None))


def plain(value) -> bool:
    """A value JSON spells unambiguously (so that equal spellings mean equal requests)."""
    if isinstance(value, (tuple, list)):
        return all(isinstance(v, _PLAIN) for v in value)
    return isinstance(value, _PLAIN)


def request(dim: int, dtype: str | None, arch: str, tier, program: dict | None, tensor_dtypes=None) -> dict | None:
    """An entry's key: the head dim, dtype, arch, tier and the program as plain values (a Request's, or a kernel's
    own for its fallback and its backward); `tensor_dtypes` (the call-time tensors' dtypes other than float32) join
    it where there are any. None where the program or the tier is not spelled in plain values."""
    if program is None or not plain(tier):
        return None
    req = dict(dim=dim, dtype=dtype, arch=arch, tier=tier, program=program)
    if tensor_dtypes:
        req["tensor_dtypes"] = sorted(tensor_dtypes.items())
    return req


@functools.lru_cache(maxsize=1)
def toolchain() -> tuple[str, ...]:
    """The installed CuPy and NVRTC distributions (names with versions) beside CuPy, and CUDA_PATH."""
    import importlib.util

    spec = importlib.util.find_spec("cupy")
    found = []
    if spec is not None and spec.origin:
        site = Path(spec.origin).parent.parent
        try:
            found = sorted(
                n
                for n in os.listdir(site)
                if n.endswith((".dist-info", ".egg-info"))
                and n.lower().replace("-", "_").startswith(("cupy", "nvidia_cuda_nvrtc"))
            )
        except OSError:
            pass
    return (*found, "CUDA_PATH=" + os.environ.get("CUDA_PATH", ""))


def key(req: dict) -> str:
    env = dict(
        format=FORMAT,
        fagen=__version__,
        files=fingerprint(),
        sympy=sympy_version(),
        toolchain=toolchain(),
        settings=tiers.settings(),
    )
    return hashlib.sha256(json.dumps([req, env], sort_keys=True).encode()).hexdigest()


def _path(cache_dir, k: str) -> Path:
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return cache / "compiled" / f"{k[:32]}.json"


def _launch_entry(spec, source: str, binary) -> dict:
    return dict(
        spec=spec.to_dict(),
        name=spec.name,
        source=source,
        source_sha256=hashlib.sha256(source.encode()).hexdigest(),
        binary=dict(key=binary.key),
    )


def _read_launch(d: dict, root: Path):
    """(KernelSpec, source, Binary) of a launch entry, or None where its source fails its hash or its cubin is
    missing or corrupt in build's cache under `root`."""
    source = d["source"]
    if hashlib.sha256(source.encode()).hexdigest() != d["source_sha256"]:
        return None
    spec = tiers.check(KernelSpec(**d["spec"]))  # read back, checked as the planner's are
    binary = build.read_binary(build.entry_base(root, spec.name, d["binary"]["key"]), d["binary"]["key"])
    return None if binary is None else (spec, source, binary)


def load(req: dict, cache_dir=None) -> dict | None:
    """The entry for `req`, its "launches" a list of (KernelSpec, source, Binary) (the Binary from build's
    cache), "tensors" rows of contract.TensorArg fields, and the fields `store` was given; or None: missing, corrupt,
    or for another key."""
    k = key(req)
    path = _path(cache_dir, k)
    try:
        entry = json.loads(path.read_text())
        if not isinstance(entry, dict) or entry.get("key") != k or entry.get("format") != FORMAT:
            return None
        launches = [_read_launch(d, path.parent.parent) for d in entry["launches"]]
        if not launches or None in launches:
            return None
        entry["launches"] = launches
        return entry
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def store(req: dict, cache_dir, launches, *, tensors=(), proofs=(), **fields) -> None:
    """Write the entry for `req` (atomically): its `launches` as (spec, source, Binary) (the cubins stay in build's
    cache), the call-time `tensors` (contract.TensorArg), the statements proven, and `fields` (plain values: the
    default scale, the tier's reason, the fused program's text ...). An unwritable cache costs a rebuild next
    time, nothing else."""
    k = key(req)
    path = _path(cache_dir, k)
    entry = dict(
        format=FORMAT,
        key=k,
        request=req,
        launches=[_launch_entry(*launch) for launch in launches],
        tensors=[[t.name, t.dtype, t.rank, t.grad, t.dims] for t in tensors],
        proofs=list(proofs),
        **fields,
        versions=dict(fagen=__version__, sympy=sympy_version(), nvrtc=launches[0][2].nvrtc_version),
    )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps(entry, indent=1).encode())
    except OSError:
        pass
