"""Planning: (kind, program, head dim, dtype, arch) → a KernelSpec, by asking the registered tiers.

Every decision about a kernel's shape is made by a tier (fagen.backend.tiers), in Python, and tested; the
templates only substitute. The planner takes the requested tier, or the supporting tier of highest priority,
and says why.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import tiers
from .contract import Kind
from .spec import KernelSpec, SpecError, kernel_head_dim


@dataclass(frozen=True)
class Choice:
    spec: KernelSpec
    reason: str


def choose(
    variant: str,
    head_dim: int,
    dtype: str,
    arch: str,
    tier: str | None = None,
    *,
    causal: bool = False,
    kind: Kind = Kind.FORWARD,
    config: dict | None = None,
) -> Choice:
    """The tier and tiles for a kernel for inputs of `head_dim` (compiled at kernel_head_dim(head_dim), the inputs
    padded to it). `causal` (the program masks keys) selects tuned entries; `config` (tile fields) overrides the
    tier's choice, as `fagen tune` does."""
    if tier is not None and not isinstance(tier, str):
        raise SpecError(f"tier: expected a tier name, got {tier!r}")
    head_dim, input_dim = kernel_head_dim(head_dim), head_dim
    padded = None if input_dim == head_dim else input_dim
    passed = []
    for t in [tiers.get(tier)] if tier is not None else tiers.all_tiers():
        why_not = t.supports(kind, head_dim, dtype, arch)
        if why_not:
            if tier is not None:
                raise SpecError(f"tier: {t.name} cannot compile this kernel: {why_not}")
            passed.append(f"the {t.name} tier does not apply: {why_not}")
            continue
        cfg, source = t.configure(kind, head_dim, dtype, arch, causal)
        if config:
            cfg, source = {**cfg, **config}, "given"
            if "persistent" not in config:  # decided for the given tiles, not for the ones they replace
                cfg["persistent"] = t.persistent(kind, head_dim, arch, causal, cfg)
        spec = tiers.check(KernelSpec(variant, head_dim, dtype, arch, t.name, kind=kind, input_dim=padded, **cfg))
        how = "requested" if tier is not None else "; ".join(passed) if passed else t.describe
        return Choice(spec, f"{how}; tiles from the {source}")
    raise SpecError(f"no tier compiles this kernel: {'; '.join(passed)}")


def lighter(spec: KernelSpec) -> KernelSpec | None:
    return tiers.get(spec.tier).lighter(spec)


def spare(spec: KernelSpec, scored: bool) -> KernelSpec | None:
    """The lighter tiles to compile beside `spec`: where a score function is likely to spill its registers."""
    t = tiers.get(spec.tier)
    return t.lighter(spec) if scored and t.tight(spec) else None


def smem_bytes(spec: KernelSpec) -> int:
    return tiers.get(spec.tier).smem_bytes(spec)


__all__ = ["Choice", "choose", "lighter", "smem_bytes", "spare"]
