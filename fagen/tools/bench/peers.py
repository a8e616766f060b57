"""The other implementations `fagen bench` times, in the same process on the same GPU: FlashAttention-4
(`flash_attn.cute`), PyTorch SDPA's FlashAttention-2 and cuDNN backends, and compiled FlexAttention.

Each peer is a callable (q, k, v) -> o in its own layout (`layout`): FlashAttention-4 takes [B, S, H, D] (packed:
[total, H, D]), SDPA and Flex [B, H, S, D] (packed: Flex [1, H, total, D] under a document mask).
"""

from __future__ import annotations

from .cases import RELATIVE_OFFSET, VARIANTS, Case, cu_seqlens, fa4_options


def fa4_module():
    """`flash_attn.cute` (FlashAttention-4), imported; ImportError where it is not installed."""
    from flash_attn import cute

    return cute


def missing_peers() -> dict[str, str]:
    """{peer: why it cannot run here} for the peers whose package does not import."""
    try:
        fa4_module()
    except Exception as e:  # ImportError, or a broken install (its CUDA bindings)
        return {"fa4": f"flash_attn.cute does not import ({type(e).__name__}: {str(e).splitlines()[0][:80]})"}
    return {}


def layout(backend: str, case: Case) -> str:
    """The layout `backend` takes a case's tensors in: the case's own (packed: [total, H, D]; else [B, H, S, D]),
    'bshd' (FlashAttention-4's [B, S, H, D]) or 'packed_bhsd' (Flex's [1, H, total, D] of packed documents)."""
    if backend == "fa4":
        return "own" if case.documents else "bshd"
    if backend == "flex" and case.documents:
        return "packed_bhsd"
    return "own"


def to_layout(x, name: str):
    """A case's tensor in layout `name` (a contiguous copy, made once, outside the timing)."""
    if name == "bshd":
        return x.transpose(1, 2).contiguous()
    if name == "packed_bhsd":
        return x.transpose(0, 1)[None].contiguous()
    return x


def from_layout(o, name: str):
    """An output in layout `name` seen in the case's own layout (a view)."""
    if name == "bshd":
        return o.transpose(1, 2)
    if name == "packed_bhsd":
        return o[0].transpose(0, 1)
    return o


def _first(o):
    """FlashAttention-4 returns (out, lse) from some entry points."""
    return o[0] if isinstance(o, tuple) else o


class Peers:
    """The peers as callables (q, k, v) -> o, built once per case."""

    def __init__(self, torch, device: str = "cuda") -> None:
        self.torch = torch
        self.device = device
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        self.F, self.SDPBackend, self.sdpa_kernel = F, SDPBackend, sdpa_kernel
        self._flex = None
        self._masks: dict = {}

    def get(self, backend: str, case: Case, tensors: dict):
        """The callable of `backend` ('fa4', 'flash', 'cudnn', 'flex') for `case`."""
        if backend == "fa4":
            return self.fa4(case)
        if backend in ("flash", "cudnn"):
            return self.sdpa(backend, case.causal, gqa=case.kv_heads != case.heads)
        if backend == "flex":
            return self.flex(case, tensors)
        raise ValueError(f"backends: unknown {backend!r}")

    def sdpa(self, backend: str, causal: bool, gqa: bool = False):
        be = {
            "flash": self.SDPBackend.FLASH_ATTENTION,
            "cudnn": self.SDPBackend.CUDNN_ATTENTION,
            "math": self.SDPBackend.MATH,
        }[backend]
        extra = dict(enable_gqa=True) if gqa else {}

        def fn(q, k, v):
            with self.sdpa_kernel([be]):
                return self.F.scaled_dot_product_attention(q, k, v, is_causal=causal, **extra)

        return fn

    def fa4(self, case: Case):
        """FlashAttention-4's flash_attn_func ([B, S, H, D]) or flash_attn_varlen_func (packed documents)."""
        cute = fa4_module()
        opts = fa4_options(case)
        if not case.documents:
            return lambda q, k, v: _first(cute.flash_attn_func(q, k, v, **opts))
        cu = self.torch.tensor(cu_seqlens(case.documents), dtype=self.torch.int32, device=self.device)
        n = max(case.documents)
        packed = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=n, max_seqlen_k=n)
        return lambda q, k, v: _first(cute.flash_attn_varlen_func(q, k, v, **packed, **opts))

    def _compiled_flex(self):
        from torch.nn.attention.flex_attention import flex_attention

        if self._flex is None:
            self.torch._dynamo.config.cache_size_limit = 1024
            self.torch._dynamo.config.accumulated_cache_size_limit = 4096
            self._flex = self.torch.compile(flex_attention, dynamic=False)
        return self._flex

    def flex(self, case: Case, tensors: dict | None = None):
        """Compiled FlexAttention with the case's mask (a block mask) and score (a score_mod)."""
        block_mask = self._block_mask(case)
        score_mod = _score_mods(self.torch, tensors or {}).get(case.variant)
        flex = self._compiled_flex()
        gqa = case.kv_heads != case.heads
        if gqa:
            return lambda q, k, v: flex(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=True)
        return lambda q, k, v: flex(q, k, v, score_mod=score_mod, block_mask=block_mask)

    def _block_mask(self, case: Case):
        from torch.nn.attention.flex_attention import create_block_mask

        window, prefix = case.variant == "window", case.variant == "prefix"
        if not (case.causal or window or prefix):
            return None
        key = (case.seqlen, case.causal, window, prefix, case.documents)
        if key not in self._masks:
            mask_mod = self._mask_mod(case)
            n = case.seqlen
            self._masks[key] = create_block_mask(mask_mod, None, None, n, n, device=self.device)
        return self._masks[key]

    def _mask_mod(self, case: Case):
        window, prefix = case.variant == "window", case.variant == "prefix"
        left, first = VARIANTS["window"]["window"], VARIANTS["prefix"]["prefix"]
        if case.documents:
            lengths = self.torch.tensor(case.documents, device=self.device)
            doc = self.torch.repeat_interleave(self.torch.arange(len(case.documents), device=self.device), lengths)

            def document(b, h, q_idx, kv_idx):
                return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

            return document

        def mask_mod(b, h, q_idx, kv_idx):
            keep = q_idx >= kv_idx
            if prefix:
                return keep | (kv_idx < first)
            return keep & (q_idx - kv_idx <= left) if window else keep

        return mask_mod


def _score_mods(torch, tensors: dict) -> dict:
    """FlexAttention's score_mod of each variant that has one, reading the variant's tensors."""

    def softcap(score, b, h, q_idx, kv_idx):
        return 30 * torch.tanh(score / 30)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + tensors["slopes"][h] * (kv_idx - q_idx)

    def relative(score, b, h, q_idx, kv_idx):
        return score + tensors["rel"][h, q_idx - kv_idx + RELATIVE_OFFSET]

    return {"softcap": softcap, "alibi": alibi, "relative": relative}
