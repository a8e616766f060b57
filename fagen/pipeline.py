"""The pipeline, top to bottom: parse → verify → bind dtype → fuse (proven) → verify → plan → render →
compile → load. The CLI and the Python API both call `compile` (or `lower` alone for `fagen ir`).

A whole compile is cached on disk (fagen.cache): the same request in a later process returns its kernel
without running any of these steps, so this module imports the compiler proper (SymPy, networkx, Jinja) only
when a step runs (`_import_compiler`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from . import build, cache, plan
from .spec import SpecError, normalize_arch, normalize_dtype

TYPE_CHECKING = False   # typing.TYPE_CHECKING, without importing typing
if TYPE_CHECKING:
    from .kernel import Kernel

CAUSAL_PROGRAMS = {False: "full", None: "full", True: "causal", "top_left": "causal", "bottom_right": "causal_br"}


def _import_compiler() -> None:
    """Bind the compiler's modules here, on first use (importing them loads SymPy, networkx and Jinja)."""
    global codegen, fusion, variants, DIMS, Op, Program, bind_dtype, parse_program, verify, shipped_programs
    from . import codegen, fusion, variants
    from .exprs import DIMS
    from .ir import Op, Program, bind_dtype, parse_program, verify
    from .resources import shipped_programs


def _compiler(fn):
    @functools.wraps(fn)
    def with_compiler(*args, **kwargs):
        _import_compiler()
        return fn(*args, **kwargs)
    return with_compiler


@dataclass(frozen=True)
class Step:
    name: str
    program: Program


@_compiler
def load_program(*, causal=False, ir=None, **variant) -> Program:
    """The attention program: built from options (causal, window, alibi, softcap, prefix, mask, score_mod;
    see fagen.variants) or the user's own (`ir`: a path to a .ir file, its text, or a Program)."""
    variant = {k: v for k, v in variant.items() if v is not None and v is not False}
    if ir is not None:
        if causal not in (False, None) or variant:
            given = ", ".join(["causal"] * (causal not in (False, None)) + sorted(variant))
            raise ValueError(f"ir: an ir program states its own mask and score; drop {given}")
        if isinstance(ir, Program):
            return verify(ir)
        if isinstance(ir, Path) or (isinstance(ir, str) and "\n" not in ir and ir.endswith(".ir")):
            path = Path(ir)
            try:
                text = path.read_text()
            except OSError as e:
                raise ValueError(f"ir: cannot read {str(path)!r}: {e.strerror}") from None
            return parse_program(text, source=str(path))
        if isinstance(ir, str):
            return parse_program(ir)
        raise TypeError(f"ir: expected a path, program text or Program, got {type(ir).__name__}")
    if causal not in CAUSAL_PROGRAMS:
        raise ValueError(f"causal: expected False, True, 'top_left' or 'bottom_right', got {causal!r}")
    if not variant:     # the shipped programs, read from ir/
        path = shipped_programs()[CAUSAL_PROGRAMS[causal]]
        return parse_program(path.read_text(), source=path.name)
    return variants.build(causal=causal, **variant)


def lower(program: Program, dtype: str) -> list[Step]:
    """The IR passes, each a pure function IR → IR, with the verifier between them."""
    _import_compiler()
    steps = [Step("parsed", verify(program))]
    steps.append(Step(f"bind_dtype(T = {dtype})", verify(bind_dtype(steps[-1].program, dtype))))
    steps.append(Step("fuse: softmax + matmul -> online softmax (proven)", verify(fusion.fuse(steps[-1].program))))
    return steps


def detect_arch() -> str | None:
    """The arch of the current CUDA device, or None where there is no GPU. Asks the CUDA driver itself
    (ctypes) unless CuPy is loaded already: importing CuPy to learn one number would cost more than a
    cached compile."""
    import sys
    if "cupy" in sys.modules:
        try:
            cupy = sys.modules["cupy"]
            if cupy.cuda.runtime.getDeviceCount() < 1:
                return None
            cc = cupy.cuda.Device().compute_capability
        except Exception:
            return None
    else:
        cc = _driver_compute_capability()
        if cc is None:
            return None
    return f"sm_{cc}{'a' if cc == '90' else ''}"


