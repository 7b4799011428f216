"""``bench compare``: one single-turn workload on tokenmill (offline) and on every installed peer, in one run.

Runs vary 10-20% between runs on shared CPUs, so engines are compared within one run only.
Peers that are absent are listed with the reason they were skipped; no number is made up.
"""
from __future__ import annotations

import gc
import time
from dataclasses import asdict
from typing import Any

from tokenmill.bench.datasets import SampledRequest
from tokenmill.bench.offline import run_offline
from tokenmill.bench.peers import EngineRun, run_llama_cpp, run_transformers, skip_reason
from tokenmill.bench.table import Column, comparison_lines, format_rows
from tokenmill.bench.workload import Conversation


def run_tokenmill(llm: Any, requests: list[SampledRequest], load_s: float) -> EngineRun:
    """tokenmill's offline pass over ``requests`` (all fitting max_model_len) as an EngineRun, after a warm-up."""
    warm = SampledRequest("", requests[0].prompt_token_ids[:16], 2)
    run_offline(llm, [Conversation((warm,))], use_tqdm=False)
    run = run_offline(llm, [Conversation((r,)) for r in requests], use_tqdm=True)
    assert run.metrics.failed == 0, [r.error for r in run.results if not r.success][:3]
    return EngineRun("tokenmill", len(requests), run.metrics.total_input_tokens,
                     sum(r.expected_output_len for r in requests), run.metrics.total_output_tokens,
                     run.duration_s, load_s, note="continuous batching")


def compare_engines(build_llm: Any, model: str | None, requests: list[SampledRequest], peers: list[str],
                    peer_batch_size: int, num_threads: int | None) -> tuple[list[EngineRun], dict[str, str], list[str]]:
    """Run tokenmill (``build_llm()`` makes the LLM) then each runnable peer on the same requests.

    Requests longer than tokenmill's max_model_len are dropped for every engine. Returns the
    runs, the skipped peers with their reasons, and notes about the workload.
    """
    start = time.perf_counter()
    llm = build_llm()
    load_s = time.perf_counter() - start
    n_ctx = llm.engine.max_model_len
    fitting = [r for r in requests if r.prompt_len + r.expected_output_len <= n_ctx]
    notes = []
    if len(fitting) < len(requests):
        notes.append(f"dropped {len(requests) - len(fitting)} requests longer than max_model_len {n_ctx}")
    if not fitting:
        raise ValueError(f"num_prompts: no sampled request fits max_model_len {n_ctx}")
    runs = [run_tokenmill(llm, fitting, load_s)]
    dtype = llm.engine.loaded.dtype
    tokenizer = llm.get_tokenizer()
    llm.close()  # also hands the engine's start-up objects back to the garbage collector
    del llm
    gc.collect()
    skipped: dict[str, str] = {}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    for peer in peers:
        reason = skip_reason(peer, model)
        if reason is not None:
            skipped[peer] = reason
            continue
        if peer == "transformers":
            runs.append(run_transformers(model, dtype, fitting, peer_batch_size, pad))
        else:
            runs.append(run_llama_cpp(model, fitting, n_ctx, num_threads))
        gc.collect()
    return runs, skipped, notes


def ratios(runs: list[EngineRun]) -> dict[str, float]:
    """tokenmill / peer for output and total token throughput, per peer that ran."""
    base = next(r for r in runs if r.engine == "tokenmill")
    out = {}
    for r in runs:
        if r.engine != "tokenmill":
            out[f"output_tok_s tokenmill/{r.engine}"] = base.output_throughput / r.output_throughput
            out[f"total_tok_s tokenmill/{r.engine}"] = base.total_token_throughput / r.total_token_throughput
    return out


COMPARE_COLUMNS = (
    Column("engine", 14, lambda r: r.engine, align="<"),
    Column("requests", 9, lambda r: r.num_requests),
    Column("input tok", 11, lambda r: r.input_tokens),
    Column("output tok", 12, lambda r: r.output_tokens),
    Column("raw out", 10, lambda r: r.raw_output_tokens),
    Column("wall s", 9, lambda r: r.wall_s, ".2f"),
    Column("req/s", 8, lambda r: r.request_throughput, ".2f"),
    Column("out tok/s", 11, lambda r: r.output_throughput, ".1f"),
    Column("tot tok/s", 11, lambda r: r.total_token_throughput, ".1f"),
    Column("load s", 8, lambda r: r.load_s, ".1f"),
    Column("note", 0, lambda r: r.note, align="<", gap=2),
)


def format_compare_table(runs: list[EngineRun], skipped: dict[str, str], notes: list[str]) -> str:
    """Side-by-side table, the tokenmill/peer ratios, then one line per skipped peer and note."""
    return "\n".join(format_rows(COMPARE_COLUMNS, runs) + comparison_lines(ratios(runs), skipped, notes))


def compare_record(runs: list[EngineRun], skipped: dict[str, str], notes: list[str]) -> dict[str, Any]:
    """JSON-ready record of a comparison."""
    return {
        "runs": [{**asdict(r), "request_throughput": r.request_throughput, "output_throughput": r.output_throughput,
                  "total_token_throughput": r.total_token_throughput} for r in runs],
        "ratios": ratios(runs),
        "skipped": skipped,
        "notes": notes,
    }
