"""Products and lookups on GGUF block-quantized weights: the C kernels of csrc/qgemm.c through ctypes.

``quantized_linear`` computes ``x @ W.T`` reading W's blocks as stored (activations quantized per group
of 32 to int8, integer dot products; see the C file for the error bound); ``dequantize`` expands rows
to float32/bf16 (embedding lookups, and the prefill path that hands a dequantized tile to torch's GEMM).
``repack`` rewrites a Q4_0/Q4_1/Q8_0/Q5_0/Q5_1/Q4_K/Q5_K/Q6_K weight into its tiled layout (same bytes,
16 rows interleaved per group of 32; csrc/qg_tiles.h and csrc/qg_tiles_kq.h), which both take as well and which the SIMD builds multiply several times faster
(``tiled_preferred``).
Built on first use for the ISA path of ``tokenmill.csrc_build`` (plus AVX-512 VNNI where the CPU
reports it).
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from tokenmill import csrc_build
from tokenmill.csrc_build import DEFAULT_FLAGS, CLibrary
from tokenmill.huge_pages import zeros_on_huge_pages
from tokenmill.quantization.formats import TILED, TILED_FORMATS, QuantizedTensor, block_size, is_tiled, qtype_name

_SOURCE = Path(__file__).parent / "csrc" / "qgemm.c"
_FLAGS = DEFAULT_FLAGS
_VNNI_FLAGS = ("-mavx512vnni", "-DTM_VNNI")
_AMX_FLAGS = ("-mamx-tile", "-mamx-int8", "-DTM_AMX")
_AMX_BF16_FLAGS = ("-mamx-bf16", "-DTM_AMX_BF16")


def _setup(lib: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.qg_linear.argtypes = [i32, p, i64, i64, p, i32, i64, p, i32, i64, i32]
    lib.qg_linear.restype = i32
    lib.qg_dequantize.argtypes = [i32, p, i64, p, i64, p, i32, i32]
    lib.qg_dequantize.restype = None
    lib.qg_dequantize_rows.argtypes = [i32, p, i64, i64, p, i64, p, i32, i32]
    lib.qg_dequantize_rows.restype = None
    lib.qg_repack.argtypes = [i32, p, i64, i64, p]
    lib.qg_repack.restype = i32
    lib.qg_tiled_preferred.argtypes = []
    lib.qg_tiled_preferred.restype = ctypes.c_int
    lib.qg_isa.argtypes = []
    lib.qg_isa.restype = ctypes.c_char_p
    lib.qg_vnni.argtypes = []
    lib.qg_vnni.restype = ctypes.c_int
    lib.qg_amx.argtypes = []
    lib.qg_amx.restype = ctypes.c_int
    lib.qg_set_amx.argtypes = [ctypes.c_int]
    lib.qg_set_amx.restype = ctypes.c_int
    lib.qg_linear_bf16.argtypes = [i32, p, i64, i64, p, i64, p, i32, i64, i32]
    lib.qg_linear_bf16.restype = i32
    lib.qg_amx_bf16.argtypes = []
    lib.qg_amx_bf16.restype = ctypes.c_int


def flags_for(isa: str) -> tuple[str, ...]:
    """The build flags for ``isa``: VNNI is added on the AVX-512 paths when this CPU has avx512_vnni, and
    AMX (int8 tiles, for products of 16 or more rows) when it also has amx_tile and amx_int8 and the
    compiler knows the AMX flags (gcc 11+, clang 12+; an older one builds the VNNI path); on the
    avx512_bf16 path also AMX bf16 tiles (``bf16_linear``) when the CPU has amx_bf16."""
    flags = csrc_build.cpu_flags()
    if isa.startswith("avx512") and "avx512_vnni" in flags:
        if {"amx_tile", "amx_int8"} <= flags and csrc_build.compiler_accepts(_AMX_FLAGS[:2]):
            if (isa == "avx512_bf16" and "amx_bf16" in flags
                    and csrc_build.compiler_accepts((*_AMX_FLAGS[:2], _AMX_BF16_FLAGS[0]))):
                return (*_FLAGS, *_VNNI_FLAGS, *_AMX_FLAGS, *_AMX_BF16_FLAGS)
            return (*_FLAGS, *_VNNI_FLAGS, *_AMX_FLAGS)
        return (*_FLAGS, *_VNNI_FLAGS)
    return _FLAGS


library = CLibrary(_SOURCE, "qgemm", _setup, flags_for, unavailable=(
    "the quantized-weight CPU kernels are unavailable (no C compiler, build failed, or "
    "TOKENMILL_DISABLE_CPU_KERNELS=1); load the model with quantization='none'"))
# this process's build (None, or RuntimeError from _get_lib, when unavailable); tests pin another ISA
# path's with monkeypatch.setattr(library, "built", ...)
_built = library.built
_get_lib = library.get
_load = library.load  # any ISA path's build, not cached (tests compare the paths)
available = library.available


def isa() -> str:
    """The build's path: "portable", "avx2", "avx512" or "avx512_bf16", with "+vnni" where the AVX-512
    VNNI product is built in, "+amx" where products of 16 or more rows run on AMX tiles and "+amx_bf16"
    where ``bf16_linear`` runs on AMX bf16 tiles. RuntimeError
    when unavailable."""
    lib = library.get()
    return (lib.qg_isa().decode() + ("+vnni" if lib.qg_vnni() else "") + ("+amx" if lib.qg_amx() else "")
            + ("+amx_bf16" if lib.qg_amx_bf16() else ""))


def quantized_linear(x: torch.Tensor, data: torch.Tensor, qtype: int, n: int, k: int,
                     out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y = x @ W.T with W [n, k] in GGUF format ``qtype`` (``data`` [n, row bytes] uint8, as stored).

    x: [M, k] float32 or bfloat16 on CPU. ``out``: an [M, n] float32/bf16 view whose rows may be strided
    (a column slice of a fused projection's output); else a new tensor in ``out_dtype`` (default
    x's dtype). Each row of y depends only on the same row of x (batch invariant); per group of 32
    the error against float products of the dequantized weights is at most 0.5 * max|x_group| / 127 *
    sum|w_group| plus float rounding.

    Raises:
        ValueError: wrong shapes, dtypes or devices, or an unsupported ``qtype``.
        RuntimeError: the kernels are unavailable.
    """
    return _linear(library.get(), x, data, qtype, n, k, out, out_dtype)


