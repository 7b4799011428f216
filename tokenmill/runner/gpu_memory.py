"""How big the KV pool can be on a CUDA device: a profiling forward pass, then pure arithmetic.

``--gpu-memory-utilization`` is the fraction of the device's memory tokenmill may use for weights,
activations and the KV cache together. A dummy step of ``max_num_batched_tokens`` tokens (plus
logits and sampling for ``max_num_seqs`` rows) measures the activation peak; the KV pool gets the
rest, minus memory outside torch's allocator and a reserve for CUDA graphs. The arithmetic is
:func:`kv_cache_budget_bytes`, a pure function tested on CPU.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenmill.config import ConfigError
from tokenmill.runner.kv_cache_sizing import GIB

# Room kept free for the CUDA graphs' private memory pool (decode activations at the largest
# bucket, split-KV partials) and allocator fragmentation.
GRAPH_MEMORY_RESERVE = 512 * 1024**2


@dataclass(frozen=True)
class MemoryProfile:
    """Bytes measured around the profiling forward pass on one device.

    total: device memory; weights: allocated by torch before the pass; peak: torch's peak
    allocation during it (weights included); non_torch: used on the device outside torch's
    caching allocator (CUDA context, cuBLAS workspaces, other processes).
    """

    total: int
    weights: int
    peak: int
    non_torch: int


def kv_cache_budget_bytes(profile: MemoryProfile, utilization: float, reserve: int) -> int:
    """Bytes for the KV pool: ``utilization * total - peak - non_torch - reserve``.

    Raises:
        ConfigError: naming ``gpu_memory_utilization`` when nothing is left for the KV cache.
    """
    allowed = int(utilization * profile.total)
    budget = allowed - profile.peak - profile.non_torch - reserve
    if budget <= 0:
        raise ConfigError(
            f"`gpu_memory_utilization` {utilization} allows {allowed / GIB:.2f} GiB, but weights + activations "
            f"({profile.peak / GIB:.2f} GiB), memory outside torch ({profile.non_torch / GIB:.2f} GiB) and the "
            f"graph reserve ({reserve / GIB:.2f} GiB) leave nothing for the KV cache; raise `gpu_memory_utilization` "
            "or lower `max_num_batched_tokens` / `max_num_seqs`"
        )
    return budget


def profile_memory(run: Callable[[], None], device: torch.device) -> MemoryProfile:
    """Run ``run`` (a dummy forward at the largest step shape) and measure ``device``'s memory."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    weights = torch.cuda.memory_allocated(device)
    run()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    free, total = torch.cuda.mem_get_info(device)
    non_torch = max(0, (total - free) - torch.cuda.memory_reserved(device))
    torch.cuda.empty_cache()
    return MemoryProfile(total=total, weights=weights, peak=peak, non_torch=non_torch)
