"""fagen.hf, fagen as a Hugging Face transformers attention implementation, on the CPU with the kernel double
(tests/attention_double.py, float64 FlashAttention semantics): registration and dispatch inside tiny Llama and
Mistral models against transformers' own "sdpa" implementation (causal, GQA, packed documents from
position_ids or cu_seq_lens, a KV cache, a sliding window), the conversion of arguments (layouts, scaling, GQA
with no K/V copy, cu_seqlens from position_ids), and the refusals."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_import_needs_neither_torch_nor_transformers():
    code = "import sys, fagen.hf; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, create_causal_mask  # noqa: E402

import fagen.hf as hf  # noqa: E402
from fagen.request import Flash  # noqa: E402

from .attention_double import DoubleKernel, install  # noqa: E402


@pytest.fixture
def compiled(monkeypatch):
    """The compiler behind fagen's memo replaced by the kernel double, fagen registered: the (request, kernel)
    pairs made."""
    made = install(monkeypatch)
    monkeypatch.setattr(hf, "_documents_memo", [])
    hf.register()
    yield made
    torch._dynamo.reset()


def tiny(layers=2, **extra):
    cfg = LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        **extra,
    )
    torch.manual_seed(0)
    return cfg, LlamaForCausalLM(cfg).eval()


def logits(model, impl, ids, **kwargs):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(ids, **kwargs).logits


def close(a, b, tol=1e-5):
    err = (a - b).abs().max().item()
    assert err <= tol, f"max error {err:.3e} > {tol:.0e}"


def packed(lengths, B=1, vocab=97, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, sum(lengths)), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])[None].expand(B, -1)
    return ids, pos


# --- registration and dispatch ---------------------------------------------------------------------------------
def test_register(compiled):
    assert AttentionInterface()["fagen"] is hf.attention_forward
    assert ALL_MASK_ATTENTION_FUNCTIONS["fagen"] is hf.attention_mask
    assert (
        hf.register("fagen_custom") == "fagen_custom" and AttentionInterface()["fagen_custom"] is hf.attention_forward
    )
    cfg, model = tiny(attn_implementation="fagen")
    assert model.config._attn_implementation == "fagen"
    with pytest.raises(TypeError, match="name: expected a non-empty string"):
        hf.register("")


def test_causal_batch_matches_sdpa(compiled):
    cfg, model = tiny()
    ids = torch.randint(0, 97, (3, 21), generator=torch.Generator().manual_seed(1))
    close(logits(model, "fagen", ids), logits(model, "sdpa", ids))
    (request, kernel), *_ = compiled
    assert request.source == Flash(True, (-1, -1), 0.0, None)
    assert kernel.calls == [("call", (3, 4, 21, 16), 0.25)] * 2, "two layers, [B, H, M, D], the model's scaling"


@pytest.mark.parametrize("B", [1, 2])
def test_packed_documents_match_sdpa_and_separate_runs(compiled, B):
    """position_ids restarting per document (one of length 1): varlen over cu_seqlens, one per document."""
    cfg, model = tiny()
    lengths = [7, 1, 12, 5]
    ids, pos = packed(lengths, B)
    got = logits(model, "fagen", ids, position_ids=pos, use_cache=False)
    close(got, logits(model, "sdpa", ids, position_ids=pos, use_cache=False))
    at, parts = 0, []
    for n in lengths:
        parts.append(logits(model, "sdpa", ids[:, at : at + n]))
        at += n
    close(got, torch.cat(parts, 1))
    kernel = compiled[0][1]
    assert [c[:2] for c in kernel.calls] == [("varlen", (B * 25, 4, 16))] * 2
    assert kernel.calls[0][3:] == (12, 12), "max_seqlen: the longest document"


def test_documents_come_from_the_mask_not_from_position_ids(compiled, monkeypatch):
    """Through a model, the layers read no position_ids (a synchronization in every forward): the documents are
    those transformers' mask found before the layers, which fagen's mask interface hands them; one document a
    row, or none looked for (a cache), is the plain kernel."""
    from transformers import DynamicCache

    def no_read(*args):
        raise AssertionError("the layers read position_ids")

    cfg, model = tiny()
    ids, pos = packed([7, 1, 12, 5], 2)
    want = logits(model, "sdpa", ids, position_ids=pos, use_cache=False)
    monkeypatch.setattr(hf, "_cu_seqlens_from_positions", no_read)
    close(logits(model, "fagen", ids, position_ids=pos, use_cache=False), want)
    assert [c[:2] for c in compiled[0][1].calls] == [("varlen", (2 * 25, 4, 16))] * 2
    close(logits(model, "fagen", ids, use_cache=False), logits(model, "sdpa", ids, use_cache=False))
    assert compiled[0][1].calls[2:] == [("call", (2, 4, 25, 16), 0.25)] * 2, "position_ids None: one document"
    # a cache: transformers' mask looks for no documents (sdpa attends across them), and neither does fagen
    out = {}
    for impl in ("sdpa", "fagen"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            out[impl] = model(ids, position_ids=pos, past_key_values=DynamicCache(config=cfg), use_cache=True).logits
    close(out["fagen"], out["sdpa"])
    with pytest.raises(ValueError, match=r"attention_mask: the mask's packed documents cover rows x tokens \(2, 25\)"):
        q = torch.randn(1, 4, 25, 16)
        hf.attention_forward(
            Module(), q, q[:, :2], q[:, :2], hf.Documents(torch.tensor([0, 25], dtype=torch.int32), 25, (2, 25))
        )


def test_training_step_gradients_match_sdpa(compiled):
    """A training step on packed documents: the loss's gradients for every weight, through fagen's varlen
    backward, equal sdpa's."""
    cfg, model = tiny()
    model.train()
    ids, pos = packed([7, 1, 12, 5])
    grads = {}
    for impl in ("sdpa", "fagen"):
        model.set_attn_implementation(impl)
        model.zero_grad()
        model(ids, position_ids=pos, labels=ids, use_cache=False).loss.backward()
        grads[impl] = {n: p.grad.clone() for n, p in model.named_parameters()}
    for name, want in grads["sdpa"].items():
        close(grads["fagen"][name], want)
    assert compiled[0][1].backward_calls == [False, False], "two layers' varlen backwards"


