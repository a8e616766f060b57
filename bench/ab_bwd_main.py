"""A/B of two source trees' backward main kernel on one GPU: the fagen at `--root` (imported ahead of everything
else), its backward checked against float64 (FlashAttention's rule, a small shape), then timed at FlashAttention's
benchmark shapes (bf16, B·N = 16384 tokens, H·D = 2048), d64 and d128, causal and not, 2k and 8k: the main kernel
alone and every kernel the backward launches (their device times by the torch profiler, which sees NVRTC's
launches; "passes" is their sum), and the whole backward (preprocess, main kernel, convert; CUDA events), each the
median of `--rounds` rounds. One JSON line per case; `--compare` also lists each kernel of both.

    python3 bench/ab_bwd_main.py --root .gpu/base > base.jsonl     # a copy of the tree before the change
    python3 bench/ab_bwd_main.py --root . > new.jsonl
    python3 bench/ab_bwd_main.py --root .gpu/base > base2.jsonl    # again, in turn: a process's cells move by a
    python3 bench/ab_bwd_main.py --root . > new2.jsonl             # few percent
    python3 bench/ab_bwd_main.py --compare base.jsonl new.jsonl

`--cases d128-causal-8192,...` picks cases (DIM-MASK-N, MASK full, causal, softcap: 30, no mask, or window: causal, 1024
keys, windowW: W keys; a suffix -gqaG: G query heads a KV head, as d128-causal-8192-gqa4, G dividing the heads; -hH: H
query heads, not 2048 / DIM, as d128-causal-8192-gqa4-h32, `fagen bench`'s GQA case; `packed`: its packed documents, a
varlen call; default: every one above but softcap, window, GQA and packed). Kernels are built afresh (use_cache=False),
so that each tree runs its own sources. `--set BWD_NARROW_KV=False` sets one of the wgmma tier's module settings first
(a string, or an int or bool where the setting is one; `--set` again for another), for an A/B of two settings on one
tree (a tuple of ints written 96:128, e.g. `--set ROWS80_HEAD_DIMS=96:128`, empty for none). Where a change also alters
the setting's off path (another pass's work), that A/B measures against the altered path: time the tree before the
change too. `--deterministic` times (and checks) the backward with deterministic=True."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

if "--root" in sys.argv:  # the tree whose fagen is timed, ahead of everything else on the path
    sys.path.insert(0, str(Path(sys.argv[sys.argv.index("--root") + 1]).resolve()))

from ab_tools import fagen_at_root, parse_case, set_wgmma, timed_us  # noqa: E402

DEFAULT = [f"d{d}-{m}-{n}" for d in (64, 128) for m in ("full", "causal") for n in (2048, 8192)]


def kernels_us(fn, reps: int = 10) -> dict[str, float]:
    """Mean device µs per call of `fn` in each kernel it launches, by name (torch profiler, CUDA activity only: the
    kernels and fills, no host op)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    return {e.key: e.device_time_total / reps for e in prof.key_averages() if e.device_time_total > 0}


