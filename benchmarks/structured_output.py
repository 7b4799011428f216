"""Structured-output overhead: the same chat requests generated under a JSON schema and without one,
on one engine in one run, per backend (llguidance ``guidance``, ``xgrammar``, or both).

Workload: --num-prompts ShareGPT first turns (standard filter, prompts up to --max-prompt-len
tokens, fixed --seed), each wrapped in a chat asking for a JSON description of the message;
``LLM(max_num_seqs=--concurrency)`` so that many sequences decode at once, all requests queued
together; greedy unless --temperature (then seeded per request). The schema (``SCHEMA``) is a
typical extraction object: bounded strings, an enum, a bounded integer and a short array.

Per backend, after a warm-up (backend token tables built, schema compiled, kernels warm):

- constrained: every request under ``StructuredOutputsParams(json=SCHEMA)``, max_tokens --max-tokens;
- unconstrained baseline (``--baseline matched``, default): the same prompts, no constraint, each
  request generating exactly as many tokens as its constrained twin (ignore_eos), so both runs do
  the same prefill and decode work and differ only by the constraint. ``--baseline free``: one
  unconstrained run with the same max_tokens that stops at end-of-sequence (output lengths then
  differ between the runs, which moves tok/s by itself).

The warm-up prefills every prompt once, so each timed run finds its prompts in the prefix cache
(the hit rate is printed) and is nearly all decode steps, where the mask is filled: a stricter test
than a run whose prefill dilutes the cost, and a shorter one. Reported: output tok/s of both runs
and their ratio (constrained / unconstrained; goal >= 0.9), mean TPOT, the mask-fill time per step
and per constrained row (``StructuredOutputManager`` counters, deltas around the constrained
run; the fill overlaps the forward pass, so it is an upper bound on its cost), how the constrained
outputs finished, and the share that parse as JSON and validate against the schema (jsonschema).
With both backends the second one replaces the first's manager on the same engine. Runs vary
10-20% on the shared CPU machines: compare within one run, on an idle machine.

    .venv/bin/python benchmarks/structured_output.py [--backend both] [--num-prompts 64]
        [--max-tokens 160] [--output-json structured_output.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter

import jsonschema

from tokenmill import LLM, SamplingParams
from tokenmill.bench.datasets import sample_sharegpt
from tokenmill.config import StructuredOutputsConfig
from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.structured_output import StructuredOutputManager

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "summary": {"type": "string", "maxLength": 160},
        "language": {"type": "string", "maxLength": 16},
        "category": {"enum": ["question", "request", "instruction", "code", "creative", "other"]},
        "difficulty": {"type": "integer", "minimum": 1, "maximum": 10},
        "keywords": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
    },
    "required": ["title", "summary", "language", "category", "difficulty", "keywords"],
    "additionalProperties": False,
}

SYSTEM = "You are a careful assistant that answers only with one JSON object and nothing else."
INSTRUCTION = (
    "Describe the message below as a JSON object with these fields: title (a short title), summary "
    "(one sentence), language (the language it is written in), category (one of question, request, "
    "instruction, code, creative, other), difficulty (an integer from 1 to 10) and keywords (up to "
    "four short keywords).\n\nMessage:\n"
)


def build_prompts(llm: LLM, num_prompts: int, seed: int, max_prompt_len: int) -> list[list[int]]:
    """Chat-template token ids of one JSON request per sampled ShareGPT first turn."""
    sampled = sample_sharegpt(llm.get_tokenizer(), num_prompts, seed=seed, max_prompt_len=max_prompt_len)
    return [
        llm.apply_chat_template([{"role": "system", "content": SYSTEM},
                                 {"role": "user", "content": INSTRUCTION + r.prompt}])
        for r in sampled
    ]


def use_backend(llm: LLM, backend: str) -> StructuredOutputManager:
    """Point ``llm``'s engine at ``backend``: a fresh manager replaces the current one if it differs."""
    engine = llm.engine
    manager = engine.structured_output_manager
    if manager.backend_name != backend:
        manager.close()
        manager = StructuredOutputManager(StructuredOutputsConfig(backend=backend), engine.tokenizer,
                                          engine.loaded.vocab_size, engine.loaded.eos_token_ids)
        engine.structured_output_manager = manager
    _ = manager.backend  # build the backend's token tables now, outside any timed run
    return manager


