"""`tokenmill serve [MODEL]`: the OpenAI-compatible HTTP server (see tokenmill/server/)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenmill.engine_args import EngineArgs, positive_float, positive_int
from tokenmill.startup_gc import resume_after_startup
from tokenmill.security.http import (DEFAULT_MAX_BUFFERED_BODY_BYTES, DEFAULT_MAX_REQUEST_BODY_BYTES,
                                     DEFAULT_REQUEST_BODY_TIMEOUT_S)


def port_number(text: str) -> int:
    """argparse type for --port: an integer in [0, 65535] (0: any free port)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535], got {value}")
    return value


def seconds(text: str) -> float:
    """argparse type for a duration: a finite number of seconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text}")
    return value


def lora_module(text: str):
    """argparse type for --lora-modules: ``name=path`` or ``{"name", "path", "base_model_name"}``."""
    from tokenmill.lora_request import parse_lora_module

    try:
        return parse_lora_module(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def register(subparsers) -> None:
    """Add the ``serve`` subcommand (all engine flags plus the server's own)."""
    from tokenmill.router.policies import POLICY_NAMES

    parser = subparsers.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    EngineArgs.add_cli_args(parser)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=port_number, default=8000)
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer <key>' on every route except /health and the web page "
                             "(/, /static/*; its API calls send the key)")
    parser.add_argument("--metrics-without-auth", action="store_true",
                        help="with --api-key: serve /metrics without the key (for Prometheus scrapers)")
    parser.add_argument("--metrics-compat", choices=["vllm"], default=None,
                        help="vllm: /metrics also exports, beside tokenmill:*, the series inference gateways and "
                             "vLLM dashboards read under vLLM's names and labels (vllm:num_requests_waiting, "
                             "vllm:kv_cache_usage_perc, vllm:lora_requests_info, TTFT/ITL/e2e histograms; "
                             "docs/metrics.md)")
    parser.add_argument("--allowed-hosts", nargs="+", action=ExtendNames, type=name_list, default=None,
                        metavar="HOST",
                        help="Host header names served, port ignored ('*' any, '*.example.com' subdomains; "
                             "localhost, 127.0.0.1, ::1 and --host always); others get 400, which stops DNS "
                             "rebinding. Default: those only when --host is loopback, any host otherwise")
    parser.add_argument("--allowed-origins", nargs="+", action=ExtendNames, type=name_list, default=[],
                        metavar="ORIGIN",
                        help="CORS: origins whose pages may call the API from a browser, e.g. "
                             "https://app.example.com, or '*' (default: none, no CORS headers)")
    parser.add_argument("--allowed-methods", nargs="+", action=ExtendNames, type=name_list, default=None,
                        metavar="METHOD", help="CORS: methods allowed to those origins (default: *)")
    parser.add_argument("--allowed-headers", nargs="+", action=ExtendNames, type=name_list, default=None,
                        metavar="HEADER", help="CORS: request headers allowed to those origins (default: *)")
    parser.add_argument("--allow-credentials", action="store_true",
                        help="CORS: let those origins send cookies and HTTP authentication (default off)")
    parser.add_argument("--max-request-body-bytes", type=positive_int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                        metavar="BYTES", help="largest request body; larger ones get 413 before they are read, "
                                              "chunked ones when they pass it (default: 16 MiB)")
    parser.add_argument("--request-body-timeout", type=positive_float, default=DEFAULT_REQUEST_BODY_TIMEOUT_S,
                        metavar="SECONDS", help="seconds a request body may take to arrive whole; slower ones "
                                                "get 408 (default: 60)")
    parser.add_argument("--max-buffered-body-bytes", type=positive_int, default=DEFAULT_MAX_BUFFERED_BODY_BYTES,
                        metavar="BYTES", help="request body bytes all requests may hold at once; a request over "
                                              "it gets 503 with Retry-After (default: 256 MiB)")
    parser.add_argument("--served-model-name", default=None,
                        help="model name clients use (default: the model path, or the embedded model's name)")
    parser.add_argument("--shutdown-timeout", "--timeout-graceful-shutdown", dest="shutdown_timeout", type=seconds,
                        default=30.0, metavar="SECONDS",
                        help="on SIGTERM/SIGINT the server drains: new requests get 503 and /ready 503, the requests in "
                             "flight get this long to finish (then they end with a 503 error), the disk KV tier is "
                             "flushed, and it exits 0 (default 30; --timeout-graceful-shutdown is the older name)")
    parser.add_argument("--allow-special-tokens-in-content", action="store_true",
                        help="parse special-token strings in chat message contents into control tokens (default: "
                             "plain text, so a message cannot forge a turn); requests may override it")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='accept tool_choice "auto" and parse tool calls out of the output (needs --tool-call-parser)')
    parser.add_argument("--tool-call-parser", default=None, choices=["hermes"],
                        help="tool-call format of the model: hermes (<tool_call>{json}</tool_call>, ChatML models)")
    parser.add_argument("--lora-modules", nargs="+", action="extend", default=[], type=lora_module,
                        metavar="NAME=PATH",
                        help='LoRA adapters served as model NAME (needs --enable-lora): name=path, or JSON '
                             '\'{"name": ..., "path": ..., "base_model_name": ...}\'; repeatable')
    parser.add_argument("--allow-runtime-lora-updating", action="store_true",
                        help="enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter")
    parser.add_argument("--session-save-path", default=None, metavar="DIR",
                        help="enable POST /v1/sessions/{id}/save and /restore (and DELETE): saved sessions' KV "
                             "blocks are files under DIR (docs/sessions.md)")
    parser.add_argument("--session-max-bytes", type=positive_int, default=None, metavar="BYTES",
                        help="largest saved session in bytes; a bigger save gets 413 (default: only "
                             "--session-max-total-bytes)")
    parser.add_argument("--session-max-total-bytes", type=positive_int, default=4 * 1024**3, metavar="BYTES",
                        help="most bytes --session-save-path may hold; a save past it gets 507 (default 4 GiB)")
    parser.add_argument("--session-secret-file", default=None, metavar="PATH",
                        help="a secret file (mode 0600, >= 16 bytes; e.g. the cluster key file): each saved session "
                             "carries an HMAC of its files and a restore refuses a changed or planted one")
    parser.add_argument("--enable-rl-endpoints", action="store_true",
                        help="enable the RL rollout routes: /update_weights_from_disk, /pause_generation, /sleep, "
                             "/wake_up, /weight_info, ... (docs/rl.md)")
    parser.add_argument("--max-paused-requests", type=positive_int, default=1024, metavar="N",
                        help="with --enable-rl-endpoints: most requests held while generation is paused (more get "
                             "503 with Retry-After)")
    parser.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction, default=True,
                        help="one INFO log line per finished request (default on)")
    parser.add_argument("--disable-log-requests", dest="enable_log_requests", action="store_false",
                        help="same as --no-enable-log-requests")
    parser.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                        help="OpenTelemetry tracing: export one 'llm_request' span per request (GenAI attributes: "
                             "model, sampling parameters, token usage, queue time, TTFT, e2e), child of the "
                             "request's W3C traceparent, to this OTLP/HTTP receiver, e.g. "
                             "http://127.0.0.1:4318/v1/traces (no path: /v1/traces); default off (docs/tracing.md)")
    parser.add_argument("--collect-detailed-traces", nargs="+", action=ExtendNames, type=name_list, default=None,
                        metavar="MODULES",
                        help="with --otlp-traces-endpoint, more per span: 'model' the model-phase latencies "
                             "(prefill, decode, inference), 'worker' the engine steps' summed time and count and "
                             "scheduled / first_token events, 'all' both; comma-separated (docs/tracing.md)")
    parser.add_argument("--data-parallel-size", type=positive_int, default=1, metavar="N",
                        help="serve N engine replicas behind a router on --port (threads divided between them)")
    parser.add_argument("--data-parallel-size-local", type=positive_int, default=None, metavar="L",
                        help="with --distributed-executor-backend ray: L replicas on each of N / L Ray nodes (1: "
                             "one per node; a STRICT_SPREAD placement group; default: wherever Ray places them)")
    parser.add_argument("--distributed-executor-backend", choices=["mp", "ray"], default="mp",
                        help="replicas as local processes (mp) or Ray actors (ray: pip install tokenmill[ray])")
    parser.add_argument("--ray-address", default=None,
                        help="ray backend: the cluster to join, HEAD:PORT of its `ray start --head` (default: a new "
                             "one-node Ray instance on this machine, stopped at exit)")
    parser.add_argument("--policy", default="cache_aware", choices=POLICY_NAMES,
                        help="routing policy of the data-parallel router (see tokenmill router)")
    from tokenmill.server.request_limits import RequestLimits

    RequestLimits.add_cli_args(parser)  # --max-stop-strings ... --max-queued-requests
    parser.set_defaults(func=cmd_serve, builds_engine=True)


