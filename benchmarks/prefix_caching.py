"""Prefix-caching benchmark: TTFT and throughput with automatic prefix caching on vs off, in one run.

Workloads (embedded SmolLM2 model unless --model):
  shared-prefix: N requests share a long system prompt (default 1,000 tokens) and differ in a
                 50-token question; all arrive at once; each generates --output-len tokens.
  multi-turn:    one 10-turn chat; each turn appends the previous answer and a new ~50-token
                 user message, sent after the previous turn finished.
TTFT = first token time - arrival time, measured inside the engine (no HTTP).

    .venv/bin/python benchmarks/prefix_caching.py [--num-requests 64] [--output-json out.json]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from tokenmill import LLM, SamplingParams


def run_shared_prefix(llm: LLM, num_requests: int, prefix_len: int, question_len: int, output_len: int, seed: int):
    rng = random.Random(seed)
    vocab = llm.engine.loaded.vocab_size
    prefix = [rng.randrange(1000, vocab - 1000) for _ in range(prefix_len)]
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.monotonic()
    for i in range(num_requests):
        question = [rng.randrange(1000, vocab - 1000) for _ in range(question_len)]
        engine.add_request(f"sp-{i}", {"prompt_token_ids": prefix + question}, params)
    ttfts, cached, generated = [], [], 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                ttfts.append(out.metrics["first_token_time"] - out.metrics["arrival_time"])
                cached.append(out.num_cached_tokens)
                generated += len(out.outputs[0].token_ids)
    duration = time.monotonic() - start
    return {
        "mean_ttft_ms": 1e3 * statistics.mean(ttfts),
        "median_ttft_ms": 1e3 * statistics.median(ttfts),
        "output_throughput_tok_s": generated / duration,
        "total_throughput_tok_s": (generated + num_requests * (prefix_len + question_len)) / duration,
        "duration_s": duration,
        "cached_tokens_total": sum(cached),
    }


def run_multi_turn(llm: LLM, turns: int, user_len: int, output_len: int, seed: int):
    rng = random.Random(seed)
    words = "river mountain engine cache token stream paper garden window music planet signal".split()
    messages = [{"role": "system", "content": "You are a helpful assistant. " * 20}]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    ttfts, cached = [], []
    start = time.monotonic()
    generated = 0
    for turn in range(turns):
        messages.append({"role": "user", "content": " ".join(rng.choice(words) for _ in range(user_len))})
        out = llm.chat(messages, params)[0]
        ttfts.append(out.metrics["first_token_time"] - out.metrics["arrival_time"])
        cached.append(out.num_cached_tokens)
        generated += len(out.outputs[0].token_ids)
        messages.append({"role": "assistant", "content": out.outputs[0].text})
    duration = time.monotonic() - start
    return {
        "mean_ttft_ms": 1e3 * statistics.mean(ttfts),
        "last_turn_ttft_ms": 1e3 * ttfts[-1],
        "output_throughput_tok_s": generated / duration,
        "duration_s": duration,
        "cached_tokens_per_turn": cached,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prefix-len", type=int, default=1000)
    parser.add_argument("--question-len", type=int, default=50)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()

    results = {}
    for caching in (True, False):
        llm = LLM(model=args.model, dtype=args.dtype, enable_prefix_caching=caching, kv_cache_memory=2.0,
                  max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.num_requests)
        llm.generate("warm up", SamplingParams(max_tokens=2))
        label = "on" if caching else "off"
        results[f"shared_prefix_{label}"] = run_shared_prefix(
            llm, args.num_requests, args.prefix_len, args.question_len, args.output_len, args.seed)
        results[f"multi_turn_{label}"] = run_multi_turn(llm, args.turns, 50, 32, args.seed)
        del llm

    def row(name, key):
        on, off = results[f"{name}_on"][key], results[f"{name}_off"][key]
        return f"| {name} | {key} | {on:.1f} | {off:.1f} | {off / on if 'ttft' in key else on / off:.2f}x |"

    print("| workload | metric | caching on | caching off | gain |")
    print("|---|---|---|---|---|")
    for name in ("shared_prefix", "multi_turn"):
        keys = ["mean_ttft_ms", "output_throughput_tok_s"] + (["median_ttft_ms"] if name == "shared_prefix" else ["last_turn_ttft_ms"])
        for key in keys:
            print(row(name, key))
    print("multi-turn cached tokens per turn (on):", results["multi_turn_on"]["cached_tokens_per_turn"])
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
