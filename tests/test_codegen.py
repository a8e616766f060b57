"""Rendering: standalone sources that read like the derivation, printed from the proven rule."""

import re
import subprocess
from pathlib import Path

import jinja2
import pytest

from fagen import builders, resources
from fagen.backend import build, codegen, plan, tiers
from fagen.backend.spec import KernelSpec, SpecError, kernel_head_dim
from fagen.passes import fuse

from .lowered import lowered


def fused(name, dtype="bf16"):
    """The shipped program `name`, lowered: what the kernels print (a Lowering)."""
    return lowered(dict(causal={"full": False, "causal": True, "causal_br": "bottom_right"}[name]), dtype)


TIER_DTYPES = [("simt", "f16"), ("simt", "bf16"), ("simt", "f32"), ("mma", "f16"), ("mma", "bf16")]


@pytest.mark.parametrize("name", ["full", "causal", "causal_br"])
@pytest.mark.parametrize("tier, dtype", TIER_DTYPES)
def test_render_is_standalone_and_reads_like_the_math(name, tier, dtype):
    spec = plan.choose(name, 128, dtype, "sm_90a", tier).spec
    src = codegen.render(spec, fused(name, dtype))
    assert not re.search(r"^\s*#\s*include", src, re.M)
    assert spec.name in src and "Regenerate: fagen compile --dim 128" in src
    for word in ("m_i", "l_i", "acc", "alpha", "kLog2e", "Q_i", "K_j", "V_j"):
        assert word in src
    # each proven step is a named device function whose body is exactly what SymPy printed, and is called
    rule = fuse.rule_of(fuse.fused_node(fused(name, dtype).program))
    functions = codegen.rule_functions(rule, tiers.get(tier), ())
    shortcut = tier == "mma" and rule.raw_max is not None  # score and p fused into p_from_qk
    exact = tier == "simt" and dtype == "f32" and rule.p_from_qk is not None  # f32: P from raw q.k, one fma
    unused = {"score", "p"} if shortcut else {"raw_max", "p"} if exact else {"raw_max", "p_from_qk"}
    for f in functions:
        assert f"{f.returns} {f.name}({', '.join(f.params)}) {{\n    return {f.body};\n}}" in src, f.name
        if f.name not in unused:
            assert f"rule::{f.name}(" in src, f.name
    assert ("rule::p_from_qk((float)qk[r][c], scale_log2, m_use)" in src) == exact
    if tier == "simt":  # float32 sums q.k in double
        assert ("double qk[" in src) == (dtype == "f32")
    if tier == "mma":  # identity scores: the max over raw q.k, p by one fused multiply-add
        assert "rule::raw_max(" in src and "rule::p_from_qk(" in src
    assert "(m_i + log2f(l_i))" in src and "constexpr float kTau = 8.0f;" in src
    assert src.isascii()


@pytest.mark.parametrize("tier", ["mma", "wgmma"])
def test_alibi_takes_its_block_max_over_raw_values(tier):
    """A score affine in q.k (ALiBi: scale_log2 q.k + kLog2e slopes[h] (k - q)) keeps u = q.k + r in S until p: r
    is one fused multiply-add an element whose factor (a division of kernel arguments, a slope) is the same for
    every element; the max is over u, scaled once; p from u by one fused multiply-add. That factor (the slope's
    read and the division) is a fixed value, computed once a work tile before the key loop, not once a tile."""
    low = lowered(dict(causal=True, alibi=True))
    spec = plan.choose(low.program.name, 64, "bf16", "sm_90a", tier, causal=True).spec
    src = codegen.render(spec, low)
    fixed = re.search(
        r"float (fixed_\d)\(float scale_log2, int b, int h, int seqlen_q, int seqlen_k, [^)]*\) \{\n"
        r"    return \(kLog2e/scale_log2\)\*fagen_read\(tensor_slopes, fagen_at\(h, ",
        src,
    )
    assert fixed, "the raw value's factor is not a fixed value"
    name = fixed.group(1)
    assert f"return fmaf({name}, k_minus_q, qk);" in src
    decl = f"const float {name} = rule::{name}(scale_log2, b, h, seqlen_q, seqlen_k, tensor_slopes, "
    assert src.count(decl) == 1  # computed once, before the key loop that reads it
    assert src.index(decl) < src.index("rule::raw(S")
    body = re.search(r"float raw\([^)]*\) \{\n    return ([^;]*);", src).group(1)
    assert body == f"fmaf({name}, k_minus_q, qk)"  # no read, no division an element
    if tier == "wgmma":  # k - q: one conversion a tile, then an add of a constant of the unrolled loops an element
        assert "const float k_minus_q0 = (float)(n0 + 2 * (lane % 4) - q_idx0)" in src
        assert "k_minus_q = k_minus_q0 + (float)(8 * i + (e & 1) - 8 * (e >> 1));" in src
        assert "(float)(k_idx - q_idx)" not in src
    assert "rule::raw(" in src and "rule::raw_max(" in src and "rule::p_from_qk(" in src
    assert "rule::score(" not in src  # the forward computes u, not S, an element
    plain = codegen.render(plan.choose("causal", 64, "bf16", "sm_90a", tier).spec, fused("causal", "bf16"))
    assert "rule::raw(" not in plain and "float raw(" not in plain  # S = a q.k: u is q.k itself


