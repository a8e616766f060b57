"""The command line, end to end, in a subprocess as a user runs it."""

import os
import subprocess
import sys

import pytest

from fagen import resources


def fagen(*args, cwd=None, env_extra=None):
    env = {**os.environ, "PYTHONPATH": str(resources._SOURCE_TREE), **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-m", "fagen", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=300
    )


def test_compile_writes_the_kernel_and_reports_resources(tmp_path):
    r = fagen(
        "compile",
        "--dim",
        "128",
        "--causal",
        "-o",
        str(tmp_path),
        "--emit",
        "cu,ptx,cubin",
        env_extra={"FAGEN_CACHE_DIR": str(tmp_path / "cache")},
    )
    assert r.returncode == 0, r.stderr
    from fagen.backend import plan

    name = plan.choose("causal", 128, "bf16", "sm_90a", causal=True).spec.name
    assert name.startswith("flash_fwd_causal_d128_bf16_sm90a_wgmma_")
    for ext in ("cu", "ptx", "cubin"):
        assert (tmp_path / f"{name}.{ext}").is_file()
        assert str(tmp_path / f"{name}.{ext}") in r.stdout
    assert "registers" in r.stdout and "spills 0 B stores, 0 B loads" in r.stdout
    assert "shared mem" in r.stdout and "compile" in r.stdout and "NVRTC" in r.stdout
    assert "tier       wgmma: default for f16/bf16 on sm_90a (Hopper: wgmma, TMA, warp specialization)" in r.stdout
    src = (tmp_path / f"{name}.cu").read_text()
    assert "k_idx <= q_idx" in src
    # a second run hits the cache and leaves the file alone
    mtime = (tmp_path / f"{name}.cu").stat().st_mtime_ns
    r2 = fagen(
        "compile",
        "--dim",
        "128",
        "--causal",
        "-o",
        str(tmp_path),
        env_extra={"FAGEN_CACHE_DIR": str(tmp_path / "cache")},
    )
    assert r2.returncode == 0 and "cache hit" in r2.stdout
    assert (tmp_path / f"{name}.cu").stat().st_mtime_ns == mtime


def test_default_output_folder_is_generated(tmp_path):
    r = fagen(
        "compile",
        "--dim",
        "64",
        "--dtype",
        "f16",
        "--arch",
        "sm_80",
        cwd=tmp_path,
        env_extra={"FAGEN_CACHE_DIR": str(tmp_path / "cache")},
    )
    assert r.returncode == 0, r.stderr
    assert len(list((tmp_path / "generated").glob("flash_fwd_full_d64_f16_sm80_mma_*.cu"))) == 1


def test_compile_says_why_it_fell_back_to_simt(tmp_path):
    r = fagen("compile", "--dim", "72", "-o", str(tmp_path), env_extra={"FAGEN_CACHE_DIR": str(tmp_path / "c")})
    assert r.returncode == 0, r.stderr
    assert (
        "tier       simt: the wgmma tier does not apply: head dim 72 is not one of 64, 96, 128, 192, 256; "
        "the mma tier does not apply: head dim 72 is not a multiple of 32" in r.stdout
    )


def test_ir_shows_passes_and_proofs():
    r = fagen("ir", "--dim", "128", "--causal")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "== 1. parsed" in out and "softmax(u, axis=N)" in out
    assert "online_softmax(q, k, v, scale=1/sqrt(D), score=s, keep=k <= q)" in out
    for ident in (
        "(a) row sum",
        "(a) output",
        "(b) commutative",
        "(b) associative",
        "(c) output",
        "(c) log-sum-exp",
        "(c) scores",
        "(d) fully masked row",
    ):
        assert f"[proved] {ident}" in out
    assert "float alpha(float m_i, float m_use)\n      = exp2f(m_i - m_use)" in out
    assert "keys any query sees:   [max(0), min(N, q_hi + 1))" in out
    assert "keys every query sees: [max(0), min(N, q_lo + 1))" in out
    assert "[proved] term 1: k <= q masks every key from q_hi + 1 on and keeps every key before q_lo + 1" in out


