"""Harness for the Hopper FlashAttention-3 style forward prototype (fa3_fwd.cu).

  python run.py build            # here (no GPU): nvcc -> build/<variant>.cubin + ptxas report + SASS check
  python run.py check [names]    # on the H100: correctness of each variant on odd shapes, causal and not
  python run.py bench [names]    # on the H100: TFLOP/s vs SDPA flash and cuDNN (BENCH.md convention)
  python run.py all [names]      # check, then bench the variants that passed
"""
import ctypes
import json
import math
import os
import pathlib
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
BUILD = HERE / "build"

# name: (head_dim, block_n, stages, overlap, pingpong, extra defines). A name ending in "_p" launches the same
# cubin as a persistent grid (one CTA per SM looping over tiles) instead of one CTA per tile.
VARIANTS = {
    "d128_simple": (128, 128, 2, 0, 0, {}),
    "d128_simple_swap": (128, 128, 2, 0, 0, {"VDESC_SWAP": 1}),
    "d128_n128": (128, 128, 2, 1, 1, {}),
    "d128_n128_nopp": (128, 128, 2, 1, 0, {}),
    "d128_n128_s3": (128, 128, 3, 1, 1, {}),
    "d128_n176": (128, 176, 2, 1, 1, {}),
    "d128_n160": (128, 160, 2, 1, 1, {}),
    "d64_n128": (64, 128, 2, 1, 1, {}),
    "d64_n128_s3": (64, 128, 3, 1, 1, {}),
    "d64_n176_s3": (64, 176, 3, 1, 1, {}),
    "d64_n192_s3": (64, 192, 3, 1, 1, {}),
    "d256_n80": (256, 80, 2, 1, 1, {}),
    "d256_n64": (256, 64, 2, 1, 1, {}),
    "d128_n128_st": (128, 128, 2, 1, 1, {"STORE_TMA": 1}),
    "d128_n176_st": (128, 176, 2, 1, 1, {"STORE_TMA": 1}),
    "d128_n176_poly4": (128, 176, 2, 1, 1, {"POLY_EXP_EVERY": 4}),
    "d64_n176_s3_poly4": (64, 176, 3, 1, 1, {"POLY_EXP_EVERY": 4}),
    "d64_n176_s3_poly3": (64, 176, 3, 1, 1, {"POLY_EXP_EVERY": 3}),
    "d64_n176_s3_poly4_st": (64, 176, 3, 1, 1, {"POLY_EXP_EVERY": 4, "STORE_TMA": 1}),
    "d256_n80_st": (256, 80, 2, 1, 1, {"STORE_TMA": 1}),
    "d128_n128_st_lazy": (128, 128, 2, 1, 1, {"STORE_TMA": 1, "LAZY_RESCALE": 1}),
    "d128_n176_st_lazy": (128, 176, 2, 1, 1, {"STORE_TMA": 1, "LAZY_RESCALE": 1}),
    "d64_n176_s3_lazy": (64, 176, 3, 1, 1, {"LAZY_RESCALE": 1}),
    "d64_n128_s3_st_lazy": (64, 128, 3, 1, 1, {"STORE_TMA": 1, "LAZY_RESCALE": 1}),
    "d256_n80_st_lazy": (256, 80, 2, 1, 1, {"STORE_TMA": 1, "LAZY_RESCALE": 1}),
}
for _n in list(VARIANTS):
    if "simple" not in _n:
        VARIANTS[_n + "_p"] = VARIANTS[_n]


def cubin_name(name):
    return name[:-2] if name.endswith("_p") else name


def smem_bytes(d, bn, stages):
    return 128 * d * 2 + 2 * stages * bn * d * 2 + 256 + 1024 + 1024   # Q, K/V ring, mbarriers, scratch, align slack


