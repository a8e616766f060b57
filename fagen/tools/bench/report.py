"""The writers of `fagen bench`'s outputs: the text table, bench.csv, the plot, the markdown reports, and the
results table (RESULTS.md), each a function of the measured rows."""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

from .cases import BACKEND_LABEL, BACKENDS, COLUMNS, Row


def table(rows: list[Row]) -> str:
    """Per case: each backend's TFLOP/s, and fagen / peer speed ratios."""
    by_case: dict[tuple, dict[str, Row]] = {}
    for r in rows:
        by_case.setdefault((r.variant, r.dtype, r.dim, r.causal, r.seqlen), {})[r.backend] = r
    backends = [b for b in COLUMNS if any(b in c for c in by_case.values())]
    width = {b: max(11, len(b) + 5) for b in backends}  # a column as wide as its header
    head = f"{'variant':8s} {'dtype':5s} {'d':>4s} {'mask':6s} {'N':>6s} " + " ".join(
        f"{b + ' TF/s':>{width[b]}s}" for b in backends
    )
    peers = [b for b in backends if b != "fagen"]
    ratio_width = {b: max(8, len(b) + 1) for b in peers}
    head += " " + " ".join(f"{'÷' + b:>{ratio_width[b]}s}" for b in peers)
    lines = [head]
    for (var, dt, D, c, N), case in by_case.items():
        cells = []
        for b in backends:
            got, w = case.get(b), width[b]
            cells.append(
                f"{got.tflops:{w}.1f}"
                if got and got.status == "ok"
                else f"{(got.status.split(':')[0] if got else '-'):>{w}s}"[:w]
            )
        f = case.get("fagen")
        f = f if f and f.status == "ok" else None
        ratios = []
        for b in peers:
            p, w = case.get(b), ratio_width[b]
            ratios.append(f"{p.ms / f.ms:{w}.2f}" if f and p and p.status == "ok" else f"{'-':>{w}s}")
        lines.append(
            f"{var:8s} {dt:5s} {D:4d} {'causal' if c else 'full':6s} {N:6d} " + " ".join(cells) + " " + " ".join(ratios)
        )
    lines.append("ratios are fagen speed / peer speed (peer ms ÷ fagen ms): above 1 fagen is faster")
    return "\n".join(lines + _peer_notes(rows, peers))  # (a peer that ran in no case: why)


def write_csv(rows: list[Row], path: Path) -> None:
    """One line a row: the case, the backend, its time and TFLOP/s, its status and check, fagen's kernel."""
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


def plot(rows: list[Row], memory: list[dict], path: Path, title: str) -> None:
    """TFLOP/s against sequence length, a panel per dtype, head dim and mask, and peak memory (matplotlib)."""
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


@dataclass(frozen=True)
class RunInfo:
    """Where and how a run was made, for the head of its results."""

    gpu: str
    date: str
    torch: str
    cuda: str
    fagen: str
    command: str
    backward: bool = False
    rounds: int = 1


def _case_name(r: Row, dtypes: set) -> str:
    mask = "causal" if r.causal else "non-causal"
    name = r.label or f"{'' if r.variant == 'none' else r.variant + ', '}d{r.dim} {mask} {r.seqlen}"
    return f"{name} {r.dtype}" if len(dtypes) > 1 else name


def _peer_notes(rows: list[Row], peers: list[str]) -> list[str]:
    """A line for each peer that ran in no case, with why."""
    notes = []
    for p in peers:
        mine = [r for r in rows if r.backend == p]
        if mine and not any(r.status == "ok" for r in mine):
            why = sorted({r.status.removeprefix("unavailable: ") for r in mine})
            notes.append(f"- {BACKEND_LABEL[p]} did not run: {'; '.join(why[:2])}")
    return notes


