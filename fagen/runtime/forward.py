"""The forward op: `kernel(q, k, v, ...)` and `kernel.varlen(...)`.

A call first settles what decides its path (a decode kernel, a block mask, PyTorch inputs that require grad,
which go through fagen.runtime.autograd and come back without grad), then launches the prepared call of its
call shape (`ForwardCall`, kept in the kernel's CallCache). A varlen call's prepared call is kept per call shape, the
offsets' addresses, the number of sequences and the maxima (and the grid they give) written per call, as packed
training changes them every step; a kernel that reads call-time tensors prepares its varlen call each time (the
tensors are checked against the maxima).
"""

from __future__ import annotations

import os

from ..backend.contract import Kind, c_tensor_name
from . import arrays, pad
from .arrays import Array, describe
from .block_mask import table_strides
from .calls import CallCache, capturing, ptr, requires_grad, tensor_values, zeros
from .checks import check_offsets, check_output, check_packed, check_qkv, check_tensors, scale_log2, validate_offsets
from .launch import ArgPack
from .plan import KernelLike


class Forward:
    """A kernel's forward calls (Kernel.__call__ and Kernel.varlen say what they take)."""

    def __init__(self, kernel: KernelLike, calls: CallCache):
        self.kernel = kernel  # the op autograd calls back, and whose fallback tier takes inputs its tier cannot
        self.calls = calls
        # a persistent kernel's work-tile counters for the varlen calls prepared each call (a kernel that reads
        # call-time tensors), by kernel and stream: kept as a kept call shape keeps its own, so no call zeroes one
        self.varlen_counters: dict[str, dict] = {}

    def __call__(self, q, k, v, scale, return_lse: bool, out, out_lse, block_mask, tensors: dict):
        kernel = self.kernel
        if kernel.plan.decode:
            raise TypeError(f"kernel {kernel.name} was compiled with decode=True: call kernel.decode(...)")
        if kernel.captured:
            tensors = kernel.with_captured(tensors)
        if kernel.block_sparse:
            if block_mask is None:
                raise TypeError(
                    f"block_mask: kernel {kernel.name} was compiled with block_sparse=True; pass "
                    "block_mask=fagen.create_block_mask(...)"
                )
        elif block_mask is not None:
            raise TypeError(f"block_mask: kernel {kernel.name} reads no block mask; compile it with block_sparse=True")
        if arrays.library(q) == "torch" and wants_grad(kernel, q, k, v, tensors):
            from .autograd import attention_with_grad

            if out is not None or out_lse is not None:
                raise ValueError("out, out_lse: not with inputs that require grad (autograd owns its outputs)")
            sparse = {} if block_mask is None else {"block_mask": block_mask}  # a block-sparse kernel's
            o, lse = attention_with_grad(kernel, q, k, v, scale, tensors, **sparse)
            return (o, lse) if return_lse else o
        return self.launch(q, k, v, scale, return_lse, out, out_lse, block_mask, tensors)

    def launch(self, q, k, v, scale, return_lse: bool, out, out_lse, block_mask, tensors: dict):
        """Launch the prepared call of this call shape (made on its first call); a kernel of a padded head dim
        (fagen.runtime.pad) on q, k, v padded, o cut back to q's columns."""
        spec = self.kernel.spec
        if pad.padded(spec):
            qp, kp, vp = pad.pad_all(spec, q=q, k=k, v=v)
            if out is not None:
                check_output(spec, "out", out, describe("q", q), tuple(q.shape), False)
            o, lse = self._launch(qp, kp, vp, scale, True, None, out_lse, block_mask, tensors)
            o = pad.cut(o, spec, like=q, into=out)
            return (o, lse) if return_lse else o
        return self._launch(q, k, v, scale, return_lse, out, out_lse, block_mask, tensors)

    def _launch(self, q, k, v, scale, return_lse: bool, out, out_lse, block_mask, tensors: dict):
        """launch() on arrays of the kernel's own head dim."""
        shape = () if block_mask is None else (block_mask_shape(block_mask),)
        key = CallCache.key((q, k, v, out, out_lse), tensors, "forward", *shape)
        entry = self.calls.get(key, self.prepare, q, k, v, out, out_lse, tensors, block_mask)
        o = out if out is not None else entry.new_o()
        # lse is always written; when the caller does not want it, into a scratch buffer of this call shape
        lse = out_lse if out_lse is not None else entry.new_lse() if return_lse else entry.scratch_lse
        blocks: tuple = ()
        if block_mask is not None:
            tiles = entry.block_tiles(block_mask)
            blocks = (ptr(tiles.kv_count), ptr(tiles.kv_list))
        entry.run(
            ptr(q),
            ptr(k),
            ptr(v),
            ptr(o),
            ptr(lse),
            scale_log2(self.kernel.default_scale, scale),
            [ptr(tensors[name]) for name in self.kernel.tensors],
            blocks,
        )
        return (o, lse) if return_lse else o

    def prepare(self, q, k, v, out, out_lse, tensors: dict, block_mask=None) -> ForwardCall:
        """The checked, packed call of a call shape, on the tier that takes its arrays."""
        kernel = self.kernel
        tq, tk, tv = describe("q", q), describe("k", k), describe("v", v)
        check_qkv(kernel.spec, tq, tk, tv)
        B, H, M, _ = tq.shape
        shape_o, shape_l = tq.shape, tq.shape[:3]
        o = check_output(kernel.spec, "out", out, tq, shape_o, False) if out is not None else arrays.empty(tq, shape_o)
        lse = (
            check_output(kernel.spec, "out_lse", out_lse, tq, shape_l, True)
            if out_lse is not None
            else arrays.empty(tq, shape_l, float32=True)
        )
        extra = check_tensors(kernel.tensor_args, kernel.tensor_index, tensors, tq, B, H, M, tk.shape[2])
        all_arrays = dict(q=tq, k=tk, v=tv, o=describe("out", o), lse=describe("out_lse", lse))
        target = kernel.target(all_arrays)
        static = static_values(all_arrays, H // tk.shape[1], M, tk.shape[2], varlen=None)
        call = ForwardCall(target, static, B, H, M, tq, shape_o, shape_l, extra, all_arrays)
        if block_mask is not None:
            call.bind_block_mask(block_mask, B, H, M, tk.shape[2])
        return call

    def varlen(
        self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, return_lse, validate, tensors
    ):
        kernel = self.kernel
        if kernel.plan.decode:
            raise TypeError(f"kernel {kernel.name} was compiled with decode=True: call kernel.decode(...)")
        if kernel.block_sparse:
            raise TypeError(f"kernel {kernel.name} reads a block mask of [B, H, M, N] inputs: it has no varlen call")
        if kernel.captured:
            tensors = kernel.with_captured(tensors)
        if arrays.library(q) == "torch" and wants_grad(kernel, q, k, v, tensors):
            from .autograd import varlen_with_grad

            o, lse = varlen_with_grad(
                kernel, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, validate, tensors
            )
            return (o, lse) if return_lse else o
        sizes = (max_seqlen_q, max_seqlen_k)
        return self.launch_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *sizes, scale, return_lse, validate, tensors)

    def launch_varlen(
        self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, return_lse, validate, tensors
    ):
        """Check, pack and launch a varlen call: q [total_q, H, D], k, v [total_k, Hkv, D] (padded to the kernel's
        head dim where it pads them, o cut back)."""
        kernel = self.kernel
        q_in = q
        if pad.padded(kernel.spec):
            q, k, v = pad.pad_all(kernel.spec, q=q, k=k, v=v)
        check_packed(q=q, k=k, v=v)
        views = [arrays.as_bhsd(x) for x in (q, k, v)]  # [total, H, D] viewed as [1, H, total, D]: no copy
        tq, tk, tv = (describe(n, x) for n, x in zip("qkv", views))
        check_qkv(kernel.spec, tq, tk, tv)
        cq, ck = describe("cu_seqlens_q", cu_seqlens_q), describe("cu_seqlens_k", cu_seqlens_k)
        check_offsets(tq, cq, ck, max_seqlen_q, max_seqlen_k)
        totals = (tq.shape[2], tk.shape[2])
        if validate or (validate is None and os.environ.get("FAGEN_VALIDATE", "") not in ("", "0")):
            validate_offsets(cu_seqlens_q, cu_seqlens_k, totals, (max_seqlen_q, max_seqlen_k))
        varlen = (cq, ck, max_seqlen_q, max_seqlen_k)
        if tensors or kernel.tensor_args:  # checked against the maxima: prepared each call
            call = self.prepare_varlen(tq, tk, tv, varlen, tensors)
        else:  # kept per call shape; the offsets, the number of sequences and the maxima are written per call
            key = CallCache.key(tuple(views), tensors, "varlen")
            call = self.calls.get(key, self.prepare_varlen, tq, tk, tv, varlen, tensors)
        o4, lse4 = call.new_o(), call.new_lse()
        call.run(
            *(ptr(x) for x in (*views, o4, lse4)),
            scale_log2(kernel.default_scale, scale),
            [ptr(tensors[name]) for name in kernel.tensors],
            varlen=(cq.ptr, ck.ptr, cq.shape[0] - 1, max_seqlen_q, max_seqlen_k),
        )
        o, lse = arrays.from_bhsd(o4), lse4[0]
        if pad.padded(kernel.spec):
            o = pad.cut(o, kernel.spec, like=q_in)
        return (o, lse) if return_lse else o

    def prepare_varlen(self, tq: Array, tk: Array, tv: Array, varlen: tuple, tensors: dict) -> ForwardCall:
        """The checked, packed varlen call of a call shape ([1, H, total, D] views), on the tier that takes its
        arrays; a prepared call made each call (a kernel that reads call-time tensors) draws from the op's
        work-tile counters."""
        kernel = self.kernel
        cq, ck, max_q, max_k = varlen
        B, H = cq.shape[0] - 1, tq.shape[1]
        o4, lse4 = arrays.empty(tq, tq.shape), arrays.empty(tq, tq.shape[:3], float32=True)
        all_arrays = dict(q=tq, k=tk, v=tv, o=describe("out", o4), lse=describe("out_lse", lse4))
        extra = check_tensors(kernel.tensor_args, kernel.tensor_index, tensors, tq, B, H, max_q, max_k)
        target = kernel.target({**all_arrays, "cu_seqlens_q": cq, "cu_seqlens_k": ck})
        static = static_values(all_arrays, H // tk.shape[1], max_q, max_k, varlen=(cq, ck))
        per_call = bool(tensors or kernel.tensor_args)  # (launch_varlen: such a call is not kept)
        counters = self.varlen_counters.setdefault(target.name, {}) if per_call else None
        return ForwardCall(target, static, B, H, max_q, tq, tq.shape, tq.shape[:3], extra, all_arrays, counters)


def wants_grad(kernel: KernelLike, q, k, v, tensors) -> bool:
    """Whether a call on PyTorch tensors must record a backward: grad mode is on and an input requires grad.
    A kernel whose backward cannot be derived says so rather than returning an output without a grad_fn."""
    if not requires_grad(q, k, v, tensors):
        return False
    if not kernel.has_backward:
        raise RuntimeError(
            f"q, k, v: these tensors require grad, but kernel {kernel.name} has no backward (its program's "
            "backward cannot be derived; kernel.backward(...) says why); call under torch.no_grad() or pass "
            ".detach()ed tensors"
        )
    return True


class ForwardCall:
    """A prepared call shape: the target kernel's launch with its static arguments already packed, so that a
    call only allocates its outputs, writes five addresses and the scale, and launches."""

    def __init__(
        self,
        target: KernelLike,
        static: dict,
        B,
        H,
        M,
        like: Array,
        shape_o,
        shape_l,
        extra: dict,
        described: dict,
        counters: dict | None = None,
    ):
        """`counters`: the work-tile counters by stream to draw from (a varlen call's, kept by its op); else its own."""
        from ..backend import tiers

        self.launch = target.launch
        self.check_arch = target.check_arch
        self.c_names = {n: c_tensor_name(n) for n in target.tensors}
        self.pack = ArgPack(self.launch.params)
        tier = self.tier = tiers.get(self.launch.spec.tier)
        self.grid, grid_values = tier.launch_grid(self.launch.spec, self.launch.grid(B, H, M), like.device)
        self.heads = H
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
        self.counters: dict = {} if counters is None else counters  # stream -> its counter
        self.captured_counters: list = []  # the counters of captured launches, alive as long as this call shape
        self.block_slots = [self.pack.values[self.pack.index[n]] for n in blocks]
        self.block_shape: tuple | None = None
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
        if capturing(stream):
            counter = zeros(self.like, (2,), "int32")  # its fill is captured too: each replay zeroes it first
            self.captured_counters.append(counter)
            return counter
        counter = self.counters.get(stream)
        if counter is None:
            counter = self.counters[stream] = zeros(self.like, (2,), "int32")
        return counter

    def varlen_sizes(self, varlen: tuple) -> tuple[dict, tuple]:
        """A varlen call's own arguments, from its offsets' addresses, number of sequences and maxima (cu_q, cu_k,
        B, max_q, max_k), and the grid they give (a persistent kernel's: its work tiles' grid among the arguments)."""
        cu_q, cu_k, batch, max_q, max_k = varlen
        grid = self.launch.grid(batch, self.heads, max_q)
        grid, values = self.tier.launch_grid(self.launch.spec, grid, self.device)
        return dict(values, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqlen_q=max_q, seqlen_k=max_k), grid

    def run(
        self,
        q: int,
        k: int,
        v: int,
        o: int,
        lse: int,
        scale_log2: float,
        tensors: list,
        blocks: tuple = (),
        varlen: tuple | None = None,
    ) -> None:
        """Launch with these addresses; `varlen`: a varlen call's offsets' addresses, number of sequences and maxima
        (varlen_sizes)."""
        stream = self.stream()
        if len(blocks) != len(self.block_slots):
            raise TypeError("internal: the block mask's arrays do not match the kernel's parameters")
        own, grid = self.varlen_sizes(varlen) if varlen is not None else ({}, self.grid)
        with self.pack.lock:
            self.pack.update(own)
            for slot, value in zip(self.slots, (q, k, v, o, lse, scale_log2, *tensors)):
                slot.value = value
            for slot, value in zip(self.block_slots, blocks):
                slot.value = value
            if self.maps is not None:
                self.maps.update(q, k, v, o)
            if self.counter_slot is not None:
                self.counter_slot.value = ptr(self._counter(stream))
            self.launch.function.launch(self.device, stream, grid, self.launch.threads, self.pack, self.check_arch)


def static_values(a: dict[str, Array], heads_per_kv: int, seqlen_q: int, seqlen_k: int, varlen) -> dict:
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


def block_mask_strides(b: int, h: int, tiles_m: int, tiles_n: int) -> dict:
    """FORWARD_SPARSE's strides of a block mask's contiguous kv_count [b, h, tiles_m] and kv_list [b, h, tiles_m,
    tiles_n] (fagen.runtime.block_mask)."""
    return table_strides("kv", "m", b, h, tiles_m, tiles_n)


def block_mask_shape(block_mask) -> tuple:
    """A block mask's (B, H, Q_LEN, KV_LEN), checked to be a fagen.BlockMask's."""
    shape = getattr(block_mask, "shape", None)
    if shape is None or not callable(getattr(block_mask, "tiles", None)):
        raise TypeError(
            f"block_mask: expected a fagen.BlockMask from fagen.create_block_mask, got {type(block_mask).__name__}"
        )
    return tuple(shape)
