"""`fagen bench --model`: a Llama-style model (Hugging Face transformers, random weights, no download) with each
attention implementation: "sdpa", "fagen" (fagen.hf) and "flex_attention" (transformers compiles FlexAttention)
where it runs. Two tables: its forward, and its training step.

The model: LlamaConfig with 32 query heads, 8 KV heads, head dim 128 (hidden 4096), bf16, a few layers; the
input: one row of tokens packed from documents of random lengths (one of length 1), position_ids restarting
per document (transformers' padding-free format), and the same tokens as one causal sequence.

The forward (4096 tokens): each implementation's logits are checked against the float32 SDPA model before it is
timed (the error is printed). Times: the whole forward (torch.no_grad, use_cache=False), timed by triton's do_bench
in ROUNDS interleaved rounds (every implementation once a round, so a drift of the machine's speed meets them all
alike); the table gives each implementation's median over the rounds and the range of its per-round ratio to sdpa.

The training step (16k tokens): forward with labels (the next token; packed: none across a document's end),
backward and torch.optim.AdamW's step, the bf16 weights updated in place (no float32 master copy), in model.train()
mode. Before any step, each implementation's first-step loss and the gradients of every layer's attention
projections are checked against the same weights in float32 with sdpa (REFERENCE: K/V heads repeated first, so
that float32 takes SDPA's memory-efficient kernel, where transformers' GQA call takes the math one, which
materializes every score: 32 GiB a layer at 16k tokens), FlashAttention's rule: the error within
twice bf16 sdpa's own plus a floor (LOSS_FLOOR, GRAD_FLOOR). Then TRAIN_ROUNDS rotated rounds of do_bench; the
table gives tokens/s and fagen ÷ each implementation (its time over fagen's). An implementation whose check
failed is still timed, its status saying so; one with a non-finite loss is not.
"""

from __future__ import annotations

import datetime
import math
import statistics
import sys
import time
from typing import Any

from .cases import MODEL_TOKENS, MODEL_TRAIN_TOKENS

IMPLEMENTATIONS = ("sdpa", "fagen", "flex_attention")
REFERENCE = "sdpa_float32"  # the float32 model's attention (register_reference)
ROUNDS = 5
TRAIN_ROUNDS = 3
LOSS_FLOOR = 1e-3  # absolute, on a first-step loss of about ln(vocab) = 8.3
GRAD_FLOOR = 1e-2  # on the attention projections' gradients, relative (L2)


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
    return LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()  # type: ignore[call-arg]  # (transformers' stubs)


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
    register_reference()
    _raise_recompile_limit(torch)
    bench = timer(torch)
    cfg = config(layers=layers)
    reference = build_model(cfg, torch.float32)
    model = build_model(cfg, torch.bfloat16)
    lengths = documents(tokens)
    ids, pos = packed_inputs(lengths, cfg.vocab_size)
    inputs = {f"packed ({len(lengths)} documents)": pos, "causal (one sequence)": None}
    rows = []
    for what, position_ids in inputs.items():
        ref = logits(reference, REFERENCE, ids, position_ids).float()
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


# --- the training step ------------------------------------------------------------------------------------------
def training_inputs(lengths: list[int], vocab: int, packed: bool, device: str = "cuda"):
    """(input_ids, position_ids, labels) of one row: the documents packed (position_ids restarting, no label
    across a document's end: -100 at each document's first token), or the same tokens as one causal sequence
    (position_ids None)."""
    ids, pos = packed_inputs(lengths, vocab, device=device)
    if not packed:
        return ids, None, ids
    return ids, pos, ids.masked_fill(pos == 0, -100)


def step_loss(model, ids, position_ids, labels):
    """One forward with labels and its backward: the loss, the gradients left in the parameters' .grad."""
    loss = model(ids, position_ids=position_ids, labels=labels, use_cache=False).loss
    loss.backward()
    return loss


def train_step(model, optimizer, ids, position_ids, labels):
    """One training step with the model's attention implementation: zeroed gradients, forward, backward, step."""
    optimizer.zero_grad(set_to_none=True)
    loss = step_loss(model, ids, position_ids, labels)
    optimizer.step()
    return loss


def first_step(model, implementation: str, inputs) -> tuple[float, Any]:
    """The loss of a first step of `model` with `implementation` and the gradients of every layer's attention
    projections (q, k, v, o: float32, one flat vector); no weight is updated, no gradient kept."""
    import torch

    model.zero_grad(set_to_none=True)
    model.set_attn_implementation(implementation)
    loss = step_loss(model, *inputs).item()
    grads = torch.cat([p.grad.float().flatten() for n, p in model.named_parameters() if ".self_attn." in n])
    model.zero_grad(set_to_none=True)
    return loss, grads


