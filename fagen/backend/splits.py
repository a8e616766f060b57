"""How many key splits a split-KV decode uses: FlashAttention's wave-efficiency heuristic and
FlexDecoding's, over the SM count, batch, KV heads, row tiles and the keys' length. Pure functions (tested)."""

from __future__ import annotations

MAX_SPLITS = 128


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def flash_heuristic(tiles: int, slots: int, key_blocks: int, max_splits: int = MAX_SPLITS) -> int:
    """FlashAttention's num_splits_heuristic: `tiles` thread blocks without splitting (batch × KV heads × row
    tiles), `slots` blocks the GPU runs at once (SMs, or SMs × resident blocks per SM), `key_blocks` key
    blocks of the longest sequence. 1 when the tiles already fill 80 % of the slots; else the smallest count
    whose wave efficiency (waves / ceil(waves)) is within 0.85 of the best, among counts that change the
    blocks per split, capped at max_splits, the slots and the key blocks."""
    if tiles >= 0.8 * slots:
        return 1
    top = max(1, min(max_splits, slots, key_blocks))

    def eligible(s):
        return s == 1 or _ceil(key_blocks, s) != _ceil(key_blocks, s - 1)

    eff = {}
    for s in range(1, top + 1):
        if eligible(s):
            waves = tiles * s / slots
            eff[s] = waves / _ceil(tiles * s, slots)
    best = max(eff.values())
    return next(s for s in sorted(eff) if eff[s] >= 0.85 * best)


def flex_heuristic(tiles: int, sms: int, key_blocks: int, max_splits: int = MAX_SPLITS) -> int:
    """FlexDecoding's: twice the SMs over the tiles (batch × KV heads), at least 1, at most the key blocks."""
    return max(1, min(max_splits, key_blocks, 2 * sms // max(tiles, 1)))


def resident_blocks(
    registers: int, threads: int, smem: int, *, regs_per_sm=65536, max_threads=2048, smem_limit=227 * 1024
):
    """Thread blocks of a kernel one SM holds at once: by registers (allocated 256 a warp), threads and shared
    memory."""
    warp_regs = -(-registers * 32 // 256) * 256
    by_regs = regs_per_sm // (warp_regs * (threads // 32))
    by_smem = smem_limit // smem if smem else by_regs
    return max(1, min(by_regs, max_threads // threads, by_smem, 32))


def choose(
    how: str, tiles: int, sms: int, blocks_per_sm: int, max_seqlen_k: int, block_n: int, max_splits: int = MAX_SPLITS
) -> int:
    key_blocks = max(1, _ceil(max_seqlen_k, block_n))
    if how == "flash":
        return flash_heuristic(tiles, sms * blocks_per_sm, key_blocks, max_splits)
    if how == "flex":
        return flex_heuristic(tiles, sms, key_blocks, max_splits)
    raise ValueError(f"num_splits: expected an int, 'flash' or 'flex', got {how!r}")