def test_cu_seq_lens_kwargs_are_used_as_given(compiled):
    cfg, model = tiny()
    ids, pos = packed([9, 3, 8])
    cu = torch.tensor([0, 9, 12, 20], dtype=torch.int32)
    kw = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=9, max_length_k=9)
    got = logits(model, "fagen", ids, position_ids=pos, use_cache=False, **kw)
    close(got, logits(model, "sdpa", ids, position_ids=pos, use_cache=False))
    whole = torch.tensor([0, 20], dtype=torch.int32)  # one document: differs (the test can fail)
    kw = dict(cu_seq_lens_q=whole, cu_seq_lens_k=whole, max_length_q=20, max_length_k=20)
    assert (logits(model, "fagen", ids, position_ids=pos, use_cache=False, **kw) - got).abs().max() > 1e-3


def test_prefill_and_decode_with_a_cache(compiled):
    """Keys outnumber queries after a prefill: causal aligned bottom-right."""
    from transformers import DynamicCache

    cfg, model = tiny()
    ids = torch.randint(0, 97, (2, 15), generator=torch.Generator().manual_seed(3))
    out = {}
    for impl in ("sdpa", "fagen"):
        model.set_attn_implementation(impl)
        cache = DynamicCache(config=cfg)
        with torch.no_grad():
            steps = [model(ids[:, :11], past_key_values=cache, use_cache=True).logits]
            steps += [model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits for t in range(11, 15)]
        out[impl] = torch.cat(steps, 1)
    close(out["fagen"], out["sdpa"])
    assert ("call", (2, 4, 1, 16), 0.25) in compiled[0][1].calls


def test_sliding_window_matches_sdpa(compiled):
    """Mistral's causal sliding window w: FlashAttention's window (w - 1, 0), transformers' j > i - w."""
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=6,
    )
    torch.manual_seed(0)
    model = MistralForCausalLM(cfg).eval()
    ids = torch.randint(0, 97, (2, 19), generator=torch.Generator().manual_seed(4))
    got = logits(model, "fagen", ids, use_cache=False)
    close(got, logits(model, "sdpa", ids, use_cache=False))
    assert compiled[0][0].source == Flash(True, (5, 0), 0.0, None)
    ids, pos = packed([8, 11])
    close(
        logits(model, "fagen", ids, position_ids=pos, use_cache=False),
        logits(model, "sdpa", ids, position_ids=pos, use_cache=False),
    )


# --- argument conversion ---------------------------------------------------------------------------------------
class Spy:
    """Records what the double's kernel receives."""

    def __init__(self, monkeypatch):
        self.seen = []
        call, varlen = DoubleKernel.__call__, DoubleKernel.varlen

        def spy_call(kernel, q, k, v, **kw):
            self.seen.append(("call", q, k, v, kw))
            return call(kernel, q, k, v, **kw)

        def spy_varlen(kernel, q, k, v, cu_q, cu_k, max_q, max_k, **kw):
            self.seen.append(("varlen", q, k, v, (cu_q, cu_k, max_q, max_k), kw))
            return varlen(kernel, q, k, v, cu_q, cu_k, max_q, max_k, **kw)

        monkeypatch.setattr(DoubleKernel, "__call__", spy_call)
        monkeypatch.setattr(DoubleKernel, "varlen", spy_varlen)


