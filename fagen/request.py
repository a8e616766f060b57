"""The request: one frozen, typed description of what a caller asks fagen to compile.

Every entry point builds one — `fagen.compile`, `fagen.attention`, the `flash_attn_*` drop-ins,
`flash_attn_with_kvcache`, `flex_attention`/`create_block_mask`, `scaled_dot_product_attention`, `fagen.hf` (on
`flash_attn_*`) and the CLI — and everything downstream derives from it: the attention program
(`Request.program`), the compile cache's key (`Request.cache_key`), the kernel's variant name
(`Request.variant`), the "Regenerate" line in the kernel's header (`Request.command`) and the memo of compiled
ops (fagen.ops). A request names its program in one of three ways:

- `Options`: fagen's own options (causal, window, ALiBi, softcap, prefix-LM) and traced Python functions
  (mask, score_mod), or none of them: a shipped program of `ir/`;
- `Flash`: FlashAttention's semantics (bottom-right causal and window, softcap, ALiBi by |distance|), built by
  the one builder of them, fagen.ir.variants.flash_attn_program;
- `IR`: an attention program of the user's own, as IR text (an .ir file's) or a `Program`.

This module imports nothing heavy: SymPy and the IR load only when a program is built.
"""

from __future__ import annotations

import functools
import hashlib
import math
import numbers
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .backend.spec import MAX_HEAD_DIM, MIN_HEAD_DIM, SpecError, normalize_arch, normalize_dtype

Kind = Literal["forward", "block_sparse", "decode", "block_mask"]
KINDS: tuple[str, ...] = ("forward", "block_sparse", "decode", "block_mask")
CAUSAL_PROGRAMS = {False: "full", None: "full", True: "causal", "top_left": "causal", "bottom_right": "causal_br"}
MAX_IR_BYTES = 1 << 20
FLASH_WINDOW_LIMIT = 2**31  # FlashAttention's window sizes are C ints


# --- what names the program ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Options:
    """fagen's options: causal (False, True / 'top_left', 'bottom_right'), window (LEFT or (LEFT, RIGHT)), alibi
    (slopes[h]·(k - q)), softcap (C·tanh(s/C)), prefix (prefix-LM of L keys) and traced functions mask(b, h, q, k)
    and score_mod(s, b, h, q, k, ...). A traced function is compared by `function_key` (its code, defaults and
    closure values), so that a lambda written inline compiles once."""

    causal: bool | str | None = False
    window: int | tuple[int, ...] | None = None
    alibi: bool = False
    softcap: float | None = None
    prefix: int | None = None
    mask: Callable[..., Any] | None = field(default=None, compare=False)
    score_mod: Callable[..., Any] | None = field(default=None, compare=False)
    traced: tuple = ()  # (function_key(mask), function_key(score_mod)) where either is given

    @property
    def is_traced(self) -> bool:
        return self.mask is not None or self.score_mod is not None

    @property
    def is_shipped(self) -> bool:
        """No option but causal: one of the shipped programs (ir/full.ir, causal.ir, causal_br.ir)."""
        given = (self.window, self.alibi, self.softcap, self.prefix, self.mask, self.score_mod)
        return all(v is None or v is False for v in given)

    def build(self):
        """The attention program (fagen.ir.Program) these options describe."""
        from .ir import parse_program, variants
        from .resources import shipped_programs

        if not (self.causal is None or isinstance(self.causal, bool) or self.causal in ("top_left", "bottom_right")):
            raise ValueError(f"causal: expected False, True, 'top_left' or 'bottom_right', got {self.causal!r}")
        if self.is_shipped:
            shipped = shipped_programs()[CAUSAL_PROGRAMS[self.causal]]
            return parse_program(shipped.read_text(encoding="utf-8"), source=shipped.name)
        return variants.build(
            causal=self.causal,
            window=self.window,
            alibi=self.alibi,
            softcap=self.softcap,
            prefix=self.prefix,
            mask=self.mask,
            score_mod=self.score_mod,
        )

    def spelled(self) -> dict | None:
        """The options as plain values (the cache's spelling), or None where one is not a plain value."""
        from . import cache

        opts = dict(causal=self.causal, window=self.window, alibi=self.alibi, softcap=self.softcap, prefix=self.prefix)
        return {"options": opts} if all(cache.plain(v) for v in opts.values()) else None

    def flags(self) -> list[str]:
        """The options as `fagen compile` flags."""
        flags = []
        if self.causal not in (False, None):
            flags.append("--causal" if self.causal in (True, "top_left") else "--causal bottom_right")
        if self.window is not None:
            w = self.window
            flags.append(f"--window {','.join(map(str, w)) if isinstance(w, (tuple, list)) else w}")
        if self.alibi:
            flags.append("--alibi")
        if self.softcap is not None:
            flags.append(f"--softcap {self.softcap:g}")
        if self.prefix is not None:
            flags.append(f"--prefix {self.prefix}")
        return flags


