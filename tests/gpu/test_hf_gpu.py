"""fagen inside a real model: a Llama-style LlamaForCausalLM (transformers, random weights, no download), 2
layers, 32 query heads / 8 KV heads, head dim 128, bf16, with attn_implementation="fagen" (fagen.hf), against
the same model in float64 with transformers' "sdpa" implementation and its own document mask.

Two checks, both FlashAttention's rule (error <= 2x the error of the same computation in bf16 + a floor):
- in every layer, fagen's attention output on the layer's own bf16 q, k, v against float64 attention with the
  block-diagonal causal mask of the documents (the naive bf16 computation sets the bound);
- the logits of the bf16 model with "fagen" against the float64 model, the bf16 model with "sdpa" setting the
  bound. The model's other bf16 matmuls dominate this error, so a control with the wrong mask (the packed row
  taken as one document) must fail the bound: the check can fail."""

import copy

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
FLOOR = 1e-2  # absolute, on logits of magnitude ~1-10 (bf16's epsilon is 2^-8)


@pytest.fixture(scope="module")
def models():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import fagen.hf
    from fagen.tools.bench import model as bench_model

    fagen.hf.register()
    cfg = bench_model.config(layers=2)
    base = bench_model.build_model(cfg, torch.float32, device="cpu")
    exact = copy.deepcopy(base).to(device=DEVICE, dtype=torch.float64)
    model = base.to(device=DEVICE, dtype=torch.bfloat16)
    yield cfg, model, exact
    del model, exact
    torch.cuda.empty_cache()


def _errors(got, want):
    return (got.double() - want).abs().max().item()


def _spy(records: list):
    """An attention implementation that runs fagen's and records each layer's inputs and output."""
    import fagen.hf

    def forward(module, query, key, value, attention_mask, **kwargs):
        out, weights = fagen.hf.attention_forward(module, query, key, value, attention_mask, **kwargs)
        records.append((query, key, value, kwargs.get("scaling"), out))
        return out, weights

    return forward


def _documents_keep(lengths):
    """The block-diagonal causal mask [M, M] of packed documents."""
    doc = np.repeat(np.arange(len(lengths)), lengths)
    i = np.arange(len(doc))
    return (doc[:, None] == doc[None, :]) & (i[:, None] >= i[None, :])


def test_packed_documents_match_sdpa(models):
    """4096 tokens packed from documents of random lengths (one of length 1), position_ids restarting per
    document: fagen runs varlen; sdpa builds the block-diagonal causal mask from the same position_ids."""
    import torch

    from fagen.tools.bench import model as bench_model

    cfg, model, exact = models
    lengths = bench_model.documents(4096, seed=1)
    assert 1 in lengths and len(lengths) > 3
    ids, pos = bench_model.packed_inputs(lengths, cfg.vocab_size, seed=1, device=DEVICE)
    # every layer's attention on its own inputs, against float64 with the documents' mask
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    import fagen.hf
    from fagen.tools import testing

    records = []
    AttentionInterface.register("fagen_spy", _spy(records))
    AttentionMaskInterface.register("fagen_spy", fagen.hf.attention_mask)
    bench_model.logits(model, "fagen_spy", ids, pos)
    keep = _documents_keep(lengths)
    assert len(records) == cfg.num_hidden_layers
    for layer, (q, k, v, scale, out) in enumerate(records):
        assert k.shape[1] == 8 and q.shape[1] == 32
        ref, _ = testing.reference(q, k, v, keep, scale)
        naive, _ = testing.reference(q, k, v, keep, scale, dtype=q.dtype)
        o = out.transpose(1, 2)
        err, err_naive = _errors(o, ref), _errors(naive, ref)
        bound = 2 * err_naive + testing.FLOOR["bf16"]
        assert torch.isfinite(o).all() and err <= bound, f"layer {layer}: {err:.3e} > 2 x {err_naive:.3e} + floor"
    # the logits
    want = bench_model.logits(exact, "sdpa", ids, pos)
    sdpa = bench_model.logits(model, "sdpa", ids, pos)
    got = bench_model.logits(model, "fagen", ids, pos)
    assert torch.isfinite(got).all()
    err, err_sdpa = _errors(got, want), _errors(sdpa, want)
    bound = 2 * err_sdpa + FLOOR
    assert err <= bound, f"fagen {err:.3e} > 2 x sdpa-bf16 {err_sdpa:.3e} + {FLOOR}"
    # the same documents given as FlashAttention's kwargs (cu_seq_lens) give the same logits
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=ids.device, dtype=torch.int32)
    longest = max(lengths)
    kw = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
    assert torch.equal(bench_model.logits(model, "fagen", ids, pos, **kw), got)
    # control: the row taken as one document (the wrong mask) is outside the bound
    whole = torch.tensor([0, ids.shape[1]], device=ids.device, dtype=torch.int32)
    kw = dict(cu_seq_lens_q=whole, cu_seq_lens_k=whole, max_length_q=ids.shape[1], max_length_k=ids.shape[1])
    wrong = _errors(bench_model.logits(model, "fagen", ids, pos, **kw), want)
    assert wrong > bound, f"the wrong mask's error {wrong:.3e} is within the bound {bound:.3e}: the test is blind"


def test_causal_batch_and_decode_with_a_cache_match_sdpa(models):
    """Two rows of 1000 tokens, causal (the dense path, GQA with no K/V copy); then a prefill into a
    DynamicCache and decode steps of one token, where the keys outnumber the queries (bottom-right causal)."""
    import torch
    from transformers import DynamicCache

    cfg, model, exact = models
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, cfg.vocab_size, (2, 1000), generator=g).to(DEVICE)
    want = {}
    for impl, m in (("exact", exact), ("sdpa", model), ("fagen", model)):
        m.set_attn_implementation("sdpa" if impl == "exact" else impl)
        with torch.no_grad():
            full = m(ids, use_cache=False).logits
            cache = DynamicCache(config=cfg)
            steps = [m(ids[:, :997], past_key_values=cache, use_cache=True).logits[:, -1]]
            for t in range(997, 1000):
                steps.append(m(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits[:, -1])
        want[impl] = (full, torch.stack(steps, 1))
    for part, name in ((0, "causal forward"), (1, "prefill + decode")):
        err, err_sdpa = (
            _errors(want["fagen"][part], want["exact"][part]),
            _errors(want["sdpa"][part], want["exact"][part]),
        )
        assert torch.isfinite(want["fagen"][part]).all()
        assert err <= 2 * err_sdpa + FLOOR, f"{name}: fagen {err:.3e} > 2 x sdpa-bf16 {err_sdpa:.3e} + {FLOOR}"
