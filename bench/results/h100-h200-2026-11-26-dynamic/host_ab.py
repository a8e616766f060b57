"""Host cost per call (fagen.tools.bench.host_overhead) for the tree argv[1], tag argv[2]."""
import sys, os, tempfile
sys.path.insert(0, sys.argv[1])
os.environ.setdefault("FAGEN_CACHE_DIR", tempfile.mkdtemp())
import fagen
from fagen.tools import bench
assert os.path.realpath(fagen.__file__).startswith(os.path.realpath(sys.argv[1]))
for D in (64, 128):
    r = bench.host_overhead(D=D, n=2000)
    print(sys.argv[2], r, flush=True)
