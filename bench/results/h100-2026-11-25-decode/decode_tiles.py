"""Decode B 8, GQA 32/8, d128, bf16, q_len 1: the split kernel's tiles (block_n, warps, stages) and splits, ÷ copy
(flushed, as the bench), contiguous and paged 16 / 256. argv[1]: the fagen tree."""
import sys
sys.path.insert(0, sys.argv[1])
import torch
from fagen import pipeline
from fagen.tools import bench

timer = bench._timer(torch)
print(torch.cuda.get_device_name())
program = pipeline.lower(pipeline.load_program(causal="bottom_right"), "bf16")[-1].program
CFGS = [dict(block_n=128, num_warps=8, stages=2), dict(block_n=128, num_warps=8, stages=3),
        dict(block_n=64, num_warps=4, stages=4), dict(block_n=64, num_warps=4, stages=3),
        dict(block_n=64, num_warps=4, stages=2)]
kernels = []
for cfg in CFGS:
    k = pipeline.build_decode_kernel(program, "causal_br", 128, "bf16", "sm_90a", config=cfg)
    r = k.plan.launches[0].binary.resources
    print(k.plan.launches[0].spec.name, "regs", r.registers, "stack", r.stack_frame, "per_sm", k.plan.blocks_per_sm, flush=True)
    kernels.append(k)
B, Hkv, H, D = 8, 8, 32, 128
for L in (8192, 32768):
    kc = torch.randn(B, L, Hkv, D, device="cuda", dtype=torch.bfloat16); vc = torch.randn_like(kc)
    lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
    nbytes = 2 * kc.numel() * 2
    src = torch.empty(nbytes // 2, device="cuda", dtype=torch.bfloat16); dst = torch.empty_like(src)
    cf = timer(lambda: dst.copy_(src))
    del src, dst
    caches = {"contig": (kc, vc, None)}
    for page in (16, 256):
        per = -(-L // page)
        g = torch.Generator(device="cuda"); g.manual_seed(0)
        order = torch.randperm(B * per, device="cuda", generator=g)
        table = order.view(B, per).to(torch.int32)
        pk = torch.empty(B * per, page, Hkv, D, device="cuda", dtype=torch.bfloat16); pv = torch.empty_like(pk)
        pk[order] = kc.view(B * per, page, Hkv, D); pv[order] = vc.view(B * per, page, Hkv, D)
        caches[f"page{page}"] = (pk, pv, table)
    q = torch.randn(B, 1, H, D, device="cuda", dtype=torch.bfloat16)
    ref = kernels[0].decode(q, kc, vc, lens).float()
    for name, (k_, v_, t) in caches.items():
        row = []
        for cfg, kern in zip(CFGS, kernels):
            for S in (None, 4):
                out = kern.decode(q, k_, v_, lens, block_table=t, num_splits=S)
                err = (out.float() - ref).abs().max().item()
                assert err < 2e-2, (cfg, err)
                ms = timer(lambda: kern.decode(q, k_, v_, lens, block_table=t, num_splits=S))
                row.append(f"{cfg['block_n']}/{cfg['num_warps']}/{cfg['stages']}:{S or 'h'}={cf / (2 * ms):.3f}")
        print(f"L={L} {name:7s} " + " ".join(row), flush=True)
    del caches, kc, vc
