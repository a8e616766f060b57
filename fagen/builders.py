"""Building the ops of a lowered program: plan → render → NVRTC → step down → store → the op, for each kind of op
(the forward, the split-KV decode, the backward's kernels, the block-mask kernel). fagen.pipeline lowers a
request's program and hands it here; fagen.backend.kernels is the build loop they share, and fagen.loader
assembles the op. The compiler proper (SymPy, Jinja, NVRTC) is imported inside the steps that need it: an op read
back from the compile cache, with what it builds on first need, costs none of it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import cache, loader
from .backend.contract import Kind
from .loader import Facts
from .request import detect_arch

if TYPE_CHECKING:
    from .backend.spec import KernelSpec
    from .ir import Program
    from .passes.lowering import Lowering
    from .runtime.kernel import BackwardPlan, Kernel

Proofs = tuple[str, ...] | Callable[[], tuple[str, ...]]  # statements proven, or the function that proves them


def build_kernel(
    fused: Program,
    variant: str,
    dim: int,
    dtype: str,
    arch: str,
    tier: str | None = None,
    *,
    kind: Kind = Kind.FORWARD,
    scale: float | None = None,
    command: Callable[[Any], str | None] | None = None,
    config: dict | None = None,
    cache_dir=None,
    use_cache: bool = True,
    proofs: Proofs = (),
    key_range=None,
    request: dict | None = None,
    tensor_dtypes: dict | None = None,
) -> Kernel:
    """plan → render → compile → load, for a fused program: the forward (`kind` FORWARD, or FORWARD_SPARSE: over a
    run-time block mask) or the split-KV decode (DECODE_SPLIT: one split kernel whose last block of a row tile
    merges the splits with the proven merge, handed down its tier's fallback chain to a tier that has one). The
    back half of `compile`, and of `fagen tune`, which passes `config`, the tiles to time. `proofs`: the statements
    proven for `fused`, or compile's function that proves them, run while NVRTC compiles (a failed proof raises
    before anything is kept); `key_range`: its proven key ranges (else derived and proven here). With a `request`
    (its cache key), the op goes into the compile cache."""
    from .backend import codegen, plan
    from .passes import fuse, lowering

    low, check = lowering.forward(fused, key_range)  # what the kernel prints
    more = []
    if kind is Kind.DECODE_SPLIT:
        low, prove_merge = lowering.with_merge(low)  # the merge its split kernel prints, proven beside the rewrite
        more.append(prove_merge)
        tier = backward_tier(kind, dim, dtype, arch, tier) or tier
    prove = _proving(check, proofs, *more)
    choice = plan.choose(variant, dim, dtype, arch, tier, causal=fuse.is_masked(fused), config=config, kind=kind)
    spares = []
    if config is None and kind is not Kind.DECODE_SPLIT:
        spares = [s for s in [plan.spare(choice.spec, fuse.is_scored(fused))] if s is not None]
    templates = codegen.template_cache(cache_dir, use_cache)
    built = _build(
        [choice.spec],
        lambda spec: codegen.render(
            spec, low, command(spec) if command else None, tensor_dtypes, bytecode_dir=templates
        ),
        spares=spares,
        step_down=config is None,
        meanwhile=_while_nvrtc(prove, arch),
        cache_dir=cache_dir,
        use_cache=use_cache,
    )
    records = [(b.spec, b.source, b.binary) for b in built]
    spec = choice.spec
    padded = f"head dim {spec.dim} padded to {spec.head_dim} with zero columns" if spec.input_dim else ""
    reason = "; ".join(filter(None, [choice.reason, built[0].stepped, padded]))
    facts = _facts(low, dim, tensor_dtypes, reason, prove())
    if use_cache and request is not None and config is None:
        facts.store(request, cache_dir, records)
    return _op(records, facts, scale, cache_dir, use_cache, fused=fused, key_range=low.key_range)


def build_decode_kernel(fused: Program, variant: str, dim: int, dtype: str, arch: str, tier=None, **kw) -> Kernel:
    """The split-KV decode op of a fused program (build_kernel with kind DECODE_SPLIT)."""
    return build_kernel(fused, variant, dim, dtype, arch, tier, kind=Kind.DECODE_SPLIT, **kw)


def _build(specs, render, **kw):
    from .backend.kernels import build_kernels

    return build_kernels(specs, render, **kw)


def _facts(low: Lowering, dim: int, tensor_dtypes: dict | None, tier_reason: str, proofs: tuple) -> Facts:
    """What an op keeps of its program: the default scale at head dim `dim`, the call-time tensors
    (contract.TensorArg) and what each is read as (fuse.tensor_index), beside the tier's reason and the proofs."""
    from .backend import contract
    from .ir.exprs import DIMS
    from .passes import fuse

    tensors = contract.tensor_args(fuse.tensor_reads(low.program), tensor_dtypes)
    index = {t.name: fuse.tensor_index(low.program, t.name) for t in tensors}
    scale = float(low.node.attr("scale").xreplace({DIMS["D"]: dim}))
    return Facts(str(low.program), scale, tier_reason, tuple(tensors), index, tuple(proofs))


