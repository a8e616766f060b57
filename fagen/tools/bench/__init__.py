"""`fagen bench`: fagen side by side with FlashAttention-4, PyTorch SDPA (FlashAttention-2 and cuDNN backends) and
compiled FlexAttention, in one process, on one GPU, with FlashAttention's convention (../shared/BENCH.md).

The modules, by job: `cases` (the case tables and which backends run each: pure), `timing`, `peers`, `check`
(outputs against float64 before they are timed), `forward`, `backward`, `decode`, `document` (document masks),
`model` (a Llama-style model), `context_parallel` (fagen.ring_attention on several GPUs, its own processes),
`compile_time`, `memory`, and `report` (the tables, bench.csv, the plot, RESULTS.md).
"""

from __future__ import annotations

import datetime
import shlex
import sys
import time
from pathlib import Path

from . import cases, report


def run_info(args, backward: bool):
    """The run's GPU, date, versions and command, for the results it writes."""
    import fagen

    from .. import testing

    torch = testing._torch()
    return report.RunInfo(
        gpu=torch.cuda.get_device_name(),
        date=datetime.date.today().isoformat(),
        torch=torch.__version__,
        cuda=str(torch.version.cuda),
        fagen=fagen.__version__,
        command=shlex.join(["fagen", *getattr(args, "argv", ["bench"])]),
        backward=backward,
        rounds=args.rounds,
    )


def _write(path: Path, lines: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _forward(args, selected: list[cases.Case]) -> int:
    from . import compile_time, forward, memory

    info = run_info(args, backward=False)
    t0 = time.perf_counter()
    dense = [c for c in selected if c.variant == "none"] or selected
    masks = tuple(dict.fromkeys(c.compile_options["causal"] for c in dense))
    ct = compile_time.compile_times(tuple(dict.fromkeys(c.dim for c in dense)), masks, args.dtype[0], args.tier)
    try:
        overhead = compile_time.host_overhead(dtype=args.dtype[0])
    except Exception as e:  # reported, not fatal: the throughput table still follows
        print(f"host overhead not measured: {type(e).__name__}: {e}", file=sys.stderr)
        overhead = None
    rows = forward.run(selected, args.backends or cases.BACKENDS, tier=args.tier, rounds=args.rounds)
    mem = memory.peak_memory() if args.memory else []
    report.write_csv(rows, args.out / "bench.csv")
    title = f"fagen {info.fagen} on {info.gpu}, {info.date}, torch {info.torch}"
    text = report.forward_report(rows, title, args.rounds, ct, overhead, mem)
    _write(args.out / "bench.md", text + ["", f"Wall time {time.perf_counter() - t0:.0f} s."])
    try:
        report.plot(rows, mem, args.out / "bench.png", title)
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
    if args.results:
        args.results.write_text(report.results_markdown(rows, info))
    return 0


def _backward(args, selected: list[cases.Case]) -> int:
    from . import backward, memory

    info = run_info(args, backward=True)
    rows = backward.run(selected, cases.backend_columns(args), tier=args.tier, rounds=args.rounds)
    report.write_csv(rows, args.out / "bench_backward.csv")
    title = f"fagen {info.fagen} forward + backward on {info.gpu}, {info.date}, torch {info.torch}"
    text = [f"# {title}", "", "```", report.table(rows), "```", "", "TF/s: 3.5x the forward's FLOPs over fwd+bwd time."]
    if args.deterministic:
        text += ["", backward.DETERMINISTIC_NOTE]
    if args.memory:
        what = "one forward + backward (d128, one batch, 16 heads, first call of the shape)"
        text += report.memory_lines(memory.peak_memory_backward(), what)
    _write(args.out / "bench_backward.md", text)
    if args.results:
        args.results.write_text(report.results_markdown(rows, info))
    return 0


def _decode(args) -> int:
    from .decode import decode, decode_table

    info = run_info(args, backward=False)
    rows = decode(args.seqlen or cases.DECODE_SEQLENS)
    text = [
        f"# fagen {info.fagen} decode on {info.gpu}, {info.date}, torch {info.torch}",
        "",
        "Batch 8, GQA 32/8, d128, bf16, causal, every sequence at the full length; paged: pages in shuffled "
        "order. TB/s = bytes of K + V read / time (median of triton's do_bench); copy = a device-to-device copy "
        "of the same bytes, its bandwidth counted as bytes read + written / time; / copy = TB/s over that.",
        "",
        decode_table(rows),
    ]
    _write(args.out / "decode.md", text)
    return 0


def _document(args) -> int:
    import json

    from ..options import causal_cases
    from .document import document_line, run_document

    info = run_info(args, backward=False)
    causal = tuple(bool(c) for c in causal_cases(args.causal))
    seqlens = args.seqlen or cases.DEFAULT_SEQLENS
    forms = tuple(cases.DOCUMENT_FORMS[v] for v in cases.DOCUMENT_VARIANTS if v in args.variant)
    rows = [r for d in args.dim for r in run_document(seqlens, d, args.dtype[0], causal=causal[::-1], forms=forms)]
    text = [f"# document masks: fagen vs FlexAttention on {info.gpu}, {info.date}, torch {info.torch}"]
    text += ["", *[f"- {document_line(r)}" for r in rows]]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "document.json").write_text(json.dumps(rows, indent=1, default=str))
    _write(args.out / "document.md", text)
    return 0


def main(args) -> int:
    """`fagen bench`: the options are checked (and the cases chosen) before the GPU is looked for."""
    from ... import request

    which, selected = cases.selection(args)
    if request.detect_arch() is None:
        raise RuntimeError("no CUDA GPU found: fagen bench times kernels on a GPU")
    if which == "model":
        from . import model

        return model.main(args)
    if which == "context_parallel":
        from . import context_parallel

        return context_parallel.main(args)
    runners = {"decode": _decode, "document": _document}
    if which in runners:
        return runners[which](args)
    return (_backward if which == "backward" else _forward)(args, selected)
