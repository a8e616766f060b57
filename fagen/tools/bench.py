"""`fagen bench`: fagen side by side with PyTorch SDPA (FlashAttention-2 and cuDNN backends) and compiled
FlexAttention, in one process, on one GPU, with FlashAttention's convention (../shared/BENCH.md):
batch × seqlen = 16k tokens, heads × head dim = 2048, FLOPs = 4·B·H·N²·D, halved when causal.

Every output is checked against a float64 reference (on a slice of rows: all keys, a few heads) before it is
timed; a backend that fails the check is reported as such and not timed.
"""

from __future__ import annotations

import csv
import datetime
import math
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..pipeline import compile as fagen_compile
from . import testing

BACKENDS = ("fagen", "flash", "cudnn", "flex")
BACKEND_LABEL = {"fagen": "fagen", "flash": "SDPA flash (FA2)", "cudnn": "SDPA cuDNN", "flex": "FlexAttention"}


RELATIVE_OFFSET = 16384  # rel[h, q - k + 16384]: a table of 2 * 16384 + 1 entries a head, every N up to 16k


def _relative(s, b, h, q, k, rel):
    """A relative-position bias table, as FlexAttention's users write it: score + rel[h, q_idx - kv_idx + offset]."""
    return s + rel[h, q - k + RELATIVE_OFFSET]


# Variants benchmarked against FlexAttention on the same variant (SDPA has no fast path for them).
VARIANTS = {
    "none": dict(),
    "softcap": dict(softcap=30),
    "alibi": dict(alibi=True),
    "window": dict(window=256),
    "prefix": dict(prefix=1024),  # prefix-LM: the first 1024 keys seen by every query, causal after them
    "relative": dict(score_mod=_relative),
}
# these are benchmarked causal, as BENCH.md's table; prefix-LM is its own mask (no causal flag on top)
VARIANT_CAUSAL = {"window": (True,), "alibi": (True,), "prefix": (False,), "relative": (True,)}


def variant_tensors(variant: str, kernel, B: int, H: int) -> dict:
    """The call-time tensors of a variant's kernel: ALiBi's slopes and the like from testing.call_tensors; the
    relative-position table, random float32 values of magnitude ~0.1, at its full length."""
    if variant == "relative":
        torch = testing._torch()
        return {"rel": torch.randn(H, 2 * RELATIVE_OFFSET + 1, device="cuda") * 0.1}
    return testing.call_tensors(kernel, B, H)


@dataclass
class Row:
    backend: str
    dtype: str
    dim: int
    causal: bool
    seqlen: int
    batch: int
    heads: int
    ms: float = math.nan
    tflops: float = math.nan
    status: str = "ok"  # ok | failed check: ... | unavailable: ...
    variant: str = "none"
    err: float = math.nan
    bound: float = math.nan
    extra: dict = field(default_factory=dict)


def flops(B, H, N, D, causal):
    f = 4.0 * B * H * N * N * D
    return f / 2 if causal else f


def _timer(torch):
    try:
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=25, rep=100, return_mode="median")
    except ImportError:  # pragma: no cover - triton ships with torch on CUDA

        def bench(fn):
            for _ in range(5):
                fn()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            times = []
            for _ in range(30):
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            return float(np.median(times))

        return bench


def time_in_rounds(candidates: list, inputs: dict, timer, rounds: int) -> list[dict]:
    """{length: median ms} for each of `candidates` (callables of q, k, v) on `inputs` ({length: (q, k, v)}): `rounds`
    passes over all of them, pass r starting at candidate r (so none always runs after the same one)."""
    times = [{n: [] for n in inputs} for _ in candidates]
    for r in range(rounds):
        for i in range(len(candidates)):
            c = (r + i) % len(candidates)
            for n, (q, k, v) in inputs.items():
                times[c][n].append(timer(lambda f=candidates[c], q=q, k=k, v=v: f(q, k, v)))
    return [{n: statistics.median(ts) for n, ts in t.items()} for t in times]


class Peers:
    """The other implementations, as callables (q, k, v) -> o, or None where unavailable."""

    def __init__(self, torch):
        self.torch = torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        self.F, self.SDPBackend, self.sdpa_kernel = F, SDPBackend, sdpa_kernel
        self._flex = None
        self._masks = {}

    def sdpa(self, backend, causal):
        be = {
            "flash": self.SDPBackend.FLASH_ATTENTION,
            "cudnn": self.SDPBackend.CUDNN_ATTENTION,
            "math": self.SDPBackend.MATH,
        }[backend]

        def fn(q, k, v):
            with self.sdpa_kernel([be]):
                return self.F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        return fn

    def flex(self, causal, N, variant="none", tensors=None):
        torch = self.torch
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        if self._flex is None:
            torch._dynamo.config.cache_size_limit = 1024
            torch._dynamo.config.accumulated_cache_size_limit = 4096
            self._flex = torch.compile(flex_attention, dynamic=False)
        window, prefix = variant == "window", variant == "prefix"
        block_mask = None
        if causal or window or prefix:
            key = (N, causal, window, prefix)
            if key not in self._masks:

                def mask_mod(b, h, q_idx, kv_idx):
                    keep = q_idx >= kv_idx
                    if prefix:
                        return keep | (kv_idx < 1024)
                    return keep & (q_idx - kv_idx <= 256) if window else keep

                self._masks[key] = create_block_mask(mask_mod, None, None, N, N, device="cuda")
            block_mask = self._masks[key]

        def softcap(score, b, h, q_idx, kv_idx):
            return 30 * torch.tanh(score / 30)

        tensors = tensors or {}

        def alibi(score, b, h, q_idx, kv_idx):
            return score + tensors["slopes"][h] * (kv_idx - q_idx)

        def relative(score, b, h, q_idx, kv_idx):
            return score + tensors["rel"][h, q_idx - kv_idx + RELATIVE_OFFSET]

        score_mod = {"softcap": softcap, "alibi": alibi, "relative": relative}.get(variant)
        flex = self._flex
        return lambda q, k, v: flex(q, k, v, score_mod=score_mod, block_mask=block_mask)


