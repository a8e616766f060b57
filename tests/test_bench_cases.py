"""`fagen bench`'s pure parts on the CPU: the cases a command line selects, which backends run each, FlashAttention-4's
options, and the results table written from rows the test gives (the timing itself needs a GPU)."""

import math
import subprocess
import sys

import pytest

from fagen.tools.bench import cases, peers, report
from fagen.tools.bench import model as bench_model
from fagen.tools.bench.cases import Case, Row
from fagen.tools.cli import parser


def selected(*argv):
    which, run = cases.selection(parser().parse_args(["bench", *argv]))
    assert which in ("forward", "backward")
    return run


def test_the_default_run_is_every_dense_cell_and_the_two_training_shapes():
    run = selected()
    dense = [c for c in run if c.variant == "none"]
    assert len(dense) == 3 * 2 * 6  # d64/128/256, non-causal and causal, 512..16k
    assert {(c.dim, c.heads) for c in dense} == {(64, 32), (128, 16), (256, 8)}
    assert all(c.batch * c.seqlen == 16384 and c.kv_heads == c.heads for c in dense)
    packed, gqa = run[len(dense) :]
    assert (packed.variant, packed.dim, packed.causal, packed.heads, packed.seqlen) == ("packed", 128, True, 16, 16384)
    assert (gqa.variant, gqa.dim, gqa.causal, gqa.heads, gqa.kv_heads, gqa.seqlen, gqa.batch) == (
        "gqa",
        128,
        True,
        32,
        8,
        8192,
        2,
    )


def test_no_causal_keeps_only_the_unmasked_cases_and_drops_the_causal_training_shapes():
    run = selected("--no-causal", "--variant", "none,window,prefix,packed,gqa", "--seqlen", "2048")
    assert {(c.variant, c.causal) for c in run} == {("none", False), ("prefix", False)}


def test_a_variant_runs_only_with_the_mask_it_is_benchmarked_with():
    run = selected("--variant", "window,prefix,softcap", "--dim", "64", "--seqlen", "4096")
    assert [(c.variant, c.causal) for c in run] == [
        ("window", True),
        ("prefix", False),
        ("softcap", False),
        ("softcap", True),
    ]
    assert selected("--causal", "--variant", "prefix,none", "--dim", "64", "--seqlen", "4096")[0].variant == "none"


def test_the_training_shapes_need_d128_and_causal_in_the_selection():
    assert [c.variant for c in selected("--dim", "64", "--variant", "packed,gqa,none", "--seqlen", "2048")] == [
        "none",
        "none",
    ]
    assert [c.dtype for c in selected("--variant", "gqa", "--dtype", "bf16,f16")] == ["bf16", "f16"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--no-causal", "--variant", "window"], "no case"),
        (["--variant", "document,none"], "document runs alone"),
        (["--variant", "document_offsets,packed"], "document runs alone"),
        (["--backends", "sdpa"], "--backends: unknown sdpa"),
        (["--model", "--backends", "fa4"], "--backends: unknown fa4 with --model"),
        (["--model", "--seqlen", "2048,4096"], "--seqlen: --model takes one length"),
        (["--deterministic"], "--deterministic: only with --backward"),
        (["--model", "--backward", "--deterministic"], "--deterministic: only with --backward"),
        (["--decode", "--deterministic"], "--deterministic: only with --backward"),
    ],
)
def test_selections_that_cannot_run_are_refused_before_the_gpu_is_looked_for(argv, message):
    with pytest.raises(ValueError, match=message):
        cases.selection(parser().parse_args(["bench", *argv]))


def test_the_mode_of_a_command_line():
    modes = {
        (): "forward",
        ("--backward",): "backward",
        ("--decode",): "decode",
        ("--model",): "model",
        ("--model", "--backward"): "model",  # the training step alone
        ("--variant", "document"): "document",
        ("--variant", "document_offsets"): "document",
        ("--variant", "document,document_offsets"): "document",
    }
    for argv, mode in modes.items():
        assert cases.mode(parser().parse_args(["bench", *argv])) == mode


