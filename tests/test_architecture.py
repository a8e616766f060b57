"""The architecture's contracts: the tier registry, kernel kinds and the one argument contract."""

import re
from pathlib import Path

import pytest

import fagen
from fagen.backend import build, codegen, contract, plan, tiers
from fagen.backend.contract import Kind
from fagen.backend.tiers.simt import Simt
from fagen.passes import fuse
from fagen.runtime import backward, block_mask, calls, decode, forward
from fagen.runtime.arrays import Array
from fagen.runtime.launch import ArgPack

from .lowered import lowered

PACK_OF_CTYPE = {"long long": "i64", "int": "i32", "float": "f32"}


def fused(causal=True, *, decode=False, backward=False, **kw):
    """The program of these options, lowered (a Lowering; with the merge or the backward where asked)."""
    return lowered(dict(causal=causal, **kw), "bf16", decode=decode, backward=backward)


class Toy(Simt):
    """A third tier, defined here and nowhere else: the planner must pick it and render its template."""

    name = "toy"
    priority = 100
    templates = {Kind.FORWARD: Path(__file__).parent / "toy" / "flash_fwd_toy.cu.jinja"}
    describe = "a toy tier registered by a test"

    def supports(self, kind, head_dim, dtype, arch):
        return None if head_dim == 40 else "the toy takes head dim 40 only"


@pytest.fixture
def toy():
    tier = tiers.register(Toy())
    yield tier
    tiers.unregister("toy")


def test_a_tier_registered_in_a_test_module_is_picked_and_rendered(toy, tmp_path):
    choice = plan.choose("causal", 40, "bf16", "sm_90a", causal=True)
    assert choice.spec.tier == "toy" and choice.reason.startswith("a toy tier registered by a test")
    assert plan.choose("causal", 64, "bf16", "sm_90a", causal=True).spec.tier == "wgmma"  # the toy declines
    kernel = fagen.compile(40, causal=True, arch="sm_90a", cache_dir=tmp_path)
    assert kernel.spec.tier == "toy" and "_toy_" in kernel.name
    assert "// toy tier: the simt kernel under another tier's name" in kernel.source
    assert not kernel.resources.spills
    with pytest.raises(ValueError, match="tier: 'nope' is not available"):
        plan.choose("causal", 40, "bf16", "sm_90a", "nope")


def test_tier_names_are_compared_only_inside_the_tiers():
    """No module outside fagen/backend/tiers/ asks which tier it is dealing with."""
    root = Path(fagen.__file__).parent
    for path in root.rglob("*.py"):
        if "tiers" in path.relative_to(root).parts:
            continue
        text = path.read_text()
        assert not re.search(r"""(==|!=|\bin)\s*\(?\s*["'](mma|simt)["']""", text), path
        assert not re.search(r"""\.tier\s*(==|!=)""", text), path


def _signature(source: str, name: str) -> list[tuple[str, str]]:
    body = source[source.index(f"{name}(\n") + len(name) + 1 :]
    body = body[: body.index(")\n{")]
    params = []
    for part in body.split(","):
        m = re.fullmatch(r"\s*(.+?)\s*\b(\w+)\s*", part, re.S)
        params.append((m.group(1), m.group(2)))
    return params


TENSOR_PROGRAMS = {
    "none": dict(),
    "alibi": dict(alibi=True),
    "bias": dict(score_mod=lambda s, b, h, q, k, bias: s + bias[b]),
}


