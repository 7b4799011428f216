"""Greedy equality with transformers in bfloat16 on a GPU, and CUDA graphs on vs off.

Run from the repo root on the GPU machine (no network): ``python benchmarks/gpu/greedy_equality.py``.
Builds random Llama and Qwen3 checkpoints of realistic width (hidden 2048, 4 layers, vocab 32000,
bf16, synthetic tokenizer) in a temp dir, generates greedily from token-id prompts with tokenmill
(CUDA graphs on) and with transformers ``generate`` on the same GPU, and reports per prompt the
first position where they differ. A divergence passes when it happens at a near-tie: transformers'
logit margin between its token and tokenmill's is within bf16 noise (``--tie-tolerance``, relative
to the top logit). Then runs the same prompts through tokenmill with and without CUDA graphs and
requires identical tokens. Prints labelled lines, writes ``--json``, exits 1 on any failure.
``--cpu-smoke`` runs the same plumbing on CPU with tiny models (CPU runner, no graphs).
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

VOCAB = 32000
WIDE = dict(vocab_size=VOCAB, hidden_size=2048, intermediate_size=5632, num_hidden_layers=4, num_attention_heads=16,
            num_key_value_heads=8, head_dim=128, max_position_embeddings=2048, rms_norm_eps=1e-6,
            initializer_range=0.02)
SMOKE = dict(WIDE, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16)
DEVICE = "cuda"  # "cpu" with --cpu-smoke


def prompts_for(seed: int, num: int, lo: int, hi: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(lo, hi))] for _ in range(num)]


def free_gpu() -> None:
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def tokenmill_greedy(path: Path, prompts: list[list[int]], max_tokens: list[int], **engine) -> tuple[list, object]:
    llm = LLM(model=str(path), device=DEVICE, dtype="bfloat16", gpu_memory_utilization=0.3, max_num_seqs=32,
              **engine)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    runner = llm.engine.runner
    stats = (getattr(runner, "num_padded_decode_steps", 0), getattr(runner, "num_general_steps", 0))
    del llm
    free_gpu()
    return [o.outputs[0].token_ids for o in outs], stats


@torch.inference_mode()
def hf_greedy(hf, prompt: list[int], max_tokens: int) -> list[int]:
    ids = torch.tensor([prompt], device=DEVICE)
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens,
                      min_new_tokens=max_tokens, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@torch.inference_mode()
def margin_at(hf, prompt: list[int], prefix: list[int], hf_token: int, tm_token: int) -> tuple[float, float]:
    """(transformers' logit of its token minus tokenmill's token's, |top logit|) after prompt + prefix."""
    ids = torch.tensor([prompt + prefix], device=DEVICE)
    logits = hf(ids).logits[0, -1].float()
    return float(logits[hf_token] - logits[tm_token]), float(logits.max().abs())


def check_arch(arch: str, workdir: Path, tie_tolerance: float, new_tokens: int, dims: dict) -> dict:
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    path = save_random_model(workdir / arch, random_config(arch, **dims), torch.bfloat16, seed=1, init_device=DEVICE)
    prompts = prompts_for(seed=2, num=8, lo=8, hi=400)
    got, _ = tokenmill_greedy(path, prompts, [new_tokens] * len(prompts))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(DEVICE).eval()
    rows, ok = [], True
    for prompt, tokens in zip(prompts, got):
        want = hf_greedy(hf, prompt, new_tokens)
        diverge = next((i for i, (a, b) in enumerate(zip(tokens, want)) if a != b), None)
        row = {"prompt_len": len(prompt), "first_divergence": diverge}
        if diverge is not None:
            margin, scale = margin_at(hf, prompt, want[:diverge], want[diverge], tokens[diverge])
            row.update(margin=round(margin, 4), top_logit=round(scale, 3),
                       near_tie=abs(margin) <= tie_tolerance * max(scale, 1.0))
            ok &= row["near_tie"]
        rows.append(row)
    del hf
    free_gpu()
    matched = sum(r["first_divergence"] is None for r in rows)
    print(f"[equality {arch}] {matched}/{len(rows)} prompts identical over {new_tokens} tokens; "
          f"first divergences {[r['first_divergence'] for r in rows]}; "
          f"margins at divergence {[r.get('margin') for r in rows if r['first_divergence'] is not None]} "
          f"-> {'PASS' if ok else 'FAIL'} ({time.perf_counter() - t0:.0f}s)", flush=True)
    return {"arch": arch, "pass": ok, "new_tokens": new_tokens, "prompts": rows, "path": str(path)}


def check_graphs(path: Path) -> dict:
    t0 = time.perf_counter()
    prompts = prompts_for(seed=3, num=40, lo=4, hi=300)
    max_tokens = [4 + (7 * i) % 37 for i in range(len(prompts))]  # batches shrink through many buckets
    graphs, graph_steps = tokenmill_greedy(path, prompts, max_tokens)
    eager, eager_steps = tokenmill_greedy(path, prompts, max_tokens, enforce_eager=True)
    same = graphs == eager
    diverge = [next((i for i, (a, b) in enumerate(zip(g, e)) if a != b), None) for g, e in zip(graphs, eager)]
    print(f"[graphs on vs off] {sum(d is None for d in diverge)}/{len(prompts)} requests identical; padded decode "
          f"steps {graph_steps[0]} (graphs) / {eager_steps[0]} (eager) -> {'PASS' if same else 'FAIL'} "
          f"({time.perf_counter() - t0:.0f}s)", flush=True)
    return {"pass": same, "first_divergences": diverge, "padded_decode_steps": [graph_steps[0], eager_steps[0]]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--tie-tolerance", type=float, default=0.02,
                        help="a divergence passes when the logit margin is <= this x |top logit|")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny models on CPU: checks this script's plumbing")
    args = parser.parse_args()
    global DEVICE
    DEVICE = "cpu" if args.cpu_smoke else "cuda"
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("greedy_equality: needs a CUDA device", file=sys.stderr)
        return 2
    dims = SMOKE if args.cpu_smoke else WIDE
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        results["equality"] = [check_arch(arch, workdir, args.tie_tolerance, args.new_tokens, dims)
                               for arch in ("llama", "qwen3")]
        results["graphs_on_vs_off"] = check_graphs(workdir / "llama")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    ok = all(r["pass"] for r in results["equality"]) and results["graphs_on_vs_off"]["pass"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