@dataclass(frozen=True)
class Flash:
    """FlashAttention's semantics: `causal` and `window` = (left, right) aligned bottom-right (-1: unbounded on that
    side; causal makes right 0), `softcap` (0: none) and ALiBi (`alibi`: None, 'h' for slopes [H] or 'bh' for
    slopes [B, H]) added as -slope·|i + N - M - j| after the softcap; `leftpad`: keys before leftpad[b] (an int32
    [B] tensor, flash_attn_with_kvcache's cache_leftpad) are not attended."""

    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi: str | None = None
    leftpad: bool = False

    def build(self):
        from .ir import variants

        return variants.flash_attn_program(
            causal=self.causal,
            window=self.window,
            softcap=self.softcap or None,
            alibi=self.alibi == "h",
            alibi_per_batch=self.alibi == "bh",
            leftpad=self.leftpad,
        )

    def spelled(self) -> dict:
        spelled = dict(causal=self.causal, window=list(self.window), softcap=self.softcap, alibi=self.alibi)
        return {"flash": {**spelled, "leftpad": True} if self.leftpad else spelled}


@dataclass(frozen=True)
class IR:
    """A program of the user's own: IR text (`source` names the file it came from), or a `Program` (`given`)."""

    text: str
    source: str | None = None
    given: Any = field(default=None, compare=False)

    def build(self):
        from .ir import parse_program, verify

        if self.given is not None:
            return verify(self.given)
        return parse_program(self.text) if self.source is None else parse_program(self.text, source=self.source)

    def spelled(self) -> dict:
        return {"ir": self.text}


Source = Options | Flash | IR


