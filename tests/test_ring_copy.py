"""The ring's copy-engine links (fagen.ring_copy) on the CPU: the mailbox layout, and the protocol run on simulated
GPUs. Each rank's real Ring (fagen.ring) runs its passes against a recording pass that logs, in the order the host
issues them, what CopyPass would put on the GPU: a send waits for the receiver's FREE flag, writes the slot and
then READY; a receive waits for READY and reads the slot; `done` writes FREE. The simulated GPUs then run every
rank's log, each rank's work in ONE queue (what CUDA_DEVICE_MAX_CONNECTIONS=1 gives, the worst case: any wait
holds everything behind it), and the test asserts that no rank waits forever and that every receive reads the
message it expects, still there when its step ends."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from fagen import ring, ring_copy  # noqa: E402
from fagen.ring_copy import DKV, FREE, INITIAL, KV, READY, Layout  # noqa: E402


def test_layout_slots_are_aligned_and_apart():
    lay = Layout(kv=1000, dkv=3000)
    spans = []
    for channel, size in ((KV, lay.kv), (DKV, lay.dkv)):
        for slot in (0, 1):
            for t in (0, 1):
                off = lay.offset(channel, slot, t)
                assert off % ring_copy.ALIGN == 0 and off >= ring_copy.FLAG_BYTES
                spans.append((off, off + size))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    assert spans[-1][1] <= lay.size
    assert 4 * max(ring_copy.flag_index(c, k, s) for c in (KV, DKV) for k in (READY, FREE) for s in (0, 1)) < 64


class Log:
    """A rank's GPU work in issue order: ("wait", rank, flag, value), ("write", rank, flag, value), ("put", rank,
    slot, message), ("read", slot, message), ("hold", slot, message) (the slot must still hold it)."""

    def __init__(self):
        self.items: list = []


class RecordingPass:
    """CopyPass's calls, logged instead of issued (the same numbering: ring_copy's slot_of, ready_value and
    free_needed)."""

    def __init__(self, links, backward: bool):
        self.links, self.log, self.rank = links, links.log.items, links.rank
        self.first = [links.counts[KV], links.counts[DKV]]
        links.counts[KV] += links.world
        if backward:
            links.counts[DKV] += links.world
        self.expected: dict = {}

    def _send(self, channel, i, dst, tensors):
        n = self.first[channel] + i
        slot = (channel, ring_copy.slot_of(n))
        self.log.append(("wait", dst, (slot, FREE), ring_copy.free_needed(n)))
        self.log.append(("put", dst, slot, (self.rank, channel, n)))
        self.log.append(("write", dst, (slot, READY), ring_copy.ready_value(n)))

    def _take(self, channel, i, shape, src):
        n = self.first[channel] + i
        slot = (channel, ring_copy.slot_of(n))
        self.log.append(("wait", self.rank, (slot, READY), ring_copy.ready_value(n)))
        self.log.append(("read", slot, (src, channel, n)))
        self.pending[(channel, i)] = (slot, (src, channel, n))
        return [torch.zeros(shape, dtype=torch.float64) for _ in range(2)]

    pending: dict

    def _done(self, channel, i):
        n = self.first[channel] + i
        slot = (channel, ring_copy.slot_of(n))
        if (channel, i) in self.pending:
            self.log.append(("hold", *self.pending.pop((channel, i))))
        self.log.append(("write", self.rank, (slot, FREE), ring_copy.ready_value(n)))

    def post_kv(self, i, send, recv, k, v):
        if send is not None:
            self._send(KV, i, send[0], None)
        if recv is not None:
            self.expected[(KV, i)] = ((*k.shape[:2], recv[1][1] - recv[1][0], k.shape[3]), recv[0])

    def take_kv(self, i):
        found = self.expected.pop((KV, i), None)
        return None if found is None else self._take(KV, i, *found)

    def done_kv(self, i):
        self._done(KV, i)

    def post_dkv(self, i, send, recv, like):
        if send is not None:
            self._send(DKV, i, send[0], None)
        if recv is not None:
            self.expected[(DKV, i)] = ((*like.shape[:2], recv[1][1] - recv[1][0], like.shape[3]), recv[0])

    def take_dkv(self, i):
        found = self.expected.pop((DKV, i), None)
        return None if found is None else self._take(DKV, i, *found)

    def done_dkv(self, i):
        self._done(DKV, i)


class RecordingLinks:
    def __init__(self, rank, world):
        self.rank, self.world, self.log, self.counts, self.sent = rank, world, Log(), [0, 0], 0

    def open(self, device, backward, shared, layout):
        p = RecordingPass(self, backward)
        p.pending = {}
        return p

    def all_reduce(self, x):
        pass


class ZeroStep:
    """A piece's step with no arithmetic: zeros of the right shapes (the protocol is what is under test)."""

    def forward(self, q, k, v, work, scale, tensors, deterministic=False):
        return torch.zeros_like(q), torch.zeros(q.shape[:3], dtype=torch.float64)

    def backward(self, q, k, v, o, lse, do, work, scale, tensors, deterministic=False, wanted=frozenset()):
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), {}


