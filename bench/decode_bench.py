"""Decode bandwidth: TB/s of K + V read, fagen's split-KV decode against PyTorch SDPA (flash, cuDNN).
q_len 1, batch 8, GQA 32/8, d128, bf16. Run on a GPU: PYTHONPATH=. python bench/decode_bench.py"""

import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import fagen


def timed(fn, iters=50):
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters / 1e3


def main(lengths=(8192, 32768), B=8, H=32, Hkv=8, D=128, M=1):
    k_ = fagen.compile(D, causal=True, decode=True, dtype="bf16")
    dev = torch.cuda.get_device_name()
    print(f"# {dev}, torch {torch.__version__}, {k_.plan.launches[0].spec.name}")
    print(f"# {k_.plan.launches[0].binary.resources}")
    rows = []
    for L in lengths:
        q = torch.randn(B, M, H, D, device="cuda", dtype=torch.bfloat16)
        kc = torch.randn(B, L, Hkv, D, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
        nbytes = 2 * kc.numel() * kc.element_size()
        qs, ks, vs = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)  # [B, H, S, D] views
        ref = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True).transpose(1, 2)
        for splits in (None, "flex", 1, 8, 12, 16, 24, 32, 64):
            o = k_.decode(q, kc, vc, lens, num_splits=splits)
            err = float((o.float() - ref.float()).abs().max())
            t = timed(lambda: k_.decode(q, kc, vc, lens, num_splits=splits))
            entry = [e for key, e in k_._calls.items() if key[1] == splits][-1]
            rows.append((L, f"fagen splits={splits} ({entry.num_splits})", t, nbytes / t / 1e12, err))
        for name, backend in (("sdpa flash", SDPBackend.FLASH_ATTENTION), ("sdpa cudnn", SDPBackend.CUDNN_ATTENTION)):
            for gqa in (True, False):
                try:
                    kk, vv = (ks, vs) if gqa else (ks.repeat_interleave(H // Hkv, 1), vs.repeat_interleave(H // Hkv, 1))
                    with sdpa_kernel(backend):
                        f = lambda: torch.nn.functional.scaled_dot_product_attention(qs, kk, vv, enable_gqa=gqa)  # noqa: E731
                        t = timed(f)
                    label = name + (" (enable_gqa)" if gqa else " (K/V expanded to 32 heads)")
                    rows.append((L, label, t, nbytes / t / 1e12, float("nan")))
                    break
                except Exception as e:  # noqa: BLE001
                    print(f"# {name} gqa={gqa}: {type(e).__name__}: {str(e).splitlines()[0][:100]}", file=sys.stderr)
    print("| kv len | op | time (us) | K+V TB/s | max abs diff vs SDPA |")
    print("|---|---|---|---|---|")
    for L, name, t, tbs, err in rows:
        print(f"| {L} | {name} | {t * 1e6:.1f} | {tbs:.2f} | {err:.2e} |")


def tiles(lengths=(8192, 32768), B=8, H=32, Hkv=8, D=128):
    """The split kernel's other tiles (keys per step = key groups x unroll, warps), at its default split count
    and at 8 and 16."""
    from fagen import pipeline

    program = pipeline.lower(pipeline.load_program(causal="bottom_right"), "bf16")[-1].program
    print("| kv len | split tiles | registers | splits | time (us) | K+V TB/s |")
    print("|---|---|---|---|---|---|")
    for cfg in (dict(block_n=16), dict(block_n=32), dict(num_warps=8, block_n=32), dict(num_warps=8, block_n=64)):
        k_ = pipeline.build_decode_kernel(program, "causal_br", D, "bf16", "sm_90a", config=cfg)
        spec = k_.plan.launches[0].spec
        r = k_.plan.launches[0].binary.resources
        for L in lengths:
            q = torch.randn(B, 1, H, D, device="cuda", dtype=torch.bfloat16)
            kc = torch.randn(B, L, Hkv, D, device="cuda", dtype=torch.bfloat16)
            vc = torch.randn_like(kc)
            lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
            nbytes = 2 * kc.numel() * kc.element_size()
            for splits in (None, 8, 16):
                t = timed(lambda: k_.decode(q, kc, vc, lens, num_splits=splits))
                n = [e for key, e in k_._calls.items() if key[1] == splits][-1].num_splits
                tile = f"n{spec.block_n}w{spec.num_warps}"
                print(f"| {L} | {tile} | {r.registers} | {n} | {t * 1e6:.1f} | {nbytes / t / 1e12:.2f} |")


if __name__ == "__main__":
    main()
    if "--tiles" in sys.argv:
        tiles()
