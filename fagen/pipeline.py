"""The pipeline, top to bottom: parse → verify → bind dtype → fuse (proven) → verify → plan → render →
compile → load. The CLI and the Python API both call `compile` (or `lower` alone for `fagen ir`).

A whole compile is cached on disk (fagen.cache): the same request in a later process returns its kernel
without running any of these steps, so this module imports the compiler proper (SymPy, Jinja) only
when a step runs (`_import_compiler`).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from pathlib import Path

from . import cache
from .backend.spec import SpecError
from .request import Request, captures, check_head_dim, declared_dtype, detect_arch, for_compile, program_source  # noqa: F401

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from .ir import Program
    from .passes.lowering import Lowering
    from .runtime.kernel import Kernel


def _import_compiler() -> None:
    """Bind the compiler's modules here, on first use (importing them loads SymPy and Jinja)."""
    global build, codegen, contract, plan, tiers, fuse, lowering, variants
    global DIMS, Op, Program, bind_dtype, parse_program, verify, shipped_programs
    from .backend import build, codegen, contract, plan, tiers
    from .ir import Op, Program, parse_program, variants, verify
    from .ir.exprs import DIMS
    from .passes import fuse, lowering
    from .passes.dtype import bind_dtype
    from .resources import shipped_programs


def _compiler(fn):
    @functools.wraps(fn)
    def with_compiler(*args, **kwargs):
        _import_compiler()
        return fn(*args, **kwargs)

    return with_compiler


@dataclass(frozen=True)
class Step:
    """One pass of the pipeline: the program after it, and what the pass proved to get there."""

    name: str
    program: Program
    proofs: tuple[str, ...] = ()
    facts: dict = field(default_factory=dict)  # what a pass derived beside the program (key ranges, the Lowering)


def load_program(*, causal=False, ir=None, **options) -> Program:
    """The attention program of `fagen.compile`'s options (causal, window, alibi, softcap, prefix, mask, score_mod)
    or of the user's own (`ir`: a path to an .ir file, its text, or a Program), as the request builds it."""
    return program_source(causal=causal, ir=ir, **options).build()


def lower(program: Program, dtype: str, backward: bool = False) -> list[Step]:
    """The IR passes, each a pure function IR → IR, with the verifier between them, and what each proved; the last
    forward step's facts hold the key ranges ("key_range") and the values the kernels print ("lowering", a
    passes.lowering.Lowering). With `backward`, one step more at the end: the backward program derived from the
    fused one (fagen.passes.backward) with the identities (g)-(k) it proved; its facts hold the forward program
    ("forward"), the rule ("rule") and the Lowering with the backward's rule and query ranges ("lowering")."""
    steps, prove = rewrite(program, dtype)
    steps = list(prove())
    if backward:
        steps.append(backward_step(steps[-1].facts["lowering"], steps[1].program))
    return steps


def rewrite(program: Program, dtype: str) -> tuple[list[Step], Callable[[], list[Step]]]:
    """`lower`'s steps before their proofs, and the function that proves them: it returns the same steps with
    the statements proven, or raises at the first that fails. `compile` renders the rewritten program and proves
    while NVRTC compiles it (NVRTC releases the GIL); nothing built from it is loaded, cached or returned unless
    the proofs hold."""
    _import_compiler()
    steps = [Step("parsed", verify(program))]
    steps.append(Step(f"bind_dtype(T = {dtype})", verify(bind_dtype(steps[-1].program, dtype))))
    fused, prove_fusion = fuse.fuse_deferred(steps[-1].program)
    steps.append(Step("fuse: softmax + matmul -> online softmax (proven)", verify(fused)))
    low, prove_ranges = lowering.forward(fused)  # the fused node, its rule and its key ranges, proven below
    facts = {"key_range": low.key_range, "lowering": low}
    steps.append(Step("key ranges: the key tiles each query tile can see (proven)", fused, (), facts))

    @functools.cache
    def prove() -> list[Step]:
        identities = tuple(f"{i.name}: {i.statement}" for i in prove_fusion())
        ranges = prove_ranges()
        return [
            *steps[:2],
            dataclasses.replace(steps[2], proofs=identities),
            dataclasses.replace(steps[3], proofs=ranges),
        ]

    return steps, prove