def _driver_compute_capability() -> str | None:
    """"90" etc. for the current context's device (device 0 where no context is current), from libcuda."""
    import ctypes
    import sys
    try:
        lib = ctypes.WinDLL("nvcuda.dll") if sys.platform == "win32" else ctypes.CDLL("libcuda.so.1")
        if lib.cuInit(0) != 0:
            return None
        count, ctx, dev = ctypes.c_int(0), ctypes.c_void_p(), ctypes.c_int(0)
        if lib.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value < 1:
            return None
        if lib.cuCtxGetCurrent(ctypes.byref(ctx)) == 0 and ctx.value:
            if lib.cuCtxGetDevice(ctypes.byref(dev)) != 0:
                return None
        major, minor = ctypes.c_int(0), ctypes.c_int(0)
        if lib.cuDeviceGetAttribute(ctypes.byref(major), 75, dev) != 0 \
                or lib.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev) != 0:   # COMPUTE_CAPABILITY_MAJOR/MINOR
            return None
    except (OSError, AttributeError):
        return None
    return f"{major.value}{minor.value}"


def _command(spec, ir, causal, window, alibi, softcap, prefix, mask, score_mod) -> str | None:
    """The command that regenerates the kernel, for its header."""
    if mask is not None or score_mod is not None:
        return ("fagen.compile(...) with traced mask/score_mod functions (the program above is what they traced "
                "to; save it as an .ir file to use fagen compile --ir)")
    if ir is not None or (not window and not alibi and softcap is None and prefix is None):
        return None     # the shipped programs and ir files: codegen's own rule
    flags = [f"--dim {spec.head_dim}"]
    if causal not in (False, None):
        flags.append("--causal" if causal in (True, "top_left") else "--causal bottom_right")
    if window is not None:
        flags.append(f"--window {','.join(map(str, window)) if isinstance(window, (tuple, list)) else window}")
    if alibi:
        flags.append("--alibi")
    if softcap is not None:
        flags.append(f"--softcap {softcap:g}")
    if prefix is not None:
        flags.append(f"--prefix {prefix}")
    return f"fagen compile {' '.join(flags)} --dtype {spec.dtype} --arch {spec.arch} --tier {spec.tier}"


def _variant(name: str) -> str:
    import re
    v = re.sub(r"[^a-z0-9_]", "_", name.lower())
    return v if v[:1].isalpha() else "p_" + v


