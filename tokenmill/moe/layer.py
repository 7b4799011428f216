"""The sparse MoE block a decoder layer uses in place of its MLP: router, routed experts, shared expert.

forward(x [T, hidden]) -> [T, hidden]: router logits (``gate``, a Linear, so deterministic mode and GGUF blocks
apply as everywhere), each token's k experts (``routing.select_experts``), the grouped expert step
(``experts.grouped_expert_step``; on the CUDA path, ``use_triton``, the Triton grouped kernels of
``triton_experts.py``), plus the shared expert (Qwen2-MoE: times sigmoid(``shared_expert_gate``(x));
DeepSeek: ungated). Module names follow the checkpoints: ``mlp.gate.weight`` (and DeepSeek-V3's
``mlp.gate.e_score_correction_bias``), ``mlp.experts.{e}.{gate,up,down}_proj``, ``mlp.shared_expert.*``,
``mlp.shared_expert_gate.weight``; models whose checkpoints say otherwise (Mixtral's ``block_sparse_moe`` / w1 w2
w3, DeepSeek's ``shared_experts``) rename at load. Imports only ``tokenmill.layers``: models import this package,
never the other way.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn

from tokenmill import envs
from tokenmill.layers import Linear
from tokenmill.layers.batch_invariant import bi_linear
from tokenmill.moe.experts import (ExpertMLP, dense_expert_step, expert_counts, grouped_expert_step,
                                   stack_expert_weights)
from tokenmill.moe.load_stats import ExpertLoad
from tokenmill.moe.routing import RouterConfig, invariant_sigmoid, select_experts


@functools.cache
def _cpu_experts() -> ModuleType:
    """``moe.cpu_experts`` (the fused C expert step), imported on first use."""
    from tokenmill.moe import cpu_experts

    return cpu_experts


@functools.cache
def _triton_experts() -> ModuleType:
    """``moe.triton_experts``, imported on first use (importing it imports triton)."""
    from tokenmill.moe import triton_experts

    return triton_experts


@dataclass(frozen=True)
class MoEConfig:
    """One model's MoE layers: router rule, expert and shared-expert widths.

    moe_intermediate_size: each routed expert's intermediate width. shared_expert_intermediate_size: the
    shared expert's (0: none). shared_expert_gate: the shared expert's output is scaled by a per-token
    sigmoid gate (Qwen2-MoE). router_float32: the router GEMM runs in float32 on a float32 weight (DeepSeek).
    """

    router: RouterConfig
    hidden_size: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False
    router_float32: bool = False

    def __post_init__(self) -> None:
        if self.moe_intermediate_size < 1:
            raise ValueError(f"moe_intermediate_size must be >= 1, got {self.moe_intermediate_size}")
        if self.shared_expert_gate and not self.shared_expert_intermediate_size:
            raise ValueError("shared_expert_gate needs a shared expert (shared_expert_intermediate_size > 0)")


def sparse_layer_mask(num_layers: int, num_experts: int, *, mlp_only_layers: Sequence[int] = (),
                      decoder_sparse_step: int = 1, first_k_dense_replace: int = 0,
                      moe_layer_freq: int = 1) -> tuple[bool, ...]:
    """Which layers are MoE (True) and which keep a dense MLP, by the families' config fields.

    Qwen2/3-MoE: layer i is MoE unless i is in ``mlp_only_layers``, and only when (i + 1) % decoder_sparse_step
    == 0. DeepSeek: MoE from layer ``first_k_dense_replace`` on, every ``moe_layer_freq``-th (i % freq == 0).
    ``num_experts`` 0: every layer dense.

    Raises:
        ValueError: a step or frequency below 1, or an ``mlp_only_layers`` entry outside the model.
    """
    if decoder_sparse_step < 1 or moe_layer_freq < 1:
        raise ValueError(f"decoder_sparse_step ({decoder_sparse_step}) and moe_layer_freq ({moe_layer_freq}) "
                         "must be >= 1")
    bad = [i for i in mlp_only_layers if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"mlp_only_layers {bad} are not layers of a {num_layers}-layer model")
    dense = set(mlp_only_layers)
    return tuple(num_experts > 0 and i not in dense and (i + 1) % decoder_sparse_step == 0
                 and i >= first_k_dense_replace and i % moe_layer_freq == 0 for i in range(num_layers))


class Router(Linear):
    """The router: logits = x W^T, [T, hidden] -> [T, E] (a ``Linear``), plus DeepSeek-V3's
    ``e_score_correction_bias`` [E] when the config has one, and ``route`` = logits then ``select_experts``."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__(config.hidden_size, config.router.num_experts, bias=False)
        self.config = config.router
        self.float32 = config.router_float32
        if self.float32:
            self.weight = nn.Parameter(torch.empty(config.router.num_experts, config.hidden_size,
                                                   dtype=torch.float32), requires_grad=False)
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(config.router.num_experts, dtype=torch.float32), requires_grad=False)
            if config.router.correction_bias else None)

    def c_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> logits [T, E] for ``cpu_experts.route``: a float32 weight (``router_float32``) takes
        float32 inputs in the batch-invariant C GEMM (``bi_linear``, as the lean decode step computes them), any
        other router its ``forward``."""
        if self.float32 and self.quant is None and self.lora is None and self.bias is None:
            return bi_linear(x.float(), self.weight)
        return self(x.float() if self.float32 and self.quant is None else x)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, k] float32, expert ids [T, k] int64), in rank order."""
        logits = self(x.float() if self.float32 and self.quant is None else x)  # (T, E)
        return select_experts(logits, self.config, self.e_score_correction_bias, invariant=self.batch_invariant)