# --- the request ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Request:
    """What is asked: the program (`source`), head dim, storage dtype (None: what the program declares, else
    bf16), arch, tier (None: the planner's choice), the kind of op ('forward', 'block_sparse': the forward over a
    run-time block mask, 'decode': the split-KV decode, 'block_mask': the kernel that builds a block mask at
    `tiles`), the dtypes of call-time tensors other than float32, and the default softmax scale (None: the
    program's)."""

    dim: int
    source: Source
    dtype: str | None = None
    arch: str = "sm_90a"
    tier: str | None = None
    kind: str = "forward"
    tensor_dtypes: tuple[tuple[str, str], ...] = ()
    scale: float | None = None
    tiles: tuple[int, int] | None = None  # block_mask: (block_m, block_n)

    def program(self):
        """The attention program (fagen.ir.Program): parsed, built from options or FlashAttention's semantics,
        or traced; its declared dtype checked against `dtype`."""
        program = self.source.build()
        declared = declared_dtype(program)
        if self.dtype is not None and declared is not None and self.dtype != declared:
            raise ValueError(
                f"dtype: the program {program.name!r} declares {declared} inputs; drop dtype={self.dtype!r} "
                f"or change the program"
            )
        return program

    def storage_dtype(self, program) -> str:
        """The dtype the kernel stores q, k, v, o in: the request's, else the program's, else bf16."""
        return self.dtype or declared_dtype(program) or "bf16"

    def cache_key(self, program=None) -> dict | None:
        """The compile cache's key for this request: the program as the request spells it (options, FlashAttention's
        semantics or IR text) — or, with traced functions, the text of the `program` they traced to (None until it
        is given) — beside the head dim, dtype, arch, tier, kind and tensor dtypes. None where the request cannot be
        spelled in plain values (it is then compiled, not looked up)."""
        from . import cache

        src = self.source
        if isinstance(src, Options) and src.is_traced:
            spelled = None if program is None else {"traced": str(program)}
        else:
            spelled = src.spelled()
        kind: dict = {"forward": {}, "block_sparse": {"block_sparse": True}, "decode": {"decode": True}}[self.kind]
        spelled = spelled and {**spelled, **kind}
        dtypes = self.tensor_dtypes if program is None else self.program_dtypes(program)
        return cache.request(self.dim, self.dtype, self.arch, self.tier, spelled, dict(dtypes))

    def program_dtypes(self, program) -> tuple[tuple[str, str], ...]:
        """The dtypes of the kernel's call-time tensors, by name, for `program` (the traced one, or fused): the
        request's, less those of tensors a traced function captures that the program does not read (a variable it
        names that nothing it returns depends on: no argument of the kernel, so no dtype), each checked (a captured
        object's unsupported dtype is an error where the program reads it)."""
        from .backend.contract import tensor_dtype

        caught = captures(self.source)
        if not caught:
            return self.tensor_dtypes
        reads = tensors_read(program)
        return tuple((n, tensor_dtype(d, n)) for n, d in self.tensor_dtypes if n in reads or n not in caught)

    def variant(self, program, fused) -> str:
        """The kernel's variant name: the program's own where it is shipped or built from fagen's options (those
        names spell every option); for any other program (IR text, FlashAttention's semantics) its name plus a
        digest of the fused program, so that different programs never share a kernel name."""
        v = re.sub(r"[^a-z0-9_]", "_", program.name.lower())
        v = v if v[:1].isalpha() else "p_" + v
        if not isinstance(self.source, Options) and not _is_shipped_program(program):
            v = f"{v}_{hashlib.sha256(str(fused).encode()).hexdigest()[:8]}"
        if dtypes := self.program_dtypes(fused):  # the tensors' dtypes are part of the kernel: kernels for other
            # dtypes get other names
            v = f"{v}_t{hashlib.sha256(repr(sorted(dtypes)).encode()).hexdigest()[:6]}"
        return v

    def command(self, spec) -> str | None:
        """The command that regenerates the kernel `spec`, for its header (None: codegen's own rule, for the
        shipped programs and IR files)."""
        src = self.source
        if isinstance(src, Options) and src.is_traced:
            return (
                "fagen.compile(...) with traced mask/score_mod functions (the program above is what they traced "
                "to; save it as an .ir file to use fagen compile --ir)"
            )
        if not isinstance(src, Options) or src.is_shipped:
            return None
        line = f"fagen compile --dim {self.dim} {' '.join(src.flags())} --dtype {spec.dtype} --arch {spec.arch}"
        line += f" --tier {spec.tier}"
        return line + " --decode" if self.kind == "decode" else line


def _is_shipped_program(program) -> bool:
    from .ir import parse_program
    from .resources import shipped_programs

    path = shipped_programs().get(program.name)
    return path is not None and parse_program(path.read_text(), source=path.name) == program


def declared_dtype(program) -> str | None:
    """The storage dtype a program's inputs declare (None where they leave it to T)."""
    from .ir import Op

    found = {n.type.dtype for n in program.find(Op.INPUT)} - {"T"}
    if len(found) > 1:
        raise ValueError(f"ir: program {program.name!r} declares inputs of several dtypes ({', '.join(sorted(found))})")
    return found.pop() if found else None


