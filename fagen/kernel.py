"""The callable kernel: checks its arguments, loads the cubin through CuPy and launches it.

CuPy arrays and PyTorch CUDA tensors are both taken without a copy (their device pointers and strides are
passed to the kernel as they are), and the result comes back as the same kind. Any strides work, so
[B, H, N, D] tensors and [B, N, H, D] tensors viewed as [B, H, N, D] run without a copy.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from .build import Binary, Resources, compile_ptx
from .spec import KernelSpec

TYPE_CHECKING = False   # typing.TYPE_CHECKING, without importing typing
if TYPE_CHECKING:
    from .ir import Program

LOG2E = 1.0 / math.log(2.0)
_TORCH_DTYPES = {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}
_CUPY_DTYPES = {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}


@dataclass(frozen=True)
class _Tensor:
    """What the launcher needs of an array, whatever library it came from."""
    kind: str            # "cupy" or "torch"
    obj: object
    ptr: int
    shape: tuple
    strides: tuple       # in elements
    dtype: str | None    # fagen dtype name, None if unsupported
    dtype_name: str
    device: int


def _describe(name: str, x) -> _Tensor:
    mod = type(x).__module__
    if mod.startswith("torch"):
        import torch
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a CuPy array or a PyTorch CUDA tensor, got {type(x).__name__}")
        if not x.is_cuda:
            raise TypeError(f"{name}: expected a CUDA tensor, got a tensor on {x.device} (host memory); "
                            "move it with .cuda()")
        dname = str(x.dtype).replace("torch.", "")
        return _Tensor("torch", x, x.data_ptr(), tuple(x.shape), tuple(x.stride()), _TORCH_DTYPES.get(dname),
                       dname, x.device.index)
    if mod.startswith("cupy"):
        import cupy
        if not isinstance(x, cupy.ndarray):
            raise TypeError(f"{name}: expected a CuPy array or a PyTorch CUDA tensor, got {type(x).__name__}")
        item = x.dtype.itemsize
        if any(s % item for s in x.strides):
            raise ValueError(f"{name}: strides {x.strides} (bytes) are not multiples of the element size {item}")
        dname = x.dtype.name
        return _Tensor("cupy", x, x.data.ptr, tuple(x.shape), tuple(s // item for s in x.strides),
                       _CUPY_DTYPES.get(dname), dname, x.device.id)
    import numpy as np
    if isinstance(x, np.ndarray):
        raise TypeError(f"{name}: expected a CuPy array or a PyTorch CUDA tensor, got a NumPy array "
                        "(host memory); copy it to the GPU first (cupy.asarray)")
    raise TypeError(f"{name}: expected a CuPy array or a PyTorch CUDA tensor, got {type(x).__name__}")


def _as_bhsd(x):
    """[total, H, D] as a [1, H, total, D] view (no copy)."""
    if type(x).__module__.startswith("torch"):
        return x.permute(1, 0, 2).unsqueeze(0)
    if type(x).__module__.startswith("cupy"):
        return x.transpose(1, 0, 2)[None]
    raise TypeError(f"expected a CuPy array or a PyTorch CUDA tensor, got {type(x).__name__}")


def _from_bhsd(x):
    return x[0].permute(1, 0, 2) if type(x).__module__.startswith("torch") else x[0].transpose(1, 0, 2)


def _new(t: _Tensor, shape, float32=False):
    return _empty_like_layout(t, shape, float32=float32)


def _fits_mma(tq: _Tensor, tk: _Tensor, tv: _Tensor, to: _Tensor) -> bool:
    """The mma tier loads rows with 16-byte cp.async and stores O in pairs: unit stride along D, row and
    head/batch strides that are multiples of 8 elements, 16-byte aligned bases (4-byte for O)."""
    for t in (tq, tk, tv):
        if t.strides[-1] != 1 or any(s % 8 for s in t.strides[:-1]) or t.ptr % 16:
            return False
    return to.strides[-1] == 1 and not any(s % 2 for s in to.strides[:-1]) and to.ptr % 4 == 0


def _torch_stream(cupy, stream, device):
    """PyTorch's current stream as a CuPy stream, so the launch is ordered with the caller's work."""
    if hasattr(cupy.cuda.Stream, "from_external"):
        return cupy.cuda.Stream.from_external(stream)
    return cupy.cuda.ExternalStream(stream.cuda_stream, device)


def _empty_like_layout(t: _Tensor, shape, dtype_from: _Tensor | None = None, float32: bool = False):
    """A new array of `shape`, same library/device as t; dense in t's memory order when shapes agree."""
    if t.kind == "torch":
        import torch
        dt = torch.float32 if float32 else t.obj.dtype
        if tuple(t.obj.shape) == tuple(shape) and not float32:
            return torch.empty_like(t.obj, dtype=dt)
        return torch.empty(shape, dtype=dt, device=t.obj.device)
    import cupy
    with cupy.cuda.Device(t.device):
        dt = cupy.float32 if float32 else t.obj.dtype
        if tuple(t.obj.shape) == tuple(shape) and not float32:
            return cupy.empty_like(t.obj, dtype=dt)
        return cupy.empty(shape, dtype=dt)