def test_deterministic_adds_a_column_of_fagens_deterministic_backward():
    def columns(*argv):
        args = parser().parse_args(["bench", *argv])
        assert cases.selection(args)[0] == "backward"
        return cases.backend_columns(args)

    assert columns("--backward") == cases.BACKENDS
    assert columns("--backward", "--deterministic") == (*cases.BACKENDS, "fagen_det")
    assert columns("--backward", "--deterministic", "--backends", "fagen,fa4") == ("fagen", "fa4", "fagen_det")
    plan = dict(cases.backend_plan(("fagen", "fagen_det"), "packed", backward=True, missing={}))
    assert plan == {"fagen": None, "fagen_det": None}, "every variant: fagen's kernels say which they refuse"
    with pytest.raises(SystemExit):  # a column of --deterministic, not a backend to name
        parser().parse_args(["bench", "--backward", "--backends", "fagen_det"])


def test_the_model_takes_its_training_steps_tokens_from_seqlen():
    args = parser().parse_args(["bench", "--model", "--backward", "--seqlen", "8192", "--layers", "3"])
    assert cases.selection(args) == ("model", []) and args.backward and args.layers == 3
    assert (cases.MODEL_TOKENS, cases.MODEL_TRAIN_TOKENS) == (4096, 16384)


def test_packed_documents_are_seven_of_256_to_4096_tokens_summing_to_16k():
    lengths = cases.packed_document_lengths()
    assert len(lengths) == 7 and sum(lengths) == 16384 and all(256 <= n <= 4096 for n in lengths)
    assert cases.packed_document_lengths() == lengths, "the same documents every run"
    assert cases.packed_document_lengths(seed=1) != lengths
    assert cases.cu_seqlens((3, 1, 2)) == [0, 3, 4, 6]
    with pytest.raises(ValueError, match="no 7 lengths"):
        cases.packed_document_lengths(total=1000)


def test_flops_follow_the_convention_and_count_each_document_on_its_own():
    dense = Case("none", "bf16", 128, True, 2048, 8, 16, 16)
    assert dense.flops == 4 * 8 * 16 * 2048 * 2048 * 128 / 2
    assert Case("none", "bf16", 128, False, 2048, 8, 16, 16).flops == 2 * dense.flops
    packed = Case("packed", "bf16", 128, True, 300, 1, 16, 16, documents=(100, 200))
    assert packed.flops == 4 * 16 * (100**2 + 200**2) * 128 / 2
    gqa = Case("gqa", "bf16", 128, True, 8192, 2, 32, 8)
    assert gqa.flops == 4 * 2 * 32 * 8192**2 * 128 / 2, "GQA: the query heads' FLOPs"


def test_which_backends_run_a_case():
    plan = dict(cases.backend_plan(cases.BACKENDS, "none", backward=False, missing={}))
    assert plan == dict.fromkeys(cases.BACKENDS)
    plan = dict(cases.backend_plan(cases.BACKENDS, "softcap", backward=False, missing={"fa4": "not installed"}))
    assert plan["fagen"] is None and plan["flex"] is None
    assert plan["fa4"] == "unavailable: not installed"
    assert plan["flash"] == "unavailable: SDPA flash (FA2) has no forward for softcap"
    plan = dict(cases.backend_plan(("fa4", "cudnn", "flex"), "packed", backward=True, missing={}))
    assert plan == {"fa4": None, "cudnn": "unavailable: SDPA cuDNN has no backward for packed", "flex": None}
    assert dict(cases.backend_plan(("fa4",), "softcap", backward=True, missing={}))["fa4"].startswith("unavailable")
    assert dict(cases.backend_plan(("flash",), "gqa", backward=True, missing={}))["flash"] is None
    with pytest.raises(ValueError, match="unknown 'fa5'"):
        cases.backend_plan(("fa5",), "none", backward=False, missing={})