def backward_step(low: Lowering, source: Program | None = None) -> Step:
    """The backward program of a fused forward (`low`, its Lowering), derived and proven (fagen.passes.backward);
    `source` is the program before fusion, whose pointwise chain the chain-rule identities differentiate."""
    from .passes import backward as backward_pass

    derived, proven = backward_pass.derive_with_proofs(low.program, source)
    return Step(
        "backward: dQ, dK, dV (and the score's tensors) from the saved lse (proven)",
        verify(derived),
        tuple(f"{i.name}: {i.statement}" for i in proven.proofs),
        {"forward": low.program, "rule": proven.rule, "lowering": lowering.with_backward(low, proven)},
    )


def _while_nvrtc(prove, arch: str):
    """What a compile does on its own thread while NVRTC runs: prove the rewrite (`prove`, where compile still
    has to), then, where the kernel is for this machine's GPU, import CuPy, which its first call needs."""

    def meanwhile():
        if prove is not None:
            prove()
        if arch == detect_arch():
            import cupy  # noqa: F401

    return meanwhile


def compile(
    dim: int,
    *,
    causal: bool | str | None = False,
    window: int | tuple[int, int] | None = None,
    alibi: bool = False,
    softcap: float | None = None,
    prefix: int | None = None,
    mask: Callable[..., Any] | None = None,
    score_mod: Callable[..., Any] | None = None,
    dtype: str | None = None,
    arch: str | None = None,
    tier: str | None = None,
    ir: str | Path | Program | None = None,
    scale: float | None = None,
    cache_dir: str | Path | None = None,
    use_cache: bool = True,
    decode: bool = False,
    block_sparse: bool = False,
    tensor_dtypes: dict | None = None,
) -> Kernel:
    """Compile an attention kernel; returns a callable `Kernel`.

    dim: head dimension (multiple of 8, 32..256). causal: False, True / 'top_left' (PyTorch SDPA's),
    'bottom_right' (FlashAttention's). window: LEFT or (LEFT, RIGHT), keys q - LEFT <= k <= q + RIGHT.
    alibi: add slopes[h] * (k - q) (pass slopes=... at call time). softcap: C * tanh(s / C). prefix: L,
    prefix-LM. mask(b, h, q, k) and score_mod(s, b, h, q, k): your own, traced (fagen.variants).
    dtype: 'bf16', 'f16' or 'f32' (default: what an ir program declares, else bf16).
    arch: e.g. 'sm_90a' (default: the current GPU's, else sm_90a).
    ir: a program (path, text or Program) instead. scale: the default softmax scale (the program's,
    1/sqrt(dim)). cache_dir: where compiled kernels are kept (default $FAGEN_CACHE_DIR, else
    ~/.cache/fagen); use_cache=False compiles afresh and writes nothing there.

    The whole result is cached (fagen.cache): compiling the same kernel again, in any process, reads it
    back without SymPy, Jinja or NVRTC. Traced mask/score_mod functions are traced with SymPy each time
    (only the steps after tracing are cached), so that path stays slower.

    tensor_dtypes: the dtypes of the call-time tensors the program reads, by name ('f32' (default), 'f16',
    'bf16', 'i32', 'i64', 'bool' or the library's names): part of the kernel, checked at each call. A tensor a
    traced function captures from its enclosing scope takes the dtype of the object it holds now, and the
    kernel reads the object the variable holds at each call (fagen.ir.variants.captured).

    decode=True: a split-KV decode op instead (`Kernel.decode(q, k_cache, v_cache, cache_seqlens)`): one split
    kernel, whose last block of each row tile merges the splits with the proven merge. There causal=True means
    bottom-right aligned (token i of q_len sees keys <= cache_seqlens[b] - q_len + i, flash_attn_with_kvcache's).
    The whole op is cached as a forward kernel is.

    block_sparse=True: the forward over the key tiles a run-time block mask lists (`kernel(q, k, v,
    block_mask=fagen.create_block_mask(...))`; contract.Kind.FORWARD_SPARSE): empty tiles are skipped and the
    mask is not evaluated on full ones, inside the proven key ranges.
    """
    request = for_compile(
        dim,
        causal=causal,
        window=window,
        alibi=alibi,
        softcap=softcap,
        prefix=prefix,
        mask=mask,
        score_mod=score_mod,
        dtype=dtype,
        arch=arch,
        tier=tier,
        ir=ir,
        scale=scale,
        decode=decode,
        block_sparse=block_sparse,
        tensor_dtypes=tensor_dtypes,
    )
    return compile_request(request, cache_dir=cache_dir, use_cache=use_cache)