def sampling(args: argparse.Namespace, i: int, **kwargs) -> SamplingParams:
    """Request ``i``'s parameters: greedy, or seeded sampling at --temperature."""
    if args.temperature == 0:
        return SamplingParams(temperature=0.0, **kwargs)
    return SamplingParams(temperature=args.temperature, seed=args.seed + i, **kwargs)


def timed_generate(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[list, dict]:
    """Generate all requests in one call; returns (outputs, {output_tokens, wall_s, output_tok_s, mean_tpot_ms,
    prefix_hit_rate})."""
    kv = llm.engine.kv_cache_manager
    queries0, hits0 = kv.prefix_cache_queries, kv.prefix_cache_hits
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    wall = time.perf_counter() - start
    queries = kv.prefix_cache_queries - queries0
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    tpots = [(o.metrics["finished_time"] - o.metrics["first_token_time"]) / (n - 1)
             for o, n in zip(outputs, lengths) if n > 1]
    tokens = sum(lengths)
    row = {"output_tokens": tokens, "wall_s": wall, "output_tok_s": tokens / wall,
           "mean_tpot_ms": 1000 * statistics.fmean(tpots) if tpots else None,
           "prefix_hit_rate": (kv.prefix_cache_hits - hits0) / queries if queries else None}
    return outputs, row


def check_outputs(outputs: list) -> dict:
    """Finish reasons of the constrained outputs and how many parse as JSON and validate."""
    validator = jsonschema.Draft202012Validator(SCHEMA)
    parsed = valid = valid_stopped = 0
    for o in outputs:
        try:
            value = json.loads(o.outputs[0].text)
        except ValueError:
            continue
        parsed += 1
        ok = validator.is_valid(value)
        valid += ok
        valid_stopped += ok and o.outputs[0].finish_reason == "stop"
    reasons = Counter(str(o.outputs[0].finish_reason) for o in outputs)
    stopped = reasons.get("stop", 0)
    return {"finish_reasons": dict(reasons), "parsed": parsed, "valid": valid, "valid_share": valid / len(outputs),
            "valid_share_of_stopped": valid_stopped / stopped if stopped else None}


def run_backend(llm: LLM, backend: str, prompts: list[list[int]], args: argparse.Namespace,
                free_baseline: dict | None) -> tuple[dict, list[str]]:
    """The constrained run on ``backend`` and its baseline; returns (result row, constrained texts)."""
    manager = use_backend(llm, backend)
    constraint = StructuredOutputsParams(json=SCHEMA)
    # Warm-up: compile the schema and run a few constrained steps.
    llm.generate([{"prompt_token_ids": p} for p in prompts[:4]],
                 SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=constraint))
    seconds0, steps0, rows0 = manager.mask_seconds_total, manager.mask_steps_total, manager.mask_rows_total
    outputs, constrained = timed_generate(
        llm, prompts, [sampling(args, i, max_tokens=args.max_tokens, structured_outputs=constraint)
                       for i in range(len(prompts))])
    seconds = manager.mask_seconds_total - seconds0
    steps, rows = manager.mask_steps_total - steps0, manager.mask_rows_total - rows0
    if free_baseline is None:
        lengths = [max(1, len(o.outputs[0].token_ids)) for o in outputs]
        _, baseline = timed_generate(
            llm, prompts, [sampling(args, i, max_tokens=n, ignore_eos=True) for i, n in enumerate(lengths)])
    else:
        baseline = free_baseline
    row = {
        "backend": backend,
        "constrained": constrained,
        "unconstrained": baseline,
        "ratio": constrained["output_tok_s"] / baseline["output_tok_s"],
        "mask_steps": steps,
        "mask_rows": rows,
        "mask_ms_per_step": 1000 * seconds / steps if steps else None,
        "mask_us_per_row": 1e6 * seconds / rows if rows else None,
        "mask_share_of_wall": seconds / constrained["wall_s"],
        **check_outputs(outputs),
        "example": outputs[0].outputs[0].text,
    }
    return row, [o.outputs[0].text for o in outputs]


