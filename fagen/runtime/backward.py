"""The backward op: `kernel.backward(...)` and `kernel.varlen_backward(...)`.

FlashAttention-2's split (fagen.backend.contract's BWD kinds): a preprocess (D = rowsum(dO ∘ O)), the main
kernel over key tiles (dK, dV; dQ by float32 atomic additions, which a deterministic call orders where the main
kernel can (the wgmma tier's: a counter per query tile), or else by its own query-tile kernel), and a last kernel
(dQ converted, or computed). A call launches the prepared call of its call shape, mode and stream
(`BackwardCall`: the four launches packed, the float32 workspaces allocated), on the tier whose backward takes
its arrays.

A block-sparse forward's backward (`block_mask=`) runs the main kernel over the block mask's transposed table
(contract.Kind.BWD_SPARSE: a key tile visits only the query tiles listed for it), built at that kernel's tiles and
kept in the block mask per stream, where it can (`sparse_why_not`), else the dense main kernel, which visits every
tile of the proven ranges and evaluates the mask there: the same gradients.
"""

from __future__ import annotations

from typing import NamedTuple

from ..backend.contract import Param, c_grad_name, c_tensor_name
from . import arrays, pad
from .arrays import Array, describe
from .block_mask import table_strides
from .calls import CallCache, ptr, tensor_values, zeros
from .checks import check_flag, check_offsets, check_packed, check_qkv, check_tensors, scale_log2
from .forward import block_mask_shape
from .launch import ArgPack
from .plan import KernelLike


class Gradients(NamedTuple):
    """What Kernel.backward returns: dq, dk, dv with q's, k's and v's shapes and dtype (dk, dv float32 where the call
    asked for float32_dkv; GQA: dk, dv summed over each group's query heads), and the float32 gradient of each
    call-time float tensor the score reads, by name."""

    dq: object
    dk: object
    dv: object
    tensors: dict


class VarlenSizes(NamedTuple):
    """What a varlen call writes into its prepared call: the offsets' device addresses, and the number of sequences
    and the maxima, which size the grids of the launches over sequences (not the row passes': `row_pass`; the
    preprocess takes the key offsets and the number of sequences, for dK's and dV's rows outside them)."""

    cu_seqlens_q: int
    cu_seqlens_k: int
    batch: int
    max_q: int
    max_k: int