def compile_request(request: Request, *, cache_dir=None, use_cache: bool = True) -> Kernel:
    """The compiled op of a request: from the compile cache where it was built before (no SymPy, Jinja or NVRTC),
    else parsed or traced, lowered (proven while NVRTC compiles), planned, rendered and compiled, and kept."""
    check_head_dim(request.dim)
    key = request.cache_key()
    if use_cache and key is not None and (hit := cache.load(key, cache_dir)) is not None:
        return _from_cache(hit, request.scale, cache_dir, use_cache)
    _import_compiler()
    program = request.program()
    caught = captures(request.source)
    if key is None and (key := request.cache_key(program)) is not None:  # traced: keyed by what they traced to
        if use_cache and (hit := cache.load(key, cache_dir)) is not None:
            return _with_captures(_from_cache(hit, request.scale, cache_dir, use_cache), caught)
    dtype = request.storage_dtype(program)
    steps, prove = rewrite(program, dtype)  # verify, bind, fuse; proven while NVRTC compiles (build_kernel)
    fused = steps[-1].program

    def proofs():
        return tuple(p for step in prove() for p in step.proofs)

    tensor_dtypes = dict(request.tensor_dtypes)
    kind = contract.Kind.FORWARD_SPARSE if request.kind == "block_sparse" else contract.Kind.FORWARD
    builder = (
        functools.partial(build_decode_kernel, request=key)
        if request.kind == "decode"
        else functools.partial(build_kernel, request=key, kind=kind)
    )
    kernel = builder(
        fused,
        request.variant(program, fused),
        request.dim,
        dtype,
        request.arch,
        request.tier,
        scale=request.scale,
        command=request.command,
        cache_dir=cache_dir,
        use_cache=use_cache,
        proofs=proofs,
        key_range=steps[-1].facts.get("key_range"),
        tensor_dtypes=tensor_dtypes,
    )
    return _with_captures(kernel, caught)


def _with_captures(kernel: Kernel, captures: dict) -> Kernel:
    """The kernel, told where its captured tensors live (each call reads the variable's current object)."""
    names = set(getattr(kernel, "tensors", ()))
    kernel.captured = {n: (fn, c) for n, (fn, c, _) in captures.items() if n in names}
    kernel.capture_roles = {n: (role, c) for n, (_, c, role) in captures.items() if n in names}
    return kernel


