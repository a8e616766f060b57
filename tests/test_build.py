"""NVRTC compiles (no GPU needed) and the on-disk cache."""

import json
import multiprocessing
import struct

import pytest

from fagen import pipeline, store
from fagen.backend import build, codegen, plan, tiers
from fagen.backend.contract import Kind

from .lowered import lowered

VARIANT_CAUSAL = {"full": False, "causal": True, "causal_br": "bottom_right"}


def source(variant, dim, dtype, arch, tier=None):
    low = lowered(dict(causal=VARIANT_CAUSAL[variant]), dtype)
    spec = plan.choose(variant, dim, dtype, arch, tier, causal=variant != "full").spec
    return spec, codegen.render(spec, low)


MATRIX = [
    (v, d, t, a, tier)
    for a in ("sm_90a", "sm_80")
    for d in (32, 64, 72, 96, 128, 256)
    for t in ("f16", "bf16", "f32")
    for v in (("causal_br",) if a == "sm_80" else ("full", "causal_br"))
    for tier in ("simt", "mma")
    if tier == "simt" or tiers.get("mma").supports(Kind.FORWARD, d, t, a) is None
]


@pytest.mark.parametrize("variant, dim, dtype, arch, tier", MATRIX)
def test_nvrtc_compiles_without_spills(variant, dim, dtype, arch, tier, tmp_path):
    spec, src = source(variant, dim, dtype, arch, tier)
    assert spec.tier == tier
    binary = build.compile_cubin(src, spec, cache_dir=tmp_path)
    assert "warning" not in binary.log, binary.log  # NVRTC 13.0 drops the ptxas report after a warning
    r = binary.resources
    assert binary.cubin[:4] == b"\x7fELF"
    assert not r.spills and r.spill_stores == 0 and r.spill_loads == 0 and r.stack_frame == 0, (spec.name, str(r))
    # the cubin's own attributes agree with ptxas's report
    assert f"Used {r.registers} registers" in binary.log and f"{r.stack_frame} bytes stack frame" in binary.log
    assert 0 < r.registers <= 255
    assert plan.smem_bytes(spec) <= tiers.SMEM_LIMIT[arch]


def test_compile_error_carries_the_log(tmp_path):
    spec, src = source("full", 64, "f16", "sm_90a")
    with pytest.raises(build.CompileError, match="error"):
        build.compile_cubin(src.replace("kLog2e = ", "kLog2e = nope + "), spec, cache_dir=tmp_path)


def test_cache_hit_and_corrupt_entry_rebuilt(tmp_path):
    spec, src = source("full", 64, "f16", "sm_90a")
    first = build.compile_cubin(src, spec, cache_dir=tmp_path)
    assert not first.cached
    second = build.compile_cubin(src, spec, cache_dir=tmp_path)
    assert second.cached and second.cubin == first.cubin and second.resources == first.resources
    (cubin,) = tmp_path.glob("*.cubin")
    cubin.write_bytes(b"garbage")
    third = build.compile_cubin(src, spec, cache_dir=tmp_path)
    assert not third.cached and third.cubin == first.cubin
    (meta,) = tmp_path.glob("*.json")
    meta.write_text("{not json")
    assert not build.compile_cubin(src, spec, cache_dir=tmp_path).cached
    assert json.loads(meta.read_text())["key"] == first.key


def test_cache_key_covers_source_options_and_version():
    spec, src = source("full", 64, "f16", "sm_90a")
    opts = build.options(spec)
    k = build.cache_key(src, opts, "13.0")
    assert k != build.cache_key(src + " ", opts, "13.0")
    assert k != build.cache_key(src, opts + ("-G",), "13.0")
    assert k != build.cache_key(src, opts, "13.1")


def test_cache_dir_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("FAGEN_CACHE_DIR", str(tmp_path / "c"))
    assert store.default_cache_dir() == tmp_path / "c"


def _compile_in_process(cache_dir):
    spec, src = source("causal", 64, "bf16", "sm_90a")
    b = build.compile_cubin(src, spec, cache_dir=cache_dir)
    return b.cubin


