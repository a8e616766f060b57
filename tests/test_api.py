"""The Python API without a GPU: compiling, and the errors bad arguments get."""

import re

import numpy as np
import pytest

import fagen


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    return fagen.compile(64, causal=True, dtype="f16", arch="sm_90a", cache_dir=tmp_path_factory.mktemp("c"))


def test_compile_returns_a_kernel(kernel, tmp_path):
    assert kernel.name == fagen.backend.plan.choose("causal", 64, "f16", "sm_90a", causal=True).spec.name
    assert kernel.name.startswith("flash_fwd_causal_d64_f16_sm90a_wgmma_")
    assert kernel.spec.tier == "wgmma" and "default for f16/bf16 on sm_90a" in kernel.tier_reason
    assert kernel.spec.head_dim == 64 and kernel.spec.dtype == "f16"
    assert "\n#include" not in kernel.source
    assert kernel.default_scale == pytest.approx(64**-0.5)
    assert not kernel.resources.spills
    assert kernel.save(tmp_path / "k.cu").read_text() == kernel.source
    assert kernel.save(tmp_path / "k.cubin").read_bytes() == kernel.binary.cubin
    with pytest.raises(ValueError, match="path: expected a .cu, .ptx or .cubin"):
        kernel.save(tmp_path / "k.txt")


@pytest.mark.parametrize(
    "kwargs, exc, fragment",
    [
        (dict(dim=7), ValueError, "dim: expected a head dimension between 8 and 256"),
        (dict(dim=257), ValueError, "dim: expected a head dimension between 8 and 256"),
        (dict(dim="128"), TypeError, "dim: expected an int"),
        (dict(dim=64, dtype="f64"), ValueError, "dtype: expected one of"),
        (dict(dim=64, arch="sm_70"), ValueError, "arch: expected one of"),
        (dict(dim=64, causal="diagonal"), ValueError, "causal: expected"),
        (dict(dim=64, tier="tensorcore"), ValueError, "tier: 'tensorcore' is not available"),
        (dict(dim=64, tier="mma", dtype="f32"), ValueError, "tier: mma cannot compile this kernel: f32"),
        (dict(dim=64, ir="missing.ir"), ValueError, "ir: cannot read 'missing.ir'"),
        (dict(dim=64, ir="program x\n"), ValueError, "missing output"),
        (dict(dim=64, ir=3), TypeError, "ir: expected a path"),
        (
            dict(dim=64, causal=True, ir="x.ir"),
            ValueError,
            "ir: an ir program states its own mask and score; drop causal",
        ),
        (dict(dim=64, window=-3), ValueError, r"window \(left\): expected an integer >= 0"),
        (dict(dim=64, softcap=0), ValueError, "softcap: expected a positive number"),
        (dict(dim=64, prefix=0), ValueError, "prefix: expected an integer >= 1"),
        (dict(dim=64, mask=3), TypeError, "mask: expected a function"),
        (dict(dim=64, mask=lambda b, h: b), TypeError, r"mask: expected a function of \(b, h, q, k"),
    ],
)
def test_compile_errors_name_the_argument(kwargs, exc, fragment):
    dim = kwargs.pop("dim")
    with pytest.raises(exc, match=fragment):
        fagen.compile(dim, arch=kwargs.pop("arch", "sm_90a"), **kwargs)


def test_user_program_text(tmp_path):
    text = (resources_text := fagen.resources.shipped_programs()["causal"].read_text()).replace(
        "program causal", "program my_causal"
    )
    k = fagen.compile(64, ir=text, dtype="bf16", arch="sm_90a", cache_dir=tmp_path)
    # a user's program is named by its name and a digest of its content
    assert re.fullmatch(r"flash_fwd_my_causal_[0-9a-f]{8}_d64_bf16_sm90a_.*", k.name) and resources_text


@pytest.mark.parametrize(
    "arg, fragment",
    [
        (np.zeros((1, 1, 4, 64), np.float16), "got a NumPy array (host memory)"),
        ([[1.0]], "got list"),
        (None, "got NoneType"),
    ],
)
def test_host_arrays_are_refused(kernel, arg, fragment):
    with pytest.raises(TypeError, match=re.escape(fragment)):
        kernel(arg, arg, arg)


def test_torch_cpu_tensors_are_refused(kernel):
    torch = pytest.importorskip("torch")
    x = torch.randn(1, 1, 4, 64, dtype=torch.float16)
    with pytest.raises(TypeError, match="q: expected a CUDA tensor"):
        kernel(x, x, x)
