"""Batch-1 decode with the lean decode step (one C call per step for all decoder layers) against the torch
path it replaces, in one run, on the embedded SmolLM2-135M Q4_1 GGUF; plus the dense model for scale.

For each dtype: ``--quantization gguf`` with the lean step on (its thread count chosen per step by
``ThreadChoice``, and fixed to the engine's) and off (the same engine: the step is switched with
``LeanDecode.enabled``, so scheduler, sampler and kernels are the same), and
``--quantization none`` (dense weights: no lean step). Workload as benchmarks/cpu_kernels.py: one
64-token prompt, 128 new tokens, greedy, ignore_eos; decode tok/s excludes the first token; modes
alternate (on, off, off, on) and the best of two is kept. On a shared machine wall-clock rates swing with
the other processes' load (two threads that wait for each other at every kernel suffer most), so each
mode is also measured on one thread in thread CPU time per decode step, which the load disturbs less.
Then a profile of the decode steps of the
torch path and of the lean path (cProfile over 64 steps; time per step split into the quantized
products, attention, the RMSNorm / SiLU×up kernels, torch ops and the Python around them; thread CPU
time with ``--profile-threads 1``). cProfile's own cost inflates the Python share; the tok/s and CPU-ms
figures are measured without it.

    python benchmarks/lean_decode.py --dtypes float32,bfloat16 --output-json lean_decode.json
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_kernels import batch1_decode  # noqa: E402

# cProfile entries (file suffix, function) whose own time is a compiled kernel (the ctypes call inside).
_CATEGORIES = {
    ("quantization/qgemm.py", "_linear"): "quantized products",
    ("quantization/qgemm.py", "_dequantize"): "embedding lookup",
    ("attention/cpu_decode.py", "_paged_decode"): "attention",
    ("layers/batch_invariant.py", "_rms_norm"): "RMSNorm / SiLU kernels",
    ("layers/silu_and_mul_kernel.py", "_silu_and_mul"): "RMSNorm / SiLU kernels",
    ("runner/lean_decode.py", "__call__"): "lean step (C call)",
}


def cpu_ms_per_step(llm, new_tokens: int = 65) -> float:
    """Thread CPU milliseconds per decode step, one thread (the caller sets torch's thread count), best of two."""
    from tokenmill import SamplingParams

    prompt = {"prompt_token_ids": list(range(1000, 1064))}
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    full = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompt, first)
    best = float("inf")
    for _ in range(2):
        t0 = time.thread_time()
        llm.generate(prompt, first)
        t1 = time.thread_time()
        llm.generate(prompt, full)
        t2 = time.thread_time()
        best = min(best, ((t2 - t1) - (t1 - t0)) / (new_tokens - 1))
    return 1000 * best


