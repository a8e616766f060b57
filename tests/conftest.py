import functools
import os
import tempfile

import pytest


def pytest_configure(config):
    """Every test compiles into a temporary cache, never the user's ~/.cache/fagen. pytest-xdist's workers keep
    the one their controller made (they inherit its environment), so each kernel compiles once per run."""
    if os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get("FAGEN_CACHE_DIR"):
        return
    os.environ["FAGEN_CACHE_DIR"] = tempfile.mkdtemp(prefix="fagen-test-cache-")


@functools.lru_cache(maxsize=1)
def gpu_unavailable_reason():
    """Why the GPU tier cannot run here, or None when it can."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA GPU on this machine"
    except Exception as e:  # no driver, no device
        return f"no CUDA GPU on this machine ({type(e).__name__})"
    try:
        import torch
    except ImportError:
        return "PyTorch is not installed (the GPU tier's float64 reference uses it)"
    if not torch.cuda.is_available():
        return "PyTorch sees no CUDA GPU"
    return None


def pytest_collection_modifyitems(config, items):
    reason = gpu_unavailable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"GPU tier skipped: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
