"""The ring's copy-engine links (fagen.ring_copy) on the CPU: the mailbox layout, the copies' pitch, and the protocol
run on simulated GPUs. Each rank's real Ring (fagen.ring) runs its passes on the real CopyPass, whose driver calls
and copies are logged, in the order the host issues them, instead of reaching a GPU (the mailboxes' addresses are
names): a send waits for the receiver's FREE flag, copies into the slot, then writes READY; a receive waits for
READY and reads the slot; `done` writes FREE. The simulated GPUs then run every rank's log, each rank's work in ONE
queue (what CUDA_DEVICE_MAX_CONNECTIONS=1 gives, the worst case: any wait holds everything behind it), interleaved
at random, and the test asserts that no rank waits forever and that every receive reads the message whose READY it
waited for, still there when its step writes FREE."""

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


class FakeStream:
    def wait_event(self, event):
        pass

    def wait_stream(self, other):
        pass

    def record_event(self):
        return object()


class FakeBoxes:
    """ring_copy.Mailboxes without memory: addresses are names, ("flag", owner, channel, kind, slot) and ("slot",
    owner, channel, slot, tensor); `view` logs the read of this rank's slot."""

    def __init__(self, rank, world, log):
        self.rank, self.world, self.log = rank, world, log
        self.device, self.stream, self.counts, self.last, self.layout = "gpu", FakeStream(), [0, 0], None, Layout(0, 0)

    def reserve(self, layout):
        self.layout = Layout(max(layout.kv, self.layout.kv), max(layout.dkv, self.layout.dkv))

    def flag(self, rank, channel, kind, slot):
        return ("flag", rank, channel, kind, slot)

    def slot_address(self, rank, channel, slot, tensor):
        return ("slot", rank, channel, slot, tensor)

    def slot_bytes(self, channel):
        return self.layout.kv if channel == KV else self.layout.dkv

    def view(self, channel, slot, tensor, shape, dtype):
        self.log.append(("read", ("slot", self.rank, channel, slot, tensor)))
        return torch.zeros(shape, dtype=dtype)


class FakeLinks:
    """ring.Links whose passes are the real ring_copy.CopyPass over FakeBoxes."""

    def __init__(self, rank, world):
        self.rank, self.world, self.sent, self.log = rank, world, 0, []
        self.boxes = FakeBoxes(rank, world, self.log)

    def open(self, device, backward, shared, layout):
        return ring_copy.CopyPass(self.boxes, layout(), backward, self)

    def all_reduce(self, x):
        pass


@pytest.fixture
def recorded(monkeypatch):
    """CopyPass's driver calls and copies logged into the log of the rank whose pass issues them."""
    current: list = [None]

    class FakeDriver:
        def wait(self, stream, address, value):
            current[0].append(("wait", address, value))

        def write(self, stream, address, value):
            current[0].append(("write", address, value))

    def copy(dst, x, stream):
        current[0].append(("put", dst))

    monkeypatch.setattr(ring_copy, "driver", lambda: FakeDriver())
    monkeypatch.setattr(ring_copy, "copy_rows", copy)
    monkeypatch.setattr(ring_copy, "current_stream", lambda device: FakeStream())
    return current


class ZeroStep:
    """A piece's step with no arithmetic: zeros of the right shapes (the protocol is what is under test)."""

    def forward(self, q, k, v, work, scale, tensors, deterministic=False):
        return torch.zeros_like(q), torch.zeros(q.shape[:3], dtype=torch.float64)

    def backward(self, q, k, v, o, lse, do, work, scale, tensors, deterministic=False, wanted=frozenset()):
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), {}


def simulate(logs: list[list], seed: int) -> None:
    """Run every rank's log, one queue a rank, the ranks' GPUs interleaved at random (`seed`): the head of a queue
    runs when its wait holds. Fails on a deadlock (no queue can move), on a read of a slot that holds another message
    than the one whose READY was waited for, and on a slot overwritten before its step wrote FREE."""
    W = len(logs)
    flags = {("flag", r, c, kind, s): INITIAL[kind] for r in range(W) for c in (KV, DKV) for kind in (READY, FREE)
             for s in (0, 1)}  # fmt: skip
    slots: dict = {}
    heads = [0] * W
    rng = random.Random(seed)
    tags = []  # each put's message: the value of the READY write that follows it to that slot
    for log in logs:
        tag: dict = {}
        for j, item in enumerate(log):
            if item[0] == "put":
                _, owner, c, s, _t = item[1]
                tag[j] = next(x[2] for x in log[j:] if x[0] == "write" and x[1] == ("flag", owner, c, READY, s))
        tags.append(tag)
    waited: list[dict] = [{} for _ in range(W)]  # (channel, slot) -> the READY value a rank last waited for
    held: list[dict] = [{} for _ in range(W)]  # slot -> the message a rank read and has not freed

    def ready(r: int) -> bool:
        if heads[r] == len(logs[r]):
            return False
        item = logs[r][heads[r]]
        return item[0] != "wait" or flags[item[1]] - item[2] >= 0

    while any(h < len(log) for h, log in zip(heads, logs)):
        runnable = [r for r in range(W) if ready(r)]
        if not runnable:
            stuck = {r: logs[r][heads[r]] for r in range(W) if heads[r] < len(logs[r])}
            raise AssertionError(f"deadlock: {stuck}")
        r = rng.choice(runnable)
        item = logs[r][heads[r]]
        if item[0] == "wait" and item[1][3] == READY:
            waited[r][item[1][2], item[1][4]] = item[2]
        elif item[0] == "put":
            slots[item[1]] = tags[r][heads[r]]
        elif item[0] == "read":
            _, owner, c, s, _t = item[1]
            want = waited[r][c, s]
            assert slots.get(item[1]) == want, f"rank {r}: read {item[1]} found {slots.get(item[1])}, not {want}"
            held[r][item[1]] = want
        elif item[0] == "write":
            flags[item[1]] = item[2]
            _, owner, c, kind, s = item[1]
            if kind == FREE and owner == r:  # the step is over: what it read must still be there
                for t in (0, 1):
                    slot = ("slot", r, c, s, t)
                    if slot in held[r]:
                        want = held[r].pop(slot)
                        assert slots.get(slot) == want, f"rank {r}: {slot} found {slots.get(slot)} before FREE"
        heads[r] += 1