# --- building requests: one builder a door -------------------------------------------------------------------
def for_compile(
    dim,
    *,
    causal=False,
    window=None,
    alibi=False,
    softcap=None,
    prefix=None,
    mask=None,
    score_mod=None,
    dtype=None,
    arch=None,
    tier=None,
    ir=None,
    scale=None,
    decode=False,
    block_sparse=False,
    tensor_dtypes=None,
) -> Request:
    """The request of `fagen.compile`'s arguments (see its docstring), checked: errors name the argument."""
    check_dim(dim)
    if not isinstance(block_sparse, bool):
        raise TypeError(f"block_sparse: expected True or False, got {block_sparse!r}")
    if block_sparse and decode:
        raise ValueError("block_sparse: a decode kernel reads no block mask; drop block_sparse or decode")
    if decode:
        if causal == "top_left":
            raise ValueError("causal: decode aligns the mask bottom-right (the new tokens are the last); use True")
        causal = "bottom_right" if causal is True else causal
    if tensor_dtypes is not None and not isinstance(tensor_dtypes, dict):
        raise TypeError(f"tensor_dtypes: expected a dict of tensor name -> dtype, got {type(tensor_dtypes).__name__}")
    source = program_source(
        causal=causal, window=window, alibi=alibi, softcap=softcap, prefix=prefix, mask=mask, score_mod=score_mod, ir=ir
    )
    return Request(
        dim=dim,
        source=source,
        dtype=normalize_dtype(dtype) if dtype is not None else None,
        arch=resolve_arch(arch),
        tier=tier,
        kind="block_sparse" if block_sparse else "decode" if decode else "forward",
        tensor_dtypes=tensor_dtypes_of(tensor_dtypes, source),
        scale=check_scale(scale),
    )


def program_source(*, ir=None, mask=None, score_mod=None, **options) -> Source:
    """The program's source of `fagen.compile`'s arguments: the user's own program (`ir`), or the options (causal,
    window, alibi, softcap, prefix) and traced functions (mask, score_mod); an ir program takes no option."""
    if ir is None:
        return options_source(mask=mask, score_mod=score_mod, **options)
    given = [n for n, v in options.items() if v is not None and v is not False]
    given += [n for n, f in (("mask", mask), ("score_mod", score_mod)) if f is not None]
    if given:
        raise ValueError(f"ir: an ir program states its own mask and score; drop {', '.join(sorted(given))}")
    return ir_source(ir)


def options_source(*, causal=False, window=None, alibi=False, softcap=None, prefix=None, mask=None, score_mod=None):
    """`Options` of these values (a list window taken as a tuple)."""
    traced = (function_key(mask), function_key(score_mod)) if mask is not None or score_mod is not None else ()
    window = tuple(window) if isinstance(window, list) else window
    return Options(causal, window, alibi, softcap, prefix, mask, score_mod, traced)


def ir_source(ir) -> IR:
    """`IR` of a path to an .ir file, IR text or a Program."""
    from_file = isinstance(ir, Path) or (isinstance(ir, str) and "\n" not in ir and ir.endswith(".ir"))
    if from_file:
        return IR(read_ir_file(Path(ir)), str(ir))
    if isinstance(ir, str):
        return IR(ir)
    if type(ir).__name__ == "Program" and type(ir).__module__.startswith("fagen.ir"):
        return IR(str(ir), None, ir)
    raise TypeError(f"ir: expected a path, program text or Program, got {type(ir).__name__}")


