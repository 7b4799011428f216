"""Decode throughput on a GPU: tokenmill vs transformers ``generate``, and against the bandwidth roofline.

Run from the repo root on the GPU machine (no network): ``python benchmarks/gpu/decode_benchmark.py``.
Saves a random ~1.1B-parameter Llama (hidden 2048, 16 layers, intermediate 8192, 32 heads / 8 KV
heads, vocab 32000, bf16) to a temp dir. For each batch size (default 1, 32, 128) every request has
a 1,024-token prompt and generates 256 tokens (EOS ignored). Reported per batch:

- tokenmill end to end: decode tokens/s of the engine's step loop while exactly ``batch`` requests
  decode (after the last first token, until the first request finishes; prefill excluded;
  scheduler, sampling and detokenization included);
- tokenmill forward only: the decode CUDA graph's replay time at that batch (CUDA events);
- transformers: ``generate`` (bf16, sdpa, dynamic cache) for 256 tokens minus ``generate`` for 1
  token, same prompts, same GPU;
- the roofline: bytes read per decode step (every weight except the embedding table, plus the K/V
  of the whole context) / ``--bandwidth`` (4.8 TB/s for an H200), as tokens/s and as the fraction
  the measured rates reach.
Prints labelled lines and writes ``--json``. ``--cpu-smoke`` runs the plumbing on CPU with a tiny
model (CPU runner: no graphs; the numbers mean nothing).
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, when run as a script
from tests.offline_models import random_config, save_random_model  # noqa: E402
from tokenmill import LLM, SamplingParams  # noqa: E402

MODEL = dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
             num_key_value_heads=8, max_position_embeddings=4096, rms_norm_eps=1e-5, initializer_range=0.02)
SMOKE_MODEL = dict(MODEL, vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2)
DEVICE = "cuda"  # "cpu" with --cpu-smoke


def synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def step_bytes(num_params: int, batch: int, context: int) -> int:
    """Bytes one decode step must read: all weights but the embedding table (only ``batch`` rows
    of it), plus K and V of ``context`` tokens per sequence (bf16)."""
    hidden, vocab = MODEL["hidden_size"], MODEL["vocab_size"]
    head_dim = hidden // MODEL["num_attention_heads"]
    weights = (num_params - vocab * hidden + batch * hidden) * 2
    kv_per_token = 2 * MODEL["num_hidden_layers"] * MODEL["num_key_value_heads"] * head_dim * 2
    return weights + batch * context * kv_per_token


def prompts(batch: int, prompt_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, MODEL["vocab_size"]) for _ in range(prompt_len)] for _ in range(batch)]


def tokenmill_decode(llm: LLM, batch: int, prompt_len: int, new_tokens: int, tag: str = "run") -> dict:
    """Engine decode tokens/s at exactly ``batch`` running requests — from the step after every
    request has its first token to the step where the first one finishes — and the replay time
    of the decode CUDA graph for ``batch``."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    ids = [f"{tag}-b{batch}-{i}" for i in range(batch)]
    for request_id, prompt in zip(ids, prompts(batch, prompt_len, seed=batch)):
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    produced = dict.fromkeys(ids, 0)
    t_begin = time.perf_counter()
    start = end = None
    at_start = at_end = steps = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        for out in outputs:
            produced[out.request_id] = len(out.outputs[0].token_ids)
        if start is None:
            if all(n > 0 for n in produced.values()):
                start, at_start = time.perf_counter(), sum(produced.values())  # the step just run synced
        elif end is None:
            steps += 1
            if any(out.finished for out in outputs):
                end, at_end = time.perf_counter(), sum(produced.values())
    decode_tokens = at_end - at_start
    elapsed = end - start
    result = {"decode_tokens": decode_tokens, "decode_steps": steps, "decode_s": elapsed,
              "tok_s": decode_tokens / elapsed, "prefill_s": start - t_begin, "step_ms": 1e3 * elapsed / steps}
    runner = engine.runner
    if getattr(runner, "graphs", None) is not None and batch in runner.graphs.graphs:
        # Replay over the last step's buffers (its blocks are free now: reads and writes are harmless).
        for _ in range(3):
            runner.graphs.replay(batch)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        replays = 50
        begin.record()
        for _ in range(replays):
            runner.graphs.replay(batch)
        end.record()
        torch.cuda.synchronize()
        result["forward_ms"] = begin.elapsed_time(end) / replays
    return result