@pytest.mark.parametrize("kind", list(Kind))
@pytest.mark.parametrize("tier", ["simt", "mma"])
@pytest.mark.parametrize("variant", sorted(TENSOR_PROGRAMS))
def test_every_kind_and_tier_renders_the_declared_signature(kind, tier, variant):
    """The kernel's C signature is the contract's parameter list, and the launcher packs exactly that list:
    names, order and C types agree with the pack kinds."""
    if (why_not := tiers.get(tier).supports(kind, 64, "bf16", "sm_90a")) is not None:
        pytest.skip(f"{tier}: {why_not}")  # every kind has a tier: test_every_kind_has_a_tier
    low = fused(**TENSOR_PROGRAMS[variant], decode=kind is Kind.DECODE_SPLIT, backward=kind in contract.BACKWARD_KINDS)
    program = low.program
    spec = plan.choose(program.name, 64, "bf16", "sm_90a", tier, causal=True, kind=kind).spec
    src = codegen.render(spec, low)
    args = contract.tensor_args(fuse.tensor_reads(program))
    declared = contract.params(kind, args)
    tensors = tuple(a.c_name for a in args)
    # a call-time tensor's static values: its strides and sizes (calls.tensor_values)
    shapes = {a.name: Array("torch", None, 0, (4,) * a.rank, (1,) * a.rank, None, "float32", 0) for a in args}
    tensor_static = calls.tensor_values(args, shapes)
    assert _signature(src, spec.name) == [(p.ctype, p.name) for p in declared]
    for p in declared:
        assert p.pack == ("ptr" if "*" in p.ctype else PACK_OF_CTYPE[p.ctype]), p
    # the launcher fills every parameter from the same list: static values + per-call addresses and scale
    fake = {
        n: Array(
            "torch",
            None,
            0,
            (1, 2, 3, 64)[: 4 if n != "lse" else 3],
            (1, 1, 1, 1)[: 4 if n != "lse" else 3],
            "bf16",
            "bfloat16",
            0,
        )
        for n in ("q", "k", "v", "o", "lse")
    }
    if kind in contract.BACKWARD_KINDS:  # the backward: the same arrays by their roles, workspaces like q and lse
        fake = {**fake, "dout": fake["q"], "dq": fake["q"], "dk": fake["k"], "dv": fake["v"], "dq_accum": fake["q"]}
        rowstat = Array("torch", None, 0, (2, 1, 2, 3), (6, 6, 3, 1), "f32", "float32", 0)
        arrays = {**fake, "delta": fake["lse"], "rowstat": rowstat}
        values = backward.backward_pack_values(declared, arrays, 1, 3, 3, None)
        if kind in contract.READS_TENSORS:
            values.update(tensor_static)
    elif kind in (Kind.FORWARD, Kind.FORWARD_SPARSE):
        values = forward.static_values(fake, 1, 3, 3, varlen=None)
        values.update({n: 0 for n in ("q", "k", "v", "o", "lse")}, scale_log2=1.0, **{t: 0 for t in tensors})
        values.update(tensor_static)
        if kind is Kind.FORWARD_SPARSE:  # the block mask's two arrays and their strides
            values.update(kv_count=0, kv_list=0, **forward.block_mask_strides(1, 2, 1, 1))
    elif kind is Kind.BLOCK_MASK:  # the two arrays it writes, the sizes, the tensors its mask reads
        values = block_mask.values(declared, 0, 0, 3, 3, shapes)
    else:  # decode: q [B, q_len, H, D], caches [B, N, Hkv, D], the workspace and the lengths
        fake = {**fake, "k_cache": fake["k"], "v_cache": fake["v"]}
        values = decode.decode_values(fake, 1, 2, 1, num_splits=4, ws_rows=4, max_seqlen_k=3)
        pointers = ("q", "k", "v", "o", "lse", "cache_seqlens", "ws_acc", "ws_ml", "split_count")
        pointers += ("block_table", "k_new", "v_new", "k_append", "v_append")
        values.update({n: 0 for n in pointers})
        values.update(scale_log2=1.0, **{t: 0 for t in tensors}, **tensor_static)
    ArgPack(declared).set(values)  # raises on a missing or unknown argument
    with pytest.raises(TypeError, match="missing"):
        ArgPack(declared).set(
            {k: v for k, v in values.items() if k not in ("seqlen_k", "max_seqlen_k", "ws_rows", "total_q")}
        )


def test_every_kind_has_a_tier():
    for kind in Kind:
        assert any(t.supports(kind, 128, "bf16", "sm_90a") is None for t in tiers.all_tiers()), kind


@pytest.mark.parametrize("tier", ["simt", "mma"])
def test_the_rule_functions_compile_in_every_tier(tier, tmp_path):
    """The proven rule as device functions, with a call-time tensor, compiles warning- and spill-free."""
    low = fused(alibi=True)
    spec = plan.choose(low.program.name, 128, "bf16", "sm_90a", tier, causal=True).spec
    src = codegen.render(spec, low)
    binary = build.compile_cubin(src, spec, cache_dir=tmp_path)
    assert "warning" not in binary.log and not binary.resources.spills
    assert "namespace rule {" in src and "rule::keep(" in src
    # the score, or on the tensor-core tier its raw value (S = a u: ALiBi's is affine in q.k)
    assert ("rule::raw(" if tier == "mma" else "rule::score(") in src
