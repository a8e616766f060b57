"""The case tables of `fagen bench`: which shapes, variants and backends a run times. Pure Python (no torch).

The dense cases follow FlashAttention's convention (../shared/BENCH.md): batch × seqlen = 16k tokens, heads × head
dim = 2048, FLOPs = 4·B·H·N²·D, halved when causal. Two training shapes keep their own: packed documents (varlen,
7 documents of 256–4096 tokens, 16k in all, d128 causal, 16 heads) and GQA 32/8 (d128 causal 8k, batch 2).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

BACKENDS = ("fagen", "fa4", "cudnn", "flash", "flex")  # the strongest peers first (BENCH.md)
BACKEND_LABEL = {
    "fagen": "fagen",
    "fa4": "FlashAttention-4",
    "flash": "SDPA flash (FA2)",
    "cudnn": "SDPA cuDNN",
    "flex": "FlexAttention",
    "fagen_det": "fagen deterministic",
}
DETERMINISTIC = "fagen_det"  # `--backward --deterministic`: fagen's backward with deterministic=True, a column
COLUMNS = (*BACKENDS, DETERMINISTIC)  # the tables' columns, in order
MODEL_BACKENDS = ("sdpa", "fagen", "flex_attention")  # `--model`: transformers' attention implementations

DEFAULT_DIMS = (64, 128, 256)
DEFAULT_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
DECODE_SEQLENS = (8192, 32768, 131072)
MODEL_TOKENS = 4096  # `--model`: the forward's tokens
MODEL_TRAIN_TOKENS = 16384  # `--model`: the training step's tokens (one row)
TOKENS, HIDDEN = 16384, 2048  # batch × seqlen and heads × head dim of the dense cases

RELATIVE_OFFSET = 16384  # rel[h, q - k + 16384]: a table of 2 * 16384 + 1 entries a head, every N up to 16k


def _relative(s, b, h, q, k, rel):
    """A relative-position bias table, as FlexAttention's users write it: score + rel[h, q_idx - kv_idx + offset]."""
    return s + rel[h, q - k + RELATIVE_OFFSET]


# The variants: fagen.compile's options for each (SDPA has no fast path for those past "none").
VARIANTS: dict[str, dict] = {
    "none": dict(),
    "softcap": dict(softcap=30),
    "alibi": dict(alibi=True),
    "window": dict(window=256),
    "prefix": dict(prefix=1024),  # prefix-LM: the first 1024 keys seen by every query, causal after them
    "relative": dict(score_mod=_relative),
}
# these are benchmarked causal, as BENCH.md's table; prefix-LM is its own mask (no causal flag on top)
VARIANT_CAUSAL = {"window": (True,), "alibi": (True,), "prefix": (False,), "relative": (True,)}

# The training shapes, each a fixed case of the plain program.
WORKLOADS = ("packed", "gqa")
WORKLOAD_HELP = {
    "packed": "packed documents (varlen, 7 documents of 256-4096 tokens, 16k, d128 causal, 16 heads)",
    "gqa": "GQA 32/8 (d128 causal 8k, batch 2)",
}
VARIANT_NAMES = (*VARIANTS, *WORKLOADS)
# the document benchmark's masks (fagen.tools.bench.document): q // size == k // size, or written from offsets as
# FlexAttention users write them, offsets[doc[q]] <= k (a gather of a gather)
DOCUMENT_VARIANTS = ("document", "document_offsets")
DOCUMENT_FORMS = {"document": "divide", "document_offsets": "offsets"}  # document.document_mask's forms
DEFAULT_VARIANTS = ("none", *WORKLOADS)

# The variants each backend computes, forward and backward (fagen and Flex: all of them).
SUPPORTS = {
    "fa4": {"forward": {"none", "softcap", "window", *WORKLOADS}, "backward": {"none", "window", *WORKLOADS}},
    "flash": {"forward": {"none", "gqa"}, "backward": {"none", "gqa"}},
    "cudnn": {"forward": {"none", "gqa"}, "backward": {"none", "gqa"}},
}


