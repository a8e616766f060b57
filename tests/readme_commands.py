"""The README's shell commands, run as a user would run them in a fresh clone (`.ci/run` runs this before the tests).

Fenced blocks of README.md whose info string is `bash` or `console` hold commands: each line of a `bash` block (a
trailing backslash continues it, `#` starts a comment), and each line of a `console` block that starts with `$ `
(the lines after it, up to the next `$ `, are its output). A block fenced as `bash gpu` or `console gpu` needs a
CUDA GPU. Any other info string on a block that starts with `bash`, `console`, `sh` or `shell` is an error, so a
block cannot drop out of the check by a typo.

Every command is checked:
- a `fagen` command's arguments parse (fagen's own parser, through the installed `fagen` entry point, stopped
  before the command runs);
- `python3 -m MODULE` names a module that can be imported, and every `.py` file named exists in the source tree;
- any other program is on PATH, or is a GPU tool (compute-sanitizer, ncu, nsys) that a machine without a GPU lacks.

Then, unless `--check-only`, the commands of the plain blocks run in order in the source tree's root, each with
bash, and must exit 0; a `console` command must print first the line the README shows first. The commands that
`.ci/run` runs as steps of its own (the install and the test command) are not run again. The `gpu` blocks are only
checked.

    python3 tests/readme_commands.py [README.md] [--check-only]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
CI = ROOT / ".ci" / "run"
KINDS = {"bash": "cpu", "bash gpu": "gpu", "console": "cpu", "console gpu": "gpu"}
SHELLS = ("bash", "console", "sh", "shell")
GPU_TOOLS = {"compute-sanitizer", "ncu", "nsys"}

try:
    from .readme_examples import fenced_blocks  # imported as part of the tests package
except ImportError:
    from readme_examples import fenced_blocks  # run as a script: tests/ is first on the path
_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=.*")


@dataclass(frozen=True)
class Command:
    kind: str  # "cpu": runs anywhere; "gpu": needs a CUDA GPU
    text: str  # the command as written (continuation lines joined)
    line: int  # README line of its first line
    output: str | None = None  # a console command's first output line in the README


def _bash_commands(kind: str, lines: list[str], first: int) -> list[Command]:
    out, pending, start = [], "", first
    for n, raw in enumerate(lines, first):
        text = raw.rstrip()
        if not pending:
            start = n
            if not text.strip() or text.lstrip().startswith("#"):
                continue
        if text.endswith("\\"):
            pending += text[:-1] + " "
            continue
        out.append(Command(kind, (pending + text).strip(), start))
        pending = ""
    if pending:
        raise ValueError(f"README line {start}: the command's last line ends with a backslash")
    return out


def _console_commands(kind: str, lines: list[str], first: int) -> list[Command]:
    out = []
    for i, text in enumerate(lines):
        if text.startswith("$ "):
            following = lines[i + 1] if i + 1 < len(lines) and not lines[i + 1].startswith("$ ") else None
            out.append(Command(kind, text[2:].strip(), first + i, following))
    return out


def commands(text: str) -> list[Command]:
    """The commands of a Markdown text's shell blocks, in order."""
    out = []
    for info, first, lines in fenced_blocks(text):
        if info.split(" ")[0] in SHELLS:
            if info not in KINDS:
                raise ValueError(
                    f"README line {first - 1}: unknown shell block kind {info!r} (expected one of {sorted(KINDS)})"
                )
            split = _console_commands if info.startswith("console") else _bash_commands
            out += split(KINDS[info], lines, first)
    return out


def ci_steps(path: Path = CI) -> set[str]:
    """The lines of .ci/run, stripped: a README command that is one of them is a step CI runs itself."""
    return {line.strip() for line in path.read_text(encoding="utf-8").splitlines()}


class _Parsed(BaseException):  # not an Exception: a `except Exception` in main lets it through
    pass


def _check_fagen(args: list[str], where: str) -> None:
    """Parse a `fagen` command's arguments with fagen's own parser (the installed entry point's), and stop there."""
    from importlib.metadata import entry_points

    found = entry_points(group="console_scripts", name="fagen")
    if found:
        main = next(iter(found)).load()
    else:  # not installed: the source tree's (python3 -m fagen)
        from fagen.tools.cli import main
    real = argparse.ArgumentParser.parse_args

    def parse_only(self, args=None, namespace=None):
        raise _Parsed(real(self, args, namespace))

    argv, err = sys.argv, io.StringIO()
    argparse.ArgumentParser.parse_args = parse_only
    sys.argv = ["fagen", *args]
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            main()
    except _Parsed:
        return
    except SystemExit as e:
        said = (err.getvalue().strip().splitlines() or [f"exit {e.code}"])[-1]
        raise AssertionError(f"{where}: fagen's parser refuses it: {said}") from None
    finally:
        argparse.ArgumentParser.parse_args = real
        sys.argv = argv
    raise AssertionError(f"{where}: fagen's main returned without parsing its arguments")


def check(command: Command) -> None:
    """Check a command without running it (see the module docstring); raises AssertionError."""
    where = f"README line {command.line} (`{command.text}`)"
    words = shlex.split(command.text, comments=True)
    while words and _ASSIGNMENT.fullmatch(words[0]):  # VAR=value before the program
        words.pop(0)
    assert words, f"{where}: no program"
    program = words[0]
    if program == "fagen":
        _check_fagen(words[1:], where)
    elif program in ("python", "python3") and words[1:2] == ["-m"]:
        assert importlib.util.find_spec(words[2]) is not None, f"{where}: no module {words[2]!r}"
    else:
        assert shutil.which(program) or program in GPU_TOOLS, f"{where}: {program!r} is not on PATH"
    for w in words:
        assert not w.endswith(".py") or (ROOT / w).is_file(), f"{where}: no file {w} in the source tree"


def run(command: Command) -> float:
    """Run a command in the source tree's root with bash; raises AssertionError if it fails or prints another first
    line than the README shows. Returns its seconds."""
    where = f"README line {command.line} (`{command.text}`)"
    t0 = time.perf_counter()
    p = subprocess.run(
        ["bash", "-o", "pipefail", "-c", command.text], cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    seconds = time.perf_counter() - t0
    assert p.returncode == 0, f"{where}: exit {p.returncode}\n{p.stdout[-2000:]}{p.stderr[-4000:]}"
    if command.output is not None:
        first = (p.stdout.splitlines() or [""])[0]
        assert first == command.output, f"{where}: printed first {first!r}, the README shows {command.output!r}"
    return seconds


def main(argv: list[str]) -> int:
    check_only = "--check-only" in argv
    paths = [a for a in argv if not a.startswith("--")]
    readme = Path(paths[0]) if paths else README
    found = commands(readme.read_text(encoding="utf-8"))
    assert any(c.kind == "cpu" for c in found), f"{readme}: no command to run"
    steps = ci_steps()
    for c in found:
        check(c)
        if c.text in steps:
            status = "checked; .ci/run runs it as a step of its own"
        elif c.kind == "gpu":
            status = "checked (needs a GPU to run)"
        elif check_only:
            status = "checked"
        else:
            status = f"ran in {run(c):.1f} s"
        print(f"README line {c.line}: {status}: {c.text}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