def simulate(logs: list[list], seed: int) -> None:
    """Run every rank's log, one queue a rank, the ranks' GPUs interleaved at random (`seed`): the head of a queue
    runs when its wait holds. Fails on a deadlock (no queue can move), and on a read or hold of a slot that holds
    another message."""
    W = len(logs)
    flags = [
        {((c, s), kind): INITIAL[kind] for c in (KV, DKV) for s in (0, 1) for kind in (READY, FREE)} for _ in range(W)
    ]
    slots: list[dict] = [{} for _ in range(W)]
    heads = [0] * W
    rng = random.Random(seed)

    def ready(r: int) -> bool:
        if heads[r] == len(logs[r]):
            return False
        item = logs[r][heads[r]]
        return item[0] != "wait" or flags[item[1]][item[2]] - item[3] >= 0

    while any(h < len(log) for h, log in zip(heads, logs)):
        runnable = [r for r in range(W) if ready(r)]
        if not runnable:
            stuck = {r: logs[r][heads[r]] for r in range(W) if heads[r] < len(logs[r])}
            raise AssertionError(f"deadlock: {stuck}")
        r = rng.choice(runnable)
        item = logs[r][heads[r]]
        if item[0] == "write":
            _, owner, flag, value = item
            flags[owner][flag] = value
        elif item[0] == "put":
            _, owner, slot, message = item
            slots[owner][slot] = message
        elif item[0] in ("read", "hold"):
            _, slot, message = item
            assert slots[r].get(slot) == message, f"rank {r}: {item} found {slots[r].get(slot)}"
        heads[r] += 1


def passes_of(world: int, total: int, layout: str, opts: dict, order: str) -> list[list]:
    """Every rank's log over the passes in `order` ('f': forward, 'b': backward) of one Ring a rank."""
    source = ring._source(opts.get("causal", False), opts.get("window"), None, None, None, None)
    pieces = ring.split_program(source.build(), total)
    plan = ring.make_plan(pieces, world, layout)
    logs = []
    M = total // world
    for r in range(world):
        links = RecordingLinks(r, world)
        rg = ring.Ring(pieces, plan, layout, links, ZeroStep())
        q = torch.zeros(1, 2, M, 4, dtype=torch.float64)
        o, lse = q, torch.zeros(1, 2, M, dtype=torch.float64)
        for p in order:
            if p == "f":
                rg.forward(q, q, q, 0.5, {})
            else:
                rg.backward(q, q, q, o, lse, q, 0.5, {})
        logs.append(links.log.items)
    return logs


@pytest.mark.parametrize("world", [2, 3, 4, 5])
@pytest.mark.parametrize(
    "layout, opts",
    [("zigzag", dict(causal=True)), ("contiguous", dict(causal=True, window=3)), ("contiguous", dict())],
    ids=["causal", "window_pruned", "full"],
)
def test_protocol_has_no_deadlock_and_reads_what_was_sent(world, layout, opts):
    logs = passes_of(world, 8 * world, layout, opts, "ffbfbbf")
    assert any(item[0] == "put" for log in logs for item in log)
    for seed in range(20):
        simulate(logs, seed)


def test_simulation_catches_a_slot_reused_too_early(monkeypatch):
    """The check above can fail: with FREE waited for the slot's use before last, a sender overwrites a slot in use."""
    monkeypatch.setattr(ring_copy, "free_needed", lambda n: n - 2)  # the slot's use before last
    logs = passes_of(4, 32, "contiguous", {}, "fbfb")
    with pytest.raises(AssertionError, match="found"):
        for seed in range(20):
            simulate(logs, seed)