def _proving(check, proofs: Proofs, *more) -> Callable[[], tuple]:
    """The function a builder runs while NVRTC compiles (once; later calls return its statements): `check` proves
    the values it derived itself (key ranges not given to it), then `proofs` are the statements proven for the
    program (or compile's function that proves them) and `more` prove what the builder adds (the merge), their
    statements last."""

    @functools.cache
    def prove() -> tuple:
        check()  # the same statements as the compile that first proved these ranges: not listed twice
        given = tuple(proofs() if callable(proofs) else proofs)
        return given + tuple(s for extra in more for s in extra())

    return prove


def _while_nvrtc(prove, arch: str):
    """What a compile does on its own thread while NVRTC runs: prove the rewrite, then, where the kernel is for
    this machine's GPU, import CuPy, which its first call needs."""

    def meanwhile():
        prove()
        if arch == detect_arch():
            import cupy  # noqa: F401

    return meanwhile


# --- ops: assembled by the loader, with what they build on first need ----------------------------------------
def load(key: dict | None, scale, cache_dir) -> Kernel | None:
    """The op of a compile-cache entry, or None."""
    found = loader.load(key, cache_dir)
    if found is None or found.facts is None:
        return None
    return _op(found.records, found.facts, scale, cache_dir, True)


def _op(records, facts: Facts, scale, cache_dir, use_cache, *, fused=None, key_range=None) -> Kernel:
    """A forward's op, whose fallback tier's kernel (for inputs this tier cannot take) and backward are built, or
    read from the cache, on first need; or a decode's. `fused`, `key_range`: the program and its proven key ranges,
    where this process has them (the fallback and the backward print them rather than prove them again)."""
    from .backend import tiers

    spec = records[0][0]
    if spec.kind is Kind.DECODE_SPLIT:
        return loader.kernel(records, facts, scale=scale, fused=fused)
    program = fused if fused is not None else facts.program
    fallback_tier = tiers.get(spec.tier).fallback

    def fallback() -> Kernel:
        what = {
            "fused": facts.program,
            "variant": spec.variant,
            **({"block_sparse": True} if spec.kind is Kind.FORWARD_SPARSE else {}),
        }
        key = cache.request(spec.dim, spec.dtype, spec.arch, fallback_tier, what, facts.tensor_dtypes)
        if use_cache and (kernel := load(key, scale, cache_dir)) is not None:
            return kernel
        source = fused if fused is not None else loader.parse(facts.program, spec.name)
        return build_kernel(
            source,
            spec.variant,
            spec.dim,
            spec.dtype,
            spec.arch,
            fallback_tier,
            kind=spec.kind,
            scale=scale,
            cache_dir=cache_dir,
            use_cache=use_cache,
            proofs=facts.proofs,
            key_range=key_range,
            request=key,
            tensor_dtypes=facts.tensor_dtypes,
        )

    def backward() -> BackwardPlan:  # built (or read from the cache) on the first Kernel.backward
        return backward_plan(
            program, spec, facts.tensors, cache_dir=cache_dir, use_cache=use_cache, key_range=key_range
        )

    return loader.kernel(
        records, facts, scale=scale, fused=fused, fallback=fallback if fallback_tier else None, backward=backward
    )


# --- the backward ---------------------------------------------------------------------------------------------
def backward_tier(kind, dim: int, dtype: str, arch: str, forward_tier: str | None) -> str | None:
    """The tier of a backward kind: the first of the forward's tier family (the tier, its fallback, the fallback's
    fallback ...) that compiles it, so the mma kernels back an mma or wgmma forward and the simt ones a simt
    forward. None without a forward tier (the planner's default then: the supporting tier of highest priority)."""
    from .backend import tiers
    from .backend.spec import kernel_head_dim

    dim = kernel_head_dim(dim)  # the kernels' head dim (the inputs are padded to it)
    t = tiers.get(forward_tier) if forward_tier is not None else None
    while t is not None:
        if t.supports(kind, dim, dtype, arch) is None:
            return t.name
        t = tiers.get(t.fallback) if t.fallback else None
    return None


