"""Which Hopper kernels a change touched, on the CPU: each tree's wgmma forward and backward main kernels for a fixed
set of programs, compiled by NVRTC (sm_90a, bf16) and disassembled by nvdisasm, one hash of each kernel's SASS; the
cases whose SASS differs between the trees are the ones a GPU A/B must time (a change aimed at masked steps that
also moves a kernel without a mask shows here: 38faa7d slowed d128 without a mask 1.2x, seen a stop later).

    python3 bench/sass_diff.py OLD_TREE NEW_TREE            # e.g. a `git archive` of the commit before, and .
    python3 bench/sass_diff.py --nvdisasm PATH OLD NEW      # nvdisasm not on PATH (the nvidia-cuda-nvdisasm wheel's)

Each tree runs in its own process (its fagen first on the path). Prints one line a kernel, `same` or `differs` (a
kernel named differently in the old tree differs), and exits 0 either way."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

from ab_tools import disassemble, nvdisasm_from

# (head dim, fagen.compile options): without a mask at every wgmma head dim, then the masks and score functions
CASES = [(d, {}) for d in (64, 96, 128, 192, 256)] + [
    (64, {"causal": True}),
    (128, {"causal": True}),
    (64, {"causal": True, "window": (256, 0)}),
    (128, {"causal": True, "window": (256, 0)}),
    (128, {"softcap": 30.0}),
    (128, {"causal": True, "alibi": True}),
]


def sass_hash(cubin: bytes, nvdisasm: str) -> str:
    """A hash of the instructions (addresses dropped) of `cubin`."""
    sass = disassemble(cubin, nvdisasm)
    address = r"/\*[0-9a-f]+\*/"
    body = "\n".join(re.sub(address, "", line) for line in sass.splitlines() if re.match(r"\s+" + address, line))
    return hashlib.sha256(body.encode()).hexdigest()[:16]


def hashes(nvdisasm: str, cases=CASES) -> dict:
    """{case: {kernel name: SASS hash}} of the fagen on the path (this process's)."""
    import fagen

    out = {}
    for dim, options in cases:
        kernel = fagen.compile(dim, dtype="bf16", arch="sm_90a", use_cache=False, **options)
        main = kernel.backward_plan.main
        out[f"d{dim} {json.dumps(options)}"] = {
            kernel.spec.name: sass_hash(kernel.binary.cubin, nvdisasm),
            main.spec.name: sass_hash(main.binary.cubin, nvdisasm),
        }
    return out


def tree_hashes(root: Path, nvdisasm: str) -> dict:
    """hashes() of the tree at `root`, in a process of its own."""
    here = str(Path(__file__).resolve().parent)
    code = (
        f"import sys, json; sys.path.insert(0, {str(root.resolve())!r}); sys.path.insert(1, {here!r});"
        f" import sass_diff; print(json.dumps(sass_diff.hashes({nvdisasm!r})))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> int:
    trees = [a for i, a in enumerate(argv) if not a.startswith("--") and (i == 0 or argv[i - 1] != "--nvdisasm")]
    if len(trees) != 2:
        raise SystemExit(__doc__)
    nvdisasm = nvdisasm_from(argv)
    old, new = (tree_hashes(Path(t), nvdisasm) for t in trees)
    for case, kernels in new.items():
        for name, digest in kernels.items():
            same = old.get(case, {}).get(name) == digest
            print(f"{'same   ' if same else 'differs'}  {name}  ({case})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
