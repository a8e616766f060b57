"""The pipeline, top to bottom: parse → verify → bind dtype → fuse (proven) → verify → plan → render →
compile → load. The CLI and the Python API both call `compile` (or `lower` alone for `fagen ir`).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from . import build, codegen, fusion, plan, variants
from .exprs import DIMS
from .ir import Program, bind_dtype, parse_program, verify
from .kernel import Kernel
from .resources import shipped_programs
from .spec import SpecError, normalize_arch, normalize_dtype

CAUSAL_PROGRAMS = {False: "full", None: "full", True: "causal", "top_left": "causal", "bottom_right": "causal_br"}


@dataclass(frozen=True)
class Step:
    name: str
    program: Program


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
    if not variant:     # the shipped programs: package data (ir/ in a checkout), read via importlib.resources
        shipped = shipped_programs()[CAUSAL_PROGRAMS[causal]]
        return parse_program(shipped.read_text(encoding="utf-8"), source=shipped.name)
    return variants.build(causal=causal, **variant)


def lower(program: Program, dtype: str) -> list[Step]:
    """The IR passes, each a pure function IR → IR, with the verifier between them."""
    steps = [Step("parsed", verify(program))]
    steps.append(Step(f"bind_dtype(T = {dtype})", verify(bind_dtype(steps[-1].program, dtype))))
    steps.append(Step("fuse: softmax + matmul -> online softmax (proven)", verify(fusion.fuse(steps[-1].program))))
    return steps


def detect_arch() -> str | None:
    """The arch of the current CUDA device, or None where there is no GPU."""
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
        cc = cupy.cuda.Device().compute_capability
    except Exception:
        return None
    arch = f"sm_{cc}{'a' if cc == '90' else ''}"
    return arch


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
    1/sqrt(dim)).
    """
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim: expected an int head dimension, got {dim!r}")
    if not (32 <= dim <= 256 and dim % 8 == 0):
        raise ValueError(f"dim: expected a multiple of 8 between 32 and 256, got {dim}")
    dtype = normalize_dtype(dtype)
    arch = normalize_arch(arch) if arch is not None else (detect_arch() or "sm_90a")
    program = load_program(causal=causal, ir=ir, window=window, alibi=alibi, softcap=softcap,  # parse
                           prefix=prefix, mask=mask, score_mod=score_mod)
    fused = lower(program, dtype)[-1].program                             # verify, bind, fuse (proven)
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
    if scale is None:
        scale = float(node.attr("scale").xreplace({DIMS["D"]: dim}))
    def simt_kernel():                  # for inputs the fast tier cannot take (unaligned, strided along D)
        return compile(dim, dtype=dtype, arch=arch, tier="simt", ir=fused, scale=scale,
                       cache_dir=cache_dir, use_cache=use_cache)
    return Kernel(choice.spec, fused, source, binary, default_scale=float(scale),
                  smem_bytes=plan.smem_bytes(choice.spec), tier_reason=choice.reason,
                  fallback=simt_kernel if choice.spec.tier != "simt" else None,
                  tensors=codegen.tensors_of(fused))                      # loads on first call


__all__ = ["compile", "lower", "load_program", "detect_arch", "Step", "SpecError"]
