"""A layer's GGUF-quantized weight: the blocks as stored, and how a product or a lookup runs on them.

``GGUFWeight`` holds one or more row segments (a fused projection whose parts have different formats
keeps one segment per part) and computes ``x @ W.T`` either in the quantized kernel (``qgemm``) or by
dequantizing the weight and handing it to torch's GEMM, per row count as the CPU runner's measurement
decides (``dequantize_table``), and on CPUs with AMX bf16 tiles bf16 activations may skip the int8
quantization for a bf16 tile product (``amx_bf16_table``); deterministic mode always takes the quantized
kernel, whose rows are batch invariant. Used by ``tokenmill.layers.linear.Linear`` and ``tokenmill.layers.embedding``.

Q4_0, Q4_1 and Q8_0 segments can be repacked once, here, into qgemm's tiled layout (same bytes; 16 rows
interleaved per group of 32) where this build multiplies that layout faster (``qgemm.tiled_preferred``:
the x86 SIMD builds); ``_DEFAULT_TILED`` lists the formats repacked by default. A tied GGUF embedding
registers the repacked blocks (``tokenmill.layers.embedding``) and reads its rows from them, so the
tiled LM head costs no second copy. ``TILED_LAYOUT`` pins the formats to repack (benchmarks compare layouts).

The dequantized weight of a prefill-sized product lives only for that product: it is written into one
scratch buffer per thread and dtype, grown to the largest layer (a few MB), so no dequantized copy of
the model is kept and no fresh allocation is page-faulted per layer.
"""
from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F

from tokenmill.quantization import qgemm, tile_cache
from tokenmill.huge_pages import zeros_on_huge_pages
from tokenmill.quantization.formats import TILE_ROWS, TILED, TILED_FORMATS, QuantizedTensor, qtype_name

_scratch = threading.local()
# The row count the tables are read at, where a step's products have more rows than the step it stands for
# (None: each product's own rows); see ``dispatch_rows``.
_dispatch_rows: contextvars.ContextVar[int | None] = contextvars.ContextVar("tokenmill_dispatch_rows", default=None)


def current_dispatch_rows() -> int | None:
    """The row count set by the enclosing ``dispatch_rows`` block, or None (each product's own rows)."""
    return _dispatch_rows.get()


@contextlib.contextmanager
def dispatch_rows(rows: int | None) -> Iterator[None]:
    """Within the block, every ``GGUFWeight.matmul`` reads its tables at ``rows`` instead of its own row
    count: a speculative verify step (k + 1 rows per request) then makes the kernel choices of the plain
    decode step of its requests (one row each), so verified tokens get plain decoding's bits."""
    token = _dispatch_rows.set(rows)
    try:
        yield
    finally:
        _dispatch_rows.reset(token)
# The formats whose segments are repacked into the tiled layout in weights built from now on: None for
# the default (_DEFAULT_TILED where qgemm.tiled_preferred()), else any of TILED_FORMATS (() for none).
TILED_LAYOUT: tuple[int, ...] | None = None
# every tiled format: Q4_0, Q4_1, Q8_0 batch-1 decode 1.40x the stored layout (benchmarks/qgemm.py); the
# stored rows of the others run 2-30x slower than their tiles
_DEFAULT_TILED: tuple[int, ...] = TILED_FORMATS


def _scratch_buffer(dtype: torch.dtype, numel: int) -> torch.Tensor:
    """A flat ``dtype`` buffer of at least ``numel`` elements, reused by this thread's later calls."""
    buffers = _scratch.__dict__.setdefault("buffers", {})
    buf = buffers.get(dtype)
    if buf is None or buf.numel() < numel:
        buf = buffers[dtype] = torch.empty(numel, dtype=dtype)
    return buf[:numel]


def tiled_formats() -> tuple[int, ...]:
    """The formats ``GGUFWeight`` repacks into the tiled layout in this process (``TILED_LAYOUT``, else
    ``_DEFAULT_TILED`` where this build prefers tiles, else none)."""
    tiled = (_DEFAULT_TILED if qgemm.tiled_preferred() else ()) if TILED_LAYOUT is None else TILED_LAYOUT
    assert all(f in TILED_FORMATS for f in tiled), tiled
    return tuple(tiled)


def _tiled(parts: Sequence[QuantizedTensor], out: torch.Tensor | None = None) -> QuantizedTensor:
    """Row blocks of one tiled format stacked and repacked (into ``out`` when given: the tile cache's file).
    Blocks of whole tiles (all but the last a multiple of TILE_ROWS rows) are repacked one by one into their rows
    of the result, with the same bytes as the stacked copy repacked (tiles are row-local) and without that copy."""
    if len(parts) == 1 or any(p.shape[0] % TILE_ROWS for p in parts[:-1]):
        return qgemm.repack(_merge(parts), out)
    shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])
    if out is None:
        out = zeros_on_huge_pages((shape[0], parts[0].data.shape[1]), torch.uint8, parts[0].data.device)
    row = 0
    for p in parts:
        qgemm.repack(p, out[row : row + p.shape[0]])
        row += p.shape[0]
    return QuantizedTensor(parts[0].qtype + TILED, shape, out)


