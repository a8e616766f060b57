"""Forward + backward A/B of fagen's backward: times each case in this process (the fagen found on sys.path) and
prints one JSON line per case, so that two trees can be run side by side in one GPU session
(`PYTHONPATH=old python3 bench/ab_backward.py` against `PYTHONPATH=. python3 bench/ab_backward.py`). Shapes follow
the benchmark convention (B·N = 16384 tokens, H·D = 2048, bf16). Each case is checked against float64 autograd
(FlashAttention's rule, a small shape) before it is timed. `--peers` also times SDPA's FlashAttention-2 and cuDNN
backends. Usage: python bench/ab_backward.py [--peers] [--cases d64-causal-2048-none,...];
python bench/ab_backward.py --compare OLD.jsonl NEW.jsonl prints the table of the two. `--budget B` lets the wgmma
tier's backward main kernel spill up to B bytes before it steps down (to time such a kernel); `--root DIR` times the
fagen of the checkout at DIR."""

from __future__ import annotations

import json
import sys

if "--root" in sys.argv:  # the tree whose fagen is timed (a checkout's root), ahead of everything else
    sys.path.insert(0, sys.argv[sys.argv.index("--root") + 1])

import torch  # noqa: E402

import fagen  # noqa: E402
from fagen.tools import testing  # noqa: E402

VARIANTS = {
    "none": {},
    "alibi": {"alibi": True},
    "softcap": {"softcap": 30.0},
    "window": {"window": 256},
    "prefix": {"prefix": 1024},
}
DEFAULT = [f"d{d}-{m}-{n}-none" for d in (64, 128) for m in ("full", "causal") for n in (2048, 8192)] + [
    "d128-causal-2048-alibi",
    "d128-causal-8192-alibi",
    "d64-causal-2048-alibi",
    "d128-full-2048-softcap",
]


def median_ms(fn, reps=30, warmup=5):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(start, end):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(start, end))
    return times[len(times) // 2]


def run(case: str, peers: bool) -> dict:
    dim, mask, n, variant = case.split("-")
    D, N, causal = int(dim[1:]), int(n), mask == "causal"
    B, H = 16384 // N, 2048 // D
    kern = fagen.compile(D, causal=causal, dtype="bf16", **VARIANTS[variant])
    r = testing.check_backward(kern, B=2, H=2, M=300, N=257)
    q, k, v = testing.random_qkv(B, H, N, N, D, "bf16")
    do = torch.randn_like(q)
    tensors = testing.call_tensors(kern, B, H)

    def fwd_bwd():
        o, lse = kern(q, k, v, return_lse=True, **tensors)
        return kern.backward(q, k, v, o, lse, do, **tensors)

    o, lse = kern(q, k, v, return_lse=True, **tensors)
    flops = 4 * B * H * N * N * D / (2 if causal else 1)
    ok = r.finite and all(err <= bound for err, _, bound in r.errors.values())
    out = dict(case=case, main=kern.backward_plan.main.spec.name, ok=ok, check=str(r))
    out["fwd_bwd_ms"] = median_ms(fwd_bwd)
    out["bwd_ms"] = median_ms(lambda: kern.backward(q, k, v, o, lse, do, **tensors))
    out["tflops"] = 3.5 * flops / out["fwd_bwd_ms"] / 1e9
    if peers and variant == "none":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
        for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):

            def peer(backend=backend):
                with sdpa_kernel([backend]):
                    torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=causal).backward(do)

            out[f"{name}_ms"] = median_ms(peer)
    return out


def compare(old_path: str, new_path: str) -> None:
    def read(path):
        rows = {}
        for line in open(path):
            if line.startswith("{"):
                r = json.loads(line)
                rows[r["case"]] = r
        return rows

    old, new = read(old_path), read(new_path)
    print(
        f"{'case':26} {'old ms':>8} {'new ms':>8} {'speedup':>8} {'TF/s':>6} {'/FA2':>6} {'/cuDNN':>6}  ok  main (new)"
    )
    for case, n in new.items():
        o = old.get(case, {})
        if "error" in n:
            print(f"{case:26} error: {n['error'][:100]}")
            continue
        speed = o["fwd_bwd_ms"] / n["fwd_bwd_ms"] if "fwd_bwd_ms" in o else float("nan")
        fa2 = n["flash_ms"] / n["fwd_bwd_ms"] if "flash_ms" in n else float("nan")
        cud = n["cudnn_ms"] / n["fwd_bwd_ms"] if "cudnn_ms" in n else float("nan")
        print(
            f"{case:26} {o.get('fwd_bwd_ms', float('nan')):8.3f} {n['fwd_bwd_ms']:8.3f} {speed:8.3f} "
            f"{n['tflops']:6.0f} {fa2:6.2f} {cud:6.2f}  {'ok' if n['ok'] else 'FAIL'}  {n['main']}"
        )


def main(argv: list[str]) -> int:
    if "--compare" in argv:
        i = argv.index("--compare")
        compare(argv[i + 1], argv[i + 2])
        return 0
    peers = "--peers" in argv
    if "--budget" in argv:
        from fagen.backend import tiers

        type(tiers.get("wgmma")).backward_stack_budget = int(argv[argv.index("--budget") + 1])
    cases = DEFAULT
    if "--cases" in argv:
        cases = argv[argv.index("--cases") + 1].split(",")
    for case in cases:
        try:
            print(json.dumps(run(case, peers)), flush=True)
        except Exception as e:  # a case that fails says so and the others still run
            print(json.dumps(dict(case=case, error=f"{type(e).__name__}: {e}")), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
