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
Tables at tiles that nest with ones a BlockMask already holds (the backward's 64x128 in the forward's 128x128) are
`derive`d from those, the mask not evaluated again (why that is exact: `derive`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..backend.contract import c_tensor_name
from ..backend.spec import runs_on
from . import arrays
from .launch import ArgPack


class BlockTiles:
    """A block mask built at one tile size: kv_count [B', H', tiles_m] and kv_list [B', H', tiles_m, tiles_n]
    (int32, on the device; entries of kv_list past kv_count are unspecified). Tables `derive`d from another tile
    size hold the tiles' states instead and make the lists on first read."""

    def __init__(self, block_m: int, block_n: int, kv_count=None, kv_list=None, *, state=None):
        if state is None and (kv_count is None or kv_list is None):
            raise TypeError("BlockTiles: pass kv_count and kv_list, or state")
        self.block_m, self.block_n = block_m, block_n
        self._lists: Any = None if kv_count is None else (kv_count, kv_list)
        self._state: Any = state
        self._transposed: QueryTiles | None = None  # made on first need

    def __repr__(self):
        return f"BlockTiles({self.block_m}x{self.block_n})"

    @property
    def kv_count(self):
        return self._kv_lists()[0]

    @property
    def kv_list(self):
        return self._kv_lists()[1]

    def _kv_lists(self) -> tuple:
        if self._lists is None:
            self._lists = compact(self._state)
        return self._lists

    def state(self):
        """The tiles' states [B', H', tiles_m, tiles_n] (0 empty, 1 partial, 2 full; int32), made from the lists on
        first need (`states`) and kept."""
        if self._state is None:
            self._state = states(self)
        return self._state

    def transposed(self) -> QueryTiles:
        """The transposed table (per key tile, the query tiles that see it: `transpose`), made on first use on the
        caller's current stream (this table's: a BlockMask keeps one per stream) and kept."""
        if self._transposed is None:
            self._transposed = transpose(self)
        return self._transposed

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


def table_strides(name: str, row: str, b: int, h: int, rows: int, cols: int) -> dict:
    """A kernel's strides of a contiguous table {name}_count [b, h, rows] and {name}_list [b, h, rows, cols], 0 along
    a broadcast batch (b = 1) or head (h = 1) dimension: the forward's kv tables (rows: query tiles, row "m"), the
    backward's transposed q tables (rows: key tiles, row "n")."""
    return {
        f"{name}_count_stride_b": 0 if b == 1 else h * rows,
        f"{name}_count_stride_h": 0 if h == 1 else rows,
        f"{name}_list_stride_b": 0 if b == 1 else h * rows * cols,
        f"{name}_list_stride_h": 0 if h == 1 else rows * cols,
        f"{name}_list_stride_{row}": cols,
    }


def transpose(tiles: BlockTiles) -> QueryTiles:
    """The transposed table of a block mask (torch or CuPy arrays, on their device and current stream): its
    tiles' states read by key tile (a view), each key tile's non-empty query tiles compacted in order (`compact`).
    A handful of array operations, no host synchronisation."""
    q_count, q_list = compact(tiles.state().swapaxes(-1, -2))
    return QueryTiles(tiles.block_m, tiles.block_n, q_count, q_list)


def states(tiles: BlockTiles):
    """The tiles' states [B', H', tiles_m, tiles_n] (0 empty, 1 partial, 2 full; int32) from the lists: each
    listed entry scattered to its key tile, the unlisted ones to a spare column tn, dropped (a view without it)."""
    count: Any = tiles.kv_count  # (torch or CuPy arrays)
    entries: Any = tiles.kv_list
    xp = _Ops(entries)
    tn = int(entries.shape[-1])
    listed = xp.arange(tn) < count[..., None]
    state = xp.zeros((*entries.shape[:-1], tn + 1))
    xp.scatter(state, xp.where(listed, entries >> 1, tn), 1 + (entries & 1))
    return state[..., :tn]


def compact(state) -> tuple:
    """Per row of a state grid [B', H', R, C] (any strides), its non-empty columns in ascending order as entries
    2 c + 1 (full) or 2 c (partial), zeros past their number: (count [B', H', R], list [B', H', R, C]), int32 and
    contiguous. Each column goes to its rank among the non-empty ones (a cumulative count: no sort), the empty
    ones to a spare slot 0, dropped."""
    xp = _Ops(state)
    C = int(state.shape[-1])
    seen = state > 0
    rank = seen.cumsum(-1)  # 1 + the rank of a non-empty column; its last value, the row's count
    out = xp.zeros((*state.shape[:-1], C + 1))
    xp.scatter(out, rank * seen, xp.arange(C, step=2) + (state >> 1))
    return xp.int32(rank[..., -1]), xp.contiguous(out[..., 1:])


def nests(have: tuple[int, int], want: tuple[int, int]) -> bool:
    """Whether tables at tiles `want` derive from tables at tiles `have` (`derive`): along each dimension one tile
    size divides the other."""
    return all(a % b == 0 or b % a == 0 for a, b in zip(have, want))


def derive(source: BlockTiles, block_m: int, block_n: int, M: int, N: int) -> BlockTiles:
    """The block mask at block_m x block_n over M queries and N keys, from its tables at tiles that nest with
    those (`nests`), without evaluating the mask: a few array operations on the tiles' states, on the caller's
    stream. A tile's state says whether none (empty), some (partial) or all (full) of its in-bounds (query, key)
    pairs are kept. Along a dimension where the new tile divides the old, each new tile is a part of an old one:
    the pairs of a part of an empty tile are none kept (empty), of a full one all kept (full), of a partial one
    unknown, so partial: the kernels evaluate the mask on partial tiles, so a partial tile that is in fact empty
    or full costs a visit or a mask evaluation and changes no result. Where the old tile divides the new, each
    new tile is the union of whole old tiles (those past the end do not exist): empty where all are empty, full
    where all are full, else partial, exact. So the derived tables skip only empty tiles and leave the mask out
    only on full ones, as the block-mask kernel's; they are its tables where every dimension coarsens or keeps
    its size, and may mark partial a tile it would call empty or full where one refines."""
    xp = _Ops(source.kv_list if source._state is None else source._state)
    by_key = _resample(xp, source.state(), source.block_n, block_n, -(-N // block_n)).swapaxes(-1, -2)
    by_key = _resample(xp, by_key, source.block_m, block_m, -(-M // block_m))
    return BlockTiles(block_m, block_n, state=by_key.swapaxes(-1, -2))


def _resample(xp: _Ops, state, have: int, want: int, tiles: int):
    """A state grid's last dimension from tiles of `have` to `tiles` tiles of `want` (one divides the other)."""
    n = int(state.shape[-1])
    if have == want:
        return state
    if have % want == 0:  # refine: each new tile takes its old tile's state
        r = have // want
        return xp.lib.broadcast_to(state[..., None], (*state.shape, r)).reshape(*state.shape[:-1], n * r)[..., :tiles]
    c = want // have  # coarsen: the union of c old tiles; the last padded with copies of the last old one (neutral)
    pad = tiles * c - n
    if pad:
        last = xp.lib.broadcast_to(state[..., -1:], (*state.shape[:-1], pad))
        state = xp.lib.concatenate([state, last], axis=-1)
    groups = state.reshape(*state.shape[:-1], tiles, c)
    most, least = xp.lib.amax(groups, -1), xp.lib.amin(groups, -1)
    return ((most + 1) >> 1) + (least == 2)  # 0 where all are empty, 2 where all are full, else 1


class _Ops:
    """The few array operations the tables need, for torch tensors or CuPy arrays (int32, on `like`'s device)."""

    def __init__(self, like):
        self.torch = arrays.library(like) == "torch"
        if self.torch:
            import torch

            self.lib, self.device = torch, like.device
        else:
            import cupy

            self.lib, self.device = cupy, None
        self.where = self.lib.where

    def arange(self, n: int, step: int = 1):
        if self.torch:
            return self.lib.arange(0, n * step, step, device=self.device, dtype=self.lib.int32)
        return self.lib.arange(0, n * step, step, dtype=self.lib.int32)

    def zeros(self, shape: tuple):
        if self.torch:
            return self.lib.zeros(shape, device=self.device, dtype=self.lib.int32)
        return self.lib.zeros(shape, dtype=self.lib.int32)

    def scatter(self, target, index, values) -> None:
        """target[..., index[..., j]] = values[..., j] along the last dimension (index and values of one shape,
        the leading dimensions target's); where several j share an index, any one of them."""
        if self.torch:
            target.scatter_(-1, index.to(self.lib.int64), values)
            return
        lead = [
            self.lib.arange(n).reshape([n if i == d else 1 for i in range(index.ndim)])
            for d, n in enumerate(index.shape[:-1])
        ]
        target[tuple(lead) + (index,)] = values

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
