"""The FlashAttention-suite tier's parts on the CPU (tests/fa_suite; the run itself is tests/gpu/test_fa_suite_gpu.py):
the shim's pad_input / unpad_input / apply_rotary_emb against direct formulas, the shim's functions being fagen's,
fagen's dropout refusal (and only it) made a skip, the seeded sample, and, where FlashAttention's test file is found
($FAGEN_FA_TESTS), its import through the shim, its cases and their ids, and the runner's sampled collection."""

import os
import subprocess
import sys

import pytest

from tests import fa_suite

TORCH_REASON = "the shim and FlashAttention's tests are written with torch"


@pytest.fixture
def shim():
    pytest.importorskip("torch", reason=TORCH_REASON)
    with fa_suite.shimmed() as flash_attn:
        import flash_attn.bert_padding
        import flash_attn.flash_attn_interface
        import flash_attn.layers.rotary

        yield flash_attn
    assert "flash_attn" not in sys.modules or not str(sys.modules["flash_attn"].__file__).startswith(str(fa_suite.SHIM))


def test_the_shims_functions_are_fagens(shim):
    import fagen

    for name in (
        "flash_attn_func",
        "flash_attn_kvpacked_func",
        "flash_attn_qkvpacked_func",
        "flash_attn_varlen_func",
        "flash_attn_varlen_kvpacked_func",
        "flash_attn_varlen_qkvpacked_func",
        "flash_attn_with_kvcache",
    ):
        assert getattr(shim, name) is getattr(fagen.flash_attn, name)
        assert getattr(shim.flash_attn_interface, name) is getattr(fagen.flash_attn, name)
    assert shim.flash_attn_interface.USE_TRITON_ROCM is False
    assert shim.flash_attn_interface._get_block_size_n("cuda", 64, True, False) in (32, 64, 128)
    assert str(shim.__file__).startswith(str(fa_suite.SHIM))


def test_unpad_input_keeps_the_masked_tokens_in_row_major_order(shim):
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)
    B, S = 3, 7
    x = torch.randn(B, S, 2, 4, generator=g, requires_grad=True)
    mask = torch.rand(B, S, generator=g) < 0.6
    mask[1] = False  # an empty sequence
    mask[2] = True
    unused = torch.zeros(B, S, dtype=torch.bool)
    unused[0, -1] = ~mask[0, -1]
    rows, indices, cu, longest, used = shim.bert_padding.unpad_input(x, mask, unused)
    keep = mask | unused
    want = [(b, s) for b in range(B) for s in range(S) if keep[b, s]]
    assert indices.tolist() == [b * S + s for b, s in want]
    assert torch.equal(rows, torch.stack([x[b, s] for b, s in want]))
    lengths = keep.sum(-1).tolist()
    assert cu.dtype == torch.int32 and cu.tolist() == [sum(lengths[:i]) for i in range(B + 1)]
    assert type(longest) is int and longest == max(lengths)
    assert used.dtype == torch.int32 and used.tolist() == mask.sum(-1).tolist()
    int_mask = shim.bert_padding.unpad_input(x, mask.int())
    assert torch.equal(int_mask[1], torch.nonzero(mask.flatten()).flatten())


def test_pad_input_inverts_unpad_input_with_gradients(shim):
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(1)
    B, S = 4, 5
    x = torch.randn(B, S, 3, generator=g, requires_grad=True)
    mask = torch.rand(B, S, generator=g) < 0.5
    rows, indices, _, _, _ = shim.bert_padding.unpad_input(x, mask)
    back = shim.bert_padding.pad_input(rows, indices, B, S)
    assert torch.equal(back, x.detach() * mask[..., None])
    (grad,) = torch.autograd.grad(back, x, torch.ones_like(back))
    assert torch.equal(grad, mask[..., None].expand_as(x).float())


