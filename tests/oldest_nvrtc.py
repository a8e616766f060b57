"""Every kind of kernel compiled with the NVRTC this process loads (CI points FAGEN_NVRTC_LIBRARY at the oldest
fagen supports, 13.0): a construct that a newer NVRTC accepts and an older one rejects turns CI red.

python tests/oldest_nvrtc.py    (no GPU needed)
"""

import sys

import fagen
from fagen.backend import build

KERNELS = [  # (options, what), each for sm_90a unless it says otherwise
    (dict(dim=64), "wgmma forward, persistent (192 rows)"),
    (dict(dim=128, causal=True), "wgmma forward, persistent under a mask (work tiles drawn from a counter)"),
    (dict(dim=64, causal=True), "wgmma forward, a block per work tile (192 rows under a mask)"),
    (dict(dim=128, softcap=30.0, alibi=True), "wgmma forward, persistent, score function and a tensor"),
    (dict(dim=256, causal="bottom_right", window=100), "wgmma forward, d256"),
    (dict(dim=128, causal=True, arch="sm_80"), "mma forward"),
    (dict(dim=72, causal=True), "simt forward"),
    (dict(dim=64, causal=True, block_sparse=True), "wgmma block-sparse forward"),
    (dict(dim=128, causal=True, decode=True), "decode split (merges its splits)"),
]
BACKWARD = [dict(dim=64, causal=True, alibi=True), dict(dim=128, causal=True, arch="sm_80"), dict(dim=72)]


def main() -> int:
    print(f"NVRTC {build.nvrtc_version()}")
    for options, what in KERNELS:
        options = {"arch": "sm_90a", "dtype": "bf16", **options}
        k = fagen.compile(options.pop("dim"), **options)
        print(f"{what}: {k.name}")
    for options in BACKWARD:
        options = {"arch": "sm_90a", "dtype": "bf16", **options}
        k = fagen.compile(options.pop("dim"), **options)
        plan = k.backward_plan
        launches = (plan.preprocess, plan.main, plan.main_grads, plan.convert, plan.dq)  # (_grads: ALiBi's slopes)
        names = [launch.spec.name for launch in launches if launch is not None]
        print(f"backward of {k.name}: {', '.join(names)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