def test_flashattention_4_options_and_layouts():
    case = Case("window", "bf16", 128, True, 4096, 4, 16, 16)
    assert cases.fa4_options(case) == dict(causal=True, window_size=(256, 0))
    assert cases.fa4_options(Case("window", "bf16", 128, False, 4096, 4, 16, 16))["window_size"] == (256, 256)
    assert cases.fa4_options(Case("softcap", "bf16", 64, False, 4096, 4, 32, 32)) == dict(causal=False, softcap=30.0)
    assert cases.fa4_options(Case("none", "bf16", 64, True, 4096, 4, 32, 32)) == dict(causal=True)
    packed = Case("packed", "bf16", 128, True, 300, 1, 16, 16, documents=(100, 200))
    assert peers.layout("fa4", case) == "bshd" and peers.layout("fa4", packed) == "own"
    assert peers.layout("flex", packed) == "packed_bhsd" and peers.layout("flex", case) == "own"
    assert peers.layout("fagen", packed) == peers.layout("cudnn", case) == "own"


def test_a_missing_flashattention_4_is_reported_with_its_reason():
    code = (
        "import sys; sys.modules['flash_attn'] = None\n"
        "from fagen.tools.bench import peers\nprint(peers.missing_peers())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "'fa4': 'flash_attn.cute does not import (" in out.stdout


def test_the_case_tables_import_nothing_heavy():
    code = (
        "import sys\nimport fagen.tools.bench.cases\n"
        "print(sorted(m for m in ('torch', 'numpy', 'sympy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def _rows():
    d128 = Case("none", "bf16", 128, True, 2048, 8, 16, 16)
    gqa = Case("gqa", "bf16", 128, True, 8192, 2, 32, 8)
    rows = []
    for case, ms in ((d128, dict(fagen=1.0, fa4=0.9, cudnn=1.2, flex=1.5)), (gqa, dict(fagen=2.0, fa4=2.2))):
        for be in ("fagen", "fa4", "cudnn", "flex"):
            row = Row.of(case, be)
            if be in ms:
                row.ms = ms[be]
                row.tflops = case.flops / (row.ms * 1e-3) / 1e12
            else:
                row.status = "unavailable: SDPA cuDNN has no forward for gqa" if be == "cudnn" else "failed check: err"
            rows.append(row)
    flash = Row.of(d128, "flash")
    flash.status = "unavailable: RuntimeError: no kernel"
    return rows + [flash]


INFO = report.RunInfo(
    gpu="NVIDIA H100 80GB HBM3",
    date="2026-12-01",
    torch="2.11.0",
    cuda="13.0",
    fagen="0.3.0",
    command="fagen bench --dim 128 --causal --results RESULTS.md",
    rounds=3,
)


def test_the_results_table_is_fagen_over_each_peer_per_case():
    text = report.results_markdown(_rows(), INFO)
    lines = text.splitlines()
    assert lines[0] == "# Results: fagen 0.3.0, forward"
    assert "NVIDIA H100 80GB HBM3, 2026-12-01; torch 2.11.0, CUDA 13.0." in text
    assert "Made by `fagen bench --dim 128 --causal --results RESULTS.md`." in text
    assert "the median of 3 rotated rounds" in text and "Inputs bf16." in text
    header = "| case | fagen TFLOP/s | ÷ FlashAttention-4 | ÷ SDPA cuDNN | ÷ SDPA flash (FA2) | ÷ FlexAttention |"
    assert header in lines
    tflops = 4 * 8 * 16 * 2048**2 * 128 / 2 / 1e-3 / 1e12
    assert f"| d128 causal 2k | {tflops:.0f} | 0.90 | 1.20 | – | 1.50 |" in lines
    gqa_tflops = 4 * 2 * 32 * 8192**2 * 128 / 2 / 2e-3 / 1e12
    assert f"| GQA 32/8, d128 causal 8k (batch 2) | {gqa_tflops:.0f} | 1.10 | – | – | – |" in lines
    assert "- SDPA flash (FA2) did not run: RuntimeError: no kernel" in lines
    assert not any("SDPA cuDNN did not run" in line for line in lines), "cuDNN ran one case"


def test_the_results_of_a_backward_run_and_of_a_fagen_that_did_not_pass():
    rows = _rows()
    rows[0].status = "failed check: err 1e-1 > 1e-2"
    text = report.results_markdown(rows, report.RunInfo(**{**INFO.__dict__, "backward": True, "rounds": 1}))
    assert text.startswith("# Results: fagen 0.3.0, forward + backward\n")
    assert "one round of triton's do_bench" in text and "3.5x the forward's FLOPs" in text
    assert "| d128 causal 2k | – | – | – | – | – |" in text.splitlines()


def test_the_results_name_the_dtype_of_each_case_when_there_are_several():
    rows = _rows()[:4]
    f16 = [Row.of(Case("none", "f16", 128, True, 2048, 8, 16, 16), "fagen")]
    f16[0].ms, f16[0].tflops = 1.0, 275.0
    text = report.results_markdown(rows + f16, INFO)
    assert "| d128 causal 2k f16 | 275 |" in text and "| d128 causal 2k bf16 |" in text
    assert "Inputs" not in text


def test_the_text_table_has_a_column_for_flashattention_4():
    text = report.table(_rows())
    head = text.splitlines()[0]
    assert "fa4 TF/s" in head and "÷fa4" in head
    assert math.isclose(float(text.splitlines()[1].split()[-4]), 0.9)


def test_the_text_table_says_why_a_peer_ran_in_no_case():
    """A peer whose every row is unavailable (FlashAttention-4 not importable, say) gets a line under the table with
    the reason, as the results table has; a peer that ran in some case gets none."""
    rows = _rows()
    why = "flash_attn.cute does not import (ModuleNotFoundError: No module named 'flash_attn')"
    for r in rows:
        if r.backend == "fa4":
            r.status = f"unavailable: {why}"
    lines = report.table(rows).splitlines()
    assert f"- FlashAttention-4 did not run: {why}" in lines
    assert "- SDPA flash (FA2) did not run: RuntimeError: no kernel" in lines
    assert not any("SDPA cuDNN did not run" in line for line in lines), "cuDNN ran one case"


def test_the_deterministic_column_is_its_time_over_the_default_modes():
    rows = _rows()[:4]
    det = Row.of(Case("none", "bf16", 128, True, 2048, 8, 16, 16), "fagen_det")
    det.ms, det.tflops = 1.25, 1.0
    text = report.table([*rows, det])
    head, line = text.splitlines()[:2]
    assert head.split()[-1] == "÷fagen_det" and "fagen_det TF/s" in head
    assert math.isclose(float(line.split()[-1]), 1.25), "÷fagen_det: its ms over fagen's"
    assert len(head) == len(line), "the columns line up"
    md = report.results_markdown([*rows, det], INFO)
    assert md.splitlines()[6].endswith("| ÷ FlexAttention | ÷ fagen deterministic |")
    assert "| 1.50 | 1.25 |" in md


def _train_row(impl, what, ms, errors=(1e-4, 5e-3), status="ok"):
    rounds = [ms * 0.9, ms, ms * 1.1] if ms else []
    return dict(
        input=what,
        implementation=impl,
        tokens=16384,
        ms=ms,
        rounds_ms=rounds,
        loss=8.3 if ms else None,
        errors=errors if ms else None,
        bounds=(1.2e-3, 2e-2),
        status=status,
    )


def test_the_training_table_gives_tokens_per_second_and_fagen_over_each_implementation():
    rows = [
        _train_row("sdpa", "packed (27 documents)", 300.0),
        _train_row("fagen", "packed (27 documents)", 100.0),
        _train_row("flex_attention", "packed (27 documents)", None, status="RuntimeError: no GPU"),
        _train_row(
            "sdpa", "causal (one sequence)", 120.0, errors=(1e-4, 0.5), status="failed check: loss or gradients"
        ),
    ]
    lines = bench_model.train_table(rows).splitlines()
    assert lines[0].startswith("| input | implementation | step ms | tokens/s | fagen ÷ this (speedup) |")
    assert lines[2] == (
        "| packed (27 documents) | sdpa | 300.0 | 54,613 | 3.00x | 3.00–3.00x | 8.3000 | "
        "1.0e-04, 5.0e-03 (1.2e-03, 2.0e-02) | ok |"
    )
    assert "| fagen | 100.0 | 163,840 | 1.00x |" in lines[3]
    assert lines[4] == "| packed (27 documents) | flex_attention | - | - | - | - | - | - | RuntimeError: no GPU |"
    assert "| 120.0 | 136,533 | - | - |" in lines[5], "no fagen on that input: no ratio"
    assert bench_model.check_line(rows[:2]).startswith("Check: every implementation's")
    line = bench_model.check_line(rows)
    assert "flex_attention on packed (27 documents) (RuntimeError: no GPU)" in line
    assert "sdpa on causal (one sequence) (failed check" in line and "fagen on" not in line


# --- a case's run on the CPU: the layouts, the checks and the rows, with reference attention standing for the GPU ---
@pytest.fixture(scope="module")
def causal_kernel(tmp_path_factory):
    """A compiled causal d64 kernel: its program gives the checks their mask (it is never launched here)."""
    pytest.importorskip("torch")  # only the tests that run a case on torch's tensors use it
    import fagen

    return fagen.compile(64, causal=True, dtype="bf16", arch="sm_80", cache_dir=tmp_path_factory.mktemp("cache"))


def _sdpa(q, k, v, causal):
    import torch.nn.functional as F

    o = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal, enable_gqa=True)
    return o.to(q.dtype)


def reference_call(backend, case, kernel, tensors):
    """Attention in `backend`'s layout (peers.layout), as that backend would compute it; 'flash' masks wrongly."""
    import torch

    causal = case.causal if backend != "flash" else not case.causal
    name = peers.layout(backend, case)
    spans = list(zip(cases.cu_seqlens(case.documents), cases.cu_seqlens(case.documents)[1:]))
    if name == "packed_bhsd":  # [1, H, total, D]
        return lambda q, k, v: torch.cat([_sdpa(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], causal) for s, e in spans], 2)
    if case.documents:  # [total, H, D]

        def doc(x, s, e):
            return x[s:e].transpose(0, 1)[None]

        def packed(q, k, v):
            return torch.cat(
                [_sdpa(doc(q, s, e), doc(k, s, e), doc(v, s, e), causal)[0].transpose(0, 1) for s, e in spans]
            )

        return packed
    if name == "bshd":
        return lambda q, k, v: _sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal).transpose(1, 2)
    return lambda q, k, v: _sdpa(q, k, v, causal)


