"""Check the Triton paged-attention kernels against the torch reference on a GPU, at serving shapes, and time them.

Run from the repo root on the GPU machine (no network needed): ``python benchmarks/gpu/kernel_check.py``.
Compares triton_write_kv / triton_paged_attention with torch_paged.write_kv / paged_attention
(bf16, head_dim 128, 32 heads / 8 KV heads, shuffled block tables, contexts up to 8k, batches up
to 128, mixed decode + prefill steps; fp16 and fp32 too), prints max abs errors and kernel
timings (decode µs per call and GB/s of K/V read; prefill TFLOP/s), and exits 1 on any mismatch.
Timings replay a CUDA graph of the call, which also proves the call needs no host sync.
``--cpu-smoke`` runs tiny shapes on CPU under triton's interpreter (checks this script's plumbing).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, when run as a script
# None of these imports triton: triton_attention imports its kernels at their first call.
from tokenmill.attention import build_attention_metadata, triton_attention  # noqa: E402
from tokenmill.attention.torch_paged import paged_attention, write_kv  # noqa: E402
from tokenmill.attention.triton_attention import triton_paged_attention, triton_write_kv  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Shapes:
    """Everything that differs between the GPU run and the CPU smoke run."""

    device: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    write_tokens: int
    # Mixed step: (query_len, num_cached) per request, plus this many decodes with random contexts.
    prefills: tuple[tuple[int, int], ...]
    num_mixed_decodes: int
    max_context: int
    # Decode-only steps (batch, context) that are checked and timed.
    decode_steps: tuple[tuple[int, int], ...]
    # Prefill-only steps (number of prompts, prompt length) that are timed.
    prefill_steps: tuple[tuple[int, int], ...]
    time_kernels: bool


GPU = Shapes(
    device="cuda", num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, write_tokens=8192,
    prefills=((2048, 0), (512, 3000), (77, 511), (1000, 6000), (2, 16), (33, 8100)),
    num_mixed_decodes=60, max_context=8192,
    decode_steps=((1, 8192), (8, 8192), (32, 4096), (64, 8192), (128, 1024), (128, 8192)),
    prefill_steps=((8, 2048), (1, 8192)),
    time_kernels=True,
)
CPU_SMOKE = Shapes(
    device="cpu", num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, write_tokens=64,
    prefills=((20, 0), (7, 30), (2, 5)), num_mixed_decodes=3, max_context=100,
    decode_steps=((1, 100), (3, 40)), prefill_steps=(), time_kernels=False,
)
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 4e-3}


def metadata_to(metadata, device):
    """A copy of AttentionMetadata with every tensor (prefill spans included) on ``device``."""
    moved = {}
    for field in dataclasses.fields(metadata):
        value = getattr(metadata, field.name)
        if isinstance(value, torch.Tensor):
            value = value.to(device)
        moved[field.name] = value
    moved["prefills"] = tuple(
        dataclasses.replace(
            span,
            block_ids=span.block_ids.to(device),
            attn_mask=None if span.attn_mask is None else span.attn_mask.to(device),
        )
        for span in metadata.prefills
    )
    return dataclasses.replace(metadata, **moved)


def make_step(shapes: Shapes, query_lens, num_cached, dtype, rng):
    """Metadata over shuffled block ids, and a random cache holding every context."""
    query_lens = np.asarray(query_lens, dtype=np.int64)
    num_cached = np.asarray(num_cached, dtype=np.int64)
    bs = shapes.block_size
    num_blocks = -(-(query_lens + num_cached) // bs)  # (B,)
    total_blocks = int(num_blocks.sum()) + 8
    ids = rng.permutation(total_blocks)
    block_table = np.zeros((len(query_lens), int(num_blocks.max())), dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(num_blocks)])
    for i, n in enumerate(num_blocks):
        block_table[i, :n] = ids[offsets[i] : offsets[i + 1]]
    metadata, _ = build_attention_metadata(query_lens, num_cached, block_table, bs)
    metadata = metadata_to(metadata, shapes.device)
    cache_shape = (total_blocks, bs, shapes.num_kv_heads, shapes.head_dim)
    k_cache = torch.randn(cache_shape, device=shapes.device).to(dtype)
    v_cache = torch.randn(cache_shape, device=shapes.device).to(dtype)
    query = torch.randn(int(query_lens.sum()), shapes.num_heads, shapes.head_dim, device=shapes.device).to(dtype)
    kv_bytes = int((query_lens + num_cached).sum()) * 2 * shapes.num_kv_heads * shapes.head_dim * k_cache.element_size()
    return metadata, k_cache, v_cache, query, kv_bytes


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_call(fn, calls_per_graph: int = 10, replays: int = 20) -> tuple[float, float | None]:
    """(eager µs per call including Python launch cost, CUDA-graph µs per call or None if capture failed)."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    eager_us = (time.perf_counter() - start) / 20 * 1e6
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls_per_graph):
                fn()
        graph.replay()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        return eager_us, begin.elapsed_time(end) * 1e3 / (replays * calls_per_graph)
    except Exception as exc:  # a capture failure means a host sync inside the call: report it
        print(f"    CUDA graph capture failed: {type(exc).__name__}: {exc}")
        return eager_us, None


