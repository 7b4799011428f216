"""Large CPU tensors backed by transparent huge pages where the kernel allows it.

The paged KV cache is read in scattered 16-token blocks by decode attention; with 4 KiB pages nearly every
block read misses the TLB (a 500 MB working set spans 120k pages), and on the project's 2-core EPYC the
AVX512_BF16 decode kernel read 9.5 GB/s of cache from 4 KiB pages against 11.2 GB/s from 2 MiB pages
(benchmarks/RESULTS.md, "Decode attention"). Linux hands out 2 MiB pages to anonymous memory that asks for
them with madvise(MADV_HUGEPAGE) when /sys/kernel/mm/transparent_hugepage/enabled is "madvise" (or
"always"); other systems keep ordinary pages and lose nothing.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import sys

import torch

logger = logging.getLogger(__name__)

_MADV_HUGEPAGE = 14  # <sys/mman.h>, Linux
_HUGE_PAGE = 2 << 20


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc


def advise_huge_pages(tensor: torch.Tensor) -> int:
    """Ask Linux to back ``tensor``'s storage with transparent huge pages (madvise MADV_HUGEPAGE over the
    whole 2 MiB pages inside it). Call it before the memory is first written: pages already faulted in
    stay small until khugepaged merges them.

    Returns the bytes advised (0 on CPU-less devices, non-Linux systems, storage smaller than a huge page,
    or when the kernel refuses, e.g. THP compiled out; a refusal is logged at debug level). Never raises.
    """
    if tensor.device.type != "cpu":
        return 0
    libc = _libc()
    if libc is None:
        return 0
    start = tensor.untyped_storage().data_ptr()
    end = start + tensor.untyped_storage().nbytes()
    first = -(-start // _HUGE_PAGE) * _HUGE_PAGE
    last = end // _HUGE_PAGE * _HUGE_PAGE
    if last <= first:
        return 0
    if libc.madvise(first, last - first, _MADV_HUGEPAGE) != 0:
        logger.debug("madvise(MADV_HUGEPAGE) refused: errno %d", ctypes.get_errno())
        return 0
    return last - first


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype, device=device)``; on CPU its memory is first advised onto huge pages
    (``advise_huge_pages``), then zeroed.

    Raises:
        RuntimeError / MemoryError: as torch.zeros does when the allocator refuses.
    """
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    tensor = torch.empty(shape, dtype=dtype, device=device)
    advise_huge_pages(tensor)
    return tensor.zero_()
