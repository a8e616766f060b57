"""The forward benchmark: each case's backends checked against float64, then timed in rotated rounds.

`Session` holds what the forward and the backward benchmarks share: the timer, the peers, fagen's kernels (one a
program, through `fagen.compile`), and each backend's checked forward call.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable

from .. import testing
from . import check, peers, timing
from .cases import RELATIVE_OFFSET, Case, Row, backend_plan, cu_seqlens


def variant_tensors(variant: str, kernel, B: int, H: int) -> dict:
    """The call-time tensors of a variant's kernel: ALiBi's slopes and the like from testing.call_tensors; the
    relative-position table, random float32 values of magnitude ~0.1, at its full length."""
    if variant == "relative":
        torch = testing._torch()
        return {"rel": torch.randn(H, 2 * RELATIVE_OFFSET + 1, device="cuda") * 0.1}
    return testing.call_tensors(kernel, B, H)


def case_inputs(case: Case, device: str = "cuda"):
    """Random q, k, v of a case: [B, H, S, D] (k, v with the case's KV heads), or packed [total, H, D]."""
    n = case.seqlen
    if case.documents:
        q, k, v = testing.random_qkv(1, case.heads, n, n, case.dim, case.dtype, layout="bshd", device=device)
        return tuple(x.transpose(1, 2)[0] for x in (q, k, v))  # [total, H, D], contiguous
    return testing.random_qkv(case.batch, case.heads, n, n, case.dim, case.dtype, Hkv=case.kv_heads, device=device)


def unavailable(e: Exception) -> str:
    return f"unavailable: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"


class Session:
    """One benchmark run's shared state on the GPU."""

    def __init__(self, tier: str | None = None, log=sys.stderr, device: str = "cuda") -> None:
        self.torch = testing._torch()
        self.device = device
        self.timer = timing.timer(self.torch)
        self.peers = peers.Peers(self.torch, device)
        self.tier = tier
        self.log = log
        self.missing = peers.missing_peers()
        self._kernels: dict = {}

    def kernel(self, case: Case):
        """fagen's kernel for a case's program, compiled once a run."""
        import fagen

        opts = case.compile_options
        key = (case.dtype, case.dim, repr(sorted(opts.items())))
        if key not in self._kernels:
            self._kernels[key] = fagen.compile(case.dim, dtype=case.dtype, tier=self.tier, **opts)
        return self._kernels[key]

    def fagen_call(self, case: Case, kernel, tensors: dict) -> Callable:
        """fagen as (q, k, v) -> o in the case's own layout: the kernel, or Kernel.varlen for packed documents."""
        if not case.documents:
            return lambda q, k, v: kernel(q, k, v, **tensors)
        cu = self.offsets(case)
        n = max(case.documents)
        return lambda q, k, v: kernel.varlen(q, k, v, cu, cu, n, n, **tensors)

    def offsets(self, case: Case):
        """The packed documents' cu_seqlens, int32 on the device."""
        return self.torch.tensor(cu_seqlens(case.documents), dtype=self.torch.int32, device=self.device)

    def call(self, backend: str, case: Case, kernel, tensors: dict) -> Callable:
        """`backend` as (q, k, v) -> o in its own layout (peers.layout)."""
        if backend == "fagen":
            return self.fagen_call(case, kernel, tensors)
        return self.peers.get(backend, case, tensors)

    def checked(self, row: Row, backend: str, case: Case, inputs, kernel, tensors: dict):
        """(call, its inputs in its layout) after a first call (timed: it may compile) whose output passed the check;
        None, with the row's status saying why, where it failed."""
        name = peers.layout(backend, case)
        views = tuple(peers.to_layout(x, name) for x in inputs)
        fn = self.call(backend, case, kernel, tensors)
        t0 = time.perf_counter()
        o = fn(*views)
        self.synchronize()
        row.extra["first_call_s"] = round(time.perf_counter() - t0, 3)
        o = peers.from_layout(o, name)
        q, k, v = inputs
        row.err, row.bound = check.check_case(o, q, k, v, case, kernel, tensors, 1.0 / math.sqrt(case.dim))
        if not row.err <= row.bound:
            row.status = f"failed check: err {row.err:.2e} > {row.bound:.2e}"
            return None
        return fn, views

    def synchronize(self) -> None:
        if self.device != "cpu":
            self.torch.cuda.synchronize()

    def progress(self, text: str) -> None:
        print(f"\r{text}", end="", file=self.log, flush=True)


def forward_case(s: Session, case: Case, backends, rounds: int, where: str = "") -> list[Row]:
    """One case's rows: each backend checked, then those that passed timed in `rounds` rotated passes."""
    kernel = s.kernel(case)
    inputs = case_inputs(case, s.device)
    tensors = variant_tensors(case.variant, kernel, case.batch, case.heads)
    rows, timed = [], []
    for be, why_not in backend_plan(backends, case.variant, backward=False, missing=s.missing):
        s.progress(f"{where} {case.label} {be:6s}")
        row = Row.of(case, be)
        rows.append(row)
        if be == "fagen":
            row.extra["kernel"] = kernel.name
        if why_not:
            row.status = why_not
            continue
        try:
            got = s.checked(row, be, case, inputs, kernel, tensors)
        except Exception as e:  # a peer that does not run here (e.g. cuDNN at some head dim)
            row.status = unavailable(e)
            continue
        if got is not None:
            timed.append((row, got))
    try:
        calls = [lambda q, k, v, fn=fn, x=x: fn(*x) for _, (fn, x) in timed]
        times = timing.time_in_rounds(calls, {case.seqlen: inputs}, s.timer, rounds)
    except Exception as e:  # each ran once already; a failure while timing marks the case's rows
        for row, _ in timed:
            row.status = unavailable(e)
        return rows
    for (row, _), t in zip(timed, times):
        row.ms = t[case.seqlen]
        row.tflops = case.flops / (row.ms * 1e-3) / 1e12
    return rows


def run(cases: list[Case], backends, *, tier=None, rounds=1, log=sys.stderr) -> list[Row]:
    """The forward rows of every case; each figure the median over `rounds` passes (pass r starts at backend r)."""
    s = Session(tier, log)
    rows = []
    for n, case in enumerate(cases, 1):
        rows += forward_case(s, case, backends, rounds, f"[{n}/{len(cases)}]")
    print(file=log)
    return rows