def test_concurrent_processes_share_the_cache_safely(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(4) as pool:
        cubins = pool.map(_compile_in_process, [str(tmp_path)] * 4)
    assert len(set(cubins)) == 1
    assert not list(tmp_path.glob("*.tmp"))
    spec, src = source("causal", 64, "bf16", "sm_90a")
    again = build.compile_cubin(src, spec, cache_dir=tmp_path)
    assert again.cached and again.cubin == cubins[0]


def test_unwritable_cache_still_compiles(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    spec, src = source("full", 64, "f16", "sm_90a")
    assert build.compile_cubin(src, spec, cache_dir=blocker / "sub").cubin[:4] == b"\x7fELF"


def test_compile_cubins_runs_nvrtc_in_threads_and_keeps_the_order(tmp_path):
    """Several kernels (a decode's two, the backward's four) compile at once; each binary is its own job's, the
    same as a compile on its own; a failing job raises its own error."""
    jobs = [source("full", 64, "f16", "sm_90a"), source("causal", 128, "bf16", "sm_80", "mma")]
    jobs = [(src, spec) for spec, src in jobs]
    got = build.compile_cubins(jobs, cache_dir=tmp_path / "a")
    alone = [build.compile_cubin(src, spec, cache_dir=tmp_path / "b") for src, spec in jobs]
    assert [b.key for b in got] == [b.key for b in alone] and not any(b.cached for b in got)
    assert [b.resources.registers for b in got] == [b.resources.registers for b in alone]
    broken = (jobs[1][0].replace("__global__", "__global__ syntax error", 1), jobs[1][1])
    with pytest.raises(build.CompileError, match=jobs[1][1].name):
        build.compile_cubins([jobs[0], broken], use_cache=False)


def test_ptx_for_the_virtual_arch():
    spec, src = source("full", 64, "f16", "sm_90a")
    ptx = build.compile_ptx(src, spec)
    assert ".target sm_90a" in ptx and spec.name in ptx


def test_resources_come_from_the_cubin_even_without_a_ptxas_report():
    """NVRTC's compute cache can skip ptxas and its report; the cubin still says registers and stack."""
    spec, src = source("full", 256, "f32", "sm_90a", "simt")
    forced = src.replace("__launch_bounds__(NUM_THREADS, 1)", "__launch_bounds__(NUM_THREADS, 8)")  # 64 registers
    cubin, log = build._nvrtc(forced, spec.name, build.options(spec))
    with_log = build.parse_resources(log, cubin, spec.name)
    without = build.parse_resources("", cubin, spec.name)
    assert with_log.registers == without.registers == 64
    assert with_log.stack_frame == without.stack_frame > 0 and with_log.spill_stores > 0
    assert without.spills and without.spill_stores is None and "n/a" in str(without)
    with pytest.raises(build.CompileError, match="cannot read the resource attributes"):
        build.elf_resources(cubin, "no_such_kernel")


def test_read_binary_checks_key_and_hash(tmp_path):
    spec, src = source("full", 64, "f16", "sm_90a")
    first = build.compile_cubin(src, spec, cache_dir=tmp_path)
    base = build.entry_base(tmp_path, spec.name, first.key)
    hit = build.read_binary(base, first.key)
    assert hit.cached and hit.cubin == first.cubin and hit.resources == first.resources
    assert build.read_binary(base, "0" * 64) is None
    base.with_suffix(".cubin").write_bytes(b"garbage")
    assert build.read_binary(base, first.key) is None


def test_bench_probe_and_per_call_timer():
    """The pure-Python parts of `fagen bench`'s start-up and overhead figures (the rest needs a GPU)."""
    from fagen.tools.bench import compile_time, timing

    code = compile_time.probe_code(128, True, "bf16", None, {"softcap": 37})
    compile(code, "<probe>", "exec")
    assert "fagen.compile(128, causal=True, dtype='bf16', tier=None, arch=arch, **{'softcap': 37})" in code
    calls, syncs = [], []
    t = timing.per_call_seconds(lambda: calls.append(1), lambda: syncs.append(1), n=100, warmup=5)
    assert len(calls) == 105 and len(syncs) == 2 and 0 <= t < 0.01


def test_bench_variants_compile_for_the_hopper_tier(tmp_path):
    """Every `fagen bench --variant` program compiles on the wgmma tier without spills; the relative-position one
    reads its table at q - k + the offset its full-length table covers."""
    from fagen.tools.bench import cases

    for name, opts in cases.VARIANTS.items():
        for causal in cases.VARIANT_CAUSAL.get(name, (False, True)):
            kern = pipeline.compile(128, causal=causal, dtype="bf16", arch="sm_90a", cache_dir=tmp_path, **opts)
            assert kern.spec.tier == "wgmma" and not kern.resources.spills, (name, kern.name, kern.resources)
    rel = pipeline.compile(
        128, causal=True, dtype="bf16", arch="sm_90a", cache_dir=tmp_path, **cases.VARIANTS["relative"]
    )
    assert [t.name for t in rel.tensor_args] == ["rel"]
    assert f"+ {cases.RELATIVE_OFFSET}" in rel.source or f"{cases.RELATIVE_OFFSET} +" in rel.source


def test_the_ctypes_binding_and_cupys_give_the_same_cubin(monkeypatch):
    """NVRTC's C API is called through ctypes on the library cuda-pathfinder finds; where cuda-pathfinder is
    missing, CuPy's binding of the same library compiles instead. Both give the same cubin, log and errors."""
    from fagen.backend import nvrtc

    spec, src = source("causal", 64, "bf16", "sm_90a")
    opts = build.options(spec)
    assert nvrtc._library() is not None  # cuda-pathfinder comes with CuPy
    ours = build._nvrtc(src, spec.name, opts)
    ptx = build.compile_ptx(src, spec)
    version = build.nvrtc_version()
    monkeypatch.setattr(nvrtc, "_library", lambda: None)
    cubin, log = build._nvrtc(src, spec.name, opts)
    # CuPy drops the cubin's last byte (a zero, read as a string's end): ours ends where the ELF's tables do
    assert ours[0].startswith(cubin) and len(ours[0]) - len(cubin) <= 1 and ours[0][len(cubin) :] in (b"", b"\0")
    shoff, phoff = struct.unpack_from("<QQ", ours[0], 0x20)[::-1]
    (phentsize, phnum, shentsize, shnum) = struct.unpack_from("<HHHH", ours[0], 0x36)
    assert len(ours[0]) == max(shoff + shentsize * shnum, phoff + phentsize * phnum)
    timeless = lambda text: [line for line in text.splitlines() if "Compile time" not in line]  # noqa: E731
    assert timeless(log) == timeless(ours[1])
    assert build.compile_ptx(src, spec) == ptx and build.nvrtc_version() == version
    with pytest.raises(build.CompileError, match=f"(?s)NVRTC failed to compile {spec.name}.*nope"):
        build._nvrtc(src.replace("kLog2e = ", "kLog2e = nope + "), spec.name, opts)
    monkeypatch.undo()
    with pytest.raises(build.CompileError, match=f"(?s)NVRTC failed to compile {spec.name}.*nope"):
        build._nvrtc(src.replace("kLog2e = ", "kLog2e = nope + "), spec.name, opts)
    with pytest.raises(build.CompileError, match="NVRTC_ERROR_INVALID_OPTION"):
        build._nvrtc(src, spec.name, opts + ("--no-such-option",))


def test_a_named_nvrtc_library_that_is_missing_is_a_clear_error(monkeypatch, tmp_path):
    """FAGEN_NVRTC_LIBRARY picks another libnvrtc (CI: the oldest supported); a wrong path says which."""
    from fagen.backend import nvrtc

    spec, src = source("full", 64, "f16", "sm_90a")
    monkeypatch.setenv("FAGEN_NVRTC_LIBRARY", str(tmp_path / "libnvrtc.so.13"))
    nvrtc._library.cache_clear()
    try:
        with pytest.raises(build.CompileError, match=r"FAGEN_NVRTC_LIBRARY=.*libnvrtc\.so\.13: NVRTC is not available"):
            build.compile_cubin(src, spec, cache_dir=tmp_path)
    finally:
        monkeypatch.delenv("FAGEN_NVRTC_LIBRARY")
        nvrtc._library.cache_clear()
    assert build._nvrtc(src, spec.name, build.options(spec))[0][:4] == b"\x7fELF"
