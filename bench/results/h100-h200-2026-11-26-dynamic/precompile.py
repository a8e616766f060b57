"""Compile the forward kernels of the tree argv[1] for sm_90a into FAGEN_CACHE_DIR (NVRTC 13.0 here = the device's)."""
import sys, os
sys.path.insert(0, sys.argv[1])
import fagen
assert os.path.realpath(fagen.__file__).startswith(os.path.realpath(sys.argv[1]))
for D in (64, 128, 256):
    for c in (True, False):
        k = fagen.compile(dim=D, dtype="bf16", causal=c, arch="sm_90a")
        print(k.name, k.resources.registers, k.resources.stack_frame)