@dataclass(frozen=True)
class Case:
    """One timed shape: `seqlen` keys (and queries) a sequence; packed: the total tokens, in `documents`."""

    variant: str
    dtype: str
    dim: int
    causal: bool
    seqlen: int
    batch: int
    heads: int
    kv_heads: int
    documents: tuple[int, ...] = ()
    align: str = "top_left"  # the causal mask's alignment (square shapes: either gives the same mask)

    @property
    def flops(self) -> float:
        """The forward's FLOPs: 4·B·H·N²·D a sequence (each document's own N), halved when causal; under the causal
        window of `left` keys, 4·H·D for each (query, key) pair it keeps: (left + 1)·N - left·(left + 1)/2 of them."""
        lengths = self.documents or (self.seqlen,) * self.batch
        if self.variant == "window":
            left = VARIANTS["window"]["window"]
            pairs = sum((left + 1) * n - left * (left + 1) / 2 if n > left else n * (n + 1) / 2 for n in lengths)
            return 4.0 * self.heads * self.dim * pairs
        f = sum(4.0 * self.heads * n * n * self.dim for n in lengths)
        return f / 2 if self.causal else f

    @property
    def compile_options(self) -> dict:
        """fagen.compile's keyword options for this case's kernel (the dtype and tier aside)."""
        return dict(causal=self.align if self.causal else False, **VARIANTS.get(self.variant, {}))

    @property
    def label(self) -> str:
        """The case in words, as the results table names it."""
        mask = "causal" if self.causal else "non-causal"
        if self.variant == "packed":
            return f"packed documents ({len(self.documents)}, {_k(self.seqlen)} tokens), d{self.dim} {mask}"
        if self.variant == "gqa":
            heads = f"{self.heads}/{self.kv_heads}"
            return f"GQA {heads}, d{self.dim} {mask} {_k(self.seqlen)} (batch {self.batch})"
        what = "" if self.variant == "none" else f"{self.variant}, "
        return f"{what}d{self.dim} {mask} {_k(self.seqlen)}"


