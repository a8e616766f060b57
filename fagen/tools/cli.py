"""The command line: `fagen compile`, `fagen ir`, `fagen check`, `fagen bench`, `fagen tune`.

The options two subcommands share are defined once (fagen.tools.options) and mean the same in each. Errors
are one line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..version import __version__
from . import options


def _program(p: argparse.ArgumentParser) -> None:
    """The options that choose the attention program of one kernel: compile, ir and check."""
    options.add_dim(p)
    options.add_causal(p)
    p.add_argument(
        "--window",
        default=None,
        metavar="LEFT[,RIGHT]",
        help="sliding window: query q sees keys q-LEFT..q+RIGHT (RIGHT: 0 with --causal, else LEFT)",
    )
    p.add_argument("--alibi", action="store_true", help="ALiBi: add slopes[h] * (k - q); slopes= at call time")
    p.add_argument("--softcap", type=float, default=None, metavar="C", help="logit softcapping: C * tanh(s / C)")
    p.add_argument(
        "--prefix",
        type=int,
        default=None,
        metavar="L",
        help="prefix-LM: the first L keys are seen by every query, causal after them",
    )
    p.add_argument("--ir", type=Path, metavar="FILE", help="compile this .ir program instead of a shipped one")
    options.add_dtype(p)


def _compile_parser(sub) -> None:
    c = sub.add_parser(
        "compile", help="write each kernel's source (and PTX, cubin) into --out, compiled with NVRTC (no GPU needed)"
    )
    _program(c)
    options.add_arch(c)
    options.add_tier(c)
    options.add_out(c, Path("generated"), "output folder (default generated)")
    options.deprecated(c, "--out-dir", "--out", type=Path)
    c.add_argument(
        "--emit", default="cu", metavar="KINDS", help="what to write, comma-separated: cu, ptx, cubin (default cu)"
    )
    c.add_argument("--no-cache", action="store_true", help="compile even if the cache has the kernel")
    c.add_argument(
        "--decode",
        action="store_true",
        help="split-KV decode: write the split kernel, which merges its splits (--causal aligns bottom-right)",
    )
    c.add_argument(
        "--backward",
        action="store_true",
        help="also write the backward's kernels (preprocess, main, dQ convert, deterministic dQ)",
    )
    c.add_argument(
        "--tensor-dtype",
        action="append",
        default=[],
        metavar="NAME=DTYPE",
        help="a call-time tensor's dtype: f32 (default), f16, bf16, i32, i64 or bool; repeat for several",
    )


def _ir_parser(sub) -> None:
    i = sub.add_parser("ir", help="show the program before and after each pass, and the proven identities")
    _program(i)
    i.add_argument(
        "--backward",
        action="store_true",
        help="also derive the backward program, with its proofs and the device functions its kernels print",
    )


def _check_parser(sub) -> None:
    k = sub.add_parser("check", help="on a GPU: run the kernel on random inputs against a float64 reference")
    _program(k)
    options.add_arch(k)
    options.add_tier(k)
    k.add_argument(
        "--shape", default="2,4,1000,1000", metavar="B,H,M,N", help="the inputs' shape (default 2,4,1000,1000)"
    )


def _context_parallel_flags(b) -> None:
    """`fagen bench --context-parallel` and its flags."""
    b.add_argument(
        "--context-parallel",
        action="store_true",
        help="fagen's ring (fagen.ring_attention) on several GPUs against one GPU and torch's context_parallel "
        "(cuDNN), forward + backward; --seqlen: tokens a GPU (default 65536)",
    )
    b.add_argument(
        "--gpus",
        type=options.int_list,
        default=None,
        metavar="W[,W..]",
        help="with --context-parallel: the GPU counts to run (default 2,4, those this machine has)",
    )
    b.add_argument(
        "--window",
        type=int,
        default=4096,
        metavar="L",
        help="with --context-parallel: also the pruned ring, causal with this left window over 2x the tokens a GPU "
        "(default 4096; 0: skip)",
    )


def _bench_parser(sub) -> None:
    from .bench import cases

    b = sub.add_parser("bench", help="on a GPU: fagen against FlashAttention-4, SDPA (FA2, cuDNN) and FlexAttention")
    options.add_dim(b, sweep=cases.DEFAULT_DIMS)
    options.add_seqlen(
        b,
        f"sequence lengths (default {','.join(map(str, cases.DEFAULT_SEQLENS))}; with --decode the KV lengths, default "
        f"{','.join(map(str, cases.DECODE_SEQLENS))}; with --model one, its tokens, default {cases.MODEL_TOKENS} for "
        f"the forward and {cases.MODEL_TRAIN_TOKENS} for the training step); "
        "the packed and gqa cases keep their own shapes",
    )
    options.add_causal(b, sweep=True)
    options.add_dtype(b, sweep=("bf16",))
    b.add_argument(
        "--backends",
        type=options.name_list(cases.BACKENDS + cases.MODEL_BACKENDS),
        default=None,
        metavar="NAME[,NAME..]",
        help=f"what to time: some of {', '.join(cases.BACKENDS)} (default all; fa4 where flash_attn.cute imports); "
        f"with --model some of {', '.join(cases.MODEL_BACKENDS)} (default all)",
    )
    options.add_tier(b, "fagen's kernel tier")
    options.add_rounds(b, 1, "passes over each case's backends, each figure their median, pass r starting at backend r")
    b.add_argument(
        "--variant",
        type=options.name_list((*cases.VARIANT_NAMES, *cases.DOCUMENT_VARIANTS)),
        default=cases.DEFAULT_VARIANTS,
        metavar="NAME[,NAME..]",
        help=f"cases: some of {', '.join(cases.VARIANT_NAMES)} (default {','.join(cases.DEFAULT_VARIANTS)}); none: "
        f"plain attention; packed: {cases.WORKLOAD_HELP['packed']}; gqa: {cases.WORKLOAD_HELP['gqa']}; or document "
        "and/or document_offsets alone: document masks (q // size == k // size, or from offsets: "
        "offsets[doc[q]] <= k), the block-sparse forward and block-mask construction against FlexAttention's",
    )
    b.add_argument("--no-memory", dest="memory", action="store_false", help="skip the peak-memory comparison")
    b.add_argument(
        "--backward",
        action="store_true",
        help="time forward + backward (FLOPs: the backward counted 2.5x the forward, as FlashAttention's benchmark); "
        "with --model the training step alone",
    )
    b.add_argument(
        "--deterministic",
        action="store_true",
        help="with --backward: also time fagen's backward with deterministic=True (a column, fagen_det; "
        "÷fagen_det is its time over the default mode's)",
    )
    options.add_out(b, Path("bench/results"), "folder for the run's tables and plot (default bench/results)")
    b.add_argument(
        "--results",
        type=options.file_to_write,
        default=None,
        metavar="PATH",
        help="also write the results table (fagen ÷ each peer per case, GPU, date, versions, command) as markdown "
        "here, e.g. RESULTS.md",
    )
    b.add_argument(
        "--decode", action="store_true", help="split-KV decode (contiguous and paged) against SDPA and a copy"
    )
    b.add_argument(
        "--model",
        action="store_true",
        help="a Llama-style model's forward, and its training step (forward, backward, AdamW), with each attention "
        "implementation (transformers, random weights)",
    )
    b.add_argument(
        "--layers", type=options.positive_int, default=2, metavar="L", help="with --model: decoder layers (default 2)"
    )
    _context_parallel_flags(b)


def _tune_parser(sub) -> None:
    t = sub.add_parser("tune", help="on a GPU: time tile configurations of a tier, record the fastest")
    options.add_dim(t, sweep=(64, 96, 128, 256))
    options.add_seqlen(
        t,
        "sequence lengths timed (16k tokens in all; default 4096); several are ranked by the geometric mean of each "
        "time over that length's best",
    )
    options.add_causal(t, sweep=True)
    options.add_dtype(t, sweep=("bf16",))
    options.add_arch(t)
    options.add_tier(t, "the tier to tune", "the arch's default tier")
    options.add_rounds(t, 3, "passes over all candidates, each time the median of them")
    t.add_argument(
        "--compile-only", action="store_true", help="only compile every candidate into the cache (no GPU needed)"
    )
    options.add_out(t, None, "write the run's table to this file instead of merging it into the shipped tuned.json")


def parser() -> argparse.ArgumentParser:
    """The `fagen` command line: one subparser a subcommand, over the shared vocabulary of fagen.tools.options."""
    ap = argparse.ArgumentParser(prog="fagen", description="Compile attention programs to FlashAttention CUDA kernels.")
    ap.add_argument("--version", action="version", version=f"fagen {__version__}")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for build in (_compile_parser, _ir_parser, _check_parser, _bench_parser, _tune_parser):
        build(sub)
    return ap


def write_if_different(path: Path, data: bytes) -> bool:
    """Write only when the content changes, so the file a user inspects is the one that was compiled."""
    if path.exists() and path.read_bytes() == data:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return True


def _tensor_dtypes(args) -> dict | None:
    out = {}
    for item in getattr(args, "tensor_dtype", []):
        name, sep, dtype = item.partition("=")
        if not sep or not name or not dtype:
            raise ValueError(f"--tensor-dtype: expected NAME=DTYPE, got {item!r}")
        out[name.strip()] = dtype.strip()
    return out or None


def _variant(args) -> dict:
    """fagen.compile's program options from compile's, ir's and check's flags."""
    window = None
    if args.window is not None:
        try:
            parts = [int(x) for x in args.window.split(",")]
        except ValueError:
            raise ValueError(f"--window: expected LEFT or LEFT,RIGHT (integers), got {args.window!r}") from None
        if not 1 <= len(parts) <= 2:
            raise ValueError(f"--window: expected LEFT or LEFT,RIGHT, got {args.window!r}")
        window = tuple(parts)
    return dict(
        causal=options.causal_option(args.causal),
        window=window,
        alibi=args.alibi,
        softcap=args.softcap,
        prefix=args.prefix,
        ir=args.ir,
    )


def _emit_kinds(text: str) -> list[str]:
    emit = [e.strip() for e in text.split(",") if e.strip()]
    bad = [e for e in emit if e not in ("cu", "ptx", "cubin")]
    if bad or not emit:
        raise ValueError(f"--emit: expected a comma-separated list of cu, ptx, cubin, got {text!r}")
    return emit


def _write_kernels(kernel, out: Path, emit: list[str], backward: bool) -> list[Path]:
    """Write each launch's source, PTX or cubin into `out` (only what changed); the paths, in order."""
    from ..backend.build import compile_ptx

    launches = list(kernel.plan.launches)
    if backward:
        bp = kernel.backward_plan
        launches += [bp.preprocess, bp.main, *filter(None, [bp.main_grads, bp.main_sparse]), bp.convert, bp.dq]
    written = []
    for launch in launches:  # one kernel (a forward, a decode's split); the backward's four (more: _grads, sparse)
        for kind in emit:
            path = out / f"{launch.spec.name}.{kind}"
            if kind == "cu":
                data = launch.source.encode()
            elif kind == "cubin":
                data = launch.binary.cubin
            else:
                data = compile_ptx(launch.source, launch.spec).encode()
            write_if_different(path, data)
            written.append(path)
    return written