def _merge(parts: Sequence[QuantizedTensor]) -> QuantizedTensor:
    """Row blocks of one format stacked into one tensor (the part itself when there is one)."""
    if len(parts) == 1:
        return parts[0]
    return QuantizedTensor(parts[0].qtype, (sum(p.shape[0] for p in parts), parts[0].shape[1]),
                           torch.cat([p.data for p in parts]))


class GGUFWeight:
    """A [out_features, in_features] weight kept in GGUF block formats.

    ``parts``: QuantizedTensor row segments, stacked in order along the output dimension (all with
    in_features columns), as stored; ``self.parts`` holds them merged and, for the formats that have
    one, in the tiled layout where that is the faster one (see the module docstring). ``dequantize_table`` (set by ``tokenmill.runner.cpu_kernels``): per row count
    (entry ``min(rows, len - 1)``), True to dequantize and use torch's GEMM; empty means always the
    quantized kernel. ``amx_bf16_table`` (the same indexing; set by the runner where qgemm has AMX bf16
    tiles): True to multiply bf16 activations on them (``qgemm.bf16_linear``) instead of quantizing them
    for the int8 kernel. Neither table applies in deterministic mode (``batch_invariant``).

    Raises:
        ValueError: no parts, or parts with different in_features.
    """

    def __init__(self, parts: Sequence[QuantizedTensor]) -> None:
        if not parts:
            raise ValueError("GGUFWeight needs at least one part")
        k = parts[0].shape[1]
        if any(p.shape[1] != k for p in parts):
            raise ValueError(f"GGUFWeight parts have different in_features: {[p.shape for p in parts]}")
        groups: list[list[QuantizedTensor]] = []
        for p in parts:  # adjacent parts of one format become one segment (one kernel call)
            if groups and groups[-1][0].qtype == p.qtype:
                groups[-1].append(p)
            else:
                groups.append([p])
        tiled = tiled_formats()
        # the stored copy is dropped (unless the caller keeps it): memory stays that of the blocks. A tiled
        # segment may come from the loader's tile cache (tile_cache.active): then nothing is merged or repacked.
        merged = [tile_cache.tiled_segment(g, lambda out=None, g=g: _tiled(g, out)) if g[0].qtype in tiled
                  else _merge(g) for g in groups]
        self.parts = merged
        self.in_features = k
        self.out_features = sum(p.shape[0] for p in merged)
        self.offsets = [sum(p.shape[0] for p in merged[:i]) for i in range(len(merged))]
        self.dequantize_table: tuple[bool, ...] = ()
        self.amx_bf16_table: tuple[bool, ...] = ()

    @property
    def nbytes(self) -> int:
        """Bytes of quantized data."""
        return sum(p.nbytes for p in self.parts)

    def describe(self) -> str:
        return "+".join(qtype_name(p.qtype) for p in self.parts)

    def tensors(self) -> list[torch.Tensor]:
        """The uint8 data of each segment (registered as buffers by the owning layer)."""
        return [p.data for p in self.parts]

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None, batch_invariant: bool = False,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [M, in_features] float32/bf16 -> [M, out_features] in ``out_dtype`` (default x's dtype)."""
        out_dtype = out_dtype or x.dtype
        rows = _dispatch_rows.get() or x.shape[0]
        table = self.dequantize_table
        if not batch_invariant and table and table[min(rows, len(table) - 1)]:
            w = self.dequantize_into_scratch(out_dtype)  # (out, in), valid until this thread's next call
            return F.linear(x.to(out_dtype), w, None if bias is None else bias.to(out_dtype))
        y = torch.empty(x.shape[0], self.out_features, dtype=out_dtype)
        table = self.amx_bf16_table
        amx = (not batch_invariant and x.dtype == torch.bfloat16 and bool(table)
               and table[min(rows, len(table) - 1)])
        for part, start in zip(self.parts, self.offsets):
            n = part.shape[0]
            target = y if len(self.parts) == 1 else y[:, start:start + n]
            if amx and qgemm.bf16_linear(x, part.data, part.qtype, n, self.in_features, out=target) is not None:
                continue
            qgemm.quantized_linear(x, part.data, part.qtype, n, self.in_features, out=target)
        if bias is not None:
            y += bias.to(out_dtype)
        return y

    def dequantize_into_scratch(self, dtype: torch.dtype) -> torch.Tensor:
        """All rows ([out_features, in_features], ``dtype``) in this thread's scratch buffer: valid until
        the thread's next call (the product that reads it runs before)."""
        w = _scratch_buffer(dtype, self.out_features * self.in_features).view(self.out_features, self.in_features)
        for part, start in zip(self.parts, self.offsets):
            qgemm.dequantize(part.data, part.qtype, self.in_features, None, dtype, out=w[start:start + part.shape[0]])
        return w

    def dequantize(self, dtype: torch.dtype, ids: torch.Tensor | None = None) -> torch.Tensor:
        """All rows ([out_features, in_features]) or rows ``ids`` (int64 [T]; one-segment weights only) in ``dtype``."""
        if ids is not None:
            assert len(self.parts) == 1, "row lookups need a single-format weight"
            p = self.parts[0]
            return qgemm.dequantize(p.data, p.qtype, self.in_features, ids, dtype)
        return torch.cat([qgemm.dequantize(p.data, p.qtype, self.in_features, None, dtype) for p in self.parts])