# ----------------------------------------------------------------------------------------------- build
def build(names):
    BUILD.mkdir(exist_ok=True)
    report = {}
    for name in dict.fromkeys(cubin_name(n) for n in names):
        d, bn, st, ov, pp, extra = VARIANTS[name]
        defs = dict(HEAD_DIM=d, BLOCK_N=bn, STAGES=st, OVERLAP=ov, PINGPONG=pp, **extra)
        cmd = ["nvcc", "-gencode=arch=compute_90a,code=sm_90a", "-cubin", "-O3", "-Xptxas", "-v", "-o", str(BUILD / f"{name}.cubin")]
        cmd += [f"-D{k}={v}" for k, v in defs.items()] + [str(HERE / "fa3_fwd.cu")]
        r = subprocess.run(cmd, capture_output=True, text=True)
        log = r.stdout + r.stderr
        regs = [l for l in log.splitlines() if "registers" in l or "spill" in l or "C75" in l]
        sass = subprocess.run([str(HERE / "sass_check.sh"), str(BUILD / f"{name}.cubin")], capture_output=True, text=True).stdout.strip() if r.returncode == 0 else ""
        report[name] = {"rc": r.returncode, "ptxas": regs, "sass": sass}
        print(f"{name:18s} rc={r.returncode} {sass}")
        for l in regs:
            print("    ", l.strip())
        if r.returncode:
            print(log[-3000:])
    (BUILD / "build_report.json").write_text(json.dumps(report, indent=1))


# ----------------------------------------------------------------------------------------------- device
_libcuda = None


def tensor_map(t, rows_box, rows, bh, d):
    """3-D TMA map over a [B*H, rows, d] bf16 tensor: dims (d, rows, B*H), box (64, rows_box, 1), 128B swizzle."""
    global _libcuda
    import numpy as np
    if _libcuda is None:
        _libcuda = ctypes.CDLL("libcuda.so.1")
        _libcuda.cuTensorMapEncodeTiled.restype = ctypes.c_int
    buf = (ctypes.c_uint8 * 128)()
    dims = (ctypes.c_uint64 * 3)(d, rows, bh)
    strides = (ctypes.c_uint64 * 2)(d * 2, rows * d * 2)          # bytes, dims 1 and 2
    box = (ctypes.c_uint32 * 3)(64, rows_box, 1)
    estr = (ctypes.c_uint32 * 3)(1, 1, 1)
    BF16, INTERLEAVE_NONE, SWIZZLE_128B, L2_256B, OOB_ZERO = 9, 0, 3, 3, 0
    rc = _libcuda.cuTensorMapEncodeTiled(ctypes.byref(buf), BF16, 3, ctypes.c_void_p(t.data_ptr()), dims, strides, box, estr,
                                         INTERLEAVE_NONE, SWIZZLE_128B, L2_256B, OOB_ZERO)
    assert rc == 0, f"cuTensorMapEncodeTiled failed: {rc}"
    return np.frombuffer(bytes(buf), dtype="V128")[0]


class Kernel:
    def __init__(self, name):
        import cupy as cp
        self.name = name
        self.d, self.bn, self.stages = VARIANTS[name][:3]
        self.mod = cp.cuda.function.Module()
        self.mod.load((BUILD / f"{cubin_name(name)}.cubin").read_bytes())
        self.persistent = name.endswith("_p")
        self.fn = self.mod.get_function("fa3_fwd")
        self.smem = smem_bytes(self.d, self.bn, self.stages)
        from cupy_backends.cuda.api import driver
        driver.funcSetAttribute(self.fn.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, self.smem)

    def prepare(self, q, k, v, o, lse, causal):
        """Returns a zero-argument launcher (tensor maps built once)."""
        import numpy as np
        B, H, M, D = q.shape
        N = k.shape[2]
        assert D == self.d
        qm = tensor_map(q, 128, M, B * H, D)
        km = tensor_map(k, self.bn, N, B * H, D)
        vm = tensor_map(v, self.bn, N, B * H, D)
        om = tensor_map(o, 64, M, B * H, D)                           # TMA-store epilogue: 64 rows per warpgroup
        scale_log2 = np.float32(1.0 / math.sqrt(D) * 1.4426950408889634)
        args = (qm, km, vm, om, np.uint64(o.data_ptr()), np.uint64(lse.data_ptr()), np.int32(M), np.int32(N), np.int32(B * H),
                scale_log2, np.int32(causal))
        tiles = (M + 127) // 128 * B * H
        if self.persistent:
            import torch
            tiles = min(tiles, torch.cuda.get_device_properties(0).multi_processor_count)
        grid = (tiles, 1, 1)

        def launch():
            self.fn(grid, (384, 1, 1), args, shared_mem=self.smem)
        return launch