def build_kernel(
    fused: Program,
    variant: str,
    dim: int,
    dtype: str,
    arch: str,
    tier: str | None = None,
    *,
    scale: float | None = None,
    command=None,
    config: dict | None = None,
    cache_dir=None,
    use_cache: bool = True,
    proofs: tuple | Callable[[], tuple] = (),
    key_range=None,
    request=None,
    kind=None,
    tensor_dtypes: dict | None = None,
) -> Kernel:
    """plan → render → compile → load, for a fused program: the back half of `compile` (and of `fagen tune`, which
    passes `config`, the tiles to time); with a `request`, into the compile cache. `kind`: FORWARD (default) or
    FORWARD_SPARSE. `proofs`: the statements proven for `fused`, or compile's function that proves them while NVRTC
    compiles (its error raises before anything is kept); `key_range`: its proven key ranges (else proven here)."""
    _import_compiler()
    low, check = lowering.forward(fused, key_range)  # what the kernel prints
    kind = kind or contract.Kind.FORWARD
    choice = plan.choose(variant, dim, dtype, arch, tier, causal=fuse.is_masked(fused), config=config, kind=kind)
    prove = _proving(check, proofs)  # compile's proofs still to run, and the key ranges derived here

    def render(spec):
        line = command(spec) if command else None
        return codegen.render(spec, low, line, tensor_dtypes, bytecode_dir=codegen.template_cache(cache_dir, use_cache))

    # render → compile the chosen tiles and the lighter ones a score function may need (plan.spare); prove meanwhile
    specs = [choice.spec]
    if config is None and (spare := plan.spare(choice.spec, fuse.is_scored(fused))) is not None:
        specs.append(spare)
    sources = [render(spec) for spec in specs]
    binaries = build.compile_cubins(
        list(zip(sources, specs)), cache_dir=cache_dir, use_cache=use_cache, meanwhile=_while_nvrtc(prove, arch)
    )
    proofs = prove()
    built = dict(zip(specs, zip(sources, binaries)))
    source, binary = built[choice.spec]
    while binary.resources.spills and config is None and (lighter := plan.lighter(choice.spec)) is not None:
        # this program's score function needs registers the chosen tiles do not leave: step down
        why = f"{choice.spec.name} spilled ({binary.resources.stack_frame} B stack frame), so lighter tiles"
        choice = plan.Choice(lighter, f"{choice.reason}; {why}")
        if lighter not in built:
            source = render(lighter)
            built[lighter] = source, build.compile_cubin(source, lighter, cache_dir=cache_dir, use_cache=use_cache)
        source, binary = built[lighter]
    default_scale, tensors, index = _facts(low, dim, tensor_dtypes)
    if use_cache and request is not None and config is None:
        cache.store(
            request,
            cache_dir,
            [(choice.spec, source, binary)],
            tensors=tensors,
            proofs=proofs,
            default_scale=default_scale,
            tier_reason=choice.reason,
            tensor_index=index,
            program=str(fused),
        )
    return _kernel(
        choice.spec,
        fused,
        source,
        binary,
        default_scale,
        scale,
        choice.reason,
        tensors,
        index,
        cache_dir,
        use_cache,
        proofs,
        key_range=low.key_range,
    )


def _facts(low: Lowering, dim: int, tensor_dtypes: dict | None) -> tuple[float, tuple, dict]:
    """What a kernel keeps of its program: the default scale at head dim `dim`, the call-time tensors
    (contract.TensorArg) and what each is read as (fuse.tensor_index)."""
    tensors = contract.tensor_args(fuse.tensor_reads(low.program), tensor_dtypes)
    index = {t.name: fuse.tensor_index(low.program, t.name) for t in tensors}
    return float(low.node.attr("scale").xreplace({DIMS["D"]: dim})), tensors, index


def _proving(check, proofs, *more) -> Callable[[], tuple]:
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


def build_decode_kernel(
    fused: Program,
    variant: str,
    dim: int,
    dtype: str,
    arch: str,
    tier: str | None = None,
    *,
    scale: float | None = None,
    command=None,
    cache_dir=None,
    use_cache: bool = True,
    proofs: tuple | Callable[[], tuple] = (),
    key_range=None,
    config: dict | None = None,
    tensor_dtypes: dict | None = None,
    request=None,
) -> Kernel:
    """The split-KV decode op: its split kernel (plan → render → compile), which merges its own splits (the last
    block of a row tile to finish), a Plan of one launch with a float32 workspace. The merge is printed from the
    Lowering (passes.lowering.with_merge) and proven while NVRTC compiles, beside the rewrite; its statements join the
    kernel's proofs. `config`: the split kernel's tile fields (block_m, block_n, num_warps), overriding the tier's, as
    a tuning run does. With a `request`, the result goes into the compile cache."""
    _import_compiler()
    low, check = lowering.forward(fused, key_range)
    low, prove_merge = lowering.with_merge(low)  # what the split kernel prints
    prove = _proving(check, proofs, prove_merge)  # the rewrite's proofs and the merge's, run while NVRTC compiles
    masked = fuse.is_masked(fused)
    # A requested tier without a decode kernel (wgmma) hands decode down its fallback chain (wgmma -> mma -> simt),
    # as the backward does; the tier that cannot take these inputs at all still says why.
    tier = backward_tier(contract.Kind.DECODE_SPLIT, dim, dtype, arch, tier) or tier
    split = plan.choose(variant, dim, dtype, arch, tier, causal=masked, kind=contract.Kind.DECODE_SPLIT, config=config)
    specs = (split.spec,)
    templates = codegen.template_cache(cache_dir, use_cache)
    sources = [
        codegen.render(spec, low, command(spec) if command else None, tensor_dtypes, bytecode_dir=templates)
        for spec in specs
    ]
    binaries = build.compile_cubins(
        list(zip(sources, specs)), cache_dir=cache_dir, use_cache=use_cache, meanwhile=_while_nvrtc(prove, arch)
    )
    proofs = prove()
    while binaries[0].resources.spills and config is None and (lighter := plan.lighter(specs[0])) is not None:
        # the split kernel's score function needs registers its tiles do not leave: step down
        split = plan.Choice(lighter, f"{split.reason}; {specs[0].name} spilled, so lighter tiles")
        specs = (lighter,)
        line = command(lighter) if command else None
        sources[0] = codegen.render(lighter, low, line, tensor_dtypes, bytecode_dir=templates)
        binaries[0] = build.compile_cubin(sources[0], lighter, cache_dir=cache_dir, use_cache=use_cache)
    default_scale, tensors, index = _facts(low, dim, tensor_dtypes)
    if use_cache and request is not None and config is None:
        cache.store(
            request,
            cache_dir,
            list(zip(specs, sources, binaries)),
            tensors=tensors,
            proofs=proofs,
            default_scale=default_scale,
            tier_reason=split.reason,
            tensor_index=index,
            program=str(fused),
        )
    return _decode_kernel(specs, sources, binaries, fused, default_scale, scale, split.reason, tensors, index, proofs)