def results_markdown(rows: list[Row], info: RunInfo) -> str:
    """The results table of one run as markdown: per case, fagen's TFLOP/s and fagen ÷ each peer (the peer's time
    over fagen's: above 1 fagen is faster), under the GPU, date, versions and the command that made it. A pure
    function of the rows: a cell whose fagen or peer row did not pass (unavailable, failed check) reads "–"."""
    by_case: dict[tuple, dict[str, Row]] = {}
    for r in rows:
        by_case.setdefault((r.variant, r.dtype, r.dim, r.causal, r.seqlen), {})[r.backend] = r
    peers = [b for b in COLUMNS if b != "fagen" and any(r.backend == b for r in rows)]
    dtypes = {r.dtype for r in rows}
    what = "forward + backward" if info.backward else "forward"
    timing = f"the median of {info.rounds} rotated rounds of" if info.rounds > 1 else "one round of"
    lines = [
        f"# Results: fagen {info.fagen}, {what}",
        "",
        f"{info.gpu}, {info.date}; torch {info.torch}, CUDA {info.cuda}. Made by `{info.command}`.",
        "",
        f"Each figure is fagen's speed over the peer's (the peer's time ÷ fagen's; above 1, fagen is faster), "
        f"{timing} triton's do_bench (L2 flushed), every output checked against float64 first. TFLOP/s: "
        + ("3.5x the forward's FLOPs over the forward + backward time." if info.backward else "the forward's FLOPs.")
        + ("" if len(dtypes) > 1 else f" Inputs {', '.join(dtypes)}."),
        "",
        "| case | fagen TFLOP/s | " + " | ".join(f"÷ {BACKEND_LABEL[p]}" for p in peers) + " |",
        "|---|---|" + "---|" * len(peers),
    ]
    for case in by_case.values():
        f = case.get("fagen")
        f = f if f is not None and f.status == "ok" else None
        cells = [f"{f.tflops:.0f}" if f else "–"]
        for p in peers:
            peer = case.get(p)
            cells.append(f"{peer.ms / f.ms:.2f}" if f and peer and peer.status == "ok" else "–")
        name = _case_name(next(iter(case.values())), dtypes)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    notes = _peer_notes(rows, peers)
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def compile_lines(ct: list[dict]) -> list[str]:
    """bench.md's compile-time paragraph: one line a kernel."""
    from .compile_time import pyc_text

    text = [
        "Compile time, each in a fresh process with NVRTC's own cache off (CUDA_CACHE_DISABLE=1): cold = an empty "
        "fagen cache (the whole pipeline: trace/parse, proofs, render, NVRTC with ptxas); cached = a second "
        "process on the same cache (import fagen, then compile returns the kernel from disk; loading it onto "
        "the GPU happens on the first call). The CUDA driver's start (cuInit, to learn the GPU's arch), which "
        "any process using the GPU pays once and a PyTorch process has paid already, is timed apart:",
        "",
    ]
    return text + [
        f"- {c['kernel']}: cold {c['cold_s']} s (NVRTC {c['nvrtc_s']} s; whole process {c['cold_process_s']} s), "
        f"Python's bytecode cache {pyc_text(c)}; never-seen variant {c['new_variant']}: {c['new_s']} s "
        f"(NVRTC {c['new_nvrtc_s']} s; before it, import fagen {c['new_import_s']} s and driver start "
        f"{c['new_driver_s']} s; whole process {c['new_process_s']} s); "
        f"cached {c['cached_s'] * 1e3:.1f} ms (hit: {c['cached_hit']}; SymPy imported: {c['cached_sympy']}; "
        f"import fagen {c['import_s'] * 1e3:.1f} ms; driver start {c['driver_s'] * 1e3:.1f} ms; "
        f"whole process {c['cached_process_s']} s), "
        f"{c['registers']} registers, {c['stack_frame']} B stack frame (spills)"
        for c in ct
    ]


def window_lines(rows: list[Row]) -> list[str]:
    """Sliding window against full causal, fagen, same shape: the window's speed-up at each length."""
    window = {r.seqlen: r.ms for r in rows if r.variant == "window" and r.backend == "fagen" and r.status == "ok"}
    dims = {w.dim for w in rows if w.variant == "window"}
    causal_ms = {
        r.seqlen: r.ms
        for r in rows
        if r.variant == "none" and r.backend == "fagen" and r.causal and r.status == "ok" and r.dim in dims
    }
    if not (window and causal_ms):
        return []
    return ["", "Sliding window (left 256) vs full causal, fagen, same shape:", ""] + [
        f"- N={n}: window {window[n]:.3f} ms, causal {causal_ms[n]:.3f} ms: {causal_ms[n] / window[n]:.1f}x faster"
        for n in sorted(window)
        if n in causal_ms
    ]


def memory_lines(memory: list[dict], what: str) -> list[str]:
    if not memory:
        return []
    lines = ["", f"Peak extra memory of {what} (MiB):", ""]
    return lines + [f"- N={m['seqlen']}: fagen {m['fagen_MiB']}, materialized {m['materialized_MiB']}" for m in memory]


def forward_report(rows: list[Row], title: str, rounds: int, ct: list[dict], overhead, memory: list[dict]) -> list[str]:
    """bench.md of a forward run: the table, how it was timed, compile times, host cost, window and memory notes."""
    passes = (
        f"; the median of {rounds} passes over a case's backends, pass r starting at backend r."
        if rounds > 1
        else ", one pass over a case's backends in the order listed."
    )
    text = [f"# {title}", "", "```", table(rows), "```", ""]
    text += [
        "Each time is the median of the timer's runs (triton's do_bench: 25 ms of warm-up, 100 ms of runs), after a "
        "check against float64 on rows sampled over the sequence" + passes,
        "",
    ]
    text += compile_lines(ct)
    if overhead:
        text += [
            "",
            f"Host overhead per call ({overhead['shape']}, {overhead['calls']} back-to-back calls after "
            "warm-up, perf_counter around the loop, one synchronize at the end, divided by the calls): "
            f"fagen {overhead['fagen_us']} µs, SDPA (torch.nn.functional.scaled_dot_product_attention) "
            f"{overhead['sdpa_us']} µs.",
        ]
    return text + window_lines(rows) + memory_lines(memory, "one call")
