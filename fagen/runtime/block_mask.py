"""Run-time block sparsity: the block-mask kernel's launch (contract.Kind.BLOCK_MASK) and what it builds.

A block mask at tiles block_m x block_n is two int32 arrays on the GPU: for each (b, h, query tile), the
non-empty key tiles in ascending order, `kv_list` [B', H', query tiles, key tiles] (entry 2 j + 1 for a full
key tile j, where the forward does not evaluate the mask, 2 j for a partial one) and their number `kv_count`
[B', H', query tiles]; B' and H' are 1 where the mask is broadcast over batch or heads. One list with a flag
(rather than FlexAttention's separate lists of partial and full tiles) lets every tier's forward walk a single
sequence of tiles with its loop unchanged: the wgmma tier's TMA producer and its consumer warpgroups index the
same list, from its last entry to its first. `BlockTiles.flex_views` gives FlexAttention's four arrays.

The backward walks the transposed table (`BlockTiles.transposed`, FlexAttention's q_num_blocks / q_indices and
full_q_*): per (b, h, key tile), the query tiles that see some key of it, `q_list` [B', H', key tiles, query tiles]
with the same flag (2 i + 1 full, 2 i partial) and `q_count` [B', H', key tiles], made from the block mask on the
GPU (`transpose`: a handful of array operations, on the stream that built it, once) at the backward's own tiles.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..backend.contract import c_tensor_name
from ..backend.spec import runs_on
from . import arrays
from .launch import ArgPack


@dataclass(frozen=True)
class BlockTiles:
    """A block mask built at one tile size: kv_count [B', H', tiles_m] and kv_list [B', H', tiles_m, tiles_n]
    (int32, on the device; entries of kv_list past kv_count are unspecified)."""

    block_m: int
    block_n: int
    kv_count: object
    kv_list: object
    _transposed: list = field(default_factory=list, compare=False, repr=False)  # QueryTiles, made on first need

    def transposed(self) -> QueryTiles:
        """The transposed table (per key tile, the query tiles that see it: `transpose`), made on first use on the
        caller's current stream (this table's: a BlockMask keeps one per stream) and kept."""
        if not self._transposed:
            self._transposed.append(transpose(self))
        return self._transposed[0]

    def flex_views(self):
        """FlexAttention's (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices) as torch tensors:
        the partial tiles and the full tiles, each in ascending order, counts [B', H', tiles_m] and indices
        [B', H', tiles_m, tiles_n] (unused entries 0)."""
        import torch

        count, entries = torch.as_tensor(self.kv_count), torch.as_tensor(self.kv_list)
        n = entries.shape[-1]
        valid = torch.arange(n, device=entries.device) < count[..., None]
        full = valid & (entries % 2 == 1)
        partial = valid & (entries % 2 == 0)
        out = []
        for chosen in (partial, full):
            # stable: the chosen entries first, in their (ascending) order, then zeros
            order = torch.sort((~chosen).to(torch.int8), dim=-1, stable=True).indices
            idx = torch.where(chosen, entries // 2, 0).gather(-1, order)
            out += [chosen.sum(-1).to(torch.int32), idx.to(torch.int32)]
        return tuple(out)


@dataclass(frozen=True)
class QueryTiles:
    """A block mask's transposed table at block_m x block_n: q_count [B', H', tiles_n] and q_list [B', H', tiles_n,
    tiles_m] (int32, on the device): per key tile, the query tiles that see some key of it, ascending, entry
    2 i + 1 for a full query tile i, 2 i for a partial one (entries past q_count are 0)."""

    block_m: int
    block_n: int
    q_count: object
    q_list: object


def transpose(tiles: BlockTiles) -> QueryTiles:
    """The transposed table of a block mask (torch or CuPy arrays, on their device and current stream): the tiles'
    states (0 empty, 1 partial, 2 full) scattered into a [B', H', tiles_m, tiles_n] grid from the lists, read by
    key tile, and each key tile's non-empty query tiles placed at their rank among them (a cumulative count: no
    sort). Unlisted entries go to a spare column, dropped at the end."""
    xp = _Ops(tiles.kv_list)
    count: Any = tiles.kv_count  # (torch or CuPy arrays)
    entries: Any = tiles.kv_list
    B, H, tm, tn = (int(n) for n in entries.shape)
    b, h, m = xp.grid(B, H, tm)
    listed = xp.arange(tn)[None, None, None, :] < count[..., None]
    column = xp.where(listed, entries // 2, tn)  # the spare column tn takes the unlisted entries
    state = xp.zeros((B, H, tm, tn + 1))
    state[b, h, m, column] = xp.where(listed, 1 + entries % 2, 0)
    by_key = state[..., :tn].swapaxes(-1, -2)  # [B', H', tn, tm]
    seen = by_key > 0
    rank = xp.where(seen, seen.cumsum(-1) - 1, tm)  # the spare column tm takes the empty ones
    bk, hk, n = xp.grid(B, H, tn)
    q_list = xp.zeros((B, H, tn, tm + 1))
    q_list[bk, hk, n, rank] = xp.where(seen, 2 * xp.arange(tm)[None, None, None, :] + (by_key == 2), 0)
    return QueryTiles(tiles.block_m, tiles.block_n, xp.int32(seen.sum(-1)), xp.contiguous(q_list[..., :tm]))


class _Ops:
    """The few array operations `transpose` needs, for torch tensors or CuPy arrays (int32, on `like`'s device)."""

    def __init__(self, like):
        self.torch = arrays.library(like) == "torch"
        if self.torch:
            import torch

            self.lib, self.device = torch, like.device
        else:
            import cupy

            self.lib, self.device = cupy, None
        self.where = self.lib.where

    def arange(self, n: int):
        if self.torch:
            return self.lib.arange(n, device=self.device, dtype=self.lib.int32)
        return self.lib.arange(n, dtype=self.lib.int32)

    def zeros(self, shape: tuple):
        if self.torch:
            return self.lib.zeros(shape, device=self.device, dtype=self.lib.int32)
        return self.lib.zeros(shape, dtype=self.lib.int32)

    def grid(self, *sizes: int) -> tuple:
        """Index arrays over `sizes` broadcasting against a trailing dimension (advanced indexing's)."""
        shapes = [[1] * (len(sizes) + 1) for _ in sizes]
        for i, n in enumerate(sizes):
            shapes[i][i] = n
        return tuple(self.arange(n).reshape(shape) for n, shape in zip(sizes, shapes))

    def int32(self, x):
        return x.to(self.lib.int32) if self.torch else x.astype(self.lib.int32)

    def contiguous(self, x):
        return x.contiguous() if self.torch else self.lib.ascontiguousarray(x)


def _check_arch(arch: str):
    def check(major: int, minor: int, device: int):
        if not runs_on(arch, major, minor):
            raise ValueError(
                f"block mask kernel compiled for {arch}; device {device} has compute capability {major}.{minor}"
            )

    return check


def current_stream(where) -> tuple[int, bool]:
    """The caller's current stream on `where`'s device (anything with .kind, "torch" or "cupy", and .device) as a
    raw handle, and whether it is capturing a CUDA graph: block tables belong to the stream that built them."""
    from .calls import capturing

    stream = arrays.stream_getter(where)()
    return stream, capturing(stream)


def _int32(kind: str, device: int, shape: tuple):
    if kind == "torch":
        import torch

        return torch.empty(shape, dtype=torch.int32, device=f"cuda:{device}")
    import cupy

    with cupy.cuda.Device(device):
        return cupy.empty(shape, dtype=cupy.int32)


def values(params, kv_count: int, kv_list: int, M: int, N: int, tensors: dict) -> dict:
    """Every argument of a BLOCK_MASK kernel (its parameter list `params`): the two arrays' addresses, the sizes,
    and each call-time tensor its mask reads (`tensors`: name -> Array): address, element strides, sizes."""
    out = dict(kv_count=kv_count, kv_list=kv_list, seqlen_q=M, seqlen_k=N)
    for name, t in tensors.items():
        c = c_tensor_name(name)
        out[c] = t.ptr
        out.update({f"{c}_stride_{d}": s for d, s in enumerate(t.strides)})
        out.update({f"{c}_size_{d}": n for d, n in enumerate(t.shape)})
    missing = [p.name for p in params if p.name not in out]
    if missing:
        raise TypeError(
            f"{missing[0]}: the block mask's mask_mod reads a tensor this argument belongs to; pass it, with the "
            "rank it was compiled for"
        )
    names = {p.name for p in params}
    return {n: v for n, v in out.items() if n in names}


def build(launch, B: int, H: int, M: int, N: int, kind: str, device: int, tensors: dict | None = None) -> BlockTiles:
    """Run the block-mask kernel `launch` (fagen.builders.build_block_mask_launch) for B x H (1 where the mask
    is broadcast) over M queries and N keys, on the caller's current stream of `device` ("torch" or "cupy"
    arrays). `tensors`: the call-time tensors its mask reads, by name."""
    spec = launch.spec
    tiles_m, tiles_n = -(-M // spec.block_m), -(-N // spec.block_n)
    count = _int32(kind, device, (B, H, tiles_m))
    entries = _int32(kind, device, (B, H, tiles_m, tiles_n))
    like = arrays.describe("kv_count", count)
    given = {n: arrays.describe(n, x) for n, x in (tensors or {}).items()}
    pack = ArgPack(launch.params)
    pack.set(values(launch.params, like.ptr, arrays.describe("kv_list", entries).ptr, M, N, given))
    stream = arrays.stream_getter(like)()
    launch.function.launch(device, stream, launch.grid(B, H, M), launch.threads, pack, _check_arch(spec.arch))
    return BlockTiles(spec.block_m, spec.block_n, count, entries)
