"""A pytest plugin that runs FlashAttention's tests through the runner on the CPU, for the interface: fagen's
compiler is replaced by the float64 kernel double of tests/attention_double.py (fagen's front-ends, their checks and
autograd wiring run as they are; the kernels' own checks do not), torch.cuda answers as an H100 would, and every
tensor the tests ask for on "cuda" is made on the CPU. Cases whose sequences pass FAGEN_FA_CPU_MAX
keys or queries (default 256) are left out before the sample, and the loops of race_condition and
deterministic (hundreds of backwards) are deselected: the double is slow.

    FAGEN_FA_TESTS=... FAGEN_FA_SAMPLE=200 FAGEN_FA_PER_TEST=1 \\
        python -m pytest -p tests.fa_suite.cpu tests/gpu/test_fa_suite_gpu.py -p no:cacheprovider -q

(-p no:randomly etc. as usual; the gpu marker's skip is lifted for the runner's items.) A failure here is an
interface failure (an argument refused, a shape, a layout, a missed in-place update), never a kernel's numerics."""

from __future__ import annotations

import os

import pytest

SIZES = ("seqlen", "seqlen_q", "seqlen_k")
_state: dict = {}


def _cuda_to_cpu_mode():
    import torch
    from torch.overrides import TorchFunctionMode

    def cpu(device):
        return "cpu" if device is not None and torch.device(device).type == "cuda" else device

    class CudaToCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if "device" in kwargs:
                kwargs["device"] = cpu(kwargs["device"])
            if func is torch.Tensor.to and args and isinstance(args[-1], str) and args[-1].startswith("cuda"):
                args = (*args[:-1], "cpu")
            return func(*args, **kwargs)

    return CudaToCpu()


def pytest_configure(config):
    from tests import fa_suite
    from tests.attention_double import install

    fake = fa_suite.fake_cuda()
    fake.__enter__()
    mode = _cuda_to_cpu_mode()
    mode.__enter__()
    patch = pytest.MonkeyPatch()
    install(patch)
    patch.setattr(fa_suite, "KEEP", _small)
    _state.update(fake=fake, mode=mode, patch=patch)


def pytest_unconfigure(config):
    if _state:
        _state["patch"].undo()
        _state["mode"].__exit__(None, None, None)
        _state["fake"].__exit__(None, None, None)
        _state.clear()


def _small(params: dict) -> bool:
    """A case the double runs in seconds: sequences of at most FAGEN_FA_CPU_MAX, and not the loops of
    race_condition / deterministic (hundreds of backwards)."""
    limit = int(os.environ.get("FAGEN_FA_CPU_MAX", "256"))
    return all(params.get(k, 0) <= limit for k in SIZES)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Lift the GPU tier's skip from the runner's items; leave out the loops of hundreds of backwards."""
    kept, dropped = [], []
    for item in items:
        if item.path.name == "test_fa_suite_gpu.py" and ("race_condition" in item.name or "deterministic" in item.name):
            dropped.append(item)
            continue
        kept.append(item)
        if item.path.name == "test_fa_suite_gpu.py":
            item.own_markers = [m for m in item.own_markers if m.name != "skip"]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