@torch.inference_mode()
def hf_decode(hf, batch: int, prompt_len: int, new_tokens: int) -> dict:
    ids = torch.tensor(prompts(batch, prompt_len, seed=batch), device=DEVICE)
    mask = torch.ones_like(ids)

    def run(n: int) -> float:
        synchronize()
        t0 = time.perf_counter()
        out = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n, min_new_tokens=n,
                          pad_token_id=0)
        synchronize()
        assert out.shape[1] == prompt_len + n
        return time.perf_counter() - t0

    run(2)  # warm-up
    prefill_s = run(1)
    total_s = run(new_tokens)
    decode_s = total_s - prefill_s
    decode_tokens = batch * (new_tokens - 1)
    return {"decode_tokens": decode_tokens, "decode_s": decode_s, "tok_s": decode_tokens / decode_s,
            "prefill_s": prefill_s, "step_ms": 1e3 * decode_s / (new_tokens - 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--bandwidth", type=float, default=4.8e12, help="bytes/s of device memory")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny model on CPU: checks this script's plumbing")
    args = parser.parse_args()
    global DEVICE, MODEL
    if args.cpu_smoke:
        DEVICE, MODEL = "cpu", SMOKE_MODEL
    elif not torch.cuda.is_available():
        print("decode_benchmark: needs a CUDA device", file=sys.stderr)
        return 2
    device_name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    results: dict = {"device": device_name, "model": MODEL, "batches": {}}
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        path = save_random_model(Path(tmp) / "llama-1b", random_config("llama", **MODEL), torch.bfloat16,
                                 init_device=DEVICE)
        print(f"[bench] saved random model in {time.perf_counter() - t0:.0f}s", flush=True)
        t0 = time.perf_counter()
        llm = LLM(model=str(path), device=DEVICE, dtype="bfloat16", max_num_seqs=max(args.batches),
                  max_num_batched_tokens=8192, max_model_len=args.prompt_len + args.new_tokens,
                  gpu_memory_utilization=args.gpu_memory_utilization)
        num_params = sum(p.numel() for p in llm.engine.loaded.model.parameters())
        results["num_params"] = num_params
        results["kv_cache_tokens"] = llm.engine.runner.num_kv_tokens
        print(f"[bench] tokenmill engine ready in {time.perf_counter() - t0:.0f}s: {num_params / 1e9:.2f}B params, "
              f"KV cache {llm.engine.runner.num_kv_tokens} tokens", flush=True)
        # Warm-up: compile the prefill kernels, touch every path.
        tokenmill_decode(llm, 4, min(64, args.prompt_len), min(8, args.new_tokens), tag="warmup")
        for batch in args.batches:
            results["batches"][batch] = {"tokenmill": tokenmill_decode(llm, batch, args.prompt_len, args.new_tokens)}
        del llm
        gc.collect()
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        if not args.skip_transformers:
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(DEVICE).eval()
            for batch in args.batches:
                results["batches"][batch]["transformers"] = hf_decode(hf, batch, args.prompt_len, args.new_tokens)
            del hf

    mid_context = args.prompt_len + args.new_tokens // 2
    for batch, row in results["batches"].items():
        roofline_tok_s = batch / (step_bytes(num_params, batch, mid_context) / args.bandwidth)
        tm = row["tokenmill"]
        row["roofline_tok_s"] = roofline_tok_s
        row["tokenmill_roofline_fraction"] = tm["tok_s"] / roofline_tok_s
        line = (f"[bench batch {batch:>3}] tokenmill {tm['tok_s']:>9.0f} tok/s ({tm['step_ms']:.2f} ms/step, "
                f"{row['tokenmill_roofline_fraction']:.0%} of roofline {roofline_tok_s:.0f} tok/s)")
        if "forward_ms" in tm:
            forward_fraction = step_bytes(num_params, batch, args.prompt_len + args.new_tokens) / args.bandwidth / (
                tm["forward_ms"] / 1e3)
            row["forward_roofline_fraction"] = forward_fraction
            line += f"; graph forward {tm['forward_ms']:.3f} ms = {forward_fraction:.0%} of roofline"
        if "transformers" in row:
            hf = row["transformers"]
            row["speedup_vs_transformers"] = tm["tok_s"] / hf["tok_s"]
            line += f"; transformers {hf['tok_s']:.0f} tok/s -> {row['speedup_vs_transformers']:.1f}x"
        print(line, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
