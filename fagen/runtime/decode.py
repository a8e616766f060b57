"""The decode op: `kernel.decode(...)`, split-KV attention of a few queries over a KV cache.

A call launches the prepared call of its call shape, number of splits and stream (`DecodeCall`): the split
kernel's arguments packed, its float32 workspace allocated and its split counts zeroed. A call captured into a
CUDA graph gets a prepared call of its own (CallCache), whose workspace the graph keeps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..backend.contract import c_tensor_name
from . import arrays, pad
from .arrays import Array, describe
from .calls import CallCache, capturing, ptr, requires_grad, tensor_values, zeros
from .checks import check_output, check_tensors, scale_log2
from .launch import ArgPack
from .plan import KernelLike

if TYPE_CHECKING:
    from .plan import Plan


class Decode:
    """A kernel's decode calls (Kernel.decode says what they take)."""

    def __init__(self, kernel: KernelLike, calls: CallCache):
        self.kernel = kernel
        self.calls = calls

    def __call__(
        self,
        q,
        k_cache,
        v_cache,
        cache_seqlens,
        block_table,
        k_new,
        v_new,
        num_splits,
        scale,
        return_lse,
        out,
        out_lse,
        tensors,
    ):
        kernel = self.kernel
        if not kernel.plan.decode:
            raise TypeError(f"kernel {kernel.name} is a forward: compile with decode=True for kernel.decode(...)")
        caches = (k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, num_splits)
        if pad.padded(kernel.spec):
            return self.padded(q, *caches, scale, return_lse, out, out_lse, tensors)
        return self.launch(q, *caches, scale, return_lse, out, out_lse, tensors)

    def padded(
        self, q, k_cache, v_cache, seqlens, table, k_new, v_new, splits, scale, return_lse, out, out_lse, tensors
    ):
        """A call of a kernel of a padded head dim (fagen.runtime.pad): q, the caches, k_new and v_new padded, o cut
        back to q's columns, and the caches' first columns written back where the kernel appended to them (a copy
        of each cache per call: a head dim the kernels take costs none of it)."""
        spec = self.kernel.spec
        qp, kp, vp, knp, vnp = pad.pad_all(spec, q=q, k_cache=k_cache, v_cache=v_cache, k_new=k_new, v_new=v_new)
        if out is not None:
            check_output(spec, "out", out, describe("q", q), tuple(q.shape), False)
        o, lse = self.launch(qp, kp, vp, seqlens, table, knp, vnp, splits, scale, True, None, out_lse, tensors)
        if k_new is not None:
            pad.write_back(kp, k_cache, spec)
            pad.write_back(vp, v_cache, spec)
        o = pad.cut(o, spec, like=q, into=out)
        return (o, lse) if return_lse else o

    def copied(
        self, q, k_cache, v_cache, seqlens, table, k_new, v_new, splits, scale, return_lse, out, out_lse, tensors
    ):
        """A call on caches (and k_new, v_new) that no split kernel reads as they are (misaligned, or strided along
        D): on dense copies of them, the caches written back where the kernel appended to them."""
        kc, vc, kn, vn = (None if x is None else arrays.dense_copy(x) for x in (k_cache, v_cache, k_new, v_new))
        got = self.launch(q, kc, vc, seqlens, table, kn, vn, splits, scale, return_lse, out, out_lse, tensors, True)
        if k_new is not None:
            arrays.copy_into(k_cache, kc)
            arrays.copy_into(v_cache, vc)
        return got

    def launch(
        self,
        q,
        k_cache,
        v_cache,
        cache_seqlens,
        block_table,
        k_new,
        v_new,
        num_splits,
        scale,
        return_lse,
        out,
        out_lse,
        tensors,
        dense=False,
    ):
        """A call on arrays of the kernel's own head dim: the prepared call of its shape, splits and stream (`dense`:
        the caches are copies already, made because no split kernel reads the caller's)."""
        kernel = self.kernel
        if kernel.captured:
            tensors = kernel.with_captured(tensors)
        named = {**tensors, "cache_seqlens": cache_seqlens, "block_table": block_table, "k_new": k_new, "v_new": v_new}
        stream = arrays.current_stream(q)  # a workspace per stream: calls on two streams may overlap
        key = CallCache.key((q, k_cache, v_cache, out, out_lse), named, "decode", num_splits, stream)
        # a call captured into a CUDA graph gets a workspace of its own, whose split counts the graph zeroes (the
        # fill is captured before the launch): a cached one could be shared with eager calls or other graphs, and one
        # made inside a capture is not zeroed until the graph first replays
        capture = stream is not None and capturing(stream)
        args = (q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, num_splits, tensors, out, out_lse)
        try:
            entry = self.calls.get(key, DecodeCall, kernel, *args, captured=capture)
        except Unfit:
            if dense:
                raise
            caches = (k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, num_splits)
            return self.copied(q, *caches, scale, return_lse, out, out_lse, tensors)
        if entry.torch:
            no_grad(q, k_cache, v_cache, {**tensors, **({"k_new": k_new, "v_new": v_new} if k_new is not None else {})})
        o = out if out is not None else entry.new_o()
        lse = out_lse if out_lse is not None else entry.new_lse() if return_lse else entry.scratch_lse
        entry.run(
            ptr(q),
            ptr(k_cache),
            ptr(v_cache),
            ptr(cache_seqlens),
            0 if block_table is None else ptr(block_table),
            0 if k_new is None else ptr(k_new),
            0 if v_new is None else ptr(v_new),
            ptr(o),
            ptr(lse),
            scale_log2(kernel.default_scale, scale),
            [ptr(tensors[name]) for name in kernel.tensors],
            stream,
        )
        return (o, lse) if return_lse else o