BACKWARD_KINDS = (Kind.BWD_PREPROCESS, Kind.BWD, Kind.BWD_CONVERT, Kind.BWD_DQ)  # in BackwardPlan's order


def build_backward_kernels(
    fused: Program,
    variant: str,
    dim: int,
    dtype: str,
    arch: str,
    tier: str | None = None,
    *,
    forward_tier: str | None = None,
    command: Callable[[Any], str | None] | None = None,
    cache_dir=None,
    use_cache: bool = True,
    tensor_dtypes: dict | None = None,
    key_range=None,
    block_sparse: bool = False,
) -> BackwardPlan:
    """The backward of a fused program (FlashAttention-2's split): its rule and transposed key ranges derived and
    proven (fagen.passes.backward.prove_rule), then plan → render → compile for each backward kind on its tier:
    `tier` for the main kind when given, else the first tier of the forward's family (`forward_tier`, its
    fallbacks) that compiles the kind (backward_tier), else the planner's default. The main kernel, and its variant
    that also sums the gradients of tensors read as name[h] / [b] / [b, h], step down while they are too heavy.
    `key_range`: the forward's key ranges, as its compile proved them (derived and proven here where not given).
    `block_sparse` (a block-sparse forward's backward): also the main kernel over a block mask's transposed table
    (Kind.BWD_SPARSE), where the main kernel's tier has one (sparse_spec)."""
    from .backend import codegen, contract, plan, tiers
    from .passes import backward as backward_pass
    from .passes import fuse, lowering

    low, check = lowering.forward(fused, key_range)
    check()  # the key ranges, where not given: proven before the kernels are printed
    proven = backward_pass.prove_rule(fused)  # refuses a score it cannot differentiate, or a failed proof
    low = lowering.with_backward(low, proven)  # what the backward kernels print
    tensors = contract.tensor_args(fuse.tensor_reads(fused), tensor_dtypes)
    specs = []
    for kind in BACKWARD_KINDS:
        chosen = tier if kind is Kind.BWD and tier is not None else backward_tier(kind, dim, dtype, arch, forward_tier)
        masked = backward_masked(fused) if kind is Kind.BWD else fuse.is_masked(fused)
        specs.append(plan.choose(variant, dim, dtype, arch, chosen, causal=masked, kind=kind).spec)
    gradients = tuple((g.name, g.index) for g in codegen.slot_gradients(proven.rule, tensors))
    main = BACKWARD_KINDS.index(Kind.BWD)
    if gradients:  # the main kernel's variant that sums the tensors' gradients (run when they are asked for)
        specs.append(tiers.get(specs[main].tier).main_variant(specs[main], tensor_grads=True))
    if block_sparse and (sparse := sparse_spec(specs[main])) is not None:
        specs.append(sparse)
    mains = [s for s in specs if s.kind in (Kind.BWD, Kind.BWD_SPARSE)]
    templates = codegen.template_cache(cache_dir, use_cache)
    built = _build(
        specs,
        lambda spec: codegen.render(
            spec, low, command(spec) if command else None, tensor_dtypes, bytecode_dir=templates
        ),
        spares=[s for s in (plan.spare(m, fuse.is_scored(fused)) for m in mains) if s is not None],
        cache_dir=cache_dir,
        use_cache=use_cache,
    )
    assert [b.spec.tensor_grads for b in built] == [s.tensor_grads for s in specs], (
        "a step-down changed which main kernel sums the tensors' gradients"
    )
    records = [(b.spec, b.source, b.binary) for b in built]
    scatters = tuple(t.name for t in tensors if t.grad)
    return loader.backward_plan(records, tensors, gradients, proven.statements(), scatters)


def backward_masked(fused: Program) -> bool:
    """Whether the backward's main kernel takes a masked program's tiles: the program masks keys, or a score function
    transforms the scores (at d128 softcap's derivative made the unmasked tiles, 80 rows a step, spill 4 bytes and
    run 0.84-0.87x the 64-row kernel, H100: wgmma.ROWS80_HEAD_DIMS; ALiBi and other score functions were not timed)."""
    from .passes import fuse

    return fuse.is_masked(fused) or fuse.is_scored(fused)


