"""`fagen bench --model`'s training step on the CPU, with transformers (its table: tests/test_bench_cases.py): a
tiny Llama-style model trained with "sdpa" and "fagen" (fagen.hf over the kernel double, tests/attention_double.py:
the GPU kernel never runs here), the first-step check against float32 sdpa (and a wrong mask that fails it), the
rotated rounds and the optimizer's step. FlexAttention is compiled by transformers, for the GPU: timed there only."""

from __future__ import annotations

import math

import pytest

from fagen.tools.bench import model

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import AttentionInterface  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask  # noqa: E402

import fagen.hf as hf  # noqa: E402

from .attention_double import install  # noqa: E402


def tiny():
    cfg = model.config(layers=2, heads=4, kv_heads=2, head_dim=16, vocab=97)
    cfg.hidden_size, cfg.intermediate_size = 64, 96
    return cfg


@pytest.fixture
def doubled(monkeypatch):
    """fagen's compiler replaced by the float64 kernel double, and "one_sequence": sdpa that ignores the documents
    (a wrong mask on packed input, right on one causal sequence)."""
    install(monkeypatch)
    monkeypatch.setattr(hf, "_documents_memo", [])

    def one_sequence(module, q, k, v, attention_mask, **kwargs):
        kwargs.pop("is_causal", None)
        return sdpa_attention_forward(module, q, k, v, None, is_causal=True, **kwargs)

    AttentionInterface.register("one_sequence", one_sequence)
    AttentionMaskInterface.register("one_sequence", sdpa_mask)
    yield
    torch._dynamo.reset()


def test_training_inputs_label_no_token_across_a_documents_end():
    lengths = [3, 1, 4]
    ids, pos, labels = model.training_inputs(lengths, 97, packed=True, device="cpu")
    assert pos.tolist() == [[0, 1, 2, 0, 0, 1, 2, 3]]
    assert (labels == -100).nonzero()[:, 1].tolist() == [0, 3, 4], "each document's first token"
    assert torch.equal(labels[labels != -100], ids[labels != -100])
    ids2, none, labels2 = model.training_inputs(lengths, 97, packed=False, device="cpu")
    assert none is None and torch.equal(ids2, ids) and labels2 is ids2


def test_a_training_step_updates_the_weights():
    cfg = tiny()
    m = model.build_model(cfg, torch.float32, device="cpu").train()
    m.set_attn_implementation("sdpa")
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    before = m.model.layers[0].self_attn.q_proj.weight.clone()
    loss = model.train_step(m, opt, *model.training_inputs([20, 12], cfg.vocab_size, packed=True, device="cpu"))
    assert math.isfinite(loss.item()) and not torch.equal(before, m.model.layers[0].self_attn.q_proj.weight)


def test_the_training_step_is_checked_then_timed_in_rotated_rounds(doubled, monkeypatch):
    order = []

    def bench(fn):
        order.append(current["model"].config._attn_implementation)
        fn()
        return {"sdpa": 3.0, "fagen": 1.5}.get(order[-1], 2.0)

    current = {}
    build = model.build_model
    monkeypatch.setattr(model, "build_model", lambda *a, **k: current.setdefault("model", build(*a, **k)))
    impls = ("sdpa", "fagen", "one_sequence")
    rows = model.run_training(cfg=tiny(), tokens=300, implementations=impls, rounds=3, device="cpu", bench=bench)
    assert [(r["input"], r["implementation"]) for r in rows] == [
        (what, impl) for what in ("packed (2 documents)", "causal (one sequence)") for impl in impls
    ]
    assert (
        order == ["sdpa", "fagen", "one_sequence", "fagen", "one_sequence", "sdpa", "one_sequence", "sdpa", "fagen"] * 2
    )
    by = {(r["input"][:6], r["implementation"]): r for r in rows}
    for what in ("packed", "causal"):
        assert by[what, "sdpa"]["status"] == by[what, "fagen"]["status"] == "ok"
        assert by[what, "fagen"]["ms"] == 1.5 and by[what, "fagen"]["rounds_ms"] == [1.5] * 3
        loss_err, grad_err = by[what, "fagen"]["errors"]
        assert loss_err <= by[what, "fagen"]["bounds"][0] and grad_err <= by[what, "fagen"]["bounds"][1]
        assert abs(by[what, "fagen"]["loss"] - math.log(97)) < 0.5, "random weights: about ln(vocab)"
    wrong = by["packed", "one_sequence"]
    assert wrong["status"] == "failed check: loss or gradients past the bound" and wrong["ms"] == 2.0
    assert wrong["errors"][1] > 5 * wrong["bounds"][1], "attending across documents is caught by the gradients"
    assert by["causal", "one_sequence"]["status"] == "ok", "one sequence: the right mask"
    assert "| 2.00x |" in model.train_table(rows), "sdpa ÷ fagen"