@pytest.mark.parametrize("tier", ["simt", "mma"])
def test_mask_and_key_range_come_from_the_program(tier):
    spec = plan.choose("causal_br", 64, "f16", "sm_90a", tier).spec
    src = codegen.render(spec, fused("causal_br", "f16"))
    assert (
        "bool keep(int b, int h, int q_idx, int k_idx, int seqlen_q, int seqlen_k) {\n"
        "    return k_idx <= -seqlen_q + seqlen_k + q_idx;" in src
    )
    # the mma tier evaluates the mask on every element (`&`, no branch per element), the simt tier only in range
    both = "&" if tier == "mma" else "&&"
    guard = "(k_idx < seqlen_k)" if tier == "mma" else "k_idx < seqlen_k"
    assert f"({guard} {both} rule::keep(b, h, q_idx, k_idx, seqlen_q, seqlen_k))" in src
    assert "end = min(end, -seqlen_q + seqlen_k + q_hi + 1);" in src
    full = codegen.render(plan.choose("full", 64, "f16", "sm_90a", tier).spec, fused("full", "f16"))
    assert "(k_idx < seqlen_k))" in full and "end = min" not in full
    if tier == "mma":  # the mask is skipped on key tiles every row sees whole
        assert "full_end_0 = min(full_end_0, -seqlen_q + seqlen_k + q_lo + 1);" in src
        assert "unmasked = unmasked || (n0 >= full_begin_0 && n0 + BLOCK_N <= full_end_0);" in src


def test_templates_are_strict():
    env = codegen._env()
    assert env.undefined is jinja2.StrictUndefined
    with pytest.raises(jinja2.UndefinedError):
        env.get_template("flash_fwd_simt.cu.jinja").render()


def test_spec_name_is_derived_from_every_field():
    a = KernelSpec("causal", 128, "bf16", "sm_90a", "simt", 64, 64, 4)
    assert a.name == "flash_fwd_causal_d128_bf16_sm90a_simt_m64n64w4"
    names = {a.name}
    for change in (
        dict(variant="full"),
        dict(head_dim=64),
        dict(dtype="f16"),
        dict(arch="sm_80"),
        dict(block_m=32),
        dict(block_n=32),
        dict(num_warps=2),
        dict(stages=3),
        dict(input_dim=123),
    ):
        names.add(KernelSpec(**{**a.to_dict(), **change}).name)
    assert len(names) == 10
    assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", a.name)


@pytest.mark.parametrize(
    "bad, fragment",
    [
        (dict(head_dim=100), "head_dim"),
        (dict(head_dim=16), "head_dim"),
        (dict(input_dim=59), "input_dim"),  # 59 pads to 64, not 128
        (dict(input_dim=128), "input_dim"),
        (dict(dtype="f64"), "dtype"),
        (dict(arch="sm_70"), "arch"),
        (dict(tier="wgmma"), "tier"),
        (dict(block_m=48), "block_m"),
        (dict(variant="Bad Name"), "variant"),
    ],
)
def test_spec_validates(bad, fragment):
    good = dict(
        variant="full", head_dim=128, dtype="bf16", arch="sm_90a", tier="simt", block_m=64, block_n=64, num_warps=4
    )
    with pytest.raises(SpecError, match=fragment):  # the fields' own checks, then the tier's (tiers.check)
        tiers.check(KernelSpec(**{**good, **bad}))