def name_list(text: str) -> list[str]:
    """argparse type for a list flag: one name, comma-separated names, or a JSON list (vLLM's spelling)."""
    if text.lstrip().startswith("["):
        try:
            values = json.loads(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"not a JSON list: {exc}") from None
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            raise argparse.ArgumentTypeError(f"must be a JSON list of strings, got {text!r}")
    else:
        values = text.split(",")
    values = [v.strip() for v in values if v.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"must name at least one value, got {text!r}")
    return values


class ExtendNames(argparse.Action):
    """``nargs="+"`` of ``name_list`` values: each occurrence adds its names to one flat list."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        names = list(getattr(namespace, self.dest, None) or [])
        setattr(namespace, self.dest, names + [name for group in values for name in group])




def default_served_model_name(model: str | None) -> str:
    """The model argument as given; for the embedded model, its file name without extensions."""
    if model is not None:
        return model
    from tokenmill.models.default_model import default_model_path

    return Path(default_model_path()).name.split(".")[0]


def check_engine_args(engine_args: EngineArgs) -> None:
    """Validate engine settings without loading the model: ranges, the device, deterministic mode.

    Raises:
        ValueError: naming the setting at fault.
    """
    from tokenmill.runner.device import resolve_device

    config = engine_args.create_engine_config()
    device = resolve_device(config.device)
    if config.deterministic:
        import torch

        from tokenmill.runner.deterministic import check_deterministic_supported

        check_deterministic_supported(torch.bfloat16, device)


def cmd_serve(args: argparse.Namespace) -> int:
    """Run the server until SIGINT/SIGTERM; returns the exit code."""
    from tokenmill.server.api_server import run_server
    from tokenmill.server.request_limits import RequestLimits
    from tokenmill.server.state import ServerConfig
    from tokenmill.tracing import detailed_trace_modules, otlp_traces_endpoint

    endpoint = otlp_traces_endpoint(args.otlp_traces_endpoint) if args.otlp_traces_endpoint else None
    if args.collect_detailed_traces and endpoint is None:
        raise ValueError("--collect-detailed-traces needs --otlp-traces-endpoint")
    engine_args = EngineArgs.from_cli_args(args)
    check_engine_args(engine_args)  # bad flags: a one-line error before the port is bound
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes)")
    if (args.lora_modules or args.allow_runtime_lora_updating) and not args.enable_lora:
        flag = "--lora-modules" if args.lora_modules else "--allow-runtime-lora-updating"
        raise ValueError(f"{flag} needs --enable-lora")

    config = ServerConfig(
        served_model_name=args.served_model_name or default_served_model_name(args.model),
        engine_args=engine_args,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        shutdown_timeout=args.shutdown_timeout,
        allow_special_tokens_in_content=args.allow_special_tokens_in_content,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        lora_modules=tuple(args.lora_modules),
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
        enable_log_requests=args.enable_log_requests,
        session_save_path=args.session_save_path,
        session_max_bytes=args.session_max_bytes,
        session_max_total_bytes=args.session_max_total_bytes,
        session_secret_file=args.session_secret_file,
        enable_rl_endpoints=args.enable_rl_endpoints,
        max_paused_requests=args.max_paused_requests,
        request_limits=RequestLimits.from_cli_args(args),
        metrics_without_auth=args.metrics_without_auth,
        metrics_compat=args.metrics_compat,
        allowed_hosts=None if args.allowed_hosts is None else tuple(args.allowed_hosts),
        allowed_origins=tuple(args.allowed_origins),
        allowed_methods=tuple(args.allowed_methods or ["*"]),
        allowed_headers=tuple(args.allowed_headers or ["*"]),
        allow_credentials=args.allow_credentials,
        max_request_body_bytes=args.max_request_body_bytes,
        request_body_timeout=args.request_body_timeout,
        max_buffered_body_bytes=args.max_buffered_body_bytes,
        otlp_traces_endpoint=endpoint,
        collect_detailed_traces=detailed_trace_modules(args.collect_detailed_traces or ()),
    )
    if args.data_parallel_size > 1:
        from tokenmill.cli.replicas import run_data_parallel

        resume_after_startup()  # the replicas load the engines, in their own processes
        return run_data_parallel(config, args)
    return run_server(config)
