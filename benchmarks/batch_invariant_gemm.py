"""Batch-invariant GEMM benchmark: ``bi_linear`` against ``F.linear`` on SmolLM2-135M shapes (bf16).

Part 1, one linear at a time (weights stay cache-warm between repeats):
    (K, N) = (576, 960) qkv_proj, (576, 576) o_proj, (576, 3072) gate_up_proj, (1536, 576) down_proj,
    (576, 49152) lm_head, at M in 1, 8, 32, 128, 512.
Part 2, one model step's linears: 30 layers x (qkv, o, gate_up, down), i.e. the 210 projections
merged as tokenmill runs them (120 GEMMs, each layer with its own weights, ~212 MB), then lm_head
(~57 MB) on the sampled rows: all M rows for decode-sized M (<= 32), the last row for M = 512 (one
prefill chunk). Weights are streamed from memory as in a real step; the floor is ~270 MB / memory
bandwidth.

    .venv/bin/python benchmarks/batch_invariant_gemm.py [--threads 2] [--repeats 5]

On a shared machine, ``--threads 1 --clock cpu`` times with this process's CPU time, which other
processes' load does not inflate (with more threads CPU time would add up the threads).
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tokenmill.layers.batch_invariant import available, bi_linear, isa

HIDDEN, INTERMEDIATE, VOCAB, NUM_LAYERS = 576, 1536, 49152, 30
SHAPES = {  # name: (K, N)
    "qkv_proj": (HIDDEN, 960),
    "o_proj": (HIDDEN, HIDDEN),
    "gate_up_proj": (HIDDEN, 2 * INTERMEDIATE),
    "down_proj": (INTERMEDIATE, HIDDEN),
    "lm_head": (HIDDEN, VOCAB),
}


CLOCK: Callable[[], float] = time.perf_counter


def best_seconds(fns: list[Callable[[], object]], repeats: int, calls: int) -> list[float]:
    """Per function, the minimum over ``repeats`` of the mean time of ``calls`` back-to-back calls.

    The functions take turns within each repeat (after one warm-up call each), so load from other
    processes on a shared machine hits them alike.
    """
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = CLOCK()
            for _ in range(calls):
                fn()
            best[i] = min(best[i], (CLOCK() - start) / calls)
    return best


def single_linears(ms: list[int], repeats: int) -> None:
    print(f"{'shape':<14}{'M':>5}  {'bi ms':>9} {'GF/s':>7}  {'F.linear ms':>11} {'GF/s':>7}  {'bi/F':>6}")
    for name, (k, n) in SHAPES.items():
        w = torch.randn(n, k).bfloat16()
        for m in ms:
            x = torch.randn(m, k).bfloat16()
            flops = 2 * m * k * n
            calls = max(1, min(200, int(2e9 / (flops + 5e7))))
            t_bi, t_f = best_seconds([lambda: bi_linear(x, w), lambda: F.linear(x, w)], repeats, calls)
            print(
                f"{name:<14}{m:>5}  {t_bi * 1e3:>9.3f} {flops / t_bi / 1e9:>7.1f}  "
                f"{t_f * 1e3:>11.3f} {flops / t_f / 1e9:>7.1f}  {t_f / t_bi:>6.2f}"
            )


def model_step(ms: list[int], repeats: int) -> None:
    layers = [[torch.randn(n, k).bfloat16() * 0.02 for name, (k, n) in SHAPES.items() if name != "lm_head"] for _ in range(NUM_LAYERS)]
    lm_head = torch.randn(VOCAB, HIDDEN).bfloat16() * 0.02
    weight_mb = (sum(w.numel() for ws in layers for w in ws) + lm_head.numel()) * 2 / 1e6

    def step(linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor, y: torch.Tensor, sampled: int) -> None:
        for qkv, o, gate_up, down in layers:
            linear(x, qkv)
            linear(x, o)
            linear(x, gate_up)
            linear(y, down)
        linear(x[-sampled:], lm_head)

    print(f"\nmodel step: {NUM_LAYERS} layers x 4 merged GEMMs (210 projections) + lm_head, {weight_mb:.0f} MB of weights")
    print(f"{'M':>5} {'lm_head rows':>12}  {'bi ms':>8} {'GF/s':>7}  {'F.linear ms':>11} {'GF/s':>7}  {'bi/F':>6}")
    for m in ms:
        sampled = m if m <= 32 else 1
        x = torch.randn(m, HIDDEN).bfloat16()
        y = torch.randn(m, INTERMEDIATE).bfloat16()
        flops = 2 * m * sum(w.numel() for ws in layers for w in ws) + 2 * sampled * lm_head.numel()
        t_bi, t_f = best_seconds([lambda: step(bi_linear, x, y, sampled), lambda: step(F.linear, x, y, sampled)], repeats, 1)
        print(
            f"{m:>5} {sampled:>12}  {t_bi * 1e3:>8.2f} {flops / t_bi / 1e9:>7.1f}  "
            f"{t_f * 1e3:>11.2f} {flops / t_f / 1e9:>7.1f}  {t_f / t_bi:>6.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall", help="cpu: process CPU time (use with --threads 1)")
    parser.add_argument("--m", type=int, nargs="*", default=[1, 8, 32, 128, 512], help="rows for the single-linear table")
    parser.add_argument("--step-m", type=int, nargs="*", default=[1, 8, 32, 512], help="rows for the model-step table")
    args = parser.parse_args()
    if not available():
        raise SystemExit("batch-invariant kernels unavailable (no C compiler or TOKENMILL_DISABLE_CPU_KERNELS=1)")
    if args.clock == "cpu" and args.threads != 1:
        parser.error("--clock cpu needs --threads 1")
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"bf16, {args.threads} threads, kernel path {isa()}, {args.clock} clock, min of {args.repeats} repeats\n")
    if args.m:
        single_linears(args.m, args.repeats)
    if args.step_m:
        model_step(args.step_m, args.repeats)


if __name__ == "__main__":
    main()
