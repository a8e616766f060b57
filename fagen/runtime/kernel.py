"""The user-facing compiled op: checks its arguments, allocates outputs and launches its plan.

CuPy arrays and PyTorch CUDA tensors are both taken without a copy (their device pointers and strides are
passed to the kernel as they are), and the result comes back as the same kind. Any strides work, so
[B, H, N, D] tensors and [B, N, H, D] tensors viewed as [B, H, N, D] run without a copy.

A `Kernel` holds a *plan*: the launches that make up the op, in order (one for a forward or a split-KV decode;
a backward has several, with workspaces between them). Each launch's arguments are packed from its kind's
declared parameter list. Checks and packing run once per call shape; a repeated call only allocates its
outputs, writes the new addresses and launches.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from ..backend.contract import LOG2E, Kind, Param, TensorArg, as_tensor_arg
from ..backend.spec import KernelSpec
from . import arrays
from .arrays import Array, describe
from .launch import ArgPack, Function


@dataclass(frozen=True)
class Launch:
    """One kernel of a plan: what was compiled, and its parameter list."""

    spec: KernelSpec
    source: str
    binary: object  # fagen.backend.build.Binary
    smem_bytes: int
    params: tuple[Param, ...]
    threads: int
    # forward: (batch, heads, seqlen_q) -> grid; decode kinds: (batch, kv_heads, rows, num_splits) -> grid
    grid: Callable[..., tuple[int, int, int]]
    function: Function = field(init=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "function", Function(self.binary.cubin, self.spec.name, self.smem_bytes))


@dataclass(frozen=True)
class Plan:
    """The launches of an op, in order, and the workspaces they use (none for a forward; a decode's split kernel
    has ws_acc and ws_ml, float32, and split_count, int32, sized per call shape from its maxima)."""

    launches: tuple[Launch, ...]
    workspaces: tuple = ()
    blocks_per_sm: int = 1  # resident blocks per SM of the first launch, for the split-count heuristic

    @property
    def decode(self) -> bool:
        return self.launches[0].spec.kind is Kind.DECODE_SPLIT


class Gradients(NamedTuple):
    """What Kernel.backward returns: dq, dk, dv with q's, k's and v's shapes and dtype (GQA: dk, dv summed over each
    group's query heads), and the float32 gradient of each call-time float tensor the score reads, by name."""

    dq: object
    dk: object
    dv: object
    tensors: dict


@dataclass(frozen=True)
class BackwardPlan:
    """The backward's launches (FlashAttention-2's split; fagen.backend.contract's BWD kinds) and the call-time
    tensors whose gradients it computes, as (name, index) in the order of the dtensor workspace's slots."""

    preprocess: Launch
    main: Launch
    convert: Launch
    dq: Launch  # the deterministic mode's dQ kernel
    main_grads: Launch | None = None  # the main kernel that also sums `gradients` (run when they are asked for)
    gradients: tuple[tuple[str, str], ...] = ()
    proofs: tuple[str, ...] = ()
    scatters: tuple[str, ...] = ()  # gathered float tensors: their gradients scatter-added by atomics


