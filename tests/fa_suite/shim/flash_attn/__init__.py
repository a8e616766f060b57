"""`flash_attn` for FlashAttention's own tests, on fagen's drop-ins (tests/fa_suite: the shim is put first on
sys.path only while that tier runs; fagen never imports it)."""

from .flash_attn_interface import (  # noqa: F401
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)
