"""Causal ALiBi forward (and the plain causal default beside it): tiles against the table's, ms, same process."""
import sys, json
sys.path.insert(0, ".")
import torch
from fagen import pipeline
from fagen.tools import testing, bench

timer = bench._timer(torch)
arch = pipeline.detect_arch()
CFGS = {
    64: [None, dict(block_m=192, block_n=96, num_warps=16, stages=2),
         dict(block_m=128, block_n=128, num_warps=12, stages=2, persistent=True),
         dict(block_m=128, block_n=128, num_warps=12, stages=3),
         dict(block_m=128, block_n=176, num_warps=12, stages=2, persistent=True),
         dict(block_m=128, block_n=96, num_warps=12, stages=2, persistent=True)],
    128: [None, dict(block_m=128, block_n=160, num_warps=12, stages=2, persistent=True),
          dict(block_m=128, block_n=96, num_warps=12, stages=2, persistent=True),
          dict(block_m=128, block_n=112, num_warps=12, stages=2, persistent=True)],
}
for D in (64, 128):
    for alibi in (True, False):
        program = pipeline.load_program(causal=True, alibi=alibi)
        steps = pipeline.lower(program, "bf16")
        kerns = []
        for cfg in (CFGS[D] if alibi else [None]):
            try:
                k = pipeline.build_kernel(steps[-1].program, program.name, D, "bf16", arch, "wgmma", config=cfg,
                                          key_range=steps[-1].facts.get("key_range"))
            except Exception as e:
                print("skip", cfg, str(e)[:200], flush=True); continue
            chk = [testing.check_kernel(k, B=2, H=3, M=m, N=n) for m, n in ((333, 517), (1000, 1000))]
            ok = all(c.ok for c in chk)
            print(k.name, k.resources, "ok" if ok else "FAIL", flush=True)
            if ok:
                kerns.append(k)
        for N in (2048, 8192):
            B, H = max(1, 16384 // N), 2048 // D
            q, kk, v = testing.random_qkv(B, H, N, N, D, "bf16")
            t = dict(slopes=torch.rand(H, device="cuda") * 0.1) if alibi else {}
            for k in kerns:
                ms = timer(lambda: k(q, kk, v, **t))
                print(json.dumps(dict(D=D, N=N, alibi=alibi, kernel=k.name.split("_bf16_")[1], ms=round(ms, 4))), flush=True)