def _rotate(x, cos, sin, positions, interleaved):
    """The rotary embedding written out, pair by pair, in float64: x [B, S, H, D], positions [B, S]."""
    out = x.double().clone()
    half = cos.shape[1]
    for b in range(x.shape[0]):
        for s in range(x.shape[1]):
            p = int(positions[b, s])
            if p >= cos.shape[0]:
                continue
            for i in range(half):
                a, c = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
                x1, x2 = x[b, s, :, a].double(), x[b, s, :, c].double()
                cs, sn = float(cos[p, i]), float(sin[p, i])
                out[b, s, :, a] = x1 * cs - x2 * sn
                out[b, s, :, c] = x1 * sn + x2 * cs
    return out


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("offsets", ["int", "tensor"])
def test_apply_rotary_emb_matches_the_formula(shim, interleaved, offsets):
    """The first rotary_dim dims turned by the angles at offset_b + s (no turn past the table), the rest kept."""
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(2)
    B, S, H, D, rd, seqlen_ro = 2, 5, 3, 10, 6, 8
    x = torch.randn(B, S, H, D, generator=g)
    angle = torch.rand(seqlen_ro, rd // 2, generator=g) * 6.3
    cos, sin = angle.cos(), angle.sin()
    off = 2 if offsets == "int" else torch.tensor([0, 5], dtype=torch.int32)  # 5 + 4 passes the table's 8
    got = shim.layers.rotary.apply_rotary_emb(x, cos, sin, interleaved=interleaved, seqlen_offsets=off)
    positions = torch.as_tensor(off).reshape(-1, 1) + torch.arange(S)[None, :]
    want = _rotate(x, cos, sin, positions.expand(B, S), interleaved)
    assert got.dtype == x.dtype and (got.double() - want).abs().max() < 1e-5
    assert torch.equal(got[..., rd:], x[..., rd:])
    half = shim.layers.rotary.apply_rotary_emb(x.half(), cos.half(), sin.half(), interleaved, seqlen_offsets=off)
    want_half = _rotate(x.half(), cos.half(), sin.half(), positions.expand(B, S), interleaved)
    assert half.dtype == torch.float16 and (half.double() - want_half).abs().max() < 2e-3


def test_apply_rotary_emb_packed_and_in_place(shim):
    """With cu_seqlens, token r of sequence b is at offset_b + r - cu[b], as the padded form; inplace writes x."""
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 4, 2, 8, generator=g)
    angle = torch.rand(9, 4, generator=g)
    cos, sin = angle.cos(), angle.sin()
    off = torch.tensor([1, 3], dtype=torch.int32)
    padded = shim.layers.rotary.apply_rotary_emb(x, cos, sin, seqlen_offsets=off)
    cu = torch.tensor([0, 4, 8], dtype=torch.int32)
    packed = shim.layers.rotary.apply_rotary_emb(x.reshape(8, 2, 8), cos, sin, seqlen_offsets=off, cu_seqlens=cu)
    assert torch.equal(packed.reshape(x.shape), padded)
    y = x.clone()
    assert shim.layers.rotary.apply_rotary_emb(y, cos, sin, inplace=True, seqlen_offsets=off) is y
    assert torch.equal(y, padded)


def _fa_call(flash_attn, name: str):
    """A call of the shim's function `name` with dropout_p=0.17, on CPU tensors (the refusal comes first)."""
    import torch

    q = torch.randn(1, 4, 2, 32)
    qkv, kv = torch.stack([q, q, q], 2), torch.stack([q, q], 2)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    calls = {
        "flash_attn_func": lambda: flash_attn.flash_attn_func(q, q, q, 0.17),
        "flash_attn_kvpacked_func": lambda: flash_attn.flash_attn_kvpacked_func(q, kv, 0.17),
        "flash_attn_qkvpacked_func": lambda: flash_attn.flash_attn_qkvpacked_func(qkv, 0.17),
        "flash_attn_varlen_func": lambda: flash_attn.flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 4, 4, 0.17),
        "flash_attn_varlen_kvpacked_func": lambda: flash_attn.flash_attn_varlen_kvpacked_func(
            q[0], kv[0], cu, cu, 4, 4, 0.17
        ),
        "flash_attn_varlen_qkvpacked_func": lambda: flash_attn.flash_attn_varlen_qkvpacked_func(qkv[0], cu, 4, 0.17),
    }
    return calls[name]


