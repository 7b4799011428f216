"""Large CPU tensors backed by transparent huge pages where the kernel allows it.

The paged KV cache is read in scattered 16-token blocks by decode attention; with 4 KiB pages nearly every
block read misses the TLB (a 500 MB working set spans 120k pages), and on the project's 2-core EPYC the
AVX512_BF16 decode kernel read 9.5 GB/s of cache from 4 KiB pages against 11.2 GB/s from 2 MiB pages
(benchmarks/RESULTS.md, "Decode attention"). Repacked quantized weights live here too (``qgemm.repack``): a
batch-1 decode step streams every weight, and Llama-3.2-1B-shape Q4_K_M decoded at 21.9 tok/s from 4 KiB
pages against 25.7 from huge pages on a 2-core Xeon (a weight mapped from the tile cache's file gets the page
cache's large folios). Linux hands out 2 MiB pages to anonymous memory that asks for
them with madvise(MADV_HUGEPAGE) when /sys/kernel/mm/transparent_hugepage/enabled is "madvise" (or
"always"); other systems keep ordinary pages and lose nothing.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import math
import mmap
import sys
import threading
import time

import torch

logger = logging.getLogger(__name__)

_MADV_HUGEPAGE = 14  # <sys/mman.h>, Linux
_MADV_DONTNEED = 4
_MADV_POPULATE_WRITE = 23  # Linux 5.14+
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


def release_freed_heap() -> bool:
    """Hand the C heap's freed memory back to the system (glibc ``malloc_trim(0)``).

    Loading a GGUF file frees many megabyte-sized temporaries (merged gate/up blocks before their repack) from
    threads' malloc arenas, which glibc keeps for reuse rather than unmapping: after a first load of
    DeepSeek-V2-Lite Q8_0 (16.7 GB) the engine held 12 GB of freed anonymous memory beside its weights. The
    loader calls this once at the end. Returns whether it ran (False off glibc); never raises.
    """
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None) if libc is not None else None
    if trim is None:
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    trim(0)
    return True


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


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                        advise: bool = True) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype, device=device)``; on CPU, from 2 MiB up, the memory is an anonymous
    private mapping of its own, advised onto huge pages and aligned to one, and left untouched: Linux hands
    out zero-filled pages on first write, so a KV pool of many GiB is ready at once instead of after seconds
    of zeroing (4.0 s for 9 GiB on a 2-core Xeon), and only the blocks used ever take memory. Such a tensor's
    storage cannot be resized; ``release_pages`` empties it instead (see ``is_mapped``).

    ``advise`` False: the mapping is not advised yet (``Prefault(..., advise=True)`` advises it 2 MiB at a time
    while the engine is idle). Under THP ``defrag=madvise`` a first write to an advised page may compact memory
    inside the step that writes it (up to 146 ms for one page measured here); unadvised pages fault as 4 KiB
    pages at once, and the pages advised later are collapsed by khugepaged in the background.

    Raises:
        RuntimeError / MemoryError: the allocator (or mmap) refuses, e.g. more than memory and swap.
    """
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < _HUGE_PAGE or not hasattr(mmap, "MAP_ANONYMOUS"):
        tensor = torch.empty(shape, dtype=dtype, device=device)
        advise_huge_pages(tensor)
        return tensor.zero_()
    try:
        region = mmap.mmap(-1, -(-(nbytes + _HUGE_PAGE) // mmap.PAGESIZE) * mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as exc:
        raise MemoryError(f"mmap of {nbytes} bytes: {exc}") from exc
    if advise and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            region.madvise(mmap.MADV_HUGEPAGE)
        except OSError as exc:  # THP compiled out: ordinary pages
            logger.debug("madvise(MADV_HUGEPAGE) refused: %s", exc)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # holds a reference to the mapping
    start = -raw.data_ptr() % _HUGE_PAGE
    return raw[start:start + nbytes].view(dtype).view(shape)


def is_mapped(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s storage is one of ``zeros_on_huge_pages``' own mappings (not resizable: free
    its memory with ``release_pages``, not ``untyped_storage().resize_``)."""
    storage = tensor.untyped_storage()
    return tensor.device.type == "cpu" and not storage.resizable()


def release_pages(tensor: torch.Tensor) -> int:
    """Give the memory of a ``zeros_on_huge_pages`` CPU tensor back to the system (madvise MADV_DONTNEED
    over the whole pages of its storage): the tensor stays valid and reads as zeros, and memory is taken
    again only where it is written. Returns the bytes released (0 where the call is unavailable).

    Raises:
        ValueError: ``tensor`` is not such a mapping (``is_mapped`` is False).
    """
    if not is_mapped(tensor):
        raise ValueError("release_pages needs a tensor from zeros_on_huge_pages on CPU")
    libc = _libc()
    if libc is None:
        tensor.zero_()
        return 0
    storage = tensor.untyped_storage()  # the whole mapping: page-aligned at both ends
    start, size = storage.data_ptr(), storage.nbytes()
    if start % mmap.PAGESIZE or size % mmap.PAGESIZE or libc.madvise(start, size, _MADV_DONTNEED) != 0:
        tensor.zero_()
        return 0
    return size


class Prefault:
    """Fault in a ``zeros_on_huge_pages`` CPU tensor's pages on a background thread (madvise
    MADV_POPULATE_WRITE, Linux 5.14+, in 2 MiB steps): the memory is taken as if written, without writing it,
    so the thread may run while the engine writes into the same pages. A pool left to fault on first write
    pays for each new 2 MiB page inside the step that first writes it (a KV pool at 32 concurrent requests:
    about 6% of throughput on a 2-core Xeon until every block had been used once); zeroing it up front held
    start-up for seconds. Where the call is unavailable the thread ends at once and pages fault on demand.

    It works only while the engine is idle: each engine step calls ``step_started()`` and ``step_ended()``, and
    the thread waits while a step runs and until ``QUIET_S`` after the last one ended. Faulting pages in takes the memory system (about 0.4 GB/s in a VM, the
    hypervisor backing each page), so beside running steps it slowed them by half for seconds (batch-1 TTFT
    193 ms instead of 59 ms on the first requests, 2-core VM); pages the engine touches first fault in its
    steps as they would without the thread.

    ``stop()`` ends the thread early (before the memory is released); it is a daemon thread either way.
    ``start_busy``: count the construction as the end of an engine step (the thread first waits ``QUIET_S``).
    ``advise``: the tensor is a ``zeros_on_huge_pages(..., advise=False)`` mapping: each 2 MiB is advised onto
    huge pages (MADV_HUGEPAGE) just before it is faulted in, so only pages taken while the engine is idle pay
    for compaction; where MADV_POPULATE_WRITE is unavailable the whole mapping is advised at once instead.
    """

    _STEP = 2 << 20  # bytes per madvise: one huge page, what a step starting meanwhile may wait for (1-150 ms)
    QUIET_S = 0.5  # seconds without an engine step before the thread goes on

    def __init__(self, tensor: torch.Tensor, start_busy: bool = False, advise: bool = False) -> None:
        self._advise = advise
        self._stop = threading.Event()
        self._last_busy = time.monotonic() if start_busy else 0.0  # time.monotonic() the latest step ended
        self._in_step = False
        storage = tensor.untyped_storage()
        self._range = (storage.data_ptr(), storage.nbytes())
        self.thread = threading.Thread(target=self._run, name="tokenmill-prefault", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        libc = _libc()
        if libc is None:
            return
        start, size = self._range
        page = mmap.PAGESIZE
        first, end = -(-start // page) * page, (start + size) // page * page
        for at in range(first, end, self._STEP):
            while self._in_step or (wait := self.QUIET_S - (time.monotonic() - self._last_busy)) > 0:
                if self._stop.wait(self.QUIET_S if self._in_step else wait):
                    return
            if self._stop.is_set():
                return
            size = min(self._STEP, end - at)
            if self._advise:
                libc.madvise(at, size, _MADV_HUGEPAGE)  # a refusal (THP compiled out) leaves small pages
            if libc.madvise(at, size, _MADV_POPULATE_WRITE) != 0:
                logger.debug("madvise(MADV_POPULATE_WRITE) refused: errno %d", ctypes.get_errno())
                if self._advise:  # old kernel: the rest faults in on demand, onto huge pages
                    libc.madvise(at, end - at, _MADV_HUGEPAGE)
                return

    def step_started(self) -> None:
        """An engine step starts: the thread pauses (after its current 2 MiB) until the step has ended."""
        self._in_step = True
        self._last_busy = time.monotonic()

    def step_ended(self) -> None:
        """The step ended: the thread goes on once no other step has started for ``QUIET_S``."""
        self._last_busy = time.monotonic()
        self._in_step = False

    def stop(self) -> None:
        """End the thread (waits for its current step)."""
        self._stop.set()
        self.thread.join()