def compile(dim: int, *, causal=False, window=None, alibi=False, softcap=None, prefix=None, mask=None,
            score_mod=None, dtype="bf16", arch=None, tier=None, ir=None, scale=None,
            cache_dir=None, use_cache=True) -> Kernel:
    """Compile an attention kernel; returns a callable `Kernel`.

    dim: head dimension (multiple of 8, 32..256). causal: False, True / 'top_left' (PyTorch SDPA's),
    'bottom_right' (FlashAttention's). window: LEFT or (LEFT, RIGHT), keys q - LEFT <= k <= q + RIGHT.
    alibi: add slopes[h] * (k - q) (pass slopes=... at call time). softcap: C * tanh(s / C). prefix: L,
    prefix-LM. mask(b, h, q, k) and score_mod(s, b, h, q, k): your own, traced (fagen.variants).
    dtype: 'bf16', 'f16' or 'f32'. arch: e.g. 'sm_90a' (default: the current GPU's, else sm_90a).
    ir: a program (path, text or Program) instead. scale: the default softmax scale (the program's,
    1/sqrt(dim)). cache_dir: where compiled kernels are kept (default $FAGEN_CACHE_DIR, else
    ~/.cache/fagen); use_cache=False compiles afresh and writes nothing there.

    The whole result is cached (fagen.cache): compiling the same kernel again, in any process, reads it
    back without SymPy, Jinja or NVRTC. Traced mask/score_mod functions are traced with SymPy each time
    (only the steps after tracing are cached), so that path stays slower.
    """
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim: expected an int head dimension, got {dim!r}")
    if not (32 <= dim <= 256 and dim % 8 == 0):
        raise ValueError(f"dim: expected a multiple of 8 between 32 and 256, got {dim}")
    dtype = normalize_dtype(dtype)
    arch = normalize_arch(arch) if arch is not None else (detect_arch() or "sm_90a")
    traced = mask is not None or score_mod is not None
    if ir is not None:
        what = None if (causal not in (False, None) or window is not None or alibi or softcap is not None
                        or prefix is not None or traced) else cache.ir_request(ir)
    elif not traced:
        what = cache.options_request(causal=causal, window=window, alibi=alibi, softcap=softcap, prefix=prefix)
    else:
        what = None
    request = cache.request(dim, dtype, arch, tier, what)
    if use_cache and request is not None and (hit := cache.load(request, cache_dir)) is not None:
        return _kernel(hit["spec"], hit["program"], hit["source"], hit["binary"], hit["default_scale"], scale,
                       hit["tier_reason"], hit["tensors"], hit["tensor_index"], cache_dir, use_cache)

    _import_compiler()
    program = load_program(causal=causal, ir=ir, window=window, alibi=alibi, softcap=softcap,  # parse
                           prefix=prefix, mask=mask, score_mod=score_mod)
    if traced:
        request = cache.request(dim, dtype, arch, tier, cache.traced_request(program))
        if use_cache and (hit := cache.load(request, cache_dir)) is not None:
            return _kernel(hit["spec"], hit["program"], hit["source"], hit["binary"], hit["default_scale"],
                           scale, hit["tier_reason"], hit["tensors"], hit["tensor_index"], cache_dir, use_cache)
    steps = lower(program, dtype)                                         # verify, bind, fuse (proven)
    fused = steps[-1].program
    node = fusion.fused_node(fused)
    choice = plan.choose(_variant(fused.name), dim, dtype, arch, tier,    # plan
                         causal=codegen.is_masked(fused))
    command = _command(choice.spec, ir, causal, window, alibi, softcap, prefix, mask, score_mod)
    source = codegen.render(choice.spec, fused, command)                  # render
    binary = build.compile_cubin(source, choice.spec, cache_dir=cache_dir, use_cache=use_cache)  # compile
    while binary.resources.spills and (lighter := plan.lighter(choice.spec)) is not None:
        # this program's score function needs registers the chosen tiles do not leave: step down
        why = f"{choice.spec.name} spilled ({binary.resources.stack_frame} B stack frame), so lighter tiles"
        choice = plan.Choice(lighter, f"{choice.reason}; {why}")
        source = codegen.render(choice.spec, fused, command)
        binary = build.compile_cubin(source, choice.spec, cache_dir=cache_dir, use_cache=use_cache)
    default_scale = float(node.attr("scale").xreplace({DIMS["D"]: dim}))
    tensors = codegen.tensors_of(fused)
    index = {name: codegen.tensor_index(fused, name) for name in tensors}
    if use_cache and request is not None:
        cache.store(request, cache_dir, spec=choice.spec, source=source, binary=binary, default_scale=default_scale,
                    tier_reason=choice.reason, tensors=tensors, tensor_index=index, program=str(fused),
                    proofs=proofs(steps[-2].program))
    return _kernel(choice.spec, fused, source, binary, default_scale, scale, choice.reason, tensors, index,
                   cache_dir, use_cache)


def proofs(program: Program) -> list[tuple[str, str]]:
    """(name, statement) of every identity fusing `program` relies on (fusion.prove; proven again here,
    from its memo within a process, so that the cache records what was shown)."""
    out = []
    for sm in program.find(Op.SOFTMAX):
        m = fusion.match(program, sm)
        scale, fn, keep = fusion.compose(m.chain)
        out += [(i.name, i.statement) for i in fusion.prove(fusion.make_rule(fn, keep), m.chain, scale)]
    return out


def _kernel(spec, fused, source, binary, default_scale, scale, tier_reason, tensors, index, cache_dir,
            use_cache) -> Kernel:
    """The Kernel (loads on first call); `fused` is the fused Program, or its text from the cache."""
    from .kernel import Kernel
    scale = default_scale if scale is None else scale
    fused_text = fused if isinstance(fused, str) else None

    def simt_kernel():                  # for inputs the fast tier cannot take (unaligned, strided along D)
        program = fused_text if fused_text is not None else fused
        return compile(spec.head_dim, dtype=spec.dtype, arch=spec.arch, tier="simt", ir=program, scale=scale,
                       cache_dir=cache_dir, use_cache=use_cache)
    return Kernel(spec, fused, source, binary, default_scale=float(scale), smem_bytes=plan.smem_bytes(spec),
                  tier_reason=tier_reason, fallback=simt_kernel if spec.tier != "simt" else None,
                  tensors=tuple(tensors), tensor_index=index)


__all__ = ["compile", "lower", "load_program", "detect_arch", "proofs", "Step", "SpecError"]
