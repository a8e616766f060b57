"""The argument checks the ops share, run once per call shape (fagen.runtime.calls): each error names the
argument and says what was expected."""

from __future__ import annotations

import math

from ..backend.contract import LOG2E, TensorArg, tensor_dtype
from ..backend.spec import KernelSpec
from .arrays import Array, describe


def check_qkv(spec: KernelSpec, tq: Array, tk: Array, tv: Array) -> None:
    """q [B, H, M, D], k, v [B, Hkv, N, D] against the compiled head dim and dtype, and against each other."""
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


def check_output(spec: KernelSpec, name: str, x, like: Array, shape, float32: bool):
    """An output passed by the caller (out=, out_lse=): like's library and device, `shape`, the compiled dtype
    (float32 for lse)."""
    t = describe(name, x)
    want = "f32" if float32 else spec.dtype
    if t.kind != like.kind or t.device != like.device:
        raise TypeError(f"{name}: expected a {like.kind} array on device {like.device}")
    if t.shape != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {t.shape}")
    if t.dtype != want:
        raise TypeError(f"{name}: expected dtype {want}, got {t.dtype_name}")
    return x


def check_tensors(
    args: tuple[TensorArg, ...], index: dict[str, str], given: dict, tq: Array, B: int, H: int, M: int = 0, N: int = 0
) -> dict[str, Array]:
    """The call-time tensors, checked against what the kernel was compiled for (`args`, and `index`: name -> "h",
    "b" or "bh", or its reads in text): on q's device, of its library, the compiled dtype and rank, no empty
    dimension; a per-head / per-batch vector (name[h], name[b]) of at least H / B entries; a dimension every read
    indexes by a bare b, h, q or k of size 1 (broadcast) or at least B, H, M, N. Any strides (0: broadcast). The kernels
    clamp every index to the tensor, so sizes never make a read leave it."""
    names = tuple(arg.name for arg in args)
    missing = [n for n in names if n not in given]
    unknown = [n for n in given if n not in names]
    if unknown:
        raise TypeError(
            f"{unknown[0]}: this kernel takes no tensor of that name (it takes: {', '.join(names) or 'none'})"
        )
    if missing:
        raise TypeError(f"{missing[0]}: this kernel's program reads {missing[0]}[...]; pass {missing[0]}=...")
    out = {}
    extent = {"b": ("batch", B), "h": ("heads", H), "q": ("queries", M), "k": ("keys", N)}
    for arg in args:
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
        slot = index.get(name)
        if arg.rank == 1 and slot in ("h", "b"):  # (longer: entries no index reaches; their gradient is 0)
            what, want = extent[slot]
            if t.shape[0] < want:
                raise ValueError(
                    f"{name}: expected a vector of at least {want} entries ({what}), got shape {t.shape} {t.dtype_name}"
                )
        for d, (size, dim) in enumerate(zip(t.shape, arg.dims)):
            if dim in extent and extent[dim][1] and size != 1 and size < extent[dim][1]:
                what, want = extent[dim]
                raise ValueError(
                    f"{name}: dimension {d} is indexed by {dim}, so it needs 1 (broadcast) or at least {want} "
                    f"entries ({what}); got shape {t.shape}"
                )
        out[name] = t
    return out


def check_packed(**given) -> None:
    """Varlen's packed arrays, by name: 3 dimensions [total, heads, D] each."""
    for name, x in given.items():
        if len(getattr(x, "shape", ())) != 3:
            raise ValueError(
                f"{name}: expected 3 dimensions [total, heads, D] for varlen, got shape "
                f"{tuple(getattr(x, 'shape', ()))}"
            )


def check_offsets(tq: Array, cq: Array, ck: Array, max_seqlen_q, max_seqlen_k) -> None:
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


def validate_offsets(cu_q, cu_k, totals, maxima) -> None:
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


def check_flag(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected True or False, got {value!r}")


def check_scale(scale) -> float:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) and type(scale).__module__ != "numpy":
        raise ValueError(f"scale: expected a finite positive number, got {scale!r}")
    value = float(scale)
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(f"scale: expected a finite positive number, got {scale!r}")
    return value


def scale_log2(default: float, scale) -> float:
    """The softmax scale times log2(e), as the kernels take it: `scale`, checked, or the kernel's default."""
    return (default if scale is None else check_scale(scale)) * LOG2E