@pytest.fixture
def session(causal_kernel, monkeypatch):
    pytest.importorskip("torch")
    from fagen.tools.bench import forward

    s = forward.Session(log=open("/dev/null", "w"), device="cpu")
    s.timer = lambda fn: (fn(), 2.0)[1]
    s.missing = {}
    monkeypatch.setattr(s, "kernel", lambda case: causal_kernel)
    monkeypatch.setattr(s, "call", reference_call)
    return s


SMALL = (
    Case("none", "bf16", 64, True, 96, 2, 4, 4),
    Case("gqa", "bf16", 64, True, 80, 2, 8, 2),
    Case("packed", "bf16", 64, True, 197, 1, 4, 4, documents=(100, 60, 37)),
)


@pytest.mark.parametrize("case", SMALL, ids=[c.variant for c in SMALL])
def test_a_forward_case_checks_every_layout_before_it_times_it(session, case):
    from fagen.tools.bench import forward

    rows = forward.forward_case(session, case, ("fagen", "fa4", "flash", "flex"), rounds=2)
    by = {r.backend: r for r in rows}
    for be in ("fagen", "fa4", "flex"):
        assert by[be].status == "ok" and by[be].err <= by[be].bound, (be, by[be])
        assert by[be].ms == 2.0 and math.isclose(by[be].tflops, case.flops / 2e-3 / 1e12)
    if case.documents:
        assert by["flash"].status == "unavailable: SDPA flash (FA2) has no forward for packed"
    else:
        assert by["flash"].status.startswith("failed check: err"), "a wrong mask is caught"
    assert math.isnan(by["flash"].ms)
    assert by["fagen"].extra["kernel"] == session.kernel(case).name


