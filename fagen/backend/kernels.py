"""The build loop every kernel kind shares: render → NVRTC → step down.

The kernels of one op (a forward's one, a decode's split kernel, a backward's four or five) are rendered and
compiled together, NVRTC's threads running side by side while `meanwhile` runs beside them (a compile's proofs).
The lighter tiles a score function is likely to need (`spares`, plan.spare's) are compiled in the same batch.
Then each kernel its tier finds too heavy (Tier.too_heavy: a spill, a stack frame over the backward's budget)
steps down to the tier's lighter tiles until it is not, or none are left; a step down that was compiled in the
batch costs nothing more.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from . import build, tiers
from .build import Binary
from .spec import KernelSpec


@dataclass(frozen=True)
class Built:
    """One kernel, compiled: its spec (after any step down), source and binary, and why it stepped down."""

    spec: KernelSpec
    source: str
    binary: Binary
    stepped: str = ""  # "; "-joined reasons, one a step down ("" where it kept its tiles)


def build_kernels(
    specs: Sequence[KernelSpec],
    render: Callable[[KernelSpec], str],
    *,
    spares: Sequence[KernelSpec] = (),
    step_down: bool = True,
    meanwhile: Callable[[], None] | None = None,
    cache_dir: Path | None = None,
    use_cache: bool = True,
) -> list[Built]:
    """The kernels of `specs`, in their order: rendered by `render`, compiled with `spares` in one NVRTC batch
    (`meanwhile` beside it), each then stepped down while its tier finds it too heavy (unless `step_down` is off:
    a tuning run times the tiles it asked for)."""
    jobs = [(render(spec), spec) for spec in (*specs, *spares)]
    binaries = build.compile_cubins(jobs, cache_dir=cache_dir, use_cache=use_cache, meanwhile=meanwhile)
    compiled = {spec: (source, binary) for (source, spec), binary in zip(jobs, binaries)}
    out = []
    for spec in specs:
        source, binary = compiled[spec]
        reasons = []
        while step_down and (why := tiers.get(spec.tier).too_heavy(spec, binary.resources)) is not None:
            lighter = tiers.get(spec.tier).lighter(spec)
            if lighter is None:
                break
            reasons.append(why)
            if lighter not in compiled:
                lighter_source = render(lighter)
                compiled[lighter] = (
                    lighter_source,
                    build.compile_cubin(lighter_source, lighter, cache_dir=cache_dir, use_cache=use_cache),
                )
            spec = lighter
            source, binary = compiled[spec]
        out.append(Built(spec, source, binary, "; ".join(reasons)))
    return out


__all__ = ["Built", "build_kernels"]
