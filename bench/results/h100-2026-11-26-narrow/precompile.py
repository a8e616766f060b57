"""Compile the forward kernels of the tree argv[1] for sm_90a into FAGEN_CACHE_DIR (NVRTC 13.0 here = the device's).
argv[2]: dims (default 64,128,256); argv[3]: 'causal', 'full' or both (default)."""
import sys, os
sys.path.insert(0, sys.argv[1])
import fagen
assert os.path.realpath(fagen.__file__).startswith(os.path.realpath(sys.argv[1]))
dims = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "64,128,256").split(",")]
masks = {"causal": (True,), "full": (False,)}.get(sys.argv[3] if len(sys.argv) > 3 else "", (True, False))
for D in dims:
    for c in masks:
        k = fagen.compile(dim=D, dtype="bf16", causal=c, arch="sm_90a")
        print(k.name, k.resources.registers, k.resources.stack_frame)
