"""Prefill (prompt processing) speed: prompt tokens/s and GFLOP/s, old engine vs new, in one run (issue 18 part 4).

For each dtype and ``--quantization`` the embedded SmolLM2-135M-Instruct GGUF is loaded and
``LLM.generate(max_tokens=1)`` timed over ShareGPT-like prompts: ShareGPT first turns, tokenized,
concatenated and cut to exactly ``--lengths`` tokens (every request its own text; prefix caching off),
``--concurrency`` requests at once. "old" is the engine of ``--baseline-tree`` (a checkout of the
commit before this work, e.g. ``git archive <commit> | tar -x -C /tmp/tm_base``), "new" that of
``--new-tree`` (default: this working tree; a clean checkout keeps others' unfinished edits out); each
runs in its own process (``--worker``), the two alternate per repeat and the best of ``--repeats``
is kept, so load from other processes hits both alike. A breakdown pass (batch 1) times the attention
layers (K/V write + attention), the linear layers and the rest of the step with module hooks.
``--threads 1`` times with the process's CPU time instead of the wall clock, so other processes'
load on a shared machine does not inflate it.

GFLOP/s counts 2 FLOPs per multiply-add: every prompt token's linears plus the LM head of the one
sampled row per request, and QK^T + PV over the causal pairs (4 * heads * head_dim per pair and
layer). The bf16 compute ceiling of ../shared/baseline.md (~410 GFLOP/s on the Zen 4 machine) is
the yardstick.

    git archive <base commit> | (mkdir -p /tmp/tm_base && tar -x -C /tmp/tm_base)
    .venv/bin/python benchmarks/prefill.py --baseline-tree /tmp/tm_base --dtypes float32,bfloat16 \
        --quantization gguf,none --lengths 128,512,2048 --concurrency 1,4 --repeats 2
    .venv/bin/python benchmarks/prefill.py --attention-only --threads 1 --lengths 512,1024,2048
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def sharegpt_prompts(tokenizer, length: int, count: int, skip: int = 0) -> list[list[int]]:
    """``count`` prompts of exactly ``length`` token ids cut from the stream of ShareGPT first turns,
    after passing over ``skip`` such prompts (so each case gets fresh texts)."""
    from tokenmill.bench.datasets import load_sharegpt

    needed, stream = (skip + count) * length, []
    for record in load_sharegpt():
        turns = record.get("conversations") or []
        if turns:
            stream.extend(tokenizer.encode(turns[0]["value"] + "\n\n", add_special_tokens=False))
        if len(stream) >= needed:
            break
    return [stream[(skip + i) * length:(skip + i + 1) * length] for i in range(count)]


def model_flops(config: dict, prompt_lens: list[int]) -> tuple[float, float]:
    """(linear FLOPs, attention FLOPs) of prefilling ``prompt_lens`` (one sampled row each)."""
    h, heads, kv_heads = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    d = config["head_dim"] or h // heads
    layers = config["num_hidden_layers"]
    per_layer = h * (heads * d + 2 * kv_heads * d) + heads * d * h + 3 * h * config["intermediate_size"]
    linear = sum(2 * n * per_layer * layers + 2 * h * config["vocab_size"] for n in prompt_lens)
    attention = sum(4 * heads * d * n * (n + 1) / 2 * layers for n in prompt_lens)
    return float(linear), float(attention)


def worker(args) -> None:
    """Runs in the tree on PYTHONPATH: times every case once per repeat, prints one JSON line."""
    import torch

    from tokenmill import LLM, SamplingParams
    from tokenmill.attention.layer import Attention
    from tokenmill.layers.linear import Linear

    llm = LLM(dtype=args.dtype, quantization=args.quantization, enable_prefix_caching=False,
              max_model_len=4096, max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory=1.0,
              num_threads=args.threads)
    # One thread: this process's CPU time, which other processes' load does not inflate.
    clock = time.process_time if args.threads == 1 else time.perf_counter
    tokenizer, model = llm.get_tokenizer(), llm.engine.runner.model
    params = SamplingParams(max_tokens=1, temperature=0)

    def timed(prompts):
        start = clock()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return clock() - start

    result = {"kernels": llm.engine.runner.kernel_choice, "cases": {}, "breakdown": {}}
    cases, skip = [], 0
    for length in args.lengths:
        for conc in args.concurrency:
            cases.append((length, conc, sharegpt_prompts(tokenizer, length, conc, skip)))
            skip += conc
    timed(cases[0][2][:1])  # warm-up: page faults, first-call allocations
    for length, conc, prompts in cases:
        result["cases"][f"{length}x{conc}"] = min(timed(prompts) for _ in range(args.inner_repeats))
    spent: dict[str, float] = defaultdict(float)
    starts: dict[int, float] = {}

    def pre(module, inputs):
        starts[id(module)] = clock()

    def post(kind):
        def hook(module, inputs, output):
            spent[kind] += clock() - starts.pop(id(module))
        return hook

    for m in model.modules():
        kind = "attention" if isinstance(m, Attention) else "linear" if isinstance(m, Linear) else None
        if kind:
            m.register_forward_pre_hook(pre)
            m.register_forward_hook(post(kind))
    for length in args.lengths:
        prompts = sharegpt_prompts(tokenizer, length, 1, skip)
        skip += 1
        spent.clear()
        total = timed(prompts)
        result["breakdown"][str(length)] = {"total": total, "attention": spent["attention"], "linear": spent["linear"]}
    result["threads"] = torch.get_num_threads()
    c = model.config
    result["config"] = {k: getattr(c, k, None) for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                                          "head_dim", "intermediate_size", "num_hidden_layers",
                                                          "vocab_size")}
    print("RESULT " + json.dumps(result), flush=True)


def attention_only(args) -> None:
    """The prefill attention kernel against SDPA alone (this tree), SmolLM2's heads (9 query, 3 KV, head_dim
    64), one fresh prompt per length in 16-token blocks laid out in reverse, alternating, best of 5."""
    import numpy as np
    import torch

    from tokenmill.attention import build_attention_metadata, cpu_prefill
    from tokenmill.attention.torch_paged import paged_attention

    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.threads == 1 else time.perf_counter
    heads, kv_heads, d, bs = 9, 3, 64, 16
    print(f"attention only ({torch.get_num_threads()} threads; GFLOP/s over the causal pairs):")
    print("| dtype | prompt tokens | SDPA ms | SDPA GF/s | kernel ms | kernel GF/s | kernel/SDPA |")
    print("|---|---|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        for length in args.lengths:
            blocks = -(-length // bs)
            k = torch.randn(blocks, bs, kv_heads, d).to(dtype)
            v = torch.randn(blocks, bs, kv_heads, d).to(dtype)
            table = np.arange(blocks - 1, -1, -1)[None, :]
            meta, _ = build_attention_metadata(np.array([length]), np.array([0]), table, bs)
            q = torch.randn(length, heads, d).to(dtype)
            flops = 4 * heads * d * length * (length + 1) / 2
            fns = [lambda: paged_attention(q, k, v, meta, d**-0.5, use_prefill_kernel=False),
                   lambda: paged_attention(q, k, v, meta, d**-0.5, use_prefill_kernel=True)]
            best = [float("inf")] * 2
            for fn in fns:
                fn()
            for _ in range(5):
                for i, fn in enumerate(fns):
                    start = clock()
                    fn()
                    best[i] = min(best[i], clock() - start)
            assert cpu_prefill.supports(q, k)
            print(f"| {str(dtype).removeprefix('torch.')} | {length} | {best[0] * 1e3:.1f} | {flops / best[0] / 1e9:.1f} | "
                  f"{best[1] * 1e3:.1f} | {flops / best[1] / 1e9:.1f} | {best[0] / best[1]:.2f}x |", flush=True)


def run_variant(tree: Path, args, dtype: str, quantization: str) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--dtype", dtype, "--quantization-one",
           quantization, "--lengths", ",".join(map(str, args.lengths)), "--concurrency",
           ",".join(map(str, args.concurrency)), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
           "--inner-repeats", str(args.inner_repeats)] + (["--threads", str(args.threads)] if args.threads else [])
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=str(tree))
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"worker in {tree} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(line[len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline-tree", type=Path, help="checkout of the old engine (omit: new only)")
    parser.add_argument("--new-tree", type=Path, default=REPO,
                        help="checkout of the new engine (default: this repository's working tree)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--quantization", default="gguf,none")
    parser.add_argument("--lengths", default="128,512,2048", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--concurrency", default="1,4", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--repeats", type=int, default=2, help="alternating old/new processes per configuration")
    parser.add_argument("--inner-repeats", type=int, default=1, help="timed runs of each case per process")
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--threads", type=int, help="engine threads (default: all the CPUs it may use); 1 times "
                        "with process CPU time, for a machine shared with other work")
    parser.add_argument("--attention-only", action="store_true",
                        help="time the prefill attention kernel against SDPA in this tree, nothing else")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", help=argparse.SUPPRESS)
    parser.add_argument("--quantization-one", dest="quantization_one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.quantization = args.quantization_one
        worker(args)
        return
    if args.attention_only:
        attention_only(args)
        return

    from tokenmill import csrc_build

    variants = ([("old", args.baseline_tree.resolve())] if args.baseline_tree else []) + [("new", args.new_tree.resolve())]
    print(f"CPU: {csrc_build.cpu_model_name()} | ISA path {csrc_build.selected_isa()} | "
          f"load {os.getloadavg()[0]:.2f} | max_num_batched_tokens {args.max_num_batched_tokens}")
    for dtype in args.dtypes.split(","):
        for quantization in args.quantization.split(","):
            best: dict[str, dict] = {}
            for _ in range(args.repeats):
                for name, tree in variants:
                    res = run_variant(tree, args, dtype, quantization)
                    if name not in best:
                        best[name] = res
                    else:
                        for key, t in res["cases"].items():
                            best[name]["cases"][key] = min(best[name]["cases"][key], t)
                        for key, parts in res["breakdown"].items():
                            if parts["total"] < best[name]["breakdown"][key]["total"]:
                                best[name]["breakdown"][key] = parts
            config = best["new"]["config"]
            print(f"\n### {dtype}, --quantization {quantization} ({best['new']['threads']} threads)")
            for name, _ in variants:
                print(f"{name}: {best[name]['kernels']}")
            head = " | ".join(f"{n} tok/s | {n} GF/s" for n, _ in variants)
            print(f"| prompt tokens | concurrent | {head} |" + (" new/old |" if len(variants) == 2 else ""))
            print("|---" * (2 + 2 * len(variants) + (len(variants) == 2)) + "|")
            for length in args.lengths:
                for conc in args.concurrency:
                    linear, attention = model_flops(config, [length] * conc)
                    cells, times = [], []
                    for name, _ in variants:
                        t = best[name]["cases"][f"{length}x{conc}"]
                        times.append(t)
                        cells.append(f"{length * conc / t:.0f} | {(linear + attention) / t / 1e9:.1f}")
                    ratio = f" {times[0] / times[1]:.2f}x |" if len(times) == 2 else ""
                    print(f"| {length} | {conc} | {' | '.join(cells)} |{ratio}")
            print("\nbreakdown, batch 1 (seconds, GF/s of the part): attention | linear | rest")
            for length in args.lengths:
                linear, attention = model_flops(config, [length])
                for name, _ in variants:
                    p = best[name]["breakdown"][str(length)]
                    rest = p["total"] - p["attention"] - p["linear"]
                    if not p["attention"] or not p["linear"]:  # the lean C step ran it: no module hook fired
                        print(f"| {length} | {name} | total {p['total']:.3f} | lean decode step (no breakdown) |")
                        continue
                    print(f"| {length} | {name} | total {p['total']:.3f} | attention {p['attention']:.3f} "
                          f"({attention / p['attention'] / 1e9:.0f}) | linear {p['linear']:.3f} "
                          f"({linear / p['linear'] / 1e9:.0f}) | rest {rest:.3f} |")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
