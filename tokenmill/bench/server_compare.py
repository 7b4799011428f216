"""``bench compare --peer``: one workload through tokenmill's own server and through each native peer server, one run.

Each engine runs as an HTTP server on this machine with the same thread count, one after the other
(never both at once): ``tokenmill serve`` (a spawned ``run_server`` process, as ``serve
--data-parallel-size`` starts its replicas), then each peer (``llama-server`` on the same GGUF file;
see ``llama_server``). The same requests go through the same ``bench serve`` client: completions,
greedy, ``ignore_eos`` with each request's own ``max_tokens`` (so every engine generates the same
number of tokens), prompts sent as the workload's token ids (so both see the same tokens whatever
their tokenizer code), at most ``max_concurrency`` in flight. One untimed warm-up request (a prompt
that shares no prefix with the workload) goes first. Token counts are the servers' own ``usage``.

A peer whose binary is absent (or that cannot read the model) is skipped with the reason; one that
fails to start is skipped with its log; nothing is estimated. Runs vary 10-20% between runs on
shared CPUs, so engines are compared within one run only.
"""
from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass, replace
from typing import Any

from tokenmill import csrc_build
from tokenmill.bench.datasets import SampledRequest
from tokenmill.bench.llama_server import (
    LlamaServerProcess,
    ServerPeer,
    binary_version,
    llama_server_command,
    peer_args_for_this_cpu,
    skip_reason,
    slot_context,
)
from tokenmill.bench.metrics import BenchmarkMetrics
from tokenmill.bench.serve_bench import LoadConfig, ServeRun, run_serve_benchmark
from tokenmill.bench.serve_client import ClientConfig, make_client
from tokenmill.bench.serve_report import error_summary, resolve_model
from tokenmill.bench.table import Column, comparison_lines, format_rows
from tokenmill.bench.workload import Conversation
from tokenmill.engine_args import EngineArgs

WARMUP_PROMPT_TOKENS = 16
WARMUP_OUTPUT_TOKENS = 4
# llama-server stops a slot once prompt + generated tokens + 1 reach its context: room for that, and one more.
SLOT_MARGIN = 2


