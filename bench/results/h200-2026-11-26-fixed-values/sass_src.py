"""Forward and backward sources of d64/d128 causal ALiBi from a tree, to /tmp/<tag>/."""
import sys, os, tempfile
sys.path.insert(0, sys.argv[1])
import fagen
tag = sys.argv[2]
os.makedirs(f"/tmp/{tag}", exist_ok=True)
for d in (64, 128):
    k = fagen.compile(dim=d, causal=True, alibi=True, arch="sm_90a", cache_dir=tempfile.mkdtemp())
    open(f"/tmp/{tag}/fwd{d}.cu", "w").write(k.source)
    print(tag, d, k.spec.name, k.resources)
    bp = k.backward_plan
    print(tag, d, bp.main.spec.name, bp.main.binary.resources)
    open(f"/tmp/{tag}/bwd{d}.cu", "w").write(bp.main.source)
