"""bench/trace_bwd.py's and trace_blocks.py's source edits on the CPU: the stamps they put into the wgmma backward's
main kernel land where they name, in order, in the default step order's kernels (d128 causal and not, d64: their
anchors still match the rendered source), and the stamped source still builds (NVRTC, no GPU). The stamps' figures
need a GPU."""

import re
import sys
from pathlib import Path

import pytest

from fagen import builders, pipeline
from fagen.backend import codegen, plan
from fagen.backend.contract import Kind

from .lowered import lowered

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import ab_tools  # noqa: E402
import trace_blocks  # noqa: E402
import trace_bwd  # noqa: E402


@pytest.fixture(autouse=True)
def block_per_tile(monkeypatch):
    """The tools trace the kernel of a block per key tile (their main() sets wgmma.BWD_PERSISTENT off)."""
    from fagen.backend.tiers import wgmma

    monkeypatch.setattr(wgmma, "BWD_PERSISTENT", False)


def main_source(causal: bool, dim: int) -> str:
    program = pipeline.lower(pipeline.load_program(causal=causal), "bf16")[-1].program
    return program_main_source(program, dim)


def program_main_source(program, dim: int) -> str:
    masked = builders.backward_masked(program)
    spec = plan.choose(program.name, dim, "bf16", "sm_90a", "wgmma", causal=masked, kind=Kind.BWD).spec
    return codegen.render(spec, lowered(program, backward=True))


def stamps(source: str) -> list[int]:
    return [int(k) for k in re.findall(r"^FAGEN_STAMP\((\d+)\);$", source, re.M)]


@pytest.mark.parametrize("causal, dim", [(True, 128), (False, 128), (True, 64)])
def test_every_phase_boundary_is_stamped_once_in_order(causal, dim):
    source = main_source(causal, dim)
    stamped = trace_bwd.instrument(source)
    ks = stamps(stamped)
    assert sorted(ks) == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]  # (11: only the overlap order's dP wait)
    # the step's order: its top, the stage, S and dP, the element-wise steps, BAR_DS, dQ done, its write-out, dK
    assert ks == [0, 1, 2, 3, 4, 5, 8, 9, 6, 7]
    assert stamped.index("__device__ unsigned long long fagen_trace[") < stamped.index('extern "C" __global__')
    lines = [line.strip() for line in stamped.splitlines()]
    assert lines[lines.index("FAGEN_STAMP(2);") - 1].startswith("gemm_s_dp(qk, dp, c,")
    assert lines[lines.index("FAGEN_STAMP(3);") + 1] == "to_fragments(qk, p_frag);"


def test_a_source_without_an_anchor_is_refused():
    source = main_source(True, 128).replace("named_bar_sync(BAR_DS, CONSUMER_THREADS);", "")
    with pytest.raises(SystemExit, match="stamp 4"):
        trace_bwd.instrument(source)


@pytest.mark.parametrize(
    "tracer, symbol", [(trace_bwd.edited, b"fagen_trace"), (trace_blocks.instrument, b"fagen_blocks")]
)
def test_the_stamped_kernel_builds(monkeypatch, tmp_path, tracer, symbol):
    from fagen.backend import build

    monkeypatch.setattr(build, "_nvrtc", build._nvrtc)  # (edit_backward_main's wrapper is undone after the test)
    ab_tools.edit_backward_main(tracer)
    program = pipeline.lower(pipeline.load_program(causal=True), "bf16")[-1].program
    main = builders.build_backward_kernels(
        program, program.name, 128, "bf16", "sm_90a", "wgmma", cache_dir=tmp_path
    ).main
    assert symbol in main.binary.cubin and not main.binary.resources.spills


def test_a_case_names_its_mask_or_is_refused():
    """bench/ab_tools.parse_case, which trace_bwd.py and ab_bwd_main.py read their cases with: an unknown mask is
    refused (trace_bwd.py once traced it as the kernel without one)."""
    opts = {c: ab_tools.parse_case(c).options for c in ("d128-full-8192", "d64-causal-2048", "d128-softcap-8192")}
    assert opts == {"d128-full-8192": {}, "d64-causal-2048": {"causal": True}, "d128-softcap-8192": {"softcap": 30.0}}
    assert ab_tools.parse_case("d128-window256-8192") == ab_tools.Case(
        128, 8192, 2, 16, 1, {"causal": True, "window": 256}
    )
    assert ab_tools.parse_case("d128-window-8192").options == {"causal": True, "window": 1024}
    assert ab_tools.parse_case("d128-causal-8192-gqa4-h32") == ab_tools.Case(128, 8192, 2, 32, 4, {"causal": True})
    for bad in ("d128-alibi-8192", "d128-causal", "128-causal-8192", "d128-causal-8192-gqa3"):
        with pytest.raises(ValueError, match="expected dDIM-MASK-N"):
            ab_tools.parse_case(bad)


def block_stamps(source: str) -> list[int]:
    return [int(k) for k in re.findall(r"FAGEN_BLK\((\d+)\);", source)]


@pytest.mark.parametrize("causal, dim", [(True, 128), (False, 128), (True, 64)])
def test_trace_blocks_stamps_each_point_of_a_block_once_in_order(causal, dim):
    stamped = trace_blocks.instrument(main_source(causal, dim))
    ks = block_stamps(stamped)
    assert sorted(ks) == list(range(trace_blocks.POINTS))
    # in the text: the K/V issue (load_steps) and the epilogue's two barriers (store_dk_dv) ahead of the kernel; then
    # its start, the tile named, the mbarriers, the block's barrier, the producer past setmaxnreg and its last dQ
    # landed, the consumers past setmaxnreg, K/V landed, the step loop's end, the epilogue's end
    assert ks == [5, 11, 12, 0, 8, 10, 9, 7, 4, 6, 1, 2, 3]
    assert stamped.startswith("__device__ long long fagen_blocks[")


def test_trace_blocks_refuses_the_wide_kernel():
    program = pipeline.lower(pipeline.load_program(causal=True), "bf16")[-1].program
    with pytest.raises(SystemExit, match="BAR_EPILOGUE"):
        trace_blocks.instrument(program_main_source(program, 192))