def test_a_packed_output_is_checked_document_by_document(causal_kernel):
    torch = pytest.importorskip("torch")
    from fagen.tools.bench import check, forward

    case = SMALL[2]
    q, k, v = forward.case_inputs(case, "cpu")
    right = reference_call("fagen", case, None, {})(q, k, v)
    err, bound = check.check_case(right, q, k, v, case, causal_kernel, {}, 1 / 8)
    assert err <= bound
    whole = _sdpa(*(x.transpose(0, 1)[None] for x in (q, k, v)), True)[0].transpose(0, 1)  # one causal sequence
    assert torch.equal(whole[:100], right[:100]), "the first document sees no other"
    err, bound = check.check_case(whole, q, k, v, case, causal_kernel, {}, 1 / 8)
    assert err > bound, "a later document that sees the ones before it is caught"


def test_a_backward_case_times_the_peers_through_autograd(session):
    from fagen.tools.bench import backward

    case = SMALL[1]
    rows = backward.backward_case(session, case, ("fa4", "flex", "cudnn"), rounds=1)
    by = {r.backend: r for r in rows}
    assert by["fa4"].status == by["flex"].status == by["cudnn"].status == "ok"
    assert math.isclose(by["fa4"].tflops, 3.5 * case.flops / 2e-3 / 1e12)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flexattention_masks_each_packed_document_on_its_own(monkeypatch):
    torch = pytest.importorskip("torch")
    from torch.nn.attention.flex_attention import flex_attention

    case = SMALL[2]
    p = peers.Peers(torch, device="cpu")
    monkeypatch.setattr(p, "_compiled_flex", lambda: flex_attention)  # eager on the CPU, compiled on the GPU
    q, k, v = (torch.randn(1, 4, case.seqlen, 64) for _ in range(3))
    want = reference_call("flex", case, None, {})(q, k, v)
    assert torch.allclose(p.flex(case)(q, k, v), want, atol=1e-5)
    gqa = SMALL[1]
    q, k, v = torch.randn(2, 8, 80, 64), torch.randn(2, 2, 80, 64), torch.randn(2, 2, 80, 64)
    assert torch.allclose(p.flex(gqa)(q, k, v), _sdpa(q, k, v, True), atol=1e-5)


