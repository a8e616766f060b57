"""Where the wgmma backward's main kernel spends an SM's time outside its blocks' step loops (d64 to d128: the wide
kernel's epilogue differs, and it is refused). Every block stamps clock64() and %globaltimer at points of its start
(the work tile named, the mbarriers set up, past the block's barrier, each role past setmaxnreg, K_j and V_j asked for
and landed), at its step loop's end and through its dK/dV epilogue, and where the producer's last dQ reduction has
landed (the source text is edited on its way to NVRTC, as bench/trace_bwd.py does; the product's kernel is not
changed; the kernel of a block per key tile, wgmma.BWD_PERSISTENT off). Printed per case: the blocks' median cycles
of each phase, and over all SMs the share of the kernel's span spent in step loops, around them, and between blocks
(an SM's block done to its next one's start, and the ends).

    python3 bench/trace_blocks.py d128-window256-16384 d128-causal-2048 d128-causal-8192
    python3 bench/trace_blocks.py --set BWD_HEADS_INNER=False d128-causal-2048   # a wgmma tier setting first
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ab_tools import edit_backward_main, kernel_global, parse_case  # noqa: E402

MAX_BLOCKS, POINTS = 1 << 16, 13
SLOTS = 2 * POINTS + 2
# slots: clock64 at point k (0 start, 1 K/V landed, 2 loop end, 3 epilogue end, 4 producer's last dQ landed, 5 the
# producer issues K/V, 6 consumers past setmaxnreg, 7 producer past setmaxnreg, 8 work tile named, 9 past the block's
# barrier, 10 mbarriers set up, 11 epilogue: both warpgroups done, 12 this thread's tiles staged), POINTS + k
# %globaltimer at them, then the SM and the block's steps
G, SM, STEPS_AT = POINTS, 2 * POINTS, 2 * POINTS + 1
BLOCK = "(blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z))"
HEAD = (
    f"__device__ long long fagen_blocks[{MAX_BLOCKS * SLOTS}];\n"
    "__device__ __forceinline__ long long fagen_gt() {\n"
    '    long long t; asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t)); return t;\n'
    "}\n"
    f"#define FAGEN_BLK(k) do {{ const unsigned blk = {BLOCK}; if (blk < {MAX_BLOCKS}) {{ \\\n"
    f"    long long* s = fagen_blocks + blk * {SLOTS}; s[k] = clock64(); s[{POINTS} + (k)] = fagen_gt(); \\\n"
    f'    if ((k) == 0) {{ unsigned sm; asm volatile("mov.u32 %0, %smid;" : "=r"(sm)); s[{SM}] = sm; }} \\\n'
    "} } while (0)\n"
)
STEPS = f"fagen_blocks[{BLOCK} * {SLOTS} + {STEPS_AT}] = steps;"
# (a line of the kernel that holds this text, once; what goes before it, what after it)
EDITS = [
    ("const Smem smem(smem_raw);", "", "if (threadIdx.x == 0) FAGEN_BLK(0);"),
    ("if (steps > 0) mbar_wait(smem.full_kv, 0);", "", f"if (threadIdx.x == 128) {{ FAGEN_BLK(1); {STEPS} }}"),
    ("// ---------------- the epilogue: dK_j, dV_j, one write each", "if (threadIdx.x == 128) FAGEN_BLK(2);", ""),
    ("dv_stride_n, dv_stride_d, dkv_float32", "", "if (threadIdx.x == 128) FAGEN_BLK(3);"),
    ("reduce_dq(smem, kt, batch_q,", "", "if (lane == 0) FAGEN_BLK(4);"),
    ("mbar_arrive_expect_tx(smem.full_kv", "FAGEN_BLK(5);", ""),
    ("setmaxnreg_inc<CONSUMER_REGS>();", "", "if (threadIdx.x == 128) FAGEN_BLK(6);"),
    ("setmaxnreg_dec<PRODUCER_REGS>();", "", "if (threadIdx.x == 0) FAGEN_BLK(7);"),
    ("const int tile_n = ", "", "if (threadIdx.x == 0) FAGEN_BLK(8);"),
    ("if (warp_group == 0) {", "if (threadIdx.x == 0) FAGEN_BLK(9);", ""),
    ("smem.init_barriers(", "", "if (threadIdx.x == 0) FAGEN_BLK(10);"),
    ("named_bar_sync(BAR_EPILOGUE, CONSUMER_THREADS);", "", "if (threadIdx.x == 128) FAGEN_BLK(11);"),
    ("stage_dk_dv<KV_COLS>(dK, dV, tile_k, tile_v, 0, c);", "", "if (threadIdx.x == 128) FAGEN_BLK(12);"),
]


def instrument(source: str) -> str:
    lines = source.split("\n")
    for text, before, after in EDITS:
        hits = [i for i, line in enumerate(lines) if text in line]
        if len(hits) != 1:
            raise SystemExit(f"{len(hits)} lines hold {text!r}")
        i = hits[0]
        lines[i : i + 1] = [x for x in (before, lines[i], after) if x]
    return HEAD + "\n".join(lines)  # (ahead of every function: the producer's load_steps stamps too)


def run(case: str) -> None:
    import torch

    import fagen
    from fagen.tools import testing

    c = parse_case(case)
    kern = fagen.compile(c.D, dtype="bf16", use_cache=False, **c.options)
    q, k, v = testing.random_qkv(c.B, c.H, c.N, c.N, c.D, "bf16", Hkv=c.H // c.G)
    do = torch.randn_like(q)
    o, lse = kern(q, k, v, return_lse=True)
    main = kern.backward_plan.main.spec.name
    for _ in range(3):
        kern.backward(q, k, v, o, lse, do)
    torch.cuda.synchronize()
    dev = kernel_global(main, "fagen_blocks", (MAX_BLOCKS, SLOTS), "int64")
    dev.fill(0)
    torch.cuda.synchronize()
    kern.backward(q, k, v, o, lse, do)
    torch.cuda.synchronize()
    t = dev.get()
    t = t[t[:, G] > 0]
    t = t[(t[:, 1] > 0) & (t[:, 3] > 0)]  # blocks with steps (the rest leave at once)
    end_g = t[:, [G + 3, G + 4]].max(axis=1)
    end_c = t[:, [3, 4]].max(axis=1)
    ghz = statistics.median((end_c - t[:, 0]) / (end_g - t[:, G]))
    t0, t1 = t[:, G].min(), end_g.max()
    sms = sorted(set(t[:, SM].tolist()))
    span = (t1 - t0) * len(sms)  # SM-ns
    loop = int((t[:, G + 2] - t[:, G + 1]).sum())
    around = int((end_g - t[:, G]).sum()) - loop
    print(
        f"## {case}: {main}, {len(t)} blocks on {len(sms)} SMs, kernel span {(t1 - t0) / 1e3:.1f} us, "
        f"{ghz:.2f} cycles a ns"
    )
    print("| per block (median) | cycles |")
    print("|---|---|")
    for label, a, z in (
        ("start to the work tile named", 0, 8),
        ("to the mbarriers set up (thread 0)", 8, 10),
        ("to past the block's barrier", 10, 9),
        ("to the producer past setmaxnreg", 9, 7),
        ("start to the producer past setmaxnreg", 0, 7),
        ("start to the consumers past setmaxnreg", 0, 6),
        ("start to K/V issued", 0, 5),
        ("K/V issued to landed", 5, 1),
        ("step loop", 1, 2),
        ("epilogue (dK, dV)", 2, 3),
        ("epilogue: to both warpgroups done", 2, 11),
        ("epilogue: to its tiles staged", 11, 12),
        ("epilogue: to the copy out done", 12, 3),
        ("loop end to producer's last dQ landed", 2, 4),
    ):
        print(f"| {label} | {statistics.median((t[:, z] - t[:, a]).tolist()):.0f} |")
    print(f"| steps | {statistics.median(t[:, STEPS_AT].tolist()):.0f} |")
    print(f"| cycles a step in the loop | {statistics.median(((t[:, 2] - t[:, 1]) / t[:, STEPS_AT]).tolist()):.0f} |")
    gaps = 0
    for sm in sms:
        rows = t[t[:, SM] == sm]
        order = rows[:, G].argsort()
        starts, ends = rows[order, G], rows[order][:, [G + 3, G + 4]].max(axis=1)
        gaps += int((starts[1:] - ends[:-1]).clip(min=0).sum()) + int(starts[0] - t0) + int(t1 - ends[-1])
    print(
        f"| SM time: step loops / around them / between blocks and at the ends | "
        f"{loop / span:.1%} / {around / span:.1%} / {gaps / span:.1%} |"
    )
    print()


def main(argv: list[str]) -> int:
    from ab_tools import set_wgmma

    set_wgmma("BWD_PERSISTENT=False")  # the kernel of a block per key tile: the stamps are a block's (its one tile's)
    cases, args = [], iter(argv)
    for a in args:
        if a == "--set":  # a wgmma tier setting first, as trace_bwd.py's
            set_wgmma(next(args))
        else:
            cases.append(a)
    edit_backward_main(instrument)
    for case in cases or ["d128-window256-16384"]:
        run(case)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
