"""The tier registry. Adding a tier means adding a module (a `Tier` subclass, registered) and a template.

from fagen.backend import tiers
tiers.register(MyTier())        # then the planner considers it, in priority order
"""

from __future__ import annotations

from .base import SMEM_LIMIT, Tier

_REGISTRY: dict[str, Tier] = {}


def register(tier: Tier) -> Tier:
    if not getattr(tier, "name", None) or not tier.name.isidentifier():
        raise ValueError(f"tier: a tier needs an identifier name, got {getattr(tier, 'name', None)!r}")
    _REGISTRY[tier.name] = tier
    return tier


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)


def get(name: str) -> Tier:
    _load_builtin()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"tier: {name!r} is not available (available: {', '.join(names())})") from None


def all_tiers() -> list[Tier]:
    """Every registered tier, highest priority first."""
    _load_builtin()
    return sorted(_REGISTRY.values(), key=lambda t: -t.priority)


def names() -> list[str]:
    return sorted(t.name for t in all_tiers())


def _load_builtin() -> None:
    from . import mma, simt  # noqa: F401  (each registers itself on import)


__all__ = ["Tier", "SMEM_LIMIT", "register", "unregister", "get", "all_tiers", "names"]