def passes_of(world: int, total: int, configs: list, order: str, recorded) -> list[list]:
    """Every rank's log over the passes in `order` ('f': forward, 'b': backward), each pass of each of `configs`
    ((layout, options) a Ring, every Ring of a rank on its one set of links, as one group's are)."""
    rings = []
    for layout, opts in configs:
        source = ring._source(opts.get("causal", False), opts.get("window"), None, None, None, None)
        pieces = ring.split_program(source.build(), total)
        rings.append((pieces, ring.make_plan(pieces, world, layout), layout))
    M = total // world
    logs = []
    for r in range(world):
        links = FakeLinks(r, world)
        recorded[0] = links.log
        q = torch.zeros(1, 2, M, 4, dtype=torch.float64)
        o, lse = q, torch.zeros(1, 2, M, dtype=torch.float64)
        for pieces, plan, layout in rings:
            rg = ring.Ring(pieces, plan, layout, links, ZeroStep())
            for p in order:
                if p == "f":
                    rg.forward(q, q, q, 0.5, {})
                else:
                    rg.backward(q, q, q, o, lse, q, 0.5, {})
        logs.append(links.log)
    return logs


@pytest.mark.parametrize("world", [2, 3, 4, 5])
@pytest.mark.parametrize(
    "configs",
    [
        [("zigzag", dict(causal=True))],
        [("contiguous", dict(causal=True, window=3))],
        [("contiguous", dict()), ("zigzag", dict(causal=True))],  # two Rings on one group's mailboxes
    ],
    ids=["causal", "window_pruned", "full_then_causal"],
)
def test_protocol_has_no_deadlock_and_reads_what_was_sent(world, configs, recorded):
    logs = passes_of(world, 8 * world, configs, "ffbfbbf", recorded)
    assert any(item[0] == "put" for log in logs for item in log)
    for seed in range(20):
        simulate(logs, seed)


def test_simulation_catches_a_slot_reused_too_early(recorded, monkeypatch):
    """The check above can fail: with FREE waited for the slot's use before last, a sender overwrites a slot in use."""
    monkeypatch.setattr(ring_copy, "free_needed", lambda n: n - 2)
    logs = passes_of(4, 32, [("contiguous", {})], "fbfb", recorded)
    with pytest.raises(AssertionError, match="found"):
        for seed in range(20):
            simulate(logs, seed)


def test_slots_hold_the_largest_message_float64_sums_included(recorded):
    """The pass sizes its slots from the plan, and _send refuses a message larger than its slot: a two-sided window
    over zigzag shards has steps of two pieces, whose dK/dV go back as sums in the accumulator's dtype (float64 for
    these float64 inputs, 8 bytes an element)."""
    opts = dict(window=(3, 3))
    plan = ring.plan(64, 4, "zigzag", **opts)
    assert max(len(plan.pieces[r][s]) for r in range(4) for s in range(4) if r != s) == 2
    logs = passes_of(4, 64, [("zigzag", opts)], "fb", recorded)
    assert any(item[0] == "put" and item[1][2] == DKV for log in logs for item in log)


def test_plane_pitch_reads_no_stride_of_a_size_1_dimension():
    x = torch.zeros(2, 3, 10, 4)
    assert ring_copy.plane_pitch(x[:, :, 2:7]) == 10 * 4 * 4
    mqa = torch.zeros(7, 1, 4).permute(1, 0, 2).unsqueeze(0)  # varlen's [1, Hkv=1, T, D] view: strides (4, 4, 4, 1)
    assert mqa.is_contiguous() and ring_copy.plane_pitch(mqa[:, :, 1:5]) == 4 * 4 * 4
    b2 = torch.zeros(2, 10, 1, 4).transpose(1, 2)  # [B=2, H=1, M, D]: the planes B apart
    assert ring_copy.plane_pitch(b2[:, :, 3:8]) == 10 * 4 * 4
    uneven = torch.zeros(2, 5, 3, 10, 4)[:, 1:4, 0]  # [2, 3, 10, 4] whose b stride is not 3 planes
    assert ring_copy.plane_pitch(uneven) is None
