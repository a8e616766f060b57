"""FlashAttention's own tests/test_flash_attn.py, unmodified, against fagen (issue 40's target): its test functions
are collected here, as they are, with `flash_attn` the shim of tests/fa_suite (fagen's functions). A dropout case
is skipped giving fagen's refusal; any other exception, and every assertion of FlashAttention's, fails the case.

    FAGEN_FA_TESTS=path/to/test_flash_attn.py python -m pytest -q -n 14 tests/gpu/test_fa_suite_gpu.py

FAGEN_FA_SAMPLE=N runs a seeded sample of N cases (FAGEN_FA_SEED, FAGEN_FA_PER_TEST); docs/fa_suite.md gives the
whole command.
Skipped, with the reason, where the file, torch, a CUDA GPU or einops is absent."""

import pytest

from tests import fa_suite

pytestmark = pytest.mark.gpu


def _unavailable() -> str | None:
    if fa_suite.locate() is None:
        return fa_suite.missing()
    try:
        import torch
    except ImportError:
        return "PyTorch is not installed (FlashAttention's tests are written with it)"
    if not torch.cuda.is_available():
        return "PyTorch sees no CUDA GPU (FlashAttention's tests read the device's capability at import)"
    try:
        fa_suite.ensure_einops()
    except ImportError as e:
        return str(e)
    return None


_reason = _unavailable()
if _reason is not None:
    pytest.skip(_reason, allow_module_level=True)
globals().update(fa_suite.collected(fa_suite.load(fa_suite.locate())))
