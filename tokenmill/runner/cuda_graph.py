"""CUDA graphs for decode steps: capture :func:`run_padded_decode` once per bucket, then replay.

A thin layer: the graphs read and write only the fixed-address tensors of ``DecodeBuffers`` and
the KV cache, so loading new inputs into those buffers and replaying is the whole step. All
captures share one memory pool and run largest bucket first (smaller ones fit in its memory);
each is preceded by eager warm-up runs (Triton compilation, cuBLAS initialisation). Host-side
choices made while a forward is traced — e.g. the Triton decode kernel's split-KV count, a
function of the bucket and the block-table width — are frozen into each graph.
"""
from __future__ import annotations

import logging
import time

import torch

from tokenmill.attention.layer import KVCache
from tokenmill.runner.padded_decode import DecodeBuffers, run_padded_decode

logger = logging.getLogger(__name__)

_WARMUP_RUNS = 2


class DecodeGraphs:
    """One captured CUDA graph per decode bucket, sharing a memory pool.

    Args:
        model: the model (on the CUDA device, Triton attention enabled).
        kv_caches: one (k_cache, v_cache) per layer.
        buffers: the static decode inputs; their rows must hold padding (or valid rows) at capture.
        batch_sizes: buckets to capture (any order).
    """

    def __init__(
        self, model: torch.nn.Module, kv_caches: list[KVCache], buffers: DecodeBuffers, batch_sizes: list[int]
    ) -> None:
        self.buffers = buffers
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # bucket -> hidden [bucket, hidden] written by replay
        start = time.perf_counter()
        for bucket in sorted(batch_sizes, reverse=True):
            for _ in range(_WARMUP_RUNS):
                run_padded_decode(model, kv_caches, buffers, bucket)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[bucket] = run_padded_decode(model, kv_caches, buffers, bucket)
            self.graphs[bucket] = graph
        torch.cuda.synchronize()
        logger.info("captured %d decode CUDA graphs (batch sizes %d..%d) in %.1fs", len(self.graphs),
                    min(batch_sizes), max(batch_sizes), time.perf_counter() - start)

    def replay(self, bucket: int) -> torch.Tensor:
        """Run the graph of ``bucket`` over the buffers' current contents -> hidden [bucket, hidden]
        (a static tensor, overwritten by the next replay of any bucket)."""
        self.graphs[bucket].replay()
        return self.outputs[bucket]