def profile_decode(llm, steps: int = 64) -> dict[str, float]:
    """Milliseconds per decode step by category, from cProfile over ``steps`` decode steps of one request
    (thread CPU time on one thread, wall time otherwise)."""
    from tokenmill import SamplingParams

    prompt = {"prompt_token_ids": list(range(1000, 1064))}
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))  # prefix cached
    import torch

    # One thread: all the work is on this thread, so its CPU time (which other processes' load disturbs less)
    # is the clock; more threads: wall time.
    profiler = cProfile.Profile(time.thread_time if torch.get_num_threads() == 1 else time.perf_counter)
    profiler.enable()
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True))
    profiler.disable()
    stats = pstats.Stats(profiler).stats
    totals: dict[str, float] = {}
    total = 0.0
    for (filename, _, name), (_, _, tottime, _, _) in stats.items():
        total += tottime
        category = next((c for (suffix, fn), c in _CATEGORIES.items() if filename.endswith(suffix) and name == fn),
                        None)
        if category is None:
            category = "torch ops" if filename == "~" and ("torch" in name or "method" in name) else "Python + other"
        totals[category] = totals.get(category, 0.0) + tottime
    per_step = {k: 1000 * v / steps for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}
    per_step["total"] = 1000 * total / steps
    return per_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated activation dtypes")
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--no-dense", action="store_true", help="skip --quantization none")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--no-wall", action="store_true",
                        help="skip the wall-clock tok/s runs (keep the one-thread CPU time; for a loaded machine)")
    parser.add_argument("--profile-threads", type=int, default=None,
                        help="threads for the profile (default: the engine's)")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    import torch

    from tokenmill import LLM, csrc_build

    results: dict = {"cpu": csrc_build.cpu_model_name(), "isa": csrc_build.selected_isa(), "runs": []}
    print(f"{results['cpu']}, ISA path {results['isa']}", flush=True)
    for dtype in args.dtypes.split(","):
        llm = LLM(dtype=dtype, quantization="gguf", num_threads=args.num_threads, max_model_len=512,
                  kv_cache_memory=0.1)
        lean = llm.engine.runner.model.model.lean_decode
        if lean is None:
            sys.exit(f"the lean decode step is not installed: {llm.engine.runner.kernel_choice}")
        pool = torch.get_num_threads()
        best = {"lean": 0.0, "lean_pool": 0.0, "torch": 0.0}
        for mode in () if args.no_wall else ("lean", "lean_pool", "torch", "torch", "lean_pool", "lean"):
            lean.enabled = mode != "torch"
            lean.threads = pool if mode == "lean_pool" else None
            best[mode] = max(best[mode], batch1_decode(llm))
        lean.threads = None
        row = {"dtype": dtype, "threads": pool, "gguf_lean_tok_s": best["lean"],
               "gguf_lean_pool_threads_tok_s": best["lean_pool"], "gguf_torch_tok_s": best["torch"],
               "speedup": best["lean"] / best["torch"] if best["torch"] else None}
        if not args.no_wall:
            print(f"{dtype}: gguf lean {best['lean']:.1f} tok/s (thread count chosen per step), lean on {pool} "
                  f"threads {best['lean_pool']:.1f}, gguf torch path {best['torch']:.1f} tok/s -> "
                  f"{row['speedup']:.2f}x", flush=True)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        cpu = {"lean": float("inf"), "torch": float("inf")}
        for mode in ("lean", "torch", "torch", "lean"):
            lean.enabled = mode == "lean"
            cpu[mode] = min(cpu[mode], cpu_ms_per_step(llm))
        torch.set_num_threads(threads)
        row["gguf_lean_cpu_ms_1thread"], row["gguf_torch_cpu_ms_1thread"] = cpu["lean"], cpu["torch"]
        print(f"  one thread, CPU ms per decode step: lean {cpu['lean']:.2f}, torch path {cpu['torch']:.2f} "
              f"-> {cpu['torch'] / cpu['lean']:.2f}x", flush=True)
        if not args.no_profile:
            torch.set_num_threads(args.profile_threads or pool)
            for mode in ("torch", "lean"):
                lean.enabled = mode == "lean"
                row[f"profile_{mode}_ms_per_step"] = prof = profile_decode(llm)
                print(f"  profile, {mode} path, {torch.get_num_threads()} threads (ms/step under cProfile): "
                      + ", ".join(f"{k} {v:.2f}" for k, v in prof.items()), flush=True)
            lean.enabled = True
            torch.set_num_threads(pool)
        llm.close()
        if not args.no_dense:
            dense = LLM(dtype=dtype, quantization="none", num_threads=args.num_threads, max_model_len=512,
                        kv_cache_memory=0.1)
            if not args.no_wall:
                row["dense_tok_s"] = max(batch1_decode(dense) for _ in range(2))
                print(f"{dtype}: dense (--quantization none) {row['dense_tok_s']:.1f} tok/s", flush=True)
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            row["dense_cpu_ms_1thread"] = cpu_ms_per_step(dense)
            torch.set_num_threads(threads)
            print(f"{dtype}: dense (--quantization none), one thread: {row['dense_cpu_ms_1thread']:.2f} CPU ms per "
                  "decode step", flush=True)
            dense.close()
        results["runs"].append(row)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