def _print_kernel(kernel) -> None:
    """The compiled kernel's name, tier and why, tiles, registers, spills, shared memory and compile time."""
    r = kernel.resources
    spec = kernel.spec
    print(f"  kernel     {kernel.name}")
    print(f"  tier       {spec.tier}: {kernel.tier_reason}")
    print(f"  tiles      block_m={spec.block_m} block_n={spec.block_n} warps={spec.num_warps} stages={spec.stages}")
    spills = (
        "n/a (NVRTC's cache skipped ptxas)"
        if r.spill_stores is None
        else f"{r.spill_stores} B stores, {r.spill_loads} B loads"
    )
    print(f"  registers  {r.registers} per thread; spills {spills}; stack frame {r.stack_frame} B")
    print(f"  shared mem {kernel.smem_bytes} B dynamic + {r.static_smem} B static per block")
    how = "cache hit" if kernel.binary.cached else "NVRTC"
    print(f"  compile    {kernel.compile_seconds:.3f} s ({how}; NVRTC {kernel.binary.nvrtc_version}, {spec.arch})")


def cmd_compile(args) -> int:
    import fagen

    emit = _emit_kinds(args.emit)
    variant = _variant(args)
    if args.decode and variant["causal"] == "top_left":  # --causal: decode's mask is aligned bottom-right
        variant["causal"] = True
    kernel = fagen.compile(
        args.dim,
        dtype=args.dtype,
        arch=args.arch,
        tier=args.tier,
        use_cache=not args.no_cache,
        decode=args.decode,
        tensor_dtypes=_tensor_dtypes(args),
        **variant,
    )
    if args.backward and args.decode:
        raise ValueError("--backward: a decode kernel has no backward; drop --decode")
    for path in _write_kernels(kernel, args.out, emit, args.backward):
        print(path)
    _print_kernel(kernel)
    return 0


