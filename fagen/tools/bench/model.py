"""`fagen bench --model`: a forward pass of a Llama-style model (Hugging Face transformers, random weights, no
download) with each attention implementation: "sdpa", "fagen" (fagen.hf) and "flex_attention" where it runs.

The model: LlamaConfig with 32 query heads, 8 KV heads, head dim 128 (hidden 4096), bf16, a few layers; the
input: one row of 4096 tokens packed from documents of random lengths (one of length 1), position_ids restarting
per document (transformers' padding-free format), and the same tokens as one causal sequence. Each
implementation's logits are checked against the float32 SDPA model before it is timed (the error is printed).
Times: the whole forward (torch.no_grad, use_cache=False), timed by triton's do_bench in ROUNDS interleaved
rounds (every implementation once a round, so a drift of the machine's speed meets them all alike); the table
gives each implementation's median over the rounds and the range of its per-round ratio to sdpa.
"""

from __future__ import annotations

import datetime
import statistics
import sys
import time

IMPLEMENTATIONS = ("sdpa", "fagen", "flex_attention")
ROUNDS = 5


def config(layers: int = 2, heads: int = 32, kv_heads: int = 8, head_dim: int = 128, vocab: int = 4096):
    """A Llama-style config (hidden = heads x head_dim, SwiGLU MLP of 2x hidden)."""
    from transformers import LlamaConfig

    hidden = heads * head_dim
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=16384,
        attention_dropout=0.0,
    )


def build_model(cfg, dtype, seed: int = 0, device: str = "cuda"):
    """LlamaForCausalLM(cfg) with transformers' random initialization from `seed` (the same weights for every
    dtype), in eval mode."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def documents(tokens: int, seed: int = 0, mean: int = 600) -> list[int]:
    """Random document lengths summing to `tokens`, one of them of length 1."""
    import random

    rng = random.Random(seed)
    lengths, left = [1], tokens - 1
    while left > 0:
        n = min(left, rng.randint(1, 2 * mean))
        lengths.append(n)
        left -= n
    rng.shuffle(lengths)
    return lengths


def packed_inputs(lengths: list[int], vocab: int, seed: int = 0, device: str = "cuda"):
    """input_ids [1, total] and position_ids [1, total] restarting at 0 for each document."""
    import torch

    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    ids = torch.randint(0, vocab, (1, total), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    return ids.to(device), pos.to(device)


def logits(model, implementation: str, ids, position_ids=None, **kwargs):
    import torch

    model.set_attn_implementation(implementation)
    with torch.no_grad():
        return model(ids, position_ids=position_ids, use_cache=False, **kwargs).logits


def run(
    layers: int = 2, tokens: int = 4096, implementations=IMPLEMENTATIONS, rounds: int = ROUNDS, log=sys.stderr
) -> list[dict]:
    """Rows {input, implementation, ms, rounds_ms, err, status} for the packed and the causal input."""
    import torch

    from ... import hf
    from .timing import timer

    hf.register()
    bench = timer(torch)
    cfg = config(layers=layers)
    reference = build_model(cfg, torch.float32)
    model = build_model(cfg, torch.bfloat16)
    lengths = documents(tokens)
    ids, pos = packed_inputs(lengths, cfg.vocab_size)
    inputs = {f"packed ({len(lengths)} documents)": pos, "causal (one sequence)": None}
    rows = []
    for what, position_ids in inputs.items():
        ref = logits(reference, "sdpa", ids, position_ids).float()
        timed = []
        for impl in implementations:
            row = dict(input=what, implementation=impl, ms=None, rounds_ms=[], err=None, status="ok")
            try:
                out = logits(model, impl, ids, position_ids).float()
                row["err"] = (out - ref).abs().max().item()
                if not torch.isfinite(out).all():
                    row["status"] = "non-finite logits"
                else:
                    timed.append(row)
            except Exception as e:  # reported, not fatal: the other implementations are still timed
                row["status"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
            rows.append(row)
        for _ in range(rounds):
            for row in timed:
                impl = row["implementation"]
                row["rounds_ms"].append(bench(lambda: logits(model, impl, ids, position_ids)))
        for row in timed:
            row["ms"] = statistics.median(row["rounds_ms"])
        for row in rows[-len(implementations) :]:
            print(row, file=log)
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| input | implementation | forward ms | ÷ sdpa (speedup) | per round | max abs err vs f32 sdpa | status |",
        "|---|---|---|---|---|---|---|",
    ]
    sdpa = {r["input"]: r for r in rows if r["implementation"] == "sdpa" and r["ms"]}
    for r in rows:
        ms = f"{r['ms']:.2f}" if r["ms"] else "-"
        base = sdpa.get(r["input"])
        ratio = f"{base['ms'] / r['ms']:.2f}x" if r["ms"] and base else "-"
        per = [a / b for a, b in zip(base["rounds_ms"], r.get("rounds_ms", ()))] if r["ms"] and base else []
        spread = f"{min(per):.2f}–{max(per):.2f}x" if len(per) > 1 else "-"
        err = f"{r['err']:.3g}" if r["err"] is not None else "-"
        lines.append(f"| {r['input']} | {r['implementation']} | {ms} | {ratio} | {spread} | {err} | {r['status']} |")
    return "\n".join(lines)


def main(args) -> int:
    """`fagen bench --model`: the table of each implementation's forward on the packed and the causal input."""
    import torch
    import transformers

    import fagen

    t0 = time.perf_counter()
    implementations = args.backends or IMPLEMENTATIONS  # checked by cases.selection
    tokens = args.seqlen[0] if args.seqlen else 4096
    rows = run(layers=args.layers, tokens=tokens, implementations=implementations)
    title = (
        f"fagen {fagen.__version__} model forward on {torch.cuda.get_device_name()}, "
        f"{datetime.date.today().isoformat()}, torch {torch.__version__}, transformers {transformers.__version__}"
    )
    text = [
        f"# {title}",
        "",
        f"LlamaForCausalLM, random weights: {args.layers} layers, 32 query heads / 8 KV heads, head dim 128, "
        f"bf16, {tokens} tokens in one row, torch.no_grad, use_cache=False. Forward ms: the median of {ROUNDS} "
        "interleaved rounds; ÷ sdpa: sdpa's ms over this one's (per round: the range of that ratio).",
        "",
        table(rows),
        "",
        f"Wall time {time.perf_counter() - t0:.0f} s.",
    ]
    print("\n".join(text))
    return 0