class Module:
    is_causal = True


def bhnd(B, H, N, D, seed):
    """[B, H, N, D] as transformers makes it: a transposed view of [B, N, H, D]."""
    return torch.randn(B, N, H, D, generator=torch.Generator().manual_seed(seed)).transpose(1, 2)


def test_layouts_scaling_and_gqa_without_copies(compiled, monkeypatch):
    spy = Spy(monkeypatch)
    q, k, v = bhnd(2, 8, 9, 16, 0), bhnd(2, 2, 9, 16, 1), bhnd(2, 2, 9, 16, 2)
    o, weights = hf.attention_forward(Module(), q, k, v, None, scaling=0.3, softcap=7.0)
    assert weights is None and o.shape == (2, 9, 8, 16), "transformers' [B, M, H, D]"
    _, kq, kk, kv, kw = spy.seen[0]
    assert kq.shape == (2, 8, 9, 16) and kk.shape == (2, 2, 9, 16), "GQA: 2 KV heads reach the kernel"
    assert (kq.data_ptr(), kk.data_ptr(), kv.data_ptr()) == (q.data_ptr(), k.data_ptr(), v.data_ptr()), "no copies"
    assert kw["scale"] == 0.3 and compiled[0][0].source == Flash(True, (-1, -1), 7.0, None)
    ref = DoubleKernel(causal=True, softcap=7.0)(q.double(), k.double(), v.double(), scale=0.3)
    torch.testing.assert_close(o.double(), ref.transpose(1, 2), atol=1e-6, rtol=0)
    hf.attention_forward(Module(), q, k, v, None, is_causal=False)
    assert compiled[1][0].source.causal is False, "is_causal=False from the model wins over the module's"


def test_packed_arguments_are_views(compiled, monkeypatch):
    spy = Spy(monkeypatch)
    q, k, v = bhnd(1, 4, 10, 16, 0), bhnd(1, 2, 10, 16, 1), bhnd(1, 2, 10, 16, 2)
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1, 2, 3]])
    o, _ = hf.attention_forward(Module(), q, k, v, None, position_ids=pos)
    _, pq, pk, pv, (cu_q, cu_k, max_q, max_k), _ = spy.seen[0]
    assert pq.shape == (10, 4, 16) and pk.shape == (10, 2, 16) and pq.data_ptr() == q.data_ptr()
    assert cu_q.tolist() == [0, 3, 5, 6, 10] and cu_q.dtype == torch.int32 and (max_q, max_k) == (4, 4)
    assert o.shape == (1, 10, 4, 16)


def test_cu_seqlens_from_position_ids():
    cu = hf._cu_seqlens_from_positions
    assert cu(torch.arange(6)[None], 1, 6) is None, "one document"
    assert cu(torch.arange(6)[None] + 3, 2, 6) is None, "each row one document (a continuation)"
    got, longest = cu(torch.tensor([[0, 1, 0, 1, 2, 0], [5, 6, 0, 0, 1, 2]]), 2, 6)
    assert got.tolist() == [0, 2, 5, 6, 8, 9, 12] and longest == 3
    pos = torch.tensor([[0, 0, 0]])
    first = cu(pos, 1, 3)
    assert first[0].tolist() == [0, 1, 2, 3] and cu(pos, 1, 3) is first, "kept for the tensor the layers share"
    pos[0, 1] = 1  # changed in place: found afresh
    assert cu(pos, 1, 3)[0].tolist() == [0, 2, 3]
    with pytest.raises(ValueError, match=r"position_ids: expected shape \[2, 3\] \(or \[1, 3\]\)"):
        cu(torch.zeros(3, 2, 3, dtype=torch.long), 2, 3)