def for_flash(
    dim: int, dtype: str, arch: str | None, *, causal, window_size, softcap, alibi, kind="forward", leftpad=False
):
    """The request of FlashAttention's options (flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache):
    `alibi` None, 'h' (slopes [H]) or 'bh' (slopes [B, H]); `leftpad`: the program reads an int32 leftpad[b].
    Errors name FlashAttention's arguments."""
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected True or False, got {causal!r}")
    source = Flash(causal, flash_window(window_size), flash_softcap(softcap), alibi, bool(leftpad))
    return Request(
        dim=check_dim(dim),
        source=source,
        dtype=normalize_dtype(dtype),
        arch=resolve_arch(arch),
        kind=kind,
        tensor_dtypes=(("leftpad", "i32"),) if leftpad else (),
    )


def for_attention(*, dim, dtype, device, tensor_dtypes=(), **options) -> Request:
    """The request of `fagen.attention`'s options (and FlexAttention's and SDPA's, which are fagen's options and
    traced functions) for inputs of `dtype` on `device` (a tuple: library, device type, index); `tensor_dtypes`:
    the call-time tensors' dtypes other than float32, as (name, dtype) pairs; `block_sparse`: the forward over a
    run-time block mask."""
    return for_compile(dim, dtype=dtype, arch=device_arch(device), tensor_dtypes=dict(tensor_dtypes), **options)


def for_flash_attn(*, dim, dtype, device, causal, window_size, softcap, alibi, decode=False, leftpad=False) -> Request:
    """The request of FlashAttention's options for inputs of `dtype` on `device` (for_flash's, the kind a
    split-KV decode with `decode`)."""
    kind = "decode" if decode else "forward"
    options = dict(causal=causal, window_size=window_size, softcap=softcap, alibi=alibi, kind=kind, leftpad=leftpad)
    return for_flash(dim, dtype, device_arch(device), **options)


def for_block_mask(*, mask, device, tiles) -> Request:
    """The request of the kernel that builds a block mask of `mask` (FlexAttention's mask_mod) at `tiles`
    (block_m, block_n) on `device`. It reads no q, k, v: its head dim and dtype are placeholders."""
    return Request(
        dim=64,
        source=options_source(mask=mask),
        dtype="f32",
        arch=resolve_arch(device_arch(device)),
        kind="block_mask",
        tensor_dtypes=tensor_dtypes_of(None, options_source(mask=mask)),
        tiles=tiles,
    )


def flash_window(window_size) -> tuple[int, int]:
    """FlashAttention's window_size (left, right), -1 unbounded on that side; None is (-1, -1). The pair may be a
    tuple, a list or a 2-element tensor, each side any integer type (as_int)."""
    if window_size is None:
        return (-1, -1)
    if not isinstance(window_size, (tuple, list)) and is_array(window_size) and tuple(window_size.shape) != (2,):
        raise ValueError(f"window_size: expected a pair (left, right), got a tensor of shape {list(window_size.shape)}")
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise ValueError(f"window_size: expected a pair (left, right), got {window_size!r}") from None
    sides = []
    for side, value in (("left", left), ("right", right)):
        try:
            value = as_int(value, f"window_size ({side})")
        except TypeError as e:
            raise ValueError(f"window_size ({side}): expected an int >= -1 (-1: unbounded), got {value!r}") from e
        if value < -1:
            raise ValueError(f"window_size ({side}): expected an int >= -1 (-1: unbounded), got {value!r}")
        if value >= FLASH_WINDOW_LIMIT:
            raise ValueError(f"window_size ({side}): expected below 2^31, got {value!r}")
        sides.append(value)
    return (sides[0], sides[1])


def flash_softcap(softcap) -> float:
    """FlashAttention's softcap: a finite number >= 0 (0: none), of any real type (as_real)."""
    try:
        value = as_real(softcap, "softcap")
    except TypeError:
        raise ValueError(f"softcap: expected a number >= 0 (0: none), got {softcap!r}") from None
    if not value >= 0.0:
        raise ValueError(f"softcap: expected a number >= 0 (0: none), got {softcap!r}")
    if not math.isfinite(value):
        raise ValueError(f"softcap: expected a finite number, got {softcap!r}")
    return value


