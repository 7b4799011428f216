"""Deterministic mode's cost: ShareGPT output throughput, default vs ``deterministic=True``, in one run.

For each concurrency C (default 1, 8, 32) the same ShareGPT requests (standard filter, output
length from the dataset's reply, greedy, ignore_eos) run through ``LLM.generate`` with
``max_num_seqs=C`` (at most C sequences in flight), once per mode, back to back; the script
prints output tok/s per mode and the ratio deterministic / default. Runs vary 10–20% on the
shared CPU machines: compare modes within one run only, on an idle machine.

    python benchmarks/deterministic_throughput.py --concurrency 1,8,32 --requests-per-slot 2 \
        --output-json det.json
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

from tokenmill import LLM
from tokenmill.bench.datasets import sample_sharegpt
from tokenmill.bench.offline import generate_sampled


def run(mode_deterministic: bool, concurrency: int, requests, args) -> dict:
    """Build an engine for this mode and concurrency, generate every request, return the timings."""
    t0 = time.perf_counter()
    llm = LLM(
        dtype=args.dtype, deterministic=mode_deterministic, max_num_seqs=concurrency,
        max_num_batched_tokens=args.max_num_batched_tokens, num_threads=args.num_threads,
    )
    load_s = time.perf_counter() - t0
    run = generate_sampled(llm, requests)
    return {
        "mode": "deterministic" if mode_deterministic else "default",
        "concurrency": concurrency,
        "num_requests": len(requests),
        "load_s": load_s,
        **run,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="1,8,32", help="comma-separated max_num_seqs values")
    parser.add_argument("--requests-per-slot", type=float, default=2.0,
                        help="requests per concurrency slot (at least 4 requests per run)")
    parser.add_argument("--max-output-len", type=int, default=256, help="cap on each request's output length")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()

    tokenizer = LLM(dtype=args.dtype).get_tokenizer()
    rows = []
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        num = max(4, int(round(concurrency * args.requests_per_slot)))
        requests = [
            replace(r, expected_output_len=min(r.expected_output_len, args.max_output_len))
            for r in sample_sharegpt(tokenizer, num, seed=args.seed + concurrency)
        ]
        pair = [run(False, concurrency, requests, args), run(True, concurrency, requests, args)]
        ratio = pair[1]["output_tok_s"] / pair[0]["output_tok_s"]
        for row in pair:
            row["ratio_vs_default"] = ratio if row["mode"] == "deterministic" else 1.0
            rows.append(row)
            print(f"C={concurrency:>3} {row['mode']:>13}: {row['num_requests']} requests, {row['prompt_tokens']} prompt + "
                  f"{row['output_tokens']} output tokens in {row['wall_s']:.1f} s = {row['output_tok_s']:.1f} output tok/s",
                  flush=True)
        print(f"C={concurrency:>3} deterministic / default throughput = {ratio:.3f}", flush=True)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