def packed_backward(deterministic: bool):
    """`fagen bench`'s packed documents (d128 causal, 16 heads, 7 documents, 16k tokens): the kernel, its backward
    checked (a dense call: the varlen calls' checks are the GPU tier's, test_backward_gpu.py) and the timed backward."""
    import torch

    import fagen
    from fagen.tools import testing
    from fagen.tools.bench.cases import cu_seqlens, packed_document_lengths

    kern = fagen.compile(128, dtype="bf16", use_cache=False, causal=True)
    check = testing.check_backward(kern, B=2, H=4, Hkv=2, M=300, N=257, deterministic=deterministic)
    docs = packed_document_lengths()
    cu = torch.tensor(cu_seqlens(docs), dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(sum(docs), 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    do = torch.randn_like(q)
    o, lse = kern.varlen(q, k, v, cu, cu, max(docs), max(docs), return_lse=True)

    def backward():
        return kern.varlen_backward(q, k, v, o, lse, do, cu, cu, max(docs), max(docs), deterministic=deterministic)

    return kern, check, backward


def run(case: str, rounds: int, deterministic: bool = False) -> dict:
    import torch

    import fagen
    from fagen.tools import testing

    if case == "packed":
        kern, check, backward = packed_backward(deterministic)
    else:
        c = parse_case(case)
        D, N, B, H, G = c.D, c.N, c.B, c.H, c.G
        kern = fagen.compile(D, dtype="bf16", use_cache=False, **c.options)
        check = testing.check_backward(kern, B=2, H=2 * G, Hkv=2, M=300, N=257, deterministic=deterministic)
        q, k, v = testing.random_qkv(B, H, N, N, D, "bf16", Hkv=H // G)
        do = torch.randn_like(q)
        o, lse = kern(q, k, v, return_lse=True)

        def backward():
            return kern.backward(q, k, v, o, lse, do, deterministic=deterministic)

    main = kern.backward_plan.main.spec.name

    mains, sums, wholes = [], [], []
    for _ in range(rounds):
        kernels = kernels_us(backward)
        if main not in kernels:
            raise RuntimeError(f"the profiler saw no kernel {main}")
        mains.append(kernels[main])
        sums.append(sum(kernels.values()))
        wholes.append(timed_us(backward))
    return dict(
        case=case,
        kernel=main,
        ok=bool(check.ok),
        check=str(check),
        main_us=statistics.median(mains),
        passes_us=statistics.median(sums),
        kernels_us=kernels,  # (the last round's)
        bwd_us=statistics.median(wholes),
    )


def compare(old_path: str, new_path: str) -> None:
    """The two files' cases side by side: the main kernel, the sum of every kernel the backward launches (the
    passes: a change that moves work between kernels shows there) and the whole backward by CUDA events."""

    def read(path):
        return {r["case"]: r for r in map(json.loads, Path(path).read_text().splitlines()) if "case" in r}

    def us(x: float | None) -> str:
        return "-" if x is None else f"{x:.0f}"

    def cell(o: dict, n: dict, key: str) -> str:
        if key not in o or key not in n:  # (files written before the passes were timed)
            return f"{'-':>9} {'-':>9} {'-':>9}"
        return f"{o[key]:9.0f} {n[key]:9.0f} {o[key] / n[key]:9.3f}"

    old, new = read(old_path), read(new_path)
    head = ("main", "pass", "bwd")  # (each an old, a new and their ratio)
    print(f"{'case':18} " + " ".join(f"{h + ' old':>9} {h + ' new':>9} {'old/new':>9}" for h in head) + "  ok")
    for case, n in new.items():
        o = old.get(case, {})
        if "error" in n or "main_us" not in o:
            print(f"{case:18} {n.get('error', 'not in ' + old_path)[:100]}")
            continue
        cells = " ".join(cell(o, n, key) for key in ("main_us", "passes_us", "bwd_us"))
        print(f"{case:18} {cells}  {'ok' if n['ok'] and o['ok'] else 'FAIL'}")
        ko, kn = o.get("kernels_us", {}), n.get("kernels_us", {})
        for name in sorted(set(ko) | set(kn)):
            print(f"{'':20}{name[:66]:66} {us(ko.get(name)):>9} {us(kn.get(name)):>9}")


def main(argv: list[str]) -> int:
    if "--compare" in argv:
        i = argv.index("--compare")
        compare(argv[i + 1], argv[i + 2])
        return 0
    fagen = fagen_at_root(argv)
    where = Path(fagen.__file__).resolve()
    import torch

    print(json.dumps(dict(fagen=str(where.parent), version=fagen.__version__, device=torch.cuda.get_device_name())))
    for i in [i for i, a in enumerate(argv) if a == "--set"]:
        value = set_wgmma(argv[i + 1])
        print(json.dumps(dict(setting=argv[i + 1].split("=", 1)[0], value=value)))
    cases = argv[argv.index("--cases") + 1].split(",") if "--cases" in argv else DEFAULT
    rounds = int(argv[argv.index("--rounds") + 1]) if "--rounds" in argv else 3
    for case in cases:
        try:
            print(json.dumps(run(case, rounds, "--deterministic" in argv)), flush=True)
        except Exception as e:  # a case that fails says so, and the others still run
            print(json.dumps(dict(case=case, error=f"{type(e).__name__}: {e}")), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