def _check(o, q, k, v, kernel, tensors, scale, dtype, rows=256, heads=2):
    """The FlashAttention rule on a slice: rows spread over the sequence, all keys, the first heads;
    the semantics (mask, score function) are those of the fagen kernel's program."""
    torch = testing._torch()
    N = q.shape[2]
    idx = torch.linspace(0, N - 1, min(rows, N), device=q.device).round().long().unique()
    qs, ks, vs = q[:1, :heads, idx], k[:1, :heads], v[:1, :heads]
    H = q.shape[1]
    rows_np = idx.cpu().numpy()
    keep = testing.keep_matrix(kernel, 1, H, N, N, tensors, rows=rows_np)[:, :heads]
    row_score = testing.score_function(
        kernel, 1, heads, N, N, {n: t[:heads] if t.shape[0] == H else t for n, t in tensors.items()}, rows=rows_np
    )
    score = row_score  # the score function at the sampled rows (None: identity)
    ref, _ = testing.reference(qs, ks, vs, keep, scale, score=score)
    naive, _ = testing.reference(qs, ks, vs, keep, scale, dtype=q.dtype, score=score)
    err = float((o[:1, :heads, idx].double() - ref).abs().max())
    err_naive = float((naive.double() - ref).abs().nan_to_num(0.0).max())
    bound = 2 * err_naive + testing.FLOOR[dtype]
    return err, bound


def _unavailable(e: Exception) -> str:
    return f"unavailable: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"