def test_flashattention_4_is_called_as_its_interface_reads(monkeypatch):
    """flash_attn.cute's flash_attn_func / flash_attn_varlen_func (a stand-in module records the calls): its keyword
    options, the packed offsets, and the first element where it returns (out, lse)."""
    torch = pytest.importorskip("torch")
    import types

    calls = []

    def func(q, k, v, **kw):
        calls.append(("func", kw))
        return q + 1, None

    def varlen(q, k, v, **kw):
        calls.append(("varlen", kw))
        return q + 2

    module = types.ModuleType("flash_attn.cute")
    module.flash_attn_func, module.flash_attn_varlen_func = func, varlen
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    monkeypatch.setitem(sys.modules, "flash_attn.cute", module)
    sys.modules["flash_attn"].cute = module
    assert peers.missing_peers() == {}
    p = peers.Peers(torch, device="cpu")
    x = torch.zeros(2)
    assert torch.equal(p.fa4(Case("window", "bf16", 128, True, 4096, 4, 16, 16))(x, x, x), x + 1)
    assert calls[-1] == ("func", dict(causal=True, window_size=(256, 0)))
    assert torch.equal(p.fa4(SMALL[2])(x, x, x), x + 2)
    kind, kw = calls[-1]
    assert kind == "varlen" and kw["cu_seqlens_q"].tolist() == kw["cu_seqlens_k"].tolist() == [0, 100, 160, 197]
    assert kw["cu_seqlens_q"].dtype == torch.int32 and kw["max_seqlen_q"] == kw["max_seqlen_k"] == 100
    assert kw["causal"] is True