_INT_DTYPE = re.compile(r"(torch\.)?u?int(8|16|32|64)")
_REAL_DTYPE = re.compile(r"(torch\.)?(u?int(8|16|32|64)|float(16|32|64)|bfloat16|half|double)")


def _scalar_of(value, name: str, what: str, dtypes: re.Pattern):
    """The value of a 0-d array (PyTorch, NumPy, CuPy) whose dtype matches `dtypes`, as a Python number; a
    CUDA tensor's value is read to the host (a sync, as int(tensor) would)."""
    shape = tuple(value.shape)
    if shape != ():
        raise ValueError(f"{name}: expected {what} or a 0-d tensor, got a tensor of shape {list(shape)}")
    if not dtypes.fullmatch(str(value.dtype)):
        raise TypeError(f"{name}: expected {what}, got a 0-d tensor of dtype {value.dtype}")
    return value.item()


def as_int(value, name: str) -> int:
    """An integer argument of any integer type: a Python int, a NumPy integer, or a 0-d integer tensor
    (PyTorch, NumPy, CuPy). A bool, a float, another type (TypeError) or a tensor of another shape (ValueError)
    is refused with an error naming `name`."""
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected an integer, got {value!r}")
    if isinstance(value, numbers.Integral):
        return int(value)
    if is_array(value):
        return int(_scalar_of(value, name, "an integer", _INT_DTYPE))
    raise TypeError(f"{name}: expected an integer, got {value!r}")


def as_real(value, name: str) -> float:
    """A real argument of any real type: a Python or NumPy number, or a 0-d integer or floating tensor; refused
    as as_int refuses."""
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected a number, got {value!r}")
    if isinstance(value, numbers.Real):
        return float(value)
    if is_array(value):
        return float(_scalar_of(value, name, "a number", _REAL_DTYPE))
    raise TypeError(f"{name}: expected a number, got {value!r}")


def check_dim(dim) -> int:
    """A head dimension: an int (the kernels' range is checked where they are compiled: check_head_dim)."""
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim: expected an int head dimension, got {dim!r}")
    return dim


def check_head_dim(dim: int) -> None:
    """The head dims fagen takes: any from 8 to 256, as FlashAttention (the kernels are compiled at the next
    multiple of 8 of at least 32, and the runtime pads q, k, v with zero columns: backend.spec.kernel_head_dim)."""
    if not (MIN_HEAD_DIM <= dim <= MAX_HEAD_DIM):
        raise ValueError(f"dim: expected a head dimension between {MIN_HEAD_DIM} and {MAX_HEAD_DIM}, got {dim}")


def check_scale(scale) -> float | None:
    """A softmax scale: None (the program's default) or a finite positive number."""
    if scale is None:
        return None
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale: expected a finite positive number, got {scale!r}")
    if not math.isfinite(float(scale)) or float(scale) <= 0.0:
        raise ValueError(f"scale: expected a finite positive number, got {scale!r}")
    return float(scale)


def read_ir_file(path: Path) -> str:
    """An .ir file's text; errors name the file (and the line of a byte that is not UTF-8)."""
    try:
        if path.stat().st_size > MAX_IR_BYTES:
            raise ValueError(
                f"ir: {str(path)!r} is {path.stat().st_size} bytes; an ir program is at most {MAX_IR_BYTES} bytes"
            )
        data = path.read_bytes()
    except OSError as e:
        raise ValueError(f"ir: cannot read {str(path)!r}: {e.strerror}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise ValueError(
            f"ir: {str(path)}:{line}: not UTF-8 text (byte {data[e.start]:#04x} at offset {e.start}); "
            "an ir program is a text file"
        ) from None


# --- traced functions and the tensors they read ---------------------------------------------------------------
def is_array(x) -> bool:
    return type(x).__module__.split(".")[0] in ("torch", "cupy", "numpy") and hasattr(x, "dtype")


