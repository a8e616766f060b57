"""The command line's vocabulary: every option two subcommands share, defined once.

An option means the same wherever it appears. Where a command makes one kernel (compile, ir, check) `--dim` and
`--dtype` take one value; where it sweeps (bench, tune) they take a comma-separated list. `--causal [ALIGN]` is the
causal mask everywhere (in a sweep: only the causal cases), `--no-causal` no mask (in a sweep: only the others);
a sweep given neither runs both. `-o/--out` is where a command writes.

Imports stay light: `fagen --help` loads no SymPy, Jinja, NumPy or CuPy.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ALIGNS = ("top_left", "bottom_right")
SWEEP_DTYPES = ("bf16", "f16")


def _dtypes() -> tuple[str, ...]:
    from ..backend.spec import DTYPES

    return DTYPES


def _archs() -> tuple[str, ...]:
    from ..backend.spec import ARCHS

    return ARCHS


def _tiers() -> list[str]:
    from ..backend import tiers

    return tiers.names()


def int_list(text: str) -> tuple[int, ...]:
    """'2048,4096' -> (2048, 4096): positive integers separated by commas."""
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}") from None
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def name_list(choices: tuple[str, ...]) -> Callable[[str], tuple[str, ...]]:
    """A parser of 'a,b' into ('a', 'b'), each one of `choices`."""

    def parse(text: str) -> tuple[str, ...]:
        names = tuple(x.strip() for x in text.split(",") if x.strip())
        bad = [x for x in names if x not in choices]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"expected some of {', '.join(choices)} (comma-separated), got {text!r}")
        return names

    return parse


def positive_int(text: str) -> int:
    """A positive integer (a count of rounds, layers)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def file_to_write(text: str) -> Path:
    """A file a command writes when it is done (refused before the run where it names a folder)."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"expected a file to write (e.g. RESULTS.md), got the folder {text!r}")
    return path


class _Deprecated(argparse.Action):
    """An old spelling kept working: stores as its new name does, with a warning on stderr."""

    def __init__(self, option_strings, dest, new: str = "", **kw) -> None:
        self.new = new
        super().__init__(option_strings, dest, **kw)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(f"fagen: warning: {option_string} is deprecated; use {self.new}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def deprecated(p: argparse.ArgumentParser, old: str, new: str, **kw: Any) -> None:
    """`old` as a hidden alias of option `new` (same destination and type; not listed by --help)."""
    dest = new.lstrip("-").replace("-", "_")
    p.add_argument(old, dest=dest, action=_Deprecated, new=new, help=argparse.SUPPRESS, default=argparse.SUPPRESS, **kw)


def add_dim(p: argparse.ArgumentParser, sweep: tuple[int, ...] | None = None) -> None:
    """--dim: one head dimension (required), or, where the command sweeps, a list (default `sweep`)."""
    if sweep is None:
        p.add_argument(
            "--dim",
            type=int,
            required=True,
            metavar="D",
            help="head dimension, 8..256 (padded to a multiple of 8, >= 32)",
        )
        return
    default = ",".join(map(str, sweep))
    p.add_argument(
        "--dim", type=int_list, default=sweep, metavar="D[,D..]", help=f"head dimensions (default {default})"
    )
    deprecated(p, "--dims", "--dim", type=int_list)


def add_seqlen(p: argparse.ArgumentParser, help: str) -> None:
    """--seqlen: sequence lengths, comma-separated."""
    p.add_argument("--seqlen", type=int_list, default=None, metavar="N[,N..]", help=help)
    deprecated(p, "--seqlens", "--seqlen", type=int_list)


def add_dtype(p: argparse.ArgumentParser, sweep: tuple[str, ...] | None = None) -> None:
    """--dtype: one input dtype, or, where the command sweeps, a list (default `sweep`)."""
    if sweep is None:
        p.add_argument(
            "--dtype",
            default=None,
            metavar="T",
            help=f"input dtype: {', '.join(_dtypes())} (default bf16, or what an --ir program declares)",
        )
        return
    p.add_argument(
        "--dtype",
        type=name_list(SWEEP_DTYPES),
        default=sweep,
        metavar="T[,T..]",
        help=f"input dtypes, some of {', '.join(SWEEP_DTYPES)} (default {','.join(sweep)})",
    )
    deprecated(p, "--dtypes", "--dtype", type=name_list(SWEEP_DTYPES))


def add_causal(p: argparse.ArgumentParser, sweep: bool = False) -> None:
    """--causal [ALIGN] and --no-causal, one excluding the other; neither: no mask, or in a sweep both cases."""
    g = p.add_mutually_exclusive_group()
    where = "only the causal cases, their kernels " if sweep else "causal mask, "
    g.add_argument(
        "--causal",
        nargs="?",
        const="top_left",
        default=None,
        choices=ALIGNS,
        help=f"{where}aligned top_left (the default: PyTorch SDPA's is_causal) or bottom_right (FlashAttention's)"
        + ("; square shapes give both the same mask" if sweep else ""),
    )
    g.add_argument(
        "--no-causal",
        dest="causal",
        action="store_const",
        const=False,
        help="only the cases without a causal mask (without either flag: both)"
        if sweep
        else "no causal mask (default)",
    )


def causal_cases(value: str | bool | None) -> tuple[str | bool, ...]:
    """The causal option (as `fagen.compile` takes it) of each case a sweep runs, from --causal's value: neither flag
    (None) both False and 'top_left'; --no-causal False alone; --causal ALIGN that alignment alone."""
    if value is None:
        return (False, "top_left")
    return (value,) if value else (False,)


def causal_option(value: str | bool | None) -> str | bool:
    """What `fagen.compile(causal=...)` takes for --causal's value in a one-kernel command."""
    return value or False


def add_arch(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--arch",
        default=None,
        metavar="ARCH",
        help=f"target GPU: {', '.join(_archs())} (default: this machine's GPU, else sm_90a)",
    )


def add_tier(
    p: argparse.ArgumentParser, what: str = "kernel tier", default: str = "the planner's choice for each kernel"
) -> None:
    p.add_argument("--tier", default=None, metavar="TIER", help=f"{what}: {', '.join(_tiers())} (default: {default})")


def add_out(p: argparse.ArgumentParser, default: Path | None, help: str) -> None:
    """-o/--out PATH: where the command writes."""
    p.add_argument("-o", "--out", type=Path, default=default, metavar="PATH", help=help)


def add_rounds(p: argparse.ArgumentParser, default: int, help: str) -> None:
    p.add_argument("--rounds", type=positive_int, default=default, metavar="R", help=f"{help} (default {default})")
