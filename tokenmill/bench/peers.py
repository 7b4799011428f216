"""Peer engines for ``bench compare``: ``transformers`` batched ``generate`` and ``llama_cpp`` (if installed).

Each peer runs the same single-turn requests greedily and generates each request's target
length, and reports wall time over the requests (loading excluded). A peer that is not
installed, or cannot read the model, is skipped with the reason; nothing is estimated.

transformers cannot stop rows of a batch independently while ignoring EOS, so each batch
(requests sorted by prompt length, left-padded) generates the longest target in the batch;
only each request's own target counts as output, the padded extra is reported as ``raw``.
llama-cpp-python runs one request at a time (it has no batched API), with EOS biased away.
"""
from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenmill.bench.datasets import SampledRequest

PEERS = ("transformers", "llama_cpp")


@dataclass(frozen=True)
class EngineRun:
    """One engine's pass over the requests: useful tokens, wall time, and how long loading took."""

    engine: str
    num_requests: int
    input_tokens: int
    output_tokens: int  # sum of the requests' targets (the work asked for)
    raw_output_tokens: int  # everything generated, padding rows of a batch included
    wall_s: float
    load_s: float
    note: str = ""

    @property
    def request_throughput(self) -> float:
        return self.num_requests / self.wall_s

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def total_token_throughput(self) -> float:
        return (self.input_tokens + self.output_tokens) / self.wall_s


def model_file(model: str | None) -> Path:
    """The local path a peer loads: the embedded SmolLM2 GGUF when ``model`` is None."""
    if model is None:
        from tokenmill.models.default_model import default_model_path

        return default_model_path()
    return Path(model).expanduser()


def skip_reason(peer: str, model: str | None) -> str | None:
    """Why ``peer`` cannot run on ``model`` here (not installed, wrong format), or None when it can."""
    if peer not in PEERS:
        return f"unknown peer {peer!r} (known: {', '.join(PEERS)})"
    if importlib.util.find_spec(peer) is None:
        return f"{peer} is not installed"
    path = model_file(model)
    if peer == "transformers" and path.suffix == ".gguf" and importlib.util.find_spec("accelerate") is None:
        return "transformers needs `accelerate` to load a GGUF file"
    if peer == "llama_cpp" and path.suffix != ".gguf":
        return "llama_cpp needs a .gguf model file"
    return None


def _totals(requests: list[SampledRequest]) -> tuple[int, int]:
    return sum(r.prompt_len for r in requests), sum(r.expected_output_len for r in requests)


def run_transformers(model: str | None, dtype: Any, requests: list[SampledRequest], batch_size: int,
                     pad_token_id: int) -> EngineRun:
    """Greedy batched ``generate`` (dense weights in ``dtype``, a torch dtype); see the module docstring."""
    import torch
    from transformers import AutoModelForCausalLM

    path = model_file(model)
    kwargs = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    source = str(path.parent) if path.suffix == ".gguf" else str(path)
    start = time.perf_counter()
    hf_model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **kwargs).eval()
    load_s = time.perf_counter() - start

    @torch.inference_mode()
    def generate(batch: list[SampledRequest], new_tokens: int) -> int:
        width = max(r.prompt_len for r in batch)
        input_ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)  # (B, width), left-padded
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):
            input_ids[row, width - r.prompt_len:] = torch.tensor(r.prompt_token_ids)
            mask[row, width - r.prompt_len:] = 1
        out = hf_model.generate(input_ids=input_ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens, pad_token_id=pad_token_id)  # (B, width + new)
        return (out.shape[1] - width) * out.shape[0]

    generate(requests[:1], 2)  # warm-up
    ordered = sorted(requests, key=lambda r: r.prompt_len)
    raw = 0
    start = time.perf_counter()
    for i in range(0, len(ordered), batch_size):
        batch = ordered[i:i + batch_size]
        raw += generate(batch, max(r.expected_output_len for r in batch))
    wall = time.perf_counter() - start
    input_tokens, output_tokens = _totals(requests)
    return EngineRun("transformers", len(requests), input_tokens, output_tokens, raw, wall, load_s,
                     note=f"batches of {batch_size}, each to its longest target")


def run_llama_cpp(model: str | None, requests: list[SampledRequest], n_ctx: int, num_threads: int | None) -> EngineRun:
    """llama-cpp-python, one request at a time, greedy, EOS biased away so each reaches its target."""
    from llama_cpp import Llama

    start = time.perf_counter()
    llm = Llama(model_path=str(model_file(model)), n_ctx=n_ctx, n_threads=num_threads, verbose=False)
    load_s = time.perf_counter() - start
    no_eos = {llm.token_eos(): -1e9}
    llm.create_completion(requests[0].prompt_token_ids, max_tokens=2, temperature=0.0)  # warm-up
    raw = 0
    start = time.perf_counter()
    for r in requests:
        out = llm.create_completion(r.prompt_token_ids, max_tokens=r.expected_output_len, temperature=0.0,
                                    logit_bias=no_eos)
        raw += int(out["usage"]["completion_tokens"])
    wall = time.perf_counter() - start
    input_tokens, output_tokens = _totals(requests)
    return EngineRun("llama_cpp", len(requests), input_tokens, output_tokens, raw, wall, load_s,
                     note="one request at a time; weights as stored in the GGUF")