class Unfit(ValueError):
    """No split kernel reads these caches (or k_new, v_new) as they are (decode_fits)."""


class DecodeCall:
    """A prepared decode call shape: the split kernel's arguments packed, its workspace allocated (sized for this
    shape and its number of splits) and its split counts zeroed, so that a call writes a few addresses and
    launches once."""

    def __init__(
        self,
        kernel: KernelLike,
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
        tq, tk, tv = describe("q", q), describe("k_cache", k_cache), describe("v_cache", v_cache)
        tl = describe("cache_seqlens", cache_seqlens)
        table = describe("block_table", block_table) if block_table is not None else None
        if tq.kind == "torch":
            no_grad(q, k_cache, v_cache, tensors)
        check_decode(kernel.spec, tq, tk, tv, table)
        B, M, H, D = tq.shape
        _, page, Hkv, _ = tk.shape
        N = table.shape[1] * page if table else page  # the cache's capacity per sequence
        tn, tvn = check_new(tq, tk, k_new, v_new, N)
        check_seqlens(tq, tl)
        why_not = kernel.why_not(dict(k_cache=tk, v_cache=tv, **({"k_new": tn, "v_new": tvn} if tn else {})))
        if why_not:
            raise Unfit(f"kernel {kernel.name}: {why_not}")
        (split,) = kernel.plan.launches
        rows = M * (H // Hkv)
        tiles = -(-rows // split.spec.block_m)
        S = decode_splits(num_splits, kernel.plan, B * Hkv * tiles, sm_count(tq.device), N)
        ws_rows = tiles * split.spec.block_m
        self.num_splits = S
        self.ws_acc = arrays.empty(tq, (B, Hkv, S, ws_rows, D), float32=True)
        self.ws_ml = arrays.empty(tq, (B, Hkv, S, ws_rows, 2), float32=True)
        # the blocks of a row tile that have finished; the last sets it back to 0, so it is zeroed only here
        self.split_count = zeros(tq, (B, Hkv, tiles), "int32")
        self.like, self.shape_o, self.shape_l = tq, tuple(tq.shape), (B, H, M)
        self.scratch_lse = arrays.empty(tq, self.shape_l, float32=True)
        spec = kernel.spec
        o = describe(
            "out", check_output(spec, "out", out, tq, self.shape_o, False) if out is not None else self.new_o()
        )
        lse = self.scratch_lse if out_lse is None else check_output(spec, "out_lse", out_lse, tq, self.shape_l, True)
        # the call-time tensors, checked: names, sizes, dtypes
        described = check_tensors(kernel.tensor_args, kernel.tensor_index, tensors, tq, B, H, M, N)
        all_arrays: dict[str, Array | None] = dict(q=tq, k_cache=tk, v_cache=tv, o=o, lse=describe("out_lse", lse))
        all_arrays.update(block_table=table, k_new=tn, v_new=tvn)
        sizes = dict(num_splits=S, ws_rows=ws_rows, max_seqlen_k=N)
        self.split = split
        self._pack(kernel, decode_values(all_arrays, H // Hkv, Hkv, M, **sizes), described, appending=tn is not None)
        self.split_grid = split.grid(B, Hkv, rows, S)
        self.check_arch = kernel.check_arch
        self.torch = tq.kind == "torch"
        self.device = tq.device
        self.stream = arrays.stream_getter(tq)

    def _pack(self, kernel: KernelLike, static: dict, described: dict, appending: bool) -> None:
        """The split kernel's arguments: `static`, the call-time tensors' strides and sizes, the workspace, and a
        slot for each address a call writes."""
        self.c_names = [c_tensor_name(n) for n in kernel.tensors]
        self.split_pack = ArgPack(self.split.params)
        workspace = dict(ws_acc=ptr(self.ws_acc), ws_ml=ptr(self.ws_ml), split_count=ptr(self.split_count))
        # k_append, v_append: the caches' addresses when appending, else null
        addresses = ("q", "k", "v", "cache_seqlens", "block_table", "k_new", "v_new", "k_append", "v_append")
        dynamic = (*addresses, "o", "lse", "scale_log2", *self.c_names)
        self.appending = appending
        self.split_pack.set(
            {**static, **tensor_values(kernel.tensor_args, described), **workspace, **{n: 0 for n in dynamic}}
        )
        self.split_slots = [self.split_pack.values[self.split_pack.index[n]] for n in dynamic]

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


def decode_values(a: dict, heads_per_kv: int, kv_heads: int, seqlen_q: int, **sizes) -> dict:
    """The static arguments of the decode split kernel: strides of q [B, q_len, H, D], the caches ([B, N, Hkv, D],
    or [num_pages, page_size, Hkv, D] with a block_table), k_new, v_new, o and lse [B, H, q_len], and the sizes
    (max_seqlen_k, num_splits, ws_rows). `a` holds the arrays by name; those not given (block_table, k_new,
    v_new: None or absent) get zeros."""
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


def check_decode(spec, tq: Array, tk: Array, tv: Array, table: Array | None = None) -> None:
    """q [B, q_len, H, D] and the caches (contiguous [B, Nmax, Hkv, D], or pages with a block_table)."""
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


def check_new(tq: Array, tk: Array, k_new, v_new, capacity: int) -> tuple[Array, Array] | tuple[None, None]:
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


def check_seqlens(tq: Array, tl: Array) -> None:
    """cache_seqlens: a contiguous int32 vector of B lengths on q's device."""
    B = tq.shape[0]
    if len(tl.shape) != 1 or tl.shape[0] != B or tl.dtype_name != "int32" or (B > 1 and tl.strides[0] != 1):
        raise ValueError(
            f"cache_seqlens: expected a contiguous int32 vector of {B} lengths, got shape {tl.shape} {tl.dtype_name}"
        )
    if tl.kind != tq.kind or tl.device != tq.device:
        raise TypeError(f"cache_seqlens: expected a {tq.kind} array on device {tq.device}")


def no_grad(q, k, v, tensors) -> None:
    """Decode has no backward: inputs that require grad get an error, never a silently broken step."""
    if requires_grad(q, k, v, tensors):
        raise RuntimeError(
            "q, k_cache, v_cache: these tensors require grad, but a decode kernel has no backward; "
            "call under torch.no_grad() or pass .detach()ed tensors"
        )