def run(
    *,
    dims=(64, 128, 256),
    seqlens=(512, 1024, 2048, 4096, 8192, 16384),
    causal=(False, True),
    dtypes=("bf16",),
    backends=BACKENDS,
    tokens=16384,
    hidden=2048,
    tier=None,
    variants=("none",),
    rounds=1,
    log=sys.stderr,
) -> list[Row]:
    """Each case's backends are checked, then timed in `rounds` passes (`time_in_rounds`: pass r starts at backend
    r), each figure the median over the passes."""
    torch = testing._torch()
    bench = _timer(torch)
    peers = Peers(torch)
    rows: list[Row] = []
    cases = [
        (var, dt, d, c, n)
        for var in variants
        for dt in dtypes
        for d in dims
        for c in VARIANT_CAUSAL.get(var, causal)
        for n in seqlens
    ]
    total = len(cases) * len(backends)
    done = 0
    kernels = {}
    for var, dt, D, c, N in cases:
        B, H = max(1, tokens // N), max(1, hidden // D)
        q, k, v = testing.random_qkv(B, H, N, N, D, dt)
        scale = 1.0 / math.sqrt(D)
        key = (var, dt, D, c)
        if key not in kernels:
            kernels[key] = fagen_compile(D, causal=c, dtype=dt, tier=tier, **VARIANTS[var])
        kern = kernels[key]
        tensors = variant_tensors(var, kern, B, H)
        timed = []  # (row, fn) of the backends that ran and passed the check
        for be in backends:
            done += 1
            print(
                f"\r[{done}/{total}] {var} {dt} d{D} {'causal' if c else 'full'} N={N} {be:6s}",
                end="",
                file=log,
                flush=True,
            )
            row = Row(be, dt, D, c, N, B, H, variant=var)
            rows.append(row)
            try:
                if be == "fagen":
                    row.extra["kernel"] = kern.name
                    fn = lambda kern=kern: kern(q, k, v, **tensors)  # noqa: E731
                elif be in ("flash", "cudnn"):
                    if var != "none":
                        row.status = "unavailable: no SDPA backend for this variant"
                        continue
                    f = peers.sdpa(be, c)
                    fn = lambda f=f: f(q, k, v)  # noqa: E731
                elif be == "flex":
                    f = peers.flex(c, N, var, tensors)
                    fn = lambda f=f: f(q, k, v)  # noqa: E731
                else:
                    raise ValueError(f"backends: unknown {be!r}")
                t0 = time.perf_counter()
                o = fn()
                torch.cuda.synchronize()
                row.extra["first_call_s"] = round(time.perf_counter() - t0, 3)
                row.err, row.bound = _check(o, q, k, v, kern, tensors, scale, dt)
                if not row.err <= row.bound:
                    row.status = f"failed check: err {row.err:.2e} > {row.bound:.2e}"
                    continue
                timed.append((row, fn))
            except Exception as e:  # a peer that does not run here (e.g. cuDNN at some head dim)
                row.status = _unavailable(e)
        try:
            times = time_in_rounds([lambda q, k, v, fn=fn: fn() for _, fn in timed], {N: (q, k, v)}, bench, rounds)
        except Exception as e:  # each ran once already; a failure while timing marks the case's rows
            for row, _ in timed:
                row.status = _unavailable(e)
            continue
        for (row, _), t in zip(timed, times):
            row.ms = t[N]
            row.tflops = flops(B, H, N, D, c) / (row.ms * 1e-3) / 1e12
    print(file=log)
    return rows


# Run in a fresh process: the time to `import fagen` and to compile one kernel, as JSON on the last line.
_COMPILE_PROBE = """
import json, sys, time
t0 = time.perf_counter()
import fagen
from fagen import pipeline
t1 = time.perf_counter()
arch = pipeline.detect_arch()  # the CUDA driver's start (cuInit), which a process using the GPU pays once
ta = time.perf_counter()
k = fagen.compile({dim}, causal={causal!r}, dtype={dtype!r}, tier={tier!r}, arch=arch, **{variant!r})
t2 = time.perf_counter()
print(json.dumps(dict(kernel=k.name, import_s=t1 - t0, driver_s=ta - t1, compile_s=t2 - ta, nvrtc_s=k.compile_seconds,
                      cached=k.binary.cached, registers=k.resources.registers,
                      stack_frame=k.resources.stack_frame, sympy="sympy" in sys.modules,
                      bytecode_cache=not sys.dont_write_bytecode)))
"""


_NO_PYC = "off (PYTHONDONTWRITEBYTECODE: every import compiles its modules)"


def _pyc(c: dict) -> str:
    if c["pyc_prefix"]:
        return "written by a first untimed probe into a shared folder (this interpreter writes none), as pip does"
    return "on" if c["bytecode_cache"] else _NO_PYC


def probe_code(dim, causal, dtype, tier=None, variant=None) -> str:
    return _COMPILE_PROBE.format(dim=int(dim), causal=causal, dtype=str(dtype), tier=tier, variant=dict(variant or {}))


def compile_in_fresh_process(code: str, cache_dir, timeout=600, pyc_dir=None) -> dict:
    """Run a probe in a new interpreter with NVRTC's own cache off and `cache_dir` as fagen's cache, so a
    cold compile is cold all the way down (CUDA_CACHE_DISABLE=1: ptxas runs), and time it from outside too.
    `pyc_dir`: Python's bytecode cache for the probe (PYTHONPYCACHEPREFIX), for an interpreter that writes none
    (PYTHONDONTWRITEBYTECODE)."""
    import json
    import os
    import subprocess

    root = str(Path(__file__).resolve().parents[2])  # the folder holding the fagen package
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
                out.append(
                    dict(
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
                        pyc_prefix=pyc_dir is not None,
                        cold_process_s=round(cold["process_s"], 3),
                        cached_process_s=round(cached["process_s"], 3),
                        new_process_s=round(new["process_s"], 3),
                        registers=cold["registers"],
                        stack_frame=cold["stack_frame"],
                    )
                )
    return out


def per_call_seconds(fn, sync, n=1000, warmup=50) -> float:
    """Host time per call of `fn`, back to back: a perf_counter around n calls after warm-up, one
    synchronize at the end (so the queue drains inside the window), divided by n."""
    for _ in range(warmup):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    sync()
    return (time.perf_counter() - t0) / n


def host_overhead(D=128, dtype="bf16", n=1000) -> dict:
    """Per-call cost of a tiny problem (B=1, H=1, M=N=128), where launching dominates: fagen vs SDPA."""
    torch = testing._torch()
    q, k, v = testing.random_qkv(1, 1, 128, 128, D, dtype)
    import torch.nn.functional as F

    kern = fagen_compile(D, causal=False, dtype=dtype)
    sync = torch.cuda.synchronize
    return dict(
        shape=f"B=1 H=1 M=N=128 D={D} {dtype}",
        calls=n,
        fagen_us=round(per_call_seconds(lambda: kern(q, k, v), sync, n) * 1e6, 1),
        sdpa_us=round(per_call_seconds(lambda: F.scaled_dot_product_attention(q, k, v), sync, n) * 1e6, 1),
    )


def peak_extra_mib(torch, fn) -> float:
    """The device memory `fn` allocates at its peak beyond what was allocated before it (its results included),
    in MiB; NaN where it runs out of memory."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    try:
        result = fn()
        torch.cuda.synchronize()
        mib = round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)
        del result
    except torch.OutOfMemoryError:
        mib = math.nan
    torch.cuda.empty_cache()
    return mib


def peak_memory(seqlens=(1024, 2048, 4096, 8192, 16384), D=128, dtype="bf16") -> list[dict]:
    """Peak extra device memory of one forward call: fagen vs attention that materializes S (SDPA math)."""
    torch = testing._torch()
    peers = Peers(torch)
    kern = fagen_compile(D, causal=False, dtype=dtype)
    math_fn = peers.sdpa("math", False)
    out = []
    for N in seqlens:
        B, H = max(1, 16384 // N), max(1, 2048 // D)
        q, k, v = testing.random_qkv(B, H, N, N, D, dtype)
        out.append(
            dict(
                seqlen=N,
                batch=B,
                heads=H,
                fagen_MiB=peak_extra_mib(torch, lambda: kern(q, k, v)),
                materialized_MiB=peak_extra_mib(torch, lambda: math_fn(q, k, v)),
            )
        )
    return out


def peak_memory_backward(seqlens=(1024, 2048, 4096, 8192, 16384), D=128, dtype="bf16", B=1, H=16) -> list[dict]:
    """Peak extra device memory of one forward + backward (the first call of its shape, so the backward's workspaces
    count: D, the float32 dQ accumulator), beyond q, k, v and dO, at one batch and H heads, so that it grows with N
    alone: fagen vs SDPA's math backend through autograd (it materializes S and P)."""
    torch = testing._torch()
    peers = Peers(torch)
    kern = fagen_compile(D, causal=False, dtype=dtype)
    math_fn = peers.sdpa("math", False)
    out = []
    for N in seqlens:
        q, k, v = testing.random_qkv(B, H, N, N, D, dtype)
        do = torch.randn_like(q)

        def fagen_fb():
            o, lse = kern(q, k, v, return_lse=True)
            return o, kern.backward(q, k, v, o, lse, do)

        def math_fb():
            qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
            o = math_fn(qg, kg, vg)
            o.backward(do)
            return o, (qg.grad, kg.grad, vg.grad)

        out.append(
            dict(
                seqlen=N,
                batch=B,
                heads=H,
                fagen_MiB=peak_extra_mib(torch, fagen_fb),
                materialized_MiB=peak_extra_mib(torch, math_fb),
            )
        )
    return out


def table(rows: list[Row]) -> str:
    """Per case: each backend's ms and TFLOP/s, and fagen / peer speed ratios."""
    by_case = {}
    for r in rows:
        by_case.setdefault((r.variant, r.dtype, r.dim, r.causal, r.seqlen), {})[r.backend] = r
    backends = [b for b in BACKENDS if any(b in c for c in by_case.values())]
    head = f"{'variant':8s} {'dtype':5s} {'d':>4s} {'mask':6s} {'N':>6s} " + " ".join(
        f"{b + ' TF/s':>11s}" for b in backends
    )
    peers = [b for b in backends if b != "fagen"]
    head += " " + " ".join(f"{'÷' + b:>8s}" for b in peers)
    lines = [head]
    for (var, dt, D, c, N), case in by_case.items():
        cells = []
        for b in backends:
            r = case.get(b)
            cells.append(
                f"{r.tflops:11.1f}" if r and r.status == "ok" else f"{(r.status.split(':')[0] if r else '-'):>11s}"[:11]
            )
        f = case.get("fagen")
        ratios = []
        for b in peers:
            p = case.get(b)
            ok = f and p and f.status == "ok" and p.status == "ok"
            ratios.append(f"{p.ms / f.ms:8.2f}" if ok else f"{'-':>8s}")
        lines.append(
            f"{var:8s} {dt:5s} {D:4d} {'causal' if c else 'full':6s} {N:6d} " + " ".join(cells) + " " + " ".join(ratios)
        )
    lines.append("ratios are fagen speed / peer speed (peer ms ÷ fagen ms): above 1 fagen is faster")
    return "\n".join(lines)


def write_csv(rows: list[Row], path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            [
                "variant",
                "backend",
                "dtype",
                "dim",
                "causal",
                "seqlen",
                "batch",
                "heads",
                "ms",
                "tflops",
                "status",
                "err",
                "bound",
                "kernel",
            ]
        )
        for r in rows:
            w.writerow(
                [
                    r.variant,
                    r.backend,
                    r.dtype,
                    r.dim,
                    int(r.causal),
                    r.seqlen,
                    r.batch,
                    r.heads,
                    f"{r.ms:.4f}",
                    f"{r.tflops:.2f}",
                    r.status,
                    f"{r.err:.3e}",
                    f"{r.bound:.3e}",
                    r.extra.get("kernel", ""),
                ]
            )


def plot(rows: list[Row], memory: list[dict], path: Path, title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.variant == "none"]
    cases = sorted({(r.dtype, r.dim, r.causal) for r in rows})
    panels = len(cases) + (1 if memory else 0)
    if not panels:  # variants alone and no memory figures: nothing to draw (bench.md has the table)
        return
    ncols = min(4, panels)
    nrows = -(-panels // ncols)
    fig, grid = plt.subplots(nrows, ncols, figsize=(4.4 * ncols, 3.6 * nrows), squeeze=False)
    axes = list(grid.flat)
    for ax in axes[panels:]:
        ax.axis("off")
    for ax, (dt, D, c) in zip(axes, cases):
        for b in BACKENDS:
            pts = sorted(
                (r.seqlen, r.tflops)
                for r in rows
                if (r.dtype, r.dim, r.causal, r.backend) == (dt, D, c, b) and r.status == "ok"
            )
            if pts:
                ax.plot(*zip(*pts), marker="o", label=BACKEND_LABEL[b], linewidth=2.2 if b == "fagen" else 1.2)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{dt} d{D} {'causal' if c else 'non-causal'}")
        ax.set_xlabel("sequence length")
        ax.set_ylabel("TFLOP/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if memory:
        ax = axes[panels - 1]
        for key, label in (("fagen_MiB", "fagen (O, lse)"), ("materialized_MiB", "materialized S (SDPA math)")):
            pts = [(m["seqlen"], m[key]) for m in memory if not math.isnan(m.get(key, math.nan))]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title("peak extra memory, d128 bf16, 16k tokens")
        ax.set_xlabel("sequence length")
        ax.set_ylabel("MiB")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def decode(lengths=(8192, 32768, 131072), q_lens=(1, 4), B=8, H=32, Hkv=8, D=128, page_sizes=(16, 256)) -> list[dict]:
    """Split-KV decode, bytes of K + V read per second: fagen (its default split kernel, the mma tier's) over a
    contiguous cache and over paged caches (pages in shuffled order) of each page size, the simt tier's split
    kernel over the contiguous cache, PyTorch SDPA's flash and cuDNN backends on the same K/V, and
    a device-to-device copy of the same bytes (its bandwidth: bytes read + written / time, as CUDA's
    bandwidthTest counts a device-to-device copy). bf16, every sequence at the full length, causal
    (bottom-right)."""
    torch = testing._torch()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from .. import pipeline

    bench = _timer(torch)
    kernel = pipeline.compile(D, causal=True, decode=True, dtype="bf16")
    simt = pipeline.compile(D, causal=True, decode=True, dtype="bf16", tier="simt")
    rows = []
    for L in lengths:
        kc = torch.randn(B, L, Hkv, D, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
        nbytes = 2 * kc.numel() * kc.element_size()
        paged = {}
        for page in page_sizes:
            per = -(-L // page)
            order = torch.randperm(B * per, device="cuda")
            table = order.view(B, per).to(torch.int32)
            pool_k = torch.empty(B * per, page, Hkv, D, device="cuda", dtype=torch.bfloat16)
            pool_v = torch.empty_like(pool_k)
            pad = per * page - L
            src_k = torch.nn.functional.pad(kc, (0, 0, 0, 0, 0, pad)).view(B * per, page, Hkv, D)
            src_v = torch.nn.functional.pad(vc, (0, 0, 0, 0, 0, pad)).view(B * per, page, Hkv, D)
            pool_k[order], pool_v[order] = src_k, src_v  # sequence b's page j is pool page table[b, j]
            paged[page] = (pool_k, pool_v, table)
            src_k = src_v = None
        copy_src = torch.empty(nbytes // 2, device="cuda", dtype=torch.bfloat16)
        copy_dst = torch.empty_like(copy_src)
        copy_ms = bench(lambda: copy_dst.copy_(copy_src))
        copy_bw = 2 * nbytes / (copy_ms * 1e-3)  # a copy reads and writes the bytes: its DRAM traffic per second
        copy_src = copy_dst = None  # freed before the kernels run
        for M in q_lens:
            q = torch.randn(B, M, H, D, device="cuda", dtype=torch.bfloat16)
            qs, ks, vs = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)
            o_ref = kernel.decode(q, kc, vc, lens)
            cases = [(f"fagen contiguous ({kernel.spec.tier})", lambda: kernel.decode(q, kc, vc, lens), None)]
            for page, (pk, pv, table) in paged.items():
                cases.append(
                    (
                        f"fagen paged {page}",
                        lambda pk=pk, pv=pv, table=table: kernel.decode(q, pk, pv, lens, block_table=table),
                        None,
                    )
                )
            cases.append(("fagen contiguous (simt)", lambda: simt.decode(q, kc, vc, lens), None))
            # SDPA without a mask: its is_causal is top-left, and a bottom-right mask is refused by its flash
            # backend; at q_len > 1 it reads the same K/V (its difference column is then left out).
            for name, backend in (
                ("SDPA flash", SDPBackend.FLASH_ATTENTION),
                ("SDPA cuDNN", SDPBackend.CUDNN_ATTENTION),
            ):

                def sdpa(backend=backend):
                    with sdpa_kernel(backend):
                        return torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True)

                cases.append((name, sdpa, "sdpa"))
            for name, fn, kind in cases:
                try:
                    o = fn()
                    o = o.transpose(1, 2) if kind == "sdpa" else o
                    err = float((o.float() - o_ref.float()).abs().max()) if kind is None or M == 1 else float("nan")
                    ms = bench(fn)
                    status = "ok"
                except Exception as e:  # noqa: BLE001 - a backend that refuses the shape is reported, not fatal
                    ms, err, status = float("nan"), float("nan"), f"{type(e).__name__}: {str(e).splitlines()[0][:60]}"
                rows.append(
                    dict(
                        kv_len=L,
                        q_len=M,
                        op=name,
                        us=ms * 1e3,
                        tbs=nbytes / (ms * 1e-3) / 1e12,
                        of_copy=(nbytes / (ms * 1e-3)) / copy_bw,
                        err=err,
                        status=status,
                    )
                )
            rows.append(
                dict(
                    kv_len=L,
                    q_len=M,
                    op="copy (D2D of the same bytes; read + write)",
                    us=copy_ms * 1e3,
                    tbs=copy_bw / 1e12,
                    of_copy=1.0,
                    err=float("nan"),
                    status="ok",
                )
            )
        kc = vc = paged = None  # this length's caches, freed
        torch.cuda.empty_cache()
    return rows


def decode_table(rows: list[dict]) -> str:
    lines = ["| kv len | q_len | op | time (us) | K+V TB/s | / copy | max abs diff vs fagen contiguous |"]
    lines.append("|---|---|---|---|---|---|---|")
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['kv_len']} | {r['q_len']} | {r['op']} | – | – | – | {r['status']} |")
            continue
        lines.append(
            f"| {r['kv_len']} | {r['q_len']} | {r['op']} | {r['us']:.1f} | {r['tbs']:.2f} | {r['of_copy']:.2f} | "
            f"{r['err']:.1e} |"
        )
    return "\n".join(lines)


def main_decode(args) -> int:
    torch = testing._torch()
    ints = lambda s: tuple(int(x) for x in s.split(",") if x)  # noqa: E731
    lengths = ints(args.seqlens) if args.seqlens != DEFAULT_SEQLENS else (8192, 32768, 131072)
    rows = decode(lengths)
    device = torch.cuda.get_device_name()
    title = f"fagen {__import__('fagen').__version__} decode on {device}, {datetime.date.today().isoformat()}"
    text = [
        f"# {title}, torch {torch.__version__}",
        "",
        "Batch 8, GQA 32/8, d128, bf16, causal, every sequence at the full length; paged: pages in shuffled "
        "order. TB/s = bytes of K + V read / time (median of triton's do_bench); copy = a device-to-device copy "
        "of the same bytes, its bandwidth counted as bytes read + written / time; / copy = TB/s over that.",
        "",
        decode_table(rows),
    ]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode.md").write_text("\n".join(text) + "\n")


def run_backward(
    *,
    dims=(64, 128),
    seqlens=(2048, 4096, 8192),
    causal=(False, True),
    dtype="bf16",
    backends=BACKENDS,
    tokens=16384,
    hidden=2048,
    variants=("none",),
    log=sys.stderr,
) -> list[Row]:
    """Forward + backward, each backend in this process: fagen (kernel(..., return_lse=True), then
    Kernel.backward with tensor_grads=False: like the peers', the variant's tensors, ALiBi's slopes, take no
    gradient), SDPA's flash and cuDNN backends and compiled FlexAttention (autograd: o = f(q, k, v),
    o.backward(do)). FLOPs: the forward's 4·B·H·N²·D (halved when causal) times 3.5, the backward counted 2.5x the
    forward as FlashAttention's benchmark counts it. The gradients are not checked here: tests/gpu/
    test_backward_gpu.py checks them against float64 autograd."""
    torch = testing._torch()
    bench = _timer(torch)
    peers = Peers(torch)
    rows: list[Row] = []
    kernels = {}
    for var in variants:
        for D in dims:
            for c in VARIANT_CAUSAL.get(var, causal):
                for N in seqlens:
                    B, H = max(1, tokens // N), max(1, hidden // D)
                    q, k, v = testing.random_qkv(B, H, N, N, D, dtype)
                    do = torch.randn_like(q)
                    key = (var, D, c)
                    if key not in kernels:
                        kernels[key] = fagen_compile(D, causal=c, dtype=dtype, **VARIANTS[var])
                    kern = kernels[key]
                    tensors = variant_tensors(var, kern, B, H)
                    for be in backends:
                        print(f"\r{var} d{D} {'causal' if c else 'full'} N={N} {be:6s}", end="", file=log, flush=True)
                        row = Row(be, dtype, D, c, N, B, H, variant=var)
                        rows.append(row)
                        try:
                            if be == "fagen":
                                row.extra["kernel"] = kern.backward_plan.main.spec.name

                                def fn(kern=kern):  # no tensor's gradient, as the peers (their tensors need none)
                                    o, lse = kern(q, k, v, return_lse=True, **tensors)
                                    return kern.backward(q, k, v, o, lse, do, tensor_grads=False, **tensors)

                            else:
                                if be in ("flash", "cudnn"):
                                    if var != "none":
                                        row.status = "unavailable: no SDPA backend for this variant"
                                        continue
                                    f = peers.sdpa(be, c)
                                else:
                                    f = peers.flex(c, N, var, tensors)
                                qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))

                                def fn(f=f, qg=qg, kg=kg, vg=vg):
                                    qg.grad = kg.grad = vg.grad = None
                                    f(qg, kg, vg).backward(do)
                                    return qg.grad

                            fn()
                            torch.cuda.synchronize()
                            row.ms = bench(fn)
                            row.tflops = 3.5 * flops(B, H, N, D, c) / (row.ms * 1e-3) / 1e12
                        except Exception as e:  # a peer that does not run here
                            msg = str(e).splitlines()[0][:120] if str(e) else ""
                            row.status = f"unavailable: {type(e).__name__}: {msg}"
    print(file=log)
    return rows


def main_backward(args, ints, causal, backends) -> int:
    torch = testing._torch()
    device = torch.cuda.get_device_name()
    date = datetime.date.today().isoformat()
    variants = tuple(args.variant.split(","))
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        raise ValueError(f"--variant: unknown {', '.join(bad)} (expected some of {', '.join(VARIANTS)})")
    rows = run_backward(
        dims=ints(args.dims),
        seqlens=ints(args.seqlens),
        causal=causal,
        dtype=args.dtypes.split(",")[0],
        backends=backends,
        variants=variants,
    )
    out = Path(args.out)
    write_csv(rows, out / "bench_backward.csv")
    title = f"fagen {__import__('fagen').__version__} forward + backward on {device}, {date}, torch {torch.__version__}"
    text = [f"# {title}", "", "```", table(rows), "```", "", "TF/s: 3.5x the forward's FLOPs over fwd+bwd time."]
    if args.memory:
        memory = peak_memory_backward()
        text += [
            "",
            "Peak extra memory of one forward + backward (MiB; d128, one batch, 16 heads, first call of the shape):",
        ]
        text += [
            "",
            *(f"- N={m['seqlen']}: fagen {m['fagen_MiB']}, materialized {m['materialized_MiB']}" for m in memory),
        ]
    (out / "bench_backward.md").write_text("\n".join(text) + "\n")
    print("\n".join(text))
    return 0


DEFAULT_SEQLENS = "512,1024,2048,4096,8192,16384"


# Document masks (packed sequences), FlexAttention's mask_mod form: documents of `size` tokens, causal inside.
DOCUMENT_SIZES = (1000,)  # not tile-aligned: partial tiles on every document boundary


def _document_mask(size: int, causal: bool):
    def document(b, h, q_idx, kv_idx):
        same = q_idx // size == kv_idx // size
        return same & (q_idx >= kv_idx) if causal else same

    return document


def _median_seconds(fn, sync, n=20, warmup=3) -> float:
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def run_document(
    seqlens=(4096, 16384), dim=128, dtype="bf16", sizes=DOCUMENT_SIZES, causal=(True, False), tokens=16384, hidden=2048
) -> list[dict]:
    """The block-sparse forward (fagen.flex_attention's path: create_block_mask's tables at the kernel's tiles)
    against compiled FlexAttention with the same mask_mod and torch's create_block_mask, the dense fagen kernel
    (the mask evaluated on every key tile of its proven range) beside them; and block-mask construction,
    fagen.create_block_mask against torch's (eager and _compile=True), each a whole call with a synchronize.
    Outputs are checked against float64 on a slice of rows first."""
    torch = testing._torch()
    from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask
    from torch.nn.attention.flex_attention import flex_attention

    import fagen

    bench = _timer(torch)
    flex = torch.compile(flex_attention, dynamic=False)
    sync = torch.cuda.synchronize
    rows = []
    for size in sizes:
        for c in causal:
            mask_mod = _document_mask(size, c)
            sparse = fagen_compile(dim, dtype=dtype, mask=mask_mod, block_sparse=True)
            dense = fagen_compile(dim, dtype=dtype, mask=mask_mod)
            tiles = (sparse.spec.block_m, sparse.spec.block_n)
            for N in seqlens:
                B, H = max(1, tokens // N), max(1, hidden // dim)
                q, k, v = testing.random_qkv(B, H, N, N, dim, dtype)
                row = dict(size=size, causal=c, seqlen=N, batch=B, heads=H, kernel=sparse.name, tiles=tiles)
                bm = fagen.create_block_mask(mask_mod, None, None, N, N, BLOCK_SIZE=tiles)
                tbm = torch_create_block_mask(mask_mod, None, None, N, N, device="cuda")
                count = bm.tiles(*tiles).kv_count
                row["visited_tiles"] = int(count.sum())
                row["dense_tiles"] = None
                fns = {
                    "fagen": lambda: sparse(q, k, v, block_mask=bm),
                    "fagen_dense": lambda: dense(q, k, v),
                    "flex": lambda: flex(q, k, v, block_mask=tbm),
                }
                for name, fn in fns.items():
                    o = fn()
                    sync()
                    err, bound = _check(o, q, k, v, sparse, {}, 1 / math.sqrt(dim), dtype)
                    row[f"{name}_err"], row[f"{name}_ok"] = err, err <= bound
                    row[f"{name}_ms"] = bench(fn) if err <= bound else math.nan
                row["fagen_vs_flex"] = row["flex_ms"] / row["fagen_ms"]
                row["fagen_vs_dense"] = row["fagen_dense_ms"] / row["fagen_ms"]
                # construction: a whole create_block_mask call, the tables on the GPU (synchronized)
                row["build_fagen_ms"] = 1e3 * _median_seconds(
                    lambda: fagen.create_block_mask(mask_mod, None, None, N, N, BLOCK_SIZE=tiles), sync
                )
                row["build_torch_ms"] = 1e3 * _median_seconds(
                    lambda: torch_create_block_mask(mask_mod, None, None, N, N, device="cuda"), sync
                )
                try:
                    row["build_torch_compiled_ms"] = 1e3 * _median_seconds(
                        lambda: torch_create_block_mask(mask_mod, None, None, N, N, device="cuda", _compile=True), sync
                    )
                except Exception as e:  # reported, not fatal
                    row["build_torch_compiled_ms"] = f"{type(e).__name__}: {str(e)[:80]}"
                rows.append(row)
                print(document_line(row), file=sys.stderr, flush=True)
    return rows


def document_line(r: dict) -> str:
    compiled = r["build_torch_compiled_ms"]
    compiled = f"{compiled:.3f}" if isinstance(compiled, float) else compiled
    return (
        f"doc {r['size']:5d} {'causal' if r['causal'] else 'full  '} N={r['seqlen']:6d} B={r['batch']} "
        f"H={r['heads']} tiles {r['tiles'][0]}x{r['tiles'][1]} visited {r['visited_tiles']}: "
        f"fagen {r['fagen_ms']:.3f} ms, fagen dense {r['fagen_dense_ms']:.3f} ms, flex {r['flex_ms']:.3f} ms "
        f"-> fagen/flex {r['fagen_vs_flex']:.2f}x, sparse/dense {r['fagen_vs_dense']:.2f}x; block mask: fagen "
        f"{r['build_fagen_ms']:.3f} ms, torch {r['build_torch_ms']:.3f} ms, torch _compile {compiled} ms "
        f"(checks: {r['fagen_ok']}, {r['fagen_dense_ok']}, {r['flex_ok']})"
    )


def main_document(args) -> int:
    import json

    torch = testing._torch()
    ints = lambda s: tuple(int(x) for x in s.split(",") if x)  # noqa: E731
    causal = {"both": (True, False), "yes": (True,), "no": (False,)}[args.causal]
    dims = ints(args.dims)
    rows = [r for d in dims for r in run_document(ints(args.seqlens), d, args.dtypes.split(",")[0], causal=causal)]
    device = torch.cuda.get_device_name()
    text = [f"# document masks: fagen vs FlexAttention on {device}, {datetime.date.today()}, torch {torch.__version__}"]
    text += ["", *[f"- {document_line(r)}" for r in rows]]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "document.md").write_text("\n".join(text) + "\n")
    (out / "document.json").write_text(json.dumps(rows, indent=1, default=str))
    print("\n".join(text))
    return 0


def main(args) -> int:
    from ..pipeline import detect_arch

    if detect_arch() is None:
        raise RuntimeError("no CUDA GPU found: fagen bench times kernels on a GPU")
    if getattr(args, "decode", False):
        return main_decode(args)
    if getattr(args, "model", False):
        from . import bench_model

        return bench_model.main(args)
    if args.variant == "document":
        return main_document(args)
    torch = testing._torch()
    ints = lambda s: tuple(int(x) for x in s.split(",") if x)  # noqa: E731
    if getattr(args, "backward", False):
        causal = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
        return main_backward(args, ints, causal, tuple(b for b in args.backends.split(",") if b))
    causal = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    backends = tuple(b for b in args.backends.split(",") if b)
    bad = [b for b in backends if b not in BACKENDS]
    if bad:
        raise ValueError(f"--backends: unknown {', '.join(bad)} (expected some of {', '.join(BACKENDS)})")
    device = torch.cuda.get_device_name()
    date = datetime.date.today().isoformat()
    t0 = time.perf_counter()
    ct = compile_times(ints(args.dims), causal, args.dtypes.split(",")[0], args.tier)
    variants = tuple(args.variant.split(","))
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        raise ValueError(f"--variant: unknown {', '.join(bad)} (expected some of {', '.join(VARIANTS)})")
    try:
        overhead = host_overhead(dtype=args.dtypes.split(",")[0])
    except Exception as e:  # reported, not fatal: the throughput table still follows
        print(f"host overhead not measured: {type(e).__name__}: {e}", file=sys.stderr)
        overhead = None
    rows = run(
        dims=ints(args.dims),
        seqlens=ints(args.seqlens),
        causal=causal,
        dtypes=tuple(args.dtypes.split(",")),
        backends=backends,
        tier=args.tier,
        variants=variants,
        rounds=args.rounds,
    )
    memory = peak_memory() if args.memory else []
    out = Path(args.out)
    write_csv(rows, out / "bench.csv")
    title = f"fagen {__import__('fagen').__version__} on {device}, {date}, torch {torch.__version__}"
    text = [
        f"# {title}",
        "",
        "```",
        table(rows),
        "```",
        "",
        "Each time is the median of the timer's runs (triton's do_bench: 25 ms of warm-up, 100 ms of runs), after a "
        "check against float64 on rows sampled over the sequence"
        + (
            f"; the median of {args.rounds} passes over a case's backends, pass r starting at backend r."
            if args.rounds > 1
            else ", one pass over a case's backends in the order listed."
        ),
        "",
        "Compile time, each in a fresh process with NVRTC's own cache off (CUDA_CACHE_DISABLE=1): cold = an empty "
        "fagen cache (the whole pipeline: trace/parse, proofs, render, NVRTC with ptxas); cached = a second "
        "process on the same cache (import fagen, then compile returns the kernel from disk; loading it onto "
        "the GPU happens on the first call). The CUDA driver's start (cuInit, to learn the GPU's arch), which "
        "any process using the GPU pays once and a PyTorch process has paid already, is timed apart:",
        "",
    ]
    text += [
        f"- {c['kernel']}: cold {c['cold_s']} s (NVRTC {c['nvrtc_s']} s; whole process {c['cold_process_s']} s), "
        f"Python's bytecode cache {_pyc(c)}; never-seen variant {c['new_variant']}: {c['new_s']} s "
        f"(NVRTC {c['new_nvrtc_s']} s; before it, import fagen {c['new_import_s']} s and driver start "
        f"{c['new_driver_s']} s; whole process {c['new_process_s']} s); "
        f"cached {c['cached_s'] * 1e3:.1f} ms (hit: {c['cached_hit']}; SymPy imported: {c['cached_sympy']}; "
        f"import fagen {c['import_s'] * 1e3:.1f} ms; driver start {c['driver_s'] * 1e3:.1f} ms; "
        f"whole process {c['cached_process_s']} s), "
        f"{c['registers']} registers, {c['stack_frame']} B stack frame (spills)"
        for c in ct
    ]
    if overhead:
        text += [
            "",
            f"Host overhead per call ({overhead['shape']}, {overhead['calls']} back-to-back calls after "
            "warm-up, perf_counter around the loop, one synchronize at the end, divided by the calls): "
            f"fagen {overhead['fagen_us']} µs, SDPA (torch.nn.functional.scaled_dot_product_attention) "
            f"{overhead['sdpa_us']} µs.",
        ]
    window = {r.seqlen: r.ms for r in rows if r.variant == "window" and r.backend == "fagen" and r.status == "ok"}
    causal_ms = {
        r.seqlen: r.ms
        for r in rows
        if r.variant == "none"
        and r.backend == "fagen"
        and r.causal
        and r.status == "ok"
        and r.dim in {w.dim for w in rows if w.variant == "window"}
    }
    if window and causal_ms:
        text += ["", "Sliding window (left 256) vs full causal, fagen, same shape:", ""]
        text += [
            f"- N={n}: window {window[n]:.3f} ms, causal {causal_ms[n]:.3f} ms: {causal_ms[n] / window[n]:.1f}x faster"
            for n in sorted(window)
            if n in causal_ms
        ]
    if memory:
        text += ["", "Peak extra memory of one call (MiB):", ""]
        text += [f"- N={m['seqlen']}: fagen {m['fagen_MiB']}, materialized {m['materialized_MiB']}" for m in memory]
    text += ["", f"Wall time {time.perf_counter() - t0:.0f} s."]
    (out / "bench.md").write_text("\n".join(text) + "\n")
    try:
        plot(rows, memory, out / "bench.png", title)
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
    print("\n".join(text))
    return 0
