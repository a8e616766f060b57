"""The forward + backward benchmark (`fagen bench --backward`).

fagen: the kernel's forward with return_lse=True, then Kernel.backward (packed: Kernel.varlen and varlen_backward)
with tensor_grads=False: like the peers', the variant's tensors (ALiBi's slopes) take no gradient. The peers through
autograd: o = f(q, k, v), o.backward(do). FLOPs: the forward's times 3.5, the backward counted 2.5x the forward as
FlashAttention's benchmark counts it. Each backend's forward output is checked against float64 before it is timed;
the gradients are checked by tests/gpu/test_backward_gpu.py, against float64 autograd.

With --deterministic, a column `fagen_det`: the same forward + backward with deterministic=True, its gradients
checked first (DETERMINISTIC_NOTE).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from .. import testing
from . import peers, timing
from .cases import DETERMINISTIC, Case, Row, backend_plan
from .forward import Session, case_inputs, unavailable, variant_tensors

DETERMINISTIC_RTOL = 1e-2  # fagen_det's dq, dk, dv against the default mode's, relative to each one's largest entry
DETERMINISTIC_NOTE = (
    "fagen_det: fagen's forward + backward with deterministic=True (the key tiles add into dQ in their order, or "
    "dQ by its own query-tile kernel where the tier has no order); "
    "÷fagen_det is its time over the default mode's, so 1.11 or less is within 10% of the default's speed. Checked "
    f"before it is timed: two calls give bitwise equal dq, dk, dv, each within {DETERMINISTIC_RTOL:g} (relative to "
    "its largest entry) of the default mode's."
)


def fagen_backward(s: Session, case: Case, kernel, tensors: dict, inputs, do, deterministic: bool = False) -> Callable:
    """fagen's forward + backward on the case's inputs, outside autograd."""
    q, k, v = inputs
    if not case.documents:

        def dense():  # no tensor's gradient, as the peers (their tensors need none)
            o, lse = kernel(q, k, v, return_lse=True, **tensors)
            return kernel.backward(q, k, v, o, lse, do, deterministic=deterministic, tensor_grads=False, **tensors)

        return dense
    cu = s.offsets(case)
    n = max(case.documents)

    def packed():
        o, lse = kernel.varlen(q, k, v, cu, cu, n, n, return_lse=True, **tensors)
        return kernel.varlen_backward(
            q, k, v, o, lse, do, cu, cu, n, n, deterministic=deterministic, tensor_grads=False, **tensors
        )

    return packed


def check_deterministic(row: Row, deterministic: Callable, default: Callable) -> bool:
    """Whether fagen's deterministic backward passes (DETERMINISTIC_NOTE), its row's err, bound and status set: two
    calls bitwise equal, and each of dq, dk, dv within DETERMINISTIC_RTOL of the default mode's."""
    torch = testing._torch()
    first, second, want = deterministic()[:3], deterministic()[:3], default()[:3]
    if not all(torch.equal(a, b) for a, b in zip(first, second)):
        row.status = "failed check: two deterministic calls differ"
        return False
    row.err = max(
        float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)) for a, b in zip(first, want)
    )
    row.bound = DETERMINISTIC_RTOL
    if not row.err <= row.bound:
        row.status = f"failed check: dq, dk, dv {row.err:.2e} from the default mode's > {row.bound:.0e}"
        return False
    return True


def peer_backward(fn: Callable, views, do) -> Callable:
    """A peer's forward + backward through autograd, on leaves made from its inputs (in its layout)."""
    qg, kg, vg = (x.detach().requires_grad_() for x in views)

    def step():
        qg.grad = kg.grad = vg.grad = None
        fn(qg, kg, vg).backward(do)
        return qg.grad

    return step


def backward_case(s: Session, case: Case, backends, rounds: int, where: str = "") -> list[Row]:
    """One case's forward + backward rows: each backend's forward checked, then timed in `rounds` rotated passes."""
    kernel = s.kernel(case)
    inputs = case_inputs(case, s.device)
    do = s.torch.randn_like(inputs[0])
    tensors = variant_tensors(case.variant, kernel, case.batch, case.heads)
    rows, timed = [], []
    for be, why_not in backend_plan(backends, case.variant, backward=True, missing=s.missing):
        s.progress(f"{where} {case.label} {be:6s}")
        row = Row.of(case, be)
        rows.append(row)
        if why_not:
            row.status = why_not
            continue
        try:
            got = s.checked(row, "fagen" if be == DETERMINISTIC else be, case, inputs, kernel, tensors)
            if got is None:
                continue
            if be in ("fagen", DETERMINISTIC):
                bp = kernel.backward_plan
                row.extra["kernel"] = bp.main.spec.name + (deterministic_dq(bp) if be == DETERMINISTIC else "")
                step = fagen_backward(s, case, kernel, tensors, inputs, do, deterministic=be == DETERMINISTIC)
            else:
                step = peer_backward(got[0], got[1], peers.to_layout(do, peers.layout(be, case)))
            step()  # the first call compiles, for fagen's backward kernels and the peers alike
            s.synchronize()
            if be == DETERMINISTIC and not check_deterministic(
                row, step, fagen_backward(s, case, kernel, tensors, inputs, do)
            ):
                continue
            timed.append((row, step))
        except Exception as e:  # a peer that does not run here
            row.status = unavailable(e)
    try:
        times = timing.time_in_rounds([lambda q, k, v, f=f: f() for _, f in timed], {0: (0, 0, 0)}, s.timer, rounds)
    except Exception as e:
        for row, _ in timed:
            row.status = unavailable(e)
        return rows
    for (row, _), t in zip(timed, times):
        row.ms = t[0]
        row.tflops = 3.5 * case.flops / (row.ms * 1e-3) / 1e12
    return rows


def run(cases: list[Case], backends, *, tier=None, rounds=1, log=sys.stderr) -> list[Row]:
    """The forward + backward rows of every case."""
    s = Session(tier, log)
    rows = []
    for n, case in enumerate(cases, 1):
        rows += backward_case(s, case, backends, rounds, f"[{n}/{len(cases)}]")
    print(file=log)
    return rows


def deterministic_dq(bp) -> str:
    """How a deterministic backward makes dQ: the main kernel's ordered additions (the wgmma tier's counters), or the
    dQ kernel (with tensor gradients, or on the other tiers)."""
    if any(p.name == "dq_semaphore" for p in bp.main.params):
        return " (ordered dQ)"
    return f" + {bp.dq.spec.name}"