# --- what is refused ---------------------------------------------------------------------------------------------
def test_refused(compiled):
    cfg, model = tiny()
    ids = torch.randint(0, 97, (2, 8), generator=torch.Generator().manual_seed(5))
    model.set_attn_implementation("fagen")
    padding = torch.ones(2, 8, dtype=torch.long)
    padding[1, :3] = 0
    with pytest.raises(NotImplementedError, match=r"attention_mask: a padding mask \(shape \[2, 8\]"):
        model(ids, attention_mask=padding)
    close(model(ids, attention_mask=torch.ones(2, 8, dtype=torch.long)).logits, logits(model, "sdpa", ids))
    model.set_attn_implementation("fagen")
    with pytest.raises(NotImplementedError, match="attention_mask: a 4-D mask"):
        model(ids, attention_mask=torch.ones(2, 1, 8, 8, dtype=torch.bool))
    q = k = v = bhnd(1, 2, 5, 16, 0)
    with pytest.raises(NotImplementedError, match="dropout: fagen has no attention dropout"):
        hf.attention_forward(Module(), q, k, v, None, dropout=0.1)
    with pytest.raises(NotImplementedError, match="sliding_window: a non-causal sliding window"):
        hf.attention_forward(Module(), q, k, v, None, sliding_window=2, is_causal=False)
    with pytest.raises(NotImplementedError, match=r"s_aux: attention sinks"):
        hf.attention_forward(Module(), q, k, v, None, s_aux=torch.zeros(2))
    hf.attention_forward(Module(), q, k, v, None, sliding_window=9)  # a window wider than the keys: none
    assert [request.source.window for request, _ in compiled] == [(-1, -1)], "one kernel, with no window"


def test_mask_functions_fagen_cannot_express_are_refused(compiled, monkeypatch):
    cfg, _ = tiny()
    cfg._attn_implementation = "fagen"
    x = torch.zeros(1, 6, 64)
    pos = torch.tensor([[0, 1, 2, 0, 1, 2]])
    docs = create_causal_mask(cfg, x, None, None, position_ids=pos)
    assert isinstance(docs, hf.Documents), "causal + documents: no tensor, the documents"
    assert docs.cu_seqlens.tolist() == [0, 3, 6] and docs.longest == 3 and docs.shape == (1, 6)

    def image_tokens(b, h, q_idx, kv_idx):
        return q_idx < 2

    with pytest.raises(NotImplementedError, match=r"mask_function: .* uses .*image_tokens"):
        create_causal_mask(cfg, x, None, None, or_mask_function=image_tokens)
    parts = hf.mask_parts(transformers.masking_utils.sliding_window_causal_mask_function(4))
    assert "transformers.masking_utils.sliding_window_overlay.<locals>.inner_mask" in parts
    hf.check_mask_function(transformers.masking_utils.sliding_window_causal_mask_function(4))
    with pytest.raises(NotImplementedError, match="sliding_window_bidirectional_overlay"):
        hf.check_mask_function(transformers.masking_utils.sliding_window_bidirectional_mask_function(4))
    ids = torch.tensor([[0, 0, 1]])
    assert hf.packed_sequence_ids(transformers.masking_utils.packed_sequence_mask_function(ids)) is ids
    with monkeypatch.context() as m:
        m.setattr(hf, "packed_sequence_ids", lambda fn: None)  # a transformers keeping them elsewhere
        assert create_causal_mask(cfg, x, None, None, position_ids=pos) is None, "the layers read position_ids"
    one = hf.attention_mask(1, 4, 4, attention_mask=torch.ones(1, 4, dtype=torch.bool))
    assert isinstance(one, hf.Documents) and one.cu_seqlens is None, "no padding, no documents"
    mask = torch.tensor([[False, True, True, True]])
    assert hf.attention_mask(1, 4, 4, attention_mask=mask) is not None, "padding is passed on, to be refused"


# --- fagen bench --model's pieces (the timing itself needs a GPU) -----------------------------------------------
def test_bench_model_inputs_and_table():
    from fagen.tools.bench import model as bench_model
    from fagen.tools.cli import parser

    lengths = bench_model.documents(4096, seed=3)
    assert sum(lengths) == 4096 and 1 in lengths and len(lengths) > 3
    ids, pos = bench_model.packed_inputs([3, 1, 2], 50, device="cpu")
    assert ids.shape == (1, 6) and pos.tolist() == [[0, 1, 2, 0, 0, 1]]
    cfg = bench_model.config(layers=3)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size) == (32, 8, 128, 4096)
    rows = [
        dict(input="packed", implementation="sdpa", ms=8.0, rounds_ms=[8.0, 9.0, 7.0], err=0.5, status="ok"),
        dict(input="packed", implementation="fagen", ms=4.0, rounds_ms=[4.0, 3.0, 5.0], err=0.5, status="ok"),
        dict(input="packed", implementation="flex_attention", ms=None, err=None, status="RuntimeError: no"),
    ]
    text = bench_model.table(rows)
    assert "| packed | fagen | 4.00 | 2.00x | 1.40–3.00x | 0.5 | ok |" in text, text
    assert "| packed | flex_attention | - | - | - | - |" in text
    args = parser().parse_args(["bench", "--model", "--layers", "3", "--seqlen", "2048"])
    assert args.model and args.layers == 3 and args.seqlen == (2048,)
