"""ServerConfig and ServerState: what every route shares (engine, served name, metrics), plus the
plumbing between a route and the engine: submit requests, collect results while watching for
a disconnected client, and frame streams as SSE that abort on exit.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from fastapi import Request

from tokenmill.engine_args import EngineArgs
from tokenmill.lora.adapter import LoRAAdapterError
from tokenmill.lora_request import LoRARequest
from tokenmill.outputs import RequestOutput
from tokenmill.server.async_engine import (AsyncEngine, EngineDeadError, EngineRequest, QueueFullError,
                                           RequestFailedError, RequestStream)
from tokenmill.server.errors import APIError
from tokenmill.server.metrics import RequestMetricsTracker, ServerMetrics
from tokenmill.server.openai_format import SSE_DONE, sse
from tokenmill.server.request_limits import RequestLimits
from tokenmill.server.rl_gate import RLGate, ServiceUnavailable
from tokenmill.server.serving_lora import LoRAModulePath, ServedAdapters
from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.security.http import (DEFAULT_MAX_BUFFERED_BODY_BYTES, DEFAULT_MAX_REQUEST_BODY_BYTES,
                                     DEFAULT_REQUEST_BODY_TIMEOUT_S)
from tokenmill.structured_output import ConstraintError
from tokenmill.token_strings import TokenStrings
from tokenmill.tracing import RequestTracer, Tracing, trace_headers

logger = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks that its client is still there


@dataclass(frozen=True)
class ServerConfig:
    """Settings of ``tokenmill serve``.

    Args:
        engine_args: the engine options (``LLM(...)``'s; the ``tokenmill serve`` engine flags).
        served_model_name: the name clients must use in ``model``.
        api_key: when set, every route needs ``Authorization: Bearer <api_key>`` except ``/health``, the
            web page (``/``, ``/static/*``) and, with ``metrics_without_auth``, ``/metrics``.
        metrics_without_auth: serve ``/metrics`` without the API key (for scrapers).
        metrics_compat: ``"vllm"``: ``/metrics`` also exports the gateway-read series under vLLM's names
            and labels (``tokenmill.server.metrics``); None: ``tokenmill:*`` only.
        allowed_hosts: the Host header names served (``*``: any; ``*.example.com``: subdomains); None:
            on a loopback bind the loopback names and ``host``, beyond loopback any. Others get 400.
        allowed_origins, allowed_methods, allowed_headers, allow_credentials: CORS (vLLM's flags);
            no origins (the default): no CORS headers, so browsers keep other sites' pages out.
        max_request_body_bytes: the largest request body (bytes); larger ones get 413 unread.
        request_body_timeout: seconds a request's whole body may take to arrive (408 after).
        max_buffered_body_bytes: request body bytes all requests may hold at once (503 with Retry-After over).
        shutdown_timeout: seconds the requests in flight get to finish after SIGTERM/SIGINT (the server drains:
            new requests get 503, ``/ready`` 503); those still running then end with a 503 (docs/deployment.md).
        allow_special_tokens_in_content: default of the chat request field of that name: parse
            special-token strings in message contents into control tokens (off: plain text).
        enable_auto_tool_choice: accept ``tool_choice: "auto"`` (the default with tools) and parse
            tool calls out of free text with ``tool_call_parser``.
        tool_call_parser: the tool-call format; only ``hermes`` (``<tool_call>{...}</tool_call>``).
        lora_modules: adapters served from the start (``--lora-modules``; needs ``enable_lora`` in
            ``engine_args``), each reached with ``model: name``.
        allow_runtime_lora_updating: enable ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``.
        session_save_path: directory of saved sessions (``/v1/sessions/{id}/save|restore``); None: off.
        session_max_bytes: largest saved session, in bytes (None: only ``session_max_total_bytes``); 413 over it.
        session_max_total_bytes: most bytes the session directory may hold; a save past it gets 507.
        session_secret_file: a secret file (0600, >= 16 bytes); saved sessions then carry an HMAC of their
            files and a restore refuses one whose HMAC fails (None: no integrity check).
        enable_log_requests: one INFO log line per finished request (id, model or adapter, tokens,
            finish reason, latency).
        enable_rl_endpoints: serve the RL rollout routes (weight updates, pause, sleep; docs/rl.md).
        max_paused_requests: most requests held while generation is paused (more get 503 + Retry-After).
        otlp_traces_endpoint: an OTLP/HTTP receiver's URL: each engine request then makes an ``llm_request``
            span exported there (``tokenmill.tracing``, docs/tracing.md); None: no tracing, the SDK not imported.
        collect_detailed_traces: what the spans add (``model``, ``worker``; ``tokenmill.tracing.RequestTracer``).
        request_limits: how much one request may ask (stop strings, prompts, sequences, constraint size and
            compile time, queued sequences; ``tokenmill.server.request_limits``).
    """

    served_model_name: str
    engine_args: EngineArgs = field(default_factory=EngineArgs)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    shutdown_timeout: float = 30.0
    allow_special_tokens_in_content: bool = False
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    lora_modules: tuple[LoRAModulePath, ...] = ()
    allow_runtime_lora_updating: bool = False
    enable_log_requests: bool = True
    enable_rl_endpoints: bool = False
    max_paused_requests: int = 1024
    request_limits: RequestLimits = field(default_factory=RequestLimits)
    session_save_path: str | None = None
    session_max_bytes: int | None = None
    session_max_total_bytes: int = 4 * 1024**3
    session_secret_file: str | None = None
    metrics_without_auth: bool = False
    metrics_compat: str | None = None
    allowed_hosts: tuple[str, ...] | None = None
    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    request_body_timeout: float = DEFAULT_REQUEST_BODY_TIMEOUT_S
    max_buffered_body_bytes: int = DEFAULT_MAX_BUFFERED_BODY_BYTES
    otlp_traces_endpoint: str | None = None
    collect_detailed_traces: tuple[str, ...] = ()


class ServerState:
    """The engine, the metrics and the served name, shared by all routes (``app.state.server``)."""

    def __init__(self, config: ServerConfig, on_load_failure: Callable[[BaseException], None] | None = None) -> None:
        self.config = config
        self.model_name = config.served_model_name
        self.created = int(time.time())
        self.metrics = ServerMetrics(self.model_name, lambda: self.engine.stats, compat=config.metrics_compat)
        self.adapters = ServedAdapters(self.model_name, config.lora_modules,
                                       enabled=config.engine_args.enable_lora)
        self.tracing = Tracing(config.otlp_traces_endpoint, "tokenmill") if config.otlp_traces_endpoint else None
        tracker = RequestMetricsTracker(self.metrics, log_requests=config.enable_log_requests,
                                        base_model_name=self.model_name,
                                        tracer=RequestTracer(self.tracing, config.collect_detailed_traces)
                                        if self.tracing is not None else None)
        self.engine = AsyncEngine(config.engine_args, tracker, on_load_failure,
                                  on_loaded=lambda llm: self.adapters.register_static(llm.engine),
                                  max_queued_requests=config.request_limits.max_queued_requests)
        self.rl = RLGate(self.engine, config.max_paused_requests)  # pause / sleep gate, weight version
        self.draining = False  # set on SIGTERM/SIGINT: new requests get 503, /ready answers 503
        self._token_strings: TokenStrings | None = None

    # ---- facts of the loaded engine (raise 503 until it is loaded) ---------------------------
    def llm(self):
        """The loaded LLM (for its tokenizer and fixed facts), or a 503 APIError."""
        try:
            self.engine.check_healthy()
        except EngineDeadError as exc:
            raise APIError(str(exc), 503, "service_unavailable_error") from None
        return self.engine.llm

    @property
    def tokenizer(self):
        return self.llm().get_tokenizer()

    @property
    def max_model_len(self) -> int:
        return self.llm().engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.llm().engine.loaded.vocab_size

    def decode(self, token_ids: list[int]) -> str:
        """``tokenizer.decode(token_ids)``, through ``decode_batch``, which lets other Python threads
        run meanwhile (``decode`` holds the GIL). Blocking: run it in a worker thread."""
        tokenizer = self.tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        text = backend.decode_batch([token_ids], skip_special_tokens=False)[0]
        if getattr(tokenizer, "clean_up_tokenization_spaces", False):
            text = tokenizer.clean_up_tokenization(text)
        return text

    @property
    def token_strings(self) -> TokenStrings:
        """How logprobs show each token (text, or a ``bytes:`` marker for partial UTF-8)."""
        if self._token_strings is None:
            self._token_strings = TokenStrings(self.tokenizer)
        return self._token_strings

    def check_constraint(self, constraint: StructuredOutputsParams | None, param: str | None) -> None:
        """Compile an output constraint (cached for the engine) so that a bad one, one over
        ``--max-structured-output-bytes`` or one that does not compile within
        ``--structured-outputs-compile-timeout`` is a 400 naming ``param`` before the request is queued.
        Blocking: run it in a worker thread."""
        if constraint is None:
            return
        limits = self.config.request_limits
        limits.check_constraint_size(constraint, param)
        try:
            self.llm().engine.structured_output_manager.compile(constraint,
                                                                timeout=limits.structured_outputs_compile_timeout)
        except ConstraintError as exc:
            raise APIError(f"{param}: {exc.reason}", param=param) from None

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The adapter ``model`` names (None: the base model, or no ``model``); 404 naming ``model`` otherwise."""
        return self.adapters.resolve(model)

    @staticmethod
    def session_of(raw_request: Request, user: str | None) -> str | None:
        """The agent session of a request: its ``X-Session-Id`` header, else the body's ``user``, as a short
        digest (what the KV cache keys kept blocks by and /debug/kv_cache shows); None without either."""
        name = raw_request.headers.get("x-session-id") or user
        if not name:
            return None
        return hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:16]

    def check_priority(self, priority: int) -> None:
        """A request's ``priority`` is taken only under ``--scheduling-policy priority`` (as vLLM).

        Raises:
            APIError: 400 naming ``priority`` when it is not 0 and the policy is fcfs.
        """
        if priority and self.config.engine_args.scheduling_policy != "priority":
            raise APIError(f"priority {priority} needs a server started with --scheduling-policy priority "
                           "(first come, first served here)", param="priority")

    def check_queue(self) -> None:
        """Refuse at once (503, Retry-After) while the waiting queue is full, before any work on the request:
        under overload, tokenizing requests that are then refused took the CPU the accepted ones needed.

        Raises:
            ServiceUnavailable: ``--max-queued-requests`` sequences were waiting after the engine's latest step.
        """
        if self.engine.queue_looks_full():
            raise ServiceUnavailable("the server's waiting queue is full (--max-queued-requests); retry later")

    # ---- talking to the engine -----------------------------------------------------------------
    async def submit(self, requests: list[EngineRequest], prompt_param: str,
                     raw_request: Request | None = None) -> RequestStream:
        """Queue requests (all or none) once the RL gate lets them through (paused: they wait; asleep:
        503); engine rejections become 400s naming ``prompt_param``. The stream carries its weight version.
        ``raw_request``: the HTTP request, whose ``traceparent`` the requests' ``llm_request`` spans continue."""
        if self.tracing is not None and raw_request is not None:  # their llm_request spans join the client's trace
            headers = trace_headers(raw_request.headers)
            if headers is not None:
                requests = [dataclasses.replace(r, trace_headers=headers) for r in requests]
        weight_version = await self.rl.admit()
        if self.draining:  # checked after the gate: a request held while paused may be let through after SIGTERM
            raise ServiceUnavailable("the server is shutting down and takes no new requests; send it to another "
                                     "replica")
        try:
            stream = await self.engine.add(requests)
            stream.weight_version = weight_version
            return stream
        except EngineDeadError as exc:
            raise APIError(str(exc), 503, "service_unavailable_error") from None
        except QueueFullError as exc:
            raise ServiceUnavailable(str(exc)) from None
        except LoRAAdapterError as exc:  # unloaded between the name lookup and the queueing
            raise APIError(str(exc), 404, "not_found_error", param="model", code="model_not_found") from None
        except ValueError as exc:
            raise APIError(str(exc), param=prompt_param) from None

    async def collect(self, stream: RequestStream, raw_request: Request) -> dict[str, RequestOutput]:
        """The final output of every request in ``stream``; aborts them if the client disconnects."""
        finals: dict[str, RequestOutput] = {}

        async def drain() -> None:
            async for output in stream:
                if output.finished:
                    finals[output.request_id] = output

        task = asyncio.ensure_future(drain())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if done:
                    break
                if await raw_request.is_disconnected():
                    logger.info("client disconnected; aborting %s", sorted(stream.unfinished))
                    raise APIError("client disconnected", 499)
            try:
                task.result()
            except RequestFailedError as exc:  # the engine died, a step failed, or the shutdown timeout ran out
                raise APIError(str(exc), exc.status_code, exc.error_type) from None
            return finals
        finally:
            task.cancel()
            stream.close()


async def sse_stream(events: AsyncIterator[dict], stream: RequestStream) -> AsyncIterator[str]:
    """Frame chunk dicts as SSE, end with ``[DONE]``; the requests are aborted if the client leaves."""
    try:
        async for event in events:
            yield sse(event)
    except RequestFailedError as exc:  # the engine died, a step failed, or the shutdown timeout ran out
        yield sse({"error": {"message": str(exc), "type": exc.error_type, "param": None, "code": exc.status_code}})
    finally:
        stream.close()
    yield SSE_DONE