def reference(q, k, v, causal):
    import torch
    B, H, M, D = q.shape
    N = k.shape[2]
    scale = 1.0 / math.sqrt(D)
    qd, kd, vd = q.double(), k.double(), v.double()
    s = (qd @ kd.transpose(-1, -2)) * scale
    mask = None
    if causal:
        qi = torch.arange(M, device=q.device)[:, None]
        ki = torch.arange(N, device=q.device)[None, :]
        mask = ki <= qi + (N - M)                                   # bottom-right aligned
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    o = p @ vd
    # naive bf16 implementation (FlashAttention's yardstick)
    sb = (q @ k.transpose(-1, -2)).float() * scale
    if causal:
        sb = sb.masked_fill(~mask, float("-inf"))
    pb = torch.softmax(sb, dim=-1).nan_to_num(0.0).to(torch.bfloat16)
    ob = (pb @ v).double()
    return o, lse, ob


def check(names):
    import torch
    torch.manual_seed(0)
    shapes = [  # B, H, M, N, causal
        (2, 3, 1000, 1000, False), (2, 3, 1000, 1000, True),
        (1, 2, 4097, 4097, False), (1, 2, 4097, 4097, True),
        (2, 2, 300, 1000, False), (2, 2, 300, 1000, True),
        (1, 2, 1000, 300, True), (1, 2, 1000, 300, False),
        (1, 1, 128, 128, True), (1, 2, 64, 1, False), (1, 2, 777, 5, True),
        (4, 8, 2000, 2000, False), (4, 8, 2000, 2000, True),            # > 132 tiles: several per persistent CTA
        (2, 16, 1000, 1500, True), (2, 16, 1500, 1000, True),
        (1, 2, 1000, 1000, False, 8.0), (1, 2, 1000, 1000, True, 8.0),   # q x8: spiky scores, the max moves often
    ]
    results = {}
    for name in names:
        kern = Kernel(name)
        ok_all = True
        rows = []
        for (B, H, M, N, causal, *qs) in shapes:
            D = kern.d
            q = torch.randn(B, H, M, D, device="cuda", dtype=torch.bfloat16) * (qs[0] if qs else 1.0)
            k = torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16)
            v = torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16)
            o = torch.full((B, H, M, D), float("nan"), device="cuda", dtype=torch.bfloat16)
            lse = torch.full((B, H, M), float("nan"), device="cuda", dtype=torch.float32)
            try:
                kern.prepare(q, k, v, o, lse, causal)()
                torch.cuda.synchronize()
            except AssertionError as e:   # tensor-map refusal: report, go on
                print(f"  {name:18s} B{B} H{H} M{M:5d} N{N:5d} causal={int(causal)} FAIL {e}", flush=True)
                ok_all = False
                continue
            ro, rlse, ob = reference(q, k, v, causal)
            err = (o.double() - ro).abs().max().item()
            nerr = (ob - ro).abs().max().item()
            fin = torch.isfinite(rlse)
            lerr = (lse.double()[fin] - rlse[fin]).abs().max().item() if fin.any() else 0.0
            lse_inf_ok = bool((lse[~fin] == float("-inf")).all().item()) if (~fin).any() else True
            o_masked_ok = bool((o[~fin] == 0).all().item()) if (~fin).any() else True
            nan = bool(torch.isnan(o).any().item() or torch.isnan(lse).any().item())
            ok = (not nan) and err <= 2 * nerr + 1e-3 and lerr <= 1e-3 and lse_inf_ok and o_masked_ok
            ok_all &= ok
            rows.append(f"  {name:18s} B{B} H{H} M{M:5d} N{N:5d} causal={int(causal)} err={err:.2e} naive={nerr:.2e} lse_err={lerr:.1e} masked_rows={int((~fin).sum())} {'PASS' if ok else 'FAIL'}{' NaN' if nan else ''}")
            print(rows[-1], flush=True)
        # determinism: same inputs twice, bitwise equal
        B, H, M, N = 2, 4, 2048, 2048
        q, k, v = (torch.randn(B, H, M, kern.d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        outs = []
        for _ in range(2):
            o = torch.full((B, H, M, kern.d), float("nan"), device="cuda", dtype=torch.bfloat16)
            lse = torch.empty((B, H, M), device="cuda", dtype=torch.float32)
            kern.prepare(q, k, v, o, lse, True)()
            outs.append(o)
        torch.cuda.synchronize()
        det = bool(torch.equal(outs[0], outs[1]))
        print(f"  {name:18s} repeat-bitwise-equal={det}", flush=True)
        results[name] = ok_all and det
    return results


def bench(names):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel, SDPBackend
    from triton.testing import do_bench
    torch.manual_seed(0)
    kerns = {n: Kernel(n) for n in names}
    table = []
    for D in (64, 128, 256):
        ks = [n for n in names if kerns[n].d == D]
        if not ks:
            continue
        H = 2048 // D
        for causal in (False, True):
            for N in (2048, 4096, 8192, 16384):
                B = 16384 // N
                q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                flops = 4 * B * H * N * N * D / (2 if causal else 1)
                row = {"D": D, "causal": causal, "N": N}
                for be, tag in ((SDPBackend.FLASH_ATTENTION, "flash"), (SDPBackend.CUDNN_ATTENTION, "cudnn")):
                    try:
                        with sdpa_kernel([be]):
                            ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                            ms = do_bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), warmup=25, rep=100, return_mode="median")
                        row[tag] = flops / ms / 1e9
                    except Exception as e:  # noqa: BLE001
                        row[tag] = float("nan")
                        print("  ", tag, "failed:", str(e)[:200])
                for n in ks:
                    o = torch.full_like(q, float("nan"))
                    lse = torch.empty((B, H, N), device="cuda", dtype=torch.float32)
                    launch = kerns[n].prepare(q, k, v, o, lse, causal)
                    launch()
                    torch.cuda.synchronize()
                    # sanity against SDPA (same N, square, causal top-left == bottom-right)
                    diff = (o.float() - ref.float()).abs().max().item()
                    ms = do_bench(launch, warmup=25, rep=100, return_mode="median")
                    row[n] = flops / ms / 1e9
                    row[n + "_diff"] = diff
                table.append(row)
                best = max(ks, key=lambda n: row[n])
                print(f"  d{D} causal={int(causal)} N={N:5d} flash={row['flash']:6.1f} cudnn={row['cudnn']:6.1f} " +
                      " ".join(f"{n}={row[n]:6.1f}(d{row[n + '_diff']:.0e})" for n in ks) +
                      f"  best/cudnn={row[best] / row['cudnn']:.2f} best/flash={row[best] / row['flash']:.2f}", flush=True)
                del q, k, v
    return table


