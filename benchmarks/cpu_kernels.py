"""Default mode against ``--no-cpu-kernels``, in one run: the C kernels where the measured plan picks
them (``tokenmill.runner.cpu_kernels``: GEMM, RMSNorm, SiLU×up, paged decode attention, the LM head's
float32 logits) against torch's ops for every layer. Records the CPU model and the ISA path; force
another path with ``--isa`` (e.g. ``--isa portable``; it must run on this CPU).

Two workloads, each run with the kernels on and then off, then on and off again in the opposite
order, best of the two kept per mode:

- batch-1 decode: one 64-token prompt, 128 new tokens (greedy, ignore_eos), as in
  ``../shared/baseline.md``; decode tok/s excludes the first token.
- ShareGPT at concurrency C (default 1, 8, 32): the same requests (standard filter, output length
  from the dataset capped at 256, greedy, ignore_eos) through ``LLM.generate`` with
  ``max_num_seqs=C``; output tok/s over the whole run (prefill included).

"Off" builds the same engine and applies the plan that ``--no-cpu-kernels`` gets (every layer on
torch), so the scheduler and sampler are the same in both modes. Runs vary 10–20% on the shared CPU
machines: compare within one run, on an idle machine.

    python benchmarks/cpu_kernels.py --dtype auto --concurrency 1,8,32 --output-json cpu_kernels.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace


def set_kernels(llm, on: bool, plans: dict) -> None:
    """Put ``llm``'s layers on the plan its runner measured (on) or on torch's ops (off)."""
    from tokenmill.runner.cpu_kernels import KernelPlan, apply_plan, plan_cpu_kernels

    runner = llm.engine.runner
    lm_head = getattr(runner.model, "lm_head", None)
    if "on" not in plans:
        plans["on"] = plan_cpu_kernels(runner.model, runner.loaded.dtype, lm_head=lm_head)
    apply_plan(runner.model, plans["on"] if on else KernelPlan(isa=None), lm_head)


def batch1_decode(llm) -> float:
    """Decode tok/s of one 64-token prompt with 128 new tokens (first token excluded)."""
    prompt = {"prompt_token_ids": list(range(1000, 1064))}
    from tokenmill import SamplingParams

    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    full = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    llm.generate(prompt, first)  # warm-up
    t0 = time.perf_counter()
    llm.generate(prompt, first)
    t1 = time.perf_counter()
    llm.generate(prompt, full)
    t2 = time.perf_counter()
    # Same prompt, so the prefix cache serves it in both calls: the difference is 127 decode steps.
    return 127 / ((t2 - t1) - (t1 - t0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="1,8,32", help="comma-separated max_num_seqs values")
    parser.add_argument("--requests-per-slot", type=float, default=2.0, help="requests per slot (at least 4)")
    parser.add_argument("--max-output-len", type=int, default=256)
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    parser.add_argument("--isa", default=None, help="force an ISA path (TOKENMILL_CPU_ISA), e.g. portable")
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    if args.isa:
        os.environ["TOKENMILL_CPU_ISA"] = args.isa
    from tokenmill import LLM, csrc_build
    from tokenmill.bench.datasets import sample_sharegpt
    from tokenmill.bench.offline import generate_sampled

    if args.isa and csrc_build.selected_isa() != args.isa:
        sys.exit(f"this CPU cannot run the {args.isa} path")
    plans: dict = {}
    llm = LLM(dtype=args.dtype, num_threads=args.num_threads)
    set_kernels(llm, True, plans)
    results: dict = {"cpu": csrc_build.cpu_model_name(), "isa": csrc_build.selected_isa(), "dtype": str(llm.engine.loaded.dtype),
                     "plan": plans["on"].describe(), "batch1_decode_tok_s": {}, "sharegpt": []}
    print(f"{results['cpu']}, ISA path {results['isa']}, {results['dtype']}\n{results['plan']}", flush=True)
    best = {"on": 0.0, "off": 0.0}
    for mode in ("on", "off", "off", "on"):
        set_kernels(llm, mode == "on", plans)
        best[mode] = max(best[mode], batch1_decode(llm))
    results["batch1_decode_tok_s"] = best
    print(f"batch-1 decode (64-token prompt, 128 new): kernels on {best['on']:.1f} tok/s, "
          f"off {best['off']:.1f} tok/s -> {best['on'] / best['off']:.2f}x", flush=True)

    tokenizer = llm.get_tokenizer()
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        num = max(4, int(round(concurrency * args.requests_per_slot)))
        requests = [replace(r, expected_output_len=min(r.expected_output_len, args.max_output_len))
                    for r in sample_sharegpt(tokenizer, num, seed=args.seed + concurrency)]
        runs: dict = {"on": None, "off": None}
        for mode in ("on", "off", "off", "on"):
            # A fresh engine per run: no prefix-cache hits carried from the previous run.
            run_llm = LLM(dtype=args.dtype, num_threads=args.num_threads, max_num_seqs=concurrency)
            set_kernels(run_llm, mode == "on", plans)
            row = generate_sampled(run_llm, requests)
            if runs[mode] is None or row["output_tok_s"] > runs[mode]["output_tok_s"]:
                runs[mode] = row
            del run_llm
        ratio = runs["on"]["output_tok_s"] / runs["off"]["output_tok_s"]
        results["sharegpt"].append({"concurrency": concurrency, "num_requests": num, **{
            f"{mode}_{k}": v for mode, row in runs.items() for k, v in row.items()}, "ratio": ratio})
        print(f"C={concurrency:>3}: {num} requests, {runs['on']['prompt_tokens']} prompt + "
              f"{runs['on']['output_tokens']} output tokens; kernels on {runs['on']['output_tok_s']:.1f}, "
              f"off {runs['off']['output_tok_s']:.1f} output tok/s -> {ratio:.2f}x", flush=True)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
