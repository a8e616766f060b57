"""A/B of two source trees on a GPU: the forward, forward + backward and decode times of the fagen at `--root`, one
JSON line per case, so that a change can be timed against the tree before it in one GPU session:

    python3 bench/ab.py --root OLD > old.jsonl       # a checkout of the tree before the change
    python3 bench/ab.py --root . > new.jsonl
    python3 bench/ab.py --compare old.jsonl new.jsonl

Run the two trees in turn, two or three rounds each, and read a ratio as noise unless every round agrees: single
cells move by a few percent between processes. A case is KIND-dDIM-MASK-N-VARIANT: KIND fwd (forward), bwd (forward
+ backward) or decode (q_len 1, batch 8, GQA 32/8, N keys in the cache; MASK causal); MASK full or causal; VARIANT
none, alibi, softcap, window or prefix. Forward and backward shapes follow FlashAttention's benchmark (bf16, B·N =
16384 tokens, H·D = 2048). Each case is checked against float64 (FlashAttention's rule, on a small shape) before it
is timed, and times are the median of `triton.testing.do_bench` (L2 flushed). `--peers` also times SDPA's
FlashAttention-2 and cuDNN backends where the variant is none. `--cases a,b,...` picks the cases (default: DEFAULT
below). `--set NAME=VALUE` sets one of the wgmma tier's module settings first, as in bench/ab_bwd_main.py, for an A/B
of two settings on one tree. A case that fails prints its error, and the others still run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

if "--root" in sys.argv:  # the tree whose fagen is timed, ahead of everything else on the path
    sys.path.insert(0, str(Path(sys.argv[sys.argv.index("--root") + 1]).resolve()))

from ab_tools import fagen_at_root, set_wgmma  # noqa: E402

VARIANTS = {
    "none": {},
    "alibi": {"alibi": True},
    "softcap": {"softcap": 30.0},
    "window": {"window": 256},
    "prefix": {"prefix": 1024},
}
DEFAULT = (
    [f"fwd-d{d}-{m}-{n}-none" for d in (64, 128, 256) for m in ("full", "causal") for n in (2048, 8192)]
    + ["fwd-d128-causal-2048-alibi", "fwd-d128-full-2048-softcap"]
    + [f"bwd-d{d}-{m}-{n}-none" for d in (64, 128) for m in ("full", "causal") for n in (2048, 8192)]
    + ["bwd-d128-causal-2048-alibi", "bwd-d64-causal-2048-alibi", "bwd-d128-full-2048-softcap"]
    + ["decode-d128-causal-8192-none", "decode-d128-causal-32768-none"]
)


def median_ms(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100)


def attention_case(kind: str, D: int, causal: bool, N: int, variant: str, peers: bool) -> dict:
    """A forward or forward + backward case: fagen's time, and the peers' with `peers`."""
    import torch

    import fagen
    from fagen.tools import testing

    B, H = 16384 // N, 2048 // D
    kern = fagen.compile(D, causal=causal, dtype="bf16", **VARIANTS[variant])
    if kind == "fwd":
        check = testing.check_kernel(kern, B=2, H=2, M=333, N=517)
    else:
        check = testing.check_backward(kern, B=2, H=2, M=300, N=257)
    q, k, v = testing.random_qkv(B, H, N, N, D, "bf16")
    do = torch.randn_like(q)
    tensors = testing.call_tensors(kern, B, H)

    def ours():
        if kind == "fwd":
            return kern(q, k, v, **tensors)
        o, lse = kern(q, k, v, return_lse=True, **tensors)
        return kern.backward(q, k, v, o, lse, do, **tensors)

    flops = 4 * B * H * N * N * D / (2 if causal else 1) * (1 if kind == "fwd" else 3.5)
    out = dict(kernel=kern.name, ok=bool(check.ok), check=str(check), ms=median_ms(ours))
    out["tflops"] = flops / out["ms"] / 1e9
    if peers and variant == "none":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        qg, kg, vg = (x.detach().requires_grad_(kind == "bwd") for x in (q, k, v))
        for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):

            def peer(backend=backend):
                with sdpa_kernel([backend]):
                    o = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
                    if kind == "bwd":
                        o.backward(do)

            out[f"{name}_ms"] = median_ms(peer)
    return out


def decode_case(D: int, N: int, B: int = 8, H: int = 32, Hkv: int = 8) -> dict:
    """q_len 1 over a contiguous cache of N keys a sequence: checked against float64 SDPA on a short cache."""
    import torch

    import fagen

    kern = fagen.compile(D, causal=True, decode=True, dtype="bf16")

    def inputs(length):
        q = torch.randn(B, 1, H, D, device="cuda", dtype=torch.bfloat16)
        kc, vc = (torch.randn(B, length, Hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        return q, kc, vc, torch.full((B,), length, dtype=torch.int32, device="cuda")

    def sdpa(q, kc, vc, dtype):
        q, kc, vc = (x.transpose(1, 2).to(dtype) for x in (q, kc, vc))
        return torch.nn.functional.scaled_dot_product_attention(q, kc, vc, enable_gqa=True).transpose(1, 2)

    q, kc, vc, lens = inputs(1000)
    ref = sdpa(q, kc, vc, torch.float64)
    err = float((kern.decode(q, kc, vc, lens).double() - ref).abs().max())
    naive = float((sdpa(q, kc, vc, torch.bfloat16).double() - ref).abs().max())
    q, kc, vc, lens = inputs(N)
    ms = median_ms(lambda: kern.decode(q, kc, vc, lens))
    ok = err <= 2 * naive + 1e-3
    return dict(kernel=kern.name, ok=ok, check=f"max|O - ref| {err:.2e} (naive bf16 {naive:.2e})", ms=ms)


def run(case: str, peers: bool) -> dict:
    kind, dim, mask, n, variant = case.split("-")
    if kind not in ("fwd", "bwd", "decode") or mask not in ("full", "causal") or variant not in VARIANTS:
        raise ValueError(f"case {case!r}: expected KIND-dDIM-MASK-N-VARIANT (see the docstring)")
    if kind == "decode":
        return dict(case=case, **decode_case(int(dim[1:]), int(n)))
    return dict(case=case, **attention_case(kind, int(dim[1:]), mask == "causal", int(n), variant, peers))


def compare(old_path: str, new_path: str) -> None:
    def read(path):
        return {r["case"]: r for r in map(json.loads, Path(path).read_text().splitlines()) if "case" in r}

    old, new = read(old_path), read(new_path)
    print(f"{'case':30} {'old ms':>8} {'new ms':>8} {'old/new':>8} {'/FA2':>6} {'/cuDNN':>6}  ok  kernel (new)")
    for case, n in new.items():
        o = old.get(case, {})
        if "error" in n or "ms" not in o:
            print(f"{case:30} {n.get('error', 'not in ' + old_path)[:100]}")
            continue
        fa2, cudnn = (n[f"{p}_ms"] / n["ms"] if f"{p}_ms" in n else float("nan") for p in ("flash", "cudnn"))
        print(
            f"{case:30} {o['ms']:8.3f} {n['ms']:8.3f} {o['ms'] / n['ms']:8.3f} {fa2:6.2f} {cudnn:6.2f}  "
            f"{'ok' if n['ok'] and o['ok'] else 'FAIL'}  {n['kernel']}"
        )


def main(argv: list[str]) -> int:
    if "--compare" in argv:
        i = argv.index("--compare")
        compare(argv[i + 1], argv[i + 2])
        return 0
    fagen = fagen_at_root(argv)
    where = Path(fagen.__file__).resolve()
    print(json.dumps(dict(fagen=str(where.parent), version=fagen.__version__)), flush=True)
    for i in [i for i, a in enumerate(argv) if a == "--set"]:
        value = set_wgmma(argv[i + 1])
        print(json.dumps(dict(setting=argv[i + 1].split("=", 1)[0], value=value)), flush=True)
    cases = argv[argv.index("--cases") + 1].split(",") if "--cases" in argv else DEFAULT
    for case in cases:
        try:
            print(json.dumps(run(case, "--peers" in argv)), flush=True)
        except Exception as e:  # a case that fails says so, and the others still run
            print(json.dumps(dict(case=case, error=f"{type(e).__name__}: {e}")), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