def test_ir_of_a_user_file(tmp_path):
    path = tmp_path / "mine.ir"
    path.write_text(resources.shipped_programs()["causal_br"].read_text())
    r = fagen("ir", "--dim", "64", "--ir", str(path))
    assert r.returncode == 0, r.stderr
    assert "keep=k <= -M + N + q" in r.stdout


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["compile", "--dim", "4"], "dim: expected a head dimension between 8 and 256"),
        (["compile", "--dim", "64", "--dtype", "f64"], "dtype: expected one of"),
        (["compile", "--dim", "64", "--arch", "sm_70"], "arch: expected one of"),
        (["compile", "--dim", "64", "--emit", "exe"], "--emit: expected"),
        (["compile", "--dim", "64", "--ir", "nope.ir"], "ir: cannot read 'nope.ir'"),
        (["compile", "--dim", "64", "--tier", "tensorcore"], "tier: 'tensorcore' is not available"),
        (["compile", "--dim", "64", "--tier", "mma", "--dtype", "f32"], "tier: mma cannot compile this kernel"),
    ],
)
def test_errors_are_one_clear_line(args, fragment, tmp_path):
    r = fagen(*args, "-o", str(tmp_path))
    assert r.returncode == 1
    assert r.stderr.startswith("fagen: error: ") and fragment in r.stderr
    assert "Traceback" not in r.stderr


def test_bad_ir_file_error_names_the_line(tmp_path):
    path = tmp_path / "bad.ir"
    path.write_text(resources.shipped_programs()["full"].read_text().replace("softmax(t, axis=N)", "softmax(t, ax=N)"))
    r = fagen("compile", "--dim", "64", "--ir", str(path), "-o", str(tmp_path))
    assert r.returncode == 1 and "bad.ir:8: softmax has no attribute 'ax'" in r.stderr


def test_usage_errors_exit_non_zero():
    r = fagen("compile")
    assert r.returncode == 2 and "--dim" in r.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["check", "--dim", "64"],
        ["bench", "--dim", "64"],
        ["bench", "--dim", "128", "--causal"],
        ["tune", "--dim", "64"],
    ],
)
def test_gpu_commands_without_a_gpu_say_so(args):
    from tests.conftest import gpu_unavailable_reason

    if gpu_unavailable_reason() is None:
        pytest.skip("this machine has a GPU; the GPU tier runs these commands")
    r = fagen(*args)
    assert r.returncode == 1 and "no CUDA GPU found" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("bad", ["", "2k", "4096,-1", "0"])
def test_tune_refuses_a_bad_seqlen_before_it_needs_a_gpu(bad, tmp_path):
    r = fagen("tune", "--compile-only", "--seqlen", bad, env_extra={"FAGEN_CACHE_DIR": str(tmp_path)})
    assert r.returncode != 0 and "--seqlen: expected" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_tune_ranks_several_lengths_by_the_geometric_mean_of_each_time_over_its_best():
    from fagen.tools.tune import rank

    one = [dict(block_n=128, ms=0.52), dict(block_n=160, ms=0.48)]
    assert [r["block_n"] for r in rank(one)] == [160, 128] and "score" not in rank(one)[0]
    several = [  # 160 wins at 4k and 8k, 128 at 2k and 16k by more
        dict(block_n=128, ms_by_seqlen={2048: 0.26, 4096: 0.49, 8192: 0.92, 16384: 1.70}),
        dict(block_n=160, ms_by_seqlen={2048: 0.29, 4096: 0.48, 8192: 0.91, 16384: 1.76}),
        dict(block_n=96, ms_by_seqlen={2048: 0.27, 4096: 0.50, 16384: 1.72}),  # 8k not timed: left out of every score
    ]
    ranked = rank(several)
    assert [r["block_n"] for r in ranked] == [128, 96, 160]
    assert ranked[0]["score"] == round(((0.49 / 0.48) ** 1) ** (1 / 3), 4)  # fastest at 2k and 16k: ratios 1
    assert ranked[2]["score"] == round(((0.29 / 0.26) * (1.76 / 1.70)) ** (1 / 3), 4)
    assert all(r["ms_by_seqlen"] == s["ms_by_seqlen"] for r, s in zip(ranked, [several[0], several[2], several[1]]))


def test_tune_times_in_rotated_rounds_and_takes_each_median():
    from fagen.tools.bench.timing import time_in_rounds

    order = []
    clock = iter([5.0, 1.0, 2.0, 9.0, 3.0, 4.0, 1.5, 2.5, 7.0, 3.5, 0.5, 6.0] * 2)  # one reading per timing, in turn

    def timer(fn):
        fn()
        return next(clock)

    cands = [lambda q, k, v, i=i: order.append((i, q)) for i in range(3)]
    times = time_in_rounds(cands, {2048: (2048, 0, 0), 4096: (4096, 0, 0)}, timer, rounds=2)
    # round 0 runs 0, 1, 2 and round 1 runs 1, 2, 0; each candidate at both lengths in turn
    assert [i for i, _ in order] == [0, 0, 1, 1, 2, 2, 1, 1, 2, 2, 0, 0]
    assert [q for _, q in order] == [2048, 4096] * 6
    # candidate 0 read (5, 1) in round 0 and (0.5, 6) in round 1: the medians of two are their means
    assert times[0] == {2048: 2.75, 4096: 3.5}
    assert times[1] == {2048: 1.75, 4096: 5.75} and times[2] == {2048: 5.0, 4096: 3.75}


