"""Default-mode CPU kernels on vs off: the C GEMM for decode-sized linears plus the C RMSNorm and
SiLU×up (``tokenmill.runner.cpu_kernels``) against torch's ``F.linear`` and elementwise ops, in one run.

Two workloads, each run with the kernels on and then off, then on and off again in the opposite
order, best of the two kept per mode:

- batch-1 decode: one 64-token prompt, 128 new tokens (greedy, ignore_eos), as in
  ``../shared/baseline.md``; decode tok/s excludes the first token.
- ShareGPT at concurrency C (default 1, 8, 32): the same requests (standard filter, output length
  from the dataset capped at 256, greedy, ignore_eos) through ``LLM.generate`` with
  ``max_num_seqs=C``; output tok/s over the whole run (prefill included).

"Off" builds the same engine and then puts every Linear, RMSNorm and SiluAndMul back on its torch
path, so the attention kernel, scheduler and sampler are the same in both modes. Runs vary 10–20%
on the shared CPU machines: compare within one run, on an idle machine.

    python benchmarks/cpu_kernels.py --concurrency 1,8,32 --output-json cpu_kernels.json
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

from tokenmill import LLM, SamplingParams
from tokenmill.bench.datasets import sample_sharegpt
from tokenmill.bench.offline import generate_sampled
from tokenmill.layers.activation import SiluAndMul
from tokenmill.layers.layernorm import RMSNorm
from tokenmill.layers.linear import Linear


def set_kernels(llm: LLM, on: bool, saved: dict) -> None:
    """Switch the default-mode C kernels of ``llm``'s model on (as the runner set them) or off."""
    for module in llm.engine.runner.model.modules():
        if isinstance(module, Linear):
            saved.setdefault(id(module), module.cpu_gemm_max_rows)
            module.cpu_gemm_max_rows = saved[id(module)] if on else 0
        elif isinstance(module, (RMSNorm, SiluAndMul)):
            saved.setdefault(id(module), module.use_cpu_kernel)
            module.use_cpu_kernel = saved[id(module)] if on else False


def batch1_decode(llm: LLM) -> float:
    """Decode tok/s of one 64-token prompt with 128 new tokens (first token excluded)."""
    prompt = {"prompt_token_ids": list(range(1000, 1064))}
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
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()

    results: dict = {"dtype": args.dtype, "batch1_decode_tok_s": {}, "sharegpt": []}
    saved: dict = {}
    llm = LLM(dtype=args.dtype, num_threads=args.num_threads)
    best = {"on": 0.0, "off": 0.0}
    for mode in ("on", "off", "off", "on"):
        set_kernels(llm, mode == "on", saved)
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
            set_kernels(run_llm, mode == "on", {})
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