@pytest.mark.parametrize(
    "name",
    [
        "flash_attn_func",
        "flash_attn_kvpacked_func",
        "flash_attn_qkvpacked_func",
        "flash_attn_varlen_func",
        "flash_attn_varlen_kvpacked_func",
        "flash_attn_varlen_qkvpacked_func",
    ],
)
def test_dropout_reaches_fagens_refusal_and_becomes_a_skip(shim, name):
    call = _fa_call(shim, name)
    with pytest.raises(NotImplementedError) as refused:
        call()
    assert fa_suite.is_refusal(refused.value), str(refused.value)
    assert "dropout" in str(refused.value)

    def test_case(x):
        call()

    with pytest.raises(pytest.skip.Exception, match="refused by fagen: dropout_p: fagen has no attention dropout"):
        fa_suite.wrap(test_case)(x=1)


def test_only_the_refusal_is_a_skip():
    def raises(e):
        def test_case():
            raise e

        return fa_suite.wrap(test_case)

    with pytest.raises(NotImplementedError, match="something else"):
        raises(NotImplementedError("something else"))()
    with pytest.raises(ValueError, match="dropout_p"):
        raises(ValueError("dropout_p: expected a probability in [0, 1), got 2"))()
    with pytest.raises(AssertionError):
        raises(AssertionError())()
    assert fa_suite.wrap(lambda: 7)() == 7


def test_wrap_keeps_the_parameters_and_marks():
    torch = pytest.importorskip("torch")
    import inspect

    @pytest.mark.parametrize("b", [1, 2])
    @pytest.mark.parametrize("a", ["x", torch.float16])
    def test_f(a, b):
        return a, b

    wrapped = fa_suite.wrap(test_f)
    assert list(inspect.signature(wrapped).parameters) == ["a", "b"]
    assert [m.args[0] for m in wrapped.pytestmark] == ["a", "b"]
    assert [p for p, _ in fa_suite.cases(test_f)] == [
        {"a": "x", "b": 1},
        {"a": "x", "b": 2},
        {"a": torch.float16, "b": 1},
        {"a": torch.float16, "b": 2},
    ]
    assert [i for _, i in fa_suite.cases(test_f)] == ["x-1", "x-2", "a1-1", "a1-2"]


def test_the_sample_is_seeded_and_sized():
    sizes = {"a": 1000, "b": 10, "c": 3}
    one = fa_suite.choose(sizes, 50, seed=0, per_test=False)
    assert sum(map(len, one.values())) == 50 and one == fa_suite.choose(sizes, 50, seed=0, per_test=False)
    assert one != fa_suite.choose(sizes, 50, seed=1, per_test=False)
    assert all(0 <= i < sizes[n] and one[n] == sorted(set(one[n])) for n in sizes for i in one[n])
    even = fa_suite.choose(sizes, 30, seed=0, per_test=True)
    assert {n: len(v) for n, v in even.items()} == {"a": 17, "b": 10, "c": 3}
    assert sum(map(len, fa_suite.choose(sizes, 5000, 0, False).values())) == 1013


def test_sampled_tests_keep_their_chosen_cases():
    @pytest.mark.parametrize("n", range(20))
    @pytest.mark.parametrize("dropout_p", [0.0, 0.17])
    def test_g(dropout_p, n):
        pass

    def test_h():
        pass

    tests = fa_suite.sampled({"test_g": fa_suite.wrap(test_g), "test_h": fa_suite.wrap(test_h)}, 5, 3, False)
    all_ids = [i for _, i in fa_suite.cases(test_g)]
    if "test_g" in tests:
        (mark,) = tests["test_g"].pytestmark
        ids = [p.id for p in mark.args[1]]
        assert set(ids) <= set(all_ids) and len(ids) == 5 - ("test_h" in tests)
    assert len(test_g.pytestmark) == 2, "the original's marks are left alone"


