"""The README's examples, and those of docs/, run as written (tests/readme_examples.py says how blocks are told apart),
and its shell commands are checked (tests/readme_commands.py)."""

import re

import pytest

import fagen
from tests import readme_commands as rc
from tests import readme_examples as rx


def test_readme_python_blocks_run_and_gpu_blocks_check(tmp_path):
    found = rx.blocks(rx.README.read_text(encoding="utf-8"))
    assert [b.kind for b in found].count("cpu") >= 1 and [b.kind for b in found].count("gpu") >= 1
    ns = rx.run_all(rx.README, tmp_path)
    assert isinstance(ns["attn"], fagen.Kernel) and (tmp_path / "attn.cu").read_text() == ns["attn"].source
    assert ns["t"].tensors == ("bias",) and ns["a"].tensors == ("slopes",)
    assert list((tmp_path / "cache").iterdir()), "the examples compiled into the temporary cache"


@pytest.mark.gpu
def test_readme_gpu_blocks_run(tmp_path):
    rx.run_all(rx.README, tmp_path, gpu=True)


DOCS = sorted((rx.README.parent / "docs").glob("*.md"))


def test_the_readme_links_every_docs_page():
    text = rx.README.read_text(encoding="utf-8")
    assert DOCS and all(f"(docs/{page.name})" in text for page in DOCS)


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_docs_python_blocks_run_and_gpu_blocks_check(page, tmp_path):
    rx.run_all(page, tmp_path)


@pytest.mark.gpu
@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_docs_gpu_blocks_run(page, tmp_path):
    rx.run_all(page, tmp_path, gpu=True)


README_TEXT = """
```python
import fagen
k = fagen.compile(dim=64, alibi=True, arch="sm_90a")
```
Then
```python gpu
o = k(q, q, q, slopes=s)
```
"""


def _ns(tmp_path):
    ns = {}
    with rx._isolated(tmp_path):
        for b in rx.blocks(README_TEXT)[:1]:
            exec(b.compiled("x"), ns)  # noqa: S102 - the example block under test
    return ns


def test_blocks_are_told_apart_by_their_info_string():
    found = rx.blocks(README_TEXT + "```bash\nfagen ir\n```\n")
    assert [(b.kind, b.line) for b in found] == [("cpu", 3), ("gpu", 8)]
    with pytest.raises(ValueError, match="unknown python block kind 'python gpus'"):
        rx.blocks("```python gpus\nx\n```\n")
    with pytest.raises(ValueError, match="not closed"):
        rx.blocks("```python\nx\n")


@pytest.mark.parametrize(
    "code, fragment",
    [
        ("o = k(q, q, q, slopes=s)\n", "'q' is not defined"),
        ("import torch\nq = torch.ones(1)\no = k(q, q, q)\n", "passes tensors [], its program reads ['slopes']"),
        ("q = 1\no = k(q, q, q, slopes=q, bias=q)\n", "passes tensors ['bias', 'slopes']"),
        ("q = 1\no = k(q, q, slopes=q)\n", "does not fit"),
        ("q = 1\no = k.varlen(q, q, q, q, q, 3, 3, slope=q)\n", "passes tensors ['slope']"),
        ("q = 1\no = k.run(q)\n", "kernel k has no attribute 'run'"),
    ],
)
def test_gpu_blocks_are_checked_without_a_gpu(tmp_path, code, fragment):
    ns = _ns(tmp_path)
    with pytest.raises(AssertionError, match=re.escape(fragment)):
        rx.check_gpu_block(rx.Block("gpu", code, 10), ns)


def test_a_correct_gpu_block_passes_the_check(tmp_path):
    ns = _ns(tmp_path)
    rx.check_gpu_block(
        rx.Block("gpu", "import torch\nq = torch.ones(1)\no, lse = k(q, q, q, return_lse=True, slopes=q)\n", 10), ns
    )


# --- the README's shell commands (tests/readme_commands.py; .ci/run runs them before the tests) ---

SHELL_TEXT = """
```bash
fagen ir --dim 64   # a comment
# a comment line
fagen compile --dim 64 \\
    --causal
```
```console
$ fagen compile --dim 128
generated/x.cu
  kernel x
$ fagen ir --dim 128
```
```bash gpu
fagen check --dim 64
```
"""


def test_shell_blocks_are_told_apart_by_their_info_string():
    found = rc.commands(SHELL_TEXT + "```python\nx = 1\n```\n```text\n$ not a command\n```\n")
    assert found == [
        rc.Command("cpu", "fagen ir --dim 64   # a comment", 3),
        rc.Command("cpu", "fagen compile --dim 64      --causal", 5),
        rc.Command("cpu", "fagen compile --dim 128", 9, "generated/x.cu"),
        rc.Command("cpu", "fagen ir --dim 128", 12),
        rc.Command("gpu", "fagen check --dim 64", 15),
    ]
    with pytest.raises(ValueError, match="unknown shell block kind 'bash gpus'"):
        rc.commands("```bash gpus\nx\n```\n")
    with pytest.raises(ValueError, match="unknown shell block kind 'sh'"):
        rc.commands("```sh\nx\n```\n")
    with pytest.raises(ValueError, match="ends with a backslash"):
        rc.commands("```bash\nfagen ir \\\n```\n")


def test_readme_commands_are_checked_and_its_setup_commands_are_ci_steps():
    found = rc.commands(rc.README.read_text(encoding="utf-8"))
    assert [c.kind for c in found].count("cpu") >= 3 and [c.kind for c in found].count("gpu") >= 1
    for c in found:
        rc.check(c)
    setup = ['python3 -m pip install -e ".[test]"', "python3 -m pytest -q -rs"]
    assert [c.text for c in found[:2]] == setup, "the README's first commands: install, then test"
    assert set(setup) <= rc.ci_steps(), ".ci/run runs the README's install and test commands as written"


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("fagen bench --dim 128 --causal both", "argument --causal: invalid choice"),
        ("fagen compile --dim 128 --bogus", "unrecognized arguments: --bogus"),
        ("fagen compile --causal", "the following arguments are required: --dim"),
        ("python3 -m no_such_module_here", "no module 'no_such_module_here'"),
        ("no-such-program --x", "'no-such-program' is not on PATH"),
        ("PYTHONPATH=. python3 tests/gpu/no_such_case.py", "no file tests/gpu/no_such_case.py"),
    ],
)
def test_a_command_that_cannot_run_is_refused_by_the_check(text, fragment):
    with pytest.raises(AssertionError, match=re.escape(fragment)):
        rc.check(rc.Command("gpu", text, 7))


def test_checked_commands_pass():
    rc.check(rc.Command("gpu", "fagen compile --dim 128 --causal bottom_right", 7))
    rc.check(rc.Command("gpu", "compute-sanitizer --tool memcheck python3 tests/gpu/sanitize_case.py", 7))


def test_a_run_command_must_exit_0_and_print_what_the_readme_shows():
    assert rc.run(rc.Command("cpu", "echo one; echo two", 3, "one")) >= 0
    with pytest.raises(AssertionError, match="printed first 'one', the README shows 'two'"):
        rc.run(rc.Command("cpu", "echo one", 3, "two"))
    with pytest.raises(AssertionError, match=r"README line 3 \(`false \| cat`\): exit 1"):
        rc.run(rc.Command("cpu", "false | cat", 3))