@pytest.mark.parametrize(
    "dim, kernel_dim", [(8, 32), (16, 32), (31, 32), (40, 40), (59, 64), (72, 72), (111, 112), (200, 200), (256, 256)]
)
def test_a_head_dim_the_kernels_do_not_take_is_padded_to_the_next_one(dim, kernel_dim):
    """Any head dim from 8 to 256: the kernel is compiled at the next multiple of 8 of at least 32, and says so
    (its name, its header's Padding and Regenerate lines); the default scale stays 1/sqrt(dim)."""
    assert kernel_head_dim(dim) == kernel_dim
    assert builders._facts(fused("causal", "bf16"), dim, None, "", ()).default_scale == pytest.approx(dim**-0.5)
    spec = plan.choose("causal", dim, "bf16", "sm_90a").spec
    assert spec.head_dim == kernel_dim and spec.dim == dim
    src = codegen.render(spec, fused("causal", "bf16"))
    if dim == kernel_dim:
        assert spec.input_dim is None and f"_d{dim}_" in spec.name and "Padding" not in src
        return
    assert spec.input_dim == dim and f"_d{dim}p{kernel_dim}_" in spec.name
    assert f"// Padding: inputs of head dim {dim}, padded to {kernel_dim}: " in src
    assert f"scale 1/sqrt({dim})" in src
    assert f"// Regenerate: fagen compile --dim {dim} --causal --dtype bf16 --arch sm_90a --tier {spec.tier} " in src
    assert f"(pads head dim {dim})" in src.splitlines()[1]


@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_89", "sm_90a"])
@pytest.mark.parametrize("dim", [32, 64, 96, 128, 160, 256])
def test_plan_fits_shared_memory(arch, dim):
    spec = plan.choose("full", dim, "bf16", arch).spec
    assert plan.smem_bytes(spec) <= tiers.SMEM_LIMIT[arch]


# The committed outputs of `fagen compile` in generated/, the files the test below owns. generated/ is also the
# folder `fagen compile` writes to by default, so a user's compile (the README's commands) adds files there that
# are not the test's: it checks these by name, not every file in the folder. In a git checkout they must be
# exactly the .cu files git tracks there, so a file committed to generated/ cannot escape the check.
GENERATED = (
    "flash_fwd_causal_br_d256_f32_sm80_simt_m32n32w4.cu",
    "flash_fwd_causal_d128_bf16_sm90a_mma_m128n32w4s3.cu",
    "flash_fwd_causal_d128_bf16_sm90a_simt_m64n64w4.cu",
    "flash_fwd_causal_d128_bf16_sm90a_wgmma_m128n128w12s2p.cu",
    "flash_fwd_full_d128_bf16_sm90a_wgmma_m128n160w12s2p.cu",
    "flash_fwd_full_d64_f16_sm90a_mma_m128n64w4s4.cu",
)


