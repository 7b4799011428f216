"""Fast CPU decode attention: a small C kernel (csrc/paged_decode.c) built on first use, called via ctypes.

The kernel reads each sequence's K/V straight from the paged cache (no gather copy) and is
compared against the torch reference in torch_paged.py by tests. If no C compiler is present,
``available()`` is False and callers use the reference path.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_decode.c"
_lib: ctypes.CDLL | None = None
_tried = False


def _cache_dir() -> Path:
    root = os.environ.get("TOKENMILL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tokenmill")
    return Path(root) / "kernels"


def _build() -> ctypes.CDLL | None:
    source = _SOURCE.read_bytes()
    flags = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
    digest = hashlib.sha256(source + " ".join(flags).encode()).hexdigest()[:16]
    target = _cache_dir() / f"paged_decode-{digest}.so"
    if not target.exists():
        compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if compiler is None:
            logger.warning("no C compiler found: CPU decode attention uses the slower torch reference path")
            return None
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / target.name
            result = subprocess.run([compiler, *flags, str(_SOURCE), "-o", str(out), "-lm"], capture_output=True, text=True)
            if result.returncode != 0:
                logger.warning("building the CPU decode kernel failed, using the torch path:\n%s", result.stderr)
                return None
            os.replace(out, target)  # atomic: concurrent builders never see a partial file
    lib = ctypes.CDLL(str(target))
    argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int]
    for name in ("paged_decode_f32", "paged_decode_bf16"):
        getattr(lib, name).argtypes = argtypes
        getattr(lib, name).restype = None
    return lib


def _get_lib() -> ctypes.CDLL | None:
    global _lib, _tried
    if not _tried:
        _tried = True
        if os.environ.get("TOKENMILL_DISABLE_CPU_KERNELS", "0") != "1":
            _lib = _build()
    return _lib


def available() -> bool:
    """True if the compiled kernel can be used in this process."""
    return _get_lib() is not None


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Decode attention straight from the paged cache.

    query: [B, num_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads, head_dim];
    block_table: [B, max_blocks] int64; seq_lens: [B] int64 (keys per sequence, >= 1).
    Returns [B, num_heads, head_dim] in query's dtype. dtype float32 or bfloat16, CPU only.
    """
    lib = _get_lib()
    assert lib is not None, "CPU decode kernel is not available"
    assert query.dtype == k_cache.dtype == v_cache.dtype and query.dtype in (torch.float32, torch.bfloat16)
    query = query.contiguous()
    block_table = block_table.contiguous()
    seq_lens = seq_lens.contiguous()
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty_like(query)
    fn = lib.paged_decode_bf16 if query.dtype == torch.bfloat16 else lib.paged_decode_f32
    fn(
        query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_table.data_ptr(), seq_lens.data_ptr(),
        out.data_ptr(), num_seqs, num_heads, num_kv_heads, head_dim, block_size, block_table.shape[1],
        float(scale), torch.get_num_threads(),
    )
    return out