@pytest.mark.parametrize("bad", ["0", "-2"])
def test_tune_refuses_a_bad_rounds_before_it_needs_a_gpu(bad, tmp_path):
    r = fagen("tune", "--compile-only", "--rounds", bad, env_extra={"FAGEN_CACHE_DIR": str(tmp_path)})
    assert r.returncode != 0 and "--rounds: expected" in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("bad", ["0", "-1"])
def test_bench_refuses_a_bad_rounds_before_it_needs_a_gpu(bad):
    r = fagen("bench", "--rounds", bad)
    assert r.returncode != 0 and "--rounds: expected" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_tune_compile_only_needs_no_gpu(tmp_path):
    r = fagen("tune", "--compile-only", "--dim", "64", "--no-causal", env_extra={"FAGEN_CACHE_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert "sm_90a/bf16/d64/full:" in r.stdout and "candidates compiled" in r.stdout


# --- one vocabulary: the options each subcommand takes, parsed without running anything --------------------------
def _subparsers():
    import argparse

    from fagen.tools.cli import parser

    (group,) = [a for a in parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return group.choices


def _options(sub):
    """{option string: action} of a subparser's listed options (hidden deprecated aliases left out)."""
    import argparse

    return {s: a for a in sub._actions if a.help != argparse.SUPPRESS for s in a.option_strings}


def test_every_subcommand_is_there():
    assert set(_subparsers()) == {"compile", "ir", "check", "bench", "tune"}


@pytest.mark.parametrize("command", ["compile", "ir", "check", "bench", "tune"])
def test_every_option_has_help_its_choices_and_its_default(command):
    """Each listed option says what it does; one with choices shows them; one with a value by default says so."""
    import argparse

    sub = _subparsers()[command]
    text = sub.format_help()
    for action in sub._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        name = action.option_strings[-1]
        assert action.help and len(action.help) > 10, f"fagen {command} {name}: no help text"
        for choice in action.choices or ():
            assert choice in text, f"fagen {command} {name}: choice {choice!r} not listed"
        takes_value = action.nargs != 0
        if takes_value and action.default not in (None, False, [], argparse.SUPPRESS) and not action.required:
            assert "default" in action.help, f"fagen {command} {name}: its default {action.default!r} is not said"


def test_option_values_from_a_set_list_it():
    from fagen.backend import tiers
    from fagen.backend.spec import ARCHS, DTYPES

    subs = _subparsers()
    for command, sub in subs.items():
        opts = _options(sub)
        if "--tier" in opts:
            assert all(t in opts["--tier"].help for t in tiers.names()), command
        if "--arch" in opts:
            assert all(a in opts["--arch"].help for a in ARCHS), command
        dtypes = DTYPES if command in ("compile", "ir", "check") else ("bf16", "f16")
        assert all(d in opts["--dtype"].help for d in dtypes), command
    bench = _options(subs["bench"])
    for name in ("fagen", "fa4", "flash", "cudnn", "flex", "sdpa", "flex_attention"):
        assert name in bench["--backends"].help
    for name in ("none", "softcap", "alibi", "window", "prefix", "relative", "packed", "gqa", "document"):
        assert name in bench["--variant"].help


SHARED = ("--dim", "--dtype", "--causal", "--no-causal", "--arch", "--tier", "--seqlen", "--rounds", "--out", "-o")


def test_shared_options_have_the_same_names_and_choices_everywhere():
    """An option two subcommands take is one option: same spellings, choices, constant and destination; one value
    where the command makes one kernel, a comma-separated list (the same metavar) where it sweeps."""
    subs = _subparsers()
    seen = {}
    for command, sub in subs.items():
        opts = _options(sub)
        for name in SHARED:
            if name not in opts:
                continue
            a = opts[name]
            shape = (tuple(a.option_strings), a.dest, tuple(a.choices or ()), a.const)
            seen.setdefault(name, {}).setdefault(shape, []).append(command)
        old = [s for s in opts if s in ("--dims", "--seqlens", "--dtypes", "--out-dir")]
        assert not old, f"fagen {command} lists old spellings {old}"
    for name, shapes in seen.items():
        assert len(shapes) == 1, f"{name} differs between subcommands: {shapes}"
    everywhere = {name: sorted(c for cs in shapes.values() for c in cs) for name, shapes in seen.items()}
    assert everywhere["--dim"] == everywhere["--dtype"] == everywhere["--causal"] == everywhere["--no-causal"]
    assert everywhere["--dim"] == sorted(subs)
    assert everywhere["--out"] == ["bench", "compile", "tune"], "every command that writes files: -o/--out"
    for command in ("compile", "ir", "check"):
        assert _options(subs[command])["--dim"].metavar == "D" and _options(subs[command])["--dtype"].metavar == "T"
    for command in ("bench", "tune"):
        opts = _options(subs[command])
        assert (opts["--dim"].metavar, opts["--dtype"].metavar, opts["--seqlen"].metavar) == (
            "D[,D..]",
            "T[,T..]",
            "N[,N..]",
        )


@pytest.mark.parametrize(
    "argv, causal",
    [
        ([], None),
        (["--causal"], "top_left"),
        (["--causal", "bottom_right"], "bottom_right"),
        (["--no-causal"], False),
    ],
)
def test_causal_reads_the_same_in_every_subcommand(argv, causal):
    from fagen.tools import options
    from fagen.tools.cli import parser

    for command in ("compile", "ir", "check"):
        args = parser().parse_args([command, "--dim", "64", *argv])
        assert args.causal == causal
        assert options.causal_option(args.causal) == (causal or False)
    for command in ("bench", "tune"):
        args = parser().parse_args([command, *argv])
        assert args.causal == causal
    assert (
        options.causal_cases(causal)
        == {
            None: (False, "top_left"),
            "top_left": ("top_left",),
            "bottom_right": ("bottom_right",),
            False: (False,),
        }[causal]
    )


def test_causal_and_no_causal_exclude_each_other():
    r = fagen("bench", "--causal", "--no-causal")
    assert r.returncode == 2 and "not allowed with argument" in r.stderr


def test_lists_parse_where_the_command_sweeps():
    from fagen.tools.cli import parser

    args = parser().parse_args(["bench", "--dim", "64,128", "--seqlen", "2048,8192", "--dtype", "bf16,f16"])
    assert (args.dim, args.seqlen, args.dtype) == ((64, 128), (2048, 8192), ("bf16", "f16"))
    args = parser().parse_args(["tune"])
    assert (args.dim, args.seqlen, args.dtype, args.rounds, args.out) == ((64, 96, 128, 256), None, ("bf16",), 3, None)
    args = parser().parse_args(["compile", "--dim", "128", "-o", "out"])
    assert args.dim == 128 and str(args.out) == "out"


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["bench", "--dim", "128,x"], "--dim: expected positive integers"),
        (["bench", "--dtype", "f64"], "--dtype: expected some of bf16, f16"),
        (["bench", "--backends", "fagen,fa5"], "--backends: expected some of"),
        (["bench", "--variant", "nope"], "--variant: expected some of"),
        (["bench", "--causal", "yes"], "--causal: invalid choice: 'yes'"),
        (["tune", "--seqlen", "0"], "--seqlen: expected positive integers"),
        (["bench", "--results", "."], "--results: expected a file to write (e.g. RESULTS.md), got the folder '.'"),
    ],
)
def test_bad_values_are_refused_by_the_parser(argv, fragment):
    r = fagen(*argv)
    assert r.returncode == 2 and fragment in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_old_spellings_still_parse_with_a_warning(capsys):
    from fagen.tools.cli import parser

    args = parser().parse_args(["bench", "--dims", "128", "--seqlens", "4096", "--dtypes", "f16"])
    assert (args.dim, args.seqlen, args.dtype) == ((128,), (4096,), ("f16",))
    args = parser().parse_args(["compile", "--dim", "64", "--out-dir", "x"])
    assert str(args.out) == "x"
    err = capsys.readouterr().err
    for old, new in (("--dims", "--dim"), ("--seqlens", "--seqlen"), ("--dtypes", "--dtype"), ("--out-dir", "--out")):
        assert f"fagen: warning: {old} is deprecated; use {new}" in err


def test_bench_dim_128_causal_selects_its_cases():
    """`fagen bench --dim 128 --causal` parses, and runs d128 causal at every length plus the two training shapes."""
    from fagen.tools.bench import cases
    from fagen.tools.cli import parser

    args = parser().parse_args(["bench", "--dim", "128", "--causal"])
    which, selected = cases.selection(args)
    assert which == "forward"
    dense = [c for c in selected if c.variant == "none"]
    assert [(c.dim, c.causal, c.seqlen) for c in dense] == [(128, True, n) for n in cases.DEFAULT_SEQLENS]
    assert [(c.batch, c.heads) for c in dense] == [(16384 // n, 16) for n in cases.DEFAULT_SEQLENS]
    assert [c.variant for c in selected[len(dense) :]] == ["packed", "gqa"]
    assert all(c.compile_options == dict(causal="top_left") for c in selected)
    args = parser().parse_args(["bench", "--dim", "128", "--causal", "bottom_right", "--backward"])
    which, selected = cases.selection(args)
    assert which == "backward" and {c.compile_options["causal"] for c in selected} == {"bottom_right"}
