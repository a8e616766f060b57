"""Head dims the kernels do not take: FlashAttention takes any head dim up to 256, fagen's kernels a multiple of 8
from 32 (fagen.backend.spec.kernel_head_dim). A kernel compiled for inputs of head dim d < its head dim
(KernelSpec.input_dim) takes arrays of d columns; each op pads q, k, v (and o, dO, the caches, k_new, v_new) with
zero columns on the way in, and returns the first d columns of what the kernels computed.

Zero columns of q and k add nothing to q·k, so no score changes (the scale is 1/sqrt(d), the kernel's default);
zero columns of v give zero columns of O, and dO's zero columns add nothing to dP. Each padded array is one copy.
"""

from __future__ import annotations

from ..backend.spec import KernelSpec
from . import arrays


def padded(spec: KernelSpec) -> bool:
    """Whether the kernel `spec` takes inputs of a smaller head dim, padded to its own."""
    return spec.input_dim is not None


def pad(name: str, x, spec: KernelSpec):
    """x [..., spec.dim] as a new array [..., spec.head_dim], zero past its own columns (None stays None, and what
    is not an array is left for the checks to name)."""
    lib = arrays.library(x)
    shape = tuple(getattr(x, "shape", ()))
    if lib is None or not shape:
        return x
    if shape[-1] != spec.dim:
        raise ValueError(
            f"{name}: head dim {shape[-1]} differs from the compiled head_dim {spec.dim}; "
            f"compile a kernel with dim={shape[-1]}"
        )
    width = spec.head_dim - spec.dim
    if lib == "torch":
        import torch

        return torch.nn.functional.pad(x, (0, width))
    import cupy

    with cupy.cuda.Device(x.device.id):
        return cupy.pad(x, [(0, 0)] * (len(shape) - 1) + [(0, width)])


def pad_all(spec: KernelSpec, **named) -> list:
    """pad() of each array given by name, in order (None stays None)."""
    return [None if x is None else pad(name, x, spec) for name, x in named.items()]


def cut(x, spec: KernelSpec, like=None, into=None):
    """The first spec.dim columns of a padded output x, written into `into` (the caller's out=), else into a new
    array laid out like `like` (the input it answers: o like q, dK like k), else returned as a view."""
    part = x[..., : spec.dim]
    if into is None and like is None:
        return part
    if into is None:
        if arrays.library(part) == "torch":
            import torch

            into = torch.empty_like(like)
        else:
            import cupy

            with cupy.cuda.Device(part.device.id):
                into = cupy.empty_like(like)
    return arrays.copy_into(into, part)


def write_back(padded_x, x, spec: KernelSpec) -> None:
    """The first spec.dim columns of `padded_x` written back into the caller's array x (a KV cache the kernel
    appended to)."""
    arrays.copy_into(x, padded_x[..., : spec.dim])
