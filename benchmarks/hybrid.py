"""Hybrid linear-attention models (issue 20): tokenmill vs `transformers` on one random Qwen3.5 text config sized
like SmolLM2-135M, and the memory a sequence needs against a same-size full-attention model.

The config: hidden 576, 30 layers (every 4th full attention, 7 in all; 23 Gated DeltaNet layers with 4 key heads,
8 value heads, head dims 64, conv kernel 4), 9 query / 3 KV heads of 64, MLP 1536, vocab 49152, tied
embeddings: about 135M parameters. Random weights (seeded), written by transformers' ``save_pretrained`` in
float32 with the SmolLM2 tokenizer; both engines run the same weights in ``--dtype`` (float32 by default) on
``--num-threads`` threads.

Measured, in one run:
- decode tok/s at batch 1 and batch B (``--batch``, 32): B prompts of ``--prompt-len`` random tokens, greedy,
  ``ignore_eos``; decode time = time(``--max-tokens`` new tokens) - time(1 new token), so the prefill cancels;
  tokenmill via ``LLM.generate``, transformers via ``generate`` (its own recurrent cache);
- prefill tok/s: ``--prefill-batch`` prompts of ``--prefill-len`` tokens, one new token; transformers runs one
  forward over the batch (no cache);
- the linear layers' one-token state update alone (8 value heads of 64 x 64, batch 1 and B): the C kernel the
  runner uses (``invariant_ops.recurrent_rule`` on the pool's slots) against the torch batched step
  (``gated_delta_rule.decode_step`` on a gathered copy), microseconds per layer and step;
- memory per sequence at 1k, 4k and 8k tokens of context: tokenmill's KV bytes per token (the 7 full-attention
  layers) x context + the linear layers' state slot (both read from the engine's allocated tensors), with and
  without the prefix cache's state checkpoint (one more slot's bytes per sequence at most), against the same
  count for SmolLM2-135M itself (30 full-attention layers, 3 KV heads of 64), in the run's dtype.

Runs vary 10-20% on shared CPU machines: compare within one run, on an idle machine.

    .venv/bin/python benchmarks/hybrid.py [--dtype float32|bfloat16] [--batch 32] [--max-tokens 32]
        [--prompt-len 32] [--prefill-len 512] [--prefill-batch 2] [--num-threads 2] [--skip-transformers]
        [--output-json hybrid.json]
"""
from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.runner.kv_cache_sizing import kv_bytes_per_token

LAYERS = 30
FULL_EVERY = 4  # layers 3, 7, ... are full attention (Qwen3-Next's 3:1 pattern)
CONTEXTS = (1024, 4096, 8192)


def hybrid_config():
    from transformers import Qwen3_5TextConfig

    layer_types = ["full_attention" if (i + 1) % FULL_EVERY == 0 else "linear_attention" for i in range(LAYERS)]
    return Qwen3_5TextConfig(
        architectures=["Qwen3_5ForCausalLM"], vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_hidden_layers=LAYERS, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
        linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_conv_kernel_dim=4, max_position_embeddings=16384, rms_norm_eps=1e-6, tie_word_embeddings=True,
        layer_types=layer_types, bos_token_id=1, eos_token_id=2, initializer_range=0.02,
    )


def write_checkpoint(out_dir: Path) -> tuple[str, int]:
    """The random checkpoint (float32) + SmolLM2 tokenizer; returns (path, parameter count)."""
    from transformers import AutoModelForCausalLM

    from tokenmill.models.default_model import default_model_path
    from tokenmill.models.gguf_cache import cached_tokenizer
    from tokenmill.models.gguf_loader import load_gguf_tokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hybrid_config(), dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.A_log.uniform_(-1.0, 1.0)
    model.save_pretrained(out_dir)
    gguf = default_model_path()
    cached_tokenizer(gguf, lambda: load_gguf_tokenizer(gguf)).save_pretrained(out_dir)
    (out_dir / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}) + "\n")
    return str(out_dir), sum(p.numel() for p in model.parameters())


def prompts(num: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(num)]


def time_tokenmill(llm: LLM, batch: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
    return time.perf_counter() - t0


@torch.inference_mode()
def time_transformers(model, batch: list[list[int]], max_tokens: int) -> float:
    ids = torch.tensor(batch)
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens,
                         min_new_tokens=max_tokens, pad_token_id=0)
    assert out.shape[1] == ids.shape[1] + max_tokens
    return time.perf_counter() - t0


@torch.inference_mode()
def time_transformers_prefill(model, batch: list[list[int]]) -> float:
    ids = torch.tensor(batch)
    t0 = time.perf_counter()
    model(ids, use_cache=False)
    return time.perf_counter() - t0


def decode_rate(timer, batch, max_tokens: int) -> float:
    """Decode tok/s of ``len(batch)`` sequences: (max_tokens - 1) tokens each over time(max_tokens) - time(1)."""
    timer(batch, 1)  # warm-up (kernel plans, allocator)
    t1 = min(timer(batch, 1) for _ in range(2))
    tn = timer(batch, max_tokens)
    return len(batch) * (max_tokens - 1) / (tn - t1)


