"""The README's examples, and those of docs/, run as written (tests/readme_examples.py says how blocks are told
apart)."""

import re

import pytest

import fagen
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