class Kernel:
    """A compiled attention op. Call it as `kernel(q, k, v, scale=None, return_lse=False)`."""

    _backward_factory: Callable[[], BackwardPlan] | None = None  # set by the pipeline: builds the backward
    _backward_plan: BackwardPlan | None = None

    def __init__(
        self,
        plan: Plan,
        program,
        *,
        default_scale: float,
        tier_reason: str = "",
        fallback: Callable[[], Kernel] | None = None,
        fits: Callable[[dict], str | None] | None = None,
        tensors: tuple[str, ...] = (),
        tensor_index: dict[str, str] | None = None,
        proofs: tuple = (),
    ):
        self.plan = plan
        self._program = program  # a Program, or a callable that parses it when first asked
        self.default_scale = default_scale
        self.tier_reason = tier_reason
        self.proofs = tuple(proofs)  # what the compiler proved for this kernel (fagen ir prints them)
        self._fallback_factory = fallback  # builds the kernel of the fallback tier, for inputs this one cannot take
        self._fallback: Kernel | None = None
        self._fits = fits or (lambda a: None)
        self.tensor_args: tuple[TensorArg, ...] = tuple(as_tensor_arg(t) for t in tensors)
        self.tensors = tuple(t.name for t in self.tensor_args)  # call-time tensors the program reads (slopes, ...)
        self.tensor_index = dict(tensor_index or {})  # name -> "h", "b" or "bh", or its reads in text
        self.captured: dict = {}  # name -> (function, variants.Captured): tensors a traced function captured
        self.capture_roles: dict = {}  # name -> ("mask" or "score_mod", variants.Captured)
        self._calls: dict = {}
        self._captured_calls: list = []  # decode calls captured into CUDA graphs: their workspaces live on

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

    def _check_arch(self, major: int, minor: int, device: int):
        arch = self.spec.arch
        want_major, want_minor = int(arch[3]), int(arch[4])
        ok = major == want_major and minor >= want_minor and (not arch.endswith("a") or minor == want_minor)
        if not ok:
            raise ValueError(
                f"kernel {self.name} was compiled for {arch}; device {device} has compute capability "
                f"{major}.{minor}: compile with arch='sm_{major}{minor}{'a' if major >= 9 else ''}'"
            )

    # --- calling ---
    @property
    def block_sparse(self) -> bool:
        """Whether this kernel reads a block mask (compiled with block_sparse=True)."""
        return self.spec.kind is Kind.FORWARD_SPARSE

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
        kernel's tiles on first use and kept in the block mask. It has no backward (fagen.flex_attention
        runs inputs that require grad through the dense kernel).

        With PyTorch tensors that require grad (and grad mode on), o carries a grad_fn whose backward is this
        kernel's `backward` (fagen.runtime.autograd); lse is then returned as a constant (no gradient flows
        through it), and out=/out_lse= are refused."""
        if self.plan.decode:
            raise TypeError(f"kernel {self.name} was compiled with decode=True: call kernel.decode(...)")
        if getattr(self, "captured", None):
            tensors = self.with_captured(tensors)
        if getattr(self, "block_sparse", False):  # (test doubles of a Kernel have no such property)
            if block_mask is None:
                raise TypeError(
                    f"block_mask: kernel {self.name} was compiled with block_sparse=True; pass "
                    "block_mask=fagen.create_block_mask(...)"
                )
            if arrays.library(q) == "torch" and _requires_grad(q, k, v, tensors):
                raise NotImplementedError(
                    "block_mask: a block-sparse forward has no backward yet; call the kernel compiled without "
                    "block_sparse (fagen.flex_attention does) or pass .detach()ed tensors"
                )
        elif block_mask is not None:
            raise TypeError(f"block_mask: kernel {self.name} reads no block mask; compile it with block_sparse=True")
        if arrays.library(q) == "torch" and _wants_grad(self, q, k, v, tensors):
            from .autograd import attention_with_grad

            if out is not None or out_lse is not None:
                raise ValueError("out, out_lse: not with inputs that require grad (autograd owns its outputs)")
            o, lse = attention_with_grad(self, q, k, v, scale, tensors)
            return (o, lse) if return_lse else o
        key = _call_key(q, k, v, out, out_lse, tensors)
        if block_mask is not None:
            key = (key, _block_mask_shape(block_mask))
        entry = self._calls.get(key)
        if entry is None:
            entry = self._prepare(q, k, v, out, out_lse, tensors, block_mask)
            if len(self._calls) > 256:
                self._calls.clear()
            self._calls[key] = entry
        o = out if out is not None else entry.new_o()
        # lse is always written; when the caller does not want it, into a scratch buffer of this call shape
        lse = out_lse if out_lse is not None else entry.new_lse() if return_lse else entry.scratch_lse
        blocks = ()
        if block_mask is not None:
            tiles = entry.block_tiles(block_mask)
            blocks = (_ptr(tiles.kv_count), _ptr(tiles.kv_list))
        entry.run(
            _ptr(q),
            _ptr(k),
            _ptr(v),
            _ptr(o),
            _ptr(lse),
            (self.default_scale if scale is None else _scale(scale)) * LOG2E,
            [_ptr(tensors[name]) for name in self.tensors],
            blocks,
        )
        return (o, lse) if return_lse else o

    def _prepare(self, q, k, v, out, out_lse, tensors, block_mask=None) -> _Call:
        tq, tk, tv = describe("q", q), describe("k", k), describe("v", v)
        self._check(tq, tk, tv)
        B, H, M, _ = tq.shape
        shape_o, shape_l = tq.shape, tq.shape[:3]
        o = self._output("out", out, tq, shape_o, float32=False) if out is not None else arrays.empty(tq, shape_o)
        lse = (
            self._output("out_lse", out_lse, tq, shape_l, float32=True)
            if out_lse is not None
            else arrays.empty(tq, shape_l, float32=True)
        )
        extra = self._tensors(tensors, tq, B, H, M, tk.shape[2])
        all_arrays = dict(q=tq, k=tk, v=tv, o=describe("out", o), lse=describe("out_lse", lse))
        target = self._target(all_arrays)
        static = _static_values(all_arrays, H // tk.shape[1], M, tk.shape[2], varlen=None)
        call = _Call(target, static, B, H, M, tq, shape_o, shape_l, extra, all_arrays)
        if block_mask is not None:
            call.bind_block_mask(block_mask, B, H, M, tk.shape[2])
        return call

    def _target(self, all_arrays: dict) -> Kernel:
        """This kernel, or its fallback tier's when the inputs do not fit this one."""
        why_not = self._fits(all_arrays)
        return self if why_not is None else self._target_fallback(why_not)._target(all_arrays)

    def _target_fallback(self, why: str = "asked for") -> Kernel:
        """The kernel of the fallback tier (built on first need)."""
        if self._fallback is None:
            if self._fallback_factory is None:
                raise ValueError(f"kernel {self.name}: {why}, and no fallback tier is available")
            self._fallback = self._fallback_factory()
        return self._fallback

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
        if self.plan.decode:
            raise TypeError(f"kernel {self.name} was compiled with decode=True: call kernel.decode(...)")
        if getattr(self, "block_sparse", False):
            raise TypeError(f"kernel {self.name} reads a block mask of [B, H, M, N] inputs: it has no varlen call")
        if getattr(self, "captured", None):
            tensors = self.with_captured(tensors)
        if arrays.library(q) == "torch" and _wants_grad(self, q, k, v, tensors):
            from .autograd import varlen_with_grad

            o, lse = varlen_with_grad(
                self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, validate, tensors
            )
            return (o, lse) if return_lse else o
        for name, x in (("q", q), ("k", k), ("v", v)):
            if len(getattr(x, "shape", ())) != 3:
                raise ValueError(
                    f"{name}: expected 3 dimensions [total, heads, D] for varlen, got shape "
                    f"{tuple(getattr(x, 'shape', ()))}"
                )
        views = [arrays.as_bhsd(x) for x in (q, k, v)]  # [total, H, D] viewed as [1, H, total, D]: no copy
        tq, tk, tv = (describe(n, x) for n, x in zip("qkv", views))
        self._check(tq, tk, tv)
        cq, ck = describe("cu_seqlens_q", cu_seqlens_q), describe("cu_seqlens_k", cu_seqlens_k)
        _check_offsets(tq, cq, ck, max_seqlen_q, max_seqlen_k)
        totals = (tq.shape[2], tk.shape[2])
        if validate or (validate is None and os.environ.get("FAGEN_VALIDATE", "") not in ("", "0")):
            _validate_offsets(cu_seqlens_q, cu_seqlens_k, totals, (max_seqlen_q, max_seqlen_k))
        B, H = cq.shape[0] - 1, tq.shape[1]
        o4 = arrays.empty(tq, tq.shape)
        lse = arrays.empty(tq, (H, tq.shape[2]), float32=True)
        lse4 = lse[None]
        all_arrays = dict(q=tq, k=tk, v=tv, o=describe("out", o4), lse=describe("out_lse", lse4))
        extra = self._tensors(tensors, tq, B, H, max_seqlen_q, max_seqlen_k)
        target = self._target({**all_arrays, "cu_seqlens_q": cq, "cu_seqlens_k": ck})
        static = _static_values(all_arrays, H // tk.shape[1], max_seqlen_q, max_seqlen_k, varlen=(cq, ck))
        call = _Call(target, static, B, H, max_seqlen_q, tq, tq.shape, tq.shape[:3], extra, all_arrays)
        call.run(
            *(all_arrays[n].ptr for n in ("q", "k", "v", "o", "lse")),
            (self.default_scale if scale is None else _scale(scale)) * LOG2E,
            [extra[name].ptr for name in self.tensors],
        )
        o = arrays.from_bhsd(o4)
        return (o, lse) if return_lse else o

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
        if not self.plan.decode:
            raise TypeError(f"kernel {self.name} is a forward: compile with decode=True for kernel.decode(...)")
        if getattr(self, "captured", None):
            tensors = self.with_captured(tensors)
        named = {**tensors, "cache_seqlens": cache_seqlens, "block_table": block_table, "k_new": k_new, "v_new": v_new}
        stream = arrays.current_stream(q)  # a workspace per stream: calls on two streams may overlap
        key = (_call_key(q, k_cache, v_cache, out, out_lse, named), num_splits, stream)
        # a call captured into a CUDA graph gets a workspace of its own, whose split counts the graph zeroes (the
        # fill is captured before the launch): a cached one could be shared with eager calls or other graphs, and one
        # made inside a capture is not zeroed until the graph first replays
        capturing = stream is not None and _capturing(stream)
        entry = None if capturing else self._calls.get(key)
        if entry is None:
            entry = _DecodeCall(
                self, q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, num_splits, tensors, out, out_lse
            )
            if capturing:
                self._captured_calls.append(entry)
            else:
                if len(self._calls) > 256:
                    self._calls.clear()
                self._calls[key] = entry
        if entry.torch:
            _no_grad(
                q, k_cache, v_cache, {**tensors, **({"k_new": k_new, "v_new": v_new} if k_new is not None else {})}
            )
        o = out if out is not None else entry.new_o()
        lse = out_lse if out_lse is not None else entry.new_lse() if return_lse else entry.scratch_lse
        entry.run(
            _ptr(q),
            _ptr(k_cache),
            _ptr(v_cache),
            _ptr(cache_seqlens),
            0 if block_table is None else _ptr(block_table),
            0 if k_new is None else _ptr(k_new),
            0 if v_new is None else _ptr(v_new),
            _ptr(o),
            _ptr(lse),
            (self.default_scale if scale is None else _scale(scale)) * LOG2E,
            [_ptr(tensors[name]) for name in self.tensors],
            stream,
        )
        return (o, lse) if return_lse else o

    # --- the backward ---
    @property
    def has_backward(self) -> bool:
        """Whether this kernel can compute gradients (Kernel.backward); a decode kernel cannot."""
        return self._backward_factory is not None and not self.plan.decode

    @property
    def backward_plan(self) -> BackwardPlan:
        """The backward's kernels, built (rendered, compiled) on first use: forward-only users pay nothing."""
        if self._backward_plan is None:
            if not self.has_backward:
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
        **tensors,
    ):
        """Gradients of attention: q [B, H, M, D], k, v [B, Hkv, N, D] (the strides the forward takes), o and do
        like q, lse [B, H, M] float32 (natural log, from kernel(..., return_lse=True)). Returns Gradients(dq, dk,
        dv, tensors) as the same kind of array as q; `tensors` holds the float32 gradient of each call-time tensor
        the score reads. deterministic=True: bitwise equal results across runs (dQ by a query-tile kernel
        instead of atomics, and the tensor gradients' row sums by it too). tensor_grads=False: no gradient of a
        tensor read as name[h], name[b] or name[b, h] (`tensors` leaves them out), and the main kernel skips their sums.

        The float32 workspaces (D, the dQ accumulator, the tensor-gradient partials: O(B H (M D + N))) are
        allocated once per call shape and stream, so calls on two streams at once never share them."""
        _check_flag("deterministic", deterministic)
        _check_flag("tensor_grads", tensor_grads)
        if getattr(self, "captured", None):
            tensors = self.with_captured(tensors)
        stream = arrays.current_stream(q)  # workspaces per stream: calls on two streams may overlap
        key = (_call_key(q, k, v, o, lse, tensors), _call_key(do, None, None, None, None, {}), bool(deterministic))
        key = ("backward", key, stream)
        entry = self._calls.get(key)
        if entry is None:
            target = self._backward_target(q, k, v, do)
            entry = _BackwardCall(target, q, k, v, o, lse, do, tensors, deterministic, varlen=None)
            if len(self._calls) > 256:
                self._calls.clear()
            self._calls[key] = entry
        return entry.run(q, k, v, o, lse, do, self._scale_log2(scale), tensors, tensor_grads, stream)

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
    ):
        """Kernel.backward in FlashAttention's variable-length convention (Kernel.varlen's): q, o, do
        [total_q, H, D], k, v [total_k, Hkv, D] packed, lse [H, total_q]. Returns Gradients with dq, dk, dv packed
        like q, k, v (rows outside every sequence are 0)."""
        _check_flag("deterministic", deterministic)
        _check_flag("tensor_grads", tensor_grads)
        if getattr(self, "captured", None):
            tensors = self.with_captured(tensors)
        for name, x in (("q", q), ("k", k), ("v", v), ("o", o), ("do", do)):
            if len(getattr(x, "shape", ())) != 3:
                raise ValueError(
                    f"{name}: expected 3 dimensions [total, heads, D] for varlen, got shape "
                    f"{tuple(getattr(x, 'shape', ()))}"
                )
        if len(getattr(lse, "shape", ())) != 2:
            raise ValueError(
                f"lse: expected 2 dimensions [H, total_q] for varlen, got {tuple(getattr(lse, 'shape', ()))}"
            )
        q4, k4, v4, o4, do4 = (arrays.as_bhsd(x) for x in (q, k, v, o, do))
        views = [q4, k4, v4, o4, lse[None], do4]  # Kernel.backward's order: q, k, v, o, lse, do
        cq, ck = describe("cu_seqlens_q", cu_seqlens_q), describe("cu_seqlens_k", cu_seqlens_k)
        tq = describe("q", views[0])
        _check_offsets(tq, cq, ck, max_seqlen_q, max_seqlen_k)
        target = self._backward_target(q4, k4, v4, do4)
        entry = _BackwardCall(target, *views, tensors, deterministic, varlen=(cq, ck, max_seqlen_q, max_seqlen_k))
        g = entry.run(*views, self._scale_log2(scale), tensors, tensor_grads)
        return Gradients(arrays.from_bhsd(g.dq), arrays.from_bhsd(g.dk), arrays.from_bhsd(g.dv), g.tensors)

    def _backward_target(self, q, k, v, do) -> Kernel:
        """This kernel, or its fallback tier's, whose backward's main kernel takes these arrays (the wgmma tier's
        reads q, k, v and do by TMA)."""
        from ..backend import tiers

        given = {n: describe(n, x) for n, x in (("q", q), ("k", k), ("v", v), ("dout", do))}
        why_not = tiers.get(self.backward_plan.main.spec.tier).backward_fits(given)
        return self if why_not is None else self._target_fallback(why_not)._backward_target(q, k, v, do)

    def _scale_log2(self, scale) -> float:
        return (self.default_scale if scale is None else _scale(scale)) * LOG2E

    # --- checks (once per call shape) ---
    def with_captured(self, given: dict) -> dict:
        """The call's tensors with each captured tensor's current object added (a tensor passed by name wins)."""
        return {**{n: c.value(fn) for n, (fn, c) in self.captured.items()}, **given}

    def _tensors(self, given: dict, tq: Array, B: int, H: int, M: int = 0, N: int = 0) -> dict[str, Array]:
        """The call-time tensors, checked against what the kernel was compiled for: on q's device, of its
        library, the compiled dtype and rank, no empty dimension; a per-head / per-batch vector (name[h],
        name[b]) of H / B entries; a dimension every read indexes by a bare b, h, q or k of size 1 (broadcast)
        or at least B, H, M, N. Any strides (0: broadcast). The kernels clamp every index to the tensor, so
        sizes never make a read leave it."""
        from ..backend.contract import tensor_dtype

        missing = [n for n in self.tensors if n not in given]
        unknown = [n for n in given if n not in self.tensors]
        if unknown:
            raise TypeError(
                f"{unknown[0]}: this kernel takes no tensor of that name "
                f"(it takes: {', '.join(self.tensors) or 'none'})"
            )
        if missing:
            raise TypeError(f"{missing[0]}: this kernel's program reads {missing[0]}[...]; pass {missing[0]}=...")
        out = {}
        extent = {"b": ("batch", B), "h": ("heads", H), "q": ("queries", M), "k": ("keys", N)}
        for arg in self.tensor_args:
            name = arg.name
            t = describe(name, given[name])
            if t.kind != tq.kind or t.device != tq.device:
                raise TypeError(f"{name}: expected a {tq.kind} array on device {tq.device}")
            dtype = tensor_dtype(t.dtype_name, name)
            if dtype != arg.dtype:
                raise TypeError(
                    f"{name}: dtype {t.dtype_name} differs from the compiled {arg.dtype}; pass a {arg.dtype} tensor "
                    f"or compile with tensor_dtypes={{{name!r}: {t.dtype_name!r}}}"
                )
            if len(t.shape) != arg.rank:
                raise ValueError(f"{name}: the program reads it with {arg.rank} indices; got shape {t.shape}")
            if 0 in t.shape:
                raise ValueError(f"{name}: empty tensor (shape {t.shape}); every dimension must be at least 1")
            slot = self.tensor_index.get(name)
            if arg.rank == 1 and slot in ("h", "b"):
                what, want = extent[slot]
                if t.shape[0] != want:
                    raise ValueError(
                        f"{name}: expected a vector of {want} ({what}), got shape {t.shape} {t.dtype_name}"
                    )
            for d, (size, index) in enumerate(zip(t.shape, arg.dims)):
                if index in extent and extent[index][1] and size != 1 and size < extent[index][1]:
                    what, want = extent[index]
                    raise ValueError(
                        f"{name}: dimension {d} is indexed by {index}, so it needs 1 (broadcast) or at least {want} "
                        f"entries ({what}); got shape {t.shape}"
                    )
            out[name] = t
        return out

    def _check(self, tq: Array, tk: Array, tv: Array):
        spec = self.spec
        for t, name in ((tq, "q"), (tk, "k"), (tv, "v")):
            if len(t.shape) != 4:
                raise ValueError(
                    f"{name}: expected 4 dimensions [B, H, {'M' if name == 'q' else 'N'}, D], got shape {t.shape}"
                )
            if 0 in t.shape:
                raise ValueError(f"{name}: empty tensor (shape {t.shape}); every dimension must be at least 1")
            if t.shape[3] != spec.head_dim:
                raise ValueError(
                    f"{name}: head dim {t.shape[3]} differs from the compiled head_dim {spec.head_dim}; "
                    f"compile a kernel with dim={t.shape[3]}"
                )
            if t.dtype != spec.dtype:
                raise TypeError(f"{name}: dtype {t.dtype_name} differs from the compiled dtype {spec.dtype}")
        if not (tq.kind == tk.kind == tv.kind):
            raise TypeError(f"q, k, v: mix of array libraries ({tq.kind}, {tk.kind}, {tv.kind}); pass one kind")
        if not (tq.device == tk.device == tv.device):
            raise ValueError(f"q, k, v: on different devices ({tq.device}, {tk.device}, {tv.device})")
        if not (tq.shape[0] == tk.shape[0] == tv.shape[0]):
            raise ValueError(f"q, k, v: batch sizes differ ({tq.shape[0]}, {tk.shape[0]}, {tv.shape[0]})")
        if tk.shape[:3] != tv.shape[:3]:
            raise ValueError(f"k, v: shapes {tk.shape} and {tv.shape} differ in [B, H, N]")
        if tq.shape[1] % tk.shape[1]:
            raise ValueError(f"q, k: query heads {tq.shape[1]} must be a multiple of key/value heads {tk.shape[1]}")
        if tq.shape[0] > 65535 or tq.shape[1] > 65535:
            raise ValueError(f"q: batch and heads must each be at most 65535, got shape {tq.shape}")
        if max(tq.shape[2], tk.shape[2]) >= 2**31:
            raise ValueError("q, k: sequence lengths must be below 2^31")

    def _output(self, name, x, like: Array, shape, float32: bool):
        t = describe(name, x)
        want = "f32" if float32 else self.spec.dtype
        if t.kind != like.kind or t.device != like.device:
            raise TypeError(f"{name}: expected a {like.kind} array on device {like.device}")
        if t.shape != tuple(shape):
            raise ValueError(f"{name}: expected shape {tuple(shape)}, got {t.shape}")
        if t.dtype != want:
            raise TypeError(f"{name}: expected dtype {want}, got {t.dtype_name}")
        return x