class Backward:
    """A kernel's backward calls (Kernel.backward and Kernel.varlen_backward say what they take)."""

    def __init__(self, kernel: KernelLike, calls: CallCache):
        self.kernel = kernel
        self.calls = calls

    def __call__(
        self,
        q,
        k,
        v,
        o,
        lse,
        do,
        scale,
        deterministic: bool,
        tensor_grads: bool,
        tensors: dict,
        block_mask=None,
        rows: list | None = None,
        float32_dkv: bool = False,
    ) -> Gradients:
        """`rows`: a list that takes the call's RowSums, the tensors' gradients then left uncorrected (fagen.ring).
        `float32_dkv`: dk, dv in float32, the kernel's sums not rounded to the inputs' dtype (fagen.ring)."""
        check_flag("deterministic", deterministic)
        check_flag("tensor_grads", tensor_grads)
        check_flag("float32_dkv", float32_dkv)
        kernel = self.kernel
        if block_mask is not None and not kernel.block_sparse:
            raise TypeError(f"block_mask: kernel {kernel.name} reads no block mask; compile it with block_sparse=True")
        mode = (deterministic, tensor_grads, tensors, block_mask, rows, float32_dkv)
        if pad.padded(kernel.spec):  # q, k, v, o, dO padded; dQ, dK, dV cut back (fagen.runtime.pad)
            qp, kp, vp, op, dop = pad.pad_all(kernel.spec, q=q, k=k, v=v, o=o, do=do)
            g = self.run(qp, kp, vp, op, lse, dop, scale, *mode)
            return cut_gradients(g, kernel.spec, q, *((None, None) if float32_dkv else (k, v)))
        return self.run(q, k, v, o, lse, do, scale, *mode)

    def run(
        self,
        q,
        k,
        v,
        o,
        lse,
        do,
        scale,
        deterministic: bool,
        tensor_grads: bool,
        tensors: dict,
        block_mask=None,
        rows: list | None = None,
        float32_dkv: bool = False,
    ) -> Gradients:
        """A call on arrays of the kernel's own head dim: the prepared call of its shape, mode and stream."""
        kernel = self.kernel
        if kernel.captured:
            tensors = kernel.with_captured(tensors)
        stream = arrays.current_stream(q)  # workspaces per stream: calls on two streams may overlap
        shape = () if block_mask is None else (block_mask_shape(block_mask),)
        mode = ("backward", bool(deterministic), bool(float32_dkv))
        key = CallCache.key((q, k, v, o, lse, do), tensors, *mode, stream, *shape)
        entry = self.calls.get(key, self.prepare, q, k, v, o, lse, do, tensors, deterministic, block_mask, float32_dkv)
        scale2 = scale_log2(kernel.default_scale, scale)
        return entry.run(q, k, v, o, lse, do, scale2, tensors, tensor_grads, stream, block_mask, rows)

    def prepare(
        self, q, k, v, o, lse, do, tensors: dict, deterministic: bool, block_mask=None, float32_dkv: bool = False
    ) -> BackwardCall:
        """The checked, packed call of a call shape, on the tier whose backward takes its arrays."""
        target = self.target(q, k, v, do)  # (a fallback tier's plan has no block-sparse kernel: sparse_why_not)
        return BackwardCall(
            target,
            q,
            k,
            v,
            o,
            lse,
            do,
            tensors,
            deterministic,
            varlen=None,
            block_mask=block_mask,
            float32_dkv=float32_dkv,
        )

    def varlen(
        self,
        q,
        k,
        v,
        o,
        lse,
        do,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        scale,
        deterministic,
        tensor_grads,
        tensors,
    ) -> Gradients:
        check_flag("deterministic", deterministic)
        check_flag("tensor_grads", tensor_grads)
        kernel = self.kernel
        offsets = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        if pad.padded(kernel.spec):  # q, k, v, o, dO padded; dQ, dK, dV cut back (fagen.runtime.pad)
            qp, kp, vp, op, dop = pad.pad_all(kernel.spec, q=q, k=k, v=v, o=o, do=do)
            g = self.run_varlen(qp, kp, vp, op, lse, dop, *offsets, scale, deterministic, tensor_grads, tensors)
            return cut_gradients(g, kernel.spec, q, k, v)
        return self.run_varlen(q, k, v, o, lse, do, *offsets, scale, deterministic, tensor_grads, tensors)

    def run_varlen(
        self,
        q,
        k,
        v,
        o,
        lse,
        do,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        scale,
        deterministic,
        tensor_grads,
        tensors,
    ) -> Gradients:
        """A varlen call on arrays of the kernel's own head dim: the prepared call of its shape, mode and stream,
        the offsets' addresses, the number of sequences and the maxima written per call (`VarlenSizes`: packed
        training changes them every step); prepared each call where the kernel reads call-time tensors (checked
        against the maxima, their row sums sized by them)."""
        kernel = self.kernel
        if kernel.captured:
            tensors = kernel.with_captured(tensors)
        check_packed(q=q, k=k, v=v, o=o, do=do)
        if len(getattr(lse, "shape", ())) != 2:
            raise ValueError(
                f"lse: expected 2 dimensions [H, total_q] for varlen, got {tuple(getattr(lse, 'shape', ()))}"
            )
        q4, k4, v4, o4, do4 = (arrays.as_bhsd(x) for x in (q, k, v, o, do))
        lse3 = lse[None]
        cq, ck = describe("cu_seqlens_q", cu_seqlens_q), describe("cu_seqlens_k", cu_seqlens_k)
        tq = describe("q", q4)
        check_offsets(tq, cq, ck, max_seqlen_q, max_seqlen_k)
        varlen = (cq, ck, max_seqlen_q, max_seqlen_k)
        given = (q4, k4, v4, o4, lse3, do4)
        if tensors or kernel.tensor_args:
            entry = self.prepare_varlen(*given, tensors, deterministic, varlen)
        else:
            stream = arrays.current_stream(q)  # workspaces per stream, as Backward.run's
            key = CallCache.key(given, tensors, "varlen_backward", bool(deterministic), stream)
            entry = self.calls.get(key, self.prepare_varlen, *given, tensors, deterministic, varlen)
        sizes = VarlenSizes(cq.ptr, ck.ptr, cq.shape[0] - 1, max_seqlen_q, max_seqlen_k)
        scale2 = scale_log2(kernel.default_scale, scale)
        g = entry.run(*given, scale2, tensors, tensor_grads, varlen=sizes)
        return Gradients(arrays.from_bhsd(g.dq), arrays.from_bhsd(g.dk), arrays.from_bhsd(g.dv), g.tensors)

    def prepare_varlen(self, q, k, v, o, lse, do, tensors: dict, deterministic: bool, varlen) -> BackwardCall:
        """The checked, packed varlen call of a call shape ([1, H, total, D] views), on the tier whose backward
        takes its arrays."""
        target = self.target(q, k, v, do)
        return BackwardCall(target, q, k, v, o, lse, do, tensors, deterministic, varlen=varlen)

    def target(self, q, k, v, do) -> KernelLike:
        """This kernel, or its fallback tier's, whose backward's main kernel takes these arrays (the wgmma tier's
        reads q, k, v and do by TMA)."""
        from ..backend import tiers

        given = {n: describe(n, x) for n, x in (("q", q), ("k", k), ("v", v), ("dout", do))}
        kernel = self.kernel
        while (why_not := tiers.get(kernel.backward_plan.main.spec.tier).backward_fits(given)) is not None:
            kernel = kernel.fallback_tier(why_not)
        return kernel


