"""Where a step of the wgmma backward's main kernel spends its cycles: the rendered kernel gets clock64() stamps at
its step's phase boundaries (the source text is edited here, on its way to NVRTC: the product's kernel is not
changed; the kernel of a block per key tile, wgmma.BWD_PERSISTENT off), one backward runs, and the stamps of the
first TRACE_BLOCKS blocks' warp 0 of each consumer warpgroup come back from a __device__ array. Printed: each
phase's median cycles over the blocks' middle steps, per warpgroup, and how far warpgroup 1 runs behind warpgroup 0.
A stamp moves the code around it a little (clock64 is volatile).

    python3 bench/trace_bwd.py d128-causal-8192 d128-full-8192 d64-causal-8192 d128-window256-8192 d128-softcap-8192
    python3 bench/trace_bwd.py --set BWD_PIPELINE=overlap d128-causal-8192   # a wgmma tier setting first
    python3 bench/trace_bwd.py --sub 'REGEX=>TEXT' d128-causal-8192          # an edit of the kernel's source first

The phases (stamp k: the step's clock when the warp reached point k; d64-d128, the wide kernel's step differs):
    0 the step's top         1 its stage has landed (full)    2 S^T, dP^T landed (overlap: S^T)
    3 the element-wise steps done (before dqk^T, P^T to 16 bits)
    4 past BAR_DS (both warpgroups' dqk^T stored)              5 dV's, dQ's wgmma done
    8 dQ's buffer free (before its stores)                     9 its stores done
    6 dQ's part handed over                                    7 dK's wgmma done, the stage released
    11 (overlap only) dP^T landed
A kernel source without one of stamps 0-7's places stops the script, naming the stamp."""

from __future__ import annotations

import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ab_tools import edit_backward_main, kernel_global, parse_case  # noqa: E402

TRACE_BLOCKS, TRACE_STEPS, POINTS = 64, 64, 12
# (phase name, from stamp, to stamp): a phase whose stamps a kernel lacks is left out
PHASES = [
    ("full wait", 0, 1),
    ("S,dP", 1, 2),
    ("(overlap) dP after S", 2, 11),
    ("elementwise", 2, 3),
    ("dV+store+BAR_DS", 3, 4),
    ("dQ (wait<1>)", 4, 5),
    ("dQ: buffer free", 5, 8),
    ("dQ: stores", 8, 9),
    ("dQ: fence+arrive", 9, 6),
    ("dQ write", 5, 6),
    ("dK (wait<0>)", 6, 7),
]
REQUIRED = {0, 1, 2, 3, 4, 5, 6, 7}

STAMP = (
    "#define FAGEN_STAMP(k) do {{ if (c.lane == 0 && c.warp_in_wg == 0 && step < {S}) {{ "
    "const unsigned blk = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z); "
    "if (blk < {B}) fagen_trace[((blk * 2 + c.wg) * {S} + step) * {P} + (k)] = clock64(); }} }} while (0)\n"
)

# (anchor regex in the rendered source, stamp placed before (False) or after (True) the matched line)
ANCHORS = [
    (r"for \(int step = 0, h = h_kv \* heads_per_kv, t = 0; step < steps; \+\+step\) \{", 0, True),
    (r"mbar_wait\(smem\.full \+ 8 \* stage, \(unsigned\(step\) / STAGES\) & 1\);", 1, True),
    (r"gemm_s_(dp|then_dp)\(qk, dp, c, desc_add\(c\.Q_k, st\), desc_add\(c\.dO_k, st\)\);", 2, True),
    (r"wgmma_wait<0>\(\);\s+// dP_ij\^T has landed", 11, True),
    (r"write_dq\(dq, smem, c\);", 8, False),
    (r"write_dq\(dq, smem, c\);", 9, True),
    (r"to_fragments\((qk|pt), p_frag\);", 3, False),
    (r"named_bar_sync\(BAR_DS, CONSUMER_THREADS\);", 4, True),
    (r"fence_regs\(dq\);", 5, True),
    (
        r"(mbar_arrive\(smem\.dq_full \+ 8 \* c\.wg\);|named_bar_arrive\(BAR_DQ_FULL \+ c\.wg, DQ_BAR_THREADS\);)",
        6,
        True,
    ),
    (r"mbar_arrive\(smem\.empty \+ 8 \* stage\);\s+// Q_i, dO_i, lse_i, D_i read: the stage is free", 7, True),
]


