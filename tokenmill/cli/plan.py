"""`tokenmill plan [MODEL]`: how a memory budget splits into weights, reserve and KV cache (no weights loaded)."""
from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import asdict

from tokenmill.engine_args import OPTION_NAMES, EngineArgs, cli_values
from tokenmill.memory_plan import (
    DTYPE_BYTES,
    KV_CACHE_DTYPES,
    QUANTIZED_KV_DTYPES,
    MemoryPlan,
    PlanConfig,
    physical_memory_gib,
    plan_memory,
    read_model_shape,
    resolved_quantization,
)
from tokenmill.runner.kv_cache_sizing import GIB

MIB = 1024**2
# The engine options the plan depends on: PlanConfig's fields named as EngineArgs' (their flags are the engine's).
PLAN_OPTIONS = tuple(f.name for f in dataclasses.fields(PlanConfig) if f.name in OPTION_NAMES)


def register(subparsers) -> None:
    """Add the ``plan`` subcommand."""
    p = subparsers.add_parser("plan", help="plan memory: weights, activation reserve, KV-cache capacity")
    p.add_argument("--memory", type=float, default=None, help="memory in GiB (default: this machine's RAM)")
    p.add_argument("--memory-utilization", type=float, default=PlanConfig.memory_utilization,
                   help="fraction of --memory tokenmill may use")
    EngineArgs.add_cli_args(p, include=("model", *PLAN_OPTIONS), overrides={
        "kv_cache_memory": {"default": PlanConfig.kv_cache_memory,
                            "help": "plan this KV budget in GiB instead of what --memory leaves"},
        "kv_cache_dtype": {"choices": KV_CACHE_DTYPES, "help": "auto = model dtype; fp8 = 1 byte per element"},
    })
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=cmd_plan)


def _gib(nbytes: int) -> str:
    return f"{nbytes / GIB:.3f} GiB" if nbytes >= GIB // 4 else f"{nbytes / MIB:.1f} MiB"


def plan_record(plan: MemoryPlan) -> dict:
    """The plan as a JSON-ready dict (inputs, model shape, every byte count and capacity)."""
    return {
        "model": asdict(plan.model), "config": asdict(plan.config), "dtype": plan.dtype,
        "kv_cache_dtype": plan.kv_cache_dtype, "max_model_len": plan.max_model_len,
        "weight_bytes": plan.weight_bytes, "runtime_overhead_bytes": plan.runtime_overhead_bytes,
        "activation_bytes": plan.activation_bytes, "reserve_bytes": plan.reserve_bytes,
        "usable_bytes": plan.usable_bytes, "kv_budget_bytes": plan.kv_budget_bytes,
        "kv_bytes_per_token": plan.kv_bytes_per_token, "bytes_per_block": plan.bytes_per_block,
        "num_kv_blocks": plan.num_kv_blocks, "num_kv_tokens": plan.num_kv_tokens,
        "kv_pool_bytes": plan.kv_pool_bytes, "blocks_per_sequence": plan.blocks_per_sequence,
        "num_full_length_sequences": plan.num_full_length_sequences, "total_bytes": plan.total_bytes,
        "kv_cache_memory_flag": plan.kv_cache_memory_flag,
        "state_bytes_per_sequence": plan.state_bytes_per_sequence, "num_state_slots": plan.num_state_slots,
        "num_state_checkpoints": plan.num_state_checkpoints, "state_pool_bytes": plan.state_pool_bytes,
        "num_sequences_both_pools": plan.num_sequences_both_pools,
        "num_active_params": plan.model.num_active_params, "active_weight_bytes": plan.active_weight_bytes,
    }