def register_reference() -> None:
    """REFERENCE: transformers' sdpa with the K/V heads repeated to the query heads first. transformers asks SDPA for
    GQA (enable_gqa) where there is no mask, and in float32 only the math kernel takes that; with the heads repeated
    the memory-efficient kernel runs (float32, causal or a mask), the same attention."""
    import types

    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def reference(module, query, key, value, attention_mask, **kwargs):
        groups = query.shape[1] // key.shape[1]
        plain = types.SimpleNamespace(is_causal=getattr(module, "is_causal", True), num_key_value_groups=1)
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        return sdpa_attention_forward(plain, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(REFERENCE, reference)
    AttentionMaskInterface.register(REFERENCE, sdpa_mask)


def _reason(e: Exception) -> str:
    """An exception as a table's status: its type and the first line of its message."""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"


def _errors(got: tuple[float, Any], want: tuple[float, Any]) -> tuple[float, float]:
    """(|loss - want's|, the gradients' relative L2 error)."""
    return abs(got[0] - want[0]), ((got[1] - want[1]).norm() / want[1].norm()).item()


def check_first_steps(model, implementations, inputs, log=sys.stderr) -> dict:
    """{implementation: row} with each one's first-step loss and errors against the float32 sdpa model of the same
    weights (module docstring), bf16 sdpa's errors setting the bounds; status 'ok', 'failed check: ...', 'non-finite
    ...' or why it did not run."""
    import copy

    exact = copy.deepcopy(model).float()
    reference = first_step(exact, REFERENCE, inputs)
    del exact
    sdpa = _errors(first_step(model, "sdpa", inputs), reference)
    bounds = (2 * sdpa[0] + LOSS_FLOOR, 2 * sdpa[1] + GRAD_FLOOR)
    rows = {}
    for impl in implementations:
        row = dict(implementation=impl, ms=None, rounds_ms=[], loss=None, errors=None, bounds=bounds, status="ok")
        try:
            got = first_step(model, impl, inputs)
            row["loss"], row["errors"] = got[0], _errors(got, reference)
            if not all(map(math.isfinite, row["errors"])):
                row["status"] = "non-finite loss or gradients"
            elif not all(e <= b for e, b in zip(row["errors"], bounds)):
                row["status"] = "failed check: loss or gradients past the bound"
        except Exception as e:  # reported, not fatal: the other implementations are still timed
            row["status"] = _reason(e)
        rows[impl] = row
        print({k: v for k, v in row.items() if k != "rounds_ms"}, file=log)
    return rows


def run_training(
    layers: int = 2,
    tokens: int = MODEL_TRAIN_TOKENS,
    implementations=IMPLEMENTATIONS,
    rounds: int = TRAIN_ROUNDS,
    *,
    cfg=None,
    device: str = "cuda",
    bench=None,
    log=sys.stderr,
) -> list[dict]:
    """Rows {input, implementation, tokens, ms, rounds_ms, loss, errors, bounds, status} of the training step on the
    packed and the causal input (module docstring); `cfg` (default config(layers)), `bench` (a function's ms;
    default triton's do_bench)."""
    import torch

    from ... import hf
    from .timing import timer

    hf.register()
    register_reference()
    _raise_recompile_limit(torch)
    cfg = cfg or config(layers=layers)
    bench = bench or timer(torch)
    model = build_model(cfg, torch.bfloat16, device=device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device == "cuda")
    lengths = documents(tokens)
    rows = []
    for packed in (True, False):
        inputs = training_inputs(lengths, cfg.vocab_size, packed, device)
        checked = list(check_first_steps(model, implementations, inputs, log).values())
        timed = [r for r in checked if r["status"] == "ok" or r["status"].startswith("failed check")]
        for r in range(rounds):  # round r starts at implementation r
            for i in range(len(timed)):
                row = timed[(r + i) % len(timed)]
                if row["status"].startswith("timing failed"):
                    continue
                model.set_attn_implementation(row["implementation"])
                try:
                    row["rounds_ms"].append(bench(lambda: train_step(model, optimizer, *inputs)))
                except Exception as e:  # (a peer out of memory, say) reported, not fatal: the others are timed on
                    row.update(rounds_ms=[], status=f"timing failed: {_reason(e)}")
                    optimizer.zero_grad(set_to_none=True)
                    if device == "cuda":
                        torch.cuda.empty_cache()
        what = f"packed ({len(lengths)} documents)" if packed else "causal (one sequence)"
        for row in checked:
            row.update(input=what, tokens=tokens, ms=statistics.median(row["rounds_ms"]) if row["rounds_ms"] else None)
        rows += checked
    return rows


def _raise_recompile_limit(torch) -> None:
    """transformers compiles FlexAttention once a shape and mode: past dynamo's limit it silently runs unfused."""
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 1024)
    torch._dynamo.config.accumulated_cache_size_limit = max(torch._dynamo.config.accumulated_cache_size_limit, 4096)