def _decode_kernel(specs, sources, binaries, fused, default_scale, scale, tier_reason, tensors, index, proofs):
    """The decode op of its split kernel: a Plan of one launch with the float32 workspace and the split counts,
    its split count planned over the blocks an SM holds. `fused`: the Program, or its text from the cache."""
    import functools

    from .backend import contract, splits, tiers
    from .runtime.kernel import Kernel, Launch, Plan

    t = tiers.get(specs[0].tier)
    launches = []
    for spec, source, binary in zip(specs, sources, binaries):
        launches.append(
            Launch(
                spec,
                source,
                binary,
                t.smem_bytes(spec),
                contract.params(spec.kind, tuple(tensors), t.extra_params(spec)),
                t.threads(spec),
                functools.partial(t.decode_grid, spec),
            )
        )
    regs = launches[0].binary.resources.registers  # the split count plans waves of the blocks an SM holds
    per_sm = (
        t.decode_blocks_per_sm
        if not regs
        else splits.resident_blocks(regs, t.threads(specs[0]), launches[0].smem_bytes)
    )
    fused_text = fused if isinstance(fused, str) else None
    return Kernel(
        Plan(tuple(launches), workspaces=("ws_acc", "ws_ml", "split_count"), blocks_per_sm=per_sm),
        fused if fused_text is None else lambda: _parse_cached(fused_text, specs[0].name),
        default_scale=float(default_scale if scale is None else scale),
        tier_reason=tier_reason,
        fits=t.fits,
        tensors=tuple(tensors),
        tensor_index=index,
        proofs=proofs,
    )


def block_mask_program(request: Request) -> tuple:
    """(fused program, variant, key range, tensor dtypes) of a block-mask request's mask function (FlexAttention's
    mask_mod): traced, fused and its key ranges proven, as for an attention kernel; what the block-mask kernel
    evaluates. The dtypes are those of the tensors it captures (fagen.ir.variants.captured), as their objects hold
    now."""
    _import_compiler()
    program = request.program()
    steps = lower(program, "f32")
    fused = steps[-1].program
    return fused, request.variant(program, fused), steps[-1].facts["key_range"], dict(request.tensor_dtypes)


