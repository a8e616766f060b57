"""The wgmma backward main kernel's SASS instructions in one interior step of a consumer warpgroup, by category: the
path through the step loop (the loop with the most HGMMA) that a step takes whose keys and queries all exist and
all see each other (the element pass without selects), with dq_accum set and step > 0 (the wait for dQ's buffer
runs); branches to code past the loop (the retry paths of spin waits) are not taken. Rendered and compiled on the
CPU (NVRTC, sm_90a), disassembled by nvdisasm (CUDA's, or the `nvidia-cuda-nvdisasm` wheel's: `--nvdisasm PATH`).

    python3 bench/sass_step.py                       # d128 and d64, full and causal, this tree
    python3 bench/sass_step.py --nvdisasm /path/to/nvdisasm full-128 causal-64

The walk knows the step loop's shape (three conditional branches inside it: interior or not, dq_accum null or
not, step > 0 or not) and says so where a kernel has another."""

from __future__ import annotations

import collections
import re
import sys
import tempfile
from pathlib import Path

from ab_tools import disassemble, nvdisasm_from

CATEGORIES = [
    ("HGMMA", r"^HGMMA"),
    ("WARPGROUP (arrive, depbar)", r"^WARPGROUP"),
    ("MUFU", r"^MUFU"),
    ("FFMA", r"^FFMA"),
    ("FMUL", r"^FMUL"),
    ("FADD", r"^FADD"),
    ("FSETP/FSEL/FMNMX", r"^(FSETP|FSEL|FMNMX)"),
    ("F2FP/F2F/I2F", r"^(F2FP|F2F|I2F|F2I|I2FP)"),
    ("LDS", r"^LDS\b"),
    ("STS", r"^STS\b"),
    ("STSM", r"^STSM"),
    ("LDL/STL (spills)", r"^(LDL|STL)"),
    ("SYNCS (mbarrier)", r"^SYNCS"),
    ("BAR", r"^BAR"),
    ("MEMBAR/FENCE", r"^(MEMBAR|FENCE)"),
    ("R2UR", r"^R2UR"),
    ("uniform ALU (U*, S2UR)", r"^(U[A-Z0-9]+|S2UR)"),
    ("IMAD/IADD/VIADD/LEA", r"^(IMAD|IADD|VIADD|LEA)"),
    ("LOP3/SHF/PRMT", r"^(LOP3|SHF|PRMT|BMSK|SGXT)"),
    ("MOV/CS2R/S2R", r"^(MOV|CS2R|S2R)"),
    ("ISETP/PLOP3/SEL", r"^(ISETP|PLOP3|SEL|P2R|R2P)"),
    ("BRA/BSSY/BSYNC/WARPSYNC", r"^(BRA|BSSY|BSYNC|WARPSYNC|NOP)"),
]


def category(op: str) -> str:
    return next((name for name, rx in CATEGORIES if re.match(rx, op)), f"other: {op}")


def parse(sass: str) -> list[dict]:
    """nvdisasm -c's instructions: address, the label before it, predicate, opcode, text."""
    out, label = [], None
    for line in sass.splitlines():
        if m := re.match(r"^\s*(\.L_x_\d+):", line):
            label = m.group(1)
        elif m := re.match(r"\s*/\*([0-9a-f]+)\*/\s+(.*?)\s*;", line):
            text, pred = m.group(2), ""
            if text.startswith("@"):
                pred, text = text.split(None, 1)
            out.append(dict(addr=int(m.group(1), 16), label=label, pred=pred, op=text.split()[0], text=text))
            label = None
    return out


def _target(i: dict) -> str:
    m = re.search(r"`\((\.L_x_\d+)\)", i["text"])
    if m is None:
        raise SystemExit(f"a branch without a label: {i['text']}")
    return m.group(1)


def step_path(ins: list[dict], interior_first: bool) -> list[dict]:
    """The step loop's path: at its first in-loop conditional branch taken or not as `interior_first` says, the next
    two not taken (dq_accum set; step > 0)."""
    labels = {i["label"]: k for k, i in enumerate(ins) if i["label"]}
    loops = [(labels[_target(i)], k) for k, i in enumerate(ins) if i["op"] == "BRA" and labels[_target(i)] < k]
    head, end = max(loops, key=lambda hk: sum(i["op"].startswith("HGMMA") for i in ins[hk[0] : hk[1]]))
    choices, path, k = [interior_first, False, False], [], head
    while True:
        i = ins[k]
        path.append(i)
        if k == end or len(path) > 20000:
            break
        if i["op"] == "BRA":
            t = labels[_target(i)]
            conditional = i["pred"] or re.match(r"BRA\s+!?U?P\d", i["text"])
            if not conditional:
                k = t
                continue
            if t > end or t < head:
                k += 1
                continue
            if not choices:
                raise SystemExit("the step loop has more conditional branches than this walk knows")
            k = t if choices.pop(0) else k + 1
            continue
        k += 1
    if choices:
        raise SystemExit("the step loop has fewer conditional branches than this walk knows")
    return path


def interior_step(sass: str) -> collections.Counter:
    ins = parse(sass)
    paths = [step_path(ins, first) for first in (True, False)]  # the interior one: fewer selects
    path = min(paths, key=lambda p: sum(i["op"] == "FSEL" for i in p))
    return collections.Counter(category(i["op"]) for i in path)


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from fagen import builders, pipeline

    nvdisasm = nvdisasm_from(argv)
    cases = [a for a in argv if re.fullmatch(r"(full|causal)-\d+", a)] or [
        f"{m}-{d}" for d in (128, 64) for m in ("full", "causal")
    ]
    counts = {}
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            mask, dim = case.split("-")
            program = pipeline.lower(pipeline.load_program(causal=mask == "causal"), "bf16")[-1].program
            main_kernel = builders.build_backward_kernels(
                program, program.name, int(dim), "bf16", "sm_90a", "wgmma", cache_dir=Path(tmp)
            ).main
            sass = disassemble(main_kernel.binary.cubin, nvdisasm)
            counts[case] = interior_step(sass)
            print(f"{case}: {main_kernel.spec.name}, {main_kernel.binary.resources}", file=sys.stderr)
    names = [n for n, _ in CATEGORIES] + sorted({k for c in counts.values() for k in c} - {n for n, _ in CATEGORIES})
    print("| category | " + " | ".join(cases) + " |")
    print("|---" * (len(cases) + 1) + "|")
    for name in names:
        if any(counts[c][name] for c in cases):
            print(f"| {name} | " + " | ".join(str(counts[c][name]) for c in cases) + " |")
    print("| total | " + " | ".join(str(sum(counts[c].values())) for c in cases) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