def sparse_spec(main: KernelSpec) -> KernelSpec | None:
    """The block-sparse main kernel beside the dense one `main`: its tiles on its tier, where the tier has one
    (None: the dense backward serves a block-sparse forward, visiting every tile of the proven ranges)."""
    from .backend import tiers

    tier = tiers.get(main.tier)
    if tier.supports(Kind.BWD_SPARSE, main.head_dim, main.dtype, main.arch) is not None:
        return None
    return tier.main_variant(main, kind=Kind.BWD_SPARSE)


def backward_plan(fused, spec, tensors, *, cache_dir=None, use_cache: bool = True, key_range=None) -> BackwardPlan:
    """The backward of the forward kernel `spec` (its fused Program, or the program's text from the cache): from
    the compile cache where it was built before (no SymPy, Jinja or NVRTC), else derived, proven and built
    (build_backward_kernels) and kept there. `tensors`: the forward's call-time tensors (contract.TensorArg);
    `key_range`: the forward's key ranges, where its compile proved them in this process."""
    text = fused if isinstance(fused, str) else str(fused)
    tensor_dtypes = {a.name: a.dtype for a in tensors if a.dtype != "f32"}
    from .backend import tiers

    sparse = spec.kind is Kind.FORWARD_SPARSE  # a block-sparse forward's backward: its block-sparse main kernel too
    what = {"backward_of": text, "variant": spec.variant, **tiers.get(spec.tier).backward_key()}
    what.update({"block_sparse": True} if sparse else {})
    key = cache.request(spec.dim, spec.dtype, spec.arch, spec.tier, what, tensor_dtypes)
    if use_cache and (found := loader.load(key, cache_dir)) is not None:
        e = found.entry
        return loader.backward_plan(found.records, tensors, e["gradients"], e["proofs"], e["scatters"])
    built = build_backward_kernels(
        loader.parse(text, spec.name) if isinstance(fused, str) else fused,
        spec.variant,
        spec.dim,
        spec.dtype,
        spec.arch,
        forward_tier=spec.tier,
        cache_dir=cache_dir,
        use_cache=use_cache,
        tensor_dtypes=tensor_dtypes,
        key_range=key_range,
        block_sparse=sparse,
    )
    if use_cache and key is not None:
        more = filter(None, [built.main_grads, built.main_sparse])
        launches = (built.preprocess, built.main, built.convert, built.dq, *more)
        cache.store(
            key,
            cache_dir,
            [(x.spec, x.source, x.binary) for x in launches],
            proofs=built.proofs,
            gradients=[list(g) for g in built.gradients],
            scatters=list(built.scatters),
        )
    return built


def build_block_mask_launch(
    fused: Program,
    variant: str,
    arch: str,
    block_m: int,
    block_n: int,
    *,
    key_range=None,
    tensor_dtypes: dict | None = None,
    cache_dir=None,
    use_cache: bool = True,
):
    """The block-mask kernel (contract.Kind.BLOCK_MASK, simt tier) of a fused program's mask at tiles
    block_m x block_n: plan → render → compile. Returns its Launch; grid (batch, heads, seqlen_q) -> the
    query tiles x heads x batch of the block mask. Its head dim and dtype are placeholders (it reads no q, k, v)."""
    from .backend import codegen, contract, plan, tiers
    from .passes import fuse, lowering

    tier = tiers.get("simt")
    cfg, _ = tier.configure(Kind.BLOCK_MASK, 64, "f32", arch, True)
    config = {**cfg, "block_m": block_m, "block_n": block_n}
    spec = plan.choose(variant, 64, "f32", arch, tier.name, kind=Kind.BLOCK_MASK, config=config).spec
    command = f"fagen.create_block_mask(mask_mod, ..., BLOCK_SIZE=({block_m}, {block_n})) (mask_mod traced above)"
    low, check = lowering.forward(fused, key_range)
    check()  # the key ranges, where they were not given: proven before the kernel is printed
    templates = codegen.template_cache(cache_dir, use_cache)
    (built,) = _build(
        [spec],
        lambda s: codegen.render(s, low, command, tensor_dtypes, bytecode_dir=templates),
        step_down=False,
        cache_dir=cache_dir,
        use_cache=use_cache,
    )
    return loader.launch(
        built.spec, built.source, built.binary, contract.tensor_args(fuse.tensor_reads(fused), tensor_dtypes)
    )


__all__ = ["build_kernel", "build_decode_kernel", "build_backward_kernels", "build_block_mask_launch", "load"]