def block_mask_launch(request: Request, lowered: tuple):
    """The block-mask kernel's Launch of a block-mask request at its tiles, from its mask's `lowered`
    (block_mask_program's)."""
    fused, variant, key_range, tensor_dtypes = lowered
    block_m, block_n = request.tiles or (128, 128)
    return build_block_mask_launch(
        fused, variant, request.arch, block_m, block_n, key_range=key_range, tensor_dtypes=tensor_dtypes
    )


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
    import functools

    from .runtime.kernel import Launch

    _import_compiler()
    kind = contract.Kind.BLOCK_MASK
    tier = tiers.get("simt")
    cfg, _ = tier.configure(kind, 64, "f32", arch, True)
    choice = plan.choose(
        variant, 64, "f32", arch, tier.name, kind=kind, config={**cfg, "block_m": block_m, "block_n": block_n}
    )
    spec = choice.spec
    command = f"fagen.create_block_mask(mask_mod, ..., BLOCK_SIZE=({block_m}, {block_n})) (mask_mod traced above)"
    low, check = lowering.forward(fused, key_range)
    check()  # the key ranges, where they were not given: proven before the kernel is printed
    templates = codegen.template_cache(cache_dir, use_cache)
    source = codegen.render(spec, low, command, tensor_dtypes, bytecode_dir=templates)
    binary = build.compile_cubin(source, spec, cache_dir=cache_dir, use_cache=use_cache)
    return Launch(
        spec,
        source,
        binary,
        tier.smem_bytes(spec),
        contract.params(kind, contract.tensor_args(fuse.tensor_reads(fused), tensor_dtypes)),
        tier.threads(spec),
        functools.partial(tier.grid, spec),
    )


def backward_tier(kind, dim: int, dtype: str, arch: str, forward_tier: str | None) -> str | None:
    """The tier of a backward kind: the first of the forward's tier family (the tier, its fallback, the fallback's
    fallback ...) that compiles it, so the mma kernels back an mma or wgmma forward and the simt ones a simt
    forward. None without a forward tier (the planner's default then: the supporting tier of highest priority)."""
    _import_compiler()
    if forward_tier is None:
        return None
    t = tiers.get(forward_tier)
    while t is not None:
        if t.supports(kind, dim, dtype, arch) is None:
            return t.name
        t = tiers.get(t.fallback) if t.fallback else None
    return None


def build_backward_kernels(
    fused: Program,
    variant: str,
    dim: int,
    dtype: str,
    arch: str,
    tier: str | None = None,
    *,
    forward_tier: str | None = None,
    command=None,
    cache_dir=None,
    use_cache: bool = True,
    tensor_dtypes: dict | None = None,
    key_range=None,
):
    """The backward of a fused program (FlashAttention-2's split): its rule and transposed key ranges derived and
    proven (fagen.passes.backward.prove_rule), then plan → render → compile for each backward kind on its tier:
    `tier` for the main kind when given, else the first tier of the forward's family (`forward_tier`, its
    fallbacks) that compiles the kind (backward_tier), else the planner's default. `key_range`: the forward's key
    ranges, as its compile proved them (derived and proven here where not given). Returns a BackwardPlan."""
    from .passes import backward as backward_pass
    from .runtime.kernel import BackwardPlan

    _import_compiler()
    low, check = lowering.forward(fused, key_range)
    check()  # the key ranges, where not given: proven before the kernels are printed
    proven = backward_pass.prove_rule(fused)  # refuses a score it cannot differentiate, or a failed proof
    low = lowering.with_backward(low, proven)  # what the backward kernels print
    proofs = proven.statements()
    masked = fuse.is_masked(fused)
    K = contract.Kind
    tensors = contract.tensor_args(fuse.tensor_reads(fused), tensor_dtypes)
    kinds = (K.BWD_PREPROCESS, K.BWD, K.BWD_CONVERT, K.BWD_DQ)
    specs = []
    for kind in kinds:
        chosen = tier if kind is K.BWD and tier is not None else backward_tier(kind, dim, dtype, arch, forward_tier)
        specs.append(plan.choose(variant, dim, dtype, arch, chosen, causal=masked, kind=kind).spec)
    templates = codegen.template_cache(cache_dir, use_cache)

    def render(spec):
        return codegen.render(spec, low, command(spec) if command else None, tensor_dtypes, bytecode_dir=templates)

    gradients = tuple((g.name, g.index) for g in codegen.slot_gradients(proven.rule, tensors))
    i = kinds.index(K.BWD)  # the main kernel: lighter tiles while it spills more than its tier accepts
    if gradients:  # and its variant summing the gradients of tensors read as name[h] / [b] / [b, h] (when asked)
        specs.append(tiers.get(specs[i].tier).replace(specs[i], tensor_grads=True))
    sources = [render(spec) for spec in specs]
    mains = [i, len(kinds)] if gradients else [i]
    jobs = list(zip(sources, specs))
    for m in mains:  # their likely step-downs, compiled at once
        if (spare := plan.spare(specs[m], fuse.is_scored(fused))) is not None:
            jobs.append((render(spare), spare))
    binaries = build.compile_cubins(jobs, cache_dir=cache_dir, use_cache=use_cache)
    built = {spec: (source, binary) for (source, spec), binary in zip(jobs[len(specs) :], binaries[len(specs) :])}
    binaries = binaries[: len(specs)]
    for m in mains:
        while binaries[m].resources.stack_frame > tiers.get(specs[m].tier).backward_stack_budget and (
            lighter := plan.lighter(specs[m])
        ):
            if lighter not in built:
                source = render(lighter)
                built[lighter] = source, build.compile_cubin(source, lighter, cache_dir=cache_dir, use_cache=use_cache)
            specs[m] = lighter
            sources[m], binaries[m] = built[lighter]
    assert all(specs[m].tensor_grads == (m != i) for m in mains), (
        "a step-down changed which main kernel sums the tensors' gradients"
    )
    launches = [_backward_launch(*launch, tensors) for launch in zip(specs, sources, binaries)]
    return BackwardPlan(
        *launches[: len(kinds)],  # in BackwardPlan's order
        main_grads=launches[len(kinds)] if gradients else None,
        gradients=gradients,
        scatters=tuple(t.name for t in tensors if t.grad),
        proofs=proofs,
    )


