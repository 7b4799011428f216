"""`tokenmill router --worker-urls URL...`: the OpenAI-compatible front over several workers (see
tokenmill/router/ and docs/router.md). Imports nothing heavy until the command runs."""
from __future__ import annotations

import argparse
import dataclasses

from tokenmill.cli.serve import name_list, port_number, seconds
from tokenmill.engine_args import positive_int
from tokenmill.security.http import DEFAULT_MAX_REQUEST_BODY_BYTES


def positive_seconds(text: str) -> float:
    """argparse type: a finite number of seconds > 0."""
    value = seconds(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be > 0")
    return value


def register(subparsers) -> None:
    """Add the ``router`` subcommand."""
    from tokenmill.router.policies import POLICY_NAMES

    parser = subparsers.add_parser("router", help="route OpenAI requests over several workers (tokenmill or any "
                                                  "OpenAI-compatible server)")
    parser.add_argument("--worker-urls", nargs="+", default=[], metavar="URL",
                        help="workers' base URLs, e.g. http://127.0.0.1:8001 (more can be added with POST /workers)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=port_number, default=30000)
    parser.add_argument("--policy", choices=POLICY_NAMES, default="cache_aware",
                        help="routing policy (default cache_aware, as SGLang's router); kv_aware needs tokenmill "
                             "workers publishing KV events")
    parser.add_argument("--cache-threshold", type=float, default=0.5,
                        help="cache_aware: smallest prefix-match ratio that sends a request to the matching worker")
    parser.add_argument("--balance-abs-threshold", type=int, default=32,
                        help="cache_aware: load is imbalanced when max - min running requests exceeds this ...")
    parser.add_argument("--balance-rel-threshold", type=float, default=1.0001,
                        help="... and max exceeds this times min; then the least loaded worker is chosen")
    parser.add_argument("--max-tree-size", type=int, default=2**24,
                        help="cache_aware: characters of request text remembered per worker (LRU eviction)")
    parser.add_argument("--eviction-interval", type=positive_seconds, default=60.0,
                        help="cache_aware: seconds between evictions of the prefix trees")
    parser.add_argument("--load-cap-epsilon", type=float, default=0.25,
                        help="session affinity (and kv_aware): a worker over (1 + eps) x the mean outstanding "
                             "tokens takes no request it would otherwise be bound to")
    parser.add_argument("--kv-overlap-weight", type=float, default=1.0,
                        help="kv_aware: cost of one prompt block to prefill, in blocks of decode load (Dynamo's "
                             "overlap score weight); 0 routes by load alone")
    parser.add_argument("--kv-predicted-ttl", type=float, default=10.0,
                        help="kv_aware: seconds a dispatched prompt's blocks count as held by its worker before its "
                             "KV events confirm them (so a burst sharing a new prefix stays together); 0 = events only")
    parser.add_argument("--kv-events-endpoints", nargs="+", default=[], metavar="WORKER=ENDPOINT[,REPLAY]",
                        help="kv_aware: where a worker (URL or id) publishes KV events, when the address in its "
                             "/debug/status is not reachable from here, e.g. http://10.0.0.5:8000=tcp://10.0.0.5:5557")
    parser.add_argument("--kv-events-curve-secret-key-file", default=None, metavar="PATH",
                        help="kv_aware: this router's CURVE certificate (secret half, from "
                             "zmq.auth.create_certificates; its public half goes in each worker's "
                             "curve_client_keys_dir), to subscribe to KV events published with CURVE (docs/kv_events.md)")
    parser.add_argument("--kv-events-curve-server-key-file", default=None, metavar="PATH",
                        help="kv_aware: the workers' public CURVE certificate (their curve_secret_key_file's public half)")
    parser.add_argument("--tokenizer", default=None,
                        help="kv_aware: tokenizer or model path (HF directory or GGUF) to tokenize text prompts "
                             "with; default: the model the first tokenmill worker reports")
    parser.add_argument("--pd-disaggregation", action="store_true",
                        help="prefill/decode disaggregation: each request is prefilled on a --prefill worker, which "
                             "leases its KV, then decoded on a --decode worker, which pulls it (docs/pd_disaggregation.md)")
    parser.add_argument("--prefill", nargs="+", default=[], metavar="URL",
                        help="prefill workers (tokenmill serve --kv-transfer-config '{\"kv_role\": \"kv_producer\"}')")
    parser.add_argument("--decode", nargs="+", default=[], metavar="URL",
                        help="decode workers (--kv-transfer-config '{\"kv_role\": \"kv_consumer\"}')")
    parser.add_argument("--prefill-policy", choices=POLICY_NAMES, default=None,
                        help="policy among the prefill workers (default: --policy)")
    parser.add_argument("--decode-policy", choices=POLICY_NAMES, default=None,
                        help="policy among the decode workers (default: --policy)")
    parser.add_argument("--pd-local-prefill-threshold", type=int, default=0, metavar="N",
                        help="a session's round with at most N new prompt tokens is prefilled on the decode worker "
                             "holding the session instead of a prefill worker (0: never)")
    parser.add_argument("--kv-transfer-secret-file", default=None, metavar="PATH",
                        help="--pd-disaggregation: file (mode 0600) with the cluster secret the router signs "
                             "kv_transfer_params with; the workers' kv_connector_extra_config.secret_file must hold "
                             "the same (default: $TOKENMILL_CLUSTER_SECRET, else the per-user "
                             "~/.config/tokenmill/cluster.key; docs/pd_disaggregation.md)")
    parser.add_argument("--health-check-interval-secs", "--health-check-interval", dest="health_check_interval",
                        type=positive_seconds, default=1.0,
                        help="seconds between health checks of each worker (GET /health; SGLang router's spelling)")
    parser.add_argument("--health-check-timeout-secs", dest="health_check_timeout", type=positive_seconds,
                        default=3.0,
                        help="seconds a worker's GET /health may take; past it, unless one of its streams sent "
                             "something within as long, the worker is hung: out of routing, and its requests in "
                             "flight retried or resumed elsewhere. A stopped worker is routed around within "
                             "interval + timeout")
    parser.add_argument("--stream-stall-timeout-secs", dest="stream_stall_timeout", type=seconds, default=15.0,
                        help="seconds a stream may go without an event after its first token before the router "
                             "takes its worker as failed and resumes the stream on another (0: no bound)")
    parser.add_argument("--request-timeout-secs", "--request-timeout", dest="request_timeout",
                        type=positive_seconds, default=1800.0,
                        help="longest wait in seconds for a worker's next bytes")
    parser.add_argument("--api-key", default=None,
                        help="clients' key: require 'Authorization: Bearer <key>' on every route but /health (and "
                             "/metrics with --metrics-without-auth), and on /workers too when --admin-api-key is not set; never "
                             "sent to the workers")
    parser.add_argument("--admin-api-key", default=None,
                        help="key for worker administration (GET/POST /workers, DELETE /workers/ID); required when "
                             "--host is not loopback; without it --api-key also guards /workers (with neither, on loopback, /workers "
                             "takes no key)")
    parser.add_argument("--worker-api-key", default=None,
                        help="the router's credential for its workers, sent as 'Authorization: Bearer <key>' (start "
                             "the workers with --api-key <key>); a worker registered through POST /workers gets it only when "
                             "--admin-api-key or --allowed-worker-urls is set; default $TOKENMILL_WORKER_API_KEY, "
                             "else none")
    parser.add_argument("--allowed-worker-urls", nargs="+", default=None, metavar="PATTERN",
                        help="URLs POST /workers may register: globs (* within one host label) or prefixes, e.g. "
                             "'http://10.0.0.*' 'https://*.workers.internal:8000'; --worker-urls/--prefill/--decode "
                             "are allowed implicitly (default: any URL)")
    parser.add_argument("--allowed-hosts", nargs="+", action="extend", type=name_list, default=None, metavar="HOST",
                        help="Host header names served, port ignored ('*' any, '*.example.com' subdomains; "
                             "localhost, 127.0.0.1, ::1 and --host always); others get 400, which stops DNS "
                             "rebinding. Default: those only when --host is loopback, any host otherwise")
    parser.add_argument("--max-request-body-bytes", type=positive_int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                        metavar="BYTES",
                        help=f"largest request body in bytes; larger ones get 413 (default {DEFAULT_MAX_REQUEST_BODY_BYTES})")
    parser.add_argument("--metrics-without-auth", action="store_true",
                        help="serve /metrics without --api-key (for a Prometheus scraper without the key)")
    parser.add_argument("--seed", type=int, default=None, help="seed of power_of_two's random choices")
    parser.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                        help="OpenTelemetry tracing: one 'router_request' span per generation request, child of the "
                             "client's W3C traceparent, exported to this OTLP/HTTP receiver (e.g. "
                             "http://127.0.0.1:4318/v1/traces); the workers (prefill ones too) get its traceparent. "
                             "Default off: the client's traceparent is passed on as it came (docs/tracing.md)")
    parser.set_defaults(func=cmd_router)


def parse_kv_events_endpoints(items: list[str]) -> dict[str, tuple[str, str | None]]:
    """``WORKER=ENDPOINT[,REPLAY]`` items -> {worker: (endpoint, replay endpoint or None)}.

    Raises:
        ValueError: an item without ``=`` or an endpoint, naming the flag.
    """
    out: dict[str, tuple[str, str | None]] = {}
    for item in items:
        worker, sep, endpoints = item.rpartition("=")
        parts = endpoints.split(",")
        if not sep or not worker or not parts[0] or len(parts) > 2:
            raise ValueError(f"--kv-events-endpoints: expected WORKER=ENDPOINT[,REPLAY], got {item!r}")
        out[worker.rstrip("/")] = (parts[0], parts[1] if len(parts) == 2 and parts[1] else None)
    return out


def cmd_router(args: argparse.Namespace) -> int:
    """Run the router until SIGINT/SIGTERM; returns the exit code (bad settings raise ValueError: exit 2)."""
    from tokenmill import envs
    from tokenmill.router.app import RouterConfig, run_router
    from tokenmill.router.policies import PolicyConfig
    from tokenmill.tracing import otlp_traces_endpoint

    policy = PolicyConfig(name=args.policy, cache_threshold=args.cache_threshold,
                          balance_abs_threshold=args.balance_abs_threshold,
                          balance_rel_threshold=args.balance_rel_threshold, max_tree_size=args.max_tree_size,
                          eviction_interval=args.eviction_interval, load_cap_epsilon=args.load_cap_epsilon,
                          seed=args.seed, kv_overlap_weight=args.kv_overlap_weight, kv_predicted_ttl=args.kv_predicted_ttl,
                          kv_events_endpoints=parse_kv_events_endpoints(args.kv_events_endpoints) or None,
                          kv_events_curve_secret_key_file=args.kv_events_curve_secret_key_file,
                          kv_events_curve_server_key_file=args.kv_events_curve_server_key_file)
    worker_urls, prefill_urls, prefill_policy = tuple(args.worker_urls), (), None
    if args.pd_disaggregation:
        if not args.prefill or not args.decode:
            raise ValueError("--pd-disaggregation needs --prefill URL... and --decode URL...")
        if args.worker_urls:
            raise ValueError("--pd-disaggregation takes --prefill and --decode instead of --worker-urls")
        worker_urls, prefill_urls = tuple(args.decode), tuple(args.prefill)
        prefill_policy = dataclasses.replace(policy, name=args.prefill_policy or args.policy)
        policy = dataclasses.replace(policy, name=args.decode_policy or args.policy)
    elif args.prefill or args.decode:
        raise ValueError("--prefill and --decode need --pd-disaggregation")
    if args.pd_local_prefill_threshold < 0:
        raise ValueError(f"--pd-local-prefill-threshold must be >= 0, got {args.pd_local_prefill_threshold}")
    config = RouterConfig(worker_urls=worker_urls, policy=policy, host=args.host, port=args.port,
                          api_key=args.api_key, health_check_interval=args.health_check_interval,
                          health_check_timeout=args.health_check_timeout,
                          stream_stall_timeout=args.stream_stall_timeout or None,
                          request_timeout=args.request_timeout, tokenizer=args.tokenizer, prefill_urls=prefill_urls,
                          prefill_policy=prefill_policy, pd_local_prefill_threshold=args.pd_local_prefill_threshold,
                          kv_transfer_secret_file=args.kv_transfer_secret_file,
                          admin_api_key=args.admin_api_key, worker_api_key=args.worker_api_key or envs.worker_api_key(),
                          allowed_worker_urls=tuple(args.allowed_worker_urls) if args.allowed_worker_urls else None,
                          allowed_hosts=None if args.allowed_hosts is None else tuple(
                              h for group in args.allowed_hosts for h in group),
                          max_request_body_bytes=args.max_request_body_bytes,
                          metrics_without_auth=args.metrics_without_auth,
                          otlp_traces_endpoint=otlp_traces_endpoint(args.otlp_traces_endpoint)
                          if args.otlp_traces_endpoint else None)
    return run_router(config)
