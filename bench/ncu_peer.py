"""fagen's backward main kernel beside FlashAttention-4's under Nsight Compute: one shape (bf16, FlashAttention's
benchmark shapes: B·N = 16384 tokens, H·D = 2048), one backward of each inside cudaProfilerStart/Stop, every kernel
of it profiled; the table gives each main kernel's time, its tensor pipe's active share (wgmma), its warps' issue
share, its wgmma count (equal where the two take the same tiles) and the stall reasons per issued instruction, so
that a gap in the tensor pipe's share can be traced to where the warps wait (issue 39 asks the note for these).

    python3 bench/ncu_peer.py 128 8192 --causal       # d128 causal 8k; ncu on PATH, flash_attn.cute importable
    python3 bench/ncu_peer.py 64 8192 --ncu /usr/local/cuda/bin/ncu
    python3 bench/ncu_peer.py 128 8192 --causal --variant gqa      # `fagen bench`'s GQA 32/8 (batch 2)
    python3 bench/ncu_peer.py 128 0 --causal --variant packed      # its packed documents (16k tokens; N unused)

ncu locks the clocks to base: its times are longer than a benchmark's, their ratio is what to read."""

from __future__ import annotations

import csv
import io
import subprocess
import sys

METRICS = {
    "gpu__time_duration.sum": "time (ns)",
    "sm__pipe_tensor_op_hmma_type_hmma_hgmma_qgmma_cycles_active.avg.pct_of_peak_sustained_active": "tensor pipe %",
    "smsp__issue_active.avg.pct_of_peak_sustained_active": "issue active %",
    "sm__inst_executed_pipe_tensor_op_gmma.sum": "wgmma instructions",
    "sm__cycles_active.avg": "SM cycles active",
    "launch__grid_size": "blocks",
    "launch__registers_per_thread": "registers",
}
STALLS = "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio"
MAIN = ("_wgmma_m", "bwd_sm90Flash")  # fagen's backward main kernel, FlashAttention-4's


def one_backward(who: str, D: int, N: int, causal: bool, variant: str = "none") -> None:
    """The profiled process: `who`'s forward (and a few warm-up calls, which compile), then one backward between
    cudaProfilerStart and cudaProfilerStop. variant "gqa": 32 query heads over 8 KV heads (H·D = 4096 at d128, as
    `fagen bench`'s case); "packed": `fagen bench`'s packed documents (varlen, 16k tokens, N unused)."""
    import torch

    from fagen.tools.bench.cases import cu_seqlens, packed_document_lengths

    B, H = 16384 // max(N, 1), 2048 // D
    H_kv = H
    if variant == "gqa":
        H, H_kv = 4096 // D, 4096 // D // 4
    docs = packed_document_lengths() if variant == "packed" else ()
    shape = lambda h: (1, sum(docs), h, D) if docs else (B, N, h, D)  # noqa: E731
    q, do = (torch.randn(shape(H), device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(shape(H_kv), device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cu = torch.tensor(cu_seqlens(docs), dtype=torch.int32, device="cuda") if docs else None
    longest = max(docs, default=0)
    if who == "fagen":
        import fagen

        kern = fagen.compile(D, causal=causal, dtype="bf16")
        if docs:
            q, k, v, do = (x[0] for x in (q, k, v, do))
            o, lse = kern.varlen(q, k, v, cu, cu, longest, longest, return_lse=True)

            def backward():
                kern.varlen_backward(q, k, v, o, lse, do, cu, cu, longest, longest, tensor_grads=False)
        else:
            qt, kt, vt, dot = (x.transpose(1, 2) for x in (q, k, v, do))
            o, lse = kern(qt, kt, vt, return_lse=True)

            def backward():
                kern.backward(qt, kt, vt, o, lse, dot)
    else:
        from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

        if docs:
            q, k, v, do = (x[0] for x in (q, k, v, do))
        qg, kg, vg = (x.requires_grad_() for x in (q, k, v))

        def forward():
            if docs:
                out = flash_attn_varlen_func(
                    qg,
                    kg,
                    vg,
                    cu_seqlens_q=cu,
                    cu_seqlens_k=cu,
                    max_seqlen_q=longest,
                    max_seqlen_k=longest,
                    causal=causal,
                )
            else:
                out = flash_attn_func(qg, kg, vg, causal=causal)
            return out[0] if isinstance(out, tuple) else out

        o = forward()

        def backward():
            torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True)

    for _ in range(3):
        backward()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    backward()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def profile(ncu: str, who: str, D: int, N: int, causal: bool, variant: str = "none") -> dict[str, str]:
    """The main kernel's metrics ({metric name: value}) from one ncu run of `one_backward`."""
    metrics = ",".join([*METRICS, STALLS])
    command = [ncu, "--profile-from-start", "off", "--metrics", metrics, "--csv", "--page", "details"]
    command += [sys.executable, __file__, "run", who, str(D), str(N), str(int(causal)), variant]
    done = subprocess.run(command, capture_output=True, text=True)
    lines = "\n".join(x for x in done.stdout.splitlines() if x.startswith('"'))
    rows = [r for r in csv.DictReader(io.StringIO(lines)) if any(m in r["Kernel Name"] for m in MAIN)]
    if not rows:
        raise RuntimeError(f"ncu saw no backward main kernel of {who} (exit {done.returncode}): {done.stderr[-400:]}")
    return {r["Metric Name"]: r["Metric Value"] for r in rows}


def table(results: dict[str, dict[str, str]]) -> str:
    who = list(results)
    lines = [f"{'':28}" + "".join(f"{w:>16}" for w in who)]
    for metric, label in METRICS.items():
        lines.append(f"{label:28}" + "".join(f"{results[w].get(metric, '-'):>16}" for w in who))
    stalls = sorted({m for r in results.values() for m in r if "issue_stalled" in m})
    for metric in stalls:
        values = [results[w].get(metric, "-") for w in who]
        if any(v not in ("0", "0.00", "-") for v in values):
            label = "stall " + metric.split("stalled_")[1].split("_per_issue")[0]
            lines.append(f"{label:28}" + "".join(f"{v:>16}" for v in values))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if argv[:1] == ["run"]:
        one_backward(argv[1], int(argv[2]), int(argv[3]), argv[4] == "1", argv[5])
        return 0
    ncu = argv[argv.index("--ncu") + 1] if "--ncu" in argv else "ncu"
    D, N = int(argv[0]), int(argv[1])
    causal = "--causal" in argv
    variant = argv[argv.index("--variant") + 1] if "--variant" in argv else "none"
    if variant not in ("none", "gqa", "packed"):
        raise SystemExit(f"--variant must be none, gqa or packed, not {variant!r}")
    results = {}
    for who in ("fagen", "fa4"):
        try:
            results[who] = profile(ncu, who, D, N, causal, variant)
        except RuntimeError as e:  # FlashAttention-4 not installed, ncu missing a metric: the other column stays
            print(e, file=sys.stderr)
    what = {"none": "", "gqa": "GQA 32/8, ", "packed": "packed documents, "}[variant]
    shape = "16k tokens" if variant == "packed" else N
    print(f"backward main kernel, {what}d{D} {'causal' if causal else 'non-causal'} {shape}, bf16 (Nsight Compute)")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
