"""Which compiled CPU kernels the default (non-deterministic) CPU runner uses, decided by measurement.

The C kernels (GEMM, RMSNorm, SiLU×up, paged decode and prefill attention; built for this CPU's ISA path by
``tokenmill.csrc_build``) are not faster than torch everywhere: on an AVX2 CPU float32 prefill-sized
GEMMs belong to torch's blocked GEMM, while bf16 GEMMs of any size belong to the C kernel (torch
has no fast bf16 path there). So at the first start on a machine each kernel is timed against the
torch op it replaces, on the model's own weights and shapes, at a ladder of row counts
(``ROW_LADDER``), and the faster one is used per row-count bucket ("never slower than
``--no-cpu-kernels``"). The result is cached per machine beside the kernel builds
(``<cache dir>/dispatch/``), keyed by the CPU, ISA path, kernel sources, torch version, dtype,
thread count and shapes, so later starts only read a small JSON file.

The LM head of a bf16 model returns float32 logits either way (torch's CPU matmul would round them
to bf16): from the C GEMM's float32 output, or from torch in float32 over converted weight chunks,
whichever is faster here (the C GEMM, except on the slow portable path).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill import csrc_build
from tokenmill.attention import cpu_decode, cpu_prefill
from tokenmill.attention.layer import Attention
from tokenmill.layers import batch_invariant, silu_and_mul_kernel
from tokenmill.layers.activation import SiluAndMul
from tokenmill.layers.layernorm import RMSNorm
from tokenmill.layers.linear import Linear
from tokenmill.quantization import qgemm
from tokenmill.quantization.formats import AMX_TILED_FORMATS, base_qtype, is_tiled

logger = logging.getLogger(__name__)

# Row counts at which each kernel is timed against torch; a call with M rows follows the decision
# of the smallest ladder point >= M (rows above the last point follow the last point).
ROW_LADDER: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_DECODE_BATCHES = (1, 8, 32)  # paged decode attention: sequences per call, 512 context tokens each
_PREFILL_LENGTHS = (128, 512, 2048)  # paged prefill attention: one fresh prompt of each length
_AMX_BF16_MIN_ROWS = 16  # qgemm's AMX bf16 product is timed from this many rows (fewer: the int8 kernel)
_DISPATCH_VERSION = 8  # bump when the measurement or the file format changes (7: SDPA without oneDNN, prefill attention by length;
# 8: MLA's per-head products, latent_heads)


@dataclass(frozen=True)
class KernelPlan:
    """What the CPU runner runs in C (True) or torch (False), per ROW_LADDER point where it varies.

    ``isa``: the ISA path of the builds; ``dtype``: the model's ("bfloat16" / "float32"); ``gemm``/``rms_norm``/``silu_and_mul``: one decision per
    ROW_LADDER point; ``paged_decode``: decode attention (one decision for all batch sizes: the
    kernel is chosen only if it wins at each of 1, 8 and 32 sequences); ``logits``: a bf16 LM head's
    float32 logits from the C GEMM (False: torch's chunked float32 path; float32 LM heads follow
    ``gemm``); ``quantized``: for layers whose weights stay in GGUF blocks, the quantized kernel
    (True) or dequantize-then-torch-GEMM (False), per ROW_LADDER point (empty: no such layers);
    ``prefill_attention``: prefill chunks in the C flash-style kernel (False: SDPA per chunk), if it wins
    at the shortest of ``_PREFILL_LENGTHS`` prompt tokens; ``prefill_attention_max_context``: the longest
    prompt context it then takes (0: any; else the geometric middle between the last length where it won
    and the first where SDPA did: SDPA's blocked GEMMs win on long prompts);
    ``amx_bf16``: per ROW_LADDER point, True where quantized layers multiply bf16 activations on qgemm's
    AMX bf16 tiles rather than quantizing them for the int8 kernel (empty: no AMX bf16 here, or float32
    activations; never in deterministic mode); ``amx_bf16_logits``: the same for a quantized LM head,
    timed apart (its huge weight is expanded per call, so it needs more rows to win);
    ``latent_heads``: per ROW_LADDER point, True where multi-head latent attention's per-head products run in
    the batch-invariant C GEMM (``bi_linear_heads``) rather than torch's bmm (empty: no such layers);
    ``source``: "measured", "cache" or "off" (``--no-cpu-kernels``,
    TOKENMILL_DISABLE_CPU_KERNELS=1, no compiler, or a dtype the kernels do not take).
    """

    isa: str | None
    dtype: str | None = None
    gemm: tuple[bool, ...] = ()
    rms_norm: tuple[bool, ...] = ()
    silu_and_mul: tuple[bool, ...] = ()
    paged_decode: bool = False
    logits: bool = False
    quantized: tuple[bool, ...] = ()
    prefill_attention: bool = False
    prefill_attention_max_context: int = 0
    amx_bf16: tuple[bool, ...] = ()
    amx_bf16_logits: tuple[bool, ...] = ()
    latent_heads: tuple[bool, ...] = ()
    source: str = "off"

    def describe(self) -> str:
        """One line for logs and status pages, e.g. "C kernels (avx2 path, measured): GEMM at 1-256 rows, ..."."""
        if self.isa is None:
            return "torch ops (C kernels off)"
        parts = [f"GEMM {_rows_text(self.gemm)}", f"RMSNorm {_rows_text(self.rms_norm)}",
                 f"SiLU×up {_rows_text(self.silu_and_mul)}",
                 f"paged decode {'C' if self.paged_decode else 'torch'}",
                 "prefill attention " + ("torch SDPA" if not self.prefill_attention else "C" if not
                                         self.prefill_attention_max_context else
                                         f"C up to {self.prefill_attention_max_context} tokens, SDPA above"),
                 "LM head " + ("as GEMM" if self.dtype == "float32" else
                               f"{'C' if self.logits else 'torch'}, float32 logits")]
        if self.quantized:
            text = _rows_text(self.quantized)
            parts.append("quantized weights: " + ("kernel" if text == "C" else "dequantized + torch GEMM"
                                                  if text == "torch" else text.replace("C at", "kernel at")
                                                  .replace("torch otherwise", "dequantized + torch GEMM otherwise")))
        if self.latent_heads:
            parts.append(f"MLA heads {_rows_text(self.latent_heads)}")
        for name, ladder in (("AMX bf16 products", self.amx_bf16), ("LM head on AMX bf16", self.amx_bf16_logits)):
            if any(ladder):
                points = [rows for rows, use in zip(ROW_LADDER, ladder) if use]
                parts.append(f"{name} from {points[0]} rows" if all(ladder[-len(points):])
                             else f"{name} at the {'/'.join(map(str, points))}-row points")
        return f"C kernels ({self.isa} path, {self.source}): " + ", ".join(parts)


def _rows_text(decisions: tuple[bool, ...]) -> str:
    """"C at 1-16 rows, torch above" style summary of a ladder of decisions."""
    if not decisions or not any(decisions):
        return "torch"
    if all(decisions):
        return "C"
    spans, start = [], None
    for i, use_c in enumerate((*decisions, False)):
        if use_c and start is None:
            start = i
        elif not use_c and start is not None:
            lo = 1 if start == 0 else ROW_LADDER[start - 1] + 1
            spans.append(f"{lo}-{ROW_LADDER[i - 1]}")
            start = None
    return f"C at {', '.join(spans)} rows, torch otherwise"


def row_table(decisions: tuple[bool, ...]) -> tuple[bool, ...]:
    """Expand ladder decisions to one entry per row count 0..ROW_LADDER[-1]; layers index it with
    ``min(rows, len(table) - 1)``."""
    table = []
    for m in range(ROW_LADDER[-1] + 1):
        i = next((j for j, point in enumerate(ROW_LADDER) if point >= m), len(ROW_LADDER) - 1)
        table.append(bool(decisions[i]))
    return tuple(table)


# ---------------------------------------------------------------- measurement


def _race(c_fn: Callable[[], object], torch_fn: Callable[[], object], max_reps: int = 5) -> bool:
    """True if ``c_fn`` is strictly faster than ``torch_fn`` (best of several timed runs each).

    Each runs once untimed (allocation, page faults), then the two alternate so a burst of load hits
    both; a clear verdict (one at least 25% faster) stops after two timed runs each, a close one gets
    up to ``max_reps``.
    """
    c_fn()
    torch_fn()
    c = t = float("inf")
    for rep in range(max_reps):
        for fn, is_c in ((c_fn, True), (torch_fn, False)):
            start = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - start
            c, t = (min(c, elapsed), t) if is_c else (c, min(t, elapsed))
        if rep >= 1 and not 0.8 < c / t < 1.25:
            break
    return c < t


def _race_layer(layer: nn.Module, x: torch.Tensor, attribute: str, c_setting, torch_setting,
                call: Callable[[torch.Tensor], torch.Tensor] | None = None) -> bool:
    """``call(x)`` (default ``layer(x)``) with ``layer.<attribute>`` set to ``c_setting`` (its C kernel)
    against ``torch_setting`` (its torch op): the layer's own code paths, nothing rewritten here."""
    call = call or layer

    def run(setting):
        setattr(layer, attribute, setting)
        return call(x)

    try:
        return _race(lambda: run(c_setting), lambda: run(torch_setting))
    finally:
        setattr(layer, attribute, torch_setting)


def _measure(model: nn.Module, dtype: torch.dtype, lm_head: nn.Module | None) -> dict:
    """Time every kernel against torch on ``model``'s weights and layers; returns the plan's fields."""
    # dense weights in the model dtype (DeepSeek's float32 router takes float32 activations: not this race's)
    linears = [m for m in model.modules() if isinstance(m, Linear) and m is not lm_head and m.quant is None
               and m.weight is not None and m.weight.dtype == dtype]
    by_shape = {}
    for m in linears:
        by_shape.setdefault(tuple(m.weight.shape), m.weight)
    gemm = []
    for rows in ROW_LADDER:
        xs = {k: torch.randn(rows, k).to(dtype) for _, k in by_shape}
        # Every distinct shape once: the model's step in miniature.
        def c_fn(): return [batch_invariant.bi_linear(xs[w.shape[1]], w) for w in by_shape.values()]
        def t_fn(): return [F.linear(xs[w.shape[1]], w) for w in by_shape.values()]
        gemm.append(_race(c_fn, t_fn) if by_shape else False)
    always = (True,)
    rms, silu = [], []
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    if norms:
        norm = max(norms, key=lambda m: m.weight.numel())
        rms = [_race_layer(norm, torch.randn(rows, norm.weight.numel()).to(dtype), "cpu_kernel_table", always, ())
               for rows in ROW_LADDER]
    act = next((m for m in model.modules() if isinstance(m, SiluAndMul)), None)
    quantized_linears = [m for m in model.modules() if isinstance(m, Linear) and m is not lm_head
                         and m.quant is not None]
    amx_bf16 = _measure_amx_bf16(quantized_linears, dtype)
    try:  # the kernel side of the next race runs as the plan would: on AMX bf16 where it won
        for m in quantized_linears:
            m.quant.amx_bf16_table = _amx_table(amx_bf16)
        quantized = _measure_quantized(quantized_linears, dtype)
    finally:
        for m in quantized_linears:
            m.quant.amx_bf16_table = ()
    widths = [m.out_features for m in model.modules()
              if isinstance(m, Linear) and len(getattr(m, "output_sizes", ())) == 2]
    if act is not None and widths and silu_and_mul_kernel.available():
        silu = [_race_layer(act, torch.randn(rows, max(widths)).to(dtype), "cpu_kernel_table", always, ())
                for rows in ROW_LADDER]
    decode = prefill = False
    prefill_max_context = 0
    attn = next((m for m in model.modules() if isinstance(m, Attention)), None)
    if attn is not None and cpu_decode.available():
        decode = all(_race_decode(attn, dtype, batch) for batch in _DECODE_BATCHES)
    if attn is not None and cpu_prefill.available():
        prefill, prefill_max_context = _measure_prefill(attn, dtype)
    # The LM head's float32 logits from bf16 weights: the C GEMM against torch's chunked float32 path,
    # at one and eight rows (sampled rows per step). float32 weights follow the GEMM decisions.
    logits = False
    amx_bf16_logits = ()
    if isinstance(lm_head, Linear) and lm_head.quant is not None:
        amx_bf16_logits = _measure_amx_bf16([lm_head], dtype, out_dtype=torch.float32)
    if isinstance(lm_head, Linear) and lm_head.quant is None and lm_head.weight.dtype == torch.bfloat16:
        logits = all(_race_layer(lm_head, torch.randn(rows, lm_head.in_features).to(dtype), "float32_logits_kernel",
                                 True, False, call=lm_head.forward_float32) for rows in (1, 8))
    return {"gemm": tuple(gemm), "rms_norm": tuple(rms), "silu_and_mul": tuple(silu), "paged_decode": decode,
            "logits": logits, "quantized": quantized, "prefill_attention": prefill,
            "prefill_attention_max_context": prefill_max_context, "amx_bf16": amx_bf16,
            "amx_bf16_logits": amx_bf16_logits, "latent_heads": _measure_latent_heads(model, dtype)}


def _measure_latent_heads(model: nn.Module, dtype: torch.dtype) -> tuple[bool, ...]:
    """Multi-head latent attention's two per-head products (models/deepseek.py ``LatentProjection``: W_UK
    absorbed into the query, W_UV expanding the output) in ``bi_linear_heads`` against torch's bmm, on the
    model's first such layer, per ROW_LADDER point (empty: no such layers, or another weight dtype)."""
    proj = next((m for m in model.modules() if hasattr(type(m), "cpu_heads_table")), None)
    if proj is None or proj.weight.dtype != dtype:
        return ()
    decisions = []
    for rows in ROW_LADDER:
        q = torch.randn(rows, proj.num_heads, proj.qk_nope_head_dim).to(dtype)
        o = torch.randn(rows, proj.num_heads, proj.in_features).to(dtype)

        def run(table):
            proj.cpu_heads_table = table
            return proj.absorb_query(q), proj.expand_values(o)

        try:
            decisions.append(_race(lambda: run((True,)), lambda: run(())))
        finally:
            proj.cpu_heads_table = ()
    return tuple(decisions)


def _measure_amx_bf16(linears: list[Linear], dtype: torch.dtype, out_dtype: torch.dtype | None = None) -> tuple[bool, ...]:
    """qgemm's AMX bf16 product against its int8 kernel over every distinct quantized layer shape and
    format once, per ROW_LADDER point from ``_AMX_BF16_MIN_ROWS`` (below it the int8 kernel: a bf16 tile
    product costs the weight expansion whatever the rows). Empty where it cannot run (no AMX bf16 tiles,
    float32 activations, no tiled weights). Like ``_measure_quantized``, it keeps every point above the
    smallest one from which it wins at every larger point. ``out_dtype``: the products' output (float32
    for an LM head's logits)."""
    by_kind = {}
    for m in linears:
        if all(is_tiled(p.qtype) and base_qtype(p.qtype) in AMX_TILED_FORMATS and p.shape[0] % 16 == 0
               for p in m.quant.parts):
            by_kind.setdefault((m.in_features, m.out_features, m.quant.describe()), m.quant)
    if dtype != torch.bfloat16 or not by_kind or not qgemm.amx_bf16():
        return ()
    decisions = []
    for rows in ROW_LADDER:
        if rows < _AMX_BF16_MIN_ROWS:
            decisions.append(False)
            continue
        xs = {k: torch.randn(rows, k).to(dtype) for k, _, _ in by_kind}

        def run(table):
            out = []
            for quant in by_kind.values():
                quant.amx_bf16_table = table
                out.append(quant.matmul(xs[quant.in_features], out_dtype=out_dtype))
            return out

        try:
            decisions.append(_race(lambda: run((True,)), lambda: run(())))
        finally:
            for quant in by_kind.values():
                quant.amx_bf16_table = ()
    first = len(decisions)
    while first > 0 and decisions[first - 1]:
        first -= 1
    return tuple(i >= first for i in range(len(decisions)))


def _measure_quantized(linears: list[Linear], dtype: torch.dtype) -> tuple[bool, ...]:
    """The quantized kernel against dequantize-then-torch-GEMM over every distinct quantized layer shape
    and format once, per ROW_LADDER point. Decode-sized steps read few weights per row and go to the
    kernel; prefill-sized steps may repay dequantizing for torch's blocked GEMM."""
    by_kind = {}
    for m in linears:
        by_kind.setdefault((m.in_features, m.out_features, m.quant.describe()), m.quant)
    if not by_kind:
        return ()
    # Dequantizing costs the same whatever the rows and the kernel's cost grows with them, so the torch
    # GEMM keeps every row count above the smallest point from which it wins at every larger point (a
    # noisy kernel win in between moves that point up rather than leaving a hole in the ladder). The
    # ladder is therefore raced from its top down, and the first kernel win ends it: every point below
    # takes the kernel whatever it would measure (a 1-2 B model's ladder took 26 s measured bottom-up).
    first = len(ROW_LADDER)
    for i in reversed(range(len(ROW_LADDER))):
        rows = ROW_LADDER[i]
        xs = {k: torch.randn(rows, k).to(dtype) for k, _, _ in by_kind}

        def run(table):
            out = []
            for quant in by_kind.values():
                quant.dequantize_table = table
                out.append(quant.matmul(xs[quant.in_features]))
            return out

        try:
            kernel_wins = _race(lambda: run(()), lambda: run((True,)))
        finally:
            for quant in by_kind.values():
                quant.dequantize_table = ()
        if kernel_wins:
            break
        first = i
    return tuple(i < first for i in range(len(ROW_LADDER)))  # True: the kernel


_DECODE_RACE_ELEMENTS = 1 << 23  # most K (and V) cache elements one decode race allocates (32 MiB in float32)


def _race_decode(attn: Attention, dtype: torch.dtype, batch: int, context: int = 512, block_size: int = 16) -> bool:
    """The C paged decode kernel against the torch reference, ``batch`` sequences of ``context`` keys (fewer
    where the K cache would pass ``_DECODE_RACE_ELEMENTS``: at 32 sequences of a 1-2 B model's 32 KV heads
    the full context made this one race take 9 s of a model's first start, the reference's gathers mostly)."""
    from tokenmill.attention.metadata import build_attention_metadata
    from tokenmill.attention.torch_paged import reference_decode_attention

    per_token = batch * attn.num_kv_heads * attn.head_dim
    context = max(block_size, min(context, _DECODE_RACE_ELEMENTS // per_token // block_size * block_size))
    blocks = context // block_size
    cache = torch.randn(2, batch * blocks, block_size, attn.num_kv_heads, attn.head_dim).to(dtype)
    q = torch.randn(batch, attn.num_heads, attn.head_dim).to(dtype)
    table = torch.arange(batch * blocks, dtype=torch.int64).view(batch, blocks)
    metadata, _ = build_attention_metadata(
        [1] * batch, [context - 1] * batch, table.numpy(), block_size, per_token=False
    )
    return _race(
        lambda: cpu_decode.paged_decode_attention(q, cache[0], cache[1], metadata.decode_block_table,
                                                  metadata.decode_seq_lens, attn.scale),
        lambda: reference_decode_attention(q, cache[0], cache[1], metadata, attn.scale),
    )


def _measure_prefill(attn: Attention, dtype: torch.dtype) -> tuple[bool, int]:
    """(prefill_attention, prefill_attention_max_context) for ``attn``: the C kernel races SDPA at each of
    ``_PREFILL_LENGTHS`` from the shortest up, and the first SDPA win ends the kernel's range there."""
    for i, length in enumerate(_PREFILL_LENGTHS):
        if not _race_prefill(attn, dtype, length):
            return (False, 0) if i == 0 else (True, math.isqrt(_PREFILL_LENGTHS[i - 1] * length))
    return True, 0


def _race_prefill(attn: Attention, dtype: torch.dtype, length: int, block_size: int = 16) -> bool:
    """The C prefill kernel against SDPA (the torch path of ``paged_attention``) on one fresh prompt of
    ``length`` tokens with ``attn``'s heads, in blocks laid out in reverse (paged, not contiguous)."""
    from tokenmill.attention.metadata import build_attention_metadata
    from tokenmill.attention.torch_paged import paged_attention

    blocks = -(-length // block_size)
    cache = torch.randn(2, blocks, block_size, attn.num_kv_heads, attn.head_dim).to(dtype)
    q = torch.randn(length, attn.num_heads, attn.head_dim).to(dtype)
    table = torch.arange(blocks - 1, -1, -1, dtype=torch.int64).view(1, blocks)
    metadata, _ = build_attention_metadata([length], [0], table.numpy(), block_size)
    if not cpu_prefill.supports(q, cache[0]):
        return False
    return _race(
        lambda: paged_attention(q, cache[0], cache[1], metadata, attn.scale, use_prefill_kernel=True),
        lambda: paged_attention(q, cache[0], cache[1], metadata, attn.scale, use_prefill_kernel=False),
    )


def _amx_table(decisions: tuple[bool, ...]) -> tuple[bool, ...]:
    """An AMX bf16 ladder as a per-row-count table (``row_table``), with the rows below
    ``_AMX_BF16_MIN_ROWS`` on the int8 kernel: a ladder point stands for the rows down to the point below
    it, but the decision at 16 rows does not extend to the 9-15 rows it never timed. Empty when no point uses it."""
    if not any(decisions):
        return ()
    return tuple(use and rows >= _AMX_BF16_MIN_ROWS for rows, use in enumerate(row_table(decisions)))


def _cache_key(model: nn.Module, dtype: torch.dtype) -> str:
    shapes = sorted({(type(m).__name__, tuple(p.shape), str(p.dtype)) for m in model.modules()
                     for p in (*m.parameters(recurse=False), *m.buffers(recurse=False))})
    # Type ids, not names: a tiled layout (id + formats.TILED) is timed apart from the stored one.
    quant_kinds = sorted({(m.quant.describe(), tuple(getattr(p, "qtype", -1) for p in getattr(m.quant, "parts", ())))
                          for m in model.modules() if getattr(m, "quant", None) is not None})
    shapes.append(("quantized", tuple(quant_kinds), ""))
    sources = b"".join(p.read_bytes() for p in (batch_invariant._SOURCE, silu_and_mul_kernel._SOURCE,
                                                cpu_decode._SOURCE, qgemm._SOURCE, cpu_prefill._SOURCE))
    parts = [str(_DISPATCH_VERSION), csrc_build.selected_isa(), torch.__version__, str(dtype),
             str(torch.get_num_threads()), repr(shapes), hashlib.sha256(sources).hexdigest()]
    return hashlib.sha256(csrc_build._machine_key(None) + "|".join(parts).encode()).hexdigest()[:24]


def _plan_from_json(fields: object, isa: str) -> KernelPlan:
    """A cached plan, checked field by field. Raises ValueError for anything but what ``asdict`` wrote."""
    ladders = ("gemm", "rms_norm", "silu_and_mul", "quantized", "amx_bf16", "amx_bf16_logits", "latent_heads")
    flags = ("paged_decode", "logits", "prefill_attention")
    if not isinstance(fields, dict) or set(fields) != {"isa", "dtype", *ladders, *flags, "prefill_attention_max_context"}:
        raise ValueError("not a kernel plan")
    limit = fields["prefill_attention_max_context"]
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
        raise ValueError("bad prefill_attention_max_context")
    if fields["isa"] != isa or not all(isinstance(fields[k], bool) for k in flags):
        raise ValueError("not a kernel plan for this ISA path")
    if fields["dtype"] not in ("bfloat16", "float32"):
        raise ValueError("bad dtype")
    for name in ladders:
        value = fields[name]
        if not (isinstance(value, list) and len(value) in (0, len(ROW_LADDER)) and all(isinstance(v, bool) for v in value)):
            raise ValueError(f"bad {name} ladder")
    return KernelPlan(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}, source="cache")


def plan_cpu_kernels(model: nn.Module, dtype: torch.dtype, enabled: bool = True,
                     lm_head: nn.Module | None = None) -> KernelPlan:
    """Decide, by measurement cached per machine, which C kernels ``model`` runs in ``dtype``.

    ``lm_head`` (the model's output projection, if it is a Linear) is left out of the GEMM timing;
    with bf16 weights its float32 logits are timed on their own (C GEMM against torch's chunked float32
    path), with float32 weights it follows the GEMM decisions. Returns a plan with ``source="off"`` when
    ``enabled`` is False, the dtype is not float32/bfloat16, or the kernels cannot be built.
    """
    if not enabled or dtype not in (torch.float32, torch.bfloat16) or not batch_invariant.available():
        return KernelPlan(isa=None)
    isa = batch_invariant.isa()
    path = csrc_build.kernel_cache_dir() / "dispatch" / f"{_cache_key(model, dtype)}.json"
    try:
        return _plan_from_json(json.loads(path.read_text()), isa)
    except (OSError, ValueError):  # none yet, or unreadable / from another version: measure again
        pass
    # One process measures, the others wait for its file: processes started together (a server and an
    # offline engine, data-parallel replicas) must not time the kernels separately and pick different
    # ones, since the plan decides rounding and so the exact outputs.
    with _exclusive(path.with_suffix(".lock")):
        try:
            return _plan_from_json(json.loads(path.read_text()), isa)
        except (OSError, ValueError):
            pass
        t0 = time.perf_counter()
        logger.info("timing the C kernels against torch on this CPU (%s path; once per machine and model shape)",
                    isa)
        with torch.inference_mode():
            fields = {"isa": isa, "dtype": str(dtype).removeprefix("torch."), **_measure(model, dtype, lm_head)}
        plan = KernelPlan(**fields, source="measured")
        logger.info("kernel timing took %.1fs: %s", time.perf_counter() - t0, plan.describe())
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({k: v for k, v in asdict(plan).items() if k != "source"}))
            os.replace(tmp, path)
        except OSError as exc:
            logger.warning("cannot cache the kernel timing under %s (%s); it is repeated at the next start", path,
                           exc)
    return plan


@contextlib.contextmanager
def _exclusive(lock_path: Path):
    """Hold an exclusive ``flock`` on ``lock_path`` (created if needed) for the block; without ``fcntl``
    or a writable directory, run the block unlocked."""
    try:
        import fcntl

        lock_path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(lock_path, "a")
    except (ImportError, OSError):
        yield
        return
    try:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        handle.close()  # closing releases the lock


def apply_plan(model: nn.Module, plan: KernelPlan, lm_head: nn.Module | None = None) -> None:
    """Switch ``model``'s layers to what ``plan`` says (every layer back to torch for an "off" plan)."""
    gemm = row_table(plan.gemm) if plan.gemm else ()
    rms = row_table(plan.rms_norm) if plan.rms_norm else ()
    silu = row_table(plan.silu_and_mul) if plan.silu_and_mul else ()
    dequantize = tuple(not c for c in row_table(plan.quantized)) if plan.quantized else ()
    amx_bf16, amx_bf16_logits = _amx_table(plan.amx_bf16), _amx_table(plan.amx_bf16_logits)
    heads = row_table(plan.latent_heads) if plan.latent_heads else ()
    for module in model.modules():
        if hasattr(type(module), "cpu_heads_table"):  # MLA's LatentProjection (models/deepseek.py)
            module.cpu_heads_table = heads
        if isinstance(module, Linear) and module.quant is not None:  # the LM head: few rows, a huge weight
            module.quant.dequantize_table = () if module is lm_head else dequantize
            module.quant.amx_bf16_table = amx_bf16_logits if module is lm_head else amx_bf16
        if module is lm_head and isinstance(module, Linear):
            module.cpu_gemm_table = gemm
            module.float32_logits_kernel = plan.logits
        elif isinstance(module, Linear):
            module.cpu_gemm_table = gemm
        elif isinstance(module, RMSNorm):
            module.cpu_kernel_table = rms
        elif isinstance(module, SiluAndMul):
            module.cpu_kernel_table = silu
        elif isinstance(module, Attention):
            module.cpu_decode_kernel = plan.paged_decode
            module.cpu_prefill_kernel = plan.prefill_attention
            module.cpu_prefill_max_context = plan.prefill_attention_max_context