def _array_key(x) -> tuple:
    """A captured tensor as part of a request: its library, dtype and rank (its values and sizes are read at each
    call, so a new tensor of the same dtype and rank reuses the kernel)."""
    return ("array", type(x).__module__.split(".")[0], str(x.dtype), len(x.shape))


# what reads a captured tensor's sizes: the attributes, and the reductions of a row (its length: variants._Row)
SIZE_NAMES = frozenset({"shape", "size", "numel", "ndim", "dim", "len", "sum", "mean", "prod", "amax", "amin", "norm"})


@functools.lru_cache(maxsize=256)
def _reads_sizes(code) -> bool:
    """Whether a function's code (its nested functions' included) names a size attribute or len."""
    return bool(SIZE_NAMES & set(code.co_names)) or any(
        _reads_sizes(c) for c in code.co_consts if hasattr(c, "co_names")
    )


def _cell_key(value, sizes: bool = False):
    """A closure value as part of a function's key: an array by dtype and rank (and its shape where the function
    reads sizes: they are constants of its kernel), a list of numbers (a table the kernel holds) by its values,
    anything else itself."""
    if is_array(value):
        return _array_key(value) + ((tuple(value.shape),) if sizes else ())
    if (table := _frozen_table(value)) is not None:
        return ("list", table)
    return value


def _frozen_table(value, depth: int = 0) -> tuple | None:
    """A list (or tuple) of numbers, or of such lists, as nested tuples (hashable: a function's key by the values);
    None for anything else. Wider than what a kernel may index (variants._is_table: no empty list, no bools alone,
    its depth and size bounded), so that any nested number list a function captures keys it by value."""
    if type(value) not in (list, tuple) or depth > 4:
        return None
    items = [v if isinstance(v, (int, float)) else _frozen_table(v, depth + 1) for v in value]
    return None if any(v is None for v in items) else tuple(items)


def function_key(fn):
    """A traced function as part of a request: its code, defaults and closure values where they are hashable
    (so a lambda written inline in a model's forward compiles once, not on every call), else the function.
    Captured tensors (closure cells and the globals its code names) count by dtype and rank only."""
    if fn is None:
        return None
    try:
        sizes = _reads_sizes(fn.__code__)
        cells = tuple(_cell_key(c.cell_contents, sizes) for c in (fn.__closure__ or ()))
        module = fn.__globals__
        names = fn.__code__.co_names
        arrays = tuple((n, _cell_key(module[n], sizes)) for n in names if n in module and is_array(module[n]))
        key = (fn.__code__, fn.__defaults__, cells, arrays)
        hash(key)
        return key
    except (AttributeError, TypeError, ValueError):
        return fn


def captures(source: Source) -> dict:
    """The tensors the traced functions of `source` capture: name -> (function, variants.Captured, role), role
    'mask' or 'score_mod'; a name the two functions capture must name one object."""
    if not isinstance(source, Options) or not source.is_traced:
        return {}
    from .ir import variants

    out: dict = {}
    for fn, what in ((source.mask, "mask"), (source.score_mod, "score_mod")):
        if fn is None:
            continue
        for c in variants.captured(fn, what):
            if c.name in out and out[c.name][1].raw(out[c.name][0]) is not c.raw(fn):
                raise ValueError(f"{what}: the captured tensor {c.name!r} is also another object of the mask")
            out.setdefault(c.name, (fn, c, what))
    return out


