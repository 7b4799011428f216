"""The fused expert step on CPU: a MoE layer's routed experts over a step's tokens in one C call (csrc/moe_step.c).

``grouped_expert_step`` (experts.py) runs the same computation as ~5 Python/torch calls per active expert; at
batch 1 a layer's 8 active experts then cost ~40 dispatches and 16 thread barriers around products of a few
hundred microseconds. Here one call groups the slots by expert (a counting sort: the torch path's stable
argsort), runs each active expert's chain (gate_up product, SiLU-and-multiply, down product) with the same
compiled kernels the experts' ``Linear`` layers call (qgemm's quantized products, AMX bf16 tiles where the plan
says), the C SiLU kernel, and combines each token's k outputs in rank order in float32, as
``combine_in_rank_order``. So the result is bit for bit the torch path's wherever the plan puts the experts'
rows on those kernels (at a few rows the plan may prefer torch's SiLU, which can round the last bit
differently); a step where some expert's rows would be dequantized for torch's GEMM is refused by the C side
before it writes anything, and the caller runs the torch path. With no plan (``--no-cpu-kernels``: the SiLU
table is empty) the torch path runs.

Threads: on decode-sized steps the active experts are spread over the threads, one expert's chain per thread
with one-thread products (no barrier per product); on larger groups each product runs on all threads
(``expert_parallel``; the C file's top comment).

Applies to experts whose weights are GGUF blocks (``Linear.quant``: every format qgemm runs, stored or tiled)
in float32 or bfloat16 models, without bias or LoRA; otherwise ``FusedExperts.describe`` says why not and the
torch path runs. Imports ``tokenmill.quantization`` and ``tokenmill.layers`` only.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch import nn

from tokenmill.csrc_build import DEFAULT_FLAGS, CLibrary
from tokenmill.layers import silu_and_mul_kernel
from tokenmill.quantization import qgemm
from tokenmill.quantization.gguf_weight import current_dispatch_rows

_SOURCE = Path(__file__).parent / "csrc" / "moe_step.c"
MAX_SEGMENTS = 4  # ME_MAX_SEGMENTS: format segments per projection
REFUSED = -3  # me_step: the plan puts some expert's rows on a path the C step does not run


class _Linear(ctypes.Structure):
    _fields_ = [("num_segments", ctypes.c_int32), ("qtype", ctypes.c_int32 * MAX_SEGMENTS),
                ("rows", ctypes.c_int64 * MAX_SEGMENTS), ("data", ctypes.c_void_p * MAX_SEGMENTS)]


class _Expert(ctypes.Structure):
    _fields_ = [("gate_up", _Linear), ("down", _Linear)]


class _Model(ctypes.Structure):
    _fields_ = [("num_experts", ctypes.c_int64), ("hidden", ctypes.c_int64), ("intermediate", ctypes.c_int64),
                ("bf16", ctypes.c_int32), ("experts", ctypes.POINTER(_Expert)), ("qlinear", ctypes.c_void_p),
                ("qlinear_bf16", ctypes.c_void_p), ("silu_and_mul", ctypes.c_void_p)]


class _Tables(ctypes.Structure):
    _fields_ = [("dequantize", ctypes.c_void_p), ("dequantize_len", ctypes.c_int64), ("amx", ctypes.c_void_p),
                ("amx_len", ctypes.c_int64), ("invariant", ctypes.c_int32), ("product_rows", ctypes.c_int64)]


def _setup(lib: ctypes.CDLL) -> None:
    p = ctypes.c_void_p
    lib.me_route.argtypes = [p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int,
                             p, p]
    lib.me_route.restype = ctypes.c_int
    lib.me_step.argtypes = [ctypes.POINTER(_Model), ctypes.POINTER(_Tables), p, ctypes.c_int64, ctypes.c_int64, p, p,
                            p, ctypes.c_int, ctypes.c_int]
    lib.me_step.restype = ctypes.c_int


# No SIMD of its own: the kernels it calls (function pointers into their libraries) carry the ISA path.
library = CLibrary(_SOURCE, "moe_step", _setup, DEFAULT_FLAGS)
available = library.available


def _address(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


def c_routable(config) -> bool:
    """Whether ``me_route`` implements this ``RouterConfig``: softmax scores without groups, correction bias or
    scaling (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V2-Lite's greedy top-k; not V2's grouped or V3's sigmoid
    routing)."""
    return (config.scoring == "softmax" and config.num_groups == 1 and not config.correction_bias
            and config.routed_scaling_factor == 1.0)


def route(logits: torch.Tensor, config) -> tuple[torch.Tensor, torch.Tensor]:
    """``select_experts`` for a ``c_routable`` config, in C (csrc/moe_step.c ``me_route``): logits [T, E] in
    float32 or bfloat16 -> (weights [T, k] float32, expert ids [T, k] int64) in rank order. The fused step's
    blocks route with it on CPU, as the lean decode step does, so both choose the same experts with the same bits.

    Raises:
        ValueError: logits of another width or dtype.
        MemoryError: scratch memory could not be allocated.
    """
    if logits.dim() != 2 or logits.shape[1] != config.num_experts or logits.dtype not in (torch.float32,
                                                                                            torch.bfloat16):
        raise ValueError(f"router logits must be float32/bf16 [T, {config.num_experts}], got {logits.dtype} "
                         f"{tuple(logits.shape)}")
    logits = logits.contiguous()
    num_tokens, k = logits.shape[0], config.top_k
    weights = torch.empty(num_tokens, k, dtype=torch.float32)
    ids = torch.empty(num_tokens, k, dtype=torch.int64)
    rc = library.get().me_route(logits.data_ptr(), int(logits.dtype == torch.bfloat16), num_tokens,
                                config.num_experts, k, int(config.norm_topk_prob), int(config.softmax_after_topk),
                                weights.data_ptr(), ids.data_ptr())
    if rc == -2:
        raise MemoryError("me_route: scratch memory could not be allocated")
    if rc != 0:
        raise ValueError(f"me_route: bad sizes (T {num_tokens}, E {config.num_experts}, k {k})")
    return weights, ids


def _describe_linear(module) -> tuple[_Linear, list[torch.Tensor]] | str:
    quant = getattr(module, "quant", None)
    if quant is None:
        return "dense expert weights (the fused step runs GGUF blocks)"
    if len(quant.parts) > MAX_SEGMENTS:
        return f"more than {MAX_SEGMENTS} format segments in one projection"
    if module.bias is not None or getattr(module, "lora", None) is not None:
        return "a bias or a LoRA adapter on an expert"
    desc = _Linear(num_segments=len(quant.parts))
    keep = []
    for i, part in enumerate(quant.parts):
        if part.data.dtype != torch.uint8 or not part.data.is_contiguous():
            return "expert blocks that are not a contiguous uint8 tensor"
        desc.qtype[i], desc.rows[i], desc.data[i] = part.qtype, part.shape[0], part.data.data_ptr()
        keep.append(part.data)
    return desc, keep


class _TableBytes:
    """A plan table (tuple of bools) as a uint8 array the C side reads, rebuilt when the tuple changes."""

    def __init__(self) -> None:
        self.source: tuple | None = None
        self.array = torch.zeros(1, dtype=torch.uint8)

    def get(self, table: tuple) -> tuple[int, int]:
        if table is not self.source:
            self.source = table
            self.array = torch.tensor([bool(v) for v in table] or [0], dtype=torch.uint8)
        return self.array.data_ptr(), len(table)


class FusedExperts:
    """The C description of one layer's routed experts and the call that runs them (module docstring).

    Build with ``FusedExperts.describe(experts, dtype)``; call with (x [T, hidden], weights [T, k] float32,
    expert ids [T, k] int64) -> [T, hidden] in x's dtype, or None where the C step refused the step (the caller
    runs ``grouped_expert_step``).
    """

    def __init__(self, lib: ctypes.CDLL, model: _Model, experts_array: ctypes.Array, keep: list[torch.Tensor],
                 first: nn.Module) -> None:
        self._lib = lib
        self._model = model
        self._experts_array = experts_array  # the ctypes array model.experts points into
        self._keep = keep  # the weight blocks the description points into
        self._first = first  # expert 0: its layers' plan tables and deterministic flags stand for all
        self._dequantize, self._amx = _TableBytes(), _TableBytes()
        self.key = keep[0].data_ptr()
        self.calls = self.refused = 0

    @classmethod
    def describe(cls, experts: nn.ModuleList, dtype: torch.dtype) -> FusedExperts | str:
        """The fused step for ``experts`` (``ExpertMLP``s) in a ``dtype`` model, or why it cannot run them."""
        if dtype not in (torch.float32, torch.bfloat16):
            return f"dtype {dtype} (float32 or bfloat16 only)"
        lib = library.built()
        q = qgemm.library.built()
        silu = silu_and_mul_kernel.library.built()
        if lib is None or q is None or silu is None:
            return "the fused expert step or a kernel it calls cannot be built here"
        array = (_Expert * len(experts))()
        keep: list[torch.Tensor] = []
        for index, expert in enumerate(experts):
            for name in ("gate_up_proj", "down_proj"):
                got = _describe_linear(getattr(expert, name))
                if isinstance(got, str):
                    return f"expert {index}: {got}"
                setattr(array[index], name.removesuffix("_proj"), got[0])
                keep.extend(got[1])
        first = experts[0]
        suffix = "bf16" if dtype == torch.bfloat16 else "f32"
        model = _Model(num_experts=len(experts), hidden=first.down_proj.out_features,
                       intermediate=first.down_proj.in_features, bf16=int(dtype == torch.bfloat16),
                       experts=ctypes.cast(array, ctypes.POINTER(_Expert)), qlinear=_address(q.qg_linear),
                       qlinear_bf16=_address(q.qg_linear_bf16),
                       silu_and_mul=_address(getattr(silu, f"silu_and_mul_{suffix}")))
        return cls(lib, model, array, keep, first)

    def applies(self) -> bool:
        """Whether the fused step runs this model's steps: deterministic mode, or a kernel plan is applied (its
        SiLU table is set; ``--no-cpu-kernels`` leaves every layer, this step included, on torch)."""
        return bool(self._first.gate_up_proj.batch_invariant) or bool(self._first.act_fn.cpu_kernel_table)

    @property
    def address(self) -> int:
        """Where the C description (me_model) lives: the lean decode step passes it to me_step."""
        return ctypes.addressof(self._model)

    def tables(self, invariant: bool = False) -> _Tables:
        """The me_tables of this step: the plan's dequantize and AMX bf16 tables of the experts' layers (expert 0's
        stand for all: the plan gives every quantized layer the same ones), and the enclosing ``dispatch_rows``."""
        tables = _Tables(invariant=int(invariant), product_rows=current_dispatch_rows() or 0)
        quant = self._first.gate_up_proj.quant
        tables.dequantize, tables.dequantize_len = self._dequantize.get(quant.dequantize_table)
        tables.amx, tables.amx_len = self._amx.get(quant.amx_bf16_table)
        return tables

    def may_refuse(self, num_tokens: int) -> bool:
        """Whether a step of ``num_tokens`` tokens could be refused (the plan dequantizes for torch's GEMM at some
        expert row count up to ``num_tokens``, or at the enclosing ``dispatch_rows``)."""
        table = self._first.gate_up_proj.quant.dequantize_table
        if not table:
            return False
        rows = current_dispatch_rows()
        if rows:
            return bool(table[min(rows, len(table) - 1)])
        return any(table[1:num_tokens + 1])  # the entries of 1 .. num_tokens rows (the last one stands for more)

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor,
                 expert_parallel: bool | None = None) -> torch.Tensor | None:
        """Run the step (class docstring). ``expert_parallel``: None chooses (experts over threads when no active
        expert has more than 32 rows: ME_PARALLEL_MAX_ROWS), True / False forces it (tests, benchmarks).

        Raises:
            ValueError: an expert id outside [0, num_experts), or shapes that do not match the experts.
            MemoryError: scratch memory could not be allocated.
        """
        if not self.applies():
            return None  # no kernel plan (--no-cpu-kernels, or none applied): the torch path
        invariant = bool(self._first.gate_up_proj.batch_invariant)
        if (x.dim() != 2 or x.dtype != (torch.bfloat16 if self._model.bf16 else torch.float32)
                or x.shape[1] != self._model.hidden):
            raise ValueError(f"x must be [T, {self._model.hidden}] in the model dtype, got {x.dtype} {tuple(x.shape)}")
        if expert_ids.dim() != 2 or tuple(weights.shape) != tuple(expert_ids.shape) or expert_ids.shape[0] != x.shape[0]:
            raise ValueError(f"weights and expert ids must both be [T, k] with T = {x.shape[0]} (x's rows), got "
                             f"{tuple(weights.shape)} and {tuple(expert_ids.shape)}")
        num_tokens, k = expert_ids.shape
        x = x.contiguous()
        weights = weights.to(torch.float32).contiguous()
        ids = expert_ids.to(torch.int64).contiguous()
        tables = self.tables(invariant)
        mode = 2 if expert_parallel is None else int(expert_parallel)  # 2: the C side decides by the group sizes
        out = torch.empty_like(x)
        rc = self._lib.me_step(ctypes.byref(self._model), ctypes.byref(tables), x.data_ptr(), num_tokens, k,
                               ids.data_ptr(), weights.data_ptr(), out.data_ptr(), torch.get_num_threads(), mode)
        self.calls += 1
        if rc == REFUSED:
            self.refused += 1
            return None
        if rc == -2:
            raise MemoryError("fused expert step: scratch memory could not be allocated")
        if rc != 0:
            raise ValueError(f"fused expert step: bad arguments (expert ids outside [0, {self._model.num_experts}) "
                             "or experts of another shape)")
        return out
