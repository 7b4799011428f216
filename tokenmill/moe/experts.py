"""The routed experts of one MoE layer and the three ways of running a step's tokens through them.

- ``grouped_expert_step`` (the one that runs): the step's (token, rank) pairs sorted by expert (a stable
  argsort, so each expert's rows keep token order) and counted (bincount); each active expert runs once, one
  GEMM chain over all its rows, so its weights are read once per step whatever the batch, in their stored type
  (``Linear``: dense, GGUF blocks through ``tokenmill.quantization``, int8); the results go back to their
  (token, rank) slots with ``index_copy_`` (a permutation: no additions, so no order to fix) and each token's
  k outputs are summed in rank order (``combine_in_rank_order``).
- ``reference_expert_step``: per token, per chosen expert, one row at a time: slow and obviously right.
- ``dense_expert_step``: every expert over every token, masked: no data-dependent shapes and no host sync, for
  CUDA graph capture without the Triton kernel (reads every expert's weights).
- The CUDA path (``SparseMoeBlock.use_triton``) runs ``moe/triton_experts.py``'s grouped kernels on the experts'
  weights stacked by ``stack_expert_weights``.

Deterministic mode: a token's arithmetic must not depend on the batch. The expert GEMMs are row-invariant when
their ``Linear``s run batch-invariant (set by ``runner/deterministic.py``, as for every Linear), SiLU-and-multiply
is elementwise, and the combine adds a token's k weighted outputs in rank order in float32, one elementwise
multiply-add per rank: the same operations in the same order for a token alone or in any batch.
"""
from __future__ import annotations

import torch
from torch import nn

from tokenmill.layers import Linear, MergedLinear, SiluAndMul


class ExpertMLP(nn.Module):
    """One SiLU-gated expert (also a shared expert): forward(x [N, hidden]) -> [N, hidden].

    Module names match the checkpoints' ``experts.{e}.gate_proj / up_proj / down_proj`` through the fused
    ``gate_up_proj`` (``LlamaForCausalLM.load_weights`` routes gate/up into its two shards).
    """

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size, intermediate_size], bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))  # (N, 2I) -> (N, I) -> (N, hidden)


def combine_in_rank_order(slot_outputs: torch.Tensor, weights: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """sum_r weights[t, r] * slot_outputs[t, r], accumulated in float32 in rank order r = 0, 1, ..., k - 1.

    slot_outputs: [T, k, hidden]; weights: [T, k] float32. Returns [T, hidden] in ``out_dtype``. Each output
    row is a fixed sequence of elementwise float32 operations on that token's own values.
    """
    out = slot_outputs[:, 0].float() * weights[:, 0:1]  # (T, hidden)
    for rank in range(1, slot_outputs.shape[1]):
        out.add_(slot_outputs[:, rank].float() * weights[:, rank:rank + 1])
    return out.to(out_dtype)


def expert_counts(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E] int64: how many (token, rank) pairs chose each expert (a scatter-add: no host sync, graph-safe)."""
    flat = expert_ids.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat))


def grouped_expert_step(x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor,
                        experts: nn.ModuleList, counts: torch.Tensor | None = None) -> torch.Tensor:
    """The step's tokens grouped by expert, one product chain per active expert (module docstring).

    x: [T, hidden]; weights: [T, k] float32; expert_ids: [T, k] int64; counts: ``expert_counts(expert_ids)``
    when the caller already has it. Returns [T, hidden] in x's dtype.
    """
    num_tokens, k = expert_ids.shape
    if num_tokens == 0:
        return torch.empty_like(x)
    flat = expert_ids.reshape(-1)  # (T * k,), slot s = t * k + r
    order = torch.argsort(flat, stable=True)  # (T * k,) slots grouped by expert, token order within each
    if counts is None:
        counts = expert_counts(expert_ids, len(experts))
    rows = x.index_select(0, order // k)  # (T * k, hidden) each slot's token, grouped by expert
    grouped = torch.empty_like(rows)
    start = 0
    for expert, n in enumerate(counts.tolist()):  # E host ints; only active experts run
        if n:
            grouped[start:start + n] = experts[expert](rows[start:start + n])
            start += n
    slots = torch.empty_like(grouped).index_copy_(0, order, grouped)  # (T * k, hidden) back to slot order
    return combine_in_rank_order(slots.view(num_tokens, k, -1), weights, x.dtype)


def reference_expert_step(x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor,
                          experts: nn.ModuleList) -> torch.Tensor:
    """Per token, per chosen expert in rank order, one row at a time (the slow reference; tests only)."""
    num_tokens, k = expert_ids.shape
    slots = torch.empty(num_tokens, k, x.shape[1], dtype=x.dtype, device=x.device)
    for t in range(num_tokens):
        for rank in range(k):
            slots[t, rank] = experts[int(expert_ids[t, rank])](x[t:t + 1])[0]
    return combine_in_rank_order(slots, weights, x.dtype)


def dense_expert_step(x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor,
                      experts: nn.ModuleList) -> torch.Tensor:
    """Every expert over every token, each slot taking its chosen expert's row by a mask (no host sync)."""
    num_tokens, k = expert_ids.shape
    slots = torch.zeros(num_tokens, k, x.shape[1], dtype=x.dtype, device=x.device)
    for expert, module in enumerate(experts):
        y = module(x)  # (T, hidden)
        chosen = (expert_ids == expert).unsqueeze(-1)  # (T, k, 1)
        slots = torch.where(chosen, y.unsqueeze(1), slots)
    return combine_in_rank_order(slots, weights, x.dtype)


def stack_expert_weights(experts: nn.ModuleList) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts' dense weights stacked for the Triton grouped kernels: (gate_up [E, 2I, H], down [E, H, I]).

    Each expert's ``gate_up_proj.weight`` / ``down_proj.weight`` is then re-pointed at its slice of the stacked
    tensors (views: the separate copies are freed, so the stacked layout costs no extra memory and the torch
    paths read the same storage). Done once per layer; calling it again stacks again (the same values).

    Raises:
        ValueError: an expert whose weights are quantized (GGUF blocks or int8, ``Linear.quant``), have a bias or
            a LoRA hook, or differ in dtype or device: the Triton kernels take dense bf16 / fp16 / fp32 weights only.
    """
    linears = [(m.gate_up_proj, m.down_proj) for m in experts]
    for index, pair in enumerate(linears):
        for linear in pair:
            if linear.quant is not None or linear.weight is None:
                raise ValueError(f"expert {index}: weights kept quantized (GGUF blocks / int8) cannot run in the "
                                 "Triton grouped expert kernel; load them dense (--quantization none: GGUF files "
                                 "dequantize to --dtype)")
            if linear.bias is not None or linear.lora is not None:
                raise ValueError(f"expert {index}: a bias or a LoRA adapter on an expert is not supported by the "
                                 "Triton grouped expert kernel")
    first = linears[0][0].weight
    if first.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"the Triton grouped expert kernel takes bf16 / fp16 / fp32 weights, not {first.dtype}")
    if any(w.dtype != first.dtype or w.device != first.device for pair in linears for w in
           (pair[0].weight, pair[1].weight)):
        raise ValueError("the experts' weights differ in dtype or device")
    with torch.no_grad():
        gate_up = torch.stack([pair[0].weight for pair in linears])  # (E, 2I, H)
        down = torch.stack([pair[1].weight for pair in linears])  # (E, H, I)
        for index, (gate_up_proj, down_proj) in enumerate(linears):
            gate_up_proj.weight = nn.Parameter(gate_up[index], requires_grad=False)
            down_proj.weight = nn.Parameter(down[index], requires_grad=False)
    return gate_up, down
