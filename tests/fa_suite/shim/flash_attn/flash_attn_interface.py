"""flash_attn.flash_attn_interface as FlashAttention's tests import it: the public functions are fagen's (no
adapter: the arguments reach fagen as the tests pass them, dropout_p included, so fagen refuses dropout itself),
and the two module constants the tests read."""

from fagen.flash_attn import (  # noqa: F401
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from fagen.kvcache import flash_attn_with_kvcache  # noqa: F401

USE_TRITON_ROCM = False  # fagen runs on NVIDIA GPUs: the tests' CUDA-extension paths apply


def _get_block_size_n(device, head_dim, is_dropout, is_causal):
    """The width of the key blocks that FlashAttention's tests split scores by when they rebuild its dropout
    pattern (normalize_flash_attn_S). Only dropout cases read it, and fagen refuses those before; a plausible
    width (FlashAttention-2's forward tiles: 128 keys up to head dim 64, else 64)."""
    if not 0 < head_dim <= 256:
        raise ValueError(f"head_dim: expected 1..256, got {head_dim}")
    return 128 if head_dim <= 64 else 64