def main():
    mode = sys.argv[1] if len(sys.argv) > 1 else "all"
    names = sys.argv[2:] or list(VARIANTS)
    if mode in ("prof", "san"):
        names = sys.argv[2:3]
    if mode == "build":
        build(names)
        return
    out = pathlib.Path(os.environ.get("OUT", "/tmp"))
    if mode == "all":   # each variant checked in its own process (a crash or hang poisons only that one)
        passed, t0, hangs = [], time.time(), 0
        if len(sys.argv) <= 2:
            names = ["d128_n128_st_lazy", "d128_n176_st_lazy", "d64_n176_s3_lazy", "d64_n128_s3_st_lazy", "d256_n80_st_lazy",
                     "d128_n128_st", "d128_n176_st", "d64_n176_s3", "d256_n80_st", "d256_n80"]
        for n in names:
            if time.time() - t0 > 130 or hangs >= 2:
                print(f"CHECK {n:18s} SKIPPED (time or hangs)")
                continue
            try:
                r = subprocess.run([sys.executable, __file__, "check", n], capture_output=True, text=True, timeout=60)
                txt = r.stdout + r.stderr
            except subprocess.TimeoutExpired as e:
                txt = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
                txt += "\nTIMEOUT (hang?)"
                hangs += 1
            with open(out / "check_all.log", "a") as f:
                f.write(txt)
            ok = f'"{n}": true' in txt
            print(f"CHECK {n:18s} {'PASS' if ok else 'FAIL'}  ({time.time() - t0:.0f}s)")
            if not ok:
                print("\n".join(l for l in txt.splitlines() if "FAIL" in l or "Error" in l or "error" in l or "TIMEOUT" in l)[-1500:])
            if ok:
                passed.append(n)
            elif n == "d128_simple":
                names.insert(names.index(n) + 1, "d128_simple_swap")   # try the other V-descriptor reading
        bn = [n for n in passed if "simple" not in n]
        if bn:
            left = max(30, 215 - (time.time() - t0))
            with open(out / "bench.log", "w") as f:
                try:
                    subprocess.run([sys.executable, __file__, "bench"] + bn, stdout=f, stderr=subprocess.STDOUT, timeout=left)
                except subprocess.TimeoutExpired:
                    print("BENCH TIMEOUT")
            print((out / "bench.log").read_text()[-7000:])
        return
    import torch
    print(torch.cuda.get_device_name(), torch.__version__, "cudnn", torch.backends.cudnn.version(), time.strftime("%Y-%m-%d %H:%M"), flush=True)
    res = {}
    if mode == "prof":   # one launch for ncu: run.py prof VARIANT N CAUSAL
        kern = Kernel(names[0])
        N, causal = int(sys.argv[3]), bool(int(sys.argv[4]))
        D = kern.d
        B, H = 16384 // N, 2048 // D
        q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        o = torch.empty_like(q)
        lse = torch.empty((B, H, N), device="cuda", dtype=torch.float32)
        kern.prepare(q, k, v, o, lse, causal)()
        torch.cuda.synchronize()
        return
    if mode == "san":   # compute-sanitizer target: a few small launches of one variant
        kern = Kernel(names[0])
        for (B, H, M, N, causal) in ((1, 2, 1000, 300, True), (1, 2, 300, 1000, False), (2, 2, 777, 777, True)):
            q = torch.randn(B, H, M, kern.d, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(B, H, N, kern.d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            o = torch.empty_like(q)
            lse = torch.empty((B, H, M), device="cuda", dtype=torch.float32)
            kern.prepare(q, k, v, o, lse, causal)()
        torch.cuda.synchronize()
        print("san done")
        return
    if mode == "check":
        res["check"] = check(names)
        print("CHECK:", json.dumps(res["check"]), flush=True)
    if mode == "bench":
        res["bench"] = bench(names)
        print("\nSUMMARY (TFLOP/s; ratio of the best prototype variant to SDPA flash / cuDNN)")
        for row in res["bench"]:
            ks = [n for n in names if n in row]
            best = max(ks, key=lambda n: row[n])
            print(f"d{row['D']:3d} {'causal' if row['causal'] else 'full  '} N={row['N']:5d}  flash {row['flash']:5.0f}  cudnn {row['cudnn']:5.0f}  "
                  f"{best} {row[best]:5.0f}  x{row[best] / row['flash']:.2f} flash  x{row[best] / row['cudnn']:.2f} cudnn")
        (out / "bench.json").write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