def cut_gradients(g: Gradients, spec, q, k, v) -> Gradients:
    """The gradients of a padded call (fagen.runtime.pad) cut back to the inputs' head dim, laid out like them (views
    of dk, dv where k, v are None: float32 ones)."""
    return Gradients(pad.cut(g.dq, spec, like=q), pad.cut(g.dk, spec, like=k), pad.cut(g.dv, spec, like=v), g.tensors)


def check_backward_arrays(spec, tq: Array, to: Array, tl: Array, td: Array) -> None:
    """o and do like q (its library, device and shape; the compiled dtype), lse [B, H, M] float32."""
    B, H, M, _ = tq.shape
    for name, t in (("o", to), ("do", td)):
        if t.kind != tq.kind or t.device != tq.device:
            raise TypeError(f"{name}: expected a {tq.kind} array on device {tq.device}")
        if t.shape != tq.shape:
            raise ValueError(f"{name}: expected q's shape {tq.shape}, got {t.shape}")
        if t.dtype != spec.dtype:
            raise TypeError(f"{name}: expected dtype {spec.dtype}, got {t.dtype_name}")
    if tl.kind != tq.kind or tl.device != tq.device:
        raise TypeError(f"lse: expected a {tq.kind} array on device {tq.device}")
    if tl.shape != (B, H, M) or tl.dtype != "f32":
        raise ValueError(
            f"lse: expected a float32 array of shape {(B, H, M)} (natural log), got {tl.shape} {tl.dtype_name}"
        )


def sparse_why_not(bp, deterministic: bool) -> str | None:
    """Why a call with a block mask runs the dense main kernel (every tile of the proven ranges, the mask evaluated
    there: the same gradients, more work), or None where the block-sparse one (Kind.BWD_SPARSE) runs. A call that
    asks for the gradients of tensors read as name[h] / [b] / [b, h] runs the dense _grads kernel too (run)."""
    if deterministic:
        return "deterministic: the dense kernel orders dQ's additions by the key tiles its proven ranges count"
    if bp.main_sparse is None:
        return f"the {bp.main.spec.tier} tier's backward has no block-sparse main kernel"
    return None


def query_tiles_strides(b: int, h: int, tiles_m: int, tiles_n: int) -> dict:
    """BWD_SPARSE's strides of a transposed table's contiguous q_count [b, h, tiles_n] and q_list [b, h, tiles_n,
    tiles_m] (fagen.runtime.block_mask.QueryTiles)."""
    return table_strides("q", "n", b, h, tiles_n, tiles_m)