def test_an_implementation_that_fails_is_reported_and_not_timed(doubled):
    rows = model.run_training(
        cfg=tiny(), tokens=64, implementations=("sdpa", "nonesuch"), rounds=1, device="cpu", bench=lambda fn: 1.0
    )
    bad = [r for r in rows if r["implementation"] == "nonesuch"]
    assert len(bad) == 2 and all(r["ms"] is None and r["status"].startswith("ValueError") for r in bad)
    assert all(r["ms"] == 1.0 for r in rows if r["implementation"] == "sdpa")


def test_an_implementation_that_fails_while_timed_is_reported_and_the_others_timed_on(doubled):
    """A peer that fails in a timed step (out of memory on the GPU, say) gets its reason and no time; the rest run."""
    calls = []

    def bench(fn):
        calls.append(len(calls))
        if len(calls) == 2:  # round 0's second implementation
            raise RuntimeError("CUDA out of memory. Tried to allocate 32.00 GiB\nmore")
        return 1.0

    rows = model.run_training(
        cfg=tiny(), tokens=64, implementations=("sdpa", "fagen"), rounds=2, device="cpu", bench=bench
    )
    packed = {r["implementation"]: r for r in rows if r["input"].startswith("packed")}
    assert packed["fagen"]["status"] == "timing failed: RuntimeError: CUDA out of memory. Tried to allocate 32.00 GiB"
    assert packed["fagen"]["ms"] is None and packed["fagen"]["rounds_ms"] == []
    assert packed["sdpa"]["ms"] == 1.0 and packed["sdpa"]["rounds_ms"] == [1.0, 1.0], "timed in every round"
    assert all(r["ms"] == 1.0 and r["status"] == "ok" for r in rows if r["input"].startswith("causal"))
    assert len(calls) == 3 + 4, "packed: sdpa twice, fagen once (failed); causal: both twice"
    assert "timing failed" in model.train_table(rows)


def test_the_float32_reference_is_sdpa_with_the_kv_heads_repeated():
    """REFERENCE (what the first steps are checked against) computes what "sdpa" does, packed and causal, without
    SDPA's GQA call (which float32 takes to the math kernel on the GPU)."""
    model.register_reference()
    cfg = tiny()
    m = model.build_model(cfg, torch.float32, device="cpu").train()
    for packed in (True, False):
        inputs = model.training_inputs([20, 12], cfg.vocab_size, packed, device="cpu")
        want, got = model.first_step(m, "sdpa", inputs), model.first_step(m, model.REFERENCE, inputs)
        assert abs(got[0] - want[0]) < 1e-5 and torch.allclose(got[1], want[1], rtol=1e-4, atol=1e-6), packed
    wrong = model.first_step(m, "sdpa", model.training_inputs([20, 12], cfg.vocab_size, True, device="cpu"))
    other = model.first_step(m, model.REFERENCE, model.training_inputs([20, 12], cfg.vocab_size, False, device="cpu"))
    assert not torch.allclose(wrong[1], other[1], rtol=1e-4, atol=1e-6), "packed and one sequence differ"
