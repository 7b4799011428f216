"""`tokenmill bench {serve,offline,compare}`: argument parsing and printing; the work is in tokenmill/bench/."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import sys
from pathlib import Path

from tokenmill.bench.workload import add_dataset_args, build_workload, dataset_config, load_tokenizer
from tokenmill.cli.main import engine_kwargs
from tokenmill.engine_args import EngineArgs

logger = logging.getLogger(__name__)

# ``--endpoint`` spellings (ours, and vLLM's API paths) -> endpoint; vLLM's ``--backend`` -> endpoint.
ENDPOINT_SPELLINGS = {"completions": "completions", "chat": "chat",
                      "/v1/completions": "completions", "/v1/chat/completions": "chat"}
BACKEND_ENDPOINTS = {"openai": "completions", "vllm": "completions", "openai-chat": "chat"}


def register(subparsers) -> None:
    """Add ``bench`` with its ``serve``, ``offline`` and ``compare`` subcommands."""
    bench = subparsers.add_parser("bench", help="benchmark a server (serve) or the engine in-process (offline, compare)")
    sub = bench.add_subparsers(dest="bench_command", required=True)

    serve = sub.add_parser("serve", help="load-test an OpenAI-compatible server (streaming)")
    serve.add_argument("--base-url", default=None,
                       help="server root, with or without /v1 (default: http://HOST:PORT)")
    serve.add_argument("--host", default="127.0.0.1", help="server host when --base-url is not given")
    serve.add_argument("--port", type=int, default=8000, help="server port when --base-url is not given")
    serve.add_argument("--endpoint", choices=sorted(ENDPOINT_SPELLINGS), default="completions",
                       help="completions or chat; vLLM's paths /v1/completions and /v1/chat/completions too")
    serve.add_argument("--backend", choices=sorted(BACKEND_ENDPOINTS), default=None,
                       help="vLLM spelling: openai / vllm (completions) or openai-chat (chat); overrides --endpoint")
    serve.add_argument("--model", "--served-model-name", dest="model", default=None,
                       help="served model name (default: first of /v1/models)")
    serve.add_argument("--tokenizer", default=None,
                       help="local tokenizer (model dir or .gguf) for sampling and counting (default: embedded SmolLM2)")
    serve.add_argument("--api-key", default=None, help="bearer key (default: $OPENAI_API_KEY)")
    add_dataset_args(serve)
    serve.add_argument("--request-rate", type=float, default=math.inf, help="requests/s, Poisson arrivals (default inf)")
    serve.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    serve.add_argument("--concurrency", default=None,
                       help="sweep: comma-separated max-concurrency levels, e.g. 1,4,16,64 (one run each)")
    serve.add_argument("--num-warmups", type=int, default=0, help="untimed requests sent first")
    serve.add_argument("--temperature", type=float, default=0.0)
    serve.add_argument("--top-p", type=float, default=None, help="sent with every request (default: the server's)")
    serve.add_argument("--top-k", type=int, default=None, help="sent with every request (default: the server's)")
    serve.add_argument("--min-p", type=float, default=None, help="sent with every request (default: the server's)")
    serve.add_argument("--ignore-eos", action="store_true", help="ask the server for exactly max_tokens tokens")
    serve.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    serve.add_argument("--save-result", action="store_true", help="write the result JSON")
    serve.add_argument("--result-file", type=Path, default=None, help="result JSON path (implies --save-result)")
    serve.add_argument("--result-dir", type=Path, default=None,
                       help="directory of the result JSON (implies --save-result; default: the working directory)")
    serve.add_argument("--result-filename", default=None,
                       help="file name of the result JSON in --result-dir (implies --save-result; default: "
                            "tokenmill-bench-{dataset}-{endpoint}-c{N}-{date}.json)")
    serve.add_argument("--plot", nargs="?", const="", default=None, metavar="PNG",
                       help="write latency histograms (sweep: throughput vs latency) to PNG (default: next to the JSON)")
    serve.add_argument("--disable-tqdm", action="store_true")
    serve.set_defaults(func=cmd_bench_serve)

    offline = sub.add_parser("offline", help="the engine in-process, no HTTP: throughput, TTFT, TPOT")
    EngineArgs.add_cli_args(offline)
    add_dataset_args(offline, with_seed=False)
    offline.add_argument("--result-file", type=Path, default=None, help="write the result JSON here")
    offline.add_argument("--disable-tqdm", action="store_true")
    offline.set_defaults(func=cmd_bench_offline)

    compare = sub.add_parser("compare", help="the same workload on tokenmill and peers: in-process (--peers) or "
                                              "over HTTP against native servers (--peer llama-server)")
    EngineArgs.add_cli_args(compare)
    add_dataset_args(compare, with_seed=False)
    compare.add_argument("--peers", default=None,
                         help="in-process peers, comma-separated (transformers, llama_cpp) or 'none' (default: both; "
                              "none with --peer); absent ones are skipped")
    compare.add_argument("--peer-batch-size", type=int, default=32, help="transformers generate batch size")
    compare.add_argument("--peer", dest="server_peers", action="append", default=[], metavar="NAME[=PATH]",
                         help="a native server peer (repeatable): llama-server (this CPU's build from "
                              "scripts/build_llama_server.sh) or llama-server=PATH; tokenmill then runs as its own "
                              "server and the same workload goes through both over HTTP")
    compare.add_argument("--max-concurrency", type=int, default=None,
                         help="with --peer: most requests in flight (default: all at once)")
    compare.add_argument("--peer-parallel", type=int, default=None,
                         help="with --peer: llama-server slots, -np (default: --max-concurrency, else the number of "
                              "requests, at most --max-num-seqs)")
    compare.add_argument("--peer-args", default="",
                         help="with --peer: extra llama-server arguments in one string, e.g. --peer-args='-ub 256'")
    compare.add_argument("--timeout", type=float, default=3600.0, help="with --peer: per-request timeout in seconds")
    compare.add_argument("--disable-tqdm", action="store_true")
    compare.add_argument("--result-file", type=Path, default=None, help="write the comparison JSON here")
    compare.set_defaults(func=cmd_bench_compare)


def _concurrency_levels(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"concurrency must be comma-separated integers, got {text!r}") from None
    if not levels or min(levels) < 1:
        raise ValueError(f"concurrency levels must be >= 1, got {text!r}")
    return levels


def serve_endpoint(args: argparse.Namespace) -> str:
    """``completions`` or ``chat``, from ``--backend`` (vLLM's names; it wins) or ``--endpoint``."""
    return BACKEND_ENDPOINTS[args.backend] if args.backend else ENDPOINT_SPELLINGS[args.endpoint]


def serve_result_file(args: argparse.Namespace) -> Path | None:
    """The result JSON path of ``bench serve``: ``--result-file``, or ``--result-dir`` / ``--result-filename``
    as in vLLM (a missing half: the working directory, or the default name); None when none is given.

    Raises:
        ValueError: ``--result-file`` given together with ``--result-dir`` or ``--result-filename``.
    """
    if args.result_dir is None and args.result_filename is None:
        return args.result_file
    if args.result_file is not None:
        raise ValueError("result_file: give either --result-file or --result-dir/--result-filename, not both")
    from tokenmill.bench.results import default_result_path

    endpoint = serve_endpoint(args)
    sweep = args.concurrency is not None
    name = args.result_filename or default_result_path(
        args.dataset_name, endpoint, None if sweep else args.max_concurrency, "-sweep" if sweep else "").name
    return (args.result_dir or Path(".")) / name


def cmd_bench_serve(args: argparse.Namespace) -> int:
    """Run ``bench serve`` (one run, or a concurrency sweep); returns the exit code."""
    from tokenmill.bench.serve_client import ClientConfig
    from tokenmill.bench.serve_bench import LoadConfig

    levels = _concurrency_levels(args.concurrency)
    args.result_file = serve_result_file(args)
    endpoint = serve_endpoint(args)
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    for noisy in ("httpx2", "httpx", "matplotlib"):  # one INFO line per HTTP request drowns the progress bar
        logging.getLogger(noisy).setLevel(logging.WARNING)
    client_config = ClientConfig(base_url=base_url, model=args.model, endpoint=endpoint,
                                 temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                 min_p=args.min_p, ignore_eos=args.ignore_eos, api_key=args.api_key,
                                 timeout_s=args.timeout)
    load = LoadConfig(request_rate=args.request_rate, max_concurrency=args.max_concurrency,
                      num_warmups=args.num_warmups, seed=args.seed, disable_tqdm=args.disable_tqdm)
    dataset = dataset_config(args)
    if dataset.name == "multi-turn" and endpoint != "chat":
        raise ValueError("endpoint: the multi-turn dataset needs --endpoint chat")
    tokenizer = load_tokenizer(args.tokenizer)
    workload = build_workload(dataset, tokenizer)
    from tokenmill.bench.serve_report import run_and_report

    return asyncio.run(run_and_report(client_config, load, dataset, workload, tokenizer, args, levels))


def cmd_bench_offline(args: argparse.Namespace) -> int:
    """Run the workload through an in-process LLM and print the result block; returns the exit code."""
    from tokenmill.bench.metrics import format_result_block, per_request_arrays
    from tokenmill.bench.offline import run_offline
    from tokenmill.engine.llm import LLM

    dataset = dataset_config(args)
    llm = LLM(**engine_kwargs(args))
    workload = build_workload(dataset, llm.get_tokenizer())
    run = run_offline(llm, workload, use_tqdm=not args.disable_tqdm)
    print(format_result_block(run.metrics, "Offline Benchmark Result", latencies=("ttft", "tpot", "e2el")))
    print("(offline: all requests of a round queued at once; TTFT includes queueing; no per-token ITL)")
    _write_result(args, dataset, {**run.metrics.summary(), **per_request_arrays(run.results)})
    return 0


def server_compare_config(args: argparse.Namespace, num_requests: int):
    """The ``ServerCompareConfig`` of ``bench compare --peer``: every engine on ``--num-threads`` (default:
    the CPUs this process may use), llama-server's slots from ``--peer-parallel`` or the concurrency.

    Raises:
        ValueError: naming the flag, for values out of range.
    """
    import shlex

    from tokenmill.bench.server_compare import ServerCompareConfig
    from tokenmill.runner.cpu_threads import available_cpus

    if args.peer_parallel is not None and args.peer_parallel < 1:
        raise ValueError(f"peer_parallel must be >= 1, got {args.peer_parallel}")
    parallel = args.peer_parallel or min(args.max_concurrency or num_requests, num_requests, args.max_num_seqs)
    return ServerCompareConfig(threads=args.num_threads or available_cpus(), max_concurrency=args.max_concurrency,
                               parallel=parallel, peer_args=tuple(shlex.split(args.peer_args)), timeout_s=args.timeout,
                               log_level=args.log_level or "WARNING", disable_tqdm=args.disable_tqdm)


def _check_compare_mode(args: argparse.Namespace) -> None:
    """``--peers`` (in-process) and ``--peer`` (servers) are two modes; the server-only flags need ``--peer``.

    Raises:
        ValueError: naming the flag.
    """
    if args.server_peers and args.peers not in (None, "", "none"):
        raise ValueError("peers: --peers (in-process, tokenmill offline) and --peer (native servers, tokenmill "
                         "serve) are separate comparisons; run them one at a time")
    if not args.server_peers:
        for flag, value in (("max_concurrency", args.max_concurrency), ("peer_parallel", args.peer_parallel),
                            ("peer_args", args.peer_args or None)):
            if value is not None:
                raise ValueError(f"{flag}: only with --peer (a server comparison)")


def cmd_bench_compare(args: argparse.Namespace) -> int:
    """Run tokenmill and the peers on one single-turn workload and print the table; returns the exit code."""
    from tokenmill.bench.compare import compare_engines, compare_record, format_compare_table

    dataset = dataset_config(args)
    if dataset.name == "multi-turn":
        raise ValueError("dataset_name: compare runs single-turn datasets only")
    _check_compare_mode(args)
    if args.server_peers:
        return _cmd_compare_servers(args, dataset)
    from tokenmill.engine.llm import LLM

    peers_text = "transformers,llama_cpp" if args.peers is None else args.peers
    peers = [] if peers_text in ("", "none") else [p.strip() for p in peers_text.split(",") if p.strip()]
    tokenizer = load_tokenizer(args.model)
    requests = [c.turns[0] for c in build_workload(dataset, tokenizer)]
    runs, skipped, notes = compare_engines(lambda: LLM(**engine_kwargs(args)), args.model, requests, peers,
                                           args.peer_batch_size, args.num_threads)
    print(format_compare_table(runs, skipped, notes))
    _write_result(args, dataset, compare_record(runs, skipped, notes))
    return 0


def _cmd_compare_servers(args: argparse.Namespace, dataset) -> int:
    """``bench compare --peer ...``: tokenmill's server and each native peer server on one workload."""
    from tokenmill.bench.llama_server import parse_peer
    from tokenmill.bench.server_compare import compare_servers, format_server_table, server_compare_record

    peers = [parse_peer(text) for text in args.server_peers]
    for noisy in ("httpx2", "httpx"):  # one INFO line per HTTP request (health polls included)
        logging.getLogger(noisy).setLevel(logging.WARNING)
    tokenizer = load_tokenizer(args.model)
    requests = [c.turns[0] for c in build_workload(dataset, tokenizer)]
    config = server_compare_config(args, len(requests))
    runs, skipped, notes, commands = compare_servers(EngineArgs.from_cli_args(args), peers, requests, config, tokenizer)
    print(format_server_table(runs, skipped, notes))
    _write_result(args, dataset, server_compare_record(runs, skipped, notes, commands, config))
    return 0


def _write_result(args: argparse.Namespace, dataset, fields: dict) -> None:
    """Write ``--result-file`` (if given): the dataset and engine settings plus ``fields``, as JSON."""
    if args.result_file is None:
        return
    record = {"dataset_name": dataset.name, "num_prompts": dataset.num_prompts, "engine_args": engine_kwargs(args),
              **fields}
    args.result_file.parent.mkdir(parents=True, exist_ok=True)
    args.result_file.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.result_file}")


if __name__ == "__main__":
    from tokenmill.cli.main import main

    sys.exit(main(["bench", *sys.argv[1:]]))
