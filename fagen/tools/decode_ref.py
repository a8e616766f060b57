"""A NumPy model of split-KV decode (float64): the kernels' partition of rows and keys, each split's partial
state (m, l, acc) in base 2, and the merge evaluated from the proven MergeRule expressions; and plain
attention over the cache to check it against."""

from __future__ import annotations

import math

import numpy as np
import sympy as sp

from ..math import online_softmax as osm
from . import executor

LOG2E = 1.0 / math.log(2.0)


def attention(q, k_cache, v_cache, seqlens, *, causal: bool, scale: float):
    """Plain softmax attention, q [B, M, H, D] over the first seqlens[b] keys of [B, N, Hkv, D], causal aligned
    bottom-right. Returns o [B, M, H, D] (0 for a row that sees no key) and lse [B, H, M] (-inf there)."""
    B, M, H, D = q.shape
    group = H // k_cache.shape[2]
    o, lse = np.zeros(q.shape), np.full((B, H, M), -np.inf)
    for b in range(B):
        L = int(seqlens[b])
        for h in range(H):
            k, v = k_cache[b, :L, h // group], v_cache[b, :L, h // group]
            for i in range(M):
                s = k @ q[b, i, h] * scale
                keep = np.arange(L) <= L - M + i if causal else np.ones(L, bool)
                if keep.any():
                    s = np.where(keep, s, -np.inf)
                    mx = s.max()
                    w = np.exp(s - mx)
                    o[b, i, h] = w @ v / w.sum()
                    lse[b, h, i] = mx + np.log(w.sum())
    return o, lse


def _merge_fn(rule):
    """merge(a, b) as a NumPy function of the two states, evaluated from the MergeRule's expressions."""
    rule = rule.concrete()
    merge = osm.make_merge(rule)
    ma, mb = sp.symbols("ma mb", extended_real=True)  # -inf is a value they take (an empty split)
    la, lb = sp.symbols("la lb", nonnegative=True)
    aa, ab = sp.symbols("aa ab", real=True)
    syms = (ma, la, aa, mb, lb, ab)
    m, l_, a = merge.apply(syms[:3], syms[3:])
    finish = [e.xreplace({osm.kLog2e: LOG2E}) for e in osm._finish(rule, syms[:3])]

    def apply(x, y):
        values = dict(zip(syms, (*x, *y)))
        return tuple(np.broadcast_to(executor._evaluate(e, values), np.shape(x[i])) for i, e in enumerate((m, l_, a)))

    def fin(x):
        values = dict(zip(syms[:3], x))
        out = np.broadcast_to(executor._evaluate(finish[0], values), np.shape(x[2]))
        return out, np.broadcast_to(executor._evaluate(finish[1], values), np.shape(x[0]))

    return apply, fin


def split_merge(q, k_cache, v_cache, seqlens, num_splits, *, causal: bool, scale: float, rule, block_m: int = 4):
    """What the split kernel computes, its merge included, in float64: rows = tokens x heads of a group in tiles of
    block_m; a tile's visible keys [0, kv_end) cut into num_splits chunks; partial states merged in split order."""
    merge, finish = _merge_fn(rule)
    B, M, H, D = q.shape
    Hkv = k_cache.shape[2]
    group = H // Hkv
    rows = M * group
    o, lse = np.zeros(q.shape), np.zeros((B, H, M))
    for b in range(B):
        L = int(seqlens[b])
        for hk in range(Hkv):
            for r0 in range(0, rows, block_m):
                rr = np.arange(r0, min(r0 + block_m, rows))
                tok, head = rr // group, hk * group + rr % group
                q_hi = tok.max()
                kv_end = max(0, min(L, q_hi + L - M + 1)) if causal else L
                chunk = -(-kv_end // num_splits)
                state = (np.full(len(rr), -np.inf), np.zeros(len(rr)), np.zeros((len(rr), D)))
                for s in range(num_splits):
                    lo, hi = min(s * chunk, kv_end), min(s * chunk + chunk, kv_end)
                    k, v = k_cache[b, lo:hi, hk], v_cache[b, lo:hi, hk]
                    s2 = (q[b, tok, head] @ k.T) * scale * LOG2E  # [rows, keys], base 2
                    if causal:
                        s2 = np.where(np.arange(lo, hi)[None] <= (L - M + tok)[:, None], s2, -np.inf)
                    m = s2.max(axis=1, initial=-np.inf)
                    mu = np.where(np.isneginf(m), 0.0, m)
                    p = np.exp2(s2 - mu[:, None])
                    part = (m, p.sum(axis=1), p @ v)
                    state = merge(
                        (state[0][:, None], state[1][:, None], state[2]),
                        (part[0][:, None], part[1][:, None], part[2]),
                    )
                    state = (state[0][:, 0], state[1][:, 0], state[2])
                out, ls = finish((state[0][:, None], state[1][:, None], state[2]))
                o[b, tok, head] = out
                lse[b, head, tok] = ls[:, 0]
    return o, lse