class Checker:
    def __init__(self) -> None:
        self.failures: list[str] = []

    def compare(self, name: str, actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
        """Fails where |actual - expected| > tol * (1 + |expected|) (NaN fails too)."""
        diff = (actual.float() - expected.float()).abs()
        err = diff.max().item() if diff.numel() else 0.0
        bad = bool((~(diff <= tol * (1 + expected.float().abs()))).any())
        print(f"  {name:<58} max abs err {err:.3e} (tol {tol:.0e} x (1 + |ref|)){'  MISMATCH' if bad else ''}")
        if bad:
            self.failures.append(f"{name}: max abs err {err:.3e} beyond tol {tol:.0e} x (1 + |ref|)")

    def exact(self, name: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
        same = torch.equal(actual, expected)
        print(f"  {name:<58} {'bit-exact' if same else 'DIFFERS'}")
        if not same:
            self.failures.append(f"{name}: not bit-exact")

    def run(self, name: str, fn) -> None:
        try:
            fn()
        except Exception:
            traceback.print_exc()
            self.failures.append(f"{name}: raised")


def check_write_kv(shapes: Shapes, checker: Checker, rng) -> None:
    print("write_kv")
    t, kvh, d = shapes.write_tokens, shapes.num_kv_heads, shapes.head_dim
    num_slots = 2 * t
    slots = torch.from_numpy(rng.permutation(num_slots)[:t].astype(np.int64)).to(shapes.device)
    slots[::17] = -1  # padding tokens
    real = slots >= 0
    for src_dtype, cache_dtype in ((torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)):
        k_cache = torch.randn(num_slots // shapes.block_size, shapes.block_size, kvh, d, device=shapes.device)
        k_cache = k_cache.to(cache_dtype)
        v_cache = torch.randn_like(k_cache)
        qkv = torch.randn(t, 3 * kvh * d, device=shapes.device).to(src_dtype)
        key = qkv[:, : kvh * d].view(t, kvh, d)
        value = qkv[:, kvh * d : 2 * kvh * d].view(t, kvh, d)
        ref_k, ref_v = k_cache.clone(), v_cache.clone()
        write_kv(key[real], value[real], ref_k, ref_v, slots[real])
        triton_write_kv(key, value, k_cache, v_cache, slots)
        label = f"{str(src_dtype)[6:]} -> {str(cache_dtype)[6:]} cache, T={t}, padded slots skipped"
        if shapes.device == "cpu" and src_dtype != cache_dtype:  # the interpreter truncates instead of rounding
            checker.compare(label, torch.cat([k_cache, v_cache]), torch.cat([ref_k, ref_v]), 2e-2)
        else:
            checker.exact(label, torch.cat([k_cache, v_cache]), torch.cat([ref_k, ref_v]))


def check_mixed(shapes: Shapes, checker: Checker, rng) -> None:
    print("mixed decode + prefill step")
    query_lens = [q for q, _ in shapes.prefills] + [1] * shapes.num_mixed_decodes
    contexts = rng.integers(1, shapes.max_context + 1, size=shapes.num_mixed_decodes)
    num_cached = [c for _, c in shapes.prefills] + list(contexts - 1)
    order = rng.permutation(len(query_lens))
    query_lens, num_cached = [query_lens[i] for i in order], [num_cached[i] for i in order]
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        metadata, k_cache, v_cache, query, _ = make_step(shapes, query_lens, num_cached, dtype, rng)
        scale = shapes.head_dim**-0.5
        expected = paged_attention(query, k_cache, v_cache, metadata, scale)
        for num_splits in (None, 1, 4, 13):
            actual = triton_paged_attention(query, k_cache, v_cache, metadata, scale, num_splits=num_splits)
            label = f"{str(dtype)[6:]}, B={len(query_lens)}, T={query.shape[0]}, splits={num_splits or 'auto'}"
            checker.compare(label, actual, expected, TOLERANCE[str(dtype)[6:]])


def check_decode(shapes: Shapes, checker: Checker, rng) -> None:
    print("decode steps (bf16): error vs reference; µs per call (CUDA graph / eager) and K/V read bandwidth")
    for batch, context in shapes.decode_steps:
        contexts = np.full(batch, context)
        metadata, k_cache, v_cache, query, kv_bytes = make_step(
            shapes, np.ones(batch), contexts - 1, torch.bfloat16, rng
        )
        scale = shapes.head_dim**-0.5
        expected = paged_attention(query, k_cache, v_cache, metadata, scale)
        auto = triton_attention.choose_num_splits(
            batch, shapes.num_kv_heads, metadata.block_table.shape[1] * shapes.block_size,
            triton_attention._num_sms(query.device),
        )
        for num_splits in sorted({1, auto}):
            actual = triton_paged_attention(query, k_cache, v_cache, metadata, scale, num_splits=num_splits)
            label = f"B={batch:<4} context={context:<5} splits={num_splits}{' (auto)' if num_splits == auto else ''}"
            checker.compare(label, actual, expected, TOLERANCE["bfloat16"])
            if shapes.time_kernels:
                eager_us, graph_us = time_call(
                    lambda: triton_paged_attention(query, k_cache, v_cache, metadata, scale, num_splits=num_splits)
                )
                us = graph_us if graph_us is not None else eager_us
                l2 = "  (K/V fits in L2: optimistic)" if kv_bytes < 64 << 20 else ""
                graph = f"{graph_us:8.1f}" if graph_us is not None else "     n/a"
                print(f"    {graph} µs graph, {eager_us:8.1f} µs eager, {kv_bytes / us / 1e3:7.1f} GB/s of "
                      f"{kv_bytes / 2**20:.0f} MiB K/V{l2}")
        k_cache = v_cache = None  # freed before the next step's are made


def time_prefill(shapes: Shapes, checker: Checker, rng) -> None:
    if not shapes.prefill_steps:
        return
    print("prefill steps (bf16, fresh prompts): error vs reference; ms per call and causal TFLOP/s")
    for num_prompts, length in shapes.prefill_steps:
        metadata, k_cache, v_cache, query, _ = make_step(
            shapes, np.full(num_prompts, length), np.zeros(num_prompts), torch.bfloat16, rng
        )
        scale = shapes.head_dim**-0.5
        expected = paged_attention(query, k_cache, v_cache, metadata, scale)
        actual = triton_paged_attention(query, k_cache, v_cache, metadata, scale)
        checker.compare(f"{num_prompts} x {length} tokens", actual, expected, TOLERANCE["bfloat16"])
        _, graph_us = time_call(lambda: triton_paged_attention(query, k_cache, v_cache, metadata, scale), 2, 5)
        if graph_us is not None:
            flops = 4 * shapes.num_heads * shapes.head_dim * num_prompts * length * (length + 1) / 2
            print(f"    {graph_us / 1e3:8.2f} ms, {flops / graph_us / 1e6:6.1f} TFLOP/s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU under triton's interpreter")
    args = parser.parse_args()
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported
    shapes = CPU_SMOKE if args.cpu_smoke else GPU
    if shapes.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run on the GPU machine, or pass --cpu-smoke")
        return 2
    if not triton_attention.available():
        print("triton is not importable")
        return 2
    import triton

    name = torch.cuda.get_device_name() if shapes.device == "cuda" else "cpu (triton interpreter)"
    print(f"torch {torch.__version__}, triton {triton.__version__}, {name}")
    print(f"heads {shapes.num_heads} (kv {shapes.num_kv_heads}), head_dim {shapes.head_dim}, "
          f"block_size {shapes.block_size}")
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference must be exact float32
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    checker = Checker()
    start = time.perf_counter()
    with torch.inference_mode():
        checker.run("write_kv", lambda: check_write_kv(shapes, checker, rng))
        checker.run("mixed", lambda: check_mixed(shapes, checker, rng))
        checker.run("decode", lambda: check_decode(shapes, checker, rng))
        checker.run("prefill", lambda: time_prefill(shapes, checker, rng))
    print(f"done in {time.perf_counter() - start:.1f} s")
    if checker.failures:
        print("FAILED:\n  " + "\n  ".join(checker.failures))
        return 1
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