def _backward_launch(spec, source, binary, tensors):
    import functools

    from .backend import contract, tiers
    from .runtime.kernel import Launch

    t = tiers.get(spec.tier)
    params = contract.params(spec.kind, tuple(tensors), t.extra_params(spec))
    return Launch(
        spec, source, binary, t.smem_bytes(spec), params, t.threads(spec), functools.partial(t.backward_grid, spec)
    )


def backward_plan(fused, spec, tensors, *, cache_dir=None, use_cache: bool = True, key_range=None):
    """The backward of the forward kernel `spec` (its fused Program, or the program's text from the cache): from
    the compile cache where it was built before (no SymPy, Jinja or NVRTC), else derived, proven and built
    (build_backward_kernels) and kept there. `tensors`: the forward's call-time tensors (contract.TensorArg);
    `key_range`: the forward's key ranges, where its compile proved them in this process."""
    from .runtime.kernel import BackwardPlan

    text = fused if isinstance(fused, str) else str(fused)
    tensor_dtypes = {a.name: a.dtype for a in tensors if a.dtype != "f32"}
    what = {"backward_of": text, "variant": spec.variant}
    request = cache.request(spec.head_dim, spec.dtype, spec.arch, spec.tier, what, tensor_dtypes)
    if use_cache and (hit := cache.load(request, cache_dir)) is not None:
        launches = [_backward_launch(*launch, tensors) for launch in hit["launches"]]
        return BackwardPlan(
            *launches[:4],
            main_grads=launches[4] if len(launches) > 4 else None,
            gradients=tuple(tuple(g) for g in hit["gradients"]),
            scatters=tuple(hit["scatters"]),
            proofs=tuple(hit["proofs"]),
        )
    built = build_backward_kernels(
        _parse_cached(text, spec.name) if isinstance(fused, str) else fused,
        spec.variant,
        spec.head_dim,
        spec.dtype,
        spec.arch,
        forward_tier=spec.tier,
        cache_dir=cache_dir,
        use_cache=use_cache,
        tensor_dtypes=tensor_dtypes,
        key_range=key_range,
    )
    if use_cache:
        launches = (built.preprocess, built.main, built.convert, built.dq, *filter(None, [built.main_grads]))
        cache.store(
            request,
            cache_dir,
            [(x.spec, x.source, x.binary) for x in launches],
            proofs=built.proofs,
            gradients=[list(g) for g in built.gradients],
            scatters=list(built.scatters),
        )
    return built