class Kernel:
    """A compiled attention kernel. Call it as `kernel(q, k, v, scale=None, return_lse=False)`."""

    def __init__(self, spec: KernelSpec, program: Program | str, source: str, binary: Binary, *,
                 default_scale: float, smem_bytes: int, tier_reason: str = "", fallback=None,
                 tensors: tuple[str, ...] = (), tensor_index: dict[str, str] | None = None):
        self.spec = spec
        self._program = program              # the fused program, or its text (from the compile cache)
        self.source = source
        self.binary = binary
        self.default_scale = default_scale
        self.smem_bytes = smem_bytes
        self.tier_reason = tier_reason
        self._fallback_factory = fallback    # builds the simt kernel for inputs this tier cannot take
        self._fallback = None
        self._functions = {}
        self.tensors = tuple(tensors)          # call-time tensors the program reads (e.g. ALiBi's slopes)
        self._tensor_index = dict(tensor_index or {})   # name -> "h" or "b", when known without the program

    @property
    def program(self) -> Program:
        """The fused program; a kernel from the compile cache parses its text here, on first access."""
        if isinstance(self._program, str):
            from .ir import parse_program
            self._program = parse_program(self._program, source=f"<{self.spec.name}>")
        return self._program

    # --- what users read ---
    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def resources(self) -> Resources:
        return self.binary.resources

    @property
    def compile_seconds(self) -> float:
        return self.binary.compile_seconds

    def __repr__(self):
        return f"<fagen.Kernel {self.name}: {self.resources}>"

    def save(self, path) -> Path:
        """Write the kernel: .cu (the source), .cubin (the binary) or .ptx, by the file's suffix."""
        path = Path(path)
        if path.suffix == ".cubin":
            path.write_bytes(self.binary.cubin)
        elif path.suffix == ".ptx":
            path.write_text(compile_ptx(self.source, self.spec))
        elif path.suffix == ".cu":
            path.write_text(self.source)
        else:
            raise ValueError(f"path: expected a .cu, .ptx or .cubin file name, got {str(path)!r}")
        return path

    # --- launching ---
    def _function(self, device: int):
        fn = self._functions.get(device)
        if fn is None:
            import cupy
            from cupy.cuda import driver
            with cupy.cuda.Device(device):
                cc = cupy.cuda.Device(device).compute_capability      # e.g. "90"
                self._check_arch(int(cc[:-1]), int(cc[-1]), device)
                module = cupy.cuda.function.Module()
                module.load(self.binary.cubin)
                fn = module.get_function(self.spec.name)
                driver.funcSetAttribute(fn.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                        self.smem_bytes)
                self._functions[device] = (module, fn)
            return fn
        return fn[1]

    def _check_arch(self, major: int, minor: int, device: int):
        arch = self.spec.arch
        want_major, want_minor = int(arch[3]), int(arch[4])
        ok = major == want_major and minor >= want_minor and (not arch.endswith("a") or minor == want_minor)
        if not ok:
            raise ValueError(f"kernel {self.name} was compiled for {arch}; device {device} has compute capability "
                             f"{major}.{minor}: compile with arch='sm_{major}{minor}{'a' if major >= 9 else ''}'")

    def __call__(self, q, k, v, *, scale: float | None = None, return_lse: bool = False, out=None, out_lse=None,
                 **tensors):
        """Attention of q [B, H, M, D] over k, v [B, Hkv, N, D]; tensors the program reads by name."""
        tq, tk, tv = _describe("q", q), _describe("k", k), _describe("v", v)
        self._check(tq, tk, tv)
        B, H, M, D = tq.shape
        return self._run(q, k, v, tq, tk, tv, B, H, M, tk.shape[2], scale, return_lse, out, out_lse, tensors, None)

    def varlen(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *,
               scale: float | None = None, return_lse: bool = False, **tensors):
        """FlashAttention's variable-length convention: q [total_q, H, D], k, v [total_k, Hkv, D] packed;
        sequence i is rows [cu_seqlens[i], cu_seqlens[i + 1]) (int32, B + 1 entries). Masks apply within each
        sequence. Returns o [total_q, H, D] (and lse [H, total_q])."""
        for name, x in (("q", q), ("k", k), ("v", v)):
            if len(getattr(x, "shape", ())) != 3:
                raise ValueError(f"{name}: expected 3 dimensions [total, heads, D] for varlen, got shape "
                                 f"{tuple(getattr(x, 'shape', ()))}")
        # [total, H, D] viewed as [1, H, total, D]: no copy
        views = [_as_bhsd(x) for x in (q, k, v)]
        tq, tk, tv = (_describe(n, x) for n, x in zip("qkv", views))
        self._check(tq, tk, tv)
        cq, ck = _describe("cu_seqlens_q", cu_seqlens_q), _describe("cu_seqlens_k", cu_seqlens_k)
        for name, t in (("cu_seqlens_q", cq), ("cu_seqlens_k", ck)):
            if len(t.shape) != 1 or t.shape[0] < 2 or t.dtype_name != "int32" or t.strides[0] != 1:
                raise ValueError(f"{name}: expected a contiguous int32 vector of B + 1 offsets, got shape {t.shape} "
                                 f"{t.dtype_name}")
            if t.kind != tq.kind or t.device != tq.device:
                raise TypeError(f"{name}: expected a {tq.kind} array on device {tq.device}")
        if cq.shape != ck.shape:
            raise ValueError(f"cu_seqlens_q, cu_seqlens_k: need the same number of sequences, got {cq.shape[0] - 1} "
                             f"and {ck.shape[0] - 1}")
        for name, n in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"{name}: expected a positive int, got {n!r}")
        B, H = cq.shape[0] - 1, tq.shape[1]
        o4 = _empty_like_layout(tq, tq.shape)
        lse = _new(tq, (H, tq.shape[2]), float32=True)
        lse4 = lse[None]
        result = self._run(views[0], views[1], views[2], tq, tk, tv, B, H, max_seqlen_q, max_seqlen_k, scale,
                           True, o4, lse4, tensors, (cq, ck))
        o = _from_bhsd(result[0])
        return (o, lse) if return_lse else o

    def _run(self, q, k, v, tq, tk, tv, B, H, M, N, scale, return_lse, out, out_lse, tensors, varlen):
        import numpy as np
        Hkv = tk.shape[1]
        if scale is None:
            scale = self.default_scale
        if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)) \
                or not math.isfinite(float(scale)) or float(scale) <= 0.0:
            raise ValueError(f"scale: expected a finite positive number, got {scale!r}")
        shape_o, shape_l = tq.shape, tq.shape[:3]
        o = self._output("out", out, tq, shape_o, float32=False) if out is not None \
            else _empty_like_layout(tq, shape_o)
        lse = self._output("out_lse", out_lse, tq, shape_l, float32=True) if out_lse is not None \
            else _empty_like_layout(tq, shape_l, float32=True)
        to, tl = _describe("out", o), _describe("out_lse", lse)
        extra = self._tensors(tensors, tq, B, H)
        if self.spec.tier == "mma" and not _fits_mma(tq, tk, tv, to):
            fb = self._simt()
            if varlen is None:
                return fb(q, k, v, scale=scale, return_lse=return_lse, out=o, out_lse=lse, **tensors)
            return fb._run(q, k, v, tq, tk, tv, B, H, M, N, scale, return_lse, o, lse, tensors, varlen)
        grid = (-(-M // self.spec.block_m), H, B)
        block = (self.spec.num_threads, 1, 1)
        i64, i32 = np.int64, np.int32

        def strides(t):   # varlen: sequences are found through cu_seqlens, not a batch stride
            return [i64(0 if varlen and n == 0 else s) for n, s in enumerate(t.strides)]
        args = (np.uint64(tq.ptr), np.uint64(tk.ptr), np.uint64(tv.ptr), np.uint64(to.ptr), np.uint64(tl.ptr),
                *strides(tq), *strides(tk), *strides(tv), *strides(to), *strides(tl),
                i32(H // Hkv), i32(M), i32(N), np.float32(float(scale) * LOG2E),
                np.uint64(varlen[0].ptr if varlen else 0), np.uint64(varlen[1].ptr if varlen else 0),
                *[np.uint64(t.ptr) for t in extra])
        self._launch(tq, grid, block, args)
        return (o, lse) if return_lse else o

    def _tensors(self, given: dict, tq: _Tensor, B: int, H: int) -> list[_Tensor]:
        """The call-time tensors, checked: float32, contiguous, [H] for name[h] or [B] for name[b]."""
        missing = [n for n in self.tensors if n not in given]
        unknown = [n for n in given if n not in self.tensors]
        if unknown:
            raise TypeError(f"{unknown[0]}: this kernel takes no tensor of that name "
                            f"(it takes: {', '.join(self.tensors) or 'none'})")
        if missing:
            raise TypeError(f"{missing[0]}: this kernel's program reads {missing[0]}[...]; pass {missing[0]}=...")
        out = []
        for name in self.tensors:
            t = _describe(name, given[name])
            if name not in self._tensor_index:
                from .codegen import tensor_index
                self._tensor_index[name] = tensor_index(self.program, name)
            by_batch = self._tensor_index[name] == "b"
            want = B if by_batch else H
            if t.kind != tq.kind or t.device != tq.device:
                raise TypeError(f"{name}: expected a {tq.kind} array on device {tq.device}")
            if t.dtype != "f32" or len(t.shape) != 1 or t.shape[0] != want or (want > 1 and t.strides[0] != 1):
                raise ValueError(f"{name}: expected a contiguous float32 vector of {want} "
                                 f"({'batch' if by_batch else 'heads'}), got shape {t.shape} {t.dtype_name}")
            out.append(t)
        return out

    def _simt(self) -> "Kernel":
        if self._fallback is None:
            if self._fallback_factory is None:
                raise ValueError(f"kernel {self.name} needs unit stride along D and 16-byte aligned rows "
                                 "(strides multiples of 8 elements); these inputs have neither and no fallback")
            self._fallback = self._fallback_factory()
        return self._fallback

    def _launch(self, t: _Tensor, grid, block, args):
        import cupy
        fn = self._function(t.device)
        with cupy.cuda.Device(t.device):
            if t.kind == "torch":
                import torch
                stream = _torch_stream(cupy, torch.cuda.current_stream(t.device), t.device)
            else:
                stream = cupy.cuda.get_current_stream()
            fn(grid, block, args, shared_mem=self.smem_bytes, stream=stream)

    def _check(self, tq: _Tensor, tk: _Tensor, tv: _Tensor):
        spec = self.spec
        for t, name in ((tq, "q"), (tk, "k"), (tv, "v")):
            if len(t.shape) != 4:
                raise ValueError(f"{name}: expected 4 dimensions [B, H, {'M' if name == 'q' else 'N'}, D], "
                                 f"got shape {t.shape}")
            if 0 in t.shape:
                raise ValueError(f"{name}: empty tensor (shape {t.shape}); every dimension must be at least 1")
            if t.shape[3] != spec.head_dim:
                raise ValueError(f"{name}: head dim {t.shape[3]} differs from the compiled head_dim {spec.head_dim}; "
                                 f"compile a kernel with dim={t.shape[3]}")
            if t.dtype != spec.dtype:
                raise TypeError(f"{name}: dtype {t.dtype_name} differs from the compiled dtype {spec.dtype}")
        if not (tq.kind == tk.kind == tv.kind):
            raise TypeError(f"q, k, v: mix of array libraries ({tq.kind}, {tk.kind}, {tv.kind}); pass one kind")
        if not (tq.device == tk.device == tv.device):
            raise ValueError(f"q, k, v: on different devices ({tq.device}, {tk.device}, {tv.device})")
        if not (tq.shape[0] == tk.shape[0] == tv.shape[0]):
            raise ValueError(f"q, k, v: batch sizes differ ({tq.shape[0]}, {tk.shape[0]}, {tv.shape[0]})")
        if tk.shape[:3] != tv.shape[:3]:
            raise ValueError(f"k, v: shapes {tk.shape} and {tv.shape} differ in [B, H, N]")
        if tq.shape[1] % tk.shape[1]:
            raise ValueError(f"q, k: query heads {tq.shape[1]} must be a multiple of key/value heads {tk.shape[1]}")
        if tq.shape[0] > 65535 or tq.shape[1] > 65535:
            raise ValueError(f"q: batch and heads must each be at most 65535, got shape {tq.shape}")
        if max(tq.shape[2], tk.shape[2]) >= 2 ** 31:
            raise ValueError("q, k: sequence lengths must be below 2^31")

    def _output(self, name, x, like: _Tensor, shape, float32: bool):
        t = _describe(name, x)
        want = "f32" if float32 else self.spec.dtype
        if t.kind != like.kind or t.device != like.device:
            raise TypeError(f"{name}: expected a {like.kind} array on device {like.device}")
        if t.shape != tuple(shape):
            raise ValueError(f"{name}: expected shape {tuple(shape)}, got {t.shape}")
        if t.dtype != want:
            raise TypeError(f"{name}: expected dtype {want}, got {t.dtype_name}")
        return x
