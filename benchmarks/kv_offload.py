"""Tiered KV cache benchmark: multi-round conversations whose KV does not fit in the primary pool,
run with the lower tiers off, RAM only, and RAM + disk, in one run (engine in-process, no HTTP).

Each of --conversations conversations starts from its own --history-len-token history and runs
--turns turns: a --user-len-token user message, then --output-len generated tokens; the next turn
of a conversation is sent as soon as its previous one finished (all conversations at once, so they
compete for the pool). The primary pool holds --pool-fraction of the final working set (every
conversation's full history), the RAM tier --ram-fraction of it; the disk tier is unbounded.
TTFT = first token - arrival, measured in the engine; "reuse turns" are turns 2.., whose history
could come from a cache. Conversations come back in roughly the same order every round, the
worst case for LRU: a RAM tier smaller than the working set catches few of them, the disk tier
(unbounded here) nearly all. CPU s (process time) is the steadier number on a shared machine.

    .venv/bin/python benchmarks/kv_offload.py [--conversations 16 --turns 6 --history-len 1000]
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import tempfile
import time

from tokenmill import LLM, SamplingParams
from tokenmill.kv_offload.stats import drive_writes_per_day
from tokenmill.memory_plan import read_model_shape, run_dtype
from tokenmill.runner.kv_cache_sizing import kv_bytes_per_token

MIB = 2**20
GIB = 2**30


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_conversations(llm: LLM, args) -> dict:
    rng = random.Random(args.seed)
    vocab = llm.engine.loaded.vocab_size
    histories = [[rng.randrange(1000, vocab - 1000) for _ in range(args.history_len)]
                 for _ in range(args.conversations)]
    users = [[[rng.randrange(1000, vocab - 1000) for _ in range(args.user_len)] for _ in range(args.turns)]
             for _ in range(args.conversations)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    engine = llm.engine
    turn = [0] * args.conversations
    ttft, ttft_reuse, cached, prompt_tokens = [], [], 0, 0
    generated = 0

    def send(conv: int) -> None:
        nonlocal prompt_tokens
        histories[conv] = histories[conv] + users[conv][turn[conv]]
        prompt_tokens += len(histories[conv])
        engine.add_request(f"c{conv}-t{turn[conv]}", {"prompt_token_ids": histories[conv]}, params)

    start = time.monotonic()
    cpu_start = time.process_time()
    for conv in range(args.conversations):
        send(conv)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if not out.finished:
                continue
            conv = int(out.request_id[1:].split("-")[0])
            t = out.metrics["first_token_time"] - out.metrics["arrival_time"]
            ttft.append(t)
            if turn[conv] > 0:
                ttft_reuse.append(t)
            cached += out.num_cached_tokens
            generated += len(out.outputs[0].token_ids)
            histories[conv] = histories[conv] + list(out.outputs[0].token_ids)
            turn[conv] += 1
            if turn[conv] < args.turns:
                send(conv)
    duration = time.monotonic() - start
    cpu_s = time.process_time() - cpu_start
    store = engine.kv_store
    tiers = store.tier_stats() if store is not None else {}
    return {
        "mean_ttft_ms": 1e3 * statistics.mean(ttft),
        "p50_ttft_ms": 1e3 * percentile(ttft, 0.5),
        "p90_ttft_ms": 1e3 * percentile(ttft, 0.9),
        "mean_ttft_reuse_turns_ms": 1e3 * statistics.mean(ttft_reuse) if ttft_reuse else float("nan"),
        "output_throughput_tok_s": generated / duration,
        "total_throughput_tok_s": (generated + prompt_tokens) / duration,
        "duration_s": duration,
        "cpu_s": cpu_s,  # process CPU time: less sensitive than wall time to other jobs on the machine
        "transfer_s": store.transfer_seconds if store is not None else 0.0,
        "disk_wait_s": store.load_wait_seconds if store is not None else 0.0,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached,
        "preemptions": engine.scheduler.num_preemptions_total,
        "tiers": tiers,
        # This run's own write rate (the server gauge averages over at least an hour).
        "disk_dwpd": None if store is None or store.disk is None else drive_writes_per_day(
            store.disk.stats.bytes_written, duration, store.drive_bytes, min_window_s=0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--history-len", type=int, default=1000, help="tokens of each conversation's starting history")
    parser.add_argument("--user-len", type=int, default=50, help="tokens of each user message")
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--pool-fraction", type=float, default=0.25, help="primary pool / working set")
    parser.add_argument("--ram-fraction", type=float, default=0.5, help="RAM tier / working set")
    parser.add_argument("--disk-size", type=float, default=16.0, help="disk tier GiB")
    parser.add_argument("--disk-drive-size", type=float, default=1000.0, help="drive GiB for the DWPD estimate")
    parser.add_argument("--disk-path", default=None, help="disk tier directory (default: a fresh temporary one)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--configs", default="off,ram,ram+disk", help="comma-separated subset of off,ram,ram+disk")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()

    final_len = args.history_len + args.turns * (args.user_len + args.output_len)
    working_set_tokens = args.conversations * final_len
    pool_blocks = max(-(-(final_len + 2 * args.output_len) // args.block_size),  # one conversation must fit
                      int(args.pool_fraction * working_set_tokens) // args.block_size)
    shape = read_model_shape(args.model)
    dtype_bytes = 4 if run_dtype(shape, args.dtype) == "float32" else 2
    bytes_per_token = kv_bytes_per_token(shape.num_layers, shape.num_kv_heads, shape.head_dim, dtype_bytes)
    bytes_per_block = bytes_per_token * args.block_size
    ram_gib = args.ram_fraction * working_set_tokens / args.block_size * bytes_per_block / GIB
    print(f"config: {args.conversations} conversations x {args.turns} turns, history {args.history_len} tokens, "
          f"user {args.user_len}, output {args.output_len}; final history {final_len} tokens; working set "
          f"{working_set_tokens} tokens = {working_set_tokens * bytes_per_block / args.block_size / MIB:.0f} MiB; "
          f"pool {pool_blocks} blocks ({pool_blocks * args.block_size} tokens, "
          f"{pool_blocks * bytes_per_block / MIB:.0f} MiB); RAM tier {ram_gib * 1024:.0f} MiB; "
          f"disk tier {args.disk_size} GiB; block {bytes_per_block} bytes", flush=True)

    results = {}
    for name in args.configs.split(","):
        disk_dir = None
        kwargs = {}
        if "ram" in name:
            kwargs["kv_offload_memory"] = ram_gib
        if "disk" in name:
            disk_dir = args.disk_path or tempfile.mkdtemp(prefix="tokenmill-kv-bench-")
            kwargs.update(kv_offload_disk_path=disk_dir, kv_offload_disk_size=args.disk_size,
                          kv_offload_disk_drive_size=args.disk_drive_size)
        llm = LLM(model=args.model, dtype=args.dtype, num_kv_blocks=pool_blocks, block_size=args.block_size,
                  max_model_len=min(pool_blocks * args.block_size, final_len + 2 * args.output_len),
                  max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.conversations, **kwargs)
        # Warm up with a prefill of the workload's size: the first large step of a process is slow.
        warm = random.Random(-1)
        llm.generate({"prompt_token_ids": [warm.randrange(1000, 40000) for _ in range(min(args.history_len, 1024))]},
                     SamplingParams(max_tokens=4, ignore_eos=True))
        results[name] = run_conversations(llm, args)
        llm.engine.close(save_cached=False)  # nothing to keep for a next run
        if disk_dir is not None and args.disk_path is None:
            shutil.rmtree(disk_dir, ignore_errors=True)
        del llm
        print(f"{name}: {json.dumps(results[name])}", flush=True)

    base = results.get("off")
    print("\n| config | mean TTFT ms | p50 | p90 | reuse-turn TTFT ms | out tok/s | total tok/s | wall s | CPU s "
          "| copy s | disk wait s | cached tokens | RAM hits | disk hits | RAM MiB written | disk MiB written "
          "| disk DWPD | TTFT gain | throughput gain |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        ram, disk = r["tiers"].get("ram", {}), r["tiers"].get("disk", {})
        gain_ttft = f"{base['mean_ttft_ms'] / r['mean_ttft_ms']:.2f}x" if base else "-"
        gain_tput = f"{r['total_throughput_tok_s'] / base['total_throughput_tok_s']:.2f}x" if base else "-"
        dwpd = f"{r['disk_dwpd']:.3g}" if r["disk_dwpd"] is not None else "-"
        print(f"| {name} | {r['mean_ttft_ms']:.0f} | {r['p50_ttft_ms']:.0f} | {r['p90_ttft_ms']:.0f} "
              f"| {r['mean_ttft_reuse_turns_ms']:.0f} | {r['output_throughput_tok_s']:.1f} "
              f"| {r['total_throughput_tok_s']:.0f} | {r['duration_s']:.1f} | {r['cpu_s']:.1f} "
              f"| {r['transfer_s']:.2f} | {r['disk_wait_s']:.2f} | {r['cached_tokens']} | {ram.get('hits', '-')} "
              f"| {disk.get('hits', '-')} | {ram.get('bytes_written', 0) / MIB:.0f} "
              f"| {disk.get('bytes_written', 0) / MIB:.0f} | {dwpd} | {gain_ttft} | {gain_tput} |")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
