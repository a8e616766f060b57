"""NVRTC seconds, SASS size and resources of the Hopper forward kernels, for the tree on sys.path[0]."""
import sys, time, json, subprocess, tempfile, os
import fagen
from fagen.backend import build, nvrtc
cap = {}
orig = build._nvrtc
def w(src, name, opts, ptx=False):
    cap[name] = (src, opts); return orig(src, name, opts, ptx=ptx)
build._nvrtc = w
cases = [(64, False, {}), (64, True, {}), (128, False, {}), (128, True, {}), (256, False, {}), (256, True, {}),
         (128, True, {"softcap": 30.0}), (128, True, {"alibi": True}), (64, True, {"window": 256}), (128, False, {"softcap": 20.0})]
for D, c, v in cases:
    cap.clear()
    fagen.compile(D, causal=c, dtype="bf16", arch="sm_90a", use_cache=False, **v)
    for name, (src, opts) in cap.items():
        ts = []
        for i in range(2):
            t = time.perf_counter(); cub, log = nvrtc.compile_program(src, name + ".cu", opts); ts.append(time.perf_counter() - t)
        with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f: f.write(cub)
        sass = subprocess.run(["cuobjdump", "-sass", f.name], capture_output=True, text=True).stdout
        os.unlink(f.name)
        n = sum(1 for l in sass.splitlines() if l.strip().startswith("/*") and "*/" in l and len(l.split("*/")[1].strip()) > 2)
        r = build.parse_resources(log, cub, name)
        inj = sum("C7519" in l for l in log.splitlines())
        print(f"{name:70s} nvrtc {min(ts):.3f}  sass {n:5d}  regs {r.registers} stack {r.stack_frame} inj {inj}", flush=True)
