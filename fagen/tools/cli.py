"""The command line: `fagen compile`, `fagen ir`, `fagen check`.

Errors are one line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..version import __version__


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dim", type=int, required=True, help="head dimension (multiple of 8, 32..256)")
    p.add_argument(
        "--causal",
        nargs="?",
        const="top_left",
        default=False,
        choices=["top_left", "bottom_right"],
        help="causal mask; top_left (default, PyTorch SDPA's is_causal) or bottom_right (FlashAttention's)",
    )
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
    p.add_argument("--ir", type=Path, help="compile this .ir program instead of a shipped one")
    p.add_argument("--dtype", default=None, help="bf16 (default, or what an --ir program declares), f16 or f32")


def _tensor_dtype_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tensor-dtype",
        action="append",
        default=[],
        metavar="NAME=DTYPE",
        help="a call-time tensor's dtype (f32 default, f16, bf16, i32, i64, bool); repeat for several",
    )


def _tensor_dtypes(args) -> dict | None:
    out = {}
    for item in getattr(args, "tensor_dtype", []):
        name, sep, dtype = item.partition("=")
        if not sep or not name or not dtype:
            raise ValueError(f"--tensor-dtype: expected NAME=DTYPE, got {item!r}")
        out[name.strip()] = dtype.strip()
    return out or None


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="fagen", description="Compile attention programs to FlashAttention CUDA kernels.")
    ap.add_argument("--version", action="version", version=f"fagen {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)

    c = sub.add_parser("compile", help="write generated/<name>.cu and compile it with NVRTC (no GPU needed)")
    _common(c)
    c.add_argument(
        "--arch", default=None, help="sm_80, sm_86, sm_89, sm_90 or sm_90a (default: this machine's GPU, else sm_90a)"
    )
    c.add_argument("--tier", default=None, help="kernel tier (default: chosen by rules; see the output)")
    c.add_argument("-o", "--out-dir", type=Path, default=Path("generated"), help="output folder (default: generated)")
    c.add_argument("--emit", default="cu", help="comma-separated: cu, ptx, cubin (default: cu)")
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
    _tensor_dtype_arg(c)

    i = sub.add_parser("ir", help="show the program before and after each pass, and the proven identities")
    _common(i)
    i.add_argument(
        "--backward",
        action="store_true",
        help="also derive the backward program, with its proofs and the device functions its kernels print",
    )

    k = sub.add_parser("check", help="on a GPU: run the kernel on random inputs against a float64 reference")
    _common(k)
    k.add_argument("--arch", default=None)
    k.add_argument("--tier", default=None)
    k.add_argument("--shape", default="2,4,1000,1000", help="B,H,M,N (default 2,4,1000,1000)")

    b = sub.add_parser("bench", help="on a GPU: fagen vs PyTorch SDPA (FA2, cuDNN) and FlexAttention")
    b.add_argument("--dims", default="64,128,256", help="head dims (default 64,128,256)")
    b.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    b.add_argument("--causal", default="both", choices=["both", "yes", "no"])
    b.add_argument("--dtypes", default="bf16", help="bf16 and/or f16 (default bf16)")
    b.add_argument("--backends", default="fagen,flash,cudnn,flex", help="some of fagen, flash, cudnn, flex")
    b.add_argument("--tier", default=None)
    b.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="forward tables: passes over each case's backends, each figure their median, pass r starting at backend r "
        "(default 1: single cells moved by several percent between passes on an H100)",
    )
    b.add_argument(
        "--variant",
        default="none",
        help="some of none, softcap, alibi, window, prefix (vs FlexAttention); or document alone: document masks, "
        "the block-sparse forward and block-mask construction vs FlexAttention's",
    )
    b.add_argument("--no-memory", dest="memory", action="store_false", help="skip the peak-memory comparison")
    b.add_argument(
        "--backward",
        action="store_true",
        help="time forward + backward (FLOPs: the backward counted 2.5x the forward, as FlashAttention's benchmark)",
    )
    b.add_argument("-o", "--out", default="bench/results", help="folder for bench.csv, bench.md, bench.png")
    b.add_argument("--decode", action="store_true", help="split-KV decode (contiguous and paged) vs SDPA and copy")
    b.add_argument(
        "--model",
        action="store_true",
        help="a Llama-style model's forward (transformers, random weights) with sdpa, fagen and flex_attention; "
        "--seqlens N: its tokens (default 4096); --backends: some of sdpa, fagen, flex_attention",
    )
    b.add_argument("--layers", type=int, default=2, help="with --model: decoder layers (default 2)")

    t = sub.add_parser("tune", help="on a GPU: time tile configurations of a tier, record the fastest")
    t.add_argument("--dims", default="64,96,128,256")
    t.add_argument("--tier", default=None, help="the tier to tune (default: the arch's default tier)")
    t.add_argument(
        "--seqlen",
        default="4096",
        help="sequence length timed (16k tokens in all), or several (2048,4096,8192,16384): ranked by the geometric "
        "mean of each time over that length's best",
    )
    t.add_argument(
        "--rounds", type=int, default=3, help="passes over all candidates, each time the median of them (default 3)"
    )
    t.add_argument("--causal", default="both", choices=["both", "yes", "no"])
    t.add_argument("--dtypes", default="bf16")
    t.add_argument("--arch", default=None)
    t.add_argument(
        "--compile-only", action="store_true", help="only compile every candidate into the cache (no GPU needed)"
    )
    t.add_argument(
        "--out",
        type=Path,
        default=None,
        help="write the run's table here instead of merging it into the shipped tuned.json",
    )
    return ap


def write_if_different(path: Path, data: bytes) -> bool:
    """Write only when the content changes, so the file a user inspects is the one that was compiled."""
    if path.exists() and path.read_bytes() == data:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return True


def _causal(args):
    return False if args.causal is False else args.causal


def _variant(args) -> dict:
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
        causal=_causal(args), window=window, alibi=args.alibi, softcap=args.softcap, prefix=args.prefix, ir=args.ir
    )


def cmd_compile(args) -> int:
    from .. import pipeline
    from ..backend.build import compile_ptx

    emit = [e.strip() for e in args.emit.split(",") if e.strip()]
    bad = [e for e in emit if e not in ("cu", "ptx", "cubin")]
    if bad or not emit:
        raise ValueError(f"--emit: expected a comma-separated list of cu, ptx, cubin, got {args.emit!r}")
    variant = _variant(args)
    if args.decode and variant["causal"] == "top_left":  # --causal: decode's mask is aligned bottom-right
        variant["causal"] = True
    kernel = pipeline.compile(
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
    out = args.out_dir
    written = []
    launches = list(kernel.plan.launches)
    if args.backward:
        bp = kernel.backward_plan
        launches += [bp.preprocess, bp.main, *filter(None, [bp.main_grads]), bp.convert, bp.dq]
    for launch in launches:  # one kernel (a forward, a decode's split); the backward's four (five: _grads)
        for kind in emit:
            path = out / f"{launch.spec.name}.{kind}"
            data = {
                "cu": lambda: launch.source.encode(),
                "cubin": lambda: launch.binary.cubin,
                "ptx": lambda: compile_ptx(launch.source, launch.spec).encode(),
            }[kind]()
            write_if_different(path, data)
            written.append(path)
    r = kernel.resources
    for path in written:
        print(path)
    print(f"  kernel     {kernel.name}")
    print(f"  tier       {kernel.spec.tier}: {kernel.tier_reason}")
    print(
        f"  tiles      block_m={kernel.spec.block_m} block_n={kernel.spec.block_n} "
        f"warps={kernel.spec.num_warps} stages={kernel.spec.stages}"
    )
    spills = (
        "n/a (NVRTC's cache skipped ptxas)"
        if r.spill_stores is None
        else f"{r.spill_stores} B stores, {r.spill_loads} B loads"
    )
    print(f"  registers  {r.registers} per thread; spills {spills}; stack frame {r.stack_frame} B")
    print(f"  shared mem {kernel.smem_bytes} B dynamic + {r.static_smem} B static per block")
    how = "cache hit" if kernel.binary.cached else "NVRTC"
    print(
        f"  compile    {kernel.compile_seconds:.3f} s ({how}; NVRTC {kernel.binary.nvrtc_version}, {kernel.spec.arch})"
    )
    return 0


def cmd_ir(args) -> int:
    from .. import pipeline
    from ..backend import codegen, tiers
    from ..backend.spec import normalize_dtype
    from ..ir import exprs
    from ..passes import fuse

    program = pipeline.load_program(**_variant(args))
    declared = pipeline.declared_dtype(program)
    dtype = normalize_dtype(args.dtype) if args.dtype else declared or "bf16"
    if declared and dtype != declared:
        raise ValueError(f"--dtype: the program {program.name!r} declares {declared} inputs; drop --dtype {args.dtype}")
    from ..math import online_softmax

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
    print("== the proven rule, as the kernels print it (SymPy C printer; simt tier's spelling):")
    rule = fuse.rule_of(node)
    for f in codegen.rule_functions(rule, tiers.get("simt"), fuse.tensors_of(fused)):
        print(f"  {f.returns} {f.name}({', '.join(f.params)})")
        print(f"      = {f.body}")
    if args.backward:
        print("== the proven backward rule, as the backward kernels print it:")
        for f in codegen.backward_rule_functions(steps[-1].facts["rule"], tiers.get("simt"), fuse.tensors_of(fused)):
            if f.name in ("score", "keep"):
                continue  # the forward's, printed above
            print(f"  {f.returns} {f.name}({', '.join(f.params)})")
            print(f"      = {f.body}")
    print(f"(dim {args.dim}: default scale = {node.attr('scale').xreplace({exprs.DIMS['D']: args.dim})})")
    return 0


def _print_key_range(keep, rng) -> None:
    import sympy as sp

    from ..ir import exprs

    if keep == sp.true:
        print("  no mask: every key tile, no mask evaluated")
        return
    print(f"  mask: {exprs.to_text(keep)}")
    for n, term in enumerate(rng.terms, 1):

        def span(begins, ends):
            b = ", ".join(exprs.to_text(x) for x in begins)
            e = ", ".join(exprs.to_text(x) for x in ends)
            return f"[max(0{', ' + b if b else ''}), min(N{', ' + e if e else ''}))"

        text = exprs.to_text(sp.And(*term.conjuncts)) if term.conjuncts else "-"
        print(f"  term {n}: {text}")
        print(f"    keys any query sees:   {span(term.begins, term.ends)}")
        if term.exact:
            print(f"    keys every query sees: {span(term.full_begins, term.full_ends)} (no mask evaluated there)")
        else:
            print("    not affine: the mask is evaluated on every key tile of this term")


def cmd_check(args) -> int:
    from .. import pipeline
    from . import testing

    try:
        B, H, M, N = (int(x) for x in args.shape.split(","))
    except ValueError:
        raise ValueError(f"--shape: expected B,H,M,N (four integers), got {args.shape!r}") from None
    if pipeline.detect_arch() is None:
        raise RuntimeError("no CUDA GPU found: fagen check runs the kernel (fagen compile works without a GPU)")
    kernel = pipeline.compile(args.dim, dtype=args.dtype, arch=args.arch, tier=args.tier, **_variant(args))
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

    if args.rounds < 1:
        raise ValueError(f"--rounds: expected a positive number of passes, got {args.rounds}")
    return bench.main(args)


def cmd_tune(args) -> int:
    import json

    from .. import pipeline
    from . import tune

    dims = tuple(int(x) for x in args.dims.split(","))
    causal = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    dtypes = tuple(args.dtypes.split(","))
    try:
        seqlens = tuple(int(x) for x in args.seqlen.split(","))
    except ValueError:
        raise ValueError(f"--seqlen: expected a length or lengths separated by commas, got {args.seqlen!r}") from None
    if not seqlens or min(seqlens) < 1:
        raise ValueError(f"--seqlen: expected positive lengths, got {args.seqlen!r}")
    seqlen = seqlens if len(seqlens) > 1 else seqlens[0]
    if args.rounds < 1:
        raise ValueError(f"--rounds: expected a positive number of rounds, got {args.rounds}")
    if args.compile_only:
        from ..backend.spec import normalize_arch

        arch = normalize_arch(args.arch or "sm_90a")
        tier = args.tier or tune.default_tier(arch)
        for dt in dtypes:
            for d in dims:
                for c in causal:
                    n = len(tune.compiled_candidates(d, dt, arch, c, tier=tier))
                    print(f"{tier}/{arch}/{dt}/d{d}/{'causal' if c else 'full'}: {n} candidates compiled")
        return 0
    if pipeline.detect_arch() is None:
        raise RuntimeError("no CUDA GPU found: fagen tune times kernels on a GPU (--compile-only does not)")
    table = tune.tune(dims, causal, dtypes, args.arch, tier=args.tier, seqlen=seqlen, rounds=args.rounds)
    if args.out:
        args.out.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    else:
        tune.merge(table)
    for key, cfg in table["configs"].items():
        best = table["measured"][key][0]
        if "score" in best:
            times = ", ".join(f"{n}: {t:.3f} ms" for n, t in best["ms_by_seqlen"].items())
            print(f"{key}: {cfg} {times} (score {best['score']:.3f})")
        else:
            print(f"{key}: {cfg} {best['ms']:.3f} ms")
    return 0


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        return {"compile": cmd_compile, "ir": cmd_ir, "check": cmd_check, "bench": cmd_bench, "tune": cmd_tune}[
            args.command
        ](args)
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