def train_table(rows: list[dict]) -> str:
    """The training step's table: per input and implementation, step time, tokens/s, fagen ÷ it, the check."""
    lines = [
        "| input | implementation | step ms | tokens/s | fagen ÷ this (speedup) | per round | first-step loss | "
        "loss err, grads err (bound) | status |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    fagen = {r["input"]: r for r in rows if r["implementation"] == "fagen" and r["ms"]}
    for r in rows:
        base = fagen.get(r["input"]) if r["ms"] else None
        ms = f"{r['ms']:.1f}" if r["ms"] else "-"
        speed = f"{r['tokens'] / (r['ms'] * 1e-3):,.0f}" if r["ms"] else "-"
        ratio = f"{r['ms'] / base['ms']:.2f}x" if base else "-"
        per = [a / b for a, b in zip(r["rounds_ms"], base["rounds_ms"])] if base else []
        spread = f"{min(per):.2f}–{max(per):.2f}x" if len(per) > 1 else "-"
        loss = f"{r['loss']:.4f}" if r["loss"] is not None else "-"
        check = "-"
        if r["errors"] is not None:
            (le, ge), (lb, gb) = r["errors"], r["bounds"]
            check = f"{le:.1e}, {ge:.1e} ({lb:.1e}, {gb:.1e})"
        lines.append(
            f"| {r['input']} | {r['implementation']} | {ms} | {speed} | {ratio} | {spread} | {loss} | {check} | "
            f"{r['status']} |"
        )
    return "\n".join(lines)


def check_line(rows: list[dict]) -> str:
    """The training check in one sentence: which implementations passed it on which input."""
    failed = [f"{r['implementation']} on {r['input']} ({r['status']})" for r in rows if r["status"] != "ok"]
    if not failed:
        return "Check: every implementation's first-step loss and attention gradients are within the bound."
    return "Check: not passed by " + "; ".join(failed) + "."


def forward_section(layers: int, tokens: int, implementations) -> list[str]:
    """The forward's table (run) under a line saying what it measured."""
    rows = run(layers=layers, tokens=tokens, implementations=implementations)
    return [
        "## Forward",
        "",
        f"{tokens} tokens in one row, torch.no_grad, use_cache=False. Forward ms: the median of {ROUNDS} interleaved "
        "rounds; ÷ sdpa: sdpa's ms over this one's (per round: the range of that ratio).",
        "",
        table(rows),
        "",
    ]


def training_section(layers: int, tokens: int, implementations) -> list[str]:
    """The training step's table (run_training) between a line saying what it measured and its check."""
    rows = run_training(layers=layers, tokens=tokens, implementations=implementations)
    return [
        "## Training step",
        "",
        f"{tokens} tokens in one row, model.train(): forward with labels, backward, AdamW's step (bf16 weights, "
        f"updated in place). Step ms: the median of {TRAIN_ROUNDS} rotated rounds of do_bench; tokens/s: the tokens "
        "over it; fagen ÷ this: this one's ms over fagen's (per round: the range of that ratio). Check, before any "
        "step: the loss and the attention projections' gradients (relative L2) against the same weights in float32 "
        f"with sdpa; bound: twice bf16 sdpa's error plus {LOSS_FLOOR:g} (loss) and {GRAD_FLOOR:g} (gradients).",
        "",
        train_table(rows),
        "",
        check_line(rows),
        "",
    ]


def main(args) -> int:
    """`fagen bench --model`: the tables of each implementation's forward (not with --backward) and training step,
    on the packed and the causal input; printed, and written to model.md in --out."""
    import torch
    import transformers

    import fagen

    t0 = time.perf_counter()
    implementations = args.backends or IMPLEMENTATIONS  # checked by cases.selection
    tokens = args.seqlen[0] if args.seqlen else None
    what = "training step" if args.backward else "forward and training step"
    title = (
        f"fagen {fagen.__version__} model {what} on {torch.cuda.get_device_name()}, "
        f"{datetime.date.today().isoformat()}, torch {torch.__version__}, transformers {transformers.__version__}"
    )
    text = [
        f"# {title}",
        "",
        f"LlamaForCausalLM, random weights: {args.layers} layers, 32 query heads / 8 KV heads, head dim 128, bf16.",
        "",
    ]
    if not args.backward:
        text += forward_section(args.layers, tokens or MODEL_TOKENS, implementations)
    text += training_section(args.layers, tokens or MODEL_TRAIN_TOKENS, implementations)
    text += [f"Wall time {time.perf_counter() - t0:.0f} s."]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "model.md").write_text("\n".join(text) + "\n")
    print("\n".join(text))
    return 0
