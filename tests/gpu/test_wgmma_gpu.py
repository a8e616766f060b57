"""The wgmma tier (Hopper, sm_90a) against the float64 reference, with FlashAttention's rule."""

import functools

import pytest

import fagen
from fagen import builders, pipeline
from fagen.tools import testing

pytestmark = pytest.mark.gpu


def _hopper():
    import torch

    return torch.cuda.get_device_capability() == (9, 0)


@functools.cache
def kernel(dim, dtype="bf16", **options):
    return fagen.compile(dim, dtype=dtype, tier="wgmma", **dict(options))


SIZES = [(1, 1), (17, 17), (1000, 1000), (17, 1000), (1000, 17), (4097, 4097), (333, 1333), (1333, 333)]


@pytest.fixture(autouse=True)
def _needs_hopper():
    if not _hopper():
        pytest.skip("the wgmma tier runs on sm_90a (Hopper) only")


@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.parametrize("dim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("M, N", SIZES, ids=[f"M{m}-N{n}" for m, n in SIZES])
def test_matches_reference(causal, dtype, dim, M, N):
    k_ = kernel(dim, dtype, causal=causal)
    assert k_.spec.tier == "wgmma"
    B, H = (2, 3) if max(M, N) < 4000 else (1, 2)
    testing.assert_ok(testing.check_kernel(k_, B=B, H=H, M=M, N=N), f"{k_.name} M={M} N={N}")


VARIANTS = {
    "alibi": dict(causal=True, alibi=True),
    "softcap": dict(softcap=30),
    "window": dict(causal=True, window=256),
    "window_br": dict(causal="bottom_right", window=100),
    "prefix": dict(prefix=300),
    "floor_mod": dict(mask=lambda b, h, q, k: fagen.ne(((q - k) // 3) % 4, 1)),
    "bias": dict(score_mod=lambda s, b, h, q, k, bias: s + bias[h]),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
@pytest.mark.parametrize("dim", [64, 96, 128])
@pytest.mark.parametrize("M, N", [(1000, 1000), (777, 1500), (1500, 777)])
def test_variants(name, dim, M, N):
    options = tuple(sorted(VARIANTS[name].items()))
    k_ = (
        kernel(dim, "bf16", **dict(options))
        if name not in ("floor_mod", "bias")
        else fagen.compile(dim, tier="wgmma", **VARIANTS[name])
    )
    assert k_.spec.tier == "wgmma"
    testing.assert_ok(testing.check_kernel(k_, B=2, H=4, M=M, N=N), f"{k_.name} M={M} N={N}")


@functools.cache
def configured(dim, block_m, dtype="bf16", **options):
    """The kernel at d64's other block shape than the default, its tiles given as `fagen tune` gives them: 128 query
    rows (two consumer warpgroups) or 192 (three, 160 registers a thread)."""
    program = pipeline.load_program(**dict(options))
    steps = pipeline.lower(program, dtype)
    config = dict(block_m=block_m, block_n=128, num_warps=4 * (block_m // 64 + 1), stages=3)
    return builders.build_kernel(
        steps[-1].program,
        program.name,
        dim,
        dtype,
        "sm_90a",
        "wgmma",
        config=config,
        key_range=steps[-1].facts.get("key_range"),
    )


WIDE_OPTIONS = {
    "full": {},
    "causal": dict(causal=True),
    "causal_br": dict(causal="bottom_right"),
    "softcap": dict(softcap=30),
    "alibi": dict(causal=True, alibi=True),
    "window_br": dict(causal="bottom_right", window=100),
}


@pytest.mark.parametrize("block_m", [128, 192])
@pytest.mark.parametrize("name", sorted(WIDE_OPTIONS))
@pytest.mark.parametrize("M, N", [(1, 1), (17, 1000), (1000, 17), (777, 1500), (1500, 777), (4097, 4097)])
def test_block_shapes_at_d64(block_m, name, M, N):
    k_ = configured(64, block_m, **WIDE_OPTIONS[name])
    assert k_.spec.tier == "wgmma" and k_.spec.block_m == block_m, k_.name
    B, H = (2, 3) if max(M, N) < 4000 else (1, 2)
    testing.assert_ok(testing.check_kernel(k_, B=B, H=H, M=M, N=N), f"{k_.name} M={M} N={N}")


PERSISTENT_SHAPES = [  # (B, H, Hkv, M, N): more work tiles than an H100's 132 SMs, but for the last
    (3, 20, 4, 1000, 777),
    (2, 7, 7, 4097, 33),
    (5, 40, 8, 17, 1000),
    (1, 3, 1, 1, 1),
]


@pytest.mark.parametrize("options", [{}, dict(softcap=30), dict(alibi=True)], ids=["full", "softcap", "alibi"])
@pytest.mark.parametrize("dim", [64, 128])
def test_persistent_blocks_take_work_tiles_in_turn(dim, options):
    """Without a mask the kernel is persistent: a block per SM draws work tiles from a counter (query tiles
    fastest), its K/V ring and Q_i's mbarrier phases running on from one tile to the next. Blocks that take several
    tiles, odd sizes, GQA."""
    k_ = kernel(dim, "bf16", **options)
    assert k_.spec.persistent and k_.name.endswith("p"), k_.name
    for B, H, Hkv, M, N in PERSISTENT_SHAPES:
        r = testing.check_kernel(k_, B=B, H=H, Hkv=Hkv, M=M, N=N)
        testing.assert_ok(r, f"{k_.name} B={B} H={H} Hkv={Hkv} M={M} N={N}")


MASKED_PERSISTENT = [  # (options, dim): masks whose tiles take a persistent kernel (192 rows at d64, else 128)
    (dict(causal=True), 64),
    (dict(causal=True, window=300), 64),
    (dict(prefix=700), 64),
    (dict(causal=True), 128),
    (dict(causal="bottom_right"), 128),
    (dict(causal=True, window=300), 128),
    (dict(prefix=700), 128),
    (dict(causal=True, alibi=True), 128),
    (dict(causal=True, softcap=20.0), 96),
]


@pytest.mark.parametrize("options, dim", MASKED_PERSISTENT, ids=lambda x: str(x))
def test_masked_persistent_blocks_draw_work_tiles_longest_first(options, dim):
    """Under a mask the kernel is persistent too: blocks draw work tiles from a counter, the longest query tiles
    first, in chunks of heads whose K and V fit the L2 budget (the last chunk partial). Blocks that draw several,
    M != N (bottom-right alignment moves the diagonal), odd sizes, GQA, rows that see no key, 2048 x 2048 at 32
    heads, and 11 heads over 16400 keys (chunks of 7 heads at d64, 3 at d96-d128: the last one partial); d64 and d96
    at 192 rows (three consumer warpgroups), d128 at 128."""
    k_ = kernel(dim, "bf16", **options)
    assert k_.spec.persistent and k_.spec.block_m == (192 if dim in (64, 96) else 128), k_.name  # (tuned.json)
    shapes = [(1, 70, 7, 600, 600), (2, 9, 3, 1000, 4097), (2, 32, 8, 2048, 2048), (1, 11, 11, 500, 16400)]
    for B, H, Hkv, M, N in PERSISTENT_SHAPES + shapes:
        r = testing.check_kernel(k_, B=B, H=H, Hkv=Hkv, M=M, N=N)
        testing.assert_ok(r, f"{k_.name} B={B} H={H} Hkv={Hkv} M={M} N={N}")


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_gqa_and_layouts(layout):
    k_ = kernel(128, "bf16", causal=True)
    testing.assert_ok(testing.check_kernel(k_, B=2, H=8, Hkv=2, M=600, N=900, layout=layout), f"gqa {layout}")


def test_inputs_tma_cannot_describe_fall_back():
    import torch

    k_ = kernel(128, "bf16", causal=True)
    testing.assert_ok(testing.check_kernel(k_, B=1, H=2, M=300, N=300, layout="strided_d"), "strided along D")
    assert k_._fallback is not None and k_._fallback.spec.tier == "mma"
    q = torch.randn(100, 2, 128, device="cuda").bfloat16()
    cu = torch.tensor([0, 40, 100], dtype=torch.int32, device="cuda")
    o = k_.varlen(q, q, q, cu, cu, 60, 60)
    assert torch.isfinite(o).all()


def test_fully_masked_rows():
    k_ = kernel(64, "bf16", causal="bottom_right")
    r = testing.check_kernel(k_, B=1, H=2, M=500, N=100)  # the first 400 rows see no key
    testing.assert_ok(r, "fully masked rows")


def test_is_the_default_on_hopper():
    assert fagen.compile(128, causal=True).spec.tier == "wgmma"


@pytest.mark.parametrize("layout", ["bshd_view", "padded_rows"])
def test_output_written_through_tma_or_directly(layout):
    """O goes out by TMA stores from shared memory: an `out=` that TMA can describe ([B, N, H, D] viewed as
    [B, H, N, D]) stays on the tier; one it cannot (rows 130 elements apart: not a multiple of 16 bytes) falls
    back to the mma tier, which writes it directly. Both are poisoned and checked against float64."""
    import torch

    k_ = fagen.compile(128, causal=True, tier="wgmma")
    B, H, M, N, D = 2, 4, 1000, 777, 128
    q, k, v = testing.random_qkv(B, H, M, N, D, "bf16")
    if layout == "bshd_view":
        out = torch.full((B, M, H, D), float("nan"), dtype=q.dtype, device="cuda").transpose(1, 2)
    else:
        out = torch.full((B, H, M, D + 2), float("nan"), dtype=q.dtype, device="cuda")[..., :D]
    o, lse = k_(q, k, v, out=out, return_lse=True)
    torch.cuda.synchronize()
    assert o.data_ptr() == out.data_ptr()
    keep = testing.keep_matrix(k_, B, H, M, N, {})
    ref = testing.reference(q, k, v, keep, k_.default_scale)
    naive = testing.reference(q, k, v, keep, k_.default_scale, dtype=q.dtype)
    testing.assert_ok(testing.compare(o, lse, ref, naive, "bf16"), f"out layout {layout}")
    assert (k_._fallback is not None and k_._fallback.spec.tier == "mma") == (layout == "padded_rows")
