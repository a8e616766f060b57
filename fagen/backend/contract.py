"""Kernel kinds and their argument contract: each kind's parameter list, declared once.

The templates render a kernel's signature from `params(kind, tensors)`, and the launcher packs its arguments
from the very same list (fagen.runtime.launch), so the two cannot disagree. A new kind (a backward piece,
split-KV, combine) declares its parameters here and gets both for free.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

# log2(e): the kernels compute in base 2, and the launcher passes scale_log2 = scale * LOG2E (the kernels'
# kLog2e is this value too).
LOG2E = 1.0 / math.log(2.0)


class Kind(enum.Enum):
    """What a kernel computes. The value prefixes the kernel's name."""

    FORWARD = "flash_fwd"  # O = softmax(score(Q Kᵀ), mask) V and the row log-sum-exp


@dataclass(frozen=True)
class Param:
    name: str
    ctype: str  # the C type in the kernel's signature
    pack: str  # how the launcher passes it: ptr (device address), i64, i32 or f32

    def c(self) -> str:
        return f"{self.ctype} {self.name}"


PACKS = ("ptr", "i64", "i32", "f32", "tmap")  # tmap: a 128-byte TMA tensor map, by value


def _strides(tensor: str, dims: str) -> tuple[Param, ...]:
    return tuple(Param(f"{tensor}_stride_{d}", "long long", "i64") for d in dims)


# The forward: pointers, element strides of every array ([B, H, S, D]; lse [B, H, M]), sizes, the scale, the
# varlen offsets (null when not varlen) with the packed totals they must stay inside, then call-time tensors.
FORWARD = (
    Param("q", "const storage_t* __restrict__", "ptr"),
    Param("k", "const storage_t* __restrict__", "ptr"),
    Param("v", "const storage_t* __restrict__", "ptr"),
    Param("o", "storage_t* __restrict__", "ptr"),
    Param("lse", "float* __restrict__", "ptr"),
    *_strides("q", "bhmd"),
    *_strides("k", "bhnd"),
    *_strides("v", "bhnd"),
    *_strides("o", "bhmd"),
    *_strides("lse", "bhm"),
    Param("heads_per_kv", "int", "i32"),
    Param("seqlen_q", "int", "i32"),
    Param("seqlen_k", "int", "i32"),
    Param("scale_log2", "float", "f32"),
    Param("cu_seqlens_q", "const int* __restrict__", "ptr"),
    Param("cu_seqlens_k", "const int* __restrict__", "ptr"),
    Param("total_q", "int", "i32"),
    Param("total_k", "int", "i32"),
)
BASE = {Kind.FORWARD: FORWARD}


def c_tensor_name(name: str) -> str:
    """The C name of the call-time tensor `name` (a kernel parameter; prefixed so it cannot clash)."""
    return f"tensor_{name}"


def tensor_param(name: str) -> Param:
    """A call-time float tensor the program reads (e.g. ALiBi's slopes)."""
    return Param(c_tensor_name(name), "const float* __restrict__", "ptr")


def params(kind: Kind, tensors: tuple[str, ...] = (), extra: tuple[Param, ...] = ()) -> tuple[Param, ...]:
    """The parameter list of a kernel of `kind` whose program reads the call-time tensors `tensors`; `extra`
    are a tier's own parameters (Tier.extra_params: the wgmma tier's tensor maps)."""
    return BASE[kind] + tuple(extra) + tuple(tensor_param(t) for t in tensors)


def signature(kind: Kind, tensors: tuple[str, ...] = (), extra: tuple[Param, ...] = ()) -> str:
    """The parameter list as C, one parameter a line (what the templates substitute)."""
    return ",\n    ".join(p.c() for p in params(kind, tensors, extra))