class _Call:
    """A prepared call shape: the target kernel's launch with its static arguments already packed, so that a
    call only allocates its outputs, writes five addresses and the scale, and launches."""

    def __init__(
        self, target: Kernel, static: dict, B, H, M, like: Array, shape_o, shape_l, extra: dict, described: dict
    ):
        from ..backend import tiers
        from ..backend.contract import c_tensor_name

        self.launch = target.launch
        self.check_arch = target._check_arch
        self.c_names = {n: c_tensor_name(n) for n in target.tensors}
        self.pack = ArgPack(self.launch.params)
        tier = tiers.get(self.launch.spec.tier)
        self.grid, grid_values = tier.launch_grid(self.launch.spec, self.launch.grid(B, H, M), like.device)
        dynamic = ("q", "k", "v", "o", "lse", "scale_log2", *self.c_names.values())
        sparse = self.launch.spec.kind is Kind.FORWARD_SPARSE
        blocks = ("kv_count", "kv_list") if sparse else ()
        # the block mask's strides are written by bind_block_mask, before the first launch
        strides = {p.name: 0 for p in self.launch.params if p.name.startswith(("kv_count_stride", "kv_list_stride"))}
        # a persistent kernel's blocks draw work tiles from a counter that must be zero when a launch starts (its last
        # block sets it back to zero): one per stream for calls (launches on one stream never overlap), allocated
        # zeroed on the stream's first call; a launch captured into a CUDA graph gets a counter of its own, zeroed by
        # the graph itself (its fill is captured before the launch), so that no eager call and no other graph, on
        # whatever stream they replay, shares it
        counted = any(p.name == "tile_counter" for p in self.launch.params)
        self.pack.set(
            {
                **static,
                **tensor_values(target.tensor_args, extra),
                **strides,
                **grid_values,
                **{n: 0 for n in (*dynamic, *blocks)},
                **({"tile_counter": 0} if counted else {}),
            }
        )
        self.slots = [self.pack.values[self.pack.index[n]] for n in dynamic]
        self.counter_slot = self.pack.values[self.pack.index["tile_counter"]] if counted else None
        self.counters: dict = {}  # stream -> its counter
        self.captured_counters: list = []  # the counters of captured launches, alive as long as this call shape
        self.block_slots = [self.pack.values[self.pack.index[n]] for n in blocks]
        self.block_shape = None
        maps = {p.name: self.pack.values[self.pack.index[p.name]] for p in self.launch.params if p.pack == "tmap"}
        self.maps = tier.prepare(maps, described, self.launch.spec) if maps else None
        self.like, self.shape_o, self.shape_l = like, tuple(shape_o), tuple(shape_l)
        self.torch = like.kind == "torch"
        self.device = like.device
        self.same_shape = tuple(like.shape) == self.shape_o
        self.scratch_lse = arrays.empty(like, self.shape_l, float32=True)
        self.stream = arrays.stream_getter(like)

    def new_o(self):
        return arrays.empty(self.like, self.shape_o)

    def new_lse(self):
        return arrays.empty(self.like, self.shape_l, float32=True)

    def bind_block_mask(self, block_mask, B: int, H: int, M: int, N: int) -> None:
        """Check a block mask against this call shape and write its strides: it must have been made for these
        sizes (B and H, or None: broadcast), and is read at this launch's tiles."""
        got = tuple(getattr(block_mask, "shape", ()))
        if len(got) != 4 or got[2:] != (M, N) or got[0] not in (None, 1, B) or got[1] not in (None, 1, H):
            raise ValueError(
                f"block_mask: made for (B, H, Q_LEN, KV_LEN) = {got}, but the inputs are ({B}, {H}, {M}, {N})"
            )
        spec = self.launch.spec
        b, h = (1 if got[0] in (None, 1) else B), (1 if got[1] in (None, 1) else H)
        tiles_m, tiles_n = -(-M // spec.block_m), -(-N // spec.block_n)
        self.block_shape = (b, h, tiles_m, tiles_n)
        self.pack.update(block_mask_strides(b, h, tiles_m, tiles_n))

    def block_tiles(self, block_mask):
        """The block mask at this launch's tiles (built on the GPU on first use, then kept in it)."""
        spec = self.launch.spec
        tiles = block_mask.tiles(spec.block_m, spec.block_n, self.like)
        if tuple(tiles.kv_list.shape) != self.block_shape:
            raise ValueError(
                f"block_mask: its tiles at {spec.block_m}x{spec.block_n} have shape {tuple(tiles.kv_list.shape)}, "
                f"expected {self.block_shape}"
            )
        return tiles

    def _counter(self, stream: int):
        """The work-tile counter of a launch on `stream` (see __init__)."""
        if _capturing(stream):
            counter = _zeros(self.like, (2,), "int32")  # its fill is captured too: each replay zeroes it first
            self.captured_counters.append(counter)
            return counter
        counter = self.counters.get(stream)
        if counter is None:
            counter = self.counters[stream] = _zeros(self.like, (2,), "int32")
        return counter

    def run(
        self, q: int, k: int, v: int, o: int, lse: int, scale_log2: float, tensors: list, blocks: tuple = ()
    ) -> None:
        stream = self.stream()
        if len(blocks) != len(self.block_slots):
            raise TypeError("internal: the block mask's arrays do not match the kernel's parameters")
        with self.pack.lock:
            for slot, value in zip(self.slots, (q, k, v, o, lse, scale_log2, *tensors)):
                slot.value = value
            for slot, value in zip(self.block_slots, blocks):
                slot.value = value
            if self.maps is not None:
                self.maps.update(q, k, v, o)
            if self.counter_slot is not None:
                self.counter_slot.value = _ptr(self._counter(stream))
            self.launch.function.launch(self.device, stream, self.grid, self.launch.threads, self.pack, self.check_arch)


def tensor_values(args: tuple[TensorArg, ...], described: dict[str, Array]) -> dict:
    """The static arguments of the call-time tensors: each one's element strides and sizes."""
    values = {}
    for arg in args:
        t = described[arg.name]
        values.update(zip(arg.strides(), t.strides))
        values.update(zip(arg.sizes(), t.shape))
    return values


def _check_flag(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected True or False, got {value!r}")


# The arrays of the backward kinds and the dims of their strides (fagen.backend.contract): [B, H, S, D], and
# [B, H, M] for lse and delta.
_BWD_DIMS = {"lse": "bhm", "delta": "bhm", "rowstat": "sbhm", "k": "bhnd", "v": "bhnd", "dk": "bhnd", "dv": "bhnd"}


def backward_values(params: tuple[Param, ...], a: dict[str, Array], heads_per_kv: int, seqlen_q, seqlen_k, varlen):
    """The static arguments of a backward kind (its parameter list `params`): the strides of the arrays `a` it
    takes (a batch stride of 0 for varlen, where cu_seqlens place the sequences; rowstat keeps its own, being
    indexed by a sequence's own rows), the sizes, the offsets."""
    values = {}
    for p in params:
        name, sep, dim = p.name.rpartition("_stride_")
        if sep and not name.startswith("tensor_"):  # a call-time tensor's strides: tensor_values
            dims = _BWD_DIMS.get(name, "bhmd")
            packed = varlen and dim == "b" and name != "rowstat"
            values[p.name] = 0 if packed else a[name].strides[dims.index(dim)]
    sizes = dict(
        heads_per_kv=heads_per_kv,
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        cu_seqlens_q=varlen[0].ptr if varlen else 0,
        cu_seqlens_k=varlen[1].ptr if varlen else 0,
        total_q=a["q"].shape[2],
        total_k=a["k"].shape[2],
    )
    names = {p.name for p in params}
    values.update({n: v for n, v in sizes.items() if n in names})
    return values


def _dense(x) -> bool:
    """Whether an array's elements fill its memory without gaps or overlaps (any order of the dims)."""
    strides = x.stride() if arrays.library(x) == "torch" else tuple(s // x.dtype.itemsize for s in x.strides)
    expect = 1
    for size, stride in sorted(zip(x.shape, strides), key=lambda t: t[1]):
        if size > 1 and stride != expect:
            return False
        expect *= size
    return True


def backward_pack_values(params: tuple[Param, ...], a: dict[str, Array], heads_per_kv, seqlen_q, seqlen_k, varlen):
    """Every argument of a backward kind for one call shape: the static ones (backward_values), and 0 for the
    per-call ones (the arrays' addresses, the scale, the call-time tensors) that _BackwardCall.run writes."""
    values = backward_values(params, a, heads_per_kv, seqlen_q, seqlen_k, varlen)
    for p in params:
        if p.name not in values and p.pack in ("ptr", "f32"):
            values[p.name] = 0.0 if p.pack == "f32" else 0
    return values


# What _BackwardCall.run writes per call (beside the call-time tensors): every other argument is static.
BACKWARD_DYNAMIC = ("q", "k", "v", "o", "lse", "dout", "dq", "dk", "dv", "delta", "dq_accum", "dtensor", "rowstat")
BACKWARD_DYNAMIC += ("scale_log2",)


class _BackwardCall:
    """A prepared backward call shape: the four launches packed from their parameter lists, the float32
    workspaces allocated (D; the dQ accumulator unless deterministic; the tensor-gradient partials and row sums)."""

    def __init__(self, kernel: Kernel, q, k, v, o, lse, do, tensors, deterministic: bool, varlen):
        from ..backend import tiers
        from ..backend.contract import c_tensor_name

        bp = kernel.backward_plan
        tq, tk, tv = describe("q", q), describe("k", k), describe("v", v)
        to, tl, td = describe("o", o), describe("lse", lse), describe("do", do)
        kernel._check(tq, tk, tv)
        B, H, M, D = tq.shape
        Hkv, N = tk.shape[1], tk.shape[2]
        for name, t in (("o", to), ("do", td)):
            if t.kind != tq.kind or t.device != tq.device:
                raise TypeError(f"{name}: expected a {tq.kind} array on device {tq.device}")
            if t.shape != tq.shape:
                raise ValueError(f"{name}: expected q's shape {tq.shape}, got {t.shape}")
            if t.dtype != kernel.spec.dtype:
                raise TypeError(f"{name}: expected dtype {kernel.spec.dtype}, got {t.dtype_name}")
        if tl.kind != tq.kind or tl.device != tq.device:
            raise TypeError(f"lse: expected a {tq.kind} array on device {tq.device}")
        if tl.shape != (B, H, M) or tl.dtype != "f32":
            raise ValueError(
                f"lse: expected a float32 array of shape {(B, H, M)} (natural log), got {tl.shape} {tl.dtype_name}"
            )
        if varlen is not None:
            cq, ck, max_q, max_k = varlen
            B = cq.shape[0] - 1
        else:
            max_q, max_k = M, N
        described = kernel._tensors(tensors, tq, B, H, max_q, max_k)
        self.scatters = {n: described[n] for n in bp.scatters}
        self.slot_shapes = {n: tuple(described[n].shape) for n, _ in bp.gradients}
        if deterministic and self.scatters:
            raise ValueError(
                f"deterministic: the gradient of {', '.join(self.scatters)} (a tensor the score gathers) is "
                "scatter-added with atomics, which is not reproducible bit for bit; use deterministic=False"
            )
        self.like, self.varlen, self.deterministic = tq, varlen is not None, deterministic
        # the outputs: dense, like q, k, v (zeros for varlen); every call's come out with these very strides
        self.protos = tuple(self._fresh(t) for t in (tq, tk, tv))
        self.delta = arrays.empty(tq, (1 if varlen else B, H, M), float32=True)
        self.dq_accum = None if deterministic else arrays.empty(tq, (1 if varlen else B, H, M, D), float32=True)
        self.gradients = bp.gradients
        grads_grid = (bp.main_grads or bp.main).grid(B, H, Hkv, max_q, max_k)  # the kernel that writes dtensor
        self.dtensor = arrays.empty(tq, (max(1, len(bp.gradients)), B, H, grads_grid[0]), float32=True)
        # the row sums E_i, R_i (contract: rowstat), zeroed per call; a word when there is no tensor gradient
        self.rowstat_shape = (1 + len(bp.gradients), B, H, max_q) if bp.gradients else (1, 1, 1, 1)
        rowstat = arrays.empty(tq, self.rowstat_shape, float32=True)
        a = dict(q=tq, k=tk, v=tv, o=to, lse=tl, dout=td, delta=describe("delta", self.delta))
        a["rowstat"] = describe("rowstat", rowstat)
        a.update(zip(("dq", "dk", "dv"), (describe(n, x) for n, x in zip(("dq", "dk", "dv"), self.protos))))
        a["dq_accum"] = describe("dq_accum", self.dq_accum) if self.dq_accum is not None else a["dq"]  # null then
        vl = varlen[:2] if varlen else None
        self.launches = {}  # by role: preprocess, main, main_grads (the tensors' gradients asked for), last
        self.maps = {}  # a main kernel's tensor maps (the wgmma tier's), refreshed with the addresses per call
        roles = dict(preprocess=bp.preprocess, main=bp.main, main_grads=bp.main_grads)
        roles["last"] = bp.dq if deterministic else bp.convert
        for role, launch in roles.items():
            if launch is None:
                continue
            pack = ArgPack(launch.params)
            values = backward_pack_values(launch.params, a, H // Hkv, max_q, max_k, vl)
            names = {p.name for p in launch.params}
            values.update({n: v for n, v in tensor_values(kernel.tensor_args, described).items() if n in names})
            pack.set(values)
            maps = {p.name: pack.values[pack.index[p.name]] for p in launch.params if p.pack == "tmap"}
            if maps:  # (deterministic: no dq_accum, whose map stays unset and unread)
                mapped = {n: x for n, x in a.items() if n != "dq_accum" or self.dq_accum is not None}
                self.maps[role] = tiers.get(launch.spec.tier).prepare(maps, mapped, launch.spec)
            grid = launch.grid(B, H, Hkv, max_q, max_k)
            self.launches[role] = (launch, pack, grid)
        self.c_names = {n: c_tensor_name(n) for n in kernel.tensors}
        self.check_arch = kernel._check_arch
        self.device = tq.device
        self.stream = arrays.stream_getter(tq)

    def _fresh(self, t):
        """A dense output like `t` (an Array or an output made before): zeros for varlen, where rows outside
        every sequence are left unwritten by the kernels. Dense, so that empty_like/zeros_like keep its strides."""
        x = t.obj if isinstance(t, Array) else t
        if arrays.library(x) == "torch":
            import torch

            if isinstance(t, Array) and not _dense(x):
                x = torch.empty(x.shape, dtype=x.dtype, device=x.device)
            return torch.zeros_like(x) if self.varlen else torch.empty_like(x)
        import cupy

        with cupy.cuda.Device(x.device.id):
            if isinstance(t, Array) and not _dense(x):
                x = cupy.empty(x.shape, dtype=x.dtype)
            return cupy.zeros_like(x) if self.varlen else cupy.empty_like(x)

    def run(
        self, q, k, v, o, lse, do, scale_log2: float, tensors: dict, tensor_grads: bool = True, stream=None
    ) -> Gradients:
        """Launch on `stream` (a raw handle; default: the caller's current stream)."""
        from ..backend.contract import c_grad_name

        dq, dk, dv = (self._fresh(p) for p in self.protos)
        accum = 0 if self.dq_accum is None else _ptr(self.dq_accum)  # null: the deterministic mode
        gradients = self.gradients if tensor_grads else ()
        rowstat = _zeros(self.like, self.rowstat_shape) if gradients else 0  # null: the kernels skip the tensors' sums
        dynamic = (q, k, v, o, lse, do, dq, dk, dv, self.delta, accum, self.dtensor, rowstat)
        ptrs = {n: x if isinstance(x, int) else _ptr(x) for n, x in zip(BACKWARD_DYNAMIC, dynamic)}
        ptrs.update(scale_log2=scale_log2, **{c: _ptr(tensors[n]) for n, c in self.c_names.items()})
        scattered = {}
        for name, t in self.scatters.items():  # float32, dense, the tensor's shape: the kernel adds into it
            scattered[name] = _zeros(self.like, t.shape)
            ptrs[c_grad_name(name)] = _ptr(scattered[name])
        stream = self.stream() if stream is None else stream
        for role in ("preprocess", "main_grads" if gradients else "main", "last"):
            launch, pack, grid = self.launches[role]
            with pack.lock:
                pack.update({p.name: ptrs[p.name] for p in launch.params if p.name in ptrs})
                if role in self.maps:
                    self.maps[role].update(ptrs["q"], ptrs["k"], ptrs["v"], ptrs["dout"])
                launch.function.launch(self.device, stream, grid, launch.threads, pack, self.check_arch)
        grads = {}
        for slot, (name, index) in enumerate(gradients):
            # the slots [B, H, key tiles] summed in a fixed order, over all but the tensor's index; less
            # sum_i E_i R_i (contract: rowstat), in float64
            axes = SLOT_AXES[index]
            total = _sum(self.dtensor[slot], axes) - _sum(_f64(rowstat[0]) * _f64(rowstat[1 + slot]), axes)
            total = _fit(total, self.slot_shapes[name])
            grads[name] = total if name not in grads else grads[name] + total
        grads.update(scattered)
        return Gradients(dq, dk, dv, grads)


_SM_COUNT: dict = {}


def sm_count(device: int) -> int:
    """The number of SMs of a CUDA device (read once)."""
    if device not in _SM_COUNT:
        from cupy.cuda import runtime

        _SM_COUNT[device] = int(runtime.getDeviceProperties(device)["multiProcessorCount"])
    return _SM_COUNT[device]


def decode_splits(num_splits, plan: Plan, tiles: int, sms: int, max_seqlen_k: int) -> int:
    """The number of key splits: an int as given (1..128), else the named heuristic (fagen.backend.splits)."""
    from ..backend import splits

    if num_splits is None or isinstance(num_splits, str):
        block_n = plan.launches[0].spec.block_n
        return splits.choose(num_splits or "flash", tiles, sms, plan.blocks_per_sm, max_seqlen_k, block_n)
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or not 1 <= num_splits <= splits.MAX_SPLITS:
        raise ValueError(
            f"num_splits: expected an int in 1..{splits.MAX_SPLITS}, 'flash' or 'flex', got {num_splits!r}"
        )
    return num_splits


def decode_values(a: dict[str, Array], heads_per_kv: int, kv_heads: int, seqlen_q: int, **sizes) -> dict:
    """The static arguments of the decode split kernel: strides of q [B, q_len, H, D], the caches ([B, N, Hkv, D], or
    [num_pages, page_size, Hkv, D] with a block_table), k_new, v_new, o and lse [B, H, q_len], and the sizes
    (max_seqlen_k, num_splits, ws_rows). Arrays not given (block_table, k_new, v_new) get zeros."""
    values = dict(heads_per_kv=heads_per_kv, kv_heads=kv_heads, seqlen_q=seqlen_q, num_splits=sizes["num_splits"])
    values["ws_rows"] = sizes["ws_rows"]
    arrays_dims = (
        ("q", "q", "bmhd"),
        ("k", "k_cache", "bnhd"),
        ("v", "v_cache", "bnhd"),
        ("k_new", "k_new", "bnhd"),
        ("v_new", "v_new", "bnhd"),
        ("o", "o", "bmhd"),
        ("lse", "lse", "bhm"),
    )
    for name, arr, dims in arrays_dims:
        t = a.get(arr)
        values.update({f"{name}_stride_{d}": t.strides[i] if t else 0 for i, d in enumerate(dims)})
    table = a.get("block_table")
    values.update(
        block_table_stride_b=table.strides[0] if table else 0,
        page_size=a["k_cache"].shape[1] if table else 0,
        max_pages=table.shape[1] if table else 0,
        num_pages=a["k_cache"].shape[0] if table else 0,
        seqlen_new=a["k_new"].shape[1] if a.get("k_new") else 0,
        max_seqlen_k=sizes["max_seqlen_k"],
    )
    return values


def _check_decode(spec, tq: Array, tk: Array, tv: Array, table: Array | None = None) -> None:
    cache = "[num_pages, page_size, Hkv, D]" if table else "[B, Nmax, Hkv, D]"
    dims = {"q": "[B, q_len, H, D]", "k_cache": cache, "v_cache": cache}
    for t, name in ((tq, "q"), (tk, "k_cache"), (tv, "v_cache")):
        if len(t.shape) != 4:
            raise ValueError(f"{name}: expected 4 dimensions {dims[name]}, got shape {t.shape}")
        if 0 in t.shape:
            raise ValueError(f"{name}: empty tensor (shape {t.shape}); every dimension must be at least 1")
        if t.shape[3] != spec.head_dim:
            raise ValueError(f"{name}: head dim {t.shape[3]} differs from the compiled head_dim {spec.head_dim}")
        if t.dtype != spec.dtype:
            raise TypeError(f"{name}: dtype {t.dtype_name} differs from the compiled dtype {spec.dtype}")
    if not (tq.kind == tk.kind == tv.kind) or not (tq.device == tk.device == tv.device):
        raise TypeError("q, k_cache, v_cache: expected arrays of one library on one device")
    if tk.shape != tv.shape:
        raise ValueError(f"k_cache, v_cache: shapes {tk.shape} and {tv.shape} differ")
    if table is None and tq.shape[0] != tk.shape[0]:
        raise ValueError(f"q, k_cache: batch sizes differ ({tq.shape[0]}, {tk.shape[0]})")
    if tq.shape[2] % tk.shape[2]:
        raise ValueError(f"q, k_cache: query heads {tq.shape[2]} must be a multiple of key/value heads {tk.shape[2]}")
    if tq.shape[0] > 65535 or tk.shape[2] > 65535 or tk.shape[1] >= 2**31 or tk.shape[0] >= 2**31:
        raise ValueError("q, k_cache: batch and KV heads must each be at most 65535, the cache below 2^31 keys")
    if table is not None:
        B = tq.shape[0]
        if len(table.shape) != 2 or table.shape[0] != B or table.dtype_name != "int32" or table.strides[1] != 1:
            raise ValueError(
                f"block_table: expected an int32 array [B={B}, max_pages] with unit stride along pages, "
                f"got shape {table.shape} {table.dtype_name}"
            )
        if table.kind != tq.kind or table.device != tq.device:
            raise TypeError(f"block_table: expected a {tq.kind} array on device {tq.device}")
        if table.shape[1] * tk.shape[1] >= 2**31:
            raise ValueError(
                f"block_table: max_pages x page_size = {table.shape[1]} x {tk.shape[1]} keys must be below 2^31"
            )


def _check_new(tq: Array, tk: Array, k_new, v_new, capacity: int) -> tuple[Array, Array] | tuple[None, None]:
    """k_new, v_new [B, seqlen_new, Hkv, D], like the cache, both or neither."""
    if k_new is None and v_new is None:
        return None, None
    if k_new is None or v_new is None:
        raise ValueError("k_new, v_new: pass both (the new keys and their values) or neither")
    tn, tvn = describe("k_new", k_new), describe("v_new", v_new)
    B, Hkv, D = tq.shape[0], tk.shape[2], tk.shape[3]
    for t, name in ((tn, "k_new"), (tvn, "v_new")):
        if len(t.shape) != 4 or t.shape[0] != B or t.shape[2] != Hkv or t.shape[3] != D or t.shape[1] < 1:
            raise ValueError(f"{name}: expected shape [B={B}, seqlen_new, Hkv={Hkv}, D={D}], got {t.shape}")
        if t.dtype != tk.dtype:
            raise TypeError(f"{name}: dtype {t.dtype_name} differs from the cache's {tk.dtype_name}")
        if t.kind != tq.kind or t.device != tq.device:
            raise TypeError(f"{name}: expected a {tq.kind} array on device {tq.device}")
    if tn.shape != tvn.shape:
        raise ValueError(f"k_new, v_new: shapes {tn.shape} and {tvn.shape} differ")
    if tn.shape[1] > capacity:
        raise ValueError(f"k_new: {tn.shape[1]} new keys do not fit a cache of {capacity} keys per sequence")
    return tn, tvn


class _DecodeCall:
    """A prepared decode call shape: the split kernel's arguments packed, its workspace allocated (sized for this
    shape and its number of splits) and its split counts zeroed, so that a call writes a few addresses and
    launches once."""

    def __init__(
        self,
        kernel: Kernel,
        q,
        k_cache,
        v_cache,
        cache_seqlens,
        block_table,
        k_new,
        v_new,
        num_splits,
        tensors,
        out,
        out_lse,
    ):
        from ..backend.contract import c_tensor_name

        tq, tk, tv = describe("q", q), describe("k_cache", k_cache), describe("v_cache", v_cache)
        tl = describe("cache_seqlens", cache_seqlens)
        table = describe("block_table", block_table) if block_table is not None else None
        if tq.kind == "torch":
            _no_grad(q, k_cache, v_cache, tensors)
        _check_decode(kernel.spec, tq, tk, tv, table)
        B, M, H, D = tq.shape
        _, page, Hkv, _ = tk.shape
        N = table.shape[1] * page if table else page  # the cache's capacity per sequence
        tn, tvn = _check_new(tq, tk, k_new, v_new, N)
        if len(tl.shape) != 1 or tl.shape[0] != B or tl.dtype_name != "int32" or (B > 1 and tl.strides[0] != 1):
            raise ValueError(
                f"cache_seqlens: expected a contiguous int32 vector of {B} lengths, "
                f"got shape {tl.shape} {tl.dtype_name}"
            )
        if tl.kind != tq.kind or tl.device != tq.device:
            raise TypeError(f"cache_seqlens: expected a {tq.kind} array on device {tq.device}")
        why_not = kernel._fits(dict(k_cache=tk, v_cache=tv, **({"k_new": tn, "v_new": tvn} if tn else {})))
        if why_not:
            raise ValueError(f"kernel {kernel.name}: {why_not}")
        (split,) = kernel.plan.launches
        rows = M * (H // Hkv)
        tiles = -(-rows // split.spec.block_m)
        S = decode_splits(num_splits, kernel.plan, B * Hkv * tiles, sm_count(tq.device), N)
        ws_rows = tiles * split.spec.block_m
        self.num_splits = S
        self.ws_acc = arrays.empty(tq, (B, Hkv, S, ws_rows, D), float32=True)
        self.ws_ml = arrays.empty(tq, (B, Hkv, S, ws_rows, 2), float32=True)
        # the blocks of a row tile that have finished; the last sets it back to 0, so it is zeroed only here
        self.split_count = _zeros(tq, (B, Hkv, tiles), "int32")
        self.like, self.shape_o, self.shape_l = tq, tuple(tq.shape), (B, H, M)
        self.scratch_lse = arrays.empty(tq, self.shape_l, float32=True)
        o = describe("out", kernel._output("out", out, tq, self.shape_o, False) if out is not None else self.new_o())
        lse = self.scratch_lse if out_lse is None else kernel._output("out_lse", out_lse, tq, self.shape_l, True)
        lse = describe("out_lse", lse)
        described = kernel._tensors(tensors, tq, B, H, M, N)  # checked: names, sizes, dtypes
        all_arrays = dict(q=tq, k_cache=tk, v_cache=tv, o=o, lse=lse, block_table=table, k_new=tn, v_new=tvn)
        sizes = dict(num_splits=S, ws_rows=ws_rows, max_seqlen_k=N)
        self.c_names = [c_tensor_name(n) for n in kernel.tensors]
        self.split = split
        self.split_pack = ArgPack(split.params)
        workspace = dict(ws_acc=_ptr(self.ws_acc), ws_ml=_ptr(self.ws_ml), split_count=_ptr(self.split_count))
        # k_append, v_append: the caches' addresses when appending, else null
        dynamic = ("q", "k", "v", "cache_seqlens", "block_table", "k_new", "v_new", "k_append", "v_append")
        dynamic += ("o", "lse", "scale_log2", *self.c_names)
        self.appending = tn is not None
        self.split_pack.set(
            {
                **decode_values(all_arrays, H // Hkv, Hkv, M, **sizes),
                **tensor_values(kernel.tensor_args, described),
                **workspace,
                **{n: 0 for n in dynamic},
            }
        )
        self.split_slots = [self.split_pack.values[self.split_pack.index[n]] for n in dynamic]
        self.split_grid = split.grid(B, Hkv, rows, S)
        self.check_arch = kernel._check_arch
        self.torch = tq.kind == "torch"
        self.device = tq.device
        self.stream = arrays.stream_getter(tq)

    def new_o(self):
        return arrays.empty(self.like, self.shape_o)

    def new_lse(self):
        return arrays.empty(self.like, self.shape_l, float32=True)

    def run(self, q, k, v, seqlens, table, k_new, v_new, o, lse, scale_log2, tensors, stream=None) -> None:
        """Launch on `stream` (a raw handle; default: the caller's current stream)."""
        stream = self.stream() if stream is None else stream
        appends = (k, v) if self.appending else (0, 0)
        with self.split_pack.lock:
            for slot, value in zip(
                self.split_slots, (q, k, v, seqlens, table, k_new, v_new, *appends, o, lse, scale_log2, *tensors)
            ):
                slot.value = value
            split = self.split
            split.function.launch(self.device, stream, self.split_grid, split.threads, self.split_pack, self.check_arch)


def _static_values(a: dict[str, Array], heads_per_kv: int, seqlen_q: int, seqlen_k: int, varlen) -> dict:
    """Every argument that does not change between calls of one shape."""
    values = {}
    for name, dims in (("q", "bhmd"), ("k", "bhnd"), ("v", "bhnd"), ("o", "bhmd"), ("lse", "bhm")):
        for d, s in zip(dims, a[name].strides):
            values[f"{name}_stride_{d}"] = 0 if varlen and d == "b" else s  # varlen: cu_seqlens, not a batch stride
    values.update(
        heads_per_kv=heads_per_kv,
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        cu_seqlens_q=varlen[0].ptr if varlen else 0,
        cu_seqlens_k=varlen[1].ptr if varlen else 0,
        total_q=a["q"].shape[2],
        total_k=a["k"].shape[2],
    )
    return values


def _call_key(q, k, v, out, out_lse, tensors) -> tuple:
    """What decides a call's checks, tier and static arguments: shapes, strides, dtypes, devices, alignment."""
    return tuple(tensors), tuple(
        [_key_part(x) for x in (q, k, v, out, out_lse)] + [_key_part(x) for x in tensors.values()]
    )


def _key_part(x):
    if x is None:
        return None
    lib = arrays.library(x)
    if lib == "torch":  # get_device(): the index as an int (-1 on the host), cheaper than a torch.device
        return (x.shape, x.stride(), x.dtype, x.get_device(), x.data_ptr() & 15)
    if lib == "cupy":
        return (x.shape, x.strides, x.dtype, x.device.id, x.data.ptr & 15)
    return type(x)


def block_mask_strides(b: int, h: int, tiles_m: int, tiles_n: int) -> dict:
    """FORWARD_SPARSE's strides of a block mask's contiguous kv_count [b, h, tiles_m] and kv_list [b, h, tiles_m,
    tiles_n] (fagen.runtime.block_mask), 0 along a broadcast batch (b = 1) or head (h = 1) dimension."""
    return dict(
        kv_count_stride_b=0 if b == 1 else h * tiles_m,
        kv_count_stride_h=0 if h == 1 else tiles_m,
        kv_list_stride_b=0 if b == 1 else h * tiles_m * tiles_n,
        kv_list_stride_h=0 if h == 1 else tiles_m * tiles_n,
        kv_list_stride_m=tiles_n,
    )


def _block_mask_shape(block_mask) -> tuple:
    shape = getattr(block_mask, "shape", None)
    if shape is None or not callable(getattr(block_mask, "tiles", None)):
        raise TypeError(
            f"block_mask: expected a fagen.BlockMask from fagen.create_block_mask, got {type(block_mask).__name__}"
        )
    return tuple(shape)


def _f64(x):
    """A float64 copy of a torch or CuPy array."""
    return x.double() if arrays.library(x) == "torch" else x.astype("float64")


# A slot gradient's partials dtensor[slot] are [B, H, key tiles]: the axes summed for a tensor read as name[index]
SLOT_AXES = {"b": (1, 2), "h": (0, 2), "bh": (2,)}


def _fit(g, shape: tuple):
    """A slot gradient g ([B], [H] or [B, H]) in the shape of its tensor, which may broadcast a dimension (size 1:
    every batch or head read it, so g is summed there) or be longer (entries no index reaches: gradient 0)."""
    if tuple(g.shape) == tuple(shape):
        return g
    torch_lib = arrays.library(g) == "torch"
    for axis, size in enumerate(shape):
        if size == 1 and g.shape[axis] != 1:
            g = g.sum(dim=axis, keepdim=True) if torch_lib else g.sum(axis=axis, keepdims=True)
    if tuple(g.shape) != tuple(shape):  # longer: the tail is never read
        if torch_lib:
            out = g.new_zeros(shape)
        else:
            import cupy

            out = cupy.zeros(shape, dtype=g.dtype)
        out[tuple(slice(0, n) for n in g.shape)] = g
        g = out
    return g


def _sum(x, axes):
    """x summed over `axes` (a fixed order: deterministic), as float32, for a torch or CuPy array."""
    if arrays.library(x) == "torch":
        return x.sum(dim=axes).float()
    return x.sum(axis=axes).astype("float32")


def _zeros(like: Array, shape, dtype: str = "float32"):
    """An array of zeros (float32, or `dtype`: a name both libraries know) on like's device and library."""
    if like.kind == "torch":
        import torch

        return torch.zeros(shape, dtype=getattr(torch, dtype), device=like.obj.device)
    import cupy

    with cupy.cuda.Device(like.device):
        return cupy.zeros(shape, dtype=dtype)


@functools.cache
def _capture_query():
    """CuPy's cudaStreamIsCapturing and its 'not capturing' status, bound once (a call asks on every launch)."""
    from cupy.cuda import runtime

    return runtime.streamIsCapturing, runtime.streamCaptureStatusNone


def _capturing(stream: int) -> bool:
    """Whether `stream` (a raw handle) is capturing a CUDA graph."""
    is_capturing, none = _capture_query()
    return is_capturing(stream) != none


def _ptr(x) -> int:
    return x.data_ptr() if arrays.library(x) == "torch" else x.data.ptr


def _scale(scale) -> float:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) and type(scale).__module__ != "numpy":
        raise ValueError(f"scale: expected a finite positive number, got {scale!r}")
    value = float(scale)
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(f"scale: expected a finite positive number, got {scale!r}")
    return value


def _requires_grad(q, k, v, tensors) -> bool:
    if not (
        getattr(q, "requires_grad", False)
        or getattr(k, "requires_grad", False)
        or getattr(v, "requires_grad", False)
        or any(getattr(x, "requires_grad", False) for x in tensors.values())
    ):
        return False
    import torch

    return torch.is_grad_enabled()


def _no_grad(q, k, v, tensors) -> None:
    """Decode has no backward: inputs that require grad get an error, never a silently broken step."""
    if _requires_grad(q, k, v, tensors):
        raise RuntimeError(
            "q, k_cache, v_cache: these tensors require grad, but a decode kernel has no backward; "
            "call under torch.no_grad() or pass .detach()ed tensors"
        )


def _wants_grad(kernel: Kernel, q, k, v, tensors) -> bool:
    """Whether a call on PyTorch tensors must record a backward: grad mode is on and an input requires grad.
    A kernel whose backward cannot be derived says so rather than returning an output without a grad_fn."""
    if not _requires_grad(q, k, v, tensors):
        return False
    if not getattr(kernel, "has_backward", False):
        raise RuntimeError(
            f"q, k, v: these tensors require grad, but kernel {kernel.name} has no backward (its program's "
            "backward cannot be derived; kernel.backward(...) says why); call under torch.no_grad() or pass "
            ".detach()ed tensors"
        )
    return True


def _check_offsets(tq: Array, cq: Array, ck: Array, max_seqlen_q, max_seqlen_k) -> None:
    """The varlen arguments, checked without a device sync: int32 offset vectors of B + 1 on q's device, the
    same B for q and k, positive maxima."""
    for name, t in (("cu_seqlens_q", cq), ("cu_seqlens_k", ck)):
        if len(t.shape) != 1 or t.shape[0] < 2 or t.dtype_name != "int32" or t.strides[0] != 1:
            raise ValueError(
                f"{name}: expected a contiguous int32 vector of B + 1 offsets, got shape {t.shape} {t.dtype_name}"
            )
        if t.kind != tq.kind or t.device != tq.device:
            raise TypeError(f"{name}: expected a {tq.kind} array on device {tq.device}")
    if cq.shape != ck.shape:
        raise ValueError(
            f"cu_seqlens_q, cu_seqlens_k: need the same number of sequences, got {cq.shape[0] - 1} "
            f"and {ck.shape[0] - 1}"
        )
    for name, n in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{name}: expected a positive int, got {n!r}")


def _validate_offsets(cu_q, cu_k, totals, maxima) -> None:
    """Check varlen offsets on the host (synchronizes): non-decreasing, from 0, within the totals, and no
    sequence longer than its max_seqlen."""
    import numpy as np

    for name, cu, total, longest, max_name in (
        ("cu_seqlens_q", cu_q, totals[0], maxima[0], "max_seqlen_q"),
        ("cu_seqlens_k", cu_k, totals[1], maxima[1], "max_seqlen_k"),
    ):
        host = np.asarray(cu.cpu() if hasattr(cu, "cpu") else cu.get())
        lengths = np.diff(host)
        if host[0] < 0 or (lengths < 0).any():
            raise ValueError(f"{name}: offsets must start at 0 or more and never decrease, got {host.tolist()[:16]}")
        if host[-1] > total:
            raise ValueError(f"{name}: the last offset {int(host[-1])} is past the packed total {total}")
        if lengths.max(initial=0) > longest:
            raise ValueError(f"{max_name}: {longest} is below the longest sequence ({int(lengths.max())})")