def _operands(name: str, x: torch.Tensor, data: torch.Tensor, n: int, k: int, out: torch.Tensor | None,
              out_dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The checks both products make: x [M, k] (returned contiguous), data a contiguous CPU uint8 [n, row
    bytes], and ``out`` (a new [M, n] tensor in ``out_dtype``, default x's, when None) float32/bf16 with a unit
    column stride. Raises ValueError naming ``name``."""
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"{name}: x must be [M, {k}], got {tuple(x.shape)}")
    if (data.dtype != torch.uint8 or data.dim() != 2 or data.shape[0] != n or not data.is_contiguous()
            or data.device.type != "cpu"):
        raise ValueError(f"{name}: data must be contiguous uint8 [{n}, row bytes] on CPU, got "
                         f"{data.dtype} {tuple(data.shape)} on {data.device}")
    x = x.contiguous()
    m = x.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=out_dtype or x.dtype)
    if out.shape != (m, n) or out.dtype not in (torch.float32, torch.bfloat16) or out.stride(1) != 1:
        raise ValueError(f"{name}: out must be [{m}, {n}] float32/bf16 with unit column stride")
    return x, out


def _linear(lib: ctypes.CDLL, x: torch.Tensor, data: torch.Tensor, qtype: int, n: int, k: int,
            out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    qtype_name(qtype)
    if x.dtype not in (torch.float32, torch.bfloat16) or x.device.type != "cpu":
        raise ValueError(f"quantized_linear: x must be float32 or bfloat16 on CPU, got {x.dtype} on {x.device}")
    x, out = _operands("quantized_linear", x, data, n, k, out, out_dtype)
    m = x.shape[0]
    if m == 0:
        return out
    rc = lib.qg_linear(qtype, data.data_ptr(), n, k, x.data_ptr(), int(x.dtype == torch.bfloat16), m,
                       out.data_ptr(), int(out.dtype == torch.bfloat16), out.stride(0), torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"quantized_linear: {qtype_name(qtype)} cannot take in_features {k} "
                         f"(a multiple of {block_size(qtype)} is needed)")
    return out


def amx_bf16() -> bool:
    """True when ``bf16_linear`` runs on this machine (a build with AMX bf16 tiles, granted by Linux, not
    turned off by TOKENMILL_DISABLE_AMX=1); False when the kernels are unavailable."""
    lib = library.built()
    return bool(lib is not None and lib.qg_amx_bf16())


def bf16_linear(x: torch.Tensor, data: torch.Tensor, qtype: int, n: int, k: int,
                out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """y = x @ W.T on AMX bf16 tiles: the float32 product of the bf16 activations ``x`` [M, k] and the
    weight's bf16-rounded values (the bits ``dequantize`` gives in bf16), accumulated in float32 over the
    whole of k. ``data``: a Q4_0/Q4_1/Q8_0 weight in the tiled layout, n a multiple of 16. ``out`` /
    ``out_dtype`` as in ``quantized_linear``.

    Each row's result depends only on that row (not on M nor the thread count), but it is not the int8
    kernel's: unlike ``quantized_linear`` it does not quantize the activations, so the two differ by up to
    that kernel's error bound. A plan that switches between them by row count is therefore not batch
    invariant, and deterministic mode never uses this. Returns None where it does not apply (no AMX bf16
    here, x not a bf16 CPU tensor, or another layout): the caller runs ``quantized_linear``.

    Raises:
        ValueError: wrong shapes, or data that is not a contiguous uint8 [n, row bytes] tensor.
    """
    lib = library.built()
    if (lib is None or x.dtype != torch.bfloat16 or x.device.type != "cpu" or not is_tiled(qtype) or n % 16
            or not lib.qg_amx_bf16()):
        return None
    x, out = _operands("bf16_linear", x, data, n, k, out, out_dtype)
    m = x.shape[0]
    rc = lib.qg_linear_bf16(qtype, data.data_ptr(), n, k, x.data_ptr(), m, out.data_ptr(),
                            int(out.dtype == torch.bfloat16), out.stride(0), torch.get_num_threads())
    if rc == -2:
        return None
    if rc != 0:
        raise MemoryError("bf16_linear: allocation failed")
    return out


def dequantize(data: torch.Tensor, qtype: int, k: int, ids: torch.Tensor | None = None,
               dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of a GGUF-format weight as floats: all rows ([N, k]) or rows ``ids`` ([len(ids), k], int64).

    ``out``: a contiguous [rows, k] tensor of ``dtype`` to write into (the prefill path reuses one
    buffer per step instead of allocating, and page-faulting, a fresh weight per layer); else a new one.

    Raises:
        ValueError: an unsupported type or dtype, ids out of range, or an ``out`` of the wrong shape.
        RuntimeError: the kernels are unavailable.
    """
    return _dequantize(library.get(), data, qtype, k, ids, dtype, out)


def _dequantize(lib: ctypes.CDLL, data: torch.Tensor, qtype: int, k: int, ids: torch.Tensor | None,
                dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    qtype_name(qtype)
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dequantize: dtype must be float32 or bfloat16, got {dtype}")
    data = data.contiguous()
    if ids is not None:
        ids = ids.to(torch.int64).contiguous().view(-1)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= data.shape[0]):
            raise ValueError(f"dequantize: row ids must be in [0, {data.shape[0]})")
    rows = data.shape[0] if ids is None else ids.numel()
    if out is None:
        out = torch.empty(rows, k, dtype=dtype)
    elif out.shape != (rows, k) or out.dtype != dtype or not out.is_contiguous() or out.device.type != "cpu":
        raise ValueError(f"dequantize: out must be a contiguous CPU {dtype} tensor of shape [{rows}, {k}]")
    if rows:
        lib.qg_dequantize_rows(qtype, data.data_ptr(), data.shape[0], k, None if ids is None else ids.data_ptr(),
                               rows, out.data_ptr(), int(dtype == torch.bfloat16), torch.get_num_threads())
    return out


def tiled_preferred() -> bool:
    """True when this process's build multiplies the tiled layout faster than the stored one (the x86
    SIMD paths; the portable and NEON builds keep the stored layout). False when unavailable."""
    lib = library.built()
    return lib is not None and bool(lib.qg_tiled_preferred())


def repack(weight: QuantizedTensor, out: torch.Tensor | None = None) -> QuantizedTensor:
    """``weight`` (any of ``TILED_FORMATS``, as stored) in the tiled layout: a tensor of the same bytes and
    shape, type id + ``TILED``; rows past the last whole tile of 16 stay as stored. Tiles are row-local (tile t
    holds rows 16t..16t+15 in their bytes), so row blocks of whole tiles repacked apart, side by side, equal the
    stacked weight repacked. ``out``: where to write it (uint8, contiguous, ``weight.data``'s shape: a view of
    the tile cache's file, a slice of a larger segment); default a new tensor on transparent huge pages.

    Raises:
        ValueError: a format without a tiled layout (or one already tiled), or an ``out`` of another shape,
            dtype or layout.
        RuntimeError: the kernels are unavailable.
    """
    return _repack(library.get(), weight, out)


def _repack(lib: ctypes.CDLL, weight: QuantizedTensor, out: torch.Tensor | None = None) -> QuantizedTensor:
    if weight.qtype not in TILED_FORMATS:
        raise ValueError(f"repack: {qtype_name(weight.qtype)}{' (tiled)' if is_tiled(weight.qtype) else ''} "
                         f"has no tiled layout to repack into")
    n, k = weight.shape
    src = weight.data.contiguous()
    if out is not None:
        if out.shape != src.shape or out.dtype != torch.uint8 or not out.is_contiguous() or out.device != src.device:
            raise ValueError(f"repack: out must be a contiguous uint8 tensor of shape {tuple(src.shape)}, got "
                             f"{out.dtype} {tuple(out.shape)}")
    # On transparent huge pages where Linux allows (madvise): a single-row product streams the whole weight, and
    # on 4 KiB pages it pays a TLB miss every 4 KiB (Llama-3.2-1B-shape Q4_K_M batch-1 decode, 2-core Xeon:
    # 21.9 tok/s on 4 KiB pages, 25.7 on huge pages).
    elif src.device.type == "cpu":
        out = zeros_on_huge_pages(tuple(src.shape), torch.uint8, src.device)
    else:
        out = torch.empty_like(src)
    rc = lib.qg_repack(weight.qtype, src.data_ptr(), n, k, out.data_ptr())
    assert rc == 0, "QuantizedTensor checked the format and in_features"
    return QuantizedTensor(weight.qtype + TILED, weight.shape, out)