def instrument(source: str) -> str:
    lines = source.split("\n")
    found = {}
    for rx, k, after in ANCHORS:
        hits = [i for i, line in enumerate(lines) if re.search(rx, line)]
        if len(hits) > 1 or (k in REQUIRED and not hits):
            raise SystemExit(f"stamp {k}: {len(hits)} lines match {rx!r}")
        for i in hits:
            found.setdefault(i, []).append((k, after))
    out = []
    for i, line in enumerate(lines):
        out += [f"FAGEN_STAMP({k});" for k, after in found.get(i, []) if not after]
        out.append(line)
        out += [f"FAGEN_STAMP({k});" for k, after in found.get(i, []) if after]
    text = "\n".join(out)
    head = f"__device__ unsigned long long fagen_trace[{TRACE_BLOCKS * 2 * TRACE_STEPS * POINTS}];\n"
    head += STAMP.format(S=TRACE_STEPS, B=TRACE_BLOCKS, P=POINTS)
    at = text.index('extern "C" __global__')
    return text[:at] + head + text[at:]


def edited(source: str) -> str:
    for old, new in SUBS:  # an experiment's edits (--sub), then the stamps
        if not re.search(old, source):
            raise SystemExit(f"--sub: no match for {old!r}")
        source = re.sub(old, new, source)
    return instrument(source)


def read_trace(name: str):
    import numpy as np

    arr = kernel_global(name, "fagen_trace", (TRACE_BLOCKS, 2, TRACE_STEPS, POINTS), "uint64")
    return arr, np.asarray(arr.get(), dtype=np.int64)


def run(case: str) -> None:
    import torch

    import fagen
    from fagen.tools import testing

    c = parse_case(case)  # (refused: any other mask, which was once traced as the kernel without one)
    kern = fagen.compile(c.D, dtype="bf16", use_cache=False, **c.options)
    q, k, v = testing.random_qkv(c.B, c.H, c.N, c.N, c.D, "bf16", Hkv=c.H // c.G)
    do = torch.randn_like(q)
    o, lse = kern(q, k, v, return_lse=True)
    main = kern.backward_plan.main.spec.name
    kern.backward(q, k, v, o, lse, do)  # loads the module
    torch.cuda.synchronize()
    dev, _ = read_trace(main)
    dev.fill(0)
    kern.backward(q, k, v, o, lse, do)
    torch.cuda.synchronize()
    _, t = read_trace(main)
    rows = []  # per (block, wg, step) with every required stamp: its stamps and the step's period
    lag2, lag4 = [], []
    req = sorted(REQUIRED)
    for b in range(TRACE_BLOCKS):
        for s in range(1, TRACE_STEPS - 1):
            if not (t[b, :, s][:, req].all() and t[b, :, s + 1, 0].all()):
                continue
            lag2.append(t[b, 1, s, 2] - t[b, 0, s, 2])
            lag4.append(t[b, 1, s, 4] - t[b, 0, s, 4])
            for w in range(2):
                rows.append((w, t[b, w, s], t[b, w, s + 1, 0] - t[b, w, s, 0]))
    print(f"## {case}: {main}, {len(rows) // 2} steps of {TRACE_BLOCKS} blocks{' ' + ' '.join(TAGS) if TAGS else ''}")
    print("| phase | wg0 cycles | wg1 cycles |")
    print("|---|---|---|")
    for name, a, z in PHASES:
        if not all(r[1][a] and r[1][z] for r in rows):
            continue
        med = [statistics.median(int(r[1][z] - r[1][a]) for r in rows if r[0] == w) for w in range(2)]
        print(f"| {name} | {med[0]:.0f} | {med[1]:.0f} |")
    per = [statistics.median(r[2] for r in rows if r[0] == w) for w in range(2)]
    print(f"| step period | {per[0]:.0f} | {per[1]:.0f} |")
    print(f"| wg1 - wg0 at S,dP landed | {statistics.median(lag2):.0f} | |")
    print(f"| wg1 - wg0 past BAR_DS | {statistics.median(lag4):.0f} | |")
    print()


SUBS: list[tuple[str, str]] = []
TAGS: list[str] = []


def main(argv: list[str]) -> int:
    from ab_tools import set_wgmma

    set_wgmma("BWD_PERSISTENT=False")  # the kernel of a block per key tile: the stamps are a block's (its one tile's)
    cases = []
    args = iter(argv)
    for a in args:
        if a == "--set":
            setting = next(args)
            set_wgmma(setting)
            TAGS.append(setting)
        elif a == "--sub":
            old, new = next(args).split("=>", 1)
            SUBS.append((old, new))
            TAGS.append(f"sub {old!r}")
        else:
            cases.append(a)
    edit_backward_main(edited)
    for case in cases or ["d128-causal-8192"]:
        run(case)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
