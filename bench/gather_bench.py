"""Gathered tensors on a GPU: a document mask read from a captured int32 tensor (and a relative-position bias table)
under fagen.flex_attention against compiled FlexAttention with the same functions and a block mask, in one process.

    PYTHONPATH=. python3 bench/gather_bench.py [--seqlen 4096]

Prints a table: ms per call (median of triton's do_bench) and fagen / FlexAttention speed ratio. Both skip the
tiles outside the documents through their block masks (fagen.create_block_mask builds fagen's on the GPU,
gathering doc_id); the relative-position bias runs on the proven causal key ranges."""

import argparse
import datetime

import numpy as np
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from triton.testing import do_bench

import fagen

p = argparse.ArgumentParser()
p.add_argument("--seqlen", type=int, default=4096)
a = p.parse_args()
B, H, N, D = 2, 16, a.seqlen, 128
rng = np.random.default_rng(0)
lens = rng.integers(64, 1024, size=64)
doc_id = torch.tensor(np.repeat(np.arange(len(lens)), lens)[:N], dtype=torch.int32, device="cuda")
rel = torch.randn(H, 2 * N + 1, device="cuda") * 0.1


def document(b, h, q_idx, kv_idx):
    return (doc_id[q_idx] == doc_id[kv_idx]) & (q_idx >= kv_idx)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def relative(score, b, h, q_idx, kv_idx):
    return score + rel[h, q_idx - kv_idx + N]


q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
flex = torch.compile(flex_attention, dynamic=False)
rows = []
for name, mask_mod, score_mod in (("document", document, None), ("relative+causal", causal, relative)):
    bm_t = create_block_mask(mask_mod, None, None, N, N)
    bm_f = fagen.create_block_mask(mask_mod, None, None, N, N)
    o_f = fagen.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm_f)
    o_t = flex(q, k, v, score_mod=score_mod, block_mask=bm_t)
    err = float((o_f.float() - o_t.float()).abs().max())
    t_f = do_bench(lambda: fagen.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm_f), rep=200)
    t_t = do_bench(lambda: flex(q, k, v, score_mod=score_mod, block_mask=bm_t), rep=200)
    rows.append((name, t_f, t_t, err))
device = f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {datetime.date.today()}"
print(f"{device}, B={B} H={H} N={N} D={D} bf16")
print(f"{'variant':18} {'fagen ms':>9} {'flex ms':>9} {'fagen/flex speed':>17} {'max|diff|':>10}")
for name, t_f, t_t, err in rows:
    print(f"{name:18} {t_f:9.3f} {t_t:9.3f} {t_t / t_f:17.2f} {err:10.2e}")
