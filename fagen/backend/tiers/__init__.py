"""The tier registry. Adding a tier means adding a module (a `Tier` subclass, registered) and a template.

from fagen.backend import tiers
tiers.register(MyTier())        # then the planner considers it, in priority order
"""

from __future__ import annotations

from ..spec import KernelSpec, SpecError
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


def check(spec: KernelSpec) -> KernelSpec:
    """`spec`, once its tier takes it: a registered tier (`Tier.check` says the rest); else a SpecError saying what
    is wrong. The makers of specs call it (the planner, a tier's lighter tiles, the compile cache): a KernelSpec
    checks its own fields and needs no registry."""
    if not (isinstance(spec.tier, str) and spec.tier in names()):
        raise SpecError(f"KernelSpec: tier must be one of {tuple(names())}, got {spec.tier!r}")
    return get(spec.tier).check(spec)


def settings() -> str:
    """A digest of the tier modules' settings (their module-level UPPER_CASE values of plain data: tiles, rules,
    heuristics and the switches an A/B script sets, `bench/ab.py --set`), for the compile cache's key: a kernel built
    under one setting is not read back under another."""
    import hashlib
    import sys

    _load_builtin()
    plain = (bool, int, float, str, tuple, dict, frozenset, type(None))
    found = []
    for name in sorted(m for m in sys.modules if m == __name__ or m.startswith(__name__ + ".")):
        for key, value in vars(sys.modules[name]).items():
            if key.isupper() and not key.startswith("_") and isinstance(value, plain):
                text = repr(sorted(map(repr, value))) if isinstance(value, frozenset) else repr(value)  # (hash order)
                found.append(f"{name}.{key}={text}")
    return hashlib.sha256("\n".join(sorted(found)).encode()).hexdigest()


def _load_builtin() -> None:
    """Import every tier module of this package once (each registers itself on import): a new tier is a new
    module here, found without an edit elsewhere."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    import importlib
    import pkgutil

    for info in pkgutil.iter_modules(__path__):
        if info.name != "base":
            importlib.import_module(f"{__name__}.{info.name}")


_loaded = False


__all__ = ["Tier", "SMEM_LIMIT", "register", "unregister", "get", "all_tiers", "names", "check", "settings"]
