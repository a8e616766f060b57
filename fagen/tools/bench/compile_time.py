"""Compile time and host cost: `import fagen` and a compile, each in a fresh process (cold, cached, a never-seen
variant), and the host time of a tiny call where launching dominates, fagen against SDPA."""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from .. import testing
from . import timing

# Run in a fresh process: the time to `import fagen` and to compile one kernel, as JSON on the last line.
_COMPILE_PROBE = """
import json, sys, time
t0 = time.perf_counter()
import fagen
from fagen import request
t1 = time.perf_counter()
arch = request.detect_arch()  # the CUDA driver's start (cuInit), which a process using the GPU pays once
ta = time.perf_counter()
k = fagen.compile({dim}, causal={causal!r}, dtype={dtype!r}, tier={tier!r}, arch=arch, **{variant!r})
t2 = time.perf_counter()
print(json.dumps(dict(kernel=k.name, import_s=t1 - t0, driver_s=ta - t1, compile_s=t2 - ta, nvrtc_s=k.compile_seconds,
                      cached=k.binary.cached, registers=k.resources.registers,
                      stack_frame=k.resources.stack_frame, sympy="sympy" in sys.modules,
                      bytecode_cache=not sys.dont_write_bytecode)))
"""


_NO_PYC = "off (PYTHONDONTWRITEBYTECODE: every import compiles its modules)"


def pyc_text(c: dict) -> str:
    """How the probes got Python's bytecode, in words."""
    if c["pyc_prefix"]:
        return "written by a first untimed probe into a shared folder (this interpreter writes none), as pip does"
    return "on" if c["bytecode_cache"] else _NO_PYC


def probe_code(dim, causal, dtype, tier=None, variant=None) -> str:
    """The probe's Python source for one kernel."""
    return _COMPILE_PROBE.format(dim=int(dim), causal=causal, dtype=str(dtype), tier=tier, variant=dict(variant or {}))


def compile_in_fresh_process(code: str, cache_dir, timeout=600, pyc_dir=None) -> dict:
    """Run a probe in a new interpreter with NVRTC's own cache off and `cache_dir` as fagen's cache, so a
    cold compile is cold all the way down (CUDA_CACHE_DISABLE=1: ptxas runs), and time it from outside too.
    `pyc_dir`: Python's bytecode cache for the probe (PYTHONPYCACHEPREFIX), for an interpreter that writes none
    (PYTHONDONTWRITEBYTECODE)."""
    import json
    import os
    import subprocess

    import fagen

    root = str(Path(fagen.__file__).resolve().parents[1])  # the folder holding the fagen package
    env = {
        **os.environ,
        "CUDA_CACHE_DISABLE": "1",
        "FAGEN_CACHE_DIR": str(cache_dir),
        "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
    }
    if pyc_dir is not None:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(pyc_dir)
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"compile probe failed: {r.stderr.strip().splitlines()[-1:] or r.returncode}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["process_s"] = wall
    return out


def compile_times(dims=(64, 128, 256), causal=(False, True), dtype="bf16", tier=None, variant=None) -> list[dict]:
    """Per kernel, each in a fresh process: cold (empty fagen cache, CUDA_CACHE_DISABLE=1), then cached (the
    same cache, a new process: what a user's second run pays), then a never-seen variant (the same cache, a
    softcap value no process compiled before: its own proofs, render and NVRTC; the proofs of the online-softmax
    state come from the cache's proof memo, as on any machine that compiled one kernel before).

    Where this interpreter writes no bytecode (PYTHONDONTWRITEBYTECODE, as on the lent GPU machines), every
    probe would compile SymPy's and CuPy's modules from source, which no pip-installed environment does: the
    probes then share a bytecode folder that a first, untimed probe fills."""
    import random

    out = []
    with tempfile.TemporaryDirectory() as pyc:
        pyc_dir = pyc if sys.dont_write_bytecode else None
        if pyc_dir is not None:
            with tempfile.TemporaryDirectory() as tmp:
                compile_in_fresh_process(probe_code(64, False, dtype, tier, {"softcap": 7.0}), tmp, pyc_dir=pyc_dir)
        for D in dims:
            for c in causal:
                with tempfile.TemporaryDirectory() as tmp:
                    code = probe_code(D, c, dtype, tier, variant)
                    cold = compile_in_fresh_process(code, tmp, pyc_dir=pyc_dir)
                    cached = compile_in_fresh_process(code, tmp, pyc_dir=pyc_dir)
                    fresh = {**dict(variant or {}), "softcap": round(random.uniform(5, 50), 3)}
                    new = compile_in_fresh_process(probe_code(D, c, dtype, tier, fresh), tmp, pyc_dir=pyc_dir)
                out.append(_record(cold, cached, new, pyc_dir is not None))
    return out


def _record(cold: dict, cached: dict, new: dict, pyc_prefix: bool) -> dict:
    """One kernel's figures from its three probes (rounded for the report)."""
    return dict(
        kernel=cold["kernel"],
        cold_s=round(cold["compile_s"], 3),
        nvrtc_s=round(cold["nvrtc_s"], 3),
        new_variant=new["kernel"],
        new_s=round(new["compile_s"], 3),
        new_nvrtc_s=round(new["nvrtc_s"], 3),
        new_import_s=round(new["import_s"], 3),
        new_driver_s=round(new["driver_s"], 3),
        cached_s=round(cached["compile_s"], 4),
        cached_hit=cached["cached"],
        cached_sympy=cached["sympy"],
        import_s=round(cached["import_s"], 4),
        driver_s=round(cached["driver_s"], 4),
        bytecode_cache=cold["bytecode_cache"],
        pyc_prefix=pyc_prefix,
        cold_process_s=round(cold["process_s"], 3),
        cached_process_s=round(cached["process_s"], 3),
        new_process_s=round(new["process_s"], 3),
        registers=cold["registers"],
        stack_frame=cold["stack_frame"],
    )


def host_overhead(D=128, dtype="bf16", n=1000) -> dict:
    """Per-call cost of a tiny problem (B=1, H=1, M=N=128), where launching dominates: fagen vs SDPA."""
    import fagen

    torch = testing._torch()
    q, k, v = testing.random_qkv(1, 1, 128, 128, D, dtype)
    import torch.nn.functional as F

    kern = fagen.compile(D, causal=False, dtype=dtype)
    sync = torch.cuda.synchronize
    return dict(
        shape=f"B=1 H=1 M=N=128 D={D} {dtype}",
        calls=n,
        fagen_us=round(timing.per_call_seconds(lambda: kern(q, k, v), sync, n) * 1e6, 1),
        sdpa_us=round(timing.per_call_seconds(lambda: F.scaled_dot_product_attention(q, k, v), sync, n) * 1e6, 1),
    )
