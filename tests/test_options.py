"""Compile options: names that follow from content, declared dtypes, window alignment, option types, scale,
and bad .ir files — each refused with an error naming the argument (no GPU needed)."""

import math

import numpy as np
import pytest

import fagen
from fagen import resources
from fagen.ir import variants
from fagen.passes import fuse
from fagen.tools import executor

CAUSAL_IR = resources.shipped_programs()["causal"].read_text()


def _compile(**kw):
    return fagen.compile(kw.pop("dim", 64), arch=kw.pop("arch", "sm_90a"), **kw)


def test_a_changed_program_under_a_shipped_name_gets_its_own_kernel_name():
    shipped = _compile(causal=True)
    same = _compile(ir=CAUSAL_IR)
    changed = _compile(ir=CAUSAL_IR.replace("keep=k <= q", "keep=k <= q + 3"))
    assert same.name == shipped.name  # the shipped program itself keeps its name
    assert changed.name != shipped.name
    assert changed.name.startswith("flash_fwd_causal_") and "_d64_" in changed.name
    again = _compile(ir=CAUSAL_IR.replace("keep=k <= q", "keep=k <= q + 3"))
    assert again.name == changed.name  # the name follows from the content
    other = _compile(ir=CAUSAL_IR.replace("keep=k <= q", "keep=k <= q + 4"))
    assert other.name not in (changed.name, shipped.name)


def test_an_ir_program_compiles_in_the_dtype_it_declares():
    text = CAUSAL_IR.replace("T[", "f16[")
    k = _compile(ir=text)
    assert k.spec.dtype == "f16" and "_f16_" in k.name
    assert _compile(ir=text, dtype="f16").name == k.name
    with pytest.raises(ValueError, match="dtype: the program 'causal' declares f16 inputs; drop dtype='bf16'"):
        _compile(ir=text, dtype="bf16")
    assert _compile(ir=CAUSAL_IR).spec.dtype == "bf16"  # T: the default


def test_cli_takes_the_declared_dtype(tmp_path, capsys):
    from fagen.tools import cli

    path = tmp_path / "p.ir"
    path.write_text(CAUSAL_IR.replace("T[", "f16["))
    assert cli.main(["compile", "--dim", "64", "--ir", str(path), "--arch", "sm_90a", "-o", str(tmp_path)]) == 0
    assert "_f16_" in capsys.readouterr().out
    assert (
        cli.main(
            ["compile", "--dim", "64", "--ir", str(path), "--arch", "sm_90a", "--dtype", "bf16", "-o", str(tmp_path)]
        )
        == 1
    )
    assert "declares f16 inputs" in capsys.readouterr().err


def _naive(q, k, v, scale, keep):
    s = np.where(keep, scale * np.einsum("bhmd,bhnd->bhmn", q, k), -np.inf)
    m = s.max(-1, keepdims=True)
    e = np.exp(s - np.where(np.isfinite(m), m, 0.0))
    total = e.sum(-1, keepdims=True)
    return np.einsum("bhmn,bhnd->bhmd", e / np.where(total > 0, total, 1.0), v)


@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
@pytest.mark.parametrize("M, N", [(1, 1000), (7, 40), (40, 7), (23, 23)])
def test_a_window_follows_the_causal_alignment(align, M, N):
    """FlashAttention's convention: with bottom-right alignment query q stands at key q + N - M, and the
    window is counted from there (M=1, N=1000, window 256: keys 743..999)."""
    left = 256 if N >= 1000 else 5
    program = variants.build(causal=align, window=left)
    qi, ki = np.arange(M)[:, None], np.arange(N)[None, :]
    at = qi + (N - M if align == "bottom_right" else 0)
    keep = (ki <= at) & (at - ki <= left)
    rng = np.random.default_rng(5 + M + N)
    q, k, v = (rng.standard_normal((1, 2, S, 8)) for S in (M, N, N))
    ref = _naive(q, k, v, 1 / math.sqrt(8), keep)
    out = executor.run(fuse.fuse(program), dict(q=q, k=k, v=v), block_m=4, block_n=16).outputs["o"]
    np.testing.assert_allclose(out, ref, rtol=1e-10, atol=1e-12)
    if (M, N) == (1, 1000) and align == "bottom_right":
        assert keep[0].nonzero()[0].tolist() == list(range(743, 1000))


@pytest.mark.parametrize(
    "kwargs, exc, fragment",
    [
        (dict(alibi="yes"), TypeError, "alibi: expected True or False, got 'yes'"),
        (dict(alibi=1), TypeError, "alibi: expected True or False"),
        (dict(causal=1), ValueError, "causal: expected False, True"),
        (dict(causal="yes"), ValueError, "causal: expected False, True"),
        (dict(scale=-1.0), ValueError, "scale: expected a finite positive number, got -1.0"),
        (dict(scale=0), ValueError, "scale: expected a finite positive number, got 0"),
        (dict(scale=float("inf")), ValueError, "scale: expected a finite positive number"),
        (dict(scale="a"), TypeError, "scale: expected a finite positive number, got 'a'"),
        (dict(scale=True), TypeError, "scale: expected a finite positive number"),
    ],
)
def test_options_take_the_types_they_document(kwargs, exc, fragment):
    with pytest.raises(exc, match=fragment):
        _compile(**kwargs)


def test_scale_given_at_compile_time_is_the_default():
    assert _compile(scale=0.25).default_scale == 0.25
    assert _compile(scale=np.float32(0.5)).default_scale == 0.5


def test_binary_and_oversized_ir_files_name_the_file_and_line(tmp_path):
    binary = tmp_path / "b.ir"
    binary.write_bytes(b"program x\n\xff\xfe\n")
    with pytest.raises(ValueError, match=r"ir: .*b\.ir:2: not UTF-8 text"):
        _compile(ir=binary)
    big = tmp_path / "big.ir"
    big.write_text("# padding\n" * 200_000)
    with pytest.raises(ValueError, match=r"ir: .*big\.ir' is \d+ bytes; an ir program is at most"):
        _compile(ir=big)
    deep = tmp_path / "deep.ir"
    deep.write_text(CAUSAL_IR.replace("keep=k <= q", "keep=" + "(" * 300 + "k <= q" + ")" * 300))
    with pytest.raises(fagen.IRError, match=r"deep\.ir:8: cannot parse .*too many nested parentheses"):
        _compile(ir=deep)
    long = tmp_path / "long.ir"
    long.write_text(CAUSAL_IR.replace("keep=k <= q", "keep=k <= q" + " + 1" * 2000))
    with pytest.raises(fagen.IRError, match=r"long\.ir:8: statement of \d+ characters"):
        _compile(ir=long)
