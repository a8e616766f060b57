"""The compile driver, top to bottom: request → program (parsed, built or traced) → verify → bind dtype → fuse
(proven) → key ranges (proven) → plan → render → NVRTC → step down → store → the op (fagen.builders). Every
front-end hands it a request (fagen.request); `lower` alone is what `fagen ir` prints.

A whole compile is cached on disk (fagen.cache): the same request in a later process is read back by
fagen.loader without any of these steps, so this module imports the compiler proper (SymPy, Jinja) inside the
steps that need it, never at import.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import builders
from .backend.contract import Kind
from .request import Request, captures, check_head_dim, for_compile, program_source

if TYPE_CHECKING:
    from .ir import Program
    from .passes.lowering import Lowering
    from .runtime.kernel import Kernel


@dataclass(frozen=True)
class Step:
    """One pass of the pipeline: the program after it, and what the pass proved to get there."""

    name: str
    program: Program
    proofs: tuple[str, ...] = ()
    facts: dict = field(default_factory=dict)  # what a pass derived beside the program (key ranges, the Lowering)


# --- the front door ---------------------------------------------------------------------------------------------
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

    dim: head dimension, 8..256 (one that is not a multiple of 8 of at least 32 gets a kernel of the next such
    one, whose calls pad q, k, v with zero columns: fagen.runtime.pad). causal: False, True / 'top_left' (PyTorch
    SDPA's), 'bottom_right' (FlashAttention's). window: LEFT or (LEFT, RIGHT), keys q - LEFT <= k <= q + RIGHT.
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
    """The compiled op of a request: read back from the compile cache where it was built before, else its program
    made (parsed, built or traced), lowered, and built (build_kernel), proven while NVRTC compiles, and kept."""
    check_head_dim(request.dim)
    key = request.cache_key()
    if use_cache and (kernel := builders.load(key, request.scale, cache_dir)) is not None:
        return kernel
    program = request.program()
    caught = captures(request.source)
    if key is None and (key := request.cache_key(program)) is not None:  # traced: keyed by what they traced to
        if use_cache and (kernel := builders.load(key, request.scale, cache_dir)) is not None:
            return _with_captures(kernel, caught)
    dtype = request.storage_dtype(program)
    steps, prove = rewrite(program, dtype)  # verify, bind, fuse, key ranges: proven while NVRTC compiles

    def proofs() -> tuple[str, ...]:
        return tuple(p for step in prove() for p in step.proofs)

    fused = steps[-1].program
    kind = {"decode": Kind.DECODE_SPLIT, "block_sparse": Kind.FORWARD_SPARSE}.get(request.kind, Kind.FORWARD)
    kernel = builders.build_kernel(
        fused,
        request.variant(program, fused),
        request.dim,
        dtype,
        request.arch,
        request.tier,
        kind=kind,
        scale=request.scale,
        command=request.command,
        cache_dir=cache_dir,
        use_cache=use_cache,
        proofs=proofs,
        key_range=steps[-1].facts["key_range"],
        request=key,
        tensor_dtypes=dict(request.program_dtypes(fused)),
    )
    return _with_captures(kernel, caught)


def load_program(*, causal=False, ir=None, **options) -> Program:
    """The attention program of `fagen.compile`'s options (causal, window, alibi, softcap, prefix, mask, score_mod)
    or of the user's own (`ir`: a path to an .ir file, its text, or a Program), as the request builds it."""
    return program_source(causal=causal, ir=ir, **options).build()


def _with_captures(kernel: Kernel, caught: dict) -> Kernel:
    """The kernel, told where its captured tensors live (each call reads the variable's current object)."""
    names = set(kernel.tensors)
    kernel.captured = {n: (fn, c) for n, (fn, c, _) in caught.items() if n in names}
    kernel.capture_roles = {n: (role, c) for n, (_, c, role) in caught.items() if n in names}
    return kernel


# --- the passes -----------------------------------------------------------------------------------------------
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
    from .ir import verify
    from .passes import fuse, lowering
    from .passes.dtype import bind_dtype

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
    from .ir import verify
    from .passes import backward as backward_pass
    from .passes import lowering

    derived, proven = backward_pass.derive_with_proofs(low.program, source)
    return Step(
        "backward: dQ, dK, dV (and the score's tensors) from the saved lse (proven)",
        verify(derived),
        tuple(f"{i.name}: {i.statement}" for i in proven.proofs),
        {"forward": low.program, "rule": proven.rule, "lowering": lowering.with_backward(low, proven)},
    )


# --- block masks ------------------------------------------------------------------------------------------------
def block_mask_program(request: Request) -> tuple:
    """(fused program, variant, key range, tensor dtypes) of a block-mask request's mask function (FlexAttention's
    mask_mod): traced, fused and its key ranges proven, as for an attention kernel; what the block-mask kernel
    evaluates. The dtypes are those of the tensors it captures (fagen.ir.variants.captured) and reads, as their
    objects hold now."""
    program = request.program()
    steps = lower(program, "f32")
    fused = steps[-1].program
    return fused, request.variant(program, fused), steps[-1].facts["key_range"], dict(request.program_dtypes(fused))


def block_mask_launch(request: Request, lowered: tuple):
    """The block-mask kernel's Launch of a block-mask request at its tiles, from its mask's `lowered`
    (block_mask_program's)."""
    fused, variant, key_range, tensor_dtypes = lowered
    block_m, block_n = request.tiles or (128, 128)
    return builders.build_block_mask_launch(
        fused, variant, request.arch, block_m, block_n, key_range=key_range, tensor_dtypes=tensor_dtypes
    )


__all__ = [
    "compile",
    "compile_request",
    "lower",
    "load_program",
    "Step",
]