def _from_cache(hit: dict, scale, cache_dir, use_cache) -> Kernel:
    """The Kernel of a compile-cache entry (cache.load's): a forward's one launch, or a decode's."""
    from .backend.contract import Kind

    tensors = tuple(_tensor_arg(*t) for t in hit["tensors"])
    if hit["launches"][0][0].kind is Kind.DECODE_SPLIT:
        return _decode_kernel(
            *zip(*hit["launches"]),
            hit["program"],
            hit["default_scale"],
            scale,
            hit["tier_reason"],
            tensors,
            hit["tensor_index"],
            tuple(hit["proofs"]),
        )
    ((spec, source, binary),) = hit["launches"]
    return _kernel(
        spec,
        hit["program"],
        source,
        binary,
        hit["default_scale"],
        scale,
        hit["tier_reason"],
        tensors,
        hit["tensor_index"],
        cache_dir,
        use_cache,
        tuple(hit["proofs"]),
    )


def _parse_cached(text: str, name: str) -> Program:
    """The fused program of a kernel from the cache (its text), parsed when first asked for."""
    _import_compiler()
    return parse_program(text, source=f"<{name}>")


def _tensor_arg(name, dtype="f32", rank=1, grad=False, dims=""):
    from .backend.contract import TensorArg

    return TensorArg(name, dtype, rank, grad, dims)


def _kernel(
    spec,
    fused,
    source,
    binary,
    default_scale,
    scale,
    tier_reason,
    tensors,
    index,
    cache_dir,
    use_cache,
    proofs,
    key_range=None,
) -> Kernel:
    """The Kernel, a plan of one launch (it loads on first call); `fused` is the fused Program, or its text
    from the cache (parsed when first asked for); `key_range` its proven key ranges, where this process has them
    (its fallback and backward print them rather than prove them again)."""
    import functools

    from .backend import contract, tiers
    from .runtime.kernel import Kernel, Launch, Plan

    t = tiers.get(spec.tier)
    launch = Launch(
        spec,
        source,
        binary,
        t.smem_bytes(spec),
        contract.params(spec.kind, tuple(tensors), t.extra_params(spec)),
        t.threads(spec),
        functools.partial(t.grid, spec),
    )
    fused_text = fused if isinstance(fused, str) else str(fused)
    tensor_dtypes = {a.name: a.dtype for a in tensors if a.dtype != "f32"}

    def program():
        return _parse_cached(fused_text, spec.name)

    def fallback():  # for inputs this tier cannot take (unaligned, strided along D)
        what = {"fused": fused_text, "variant": spec.variant}
        if spec.kind is contract.Kind.FORWARD_SPARSE:
            what["block_sparse"] = True
        request = cache.request(spec.head_dim, spec.dtype, spec.arch, t.fallback, what, tensor_dtypes)
        if use_cache and (hit := cache.load(request, cache_dir)) is not None:
            return _from_cache(hit, scale, cache_dir, use_cache)
        return build_kernel(
            program(),
            spec.variant,
            spec.head_dim,
            spec.dtype,
            spec.arch,
            t.fallback,
            scale=scale,
            cache_dir=cache_dir,
            use_cache=use_cache,
            proofs=proofs,
            key_range=key_range,
            request=request,
            kind=spec.kind,
            tensor_dtypes=tensor_dtypes,
        )

    kernel = Kernel(
        Plan((launch,)),
        fused if not isinstance(fused, str) else program,
        default_scale=float(default_scale if scale is None else scale),
        tier_reason=tier_reason,
        fallback=fallback if t.fallback else None,
        fits=t.fits,
        tensors=tuple(tensors),
        tensor_index=index,
        proofs=proofs,
    )
    kernel._backward_factory = lambda: backward_plan(  # built (or read from the cache) on the first Kernel.backward
        fused, spec, tensors, cache_dir=cache_dir, use_cache=use_cache, key_range=key_range
    )
    return kernel


__all__ = [
    "compile",
    "build_kernel",
    "build_decode_kernel",
    "build_backward_kernels",
    "lower",
    "load_program",
    "detect_arch",
    "Step",
    "SpecError",
]