class SparseMoeBlock(nn.Module):
    """Router + routed experts (+ shared expert): forward(x [T, hidden]) -> [T, hidden] (module docstring).

    ``moe_index``: this block's position among the model's MoE layers (its row in ``expert_load``);
    ``expert_load``: where the step's tokens per expert are counted (None: not counted).
    ``use_triton`` (set by the CUDA runner): the routed experts run in the Triton grouped kernels
    (``triton_experts.py``) on weights stacked once by ``prepare_triton`` (called by the runner, else at the first
    such forward), also while a CUDA graph is captured (no host sync, a grid fixed by the shapes). Without it, a
    graph capture runs ``dense_expert_step``; on CPU, experts in GGUF blocks run in the fused C expert step
    (``cpu_experts.FusedExperts``, bit for bit the grouped step's result; ``use_cpu_fused`` False, or
    TOKENMILL_DISABLE_MOE_FUSED=1 at construction, turns it off), any other step in ``grouped_expert_step``.
    """

    use_triton = False

    def __init__(self, config: MoEConfig, moe_index: int = 0, expert_load: ExpertLoad | None = None) -> None:
        super().__init__()
        self.moe_config = config
        self.num_experts = config.router.num_experts
        self.top_k = config.router.top_k
        self.gate = Router(config)
        self.experts = nn.ModuleList(ExpertMLP(config.hidden_size, config.moe_intermediate_size)
                                     for _ in range(self.num_experts))
        self.shared_expert = (ExpertMLP(config.hidden_size, config.shared_expert_intermediate_size)
                              if config.shared_expert_intermediate_size else None)
        self.shared_expert_gate = Linear(config.hidden_size, 1, bias=False) if config.shared_expert_gate else None
        self.moe_index = moe_index
        self.expert_load = expert_load
        self._stacked: tuple[torch.Tensor, torch.Tensor] | None = None  # (gate_up [E, 2I, H], down [E, H, I])
        self.use_cpu_fused = not envs.disable_moe_fused()
        self.cpu_fused = None  # FusedExperts, or why not (str), or None: not yet tried (see fused_experts)

    def prepare_triton(self) -> None:
        """Stack the experts' weights for the Triton kernels (``experts.stack_expert_weights``: the experts' own
        weights become views of the stacked tensors, no extra memory).

        Raises:
            ValueError: quantized experts (GGUF blocks, int8), or a dtype the kernels do not take.
        """
        self._stacked = stack_expert_weights(self.experts)

    def fused_experts(self, x: torch.Tensor):
        """The fused C expert step for this block (``cpu_experts.FusedExperts``), or None where it does not apply
        (not on CPU, turned off, dense or LoRA'd experts, no C compiler). Described on the first call, again when
        the experts' blocks moved (RL sleep / weight updates reallocate them)."""
        if x.device.type != "cpu" or not self.use_cpu_fused:
            return None
        fused = self.cpu_fused
        if fused is None or (not isinstance(fused, str) and fused.key != _first_block_address(self.experts)):
            fused = self.cpu_fused = _cpu_experts().FusedExperts.describe(self.experts, x.dtype)
        return None if isinstance(fused, str) else fused

    def routes_in_c(self, x: torch.Tensor, fused=None) -> bool:
        """Whether this step routes with ``cpu_experts.route``: wherever the experts run in the fused C step
        (``fused_experts``, with a kernel plan or in deterministic mode: ``FusedExperts.applies``), for a softmax
        router it implements (``cpu_experts.c_routable``) without float32 router logits (DeepSeek's). Every step
        of such a block routes there, the first one included; turning the fused step off (``use_cpu_fused``,
        TOKENMILL_DISABLE_MOE_FUSED, ``--no-cpu-kernels``) routes with ``select_experts`` again. ``fused``: this
        step's ``fused_experts(x)`` when the caller has it."""
        fused = fused if fused is not None else self.fused_experts(x)
        return (fused is not None and fused.applies() and _cpu_experts().c_routable(self.gate.config))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = self.fused_experts(x)  # None off CPU and where the experts cannot run in the fused C step
        if self.routes_in_c(x, fused):  # blocks with fused experts route in C (cpu_experts.route), as the lean step does
            weights, ids = _cpu_experts().route(self.gate.c_logits(x), self.gate.config)
        else:
            weights, ids = self.gate.route(x)  # (T, k) float32, (T, k) int64
        counts = expert_counts(ids, self.num_experts)  # (E,)
        if self.expert_load is not None:
            self.expert_load.record(self.moe_index, counts)
        if self.use_triton:
            if self._stacked is None:
                assert not (x.is_cuda and torch.cuda.is_current_stream_capturing()), "prepare_triton before capture"
                self.prepare_triton()
            w_gate_up, w_down = self._stacked
            out = _triton_experts().triton_grouped_expert_step(x, weights, ids, w_gate_up, w_down, counts)
        elif x.is_cuda and torch.cuda.is_current_stream_capturing():
            out = dense_expert_step(x, weights, ids, self.experts)  # no data-dependent shapes in a graph
        else:
            out = fused(x, weights, ids) if fused is not None else None
            if out is None:
                out = grouped_expert_step(x, weights, ids, self.experts, counts)  # (T, hidden)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)  # (T, hidden)
            if self.shared_expert_gate is not None:
                gate = self.shared_expert_gate(x)  # (T, 1)
                # deterministic mode (the Linear's flag): torch's sigmoid bits depend on the element's position
                gate = invariant_sigmoid(gate) if self.shared_expert_gate.batch_invariant else torch.sigmoid(gate)
                shared = gate * shared  # (T, 1) * (T, hidden)
            out = out + shared
        return out


def _first_block_address(experts: nn.ModuleList) -> int | None:
    """Where expert 0's first gate_up block lives (None: dense weights)."""
    quant = experts[0].gate_up_proj.quant
    return quant.parts[0].data.data_ptr() if quant is not None else None