def report(row: dict, num_prompts: int) -> None:
    c, u = row["constrained"], row["unconstrained"]

    def tpot(r: dict) -> str:
        hits = "n/a" if r["prefix_hit_rate"] is None else f"{100 * r['prefix_hit_rate']:.0f}%"
        return ("n/a" if r["mean_tpot_ms"] is None else f"{r['mean_tpot_ms']:.1f} ms") + f", prompt cache hits {hits}"

    print(f"[{row['backend']}] constrained {c['output_tokens']} tokens in {c['wall_s']:.1f} s = "
          f"{c['output_tok_s']:.1f} tok/s (TPOT {tpot(c)}); unconstrained {u['output_tokens']} tokens in "
          f"{u['wall_s']:.1f} s = {u['output_tok_s']:.1f} tok/s (TPOT {tpot(u)}) -> "
          f"ratio {row['ratio']:.3f} (goal >= 0.9)", flush=True)
    per_step = "n/a" if row["mask_ms_per_step"] is None else f"{row['mask_ms_per_step']:.3f} ms/step"
    per_row = "n/a" if row["mask_us_per_row"] is None else f"{row['mask_us_per_row']:.1f} us/row"
    print(f"[{row['backend']}] mask fill: {row['mask_steps']} steps, {row['mask_rows']} rows, {per_step}, "
          f"{per_row}, {100 * row['mask_share_of_wall']:.1f}% of the constrained wall time (overlaps the forward)",
          flush=True)
    share = row["valid_share_of_stopped"]
    of_stopped = "n/a" if share is None else f"{100 * share:.1f}%"
    print(f"[{row['backend']}] outputs: finish {row['finish_reasons']}; {row['parsed']}/{num_prompts} parse, "
          f"{row['valid']}/{num_prompts} valid ({100 * row['valid_share']:.1f}%; {of_stopped} of those that "
          f"finished with stop); first: {row['example'][:160]!r}",
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="both", choices=["guidance", "xgrammar", "both"])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--concurrency", type=int, default=32, help="max_num_seqs")
    parser.add_argument("--max-prompt-len", type=int, default=512, help="ShareGPT prompt filter (tokens)")
    parser.add_argument("--baseline", default="matched", choices=["matched", "free"])
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="HF directory or GGUF file (default: the embedded model)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    backends = ["guidance", "xgrammar"] if args.backend == "both" else [args.backend]

    llm = LLM(model=args.model, dtype=args.dtype, num_threads=args.num_threads, max_num_seqs=args.concurrency,
              structured_outputs_config={"backend": backends[0]})
    prompts = build_prompts(llm, args.num_prompts, args.seed, args.max_prompt_len)
    prompt_tokens = sum(len(p) for p in prompts)
    print(f"{args.num_prompts} ShareGPT chat prompts ({prompt_tokens} tokens, mean {prompt_tokens / len(prompts):.0f}), "
          f"concurrency {args.concurrency}, max_tokens {args.max_tokens}, "
          f"{'greedy' if args.temperature == 0 else f'temperature {args.temperature}'}, "
          f"{args.baseline} baseline, {llm.engine.loaded.dtype}", flush=True)
    # Warm-up: prefill (and cache) every prompt, then a few decode steps.
    llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=1))
    llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], SamplingParams(temperature=0.0, max_tokens=8))

    free_baseline = None
    if args.baseline == "free":
        _, free_baseline = timed_generate(
            llm, prompts, [sampling(args, i, max_tokens=args.max_tokens) for i in range(len(prompts))])
    results: dict = {"num_prompts": args.num_prompts, "prompt_tokens": prompt_tokens, "concurrency": args.concurrency,
                     "max_tokens": args.max_tokens, "baseline": args.baseline, "temperature": args.temperature,
                     "dtype": str(llm.engine.loaded.dtype), "schema": SCHEMA, "backends": []}
    texts: dict[str, list[str]] = {}
    for backend in backends:
        row, texts[backend] = run_backend(llm, backend, prompts, args, free_baseline)
        results["backends"].append(row)
        report(row, args.num_prompts)
    if len(texts) == 2:
        same = sum(a == b for a, b in zip(*texts.values()))
        results["same_text_across_backends"] = same
        print(f"identical constrained outputs across backends: {same}/{args.num_prompts}", flush=True)
    llm.close()
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