# --- FlashAttention's file, where $FAGEN_FA_TESTS (or a checkout) is given ----------------------------------------
@pytest.fixture(scope="module")
def fa_module():
    pytest.importorskip("torch", reason=TORCH_REASON)
    path = fa_suite.locate()
    if path is None:
        pytest.skip(fa_suite.missing())
    try:
        fa_suite.ensure_einops()
    except ImportError as e:
        pytest.skip(str(e))
    with fa_suite.fake_cuda():
        return fa_suite.load(path)


def test_the_file_imports_through_the_shim(fa_module):
    import fagen

    assert fa_module.flash_attn_func is fagen.flash_attn.flash_attn_func
    assert fa_module.pad_input.__module__ == "flash_attn.bert_padding"
    assert fa_module.pad_input.__code__.co_filename.startswith(str(fa_suite.SHIM))
    assert "flash_attn" not in sys.modules, "the shim is set aside once the file is imported"
    table = fa_suite.counts(fa_module)
    print("\n" + fa_suite.describe(table))
    cases, dropout = fa_suite.total(table)
    assert cases > 100_000 and 0 < dropout < cases
    assert "test_flash_attn_output" in table and table["test_flash_attn_output"][1] > 0


def test_the_runner_collects_the_sample(fa_module, tmp_path):
    """The runner, collected on the CPU with torch.cuda faked: exactly the N sampled cases, ids of the file's."""
    args = ["--collect-only", "-q", "-p", "no:cacheprovider", "tests/gpu/test_fa_suite_gpu.py"]
    head = "import sys, pytest\nfrom tests import fa_suite"
    script = f"{head}\nwith fa_suite.fake_cuda(): sys.exit(pytest.main({args}))"
    env = {**os.environ, "FAGEN_FA_TESTS": str(fa_suite.locate()), "FAGEN_FA_SAMPLE": "40", "FAGEN_FA_PER_TEST": "1"}
    run = subprocess.run(
        [sys.executable, "-c", script], cwd=fa_suite.ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    ids = [line.split("::", 1)[1] for line in run.stdout.splitlines() if "::" in line]
    assert len(ids) == 40 and "40 tests collected" in run.stdout
    known = {
        f"{name}[{case_id}]" if params else name
        for name, fn in fa_suite.tests_of(fa_module).items()
        for params, case_id in fa_suite.cases(fn)
    }
    assert set(ids) <= known


@pytest.mark.slow
def test_the_file_passes_on_the_kernel_double(fa_module):
    """Two cases of each test function (small sequences), through the runner with fagen's compiler replaced by the
    float64 double (tests/fa_suite/cpu.py): the interface takes every argument the file passes (a failure here is
    an argument, a shape, a layout or an in-place update, never a kernel's numerics)."""
    env = {
        **os.environ,
        "FAGEN_FA_TESTS": str(fa_suite.locate()),
        "FAGEN_FA_SAMPLE": "34",
        "FAGEN_FA_PER_TEST": "1",
        "FAGEN_FA_CPU_MAX": "128",
    }
    args = ["-p", "tests.fa_suite.cpu", "tests/gpu/test_fa_suite_gpu.py", "-p", "no:cacheprovider", "-q", "-rfEs"]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", *args, "-W", "ignore::DeprecationWarning"],
        cwd=fa_suite.ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    summary = run.stdout.strip().splitlines()[-1]
    assert run.returncode == 0 and " passed" in summary and "failed" not in summary, run.stdout[-5000:]
    assert "refused by fagen: dropout_p: fagen has no attention dropout yet" in run.stdout