def _git_tracked(folder: Path) -> set[str] | None:
    """The .cu files git tracks in `folder`; None where it is not in a git checkout (a source archive, no git)."""
    try:
        out = subprocess.run(["git", "ls-files", "--", "*.cu"], cwd=folder, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return {Path(line).name for line in out.stdout.splitlines()} or None


def test_generated_files_owned_by_the_test_are_the_committed_ones():
    tracked = _git_tracked(resources._SOURCE_TREE / "generated")
    if tracked is None:
        pytest.skip("not a git checkout: the committed files are GENERATED as listed")
    assert tracked == set(GENERATED), (
        f"committed in generated/ but not in GENERATED: {sorted(tracked - set(GENERATED))}; "
        f"in GENERATED but not committed: {sorted(set(GENERATED) - tracked)}"
    )


def test_committed_generated_files_are_reproduced_byte_for_byte():
    """generated/ holds outputs of `fagen compile` (GENERATED); rendering them again gives the same bytes."""
    gen = resources._SOURCE_TREE / "generated"
    for path in (gen / name for name in GENERATED):
        assert path.is_file(), f"{path.name} is in GENERATED but not in generated/"
        m = re.search(
            r"^// Regenerate: fagen compile --dim (\d+)( --causal(?: (\w+))?)? --dtype (\w+) "
            r"--arch (\w+) --tier (\w+)$",
            path.read_text(),
            re.M,
        )
        assert m, path
        dim, causal, align, dtype, arch, tier = m.groups()
        causal = False if not causal else (align or "top_left")
        low = lowered(dict(causal=causal), dtype)
        spec = plan.choose(low.program.name, int(dim), dtype, arch, tier, causal=fuse.is_masked(low.program)).spec
        assert spec.name == path.stem
        assert codegen.render(spec, low).encode() == path.read_bytes(), path.name


def test_compiled_templates_kept_on_disk_render_the_same(tmp_path, monkeypatch):
    program = fused("causal")
    spec = plan.choose(program.program.name, 128, "bf16", "sm_90a", None, causal=True).spec
    plain = codegen.render(spec, program)
    where = codegen.template_cache(tmp_path)
    assert where == str(tmp_path / "templates") and codegen.template_cache(tmp_path, use_cache=False) is None
    codegen._env.cache_clear()
    assert codegen.render(spec, program, bytecode_dir=where) == plain  # compiled, then written
    kept = sorted((tmp_path / "templates").iterdir())
    assert kept and all(p.name.endswith(".cache") for p in kept)
    codegen._env.cache_clear()  # as in a new process: the templates are read back, not compiled
    monkeypatch.setattr(jinja2.Environment, "_compile", lambda *a: pytest.fail("compiled a kept template"))
    assert codegen.render(spec, program, bytecode_dir=where) == plain
    monkeypatch.undo()
    blocked = tmp_path / "file"
    blocked.write_text("")  # a cache directory that cannot be made: the templates are compiled, nothing kept
    codegen._env.cache_clear()
    assert codegen.render(spec, program, bytecode_dir=str(blocked / "templates")) == plain
    codegen._env.cache_clear()


@pytest.mark.parametrize("dim, cols", [(64, 64), (96, 96), (128, 128), (256, 256)])
def test_the_wgmma_forward_computes_o_over_the_head_dim_not_the_padded_tile(dim, cols, tmp_path):
    """O = P V's wgmma takes N = the head dim rounded up to 32: at d96 (on d128's tiles) 96 columns, not TMA's zero
    columns past it (48 accumulators a thread, not 64); the epilogue stores as many."""
    spec = plan.choose("causal", dim, "bf16", "sm_90a", "wgmma", causal=True).spec
    src = codegen.render(spec, fused("causal"))
    assert f"constexpr int O_COLS = {cols};" in src and "constexpr int O_REGS = O_COLS / 2;" in src
    assert f"template <> struct Wgmma<{cols}>" in src and "for (int i = 0; i < O_COLS / 8; ++i)" in src
    if dim == 96:  # NVRTC builds it for sm_90a, no warning, no spill
        binary = build.compile_cubin(src, spec, cache_dir=tmp_path)
        assert "warning" not in binary.log and binary.resources.stack_frame == 0, str(binary.resources)


@pytest.mark.parametrize(
    "options, ranges",
    [
        (dict(causal=True), True),
        (dict(causal="bottom_right", window=(100, 0)), True),
        (dict(window=(5, 3)), True),
        (dict(causal=True, prefix=7), True),  # two terms, k <= q or k < 7: either one's keys
        (dict(mask=lambda b, h, q, k: q // 64 == k // 64), False),  # a floor division: not an affine bound
    ],
)
def test_the_wgmma_forward_masks_a_tile_by_its_rows_ranges_where_every_term_is_exact(options, ranges):
    """A masked key tile tests each element's column against its query's proven range of keys (bounds.one_query),
    two comparisons at most, where every term of the mask is exact; otherwise it evaluates rule::keep."""
    low = lowered(options)
    spec = plan.choose(low.program.name, 128, "bf16", "sm_90a", "wgmma", causal=True).spec
    body = codegen.render(spec, low).split(")\n{", 1)[1]
    assert ("row_k_end[r][0] = pinned(" in body and "< col_end[e >> 1][0])" in body) == ranges
    assert ("rule::keep(" in body) == (not ranges)
    if options.get("prefix"):
        assert "| (8 * i + (e & 1) < col_end[e >> 1][1])" in body
    if options.get("window") == (5, 3):  # both bounds: the first key too
        assert "(col_begin[e >> 1][0] <= 8 * i + (e & 1) & 8 * i + (e & 1) < col_end[e >> 1][0])" in body
