"""Multi-LoRA overhead: the same ShareGPT requests on the base model alone and spread round-robin over
1, 4 and 16 adapters of rank 8 and 64, on one engine in one run.

Adapters: written by peft for the benchmark model (a transformers twin of the engine's weights) into
a temporary directory, on all seven projections (q/k/v/o/gate/up/down), ``init_lora_weights=False``
(A and B random, seeded per adapter, so no delta is zero), ``lora_alpha`` = rank.

Workload: --num-prompts ShareGPT requests (standard filter, prompts up to --max-prompt-len tokens,
fixed --seed); request i generates exactly min(its dataset output length, --max-tokens) tokens
(greedy, ``ignore_eos``), so every configuration does the same prefill and decode work;
``LLM(max_num_seqs=--concurrency)``, all requests queued in one ``generate``. Request i uses adapter
``i % k`` of its configuration. Prefix caching is off, so every run prefills every prompt (blocks are
keyed by adapter: a cache would favour repeated base runs). The engine has ``max_loras`` 16 (all
adapters of a configuration run in one step), ``max_lora_rank`` the largest rank and a host cache
for every adapter; before each timed run a short warm-up with every adapter of the configuration
reads them from disk and places them in slots, so no timed run loads weights.

The base model runs first, between the rank groups and last (drift on a shared machine shows as a
spread between those runs); each configuration's ratio is its output tok/s over the mean of the
base runs. Reported: output tok/s, mean TPOT (first token to last, per request), wall time and the
ratio; goal: 16 adapters of rank 8 keep >= 0.75 of the base model's throughput. Runs vary 10-20% on
the shared CPU machines: compare within one run, on an idle machine.

    .venv/bin/python benchmarks/multi_lora.py [--num-prompts 64] [--max-tokens 64] [--quick]
        [--output-json multi_lora.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import LoraLayer
from transformers import AutoModelForCausalLM

from tokenmill import LLM, LoRARequest, SamplingParams
from tokenmill.bench.datasets import sample_sharegpt

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def transformers_twin(llm: LLM) -> torch.nn.Module:
    """The float32 transformers model of the engine's weights (fused qkv/gate_up split back into
    projections), so peft sees the module names an adapter of this model targets."""
    loaded = llm.engine.loaded
    hf = AutoModelForCausalLM.from_config(loaded.hf_config, dtype=torch.float32).eval()
    state = {}
    for name, module in loaded.model.named_modules():
        for fused, projections in (("qkv_proj", ("q_proj", "k_proj", "v_proj")),
                                   ("gate_up_proj", ("gate_proj", "up_proj"))):
            if name.endswith(fused):
                for proj, part in zip(projections, module.weight.split(module.output_sizes)):
                    state[f"{name[: -len(fused)]}{proj}.weight"] = part.float()
    state.update((k, v.float()) for k, v in loaded.model.state_dict().items()
                 if "qkv_proj" not in k and "gate_up_proj" not in k)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    return hf


def write_adapters(llm: LLM, root: Path, rank: int, count: int, seed: int, first_id: int) -> list[LoRARequest]:
    """``count`` random rank-``rank`` adapters on every projection, saved by peft under ``root``."""
    peft_model = get_peft_model(transformers_twin(llm), LoraConfig(
        r=rank, lora_alpha=rank, init_lora_weights=False, target_modules=TARGETS))
    requests = []
    for i in range(count):
        torch.manual_seed(seed + 1000 * rank + i)
        for module in peft_model.modules():  # fresh random A and B (nn.Linear's default init) per adapter
            if isinstance(module, LoraLayer):
                module.lora_A["default"].reset_parameters()
                module.lora_B["default"].reset_parameters()
        path = root / f"r{rank}-{i}"
        peft_model.save_pretrained(path)
        requests.append(LoRARequest(f"r{rank}-{i}", first_id + i, str(path)))
    return requests


def timed_generate(llm: LLM, prompts: list[list[int]], params: list[SamplingParams],
                   loras: list[LoRARequest | None]) -> dict:
    """Generate all requests in one call; returns {output_tokens, wall_s, output_tok_s, mean_tpot_ms}."""
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=loras)
    wall = time.perf_counter() - start
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    assert lengths == [p.max_tokens for p in params], "an output stopped before its max_tokens"
    tpots = [(o.metrics["finished_time"] - o.metrics["first_token_time"]) / (n - 1)
             for o, n in zip(outputs, lengths) if n > 1]
    tokens = sum(lengths)
    return {"output_tokens": tokens, "wall_s": wall, "output_tok_s": tokens / wall,
            "mean_tpot_ms": 1000 * statistics.fmean(tpots) if tpots else None}


def run_config(llm: LLM, name: str, rank: int | None, adapters: list[LoRARequest], prompts: list[list[int]],
               params: list[SamplingParams]) -> dict:
    """Warm up ``adapters`` (host cache and slots), then time every prompt, request i on adapter i % k."""
    loras: list[LoRARequest | None] = [adapters[i % len(adapters)] for i in range(len(prompts))] if adapters \
        else [None] * len(prompts)
    warm = prompts[: max(len(adapters), 2)]
    llm.generate([{"prompt_token_ids": p[:16]} for p in warm], SamplingParams(temperature=0.0, max_tokens=2),
                 lora_request=loras[: len(warm)])
    manager = llm.engine.lora_manager
    loads = manager.num_disk_loads + manager.num_slot_loads
    row = {"config": name, "num_adapters": len(adapters), "rank": rank, **timed_generate(llm, prompts, params, loras)}
    row["adapter_loads"] = manager.num_disk_loads + manager.num_slot_loads - loads  # 0: nothing loaded while timed
    print(f"{name:>8}: {row['output_tokens']} tokens in {row['wall_s']:6.1f} s = {row['output_tok_s']:6.1f} tok/s, "
          f"mean TPOT {row['mean_tpot_ms']:.1f} ms, adapter loads while timed {row['adapter_loads']}", flush=True)
    return row


def table(rows: list[dict], base_tok_s: float) -> str:
    lines = ["| config | adapters | rank | output tok/s | mean TPOT ms | wall s | vs base |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['config']} | {r['num_adapters']} | {r['rank'] or '-'} | {r['output_tok_s']:.1f} | "
                     f"{r['mean_tpot_ms']:.1f} | {r['wall_s']:.1f} | {r['output_tok_s'] / base_tok_s:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64, help="cap on each request's dataset output length")
    parser.add_argument("--max-prompt-len", type=int, default=512, help="ShareGPT prompt filter (tokens)")
    parser.add_argument("--concurrency", type=int, default=32, help="max_num_seqs")
    parser.add_argument("--adapters", default="1,4,16", help="adapter counts, comma-separated")
    parser.add_argument("--ranks", default="8,64", help="adapter ranks, comma-separated")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: 32 prompts, max_tokens 32, 16 adapters of rank 8 only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="HF directory or GGUF file (default: the embedded model)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    if args.quick:
        args.num_prompts, args.max_tokens, args.adapters, args.ranks = 32, 32, "16", "8"
    counts = [int(c) for c in args.adapters.split(",")]
    ranks = [int(r) for r in args.ranks.split(",")]
    max_loras = max(counts)

    llm = LLM(model=args.model, dtype=args.dtype, num_threads=args.num_threads, max_num_seqs=args.concurrency,
              enable_prefix_caching=False, enable_lora=True, max_loras=max_loras, max_lora_rank=max(ranks),
              max_cpu_loras=max_loras * len(ranks))
    sampled = sample_sharegpt(llm.get_tokenizer(), args.num_prompts, seed=args.seed, max_prompt_len=args.max_prompt_len)
    prompts = [r.prompt_token_ids for r in sampled]
    params = [SamplingParams(temperature=0.0, max_tokens=min(r.expected_output_len, args.max_tokens), ignore_eos=True)
              for r in sampled]
    prompt_tokens = sum(len(p) for p in prompts)
    output_tokens = sum(p.max_tokens for p in params)
    print(f"{args.num_prompts} ShareGPT prompts ({prompt_tokens} tokens, mean {prompt_tokens / len(prompts):.0f}), "
          f"{output_tokens} output tokens (mean {output_tokens / len(prompts):.0f}, cap {args.max_tokens}), "
          f"concurrency {args.concurrency}, greedy, {llm.engine.loaded.dtype}, max_loras {max_loras}", flush=True)

    with tempfile.TemporaryDirectory(prefix="multi_lora-") as tmp:
        start = time.perf_counter()
        adapters = {rank: write_adapters(llm, Path(tmp), rank, max_loras, args.seed, first_id=1 + 100 * k)
                    for k, rank in enumerate(ranks)}
        print(f"wrote {max_loras} adapters of rank {', '.join(map(str, ranks))} in {time.perf_counter() - start:.0f} s",
              flush=True)
        # Warm-up: kernels, allocator, every prompt length class once.
        llm.generate([{"prompt_token_ids": p} for p in prompts[: args.concurrency]],
                     SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        rows, base_rows = [], []
        base_rows.append(run_config(llm, "base", None, [], prompts, params))
        for rank in ranks:
            for count in counts:
                rows.append(run_config(llm, f"{count}x r{rank}", rank, adapters[rank][:count], prompts, params))
            base_rows.append(run_config(llm, "base", None, [], prompts, params))
    llm.close()

    base_tok_s = statistics.fmean(r["output_tok_s"] for r in base_rows)
    base_spread = (max(r["output_tok_s"] for r in base_rows) - min(r["output_tok_s"] for r in base_rows)) / base_tok_s
    base = {"config": "base (mean)", "num_adapters": 0, "rank": None, "output_tok_s": base_tok_s,
            "mean_tpot_ms": statistics.fmean(r["mean_tpot_ms"] for r in base_rows),
            "wall_s": statistics.fmean(r["wall_s"] for r in base_rows)}
    print()
    print(table([base, *rows], base_tok_s))
    runs = ", ".join(f"{r['output_tok_s']:.1f}" for r in base_rows)
    print(f"base runs: {runs} tok/s "
          f"(spread {100 * base_spread:.1f}% of the mean)")
    goal = next((r for r in rows if r["num_adapters"] == 16 and r["rank"] == 8), None)
    if goal is not None:
        ratio = goal["output_tok_s"] / base_tok_s
        verdict = "met" if ratio >= 0.75 else "not met"
        print(f"16 adapters of rank 8: {ratio:.3f} of base throughput (goal >= 0.75: {verdict})")
    if args.output_json:
        results = {"num_prompts": args.num_prompts, "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
                   "max_tokens": args.max_tokens, "max_prompt_len": args.max_prompt_len,
                   "concurrency": args.concurrency, "dtype": str(llm.engine.loaded.dtype), "max_loras": max_loras,
                   "max_lora_rank": max(ranks), "base_runs": base_rows, "base_tok_s": base_tok_s,
                   "configs": [{**r, "ratio": r["output_tok_s"] / base_tok_s} for r in rows]}
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
