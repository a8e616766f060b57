"""The persistent wgmma backward (wgmma.BWD_PERSISTENT, on by default): which main kernels it takes, what they compile
to with no GPU (NVRTC), the launch grid the runtime gives them, and the preprocess that zeroes their counter."""

import dataclasses

import pytest

from fagen import builders, pipeline
from fagen.backend import codegen, contract, plan, tiers
from fagen.backend.contract import Kind
from fagen.backend.tiers import wgmma
from fagen.runtime import backward

from .lowered import lowered


@pytest.fixture
def on(monkeypatch):
    monkeypatch.setattr(wgmma, "BWD_PERSISTENT", True)


@pytest.mark.parametrize(
    "kind, dim, rows, pipeline_name, expected",
    [
        (Kind.BWD, 128, 64, "overlap_dq", True),  # d128 under a mask or a score function
        (Kind.BWD, 128, 80, "overlap_dq", False),  # no mask: 80 rows, whose consumers spill at 232 registers
        (Kind.BWD, 64, 128, "overlap_dq", False),  # d64: 128 rows
        (Kind.BWD, 64, 64, "overlap_dq", False),  # d64's step-down, not timed persistent
        (Kind.BWD, 96, 64, "overlap_dq", False),  # dqk^T and the single dQ part do not hold dK_j, dV_j
        (Kind.BWD, 256, 64, "overlap_dq", False),  # the wide backward
        (Kind.BWD_SPARSE, 128, 64, "overlap_dq", False),
        (Kind.BWD, 128, 64, "overlap", False),  # another step order
        (Kind.BWD, 128, 64, "serial", False),
    ],
)
def test_which_main_kernels_are_persistent(kind, dim, rows, pipeline_name, expected, on, monkeypatch):
    monkeypatch.setattr(wgmma, "BWD_PIPELINE", pipeline_name)
    assert wgmma.backward_persistent(kind, dim, rows) is expected


def test_on_by_default_and_in_the_key_where_on(monkeypatch):
    assert wgmma.BWD_PERSISTENT is True and wgmma.backward_persistent(Kind.BWD, 128, 64)
    on = wgmma.Wgmma().backward_key()
    monkeypatch.setattr(wgmma, "BWD_PERSISTENT", False)
    off = wgmma.Wgmma().backward_key()
    assert "persistent" not in off and {**off, "persistent": True} == on


@pytest.mark.parametrize(
    "opts",
    [dict(causal=True), dict(causal="bottom_right"), dict(causal=True, window=256), dict(softcap=30.0)],
)
def test_the_persistent_kernel_compiles_within_the_budget(opts, on, tmp_path):
    """d128 at 64 rows: the wgmma tier's kernel, no warning (no wgmma serialized), a stack frame within the budget (a
    few words of the work tile: each role names its tile after setmaxnreg, 40 and 232 registers), the work grid and
    counter last among its parameters, and the shared memory the host reserves for three more mbarriers and the
    named unit."""
    program = pipeline.lower(pipeline.load_program(**opts), "bf16")[-1].program
    main = builders.build_backward_kernels(program, program.name, 128, "bf16", "sm_90a", "wgmma", cache_dir=tmp_path)
    spec, binary = main.main.spec, main.main.binary
    assert spec.tier == "wgmma" and spec.block_m == 64 and "warning" not in binary.log, spec.name
    assert binary.resources.stack_frame <= tiers.get("wgmma").backward_stack_budget, (spec.name, binary.resources)
    assert [p.name for p in main.main.params][-4:] == ["grid_n", "grid_h", "grid_b", "tile_counter"]
    src = main.main.source
    # its launch is one-dimensional: the work grid, never the launch's y and z, names a unit's head and batch (the
    # deterministic counters' layout among them)
    assert not any(f"{g}.{a}" in src for g in ("gridDim", "blockIdx") for a in "yz"), spec.name
    assert "constexpr int PRODUCER_REGS = 40;" in src and "constexpr int CONSUMER_REGS = 232;" in src
    assert (
        "const WorkGrid grid{grid_n, grid_h, grid_b};" in src and "mbar_init(unit_empty, CONSUMER_THREADS + 32);" in src
    )
    persistent = wgmma.backward_smem_bytes(128, 64, 2, spec.tensor_grads, persistent=True)
    assert (
        tiers.get("wgmma").smem_bytes(spec)
        == persistent
        == wgmma.backward_smem_bytes(128, 64, 2, spec.tensor_grads) + 40
    )