@dataclass(frozen=True)
class ServerCompareConfig:
    """How the engines are run.

    Args:
        threads: CPU threads of every engine (tokenmill's ``num_threads``, llama-server's ``-t``/``-tb``).
        max_concurrency: most requests in flight (None: all at once).
        parallel: llama-server slots (``-np``); each gets the context of the longest request.
        peer_args: extra llama-server arguments, after the ones this tool sets.
        timeout_s: per-request timeout of the client, seconds.
        load_timeout_s: how long a server may take to answer ``/health``.
        log_level: console log level of the tokenmill server process.
        disable_tqdm: no progress bars.
    """

    threads: int
    max_concurrency: int | None
    parallel: int
    peer_args: tuple[str, ...] = ()
    timeout_s: float = 3600.0
    load_timeout_s: float = 600.0
    log_level: str = "WARNING"
    disable_tqdm: bool = False

    def __post_init__(self) -> None:
        for name in ("threads", "parallel"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")


@dataclass(frozen=True)
class ServedRun:
    """One engine's pass over the workload through its HTTP server.

    ``metrics`` are the ``bench serve`` metrics (server-reported token counts, client-side times);
    ``asked_output_tokens`` is the sum of the requests' ``max_tokens``; ``load_s`` the seconds from
    process start to a healthy ``/health``.
    """

    engine: str
    metrics: BenchmarkMetrics
    asked_output_tokens: int
    load_s: float
    note: str
    errors: str = ""

    @property
    def decode_throughput(self) -> float | None:
        """Tokens/s of one request after its first token (1 / mean TPOT); None without TPOT samples."""
        tpot = self.metrics.tpot.mean_ms
        return 1000.0 / tpot if tpot else None


def warmup_request(requests: list[SampledRequest]) -> SampledRequest:
    """A short request whose prompt (the first request's first tokens, reversed) shares no cached
    prefix with the workload, so the warm-up leaves nothing in either engine's prefix cache to reuse."""
    ids = list(reversed(requests[0].prompt_token_ids[:WARMUP_PROMPT_TOKENS]))
    return SampledRequest("", ids, WARMUP_OUTPUT_TOKENS)


def run_workload(base_url: str, requests: list[SampledRequest], config: ServerCompareConfig, tokenizer: Any) -> ServeRun:
    """The warm-up request, then the timed workload, through the ``bench serve`` client at ``base_url``."""
    client_config = ClientConfig(base_url=base_url, temperature=0.0, ignore_eos=True, send_token_ids=True,
                                 timeout_s=config.timeout_s)

    async def go() -> ServeRun:
        client = make_client(client_config)
        try:
            resolved = await resolve_model(client, client_config)
            await run_serve_benchmark(client, resolved, LoadConfig(disable_tqdm=True),
                                      [Conversation((warmup_request(requests),))], tokenizer)
            load = LoadConfig(max_concurrency=config.max_concurrency, disable_tqdm=config.disable_tqdm)
            return await run_serve_benchmark(client, resolved, load, [Conversation((r,)) for r in requests], tokenizer)
        finally:
            await client.close()

    return asyncio.run(go())


def _served_run(engine: str, run: ServeRun, requests: list[SampledRequest], load_s: float, note: str) -> ServedRun:
    asked = sum(r.expected_output_len for r in requests)
    return ServedRun(engine, run.metrics, asked, load_s, note, error_summary([r.error for r in run.results]))


def run_tokenmill_server(engine_args: EngineArgs, requests: list[SampledRequest], config: ServerCompareConfig,
                         tokenizer: Any) -> ServedRun:
    """``tokenmill serve`` with ``engine_args`` (``num_threads`` set to ``config.threads``) in a spawned
    process on a free port: wait for ``/health``, run the workload, stop it.

    Raises:
        RuntimeError: the server exited or was not healthy within ``config.load_timeout_s``.
    """
    from tokenmill.cli.serve import default_served_model_name
    from tokenmill.procs import free_port, stop_processes, wait_healthy
    from tokenmill.cli.replicas import start_replica
    from tokenmill.server.state import ServerConfig

    engine_args = replace(engine_args, num_threads=config.threads)
    server = ServerConfig(served_model_name=default_served_model_name(engine_args.model), engine_args=engine_args,
                          port=free_port(), enable_log_requests=False)
    log_args = argparse.Namespace(command="bench", log_level=config.log_level, verbose=0)
    start = time.perf_counter()
    process = start_replica(server, log_args)
    try:
        def alive() -> str | None:
            return None if process.is_alive() else f"tokenmill serve exited with {process.exitcode} while loading"

        url = f"http://127.0.0.1:{server.port}"
        try:
            wait_healthy([url], alive, timeout_s=config.load_timeout_s)
        except TimeoutError:
            raise RuntimeError(f"tokenmill serve not healthy after {config.load_timeout_s:.0f} s") from None
        load_s = time.perf_counter() - start
        run = run_workload(url, requests, config, tokenizer)
    finally:
        stop_processes([process])
    note = (f"tokenmill serve --dtype {engine_args.dtype} --quantization {engine_args.quantization or 'default'} "
            f"--kv-cache-dtype {engine_args.kv_cache_dtype} --max-num-seqs {engine_args.max_num_seqs}")
    return _served_run("tokenmill", run, requests, load_s, note)


def run_llama_server(peer: ServerPeer, model_path: Any, requests: list[SampledRequest], config: ServerCompareConfig,
                     tokenizer: Any) -> tuple[ServedRun, list[str]]:
    """llama-server on ``model_path`` with ``config``'s threads and slots, each slot sized for the longest
    request (plus ``SLOT_MARGIN``); returns the run and its command line.

    Raises:
        RuntimeError: the server exited or was not healthy in time (the message carries its log).
    """
    from tokenmill.procs import free_port

    longest = max(r.prompt_len + r.expected_output_len for r in [*requests, warmup_request(requests)])
    port = free_port()
    slot_tokens = slot_context(longest + SLOT_MARGIN)
    peer_args = peer_args_for_this_cpu(config.peer_args, csrc_build.cpu_flags(), peer.binary)
    command = llama_server_command(peer.binary, model_path, config.threads, config.parallel, slot_tokens, port,
                                   peer_args)
    version = binary_version(peer.binary)
    start = time.perf_counter()
    with LlamaServerProcess(command, port) as server:
        server.start(config.load_timeout_s)
        load_s = time.perf_counter() - start
        run = run_workload(server.url, requests, config, tokenizer)
    note = (f"llama-server -t {config.threads} -np {config.parallel} -c {config.parallel * slot_tokens} "
            f"({slot_tokens} per slot){' ' + ' '.join(peer_args) if peer_args else ''}"
            f"{f'; {version}' if version else ''}")
    return _served_run(peer.name, run, requests, load_s, note), command


def compare_servers(engine_args: EngineArgs, peers: list[ServerPeer], requests: list[SampledRequest],
                    config: ServerCompareConfig, tokenizer: Any) -> tuple[list[ServedRun], dict[str, str], list[str],
                                                                          dict[str, list[str]]]:
    """Run the workload through tokenmill's server, then through each runnable peer.

    Returns the runs (tokenmill first), the skipped peers with their reasons, notes (token counts that
    differ from what was asked or between engines, failed requests) and each peer's command line.

    Raises:
        ValueError: ``requests`` is empty.
        RuntimeError: tokenmill's own server failed to start.
    """
    from tokenmill.bench.peers import model_file

    if not requests:
        raise ValueError("num_prompts: the workload is empty")
    model_path = model_file(engine_args.model)
    runs = [run_tokenmill_server(engine_args, requests, config, tokenizer)]
    skipped: dict[str, str] = {}
    commands: dict[str, list[str]] = {}
    for peer in peers:
        label = peer.name if peer.path is None else f"{peer.name}={peer.path}"
        reason = skip_reason(peer, model_path)
        if reason is not None:
            skipped[label] = reason
            continue
        try:
            run, commands[label] = run_llama_server(peer, model_path, requests, config, tokenizer)
        except RuntimeError as exc:
            skipped[label] = f"failed to start: {exc}"
            continue
        runs.append(run)
    return runs, skipped, consistency_notes(runs), commands


def consistency_notes(runs: list[ServedRun]) -> list[str]:
    """Lines about anything that makes the runs' work differ: failed requests, output tokens other than
    asked, input token totals that differ from tokenmill's."""
    notes = []
    base = runs[0].metrics.total_input_tokens
    for r in runs:
        m = r.metrics
        if m.failed:
            notes.append(f"{r.engine}: {m.failed} of {m.completed + m.failed} requests failed:\n{r.errors}")
        elif m.total_output_tokens != r.asked_output_tokens:
            notes.append(f"{r.engine}: generated {m.total_output_tokens} tokens, {r.asked_output_tokens} asked")
        if m.total_input_tokens != base and not m.failed:
            notes.append(f"{r.engine}: {m.total_input_tokens} input tokens against tokenmill's {base}")
    return notes


def server_ratios(runs: list[ServedRun]) -> dict[str, float]:
    """tokenmill / peer for output, total and per-request decode tokens/s, per peer that ran."""
    base = runs[0]
    out = {}
    for r in runs[1:]:
        if not (r.metrics.output_throughput > 0 and base.metrics.output_throughput > 0):
            continue  # an engine whose requests all failed has no ratio
        out[f"output_tok_s tokenmill/{r.engine}"] = base.metrics.output_throughput / r.metrics.output_throughput
        out[f"total_tok_s tokenmill/{r.engine}"] = base.metrics.total_token_throughput / r.metrics.total_token_throughput
        if base.decode_throughput and r.decode_throughput:
            out[f"decode_tok_s tokenmill/{r.engine}"] = base.decode_throughput / r.decode_throughput
    return out


SERVER_COLUMNS = (
    Column("engine", 14, lambda r: r.engine, align="<"),
    Column("requests", 9, lambda r: r.metrics.completed),
    Column("failed", 7, lambda r: r.metrics.failed),
    Column("input tok", 11, lambda r: r.metrics.total_input_tokens),
    Column("output tok", 12, lambda r: r.metrics.total_output_tokens),
    Column("wall s", 9, lambda r: r.metrics.duration_s, ".2f"),
    Column("req/s", 8, lambda r: r.metrics.request_throughput, ".2f"),
    Column("out tok/s", 11, lambda r: r.metrics.output_throughput, ".1f"),
    Column("tot tok/s", 11, lambda r: r.metrics.total_token_throughput, ".1f"),
    Column("TTFT ms", 9, lambda r: r.metrics.ttft.mean_ms, ".0f"),
    Column("TPOT ms", 9, lambda r: r.metrics.tpot.mean_ms, ".1f"),
    Column("decode tok/s", 14, lambda r: r.decode_throughput, ".1f"),
    Column("load s", 8, lambda r: r.load_s, ".1f"),
)


def format_server_table(runs: list[ServedRun], skipped: dict[str, str], notes: list[str]) -> str:
    """Side-by-side table (throughputs, mean TTFT/TPOT, per-request decode tok/s), the tokenmill/peer
    ratios, then one line per skipped peer and per note, then each engine's settings."""
    lines = format_rows(SERVER_COLUMNS, runs) + comparison_lines(server_ratios(runs), skipped, notes)
    lines += [f"{r.engine}: {r.note}" for r in runs]
    return "\n".join(lines)


def server_compare_record(runs: list[ServedRun], skipped: dict[str, str], notes: list[str],
                          commands: dict[str, list[str]], config: ServerCompareConfig) -> dict[str, Any]:
    """JSON-ready record of a server comparison: per engine the ``bench serve`` summary, the ratios,
    skipped peers, notes, the peers' command lines and the settings."""
    return {
        "mode": "server",
        "threads": config.threads,
        "max_concurrency": config.max_concurrency,
        "parallel": config.parallel,
        "runs": [{"engine": r.engine, "asked_output_tokens": r.asked_output_tokens, "load_s": r.load_s,
                  "note": r.note, "decode_throughput": r.decode_throughput, **r.metrics.summary()} for r in runs],
        "ratios": server_ratios(runs),
        "skipped": skipped,
        "notes": notes,
        "commands": commands,
    }
