"""The ring's copy-engine links: K/V and dK/dV moved between the GPUs of one host by their copy engines, with no
kernel on either side.

NCCL's point-to-point runs as kernels. Beside fagen's persistent forward, which holds every SM, a step's transfer
then waits for the kernel before it to end, and a peer's transfer kernel spins on SMs its own kernel lacks
(docs/context_parallel.md has the timelines). Here each rank owns a **mailbox**, device memory that every other rank
of the group maps (CUDA IPC): two slots for K/V and two for dK/dV, each slot two tensors, and eight 32-bit flags. A
sender copies its rows straight into the receiver's slot with cudaMemcpy2DAsync (a copy engine, over NVLink) on a
stream of its own, and the GPUs signal each other with stream memory operations (cuStreamWriteValue32 /
cuStreamWaitValue32, run by each GPU's front end): no SM is taken, and no host waits.

**The protocol.** Each channel (K/V, dK/dV) numbers its steps: K/V every step of every pass, dK/dV every step of
every backward pass, the same numbers on every rank (the ranks run the same passes in the same order, as NCCL's
matched calls also require). Message n (the data of step n, if that step has any) goes to slot n % 2 with the value
n + 2, and:

- the sender's stream waits until the receiver's FREE flag of that slot is at least n (the receiver is past step
  n - 2, the slot's last use), copies, and writes the receiver's READY flag = n + 2;
- the receiver's stream waits until its READY flag is at least n + 2, runs the step, and writes FREE = n + 2 after
  it, at every step, message or not (so that FREE's values follow the steps with no gap).

Every wait is on a step before the waiter's, on every rank alike (`tests/test_ring_copy.py` runs the protocol on
simulated ranks whose GPUs take their work in one queue), so the ranks cannot wait on each other in a circle, also
when the driver puts the streams on one hardware queue (CUDA_DEVICE_MAX_CONNECTIONS=1). The comparisons are
cyclic (CU_STREAM_WAIT_VALUE_GEQ: (int32)(flag - value) >= 0), so the counters may wrap.

A pass ends with the caller's stream waiting for the sends that read the caller's K/V (it may write into them once
the pass returns), and the next pass waits for that end, so that passes issued on different streams still take the
steps in order. The dK/dV partials a sender copies are the pass's own tensors, kept from reuse by record_stream.

The mailbox grows, on every rank at once, when a pass needs larger slots (the sizes come from the plan, which every
rank holds whole): each rank finishes its work, the group meets, the old mailboxes are unmapped everywhere before
any is freed, and the new ones are mapped. Its memory is cudaMalloc's, outside torch's cache (at 64k tokens a GPU,
32 KV heads × d128 in bf16: 6 GiB a rank, 2 for K/V and 4 for the float32 dK/dV partials). Every rank takes part in
the same collectives whatever fails where, and raises alike; where a rank cannot map the others' memory (another
host), `transport='auto'` keeps NCCL.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from typing import Any

KV, DKV = 0, 1  # the channels
READY, FREE = 0, 1  # the flags of a slot
FLAG_BYTES = 4096  # the flags' region at the mailbox's start (eight int32 used)
ALIGN = 256
INITIAL = {READY: 0, FREE: 1}  # FREE >= n holds at once for messages 0 and 1; READY >= n + 2 holds for none


def flag_index(channel: int, kind: int, slot: int) -> int:
    """The int32 index of a flag in a mailbox."""
    return 4 * channel + 2 * kind + slot


def slot_of(n: int) -> int:
    return n % 2


def ready_value(n: int) -> int:
    """The value of message n's READY flag, and of its step's FREE flag once the step is over."""
    return n + 2


def free_needed(n: int) -> int:
    """FREE of message n's slot, before n is written into it: the slot's last step (n - 2) is over."""
    return n


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class Layout:
    """Where a mailbox holds what: flags first, then K/V slots 0 and 1 (K, V each `kv` bytes), then dK/dV slots 0
    and 1 (dK, dV each `dkv` bytes)."""

    kv: int
    dkv: int

    def offset(self, channel: int, slot: int, tensor: int) -> int:
        kv, dkv = _align(self.kv), _align(self.dkv)
        if channel == KV:
            return FLAG_BYTES + (2 * slot + tensor) * kv
        return FLAG_BYTES + 4 * kv + (2 * slot + tensor) * dkv

    @property
    def size(self) -> int:
        return FLAG_BYTES + 4 * _align(self.kv) + 4 * _align(self.dkv)


# --- the driver's stream memory operations -------------------------------------------------------------------------
class _Driver:
    """cuStreamWaitValue32 / cuStreamWriteValue32 (libcuda's v2 entry points, CUDA 11.7 on), each issued with the
    stream's device current (a default stream's handle is 0: the driver takes the current context's)."""

    GEQ = 0x0

    def __init__(self):
        lib = ctypes.CDLL("libcuda.so.1")
        self.wait_fn, self.write_fn = lib.cuStreamWaitValue32_v2, lib.cuStreamWriteValue32_v2
        for fn in (self.wait_fn, self.write_fn):
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
            fn.restype = ctypes.c_int

    @staticmethod
    def _issue(fn, stream, address: int, value: int, flags: int, what: str) -> None:
        import torch

        with torch.cuda.device(stream.device):
            rc = fn(stream.cuda_stream, address, value & 0xFFFFFFFF, flags)
        if rc != 0:
            raise RuntimeError(f"fagen.ring: {what} failed (CUresult {rc})")

    def wait(self, stream, address: int, value: int) -> None:
        """`stream` waits until the int32 at `address` is at least `value` (cyclically)."""
        self._issue(self.wait_fn, stream, address, value, self.GEQ, "cuStreamWaitValue32")

    def write(self, stream, address: int, value: int) -> None:
        """`stream` writes `value` at `address`, after its earlier work (with a memory fence)."""
        self._issue(self.write_fn, stream, address, value, 0, "cuStreamWriteValue32")


@functools.cache
def driver() -> _Driver:
    return _Driver()


def current_stream(device):
    """The stream the caller issues on, on `device`."""
    import torch

    return torch.cuda.current_stream(device)


# --- the mailboxes of a group -----------------------------------------------------------------------------------
class Mailboxes:
    """This rank's mailbox and the group's, mapped; the channels' step counters; the stream the sends run on; the
    end of the last pass (`last`: an event the next pass waits for, so that passes issued on different streams still
    take the steps in order)."""

    def __init__(self, group, rank: int, world: int, device):
        import torch

        self.group, self.rank, self.world, self.device = group, rank, world, device
        self.layout = Layout(0, 0)
        self.base = 0  # this rank's mailbox (device pointer), 0 before the first pass
        self.peers: list[int] = []  # every rank's mailbox as this process maps it (its own included)
        self.local: Any = None  # this rank's mailbox as a torch uint8 tensor
        self.counts = [0, 0]  # the next step number of each channel
        self.stream = torch.cuda.Stream(device)
        self.last: Any = None
        self.error: Exception | None = None  # why the last reserve failed here

    def _meet(self) -> None:
        import torch.distributed as dist

        dist.barrier(group=self.group, device_ids=[self.device.index])

    def _gather(self, value) -> list:
        import torch.distributed as dist

        found: list = [None] * self.world
        dist.all_gather_object(found, value, group=self.group)
        return found

    def _release(self) -> None:
        """Unmap the others' mailboxes, meet (no rank maps this one any more), then free this one. Collective."""
        import cupy

        with cupy.cuda.Device(self.device.index):
            for p in self.peers:
                if p and p != self.base:
                    cupy.cuda.runtime.ipcCloseMemHandle(p)
            self._meet()
            if self.base:
                cupy.cuda.runtime.free(self.base)
        self.base, self.peers, self.local, self.layout = 0, [], None, Layout(0, 0)

    def _allocate(self, size: int):
        """This rank's new mailbox (flags at their first values) and its IPC handle; None where that failed (the
        error kept in self.error)."""
        import cupy
        import torch

        with cupy.cuda.Device(self.device.index):
            try:
                try:
                    self.base = cupy.cuda.runtime.malloc(size)
                except cupy.cuda.runtime.CUDARuntimeError:  # out of memory: give torch's cached blocks back, once
                    torch.cuda.empty_cache()
                    self.base = cupy.cuda.runtime.malloc(size)
                flags = [INITIAL[kind] for _channel in (KV, DKV) for kind in (READY, FREE) for _slot in (0, 1)]
                host = (ctypes.c_int32 * len(flags))(*flags)
                cupy.cuda.runtime.memcpy(self.base, ctypes.addressof(host), ctypes.sizeof(host), 1)  # host to device
                cupy.cuda.runtime.deviceSynchronize()
                return cupy.cuda.runtime.ipcGetMemHandle(self.base)
            except Exception as e:
                self.error = e
                return None

    def reserve(self, layout: Layout) -> None:
        """Mailboxes at least `layout`'s sizes on every rank (every rank calls this with the same layout: the sizes
        come from the plan). Every rank takes part in the same collectives whatever fails where, and every rank
        raises where any failed."""
        if layout.kv <= self.layout.kv and layout.dkv <= self.layout.dkv:
            return
        import cupy
        import torch

        layout = Layout(max(layout.kv, self.layout.kv), max(layout.dkv, self.layout.dkv))
        torch.cuda.synchronize(self.device)  # this rank's sends into the others' mailboxes are over ...
        self._meet()  # ... and every rank's
        self._release()
        self.error = None
        handles = self._gather(self._allocate(layout.size))
        self.peers = [self.base if r == self.rank else 0 for r in range(self.world)]
        if all(h is not None for h in handles):
            with cupy.cuda.Device(self.device.index):
                try:
                    for r, h in enumerate(handles):
                        if r != self.rank:
                            self.peers[r] = cupy.cuda.runtime.ipcOpenMemHandle(h, 1)  # lazy peer access
                except Exception as e:
                    self.error = e
        fine = self._gather(all(self.peers))
        if not all(fine) or any(h is None for h in handles):
            self._release()
            raise RuntimeError(
                f"fagen.ring: the copy-engine mailboxes ({layout.size} bytes a rank) could not be set up on every "
                f"rank (this rank: {self.error!r})"
            ) from self.error
        with cupy.cuda.Device(self.device.index):
            memory = cupy.cuda.UnownedMemory(self.base, layout.size, self, self.device.index)
            array = cupy.ndarray((layout.size,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(memory, 0))
            self.local = torch.as_tensor(array, device=self.device)
        self.layout, self.counts, self.last = layout, [0, 0], None

    def flag(self, rank: int, channel: int, kind: int, slot: int) -> int:
        return self.peers[rank] + 4 * flag_index(channel, kind, slot)

    def slot_address(self, rank: int, channel: int, slot: int, tensor: int) -> int:
        return self.peers[rank] + self.layout.offset(channel, slot, tensor)

    def slot_bytes(self, channel: int) -> int:
        return self.layout.kv if channel == KV else self.layout.dkv

    def view(self, channel: int, slot: int, tensor: int, shape, dtype):
        """A tensor over this rank's slot (dense, `shape`, `dtype`)."""
        import math

        nbytes = math.prod(shape) * dtype.itemsize
        start = self.layout.offset(channel, slot, tensor)
        assert self.local is not None and nbytes <= self.slot_bytes(channel)
        return self.local[start : start + nbytes].view(dtype).view(shape)


def plane_pitch(x) -> int | None:
    """The bytes from one [B, H] plane of x [B, H, rows, D] to the next where each plane is dense (rows × D) and the
    planes are evenly spaced (the pitch of a 2-D copy, one row of it a plane), else None. A dimension of size 1
    has no meaningful stride (torch calls such a view contiguous whatever it holds there), so it is not read."""
    B, H, M, D = x.shape
    item = x.element_size()
    if (M > 1 and x.stride(2) != D) or (D > 1 and x.stride(3) != 1):
        return None
    if B * H == 1:
        return M * D * item
    if H == 1:
        return x.stride(0) * item
    if B == 1 or x.stride(0) == H * x.stride(1):
        return x.stride(1) * item
    return None


def copy_rows(dst: int, x, stream) -> None:
    """Copy x [B, H, rows, D] into the dense [B, H, rows, D] at device address `dst`, by the copy engine
    (cudaMemcpy2DAsync, one row of the copy a (b, h) plane) on `stream`; x's memory is kept from reuse until the copy
    is done (record_stream). A view whose planes are not evenly spaced is made dense first."""
    import cupy

    pitch = plane_pitch(x)
    if pitch is None:
        import torch

        x = x.clone(memory_format=torch.contiguous_format)
        pitch = plane_pitch(x)
        assert pitch is not None
    B, H, M, D = x.shape
    width = M * D * x.element_size()
    with cupy.cuda.Device(stream.device.index):
        cupy.cuda.runtime.memcpy2DAsync(dst, width, x.data_ptr(), pitch, width, B * H, 4, stream.cuda_stream)
    x.record_stream(stream)


# --- a pass over the copy-engine links ----------------------------------------------------------------------------
class CopyPass:
    """One forward or backward pass's exchanges (the interface of ring._Inflight): sends by copy engine into the
    receivers' slots, receives as views of this rank's slots; `done_*` after a step's use, at every step; `close` at
    the pass's end. Waits and flags go on the stream current at each call, in the order the calls come."""

    def __init__(self, boxes: Mailboxes, layout: Layout, backward: bool, links=None):
        boxes.reserve(layout)
        self.boxes, self.links = boxes, links
        main = current_stream(boxes.device)
        if boxes.last is not None:  # the last pass's steps are over (it may have run on another stream)
            main.wait_event(boxes.last)
        self.first = [boxes.counts[KV], boxes.counts[DKV]]
        boxes.counts[KV] += boxes.world
        if backward:
            boxes.counts[DKV] += boxes.world
        self.expected: dict = {}
        self.sent_inputs: Any = None  # the send stream's point after its last send of the caller's K/V
        boxes.stream.wait_stream(main)  # the sends read tensors the caller's stream made

    def _send(self, channel: int, i: int, dst: int, tensors) -> None:
        boxes, n = self.boxes, self.first[channel] + i
        slot, stream, d = slot_of(n), boxes.stream, driver()
        for x in tensors:
            nbytes = x.numel() * x.element_size()
            if nbytes > boxes.slot_bytes(channel):
                raise RuntimeError(f"fagen.ring: a {nbytes}-byte message for a {boxes.slot_bytes(channel)}-byte slot")
        d.wait(stream, boxes.flag(dst, channel, FREE, slot), free_needed(n))
        for t, x in enumerate(tensors):
            copy_rows(boxes.slot_address(dst, channel, slot, t), x, stream)
        d.write(stream, boxes.flag(dst, channel, READY, slot), ready_value(n))
        if self.links is not None:
            self.links.sent += len(tensors)

    def _take(self, channel: int, i: int):
        found = self.expected.pop((channel, i), None)
        if found is None:
            return None
        shape, dtype = found
        n = self.first[channel] + i
        slot = slot_of(n)
        flag = self.boxes.flag(self.boxes.rank, channel, READY, slot)
        driver().wait(current_stream(self.boxes.device), flag, ready_value(n))
        return [self.boxes.view(channel, slot, t, shape, dtype) for t in (0, 1)]

    def _done(self, channel: int, i: int) -> None:
        n = self.first[channel] + i
        flag = self.boxes.flag(self.boxes.rank, channel, FREE, slot_of(n))
        driver().write(current_stream(self.boxes.device), flag, ready_value(n))

    def post_kv(self, i: int, send, recv, k, v) -> None:
        """Step i's K/V: rows send[1] of k, v to rank send[0]; rows recv[1] of rank recv[0]'s expected here."""
        if send is not None:
            dst, (a, b) = send
            self._send(KV, i, dst, (k[:, :, a:b], v[:, :, a:b]))
            self.sent_inputs = self.boxes.stream.record_event()
        if recv is not None:
            _, (a, b) = recv
            self.expected[(KV, i)] = ((*k.shape[:2], b - a, k.shape[3]), k.dtype)

    def take_kv(self, i: int):
        return self._take(KV, i)

    def done_kv(self, i: int) -> None:
        self._done(KV, i)

    def post_dkv(self, i: int, send, recv, like) -> None:
        """Step i's dK/dV return: send = (owner, (dk, dv)) partials, after the current stream's work so far; recv =
        (rank, rows, dtype) expected here."""
        if send is not None:
            self.boxes.stream.wait_stream(current_stream(self.boxes.device))
            self._send(DKV, i, send[0], send[1])
        if recv is not None:
            _, (a, b), dtype = recv
            self.expected[(DKV, i)] = ((*like.shape[:2], b - a, like.shape[3]), dtype)

    def take_dkv(self, i: int):
        return self._take(DKV, i)

    def done_dkv(self, i: int) -> None:
        self._done(DKV, i)

    def close(self) -> None:
        """The pass's end: the caller's stream waits for the sends that read its K/V (the caller may write into
        them once the pass returns; the dK/dV partials sent are the pass's own, kept by record_stream), and the next
        pass waits for this one's steps."""
        main = current_stream(self.boxes.device)
        if self.sent_inputs is not None:
            main.wait_event(self.sent_inputs)
        self.boxes.last = main.record_event()


def _boot_id() -> str:
    """This machine's boot id (ranks on one host share it, containers included), else its host name."""
    import socket

    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def try_mailboxes(group, rank: int, world: int, device):
    """The group's mailboxes on `device`, or (None, why) where some rank cannot have them (another host, no peer
    mapping, no cupy or driver entry point, no memory): decided by every rank together."""
    import torch.distributed as dist

    why: Exception | None = None
    boxes = None
    try:
        driver()
        boxes = Mailboxes(group, rank, world, device)
        ok = "nccl" in str(dist.get_backend(group))
    except Exception as e:
        ok, why = False, e
    found: list = [None] * world
    dist.all_gather_object(found, (_boot_id(), ok), group=group)
    if not all(fine for _, fine in found) or len({h for h, _ in found}) != 1:
        return None, why or RuntimeError("the ranks are not all on one host, or one lacks what the links need")
    assert boxes is not None
    try:
        boxes.reserve(Layout(ALIGN, ALIGN))  # maps every rank's mailbox (collective; raises on every rank alike)
    except RuntimeError as e:
        return None, e
    return boxes, None