def test_off_the_kernel_is_a_block_per_tile(tmp_path, monkeypatch):
    monkeypatch.setattr(wgmma, "BWD_PERSISTENT", False)
    program = pipeline.lower(pipeline.load_program(causal=True), "bf16")[-1].program
    spec = plan.choose("causal", 128, "bf16", "sm_90a", "wgmma", causal=True, kind=Kind.BWD).spec
    src = codegen.render(spec, lowered(program, backward=True))
    assert "WorkUnits" not in src and "tile_counter" not in src and "constexpr int PRODUCER_REGS = 24;" in src
    assert "tile_counter" not in [p.name for p in tiers.get("wgmma").extra_params(spec)]


def test_the_launch_grid(monkeypatch):
    """A block per SM (fewer where there are fewer key tiles), at most BWD_PERSISTENT_BLOCKS where set,
    one-dimensional; the work grid among the arguments."""
    monkeypatch.setattr(wgmma, "sm_count", lambda device: 132)
    assert backward.persistent_grid((16, 8, 4), 0) == (132, 1, 1)
    assert backward.persistent_grid((3, 2, 1), 0) == (6, 1, 1)
    monkeypatch.setattr(wgmma, "BWD_PERSISTENT_BLOCKS", 3)
    assert backward.persistent_grid((16, 8, 4), 0) == (3, 1, 1)
    assert backward.work_grid((16, 8, 4)) == dict(grid_n=16, grid_h=8, grid_b=4)


def test_the_preprocess_zeroes_the_counter():
    """Its one thread of block (0, 0, 0) sets the counter to 0 where it is not null (the main kernel, launched after
    it on the stream, draws from 0): a dynamic argument of every call, like the arrays."""
    assert contract.BWD_PREPROCESS[-1].name == "tile_counter" and "tile_counter" in backward.BACKWARD_DYNAMIC
    program = pipeline.lower(pipeline.load_program(causal=True), "bf16")[-1].program
    spec = plan.choose("causal", 128, "bf16", "sm_90a", "simt", causal=True, kind=Kind.BWD_PREPROCESS).spec
    src = codegen.render(spec, lowered(program, backward=True))
    assert (
        "if (tile_counter != nullptr && blockIdx.x + blockIdx.y + blockIdx.z + threadIdx.x == 0) *tile_counter = 0;"
        in src
    )


def test_a_varlen_unit_past_its_sequence_is_drawn_again(on):
    """The producer draws again past a unit whose key tile lies beyond its sequence's end (a varlen grid counts the
    longest sequence's key tiles in every sequence), its check the work tile's own (k_lo >= seqlen_k); where a tensor's
    gradient is summed, every unit is named, so that its roles write its slots 0 (the block per tile's `return`)."""
    program = pipeline.lower(pipeline.load_program(causal=True, alibi=True), "bf16")[-1].program
    spec = plan.choose(program.name, 128, "bf16", "sm_90a", "wgmma", causal=True, kind=Kind.BWD).spec
    low = lowered(program, backward=True)
    plain, grads = codegen.render(spec, low), codegen.render(dataclasses.replace(spec, tensor_grads=True), low)
    redraw = "return t.tile_n * BLOCK_N >= varlen_length(cu_seqlens_k, t.b, total_k, k0);"
    assert redraw in plain and "while (drawn < units && skip(drawn)) drawn = draw();" in plain
    assert redraw not in grads and "const auto past_end = [](int) { return false; };" in grads
    for src in (plain, grads):  # the roles still leave a unit past the end (the tensor-gradient kernel's only way)
        assert "continue;   // (the next work unit)" in src
        assert "work.publish(smem, n, lane, past_end)" in src