def _fagen_backward_double(mode):
    """bench.backward.fagen_backward's stand-in: reference attention's gradients by autograd (the kernel is never
    launched here); in deterministic mode, with `mode` 'unstable' dq changes from call to call, with 'off' it is
    10% off the default mode's."""
    calls = iter(range(1, 100))

    def fagen_backward(s, case, kernel, tensors, inputs, do, deterministic=False):
        attend = reference_call("fagen", case, kernel, tensors)

        def step():
            q, k, v = (x.detach().requires_grad_() for x in inputs)
            attend(q, k, v).backward(do)
            dq = q.grad
            if deterministic and mode == "unstable":
                dq = dq + next(calls) * 1e-2
            if deterministic and mode == "off":
                dq = dq * 1.1
            return dq, k.grad, v.grad, {}

        return step

    return fagen_backward


@pytest.mark.parametrize("mode", ["stable", "unstable", "off"])
@pytest.mark.parametrize("case", SMALL[::2], ids=["dense", "packed"])
def test_the_deterministic_column_is_checked_before_it_is_timed(session, monkeypatch, mode, case):
    from fagen.tools.bench import backward

    monkeypatch.setattr(backward, "fagen_backward", _fagen_backward_double(mode))
    rows = backward.backward_case(session, case, ("fagen", "fagen_det"), rounds=2)
    by = {r.backend: r for r in rows}
    assert by["fagen"].status == "ok" and by["fagen"].ms == 2.0
    det = by["fagen_det"]
    plan = session.kernel(case).backward_plan
    assert det.extra["kernel"] == plan.main.spec.name + backward.deterministic_dq(plan), "how dQ is made, named"
    assert backward.deterministic_dq(plan) in (f" + {plan.dq.spec.name}", " (ordered dQ)")
    if mode == "stable":
        assert det.status == "ok" and det.ms == 2.0 and det.err <= det.bound == backward.DETERMINISTIC_RTOL
    elif mode == "unstable":
        assert det.status == "failed check: two deterministic calls differ" and math.isnan(det.ms)
    else:
        assert det.status.startswith("failed check: dq, dk, dv") and 0.09 < det.err < 0.11 and math.isnan(det.ms)


@pytest.mark.parametrize("causal", [True, False])
def test_the_document_mask_from_offsets_is_the_document_mask(causal):
    """`--variant document_offsets` times the same mask written from offsets (offsets[doc[q]] <= k): the same keys."""
    torch = pytest.importorskip("torch")
    from fagen.tools.bench.document import document_mask

    n, size = 2500, 1000  # the last document cut short
    q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
    divide = document_mask(size, causal)(0, 0, q, k)
    offsets = document_mask(size, causal, "offsets", n, device="cpu")(0, 0, q, k)
    assert torch.equal(divide, offsets) and 0 < int(offsets.sum()) < n * n
    with pytest.raises(ValueError, match="form: expected"):
        document_mask(size, causal, "ranges")


def test_a_windows_flops_count_the_pairs_it_keeps():
    """Causal, window of 256 keys: (left + 1) N - left (left + 1) / 2 pairs a sequence, 4 H D FLOPs each; a short
    sequence keeps every causal pair."""
    left = cases.VARIANTS["window"]["window"]
    case = cases.Case("window", "bf16", 128, True, 4096, 2, 16, 16)
    pairs = sum(min(q, left) + 1 for q in range(4096))
    assert case.flops == 2 * 4.0 * 16 * 128 * pairs
    short = cases.Case("window", "bf16", 128, True, 100, 1, 16, 16)
    assert short.flops == 4.0 * 16 * 128 * 100 * 101 / 2


def test_context_parallel_ranks_start_with_multicast_off_and_one_hardware_queue_unless_set():
    from fagen.tools.bench.context_parallel import rank_env

    assert rank_env({}) == {
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NVSHMEM_DISABLE_NVLS": "1",
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    }
    given = rank_env({"CUDA_DEVICE_MAX_CONNECTIONS": "8", "PATH": "/bin"})
    assert given["CUDA_DEVICE_MAX_CONNECTIONS"] == "8" and "PATH" not in given