class BackwardCall:
    """A prepared backward call shape: the four launches packed from their parameter lists, the float32
    workspaces allocated (D; the dQ accumulator unless deterministic; the tensor-gradient partials and row sums).
    With a block mask, the block-sparse main kernel's launch too where it runs (`sparse_reason` None: the strides
    of the block mask's transposed table bound; else why the dense one runs)."""

    def __init__(
        self,
        kernel: KernelLike,
        q,
        k,
        v,
        o,
        lse,
        do,
        tensors,
        deterministic: bool,
        varlen,
        block_mask=None,
        float32_dkv: bool = False,
    ):
        bp = kernel.backward_plan
        tq, tk, tv = describe("q", q), describe("k", k), describe("v", v)
        to, tl, td = describe("o", o), describe("lse", lse), describe("do", do)
        check_qkv(kernel.spec, tq, tk, tv)
        check_backward_arrays(kernel.spec, tq, to, tl, td)
        B, H, M, D = tq.shape
        Hkv, N = tk.shape[1], tk.shape[2]
        if varlen is not None:
            cq, ck, max_q, max_k = varlen
            B = cq.shape[0] - 1
        else:
            max_q, max_k = M, N
        described = check_tensors(kernel.tensor_args, kernel.tensor_index, tensors, tq, B, H, max_q, max_k)
        self.scatters = {n: described[n] for n in bp.scatters}
        self.slot_shapes = {n: tuple(described[n].shape) for n, _ in bp.gradients}
        if deterministic and self.scatters:
            raise ValueError(
                f"deterministic: the gradient of {', '.join(self.scatters)} (a tensor the score gathers) is "
                "scatter-added with atomics, which is not reproducible bit for bit; use deterministic=False"
            )
        self.like, self.varlen, self.deterministic = tq, varlen is not None, deterministic
        # deterministic, where the main kernel orders its additions into dq_accum (a counter per query tile): dQ by
        # the main kernel as by default, unless tensor gradients are asked (their row sums take the dQ kernel)
        self.ordered = deterministic and any(p.name == "dq_semaphore" for p in bp.main.params)
        self.sizes = (B, H, Hkv, max_q, max_k)  # (a varlen call's B and maxima: its own, VarlenSizes)
        # the outputs' prototypes: dense, like q, k, v, never written nor zeroed (their strides are packed); every
        # call's outputs come out with these very strides (`run`)
        self.protos = tuple(self._fresh(t, zeros=False, float32=float32_dkv and t is not tq) for t in (tq, tk, tv))
        self.delta = arrays.empty(tq, (1 if varlen else B, H, M), float32=True)
        accum = not deterministic or self.ordered
        self.dq_accum = arrays.empty(tq, (1 if varlen else B, H, M, D), float32=True) if accum else None
        # a persistent main kernel's work-unit counter (zeroed by the preprocess each call)
        persistent = any(p.name == "tile_counter" for p in bp.main.params)
        self.tile_counter = zeros(tq, (1,), "int32") if persistent else None
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
        self.sparse_reason = None if block_mask is None else sparse_why_not(bp, deterministic)
        sparse = block_mask is not None and self.sparse_reason is None
        self.table = self._table(bp.main_sparse, block_mask, B, H, max_q, max_k) if sparse else None
        self._pack(kernel, a, described, (B, H, Hkv, max_q, max_k), varlen[:2] if varlen else None)
        self.c_names = {n: c_tensor_name(n) for n in kernel.tensors}
        self.check_arch = kernel.check_arch
        self.device = tq.device
        self.stream = arrays.stream_getter(tq)

    def _table(self, launch, block_mask, B: int, H: int, M: int, N: int) -> tuple[tuple, dict]:
        """The shape of the block mask's transposed table at the block-sparse main kernel's tiles, and its strides
        (the mask made for these sizes: B and H, or None / 1, broadcast)."""
        got = block_mask_shape(block_mask)
        if got[2:] != (M, N) or got[0] not in (None, 1, B) or got[1] not in (None, 1, H):
            raise ValueError(
                f"block_mask: made for (B, H, Q_LEN, KV_LEN) = {got}, but the inputs are ({B}, {H}, {M}, {N})"
            )
        spec = launch.spec
        b, h = (1 if got[0] in (None, 1) else B), (1 if got[1] in (None, 1) else H)
        tiles_m, tiles_n = -(-M // spec.block_m), -(-N // spec.block_n)
        return (b, h, tiles_n, tiles_m), query_tiles_strides(b, h, tiles_m, tiles_n)

    def query_tiles(self, block_mask):
        """The block mask's transposed table at the block-sparse main kernel's tiles (built on first use on the
        caller's stream, then kept in the block mask), checked against this call shape."""
        spec = self.launches["main_sparse"][0].spec
        found = block_mask.tiles(spec.block_m, spec.block_n, self.like).transposed()
        if self.table is None or tuple(found.q_list.shape) != self.table[0]:
            raise ValueError(
                f"block_mask: its transposed table at {spec.block_m}x{spec.block_n} has shape "
                f"{tuple(found.q_list.shape)}, expected {self.table and self.table[0]}"
            )
        return found

    def _pack(self, kernel: KernelLike, a: dict[str, Array], described: dict, sizes: tuple, varlen) -> None:
        """Each role's launch, its arguments packed from the arrays `a` and the call-time tensors, and its grid;
        a main kernel's tensor maps (the wgmma tier's), refreshed with the addresses per call."""
        from ..backend import tiers

        bp = kernel.backward_plan
        H, Hkv = sizes[1], sizes[2]
        totals = (a["q"].shape[2], a["k"].shape[2])
        self.launches: dict = {}  # by role: preprocess, main, main_grads (the tensors' gradients asked for), last
        self.maps: dict = {}
        roles = dict(preprocess=bp.preprocess, main=bp.main, main_grads=bp.main_grads, convert=bp.convert)
        roles["dq"] = bp.dq if self.deterministic else None
        roles["main_sparse"] = bp.main_sparse if self.table is not None else None
        for role, launch in roles.items():
            if launch is None:
                continue
            pack = ArgPack(launch.params)
            B, max_q, max_k, offsets = row_pass(role, sizes, totals, varlen)
            values = backward_pack_values(launch.params, a, H // Hkv, max_q, max_k, offsets)
            if role == "main_sparse" and self.table is not None:
                values.update(self.table[1])  # (the table's addresses are written per call)
            if any(p.name == "dq_sem_tiles" for p in launch.params):
                values["dq_sem_tiles"] = -(-max_q // launch.spec.block_m)  # the counters' row, at its own tiles
            names = {p.name for p in launch.params}
            values.update({n: v for n, v in tensor_values(kernel.tensor_args, described).items() if n in names})
            if "grid_n" in names:  # (a persistent main kernel: its work grid, written per call)
                values.update(work_grid(launch.grid(B, H, Hkv, max_q, max_k)), tile_counter=0)
            pack.set(values)
            maps = {p.name: pack.values[pack.index[p.name]] for p in launch.params if p.pack == "tmap"}
            if maps:  # (deterministic: no dq_accum, whose map stays unset and unread)
                mapped = {n: x for n, x in a.items() if n != "dq_accum" or self.dq_accum is not None}
                self.maps[role] = tiers.get(launch.spec.tier).prepare(maps, mapped, launch.spec)
            grid = launch.grid(B, H, Hkv, max_q, max_k)
            self.launches[role] = (launch, pack, grid)

    def _fresh(self, t, zeros: bool, float32: bool = False):
        """A dense output like `t` (an Array or an output made before), zeros where `zeros` (run: a varlen output
        whose rows outside every sequence no kernel writes), in float32 where `float32` (a prototype). Dense, so that
        empty_like/zeros_like keep its strides."""
        x = t.obj if isinstance(t, Array) else t
        if arrays.library(x) == "torch":
            import torch

            if isinstance(t, Array) and (float32 or not _dense(x)):
                x = torch.empty(x.shape, dtype=torch.float32 if float32 else x.dtype, device=x.device)
            return torch.zeros_like(x) if zeros else torch.empty_like(x)
        import cupy

        with cupy.cuda.Device(x.device.id):
            if isinstance(t, Array) and (float32 or not _dense(x)):
                x = cupy.empty(x.shape, dtype=cupy.float32 if float32 else x.dtype)
            return cupy.zeros_like(x) if zeros else cupy.empty_like(x)

    def run(
        self,
        q,
        k,
        v,
        o,
        lse,
        do,
        scale_log2: float,
        tensors: dict,
        tensor_grads: bool = True,
        stream=None,
        block_mask=None,
        rows: list | None = None,
        varlen: VarlenSizes | None = None,
    ) -> Gradients:
        """Launch on `stream` (a raw handle; default: the caller's current stream), with a varlen call's own offsets
        and maxima where given (`per_call`); the block-sparse main kernel
        where a block mask is given and it runs (`sparse_reason`) and no tensor's gradient is asked for. `rows`: a
        list that takes the call's RowSums where a tensor read as name[h] / [b] / [b, h] has its gradient taken,
        that gradient then left uncorrected (`corrected` applies the row sums, summed over calls)."""
        gradients = self.gradients if tensor_grads else ()
        # the dQ kernel computes dQ (dq_accum null) where a deterministic call cannot order the main kernel's additions
        by_dq_kernel = self.deterministic and (not self.ordered or bool(gradients))
        # varlen: dQ starts as zeros where the dQ kernel writes it (a sequence's rows only), else the convert writes
        # every row (row_pass), those outside every sequence 0; the preprocess writes 0 into dK's and dV's rows
        # outside every sequence (before the first, after the last) and the main kernel the rest
        dq = self._fresh(self.protos[0], zeros=self.varlen and by_dq_kernel)
        dk, dv = (self._fresh(p, zeros=False) for p in self.protos[1:])
        accum = 0 if by_dq_kernel else ptr(self.dq_accum)
        B, H, _, max_q, _ = self.sizes if varlen is None else (varlen.batch, *self.sizes[1:3], *varlen[3:])
        sem_shape = (B, H, -(-max_q // self.launches["main"][0].spec.block_m))  # a counter per query tile of a head
        counters = zeros(self.like, sem_shape, "int32") if self.ordered and not by_dq_kernel else None
        rowstat = zeros(self.like, self.rowstat_shape) if gradients else 0  # null: the kernels skip the tensors' sums
        dynamic = (q, k, v, o, lse, do, dq, dk, dv, self.delta, accum, self.dtensor, rowstat)
        ptrs: dict = {n: x if isinstance(x, int) else ptr(x) for n, x in zip(BACKWARD_DYNAMIC, dynamic)}
        ptrs["dq_semaphore"] = 0 if counters is None else ptr(counters)  # null: additions in any order
        ptrs["tile_counter"] = 0 if self.tile_counter is None else ptr(self.tile_counter)
        ptrs.update(scale_log2=scale_log2, **{c: ptr(tensors[n]) for n, c in self.c_names.items()})
        scattered = {}
        for name, t in self.scatters.items():  # float32, dense, the tensor's shape: the kernel adds into it
            scattered[name] = zeros(self.like, t.shape)
            ptrs[c_grad_name(name)] = ptr(scattered[name])
        stream = self.stream() if stream is None else stream
        main = "main_grads" if gradients else "main"
        if block_mask is not None and self.table is not None and not gradients:
            table = self.query_tiles(block_mask)
            main = "main_sparse"
            ptrs.update(q_count=ptr(table.q_count), q_list=ptr(table.q_list))
        for role in ("preprocess", main, "dq" if by_dq_kernel else "convert"):
            launch, pack, grid = self.launches[role]
            own, grid = self.per_call(role, launch, grid, varlen)
            if "grid_n" in pack.index:  # (a persistent main kernel)
                own, grid = {**own, **work_grid(grid)}, persistent_grid(grid, self.device)
            with pack.lock:
                pack.update({p.name: ptrs[p.name] for p in launch.params if p.name in ptrs})
                pack.update(own)
                if role in self.maps:
                    self.maps[role].update(ptrs["q"], ptrs["k"], ptrs["v"], ptrs["dout"])
                launch.function.launch(self.device, stream, grid, launch.threads, pack, self.check_arch)
        if rows is not None and gradients:
            raw, sums = self._row_sums(gradients, rowstat)
            rows.append(sums)
            return Gradients(dq, dk, dv, {**raw, **scattered})
        return Gradients(dq, dk, dv, {**self._tensor_grads(gradients, rowstat), **scattered})

    def per_call(self, role: str, launch, grid: tuple, varlen: VarlenSizes | None) -> tuple[dict, tuple]:
        """A varlen call's own arguments of a launch and the grid they give: the offsets' addresses, the maxima and
        the deterministic counters' row (at its tiles). The row passes take every packed row: of them only the
        preprocess gets the key offsets and the number of sequences (it zeroes dK's and dV's rows outside them)."""
        if varlen is None:
            return {}, grid
        names = {p.name for p in launch.params}
        if role in ROW_PASSES:
            own = dict(cu_seqlens_k=varlen.cu_seqlens_k, sequences=varlen.batch)
            return {n: x for n, x in own.items() if n in names}, grid
        H, Hkv = self.sizes[1:3]
        own = dict(cu_seqlens_q=varlen.cu_seqlens_q, cu_seqlens_k=varlen.cu_seqlens_k, seqlen_q=varlen.max_q)
        own.update(seqlen_k=varlen.max_k, dq_sem_tiles=-(-varlen.max_q // launch.spec.block_m))
        grid = launch.grid(varlen.batch, H, Hkv, varlen.max_q, varlen.max_k)
        return {n: x for n, x in own.items() if n in names}, grid

    def _tensor_grads(self, gradients: tuple, rowstat) -> dict:
        """The gradient of each tensor read as name[b], name[h] or name[b, h], in its shape: the slots [B, H, key
        tiles] summed in a fixed order, over all but the tensor's index; less sum_i E_i R_i (contract: rowstat),
        in float64."""
        grads: dict = {}
        for slot, (name, index) in enumerate(gradients):
            axes = SLOT_AXES[index]
            total = _sum(self.dtensor[slot], axes) - _sum(_f64(rowstat[0]) * _f64(rowstat[1 + slot]), axes)
            total = _fit(total, self.slot_shapes[name])
            grads[name] = total if name not in grads else grads[name] + total
        return grads

    def _row_sums(self, gradients: tuple, rowstat) -> tuple[dict, RowSums]:
        """The tensors' slot sums in their shapes, uncorrected (float32), and the call's RowSums: E_i, and R_i by
        (name, index), summed over the slots of that read (float64)."""
        raw: dict = {}
        r: dict = {}
        for slot, (name, index) in enumerate(gradients):
            total = _fit(_sum(self.dtensor[slot], SLOT_AXES[index]), self.slot_shapes[name])
            raw[name] = total if name not in raw else raw[name] + total
            stat = _f64(rowstat[1 + slot])
            r[name, index] = stat if (name, index) not in r else r[name, index] + stat
        return raw, RowSums(_f64(rowstat[0]), r, dict(self.slot_shapes))


class RowSums(NamedTuple):
    """What corrects the gradient of a tensor read as name[h] / [b] / [b, h] (contract: rowstat), for a caller that
    splits each row's keys over several calls (fagen.ring): `e` [B, H, M] the rows' E_i = sum_j dS_ij, `r` by
    (name, index) the rows' R_i = sum_j P_ij g_ij (float64), `shapes` the tensors' shapes. E_i R_i is a product of
    whole-row sums: e and r are summed over every call that covers a row's keys before `corrected` takes them."""

    e: object
    r: dict
    shapes: dict


def corrected(tensors: dict, e, r: dict, shapes: dict) -> dict:
    """The tensors' gradients from their uncorrected sums over calls (`tensors`, by name) and the row sums e [B, H,
    M] and r (RowSums'), each summed over the calls: less sum_i E_i R_i (float64) over the axes a read leaves (for
    the tensors given: r may hold tensors whose gradient no one asked for)."""
    out = dict(tensors)
    for (name, index), stat in r.items():
        if name in out:
            out[name] = out[name] - _fit(_sum(_f64(e) * _f64(stat), SLOT_AXES[index]), shapes[name])
    return out


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
        if sep and not name.startswith("tensor_") and name not in ("q_count", "q_list"):  # (their own: _table)
            dims = _BWD_DIMS.get(name, "bhmd")
            packed = varlen and dim == "b" and name != "rowstat"
            values[p.name] = 0 if packed else a[name].strides[dims.index(dim)] * _storage_units(name, a)
    sizes = dict(
        heads_per_kv=heads_per_kv,
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        cu_seqlens_q=varlen[0].ptr if varlen else 0,
        cu_seqlens_k=varlen[1].ptr if varlen else 0,
        total_q=a["q"].shape[2],
        total_k=a["k"].shape[2],
        heads_kv=a["k"].shape[1],
        sequences=0,  # (the preprocess's: a varlen call writes its own, per_call)
        dkv_float32=int("dk" in a and a["dk"].dtype == "f32"),  # (float32 storage: either store is the same)
    )
    names = {p.name for p in params}
    values.update({n: v for n, v in sizes.items() if n in names})
    return values


def _storage_units(name: str, a: dict[str, Array]) -> int:
    """Storage elements an element of array `name` spans: 2 for float32 dK, dV of 16-bit inputs (the kernel addresses
    them through storage_t pointers, contract.BWD's dkv_float32), else 1."""
    return 2 if name in ("dk", "dv") and a[name].dtype == "f32" != a["q"].dtype else 1


def backward_pack_values(params: tuple[Param, ...], a: dict[str, Array], heads_per_kv, seqlen_q, seqlen_k, varlen):
    """Every argument of a backward kind for one call shape: the static ones (backward_values), and 0 for the
    per-call ones (the arrays' addresses, the scale, the call-time tensors) that BackwardCall.run writes."""
    values = backward_values(params, a, heads_per_kv, seqlen_q, seqlen_k, varlen)
    for p in params:
        if p.name not in values and p.pack in ("ptr", "f32"):
            values[p.name] = 0.0 if p.pack == "f32" else 0
    return values


# The backward's passes that work row by row, whatever sequence a row is in: D_i = rowsum(dO_i ∘ O_i) with the dQ
# accumulator's row zeroed, and dQ_i converted from it.
ROW_PASSES = ("preprocess", "convert")
# Tried and not kept: the main kernel and the convert launched as programmatic dependents of the kernel before them
# (cuLaunchKernelEx; griddepcontrol.wait at their top, launch_dependents at the preprocess's and main kernel's). H200,
# 2026-11-29, one process, the two launch modes in turn (the same kernels): backward 0.982-1.011x, forward + backward
# 0.945-1.004x (d64-d128, causal and not, 2k-8k, a 256-key window at 4k and 16k): within the runs' spread or slower.


def row_pass(role: str, sizes: tuple, totals: tuple, varlen) -> tuple:
    """(batch, max_q, max_k, offsets) a launch of `role` runs over, from the call's `sizes` (B, H, Hkv, max_q, max_k),
    its packed `totals` (total_q, total_k) and `varlen` (the offsets' Arrays, or None). A varlen call's row passes
    (ROW_PASSES) take every packed row as one sequence: a grid of total_q rows with none past a sequence's end (B
    sequences of max_q rows leave blocks with no rows where the sequences are short), the rows outside every
    sequence included, so the accumulator is zero there and dQ comes out 0 with no zero fill of its own."""
    B, _, _, max_q, max_k = sizes
    if varlen is not None and role in ROW_PASSES:
        return 1, totals[0], totals[1], None
    return B, max_q, max_k, varlen


# What BackwardCall.run writes per call (beside the call-time tensors): every other argument is static.
BACKWARD_DYNAMIC = (
    *("q", "k", "v", "o", "lse", "dout", "dq", "dk", "dv", "delta", "dq_accum", "dtensor", "rowstat"),
    "scale_log2",
    "tile_counter",  # (the persistent main kernel's; the preprocess zeroes it)
)


def _dense(x) -> bool:
    """Whether an array's elements fill its memory without gaps or overlaps (any order of the dims)."""
    strides = x.stride() if arrays.library(x) == "torch" else tuple(s // x.dtype.itemsize for s in x.strides)
    expect = 1
    for size, stride in sorted(zip(x.shape, strides), key=lambda t: t[1]):
        if size > 1 and stride != expect:
            return False
        expect *= size
    return True


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


def work_grid(grid: tuple) -> dict:
    """A persistent main kernel's work grid (key tiles, KV heads, batch) among its arguments."""
    return dict(grid_n=grid[0], grid_h=grid[1], grid_b=grid[2])


def persistent_grid(grid: tuple, device: int) -> tuple:
    """The launch grid of a persistent main kernel over the work grid `grid`: a block per SM, fewer where there are
    fewer units (every call, varlen and deterministic ones too, draws units from its counter), one-dimensional."""
    from ..backend.tiers import wgmma

    units = grid[0] * grid[1] * grid[2]
    blocks = wgmma.BWD_PERSISTENT_BLOCKS or wgmma.sm_count(device)
    return (max(1, min(units, blocks)), 1, 1)
