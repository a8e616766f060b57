"""The frozen kernel spec: every field that shapes a kernel's source, and the name derived from them."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from .contract import Kind

ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_90a")
DTYPES = ("f16", "bf16", "f32")

# C spellings, apart from logic (CUTLASS's DataTypeTag habit).
STORAGE_TYPE = {"f16": "unsigned short", "bf16": "unsigned short", "f32": "float"}
DTYPE_ALIASES = {
    "f16": "f16",
    "fp16": "f16",
    "float16": "f16",
    "half": "f16",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "f32": "f32",
    "fp32": "f32",
    "float32": "f32",
    "float": "f32",
}


class SpecError(ValueError):
    pass


# The head dims fagen takes (FlashAttention's: any up to 256), and those its kernels are compiled at.
MIN_HEAD_DIM, MAX_HEAD_DIM = 8, 256


def kernel_head_dim(dim: int) -> int:
    """The head dim a kernel for inputs of head dim `dim` is compiled at: `dim` itself where the kernels take it
    (a multiple of 8 in 32..256), else the next such one up. The runtime then pads q, k, v with zero columns
    (which change no score and give zero output columns) and returns the first `dim` columns of what it computes;
    the default scale stays 1/sqrt(dim)."""
    return max(32, -(-dim // 8) * 8)


@dataclass(frozen=True)
class KernelSpec:
    variant: str  # the attention program: full, causal, causal_br, or a user program's name
    head_dim: int
    dtype: str  # storage type of q, k, v, o; accumulation is always f32
    arch: str
    tier: str  # a registered tier (fagen.backend.tiers): simt, mma, ...
    block_m: int  # query rows per thread block
    block_n: int  # keys per K/V tile
    num_warps: int
    stages: int = 1  # K/V shared-memory pipeline depth
    kind: Kind = Kind.FORWARD
    persistent: bool = False  # a block per SM takes work tiles in turn (a tier's persistent_kinds)
    tensor_grads: bool = False  # BWD: the variant that also sums the gradients of tensors read as name[h], name[b]
    input_dim: int | None = None  # the head dim of q, k, v where the runtime pads them to head_dim (kernel_head_dim)

    def __post_init__(self):
        """Check the fields on their own; whether the tier takes them is the tier's to say (`tiers.check`, which
        every maker of a spec calls: the planner, a tier's lighter tiles, the compile cache)."""
        if isinstance(self.kind, str) and self.kind.upper() in Kind.__members__:
            object.__setattr__(self, "kind", Kind[self.kind.upper()])

        def need(ok, what):
            if not ok:
                raise SpecError(f"KernelSpec: {what}")

        need(isinstance(self.kind, Kind), f"kind must be a Kind, got {self.kind!r}")
        need(
            isinstance(self.variant, str) and re.fullmatch(r"[a-z][a-z0-9_]*", self.variant) is not None,
            f"variant must be a lower-case identifier, got {self.variant!r}",
        )
        need(
            isinstance(self.head_dim, int) and 32 <= self.head_dim <= 256 and self.head_dim % 8 == 0,
            f"head_dim must be a multiple of 8 in 32..256, got {self.head_dim!r}",
        )
        need(
            self.input_dim is None
            or (
                isinstance(self.input_dim, int)
                and self.input_dim != self.head_dim
                and kernel_head_dim(self.input_dim) == self.head_dim
            ),
            f"input_dim: a head dim that head_dim={self.head_dim} pads (kernel_head_dim), got {self.input_dim!r}",
        )
        need(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        need(self.arch in ARCHS, f"arch must be one of {ARCHS}, got {self.arch!r}")
        for f in ("block_m", "block_n", "num_warps"):
            v = getattr(self, f)
            need(isinstance(v, int) and not isinstance(v, bool) and v > 0, f"{f} must be a positive int, got {v!r}")
        need(isinstance(self.stages, int) and 1 <= self.stages <= 4, f"stages must be 1..4, got {self.stages!r}")
        need(isinstance(self.persistent, bool), f"persistent must be True or False, got {self.persistent!r}")
        need(
            self.tensor_grads in (False, True) and (not self.tensor_grads or self.kind is Kind.BWD),
            f"tensor_grads: only the backward's main kernel (kind bwd) has that variant, got {self.tensor_grads!r}",
        )

    @property
    def dim(self) -> int:
        """The head dim of the inputs: input_dim where the kernel pads them, else head_dim."""
        return self.head_dim if self.input_dim is None else self.input_dim

    @property
    def name(self) -> str:
        """e.g. flash_fwd_causal_d128_bf16_sm90a_mma_m128n64w4s2 (a final p: persistent; _grads after the variant:
        the backward that sums the tensors' gradients; d59p64: inputs of head dim 59 padded to 64): file name,
        cache key and kernel symbol."""
        stages = f"s{self.stages}" if self.stages > 1 else ""
        variant = self.variant + ("_grads" if self.tensor_grads else "")
        dims = f"{self.head_dim}" if self.input_dim is None else f"{self.input_dim}p{self.head_dim}"
        if self.kind is Kind.BLOCK_MASK:  # reads no q, k, v: its head dim and dtype shape nothing
            return (
                f"{self.kind.value}_{self.variant}_{self.arch.replace('_', '')}_"
                f"{self.tier}_m{self.block_m}n{self.block_n}w{self.num_warps}"
            )
        return (
            f"{self.kind.value}_{variant}_d{dims}_{self.dtype}_{self.arch.replace('_', '')}_"
            f"{self.tier}_m{self.block_m}n{self.block_n}w{self.num_warps}{stages}{'p' if self.persistent else ''}"
        )

    def to_dict(self) -> dict:
        """The fields as plain values (the kind by name), so that KernelSpec(**spec.to_dict()) == spec."""
        return {**asdict(self), "kind": self.kind.name.lower()}


def normalize_dtype(dtype) -> str:
    key = str(dtype).lower().replace("torch.", "")
    if key not in DTYPE_ALIASES:
        raise SpecError(f"dtype: expected one of f16, bf16, f32 (or fp16, float16, bfloat16, float32), got {dtype!r}")
    return DTYPE_ALIASES[key]


def arch_of(major: int, minor: int) -> str:
    """The arch fagen compiles for a device of compute capability major.minor: sm_XY, and sm_90a on Hopper (its
    wgmma and TMA instructions exist only in the arch-specific target). The one spelling of this rule."""
    return f"sm_{major}{minor}{'a' if (major, minor) == (9, 0) else ''}"


def runs_on(arch: str, major: int, minor: int) -> bool:
    """Whether a binary compiled for `arch` runs on a device of compute capability major.minor: the same major
    and no older minor, and for an arch-specific target (sm_90a) the very same capability."""
    m = re.fullmatch(r"sm_(\d+)(\d)(a?)", arch)
    if m is None:
        raise SpecError(f"arch: expected sm_XY or sm_XYa, got {arch!r}")
    want_major, want_minor, specific = int(m.group(1)), int(m.group(2)), m.group(3) == "a"
    return major == want_major and minor >= want_minor and (not specific or minor == want_minor)


def normalize_arch(arch) -> str:
    a = str(arch).lower().replace("compute_", "sm_")
    if re.fullmatch(r"\d+a?", a):
        a = "sm_" + a
    if a not in ARCHS:
        raise SpecError(f"arch: expected one of {', '.join(ARCHS)}, got {arch!r}")
    return a