def _print_rule(functions, skip=()) -> None:
    for f in functions:
        if f.name not in skip:
            print(f"  {f.returns} {f.name}({', '.join(f.params)})")
            print(f"      = {f.body}")


def cmd_ir(args) -> int:
    from .. import pipeline, request
    from ..backend import codegen, tiers
    from ..backend.spec import normalize_dtype
    from ..ir import exprs
    from ..math import online_softmax
    from ..passes import fuse

    program = pipeline.load_program(**_variant(args))
    declared = request.declared_dtype(program)
    dtype = normalize_dtype(args.dtype) if args.dtype else declared or "bf16"
    if declared and dtype != declared:
        raise ValueError(f"--dtype: the program {program.name!r} declares {declared} inputs; drop --dtype {args.dtype}")
    with online_softmax.fresh_proofs():  # what `fagen ir` shows is proven now, not read from the proof memo
        steps = pipeline.lower(program, dtype, backward=args.backward)
    shown = None
    for n, step in enumerate(steps, 1):
        print(f"== {n}. {step.name}")
        if step.program is not shown:
            print(step.program)
            shown = step.program
        for statement in step.proofs:
            print(f"  [proved] {statement}")
        rng = step.facts.get("key_range")
        if rng is not None:
            _print_key_range(fuse.fused_node(step.program).attr("keep"), rng)
    fused = steps[-1].facts["forward"] if args.backward else steps[-1].program
    node = fuse.fused_node(fused)
    simt = tiers.get("simt")
    print("== the proven rule, as the kernels print it (SymPy C printer; simt tier's spelling):")
    _print_rule(codegen.rule_functions(fuse.rule_of(node), simt, fuse.tensors_of(fused)))
    if args.backward:
        print("== the proven backward rule, as the backward kernels print it:")
        rule = steps[-1].facts["rule"]  # score and keep: the forward's, printed above
        _print_rule(codegen.backward_rule_functions(rule, simt, fuse.tensors_of(fused)), skip=("score", "keep"))
    print(f"(dim {args.dim}: default scale = {node.attr('scale').xreplace({exprs.DIMS['D']: args.dim})})")
    return 0