def state_update_us(batch: int, repeats: int = 200) -> dict[str, float]:
    """Microseconds per layer-step of the one-token state update: C kernel in place vs torch on a gathered copy."""
    from tokenmill.linear_attention import decode_step, invariant_ops

    heads, dk, dv = 8, 64, 64
    gen = torch.Generator().manual_seed(batch)
    q, k = (torch.nn.functional.normalize(torch.randn(batch, heads, dk, generator=gen), dim=-1) for _ in range(2))
    v, g, beta = torch.randn(batch, heads, dv, generator=gen), -torch.rand(batch, heads), torch.rand(batch, heads)
    pool = torch.randn(max(batch, 8) * 2, heads, dk, dv, generator=gen) * 0.1
    slots = torch.arange(batch) * 2

    def torch_step():
        state = pool[slots]
        decode_step(q, k, v, g, beta, state)
        pool[slots] = state

    out = {}
    for name, fn in (("c_kernel", lambda: invariant_ops.recurrent_rule(q, k, v, g, beta, pool, slots)),
                     ("torch", torch_step)):
        fn()
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        out[name] = (time.perf_counter() - t0) / repeats * 1e6
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--prefill-batch", type=int, default=2)
    ap.add_argument("--num-threads", type=int, default=2)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.num_threads)
    dtype = getattr(torch, args.dtype)
    results: dict = {"dtype": args.dtype, "num_threads": args.num_threads}
    with tempfile.TemporaryDirectory() as tmp:
        path, num_params = write_checkpoint(Path(tmp))
        results["num_params"] = num_params
        print(f"random Qwen3.5 text config, {num_params / 1e6:.1f}M parameters, {args.dtype}, {args.num_threads} threads")
        # prefix caching off: repeated timing runs must not hit their own prompts (transformers has no cache either)
        llm = LLM(model=path, dtype=args.dtype, num_threads=args.num_threads, max_num_seqs=max(args.batch, 8),
                  max_model_len=max(CONTEXTS), kv_cache_memory=1.0, max_num_batched_tokens=2048,
                  enable_prefix_caching=False)
        engines = {"tokenmill": (lambda b, n: time_tokenmill(llm, b, n),
                                 lambda b: time_tokenmill(llm, b, 1))}
        if not args.skip_transformers:
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
            engines["transformers"] = (lambda b, n: time_transformers(hf, b, n),
                                       lambda b: time_transformers_prefill(hf, b))
        # each measurement runs on both engines back to back, so a shared machine's load hits both alike
        for name in engines:
            results[name] = {}
        for batch_size in (1, args.batch):
            batch = prompts(batch_size, args.prompt_len, seed=batch_size)
            for name, (timer, _) in engines.items():
                results[name][f"decode_tok_s_batch{batch_size}"] = decode_rate(timer, batch, args.max_tokens)
        batch = prompts(args.prefill_batch, args.prefill_len, seed=99)
        for name, (_, prefill_timer) in engines.items():
            prefill_timer(batch)  # warm-up
            best = min(prefill_timer(batch) for _ in range(2))
            results[name]["prefill_tok_s"] = args.prefill_batch * args.prefill_len / best
        for name in engines:
            print(name, {k: round(v, 1) for k, v in results[name].items()})
        for batch_size in (1, args.batch):
            results[f"state_update_us_batch{batch_size}"] = row = state_update_us(batch_size)
            print(f"one-token state update, batch {batch_size}: C {row['c_kernel']:.0f} us, torch {row['torch']:.0f} us "
                  f"per layer-step ({row['torch'] / row['c_kernel']:.1f}x)")
        runner = llm.engine.runner
        kv_per_token, state = runner.bytes_per_token, runner.state_cache.bytes_per_sequence
        checkpoint = state  # a state checkpoint is one more slot's bytes
        elt = torch.empty(0, dtype=dtype).element_size()
        full_per_token = kv_bytes_per_token(30, 3, 64, elt)  # SmolLM2-135M: 30 layers, 3 KV heads of 64
        memory = []
        for ctx in CONTEXTS:
            hybrid = kv_per_token * ctx + state
            full = full_per_token * ctx
            memory.append({"context": ctx, "hybrid_bytes": hybrid, "hybrid_with_checkpoint_bytes": hybrid + checkpoint,
                           "full_attention_bytes": full, "ratio": full / hybrid})
            print(f"context {ctx}: hybrid {hybrid / 2**20:.2f} MiB (+ checkpoint {checkpoint / 2**20:.2f} MiB), "
                  f"full attention {full / 2**20:.2f} MiB, {full / hybrid:.2f}x")
        results["memory"] = memory
        results["kv_bytes_per_token"], results["state_bytes_per_sequence"] = kv_per_token, state
        results["full_attention_kv_bytes_per_token"] = full_per_token
    if "transformers" in results:
        for key in results["tokenmill"]:
            print(f"{key}: tokenmill / transformers = {results['tokenmill'][key] / results['transformers'][key]:.2f}x")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