def _k(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def packed_document_lengths(total=TOKENS, count=7, low=256, high=4096, seed=0) -> tuple[int, ...]:
    """`count` document lengths in [low, high] summing to `total`, drawn from `seed` (the same every run)."""
    if not count * low <= total <= count * high:
        raise ValueError(f"no {count} lengths in [{low}, {high}] sum to {total}")
    rng = random.Random(seed)
    while True:
        lengths = [rng.randint(low, high) for _ in range(count - 1)]
        last = total - sum(lengths)
        if low <= last <= high:
            return (*lengths, last)


def cu_seqlens(lengths: tuple[int, ...]) -> list[int]:
    """FlashAttention's offsets of packed sequences: 0, then each running total."""
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def _dense(variant: str, dtype: str, dim: int, causal: str | bool, seqlen: int) -> Case:
    batch, heads = max(1, TOKENS // seqlen), max(1, HIDDEN // dim)
    align = causal if isinstance(causal, str) else "top_left"
    return Case(variant, dtype, dim, bool(causal), seqlen, batch, heads, heads, align=align)


def _workload(name: str, dtype: str, align: str) -> Case:
    if name == "packed":
        docs = packed_document_lengths()
        return Case("packed", dtype, 128, True, sum(docs), 1, 16, 16, documents=docs, align=align)
    return Case("gqa", dtype, 128, True, 8192, 2, 32, 8, align=align)


def cases(
    *,
    dims=DEFAULT_DIMS,
    seqlens=DEFAULT_SEQLENS,
    causal: tuple[str | bool, ...] = (False, "top_left"),
    dtypes=("bf16",),
    variants=("none",),
) -> list[Case]:
    """The cases of a forward or backward run, in order: each variant, dtype, head dim, mask and length that the
    selection admits. A variant benchmarked with one mask alone (VARIANT_CAUSAL) runs where the selection holds that
    mask; packed and gqa (d128, causal, their own lengths) run where the selection holds d128 and causal."""
    out = []
    for var in variants:
        for dt in dtypes:
            if var in WORKLOADS:
                aligned = [c for c in causal if c]
                if 128 in dims and aligned:
                    out.append(_workload(var, dt, str(aligned[0])))
                continue
            masks = [c for c in causal if bool(c) in VARIANT_CAUSAL.get(var, (False, True))]
            out += [_dense(var, dt, d, c, n) for d in dims for c in masks for n in seqlens]
    return out


@dataclass
class Row:
    """One backend's figures on one case."""

    backend: str
    dtype: str
    dim: int
    causal: bool
    seqlen: int
    batch: int
    heads: int
    ms: float = math.nan
    tflops: float = math.nan
    status: str = "ok"  # ok | failed check: ... | unavailable: ...
    variant: str = "none"
    err: float = math.nan
    bound: float = math.nan
    extra: dict = field(default_factory=dict)
    label: str = ""

    @classmethod
    def of(cls, case: Case, backend: str) -> Row:
        c = case
        return cls(backend, c.dtype, c.dim, c.causal, c.seqlen, c.batch, c.heads, variant=c.variant, label=c.label)


def backend_plan(backends, variant: str, *, backward: bool, missing: dict[str, str]) -> list[tuple[str, str | None]]:
    """(backend, None) for each of `backends` that runs `variant`, (backend, why not) for the others: a peer
    without such a path, or one `missing` here ({name: reason}, e.g. FlashAttention-4 not installed)."""
    out: list[tuple[str, str | None]] = []
    for be in backends:
        if be not in COLUMNS:
            raise ValueError(f"--backends: unknown {be!r} (expected some of {', '.join(BACKENDS)})")
        supported = SUPPORTS.get(be, {}).get("backward" if backward else "forward")
        if be in missing:
            out.append((be, f"unavailable: {missing[be]}"))
        elif supported is not None and variant not in supported:
            direction = "backward" if backward else "forward"
            out.append((be, f"unavailable: {BACKEND_LABEL[be]} has no {direction} for {variant}"))
        else:
            out.append((be, None))
    return out


def fa4_options(case: Case) -> dict:
    """FlashAttention-4's keyword options for a case (its window_size: (left, right), None unbounded)."""
    opts: dict = dict(causal=case.causal)
    if case.variant == "window":
        left = VARIANTS["window"]["window"]
        opts["window_size"] = (left, 0 if case.causal else left)  # fagen's window=LEFT: RIGHT 0 causal, else LEFT
    if case.variant == "softcap":
        opts["softcap"] = float(VARIANTS["softcap"]["softcap"])
    return opts


def mode(args) -> str:
    """Which benchmark a `fagen bench` command line runs: context_parallel, decode, model, document, backward or
    forward."""
    if getattr(args, "context_parallel", False):
        return "context_parallel"
    if args.decode:
        return "decode"
    if args.model:
        return "model"
    if set(DOCUMENT_VARIANTS) & set(args.variant):
        if not set(args.variant) <= set(DOCUMENT_VARIANTS):
            raise ValueError("--variant: document runs alone (its own benchmark); drop the others")
        return "document"
    return "backward" if args.backward else "forward"


def selection(args) -> tuple[str, list[Case]]:
    """What a `fagen bench` command line runs, a pure function of its options: its mode, and for a forward or
    backward run its cases (an error for options that select nothing or contradict each other)."""
    which = mode(args)
    if args.deterministic and which != "backward":
        raise ValueError("--deterministic: only with --backward (fagen's backward timed both ways), without --model")
    if which == "model":
        bad = [b for b in args.backends or () if b not in MODEL_BACKENDS]
        if bad:
            expected = ", ".join(MODEL_BACKENDS)
            raise ValueError(f"--backends: unknown {', '.join(bad)} with --model (expected some of {expected})")
        if args.seqlen and len(args.seqlen) > 1:
            raise ValueError(f"--seqlen: --model takes one length (its tokens), got {','.join(map(str, args.seqlen))}")
    return which, from_args(args) if which in ("forward", "backward") else []


def backend_columns(args) -> tuple[str, ...]:
    """The backends a forward or backward run times: --backends (default all), and with --deterministic the column
    of fagen's backward with deterministic=True."""
    return (*(args.backends or BACKENDS), *((DETERMINISTIC,) if args.deterministic else ()))


def from_args(args) -> list[Case]:
    """The cases of a forward or backward `fagen bench` command line."""
    from ..options import causal_cases

    backends = args.backends or BACKENDS
    bad = [b for b in backends if b not in BACKENDS]
    if bad:
        raise ValueError(f"--backends: unknown {', '.join(bad)} (expected some of {', '.join(BACKENDS)})")
    selected = cases(
        dims=args.dim,
        seqlens=args.seqlen or DEFAULT_SEQLENS,
        causal=causal_cases(args.causal),
        dtypes=args.dtype,
        variants=args.variant,
    )
    if not selected:
        raise ValueError("no case: the --variant, --dim and --causal/--no-causal given select none")
    return selected