def _print_key_range(keep, rng) -> None:
    import sympy as sp

    from ..ir import exprs

    if keep == sp.true:
        print("  no mask: every key tile, no mask evaluated")
        return
    print(f"  mask: {exprs.to_text(keep)}")

    def span(begins, ends):
        b = ", ".join(exprs.to_text(x) for x in begins)
        e = ", ".join(exprs.to_text(x) for x in ends)
        return f"[max(0{', ' + b if b else ''}), min(N{', ' + e if e else ''}))"

    for n, term in enumerate(rng.terms, 1):
        text = exprs.to_text(sp.And(*term.conjuncts)) if term.conjuncts else "-"
        print(f"  term {n}: {text}")
        print(f"    keys any query sees:   {span(term.begins, term.ends)}")
        if term.exact:
            print(f"    keys every query sees: {span(term.full_begins, term.full_ends)} (no mask evaluated there)")
        else:
            print("    not affine: the mask is evaluated on every key tile of this term")


def cmd_check(args) -> int:
    import fagen

    from .. import request
    from . import testing

    try:
        B, H, M, N = (int(x) for x in args.shape.split(","))
    except ValueError:
        raise ValueError(f"--shape: expected B,H,M,N (four integers), got {args.shape!r}") from None
    if request.detect_arch() is None:
        raise RuntimeError("no CUDA GPU found: fagen check runs the kernel (fagen compile works without a GPU)")
    kernel = fagen.compile(args.dim, dtype=args.dtype, arch=args.arch, tier=args.tier, **_variant(args))
    result = testing.check_kernel(kernel, B=B, H=H, M=M, N=N)
    print(f"{kernel.name}  B={B} H={H} M={M} N={N}")
    print(
        f"  max |O - O_ref|      {result.err:.3e}   (naive {kernel.spec.dtype} attention: {result.err_naive:.3e}; "
        f"bound {result.bound:.3e})"
    )
    print(f"  max |lse - lse_ref|  {result.lse_err:.3e}")
    print("  " + ("PASS" if result.ok else "FAIL"))
    return 0 if result.ok else 1


def cmd_bench(args) -> int:
    from . import bench

    return bench.main(args)


def cmd_tune(args) -> int:
    from . import tune

    return tune.main(args)


COMMANDS = {"compile": cmd_compile, "ir": cmd_ir, "check": cmd_check, "bench": cmd_bench, "tune": cmd_tune}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    args.argv = argv  # the command as given, for the results it writes
    try:
        return COMMANDS[args.command](args)
    except KeyboardInterrupt:
        print("fagen: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # one clear line, not a traceback
        msg = str(e).strip().splitlines()
        first = msg[0] if msg else type(e).__name__
        print(f"fagen: error: {first}", file=sys.stderr)
        for line in msg[1:12]:
            print(f"  {line}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
