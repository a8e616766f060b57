"""fagen bench's compile probes (fresh processes, CUDA_CACHE_DISABLE=1) for the tree argv[1]."""
import sys, os
sys.path.insert(0, os.path.abspath(sys.argv[1]))
from fagen.tools import bench
import fagen
assert os.path.realpath(fagen.__file__).startswith(os.path.realpath(sys.argv[1])), fagen.__file__
for c in bench.compile_times():
    print(f"{sys.argv[1]:6s} {c['kernel']:58s} cold {c['cold_s']:.3f} (nvrtc {c['nvrtc_s']:.3f})  new {c['new_s']:.3f} (nvrtc {c['new_nvrtc_s']:.3f})  cached {c['cached_s']*1000:.1f} ms", flush=True)