def format_plan(plan: MemoryPlan, model_arg: str | None = None) -> str:
    """The human-readable plan; ``model_arg`` is the MODEL as given (None: the embedded default)."""
    m, c = plan.model, plan.config
    quantization = resolved_quantization(m, c.quantization)
    sampled_rows = min(c.max_num_seqs, c.max_num_batched_tokens)
    lines = [
        f"model: {m.path} ({m.architecture}, {m.file_format}, {_gib(m.checkpoint_bytes)} on disk)",
        f"  layers {m.num_layers}, hidden {m.hidden_size}, heads {m.num_attention_heads}, kv heads {m.num_kv_heads}, "
        f"head_dim {m.head_dim}, intermediate {m.intermediate_size}, vocab {m.vocab_size}",
        (f"parameters: {m.num_params:,} x {plan.dtype} = {_gib(plan.weight_bytes)}"
         + ("" if plan.weight_bytes == m.num_params * DTYPE_BYTES[plan.dtype] else " (routers in float32)"))
        if quantization == "none" else f"parameters: {m.num_params:,}, {_gib(plan.weight_bytes)} with "
        f"quantized weights ({quantization}; the rest in {plan.dtype})",
        *([f"experts: {m.num_experts} routed of moe_intermediate {m.moe_intermediate_size}, "
           f"{m.num_experts_per_tok} per token, shared experts {m.shared_expert_intermediate_size or 'none'}, on "
           f"{m.num_moe_layers} of {m.num_layers} layers",
           f"active parameters: {m.num_active_params:,} per token ({m.num_active_params / m.num_params:.1%} of "
           f"{m.num_params:,}); a batch-1 decode step reads {_gib(plan.active_weight_bytes)} of weights "
           f"({plan.active_weight_bytes:,} B; tokens/s <= read bandwidth / this)"] if m.num_moe_layers else []),
        (f"KV bytes per token: {m.num_kv_layers} layers x latent {m.kv_latent_dim} (kv_lora_rank + qk_rope_head_dim) x "
         f"{DTYPE_BYTES[plan.kv_cache_dtype]} B ({plan.kv_cache_dtype}) = {plan.kv_bytes_per_token:,} B; block of "
         f"{c.block_size} tokens = {plan.bytes_per_block:,} B") if m.kv_latent_dim else
        f"KV bytes per token: 2 x {m.num_kv_layers} {'full-attention ' if m.num_linear_layers else ''}layers x {m.num_kv_heads} kv heads x ({m.head_dim} head_dim x "
        f"{DTYPE_BYTES[plan.kv_cache_dtype]} B ({plan.kv_cache_dtype})"
        + (" + a 2 B scale" if plan.kv_cache_dtype in QUANTIZED_KV_DTYPES else "")
        + f") = {plan.kv_bytes_per_token:,} B; block of {c.block_size} tokens = {plan.bytes_per_block:,} B",
        *([f"state bytes per sequence: {m.num_linear_layers} linear layers x (conv {m.linear_conv_dim} x "
           f"{m.linear_conv_kernel - 1} x {DTYPE_BYTES[plan.dtype]} B + recurrent {m.linear_num_value_heads} heads x "
           f"{m.linear_key_head_dim} x {m.linear_value_head_dim} x 4 B) = {plan.state_bytes_per_sequence:,} B; "
           f"state pool: {plan.num_state_slots} live slots ({'max_num_seqs' if c.state_cache_memory is None else 'state_cache_memory'}) + "
           f"{plan.num_state_checkpoints} prefix-cache checkpoints = {_gib(plan.state_pool_bytes)}"]
          if m.num_linear_layers else []),
        f"memory: {c.memory:g} GiB x {c.memory_utilization:g} = {_gib(plan.usable_bytes)} usable",
        f"reserve: {_gib(plan.reserve_bytes)} = runtime overhead {_gib(plan.runtime_overhead_bytes)} + activations "
        f"{_gib(plan.activation_bytes)} (one step of {c.max_num_batched_tokens} tokens, {sampled_rows} sampled rows, "
        f"one prefill chunk over {plan.max_model_len} tokens)",
        f"KV budget: {_gib(plan.kv_budget_bytes)}"
        + (" (given by --kv-cache-memory)" if c.kv_cache_memory is not None else
           " (usable - weights - reserve" + (" - state pool)" if m.num_linear_layers else ")")),
        f"KV pool: {plan.num_kv_blocks:,} blocks x {c.block_size} = {plan.num_kv_tokens:,} tokens "
        f"({_gib(plan.kv_pool_bytes)})",
        f"full-length sequences ({plan.max_model_len} tokens, {plan.blocks_per_sequence} blocks each) at once: "
        f"{plan.num_full_length_sequences:,}"
        + (f" in the KV pool; {plan.num_sequences_both_pools:,} with the state pool's {plan.num_state_slots} slots"
           if m.num_linear_layers else ""),
        f"total: {_gib(plan.total_bytes)} of {_gib(plan.usable_bytes)} usable",
        "equivalent: tokenmill serve "
        + (f"{model_arg} " if model_arg else "")
        + f"--dtype {plan.dtype} --block-size {c.block_size} --max-model-len {plan.max_model_len} "
        f"--max-num-seqs {c.max_num_seqs} --max-num-batched-tokens {c.max_num_batched_tokens} "
        f"--kv-cache-memory {plan.kv_cache_memory_flag:.12g}   (or --num-kv-blocks {plan.num_kv_blocks})"
        + (f" --kv-cache-dtype {plan.kv_cache_dtype}" if plan.kv_cache_dtype in QUANTIZED_KV_DTYPES else "")
        + (f" --state-cache-memory {c.state_cache_memory:g}" if c.state_cache_memory is not None else ""),
    ]
    if plan.total_bytes > plan.usable_bytes:
        lines.append("warning: weights + reserve + KV pool exceed the usable memory")
    if plan.kv_cache_dtype != plan.dtype and plan.kv_cache_dtype not in QUANTIZED_KV_DTYPES:
        lines.append(f"note: tokenmill serve stores KV in the model dtype ({plan.dtype}) today; these "
                     f"{plan.kv_cache_dtype} numbers are for planning, the flags above would allocate a different size")
    return "\n".join(lines)


def cmd_plan(args: argparse.Namespace) -> int:
    """Print the memory plan; returns the exit code."""
    config = PlanConfig(memory=args.memory if args.memory is not None else physical_memory_gib(),
                        memory_utilization=args.memory_utilization, **cli_values(args, PLAN_OPTIONS))
    plan = plan_memory(read_model_shape(args.model), config)
    print(json.dumps(plan_record(plan), indent=2) if args.json else format_plan(plan, args.model))
    return 0
