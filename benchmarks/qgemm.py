"""The quantized product (tokenmill/quantization/csrc/qgemm.c): the stored GGUF layout against the tiled
one (``qgemm.repack``), per call, interleaved in one run; and batch-1 decode of the embedded SmolLM2
Q4_1 model with the weights in either layout.

Per call: random blocks of the embedded model's shapes (Q4_1 N x K = 1536 x 576, 576 x 1536, 576 x 576;
the Q8_0 LM head 49152 x 576), activation rows M in 1, 2, 4, 5, 8, 32, at 1 and 2 threads. Each repeat
times the stored layout then the tiled one (order alternating per repeat), each the median of a batch
of calls; the median over repeats is printed in microseconds. Decode: greedy, 256 new tokens with
ignore_eos after a warm-up, three engines (stored layout; Q4_0/Q4_1 tiled, the default; Q8_0 LM head
tiled too) built in this process and run in turns, median decode tok/s (first token excluded) over the
rounds.

    python benchmarks/qgemm.py                    # both parts
    python benchmarks/qgemm.py --no-decode --repeats 9
    python benchmarks/qgemm.py --formats --threads 1,2   # every GGUF format, stored vs tiled, GB/s and roofline share
    python benchmarks/qgemm.py --cold Q4_K,Q6_K,Q4_0 --threads 2   # weights not in cache, one row
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

SHAPES = (("Q4_1", 3, 1536, 576), ("Q4_1", 3, 576, 1536), ("Q4_1", 3, 576, 576), ("Q8_0", 8, 49152, 576))
ROWS = (1, 2, 4, 5, 8, 32)


# float16 fields (byte offsets in a block) of each format: set to small finite values
HALF_FIELDS = {2: (0,), 3: (0, 2), 6: (0,), 7: (0, 2), 8: (0,), 10: (80, 82), 11: (108,), 12: (0, 2), 13: (0, 2),
               14: (208,), 20: (0,), 23: (0,)}


def random_weight(qtype: int, n: int, k: int):
    """A [n, k] weight of random blocks in GGUF format ``qtype`` (codes and sub-scales random, fp16 scales small)."""
    import numpy as np

    from tokenmill.quantization.formats import GGUF_QUANT_TYPES, QuantizedTensor

    _, bs, bb = GGUF_QUANT_TYPES[qtype]
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(n, k // bs, bb), dtype=np.uint8)
    for off in HALF_FIELDS[qtype]:
        raw[:, :, off:off + 2] = (rng.standard_normal((n, k // bs)) * 0.01).astype(np.float16).view(
            np.uint8).reshape(n, k // bs, 2)
    return QuantizedTensor(qtype, (n, k), torch.from_numpy(raw.reshape(n, -1).copy()))


def read_bandwidth(threads: int, mb: int = 1024) -> float:
    """This machine's read bandwidth in GB/s: the best of 5 sums over a ``mb`` MB float32 array."""
    torch.set_num_threads(threads)
    a = torch.ones(mb * 2**20 // 4)
    a.sum()
    best = min(time_call(lambda: a.sum(), 1) for _ in range(5))
    return a.numel() * 4 / best / 1e9


# a 1-2 B model's MLP projections (gate/up fused: 2 x 8192 rows of 2048; down: 2048 rows of 8192)
FORMAT_SHAPES = ((16384, 2048), (2048, 8192))


def bench_formats(repeats: int, threads: tuple[int, ...], rows: tuple[int, ...]) -> None:
    """Every GGUF format tokenmill runs, stored layout against tiled, at FORMAT_SHAPES: median per call and,
    for the tiled layout, weight bytes read per second and that as a share of the measured read bandwidth."""
    from tokenmill.quantization import qgemm
    from tokenmill.quantization.formats import GGUF_QUANT_TYPES, TILED_FORMATS

    print(f"qgemm ISA path: {qgemm.isa()}; per-call median of {repeats} repeats (alternated), milliseconds")
    for nt in threads:
        bw = read_bandwidth(nt)
        print(f"{nt} thread(s): read bandwidth {bw:.1f} GB/s")
        print(f"{'format':<8}{'N x K':>12}{'M':>4}{'stored':>9}{'tiled':>9}{'speedup':>9}{'GB/s':>7}{'roofline':>9}")
        for qtype, (name, _, _) in sorted(GGUF_QUANT_TYPES.items(), key=lambda kv: kv[1][0]):
            for n, k in FORMAT_SHAPES:
                stored = random_weight(qtype, n, k)
                tiled = qgemm.repack(stored) if qtype in TILED_FORMATS else stored
                torch.set_num_threads(nt)
                for m in rows:
                    x = torch.randn(m, k)
                    y = torch.empty(m, n)
                    times = {"stored": [], "tiled": []}
                    for rep in range(repeats):
                        for label in (("stored", "tiled") if rep % 2 == 0 else ("tiled", "stored")):
                            w = stored if label == "stored" else tiled
                            times[label].append(time_call(
                                lambda w=w: qgemm.quantized_linear(x, w.data, w.qtype, n, k, out=y), 3))
                    a, b = statistics.median(times["stored"]), statistics.median(times["tiled"])
                    gbs = stored.nbytes / b / 1e9
                    print(f"{name:<8}{f'{n}x{k}':>12}{m:>4}{a * 1e3:>9.3f}{b * 1e3:>9.3f}{a / b:>8.2f}x{gbs:>7.1f}"
                          f"{gbs / bw:>8.0%}", flush=True)


def time_call(fn, calls: int) -> float:
    samples = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def bench_calls(repeats: int, threads: tuple[int, ...]) -> None:
    from tokenmill.quantization import qgemm

    print(f"qgemm ISA path: {qgemm.isa()}; per-call median of {repeats} repeats, microseconds")
    print(f"{'shape':<22}{'thr':>4}{'M':>4}{'stored':>10}{'tiled':>10}{'speedup':>9}")
    for name, qtype, n, k in SHAPES:
        stored = random_weight(qtype, n, k)
        tiled = qgemm.repack(stored)
        for nt in threads:
            torch.set_num_threads(nt)
            for m in ROWS:
                x = torch.randn(m, k)
                y = torch.empty(m, n)
                calls = max(3, int(2e5 / (n * k * min(m, 8) / 1e3)))
                times = {"stored": [], "tiled": []}
                for rep in range(repeats):
                    order = (stored, tiled) if rep % 2 == 0 else (tiled, stored)
                    for w in order:
                        label = "tiled" if w is tiled else "stored"
                        times[label].append(time_call(
                            lambda w=w: qgemm.quantized_linear(x, w.data, w.qtype, n, k, out=y), calls))
                a, b = statistics.median(times["stored"]) * 1e6, statistics.median(times["tiled"]) * 1e6
                print(f"{name} {n}x{k:<12}{nt:>4}{m:>4}{a:>10.1f}{b:>10.1f}{a / b:>8.2f}x", flush=True)


LAYOUTS = {"stored": (), "tiled Q4": (2, 3), "tiled Q4+Q8_0": (2, 3, 8)}  # formats repacked (gguf_weight.TILED_LAYOUT)


def bench_decode(rounds: int, threads: int, tokens: int) -> None:
    from tokenmill import LLM, SamplingParams
    from tokenmill.quantization import gguf_weight

    engines = {}
    for layout, formats in LAYOUTS.items():
        gguf_weight.TILED_LAYOUT = formats
        engines[layout] = LLM(num_threads=threads)
    gguf_weight.TILED_LAYOUT = None
    prompt = [{"prompt_token_ids": list(range(1000, 1064))}]
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for llm in engines.values():  # warm-up
        llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    rates = {k: [] for k in engines}
    names = list(engines)
    for r in range(rounds):
        for layout in (names if r % 2 == 0 else names[::-1]):
            llm = engines[layout]
            t0 = time.perf_counter()
            llm.generate(prompt, first)
            t1 = time.perf_counter()
            out = llm.generate(prompt, params)[0]
            t2 = time.perf_counter()
            n = len(out.outputs[0].token_ids)
            rates[layout].append((n - 1) / ((t2 - t1) - (t1 - t0)))  # decode only: the prefill run subtracted
    for llm in engines.values():
        llm.close()
    base = statistics.median(rates["stored"])
    print(f"batch-1 decode, {threads} threads, {tokens} tokens, median of {rounds} rounds: " +
          ", ".join(f"{k} {statistics.median(v):.1f} tok/s ({statistics.median(v) / base:.2f}x)"
                    for k, v in rates.items()), flush=True)


def bench_cold(repeats: int, threads: tuple[int, ...], formats: tuple[str, ...], copies: int = 40) -> None:
    """Weights not in cache: ``copies`` distinct 16384 x 2048 tiled weights (Q4_K: 755 MB, more than any L3
    here), one single-row product each in turn, the best of ``repeats`` passes; weight GB/s and its share of
    the measured read bandwidth (what batch-1 decode of a model larger than the cache sees)."""
    from tokenmill.quantization import qgemm
    from tokenmill.quantization.formats import GGUF_QUANT_TYPES

    ids = {name: qtype for qtype, (name, _, _) in GGUF_QUANT_TYPES.items()}
    n, k = 16384, 2048
    for nt in threads:
        bw = read_bandwidth(nt)
        torch.set_num_threads(nt)
        for name in formats:
            base = qgemm.repack(random_weight(ids[name], n, k))
            weights = [base.data.clone() for _ in range(copies)]
            x, y = torch.randn(1, k), torch.empty(1, n)
            best = min(time_call(lambda: [qgemm.quantized_linear(x, d, base.qtype, n, k, out=y) for d in weights], 1)
                       for _ in range(repeats))
            gbs = copies * base.nbytes / best / 1e9
            print(f"cold {name} {n}x{k}, {nt} thread(s), M=1: {best / copies * 1e3:.3f} ms per product, "
                  f"{gbs:.1f} GB/s = {gbs / bw:.0%} of {bw:.1f} GB/s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--no-calls", action="store_true")
    parser.add_argument("--no-decode", action="store_true")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--formats", action="store_true",
                        help="only the per-format table (every GGUF format, stored vs tiled, at 1-2 B model shapes)")
    parser.add_argument("--rows", default="1,8,32", help="activation rows of the --formats table")
    parser.add_argument("--cold", default="", help="only weights-not-in-cache single-row products of these "
                        "formats, e.g. Q4_K,Q6_K,Q4_0")
    args = parser.parse_args()
    threads = tuple(int(t) for t in args.threads.split(","))
    if args.cold:
        bench_cold(args.repeats, threads, tuple(args.cold.split(",")))
        return
    if args.formats:
        bench_formats(args.repeats, threads, tuple(int(r) for r in args.rows.split(",")))
        return
    if not args.no_calls:
        bench_calls(args.repeats, threads)
    if not args.no_decode:
        for nt in threads:
            bench_decode(args.rounds, nt, args.tokens)


if __name__ == "__main__":
    main()