def tensor_dtypes_of(given: dict | None, source: Source) -> tuple[tuple[str, str], ...]:
    """Every call-time tensor's dtype that is not float32, by name (fagen's names): the captured objects' own,
    then the given ones. A captured object's dtype that no kernel takes is kept as the library names it, an error
    only where the program reads the object (Request.program_dtypes)."""
    from .backend.contract import tensor_dtype

    caught = captures(source)
    out = {name: _captured_dtype(getattr(c.value(fn), "dtype", None), name) for name, (fn, c, _) in caught.items()}
    for name, d in (given or {}).items():
        if not isinstance(name, str):
            raise TypeError(f"tensor_dtypes: expected tensor names as keys, got {name!r}")
        if name in caught and out[name] != tensor_dtype(d, name):
            raise ValueError(f"tensor_dtypes: {name} is captured with dtype {out[name]}; drop it from tensor_dtypes")
        out[name] = tensor_dtype(d, name)
    return tuple((n, d) for n, d in sorted(out.items()) if d != "f32")


def _captured_dtype(dtype, name: str) -> str:
    """fagen's name of a captured object's dtype, else the library's (a dtype no kernel takes: float64, ...)."""
    from .backend.contract import tensor_dtype

    try:
        return tensor_dtype(dtype, name)
    except TypeError:
        return str(dtype).replace("torch.", "")


def tensors_read(program) -> frozenset[str]:
    """The names of the call-time tensors a program reads: name[...] in any of its nodes' expressions."""
    import sympy as sp

    return frozenset(
        str(r.base.label)
        for node in program.nodes()
        for _, value in node.attrs
        if isinstance(value, sp.Basic)
        for r in value.atoms(sp.Indexed)
    )


# --- the arch rule ----------------------------------------------------------------------------------------------
def resolve_arch(arch) -> str:
    """The arch asked for (normalized), else the current GPU's, else sm_90a."""
    return normalize_arch(arch) if arch is not None else (detect_arch() or "sm_90a")


def device_arch(device: tuple) -> str | None:
    """The arch of a device (library, device type, index) as the front-ends name it; None off CUDA."""
    from .backend.spec import arch_of

    lib, kind, index = device
    if kind != "cuda":
        return None
    if lib == "torch":
        import torch

        return arch_of(*torch.cuda.get_device_capability(index))
    import cupy

    return arch_of(*divmod(int(cupy.cuda.Device(index).compute_capability), 10))


def detect_arch() -> str | None:
    """The arch of the current CUDA device, or None where there is no GPU. Asks the CUDA driver itself (ctypes)
    unless CuPy is loaded already: importing CuPy to learn one number would cost more than a cached compile."""
    import sys

    from .backend.spec import arch_of

    if "cupy" in sys.modules:
        try:
            cupy = sys.modules["cupy"]
            if cupy.cuda.runtime.getDeviceCount() < 1:
                return None
            cc = int(cupy.cuda.Device().compute_capability)
        except Exception:
            return None
        return arch_of(*divmod(cc, 10))
    found = _driver_compute_capability()
    return None if found is None else arch_of(*found)


def _driver_compute_capability() -> tuple[int, int] | None:
    """(major, minor) of the current context's device (device 0 where no context is current), from libcuda."""
    import ctypes
    import sys

    try:
        lib = ctypes.WinDLL("nvcuda.dll") if sys.platform == "win32" else ctypes.CDLL("libcuda.so.1")  # type: ignore[attr-defined]
        if lib.cuInit(0) != 0:
            return None
        count, ctx, dev = ctypes.c_int(0), ctypes.c_void_p(), ctypes.c_int(0)
        if lib.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value < 1:
            return None
        if lib.cuCtxGetCurrent(ctypes.byref(ctx)) == 0 and ctx.value:
            if lib.cuCtxGetDevice(ctypes.byref(dev)) != 0:
                return None
        major, minor = ctypes.c_int(0), ctypes.c_int(0)
        if (
            lib.cuDeviceGetAttribute(ctypes.byref(major), 75, dev) != 0
            or lib.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev) != 0
        ):  # COMPUTE_CAPABILITY_MAJOR/MINOR
            return None
    except (OSError, AttributeError):
        return None
    return major.value, minor.value


__all__ = [
    "Request",
    "Options",
    "Flash",
    "IR",
    "for_compile",
    "for_flash",
    "detect_arch",
    "SpecError",
]
