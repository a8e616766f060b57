"""The user-facing compiled op: `Kernel`, its forward, varlen, decode and backward calls.

CuPy arrays and PyTorch CUDA tensors are both taken without a copy (their device pointers and strides are
passed to the kernel as they are), and the result comes back as the same kind. Any strides work, so
[B, H, N, D] tensors and [B, N, H, D] tensors viewed as [B, H, N, D] run without a copy.

A `Kernel` holds a *plan* (fagen.runtime.plan): the launches that make up the op, in order (one for a forward
or a split-KV decode; a backward has several, with workspaces between them). Each call goes to an op of its
own (fagen.runtime.forward, decode, backward), and every op keeps its prepared calls in the kernel's one
call-shape cache (fagen.runtime.calls): checks and packing run once per call shape; a repeated call only
allocates its outputs, writes the new addresses and launches.

A kernel compiled for a head dim its tiers do not take (any from 8 to 256 is taken: KernelSpec.input_dim) is the
kernel of the next one they take; its ops take arrays of the head dim it was compiled for and pad them with zero
columns (fagen.runtime.pad).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..backend.contract import Kind, TensorArg, as_tensor_arg
from ..backend.spec import KernelSpec, arch_of, runs_on
from .backward import Backward, Gradients
from .calls import CallCache
from .decode import Decode
from .forward import Forward
from .plan import BackwardPlan, Launch, Plan

__all__ = ["Kernel", "Launch", "Plan", "BackwardPlan", "Gradients"]


class Kernel:
    """A compiled attention op. Call it as `kernel(q, k, v, scale=None, return_lse=False)`."""

    _backward_plan: BackwardPlan | None = None

    def __init__(
        self,
        plan: Plan,
        program,
        *,
        default_scale: float,
        tier_reason: str = "",
        fallback: Callable[[], Kernel] | None = None,
        backward: Callable[[], BackwardPlan] | None = None,
        fits: Callable[[dict], str | None] | None = None,
        tensors: tuple[TensorArg | str, ...] = (),
        tensor_index: dict[str, str] | None = None,
        proofs: tuple = (),
    ):
        self.plan = plan
        self._program = program  # a Program, or a callable that parses it when first asked
        self.default_scale = default_scale
        self.tier_reason = tier_reason
        self.proofs = tuple(proofs)  # what the compiler proved for this kernel (fagen ir prints them)
        self._fallback_factory = fallback  # builds the kernel of the fallback tier, for inputs this one cannot take
        self._backward_factory = backward  # builds the backward's plan (or reads it from the cache) on first need
        self._fallback: Kernel | None = None
        self._fits = fits or (lambda a: None)
        self.tensor_args: tuple[TensorArg, ...] = tuple(as_tensor_arg(t) for t in tensors)
        self.tensors = tuple(t.name for t in self.tensor_args)  # call-time tensors the program reads (slopes, ...)
        self.tensor_index = dict(tensor_index or {})  # name -> "h", "b" or "bh", or its reads in text
        self.captured: dict = {}  # name -> (function, variants.Captured): tensors a traced function captured
        self.capture_roles: dict = {}  # name -> ("mask" or "score_mod", variants.Captured)
        self._calls = CallCache()  # the prepared calls of every op, by call shape
        self._forward = Forward(self, self._calls)
        self._decode = Decode(self, self._calls)
        self._backward = Backward(self, self._calls)

    # --- what users read ---
    @property
    def launch(self) -> Launch:
        return self.plan.launches[0]

    @property
    def spec(self) -> KernelSpec:
        return self.launch.spec

    @property
    def source(self) -> str:
        return self.launch.source

    @property
    def binary(self):
        return self.launch.binary

    @property
    def smem_bytes(self) -> int:
        return self.launch.smem_bytes

    @property
    def program(self):
        if callable(self._program):
            self._program = self._program()
        return self._program

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def resources(self):
        return self.binary.resources

    @property
    def compile_seconds(self) -> float:
        return self.binary.compile_seconds

    @property
    def block_sparse(self) -> bool:
        """Whether this kernel reads a block mask (compiled with block_sparse=True)."""
        return self.spec.kind is Kind.FORWARD_SPARSE

    def __repr__(self):
        return f"<fagen.Kernel {self.name} ({self.spec.tier} tier: {self.tier_reason}): {self.resources}>"

    def save(self, path) -> Path:
        """Write the kernel: .cu (the source), .cubin (the binary) or .ptx, by the file's suffix."""
        path = Path(path)
        if path.suffix == ".cubin":
            path.write_bytes(self.binary.cubin)
        elif path.suffix == ".ptx":
            from ..backend.build import compile_ptx

            path.write_text(compile_ptx(self.source, self.spec))
        elif path.suffix == ".cu":
            path.write_text(self.source)
        else:
            raise ValueError(f"path: expected a .cu, .ptx or .cubin file name, got {str(path)!r}")
        return path

    # --- calling ---
    def __call__(
        self,
        q,
        k,
        v,
        *,
        scale: float | None = None,
        return_lse: bool = False,
        out=None,
        out_lse=None,
        block_mask=None,
        **tensors,
    ):
        """Attention of q [B, H, M, D] over k, v [B, Hkv, N, D]; `tensors` the program reads, by name.
        Returns o (and lse [B, H, M], float32, natural log) as the same kind of array as q.

        A kernel compiled with block_sparse=True takes `block_mask` (fagen.create_block_mask's, made from this
        kernel's mask for these B, H, M, N): it visits only the key tiles the block mask lists, built at this
        kernel's tiles on first use and kept in the block mask. Its backward visits, for each key tile, only the
        query tiles the block mask's transposed table lists (Kernel.backward's block_mask).

        With PyTorch tensors that require grad (and grad mode on), o carries a grad_fn whose backward is this
        kernel's `backward` (fagen.runtime.autograd); lse is then returned as a constant (no gradient flows
        through it), and out=/out_lse= are refused."""
        return self._forward(q, k, v, scale, return_lse, out, out_lse, block_mask, tensors)

    def varlen(
        self,
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q: int,
        max_seqlen_k: int,
        *,
        scale: float | None = None,
        return_lse: bool = False,
        validate: bool | None = None,
        **tensors,
    ):
        """FlashAttention's variable-length convention: q [total_q, H, D], k, v [total_k, Hkv, D] packed;
        sequence i is rows [cu_seqlens[i], cu_seqlens[i + 1]) (int32, B + 1 entries). Masks apply within each
        sequence. Returns o [total_q, H, D] (and lse [H, total_q]).

        The contract is FlashAttention's: offsets non-decreasing, within the packed totals, and no sequence
        longer than max_seqlen. The kernel clamps every offset to the packed arrays, so bad offsets never
        read or write outside them; rows of a sequence beyond max_seqlen_q, and rows outside every sequence,
        are left unwritten. `validate=True` (or FAGEN_VALIDATE=1 in the environment) checks the offsets on
        the host first, which synchronizes, and raises a clear error instead.

        PyTorch tensors that require grad get an o with a grad_fn (the kernel's `varlen_backward`), as with
        a call.
        """
        sizes = (max_seqlen_q, max_seqlen_k)
        return self._forward.varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *sizes, scale, return_lse, validate, tensors)

    def decode(
        self,
        q,
        k_cache,
        v_cache,
        cache_seqlens,
        *,
        block_table=None,
        k_new=None,
        v_new=None,
        num_splits=None,
        scale: float | None = None,
        return_lse: bool = False,
        out=None,
        out_lse=None,
        **tensors,
    ):
        """Split-KV decode over a KV cache, flash_attn_with_kvcache's conventions. q [B, q_len, H, D];
        cache_seqlens [B] int32, the keys already cached per sequence.

        Caches: contiguous k_cache, v_cache [B, Nmax, Hkv, D] (sequence b's keys are rows [0, cache_seqlens[b])),
        or paged with block_table [B, max_pages] int32: k_cache, v_cache [num_pages, page_size, Hkv, D], key n of
        sequence b in row n % page_size of page block_table[b, n // page_size] (vLLM's layout; any page_size >= 1,
        pages in any order, shared or not). Only the pages of the keys the mask lets a row see are read.

        Append: k_new, v_new [B, seqlen_new, Hkv, D] are written into the caches at positions
        cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1 (through block_table when paged) within the same
        call, and attention covers cache_seqlens[b] + seqlen_new keys, the new ones last (FlashAttention's k=,
        v=). cache_seqlens itself is not updated: add seqlen_new yourself, as with FlashAttention. A length past
        the cache's capacity (Nmax, or max_pages * page_size) is clamped to it, so nothing is read or written
        outside the cache; page ids are clamped to [0, num_pages).

        A causal mask is aligned bottom-right: token i of q_len sees keys <= seqlen_k - q_len + i.
        num_splits: an int, or 'flash' (default; FlashAttention's wave-efficiency heuristic over this GPU's SMs)
        or 'flex' (FlexDecoding's 2 x SMs / (B x Hkv)). Returns o [B, q_len, H, D] (and lse [B, H, q_len]).

        The float32 workspace is allocated once per call shape and stream (splits sized from the capacity, not
        from the lengths), so a call captures into a CUDA graph, and calls on two streams at once never share it."""
        new = (block_table, k_new, v_new, num_splits)
        return self._decode(q, k_cache, v_cache, cache_seqlens, *new, scale, return_lse, out, out_lse, tensors)

    # --- the backward ---
    @property
    def has_backward(self) -> bool:
        """Whether this kernel can compute gradients (Kernel.backward); a decode kernel cannot."""
        return self._backward_factory is not None and not self.plan.decode

    @property
    def backward_plan(self) -> BackwardPlan:
        """The backward's kernels, built (rendered, compiled) on first use: forward-only users pay nothing."""
        if self._backward_plan is None:
            if self._backward_factory is None or not self.has_backward:
                raise TypeError(f"kernel {self.name} has no backward (a decode kernel, or one built without it)")
            self._backward_plan = self._backward_factory()
        return self._backward_plan

    def backward(
        self,
        q,
        k,
        v,
        o,
        lse,
        do,
        *,
        scale: float | None = None,
        deterministic: bool = False,
        tensor_grads: bool = True,
        block_mask=None,
        float32_dkv: bool = False,
        **tensors,
    ) -> Gradients:
        """Gradients of attention: q [B, H, M, D], k, v [B, Hkv, N, D] (the strides the forward takes), o and do
        like q, lse [B, H, M] float32 (natural log, from kernel(..., return_lse=True)). Returns Gradients(dq, dk,
        dv, tensors) as the same kind of array as q; `tensors` holds the float32 gradient of each call-time tensor
        the score reads. deterministic=True: bitwise equal results across runs (dQ by a query-tile kernel
        instead of atomics, and the tensor gradients' row sums by it too). tensor_grads=False: no gradient of a
        tensor read as name[h], name[b] or name[b, h] (`tensors` leaves them out), and the main kernel skips their sums.

        A kernel compiled with block_sparse=True takes the forward's `block_mask`: the main kernel then visits, for
        each key tile, only the query tiles its transposed table lists (built at the backward's tiles on first use
        and kept in the block mask, per stream), evaluating no mask on full ones; the dense main kernel runs
        instead (the same gradients, every tile of the proven ranges visited) in deterministic mode, where tensor
        gradients are asked for, and on a tier without one (the mma and simt tiers, inputs TMA cannot describe).

        float32_dkv=True: dk, dv come out in float32 (k's and v's shapes; views of wider arrays where the kernel pads
        the head dim), the kernel's float32 sums as they are, for a caller that sums them over several calls
        (fagen.ring) and rounds once.

        The float32 workspaces (D, the dQ accumulator, the tensor-gradient partials: O(B H (M D + N))) are
        allocated once per call shape and stream, so calls on two streams at once never share them."""
        return self._backward(
            q, k, v, o, lse, do, scale, deterministic, tensor_grads, tensors, block_mask, float32_dkv=float32_dkv
        )

    def varlen_backward(
        self,
        q,
        k,
        v,
        o,
        lse,
        do,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q: int,
        max_seqlen_k: int,
        *,
        scale: float | None = None,
        deterministic: bool = False,
        tensor_grads: bool = True,
        **tensors,
    ) -> Gradients:
        """Kernel.backward in FlashAttention's variable-length convention (Kernel.varlen's): q, o, do
        [total_q, H, D], k, v [total_k, Hkv, D] packed, lse [H, total_q]. Returns Gradients with dq, dk, dv packed
        like q, k, v (rows outside every sequence are 0 where the offsets keep the contract, Kernel.varlen's)."""
        varlen = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        return self._backward.varlen(q, k, v, o, lse, do, *varlen, scale, deterministic, tensor_grads, tensors)

    # --- what the ops ask of their kernel ---
    def backward_rows(self, q, k, v, o, lse, do, *, scale=None, deterministic=False, float32_dkv=False, **tensors):
        """Kernel.backward for a caller that splits each query row's keys over several calls (fagen.ring): the
        gradients of the tensors read as name[h] / [b] / [b, h] left uncorrected, and the row sums that correct
        them (backward.RowSums; None where no such tensor is read), to be summed over the calls of a row and
        applied once (backward.corrected)."""
        rows: list = []
        g = self._backward(q, k, v, o, lse, do, scale, deterministic, True, tensors, None, rows, float32_dkv)
        return g, (rows[0] if rows else None)

    def with_captured(self, given: dict) -> dict:
        """The call's tensors with each captured tensor's current object added (a tensor passed by name wins)."""
        return {**{n: c.value(fn) for n, (fn, c) in self.captured.items()}, **given}

    def why_not(self, described: dict) -> str | None:
        """Why this kernel's tier cannot take these arrays (by name, described), or None when it can."""
        return self._fits(described)

    def target(self, described: dict) -> Kernel:
        """This kernel, or its fallback tier's when the inputs do not fit this one."""
        why_not = self._fits(described)
        return self if why_not is None else self.fallback_tier(why_not).target(described)

    def fallback_tier(self, why: str = "asked for") -> Kernel:
        """The kernel of the fallback tier (built on first need)."""
        if self._fallback is None:
            if self._fallback_factory is None:
                raise ValueError(f"kernel {self.name}: {why}, and no fallback tier is available")
            self._fallback = self._fallback_factory()
        return self._fallback

    def check_arch(self, major: int, minor: int, device: int) -> None:
        """Refuse a device whose compute capability cannot run this kernel's binary (on its first launch there)."""
        if not runs_on(self.spec.arch, major, minor):
            raise ValueError(
                f"kernel {self.name} was compiled for {self.spec.arch}; device {device} has compute capability "
                f"{major}.{minor}: compile with arch={arch_of(major, minor)!r}"
            )
