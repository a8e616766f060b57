"""A small case for compute-sanitizer (memcheck, racecheck, synccheck): odd sizes, both causal alignments,
GQA, variants with call-time tensors and index math.

compute-sanitizer --tool memcheck --error-exitcode 1 python tests/gpu/sanitize_case.py
compute-sanitizer --tool racecheck --error-exitcode 1 python tests/gpu/sanitize_case.py
"""

import sys

import fagen
from fagen.tools import testing

CASES = [  # (dim, causal, dtype, tier, B, H, Hkv, M, N)
    (64, "bottom_right", "f16", "simt", 1, 2, 2, 33, 17),
    (128, True, "bf16", "simt", 1, 2, 1, 17, 70),
    (256, False, "f32", "simt", 1, 1, 1, 5, 40),
    (64, "bottom_right", "f16", "mma", 1, 2, 2, 150, 17),
    (128, True, "bf16", "mma", 1, 2, 1, 17, 200),
    (96, False, "bf16", "mma", 1, 1, 1, 130, 70),
    (256, True, "f16", "mma", 1, 1, 1, 70, 100),
]


# variants with call-time tensors and integer index math in the mask
VARIANTS = [  # (options, dim, dtype, tier, B, H, Hkv, M, N)
    (dict(causal=True, alibi=True), 64, "bf16", "mma", 2, 2, 1, 77, 130),
    (dict(mask=lambda b, h, q, k: fagen.ne(((q - k) // 3) % 4, 1)), 64, "bf16", "mma", 1, 2, 2, 100, 90),
    (dict(causal="bottom_right", window=20), 64, "f32", "simt", 1, 2, 2, 40, 90),
]


# the Hopper tier, where the GPU is one
HOPPER = [
    (dict(causal=True), 64, "bf16", "wgmma", 1, 2, 1, 150, 170),
    (dict(causal="bottom_right", alibi=True), 128, "f16", "wgmma", 1, 2, 2, 77, 300),
    (dict(), 256, "bf16", "wgmma", 1, 1, 1, 130, 90),
]


# the backward (simt): preprocess, main (atomics), convert; and the deterministic dQ kernel
BACKWARD = [  # (options, dim, dtype, B, H, Hkv, M, N, deterministic)
    (dict(causal="bottom_right"), 64, "f16", 1, 2, 1, 33, 17, False),
    (dict(causal=True, alibi=True), 128, "bf16", 2, 2, 1, 17, 70, True),
    (dict(causal=True, window=20), 64, "f32", 1, 2, 2, 40, 90, False),
    (dict(score_mod=lambda s, b, h, q, k, bias: s + bias[h]), 96, "bf16", 1, 2, 2, 50, 37, False),
]


def main() -> int:
    import cupy

    failed = 0
    cases = [
        (dict(causal=causal), dim, dtype, tier, B, H, Hkv, M, N) for dim, causal, dtype, tier, B, H, Hkv, M, N in CASES
    ] + VARIANTS
    if sys.argv[1:] == ["backward"]:  # the backward's cases alone
        cases = []
    elif cupy.cuda.Device().compute_capability == "90":
        cases += HOPPER
    for options, dim, dtype, tier, B, H, Hkv, M, N in cases:
        kernel = fagen.compile(dim, dtype=dtype, tier=tier, **options)
        r = testing.check_kernel(kernel, B=B, H=H, Hkv=Hkv, M=M, N=N)
        print(f"{kernel.name} M={M} N={N}: err {r.err:.2e} (bound {r.bound:.2e}) {'ok' if r.ok else 'FAIL'}")
        failed += not r.ok
    for options, dim, dtype, B, H, Hkv, M, N, det in BACKWARD:
        kernel = fagen.compile(dim, dtype=dtype, tier="simt", **options)
        r = testing.check_backward(kernel, B=B, H=H, Hkv=Hkv, M=M, N=N, deterministic=det)
        print(f"backward {kernel.name} M={M} N={N} det={det}: {r} {'ok' if r.ok else 'FAIL'}")
        failed += not r.ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
