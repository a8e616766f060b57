"""The tuning table `fagen/tuned.json`: tile configurations `fagen tune` measured fastest, per
(tier, arch, dtype, head dim, masked). Tiers prefer an entry over their rules."""

from __future__ import annotations

import functools
import json
from importlib import resources


def _file():
    return resources.files("fagen").joinpath("tuned.json")


@functools.lru_cache(maxsize=1)
def tuned_table() -> dict:
    try:
        return json.loads(_file().read_text())["configs"]
    except (OSError, ValueError, KeyError):
        return {}


def tuned_key(tier: str, arch: str, head_dim: int, dtype: str, masked: bool) -> str:
    return f"{tier}/{arch}/{dtype}/d{head_dim}/{'causal' if masked else 'full'}"


def parse_key(key: str) -> tuple[str, str, str, int, bool]:
    """(tier, arch, dtype, head dim, masked) of a table key."""
    tier, arch, dtype, d, mask = key.split("/")
    return tier, arch, dtype, int(d[1:]), mask == "causal"


def tuned_entry(tier: str, arch: str, head_dim: int, dtype: str, masked: bool) -> dict | None:
    """The tuned tiles; f16 and bf16 kernels differ only in the MMA's input type, so f16 takes bf16's tiles
    unless tuned itself."""
    table = tuned_table()
    return table.get(tuned_key(tier, arch, head_dim, dtype, masked)) or table.get(
        tuned_key(tier, arch, head_dim, "bf16", masked)
    )
