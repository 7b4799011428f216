"""The router's FastAPI app: OpenAI routes forwarded to workers, worker management, health and metrics.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streamed or not), ``GET /v1/models``
(the union of the healthy workers' models), ``GET/POST /workers``, ``DELETE /workers/{id}``,
``POST /workers/{id}/drain`` and ``/undrain``,
``GET /health`` (200 while a worker is healthy) and ``GET /metrics``. Every request first passes
the guard of router/access.py: Host check, ``--api-key`` on every route but ``/health``,
``--admin-api-key`` on ``/workers``, JSON bodies only, a body cap. Workers get the router's own
``--worker-api-key``, never the client's key, and never a client's ``kv_transfer_params``. The router
reads of a request body only what routing needs (prompt text, token budget, session); everything else
is the worker's to validate.
Never imports torch, transformers or the engine: a router starts in about a second.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import signal
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import httpx2 as httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill.openapi_errors import document_error_responses
from tokenmill.router.access import guarded
from tokenmill.router.metrics import RouterMetrics
from tokenmill.router.policies import PolicyConfig, make_policy
from tokenmill.router.policy import RouteRequest
from tokenmill.router.proxy import WORKER_HEADER, PromptIds, Proxy, openai_error
from tokenmill.router.upstream import upstream_session
from tokenmill.router.tokenize import RequestTokenizer
from tokenmill.router.workers import (HEALTH_CHECK_INTERVAL_S, HEALTH_CHECK_TIMEOUT_S, HEALTH_TIMEOUT_S,
                                      DuplicateWorker, WorkerRegistry, WorkerURLPolicy, normalize_url)
from tokenmill.security.http import (DEFAULT_MAX_REQUEST_BODY_BYTES, allowed_hosts_for, allowed_methods,
                                     is_loopback)
from tokenmill.tracing import ROUTER_REQUEST_SPAN, TRACE_SCOPE_KEY, SpanAttributes, Tracing, trace_headers

logger = logging.getLogger(__name__)

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CHAT_MAX_TOKENS_ESTIMATE = 256  # chat without a budget may run to max_model_len; count this much
# Request bodies up to this size are tokenized on the event loop (kv_aware): encoding a few thousand
# characters takes well under a millisecond, less than the hop to a worker thread and back.
INLINE_TOKENIZE_BYTES = 8192
# A session id (``user``, OpenAI's end-user id, or ``X-Session-Id``) and a ``cache_salt`` the router keeps
# or hashes: longer ones are refused (400) so that no client can make the router hold or hash megabytes per
# request (``tokenmill serve`` refuses the same salts).
MAX_SESSION_ID_LENGTH = 256
MAX_CACHE_SALT_LENGTH = 1024


@dataclass(frozen=True)
class RouterConfig:
    """The router's settings (the flags of ``tokenmill router``). ``tokenizer``: the path ``kv_aware``
    tokenizes text prompts with (None: the model the first tokenmill worker reports).

    Prefill/decode disaggregation (``--pd-disaggregation``): ``prefill_urls`` are the prefill workers,
    routed by ``prefill_policy``; ``worker_urls`` are then the decode workers (``policy``); a session's
    round with at most ``pd_local_prefill_threshold`` new prompt tokens is prefilled on its decode worker.

    Access (docs/router.md): ``api_key`` guards every route but ``/health`` (and ``/metrics`` with
    ``metrics_without_auth``), and ``/workers`` too when ``admin_api_key`` is not set; ``admin_api_key``
    guards ``/workers`` and is required when ``host`` is not
    loopback (unless ``worker_admin`` is False: no ``/workers`` routes at all); ``worker_api_key`` is the
    Bearer token sent to workers (to a worker registered at run time only when ``admin_api_key`` or
    ``allowed_worker_urls`` vouches for it: ``runtime_workers_trusted``); ``allowed_worker_urls`` limits what ``POST /workers`` may register
    (None: any); ``allowed_hosts`` is the Host allow-list as given (None: the default for ``host``);
    ``max_request_body_bytes`` caps request bodies (413).

    Tracing (docs/tracing.md): with ``otlp_traces_endpoint``, each generation request makes a ``router_request``
    span, child of the client's ``traceparent``, whose own ``traceparent`` the workers get; without it the
    client's ``traceparent`` and ``tracestate`` are passed on to the workers as they came.
    """

    @property
    def pd_disaggregation(self) -> bool:
        return bool(self.prefill_urls)

    worker_urls: tuple[str, ...] = ()
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    health_check_interval: float = HEALTH_CHECK_INTERVAL_S
    health_check_timeout: float = HEALTH_CHECK_TIMEOUT_S
    request_timeout: float = 1800.0
    stream_stall_timeout: float | None = 15.0  # seconds without a stream event after the first token; None: off
    tokenizer: str | None = None
    prefill_urls: tuple[str, ...] = ()
    prefill_policy: PolicyConfig | None = None
    pd_local_prefill_threshold: int = 0
    kv_transfer_secret_file: str | None = None  # PD: the cluster secret kv_transfer_params are signed with
    admin_api_key: str | None = None
    worker_api_key: str | None = None
    allowed_worker_urls: tuple[str, ...] | None = None
    allowed_hosts: tuple[str, ...] | None = None
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    metrics_without_auth: bool = False
    worker_admin: bool = True
    otlp_traces_endpoint: str | None = None  # OTLP/HTTP receiver of the router_request spans (None: no tracing)

    @property
    def runtime_workers_trusted(self) -> bool:
        """Whether a worker registered through ``POST /workers`` gets ``worker_api_key``: only when the
        registrant was authenticated as an administrator (``admin_api_key``) or the URL matched
        ``allowed_worker_urls``. Otherwise anyone who may call ``/workers`` (a client holding ``api_key``,
        or anyone on the host) could register a worker of their own and collect the key."""
        return bool(self.admin_api_key) or self.allowed_worker_urls is not None

    def __post_init__(self) -> None:
        if self.worker_admin and not self.admin_api_key and not is_loopback(self.host):
            raise ValueError(f"--admin-api-key is required when the router listens beyond loopback (--host "
                             f"{self.host}): without it anyone who reaches the port could register a worker and "
                             "read every prompt")
        if self.max_request_body_bytes < 1:
            raise ValueError(f"max_request_body_bytes must be >= 1, got {self.max_request_body_bytes}")
        WorkerURLPolicy(self.allowed_worker_urls)  # raises on a malformed pattern
        if not self.health_check_interval > 0:
            raise ValueError(f"health_check_interval must be > 0, got {self.health_check_interval}")
        if not self.request_timeout > 0:
            raise ValueError(f"request_timeout must be > 0, got {self.request_timeout}")
        if not self.health_check_timeout > 0:
            raise ValueError(f"health_check_timeout must be > 0, got {self.health_check_timeout}")
        if self.stream_stall_timeout is not None and not self.stream_stall_timeout > 0:
            raise ValueError(f"stream_stall_timeout must be > 0 or None, got {self.stream_stall_timeout}")


class RouterError(Exception):
    """A client error the router answers itself, as an OpenAI error body."""

    def __init__(self, message: str, status_code: int = 400, type: str = "invalid_request_error",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status_code, self.type, self.param = message, status_code, type, param


# ---- what routing needs from a request body -------------------------------------------------------
def _single_text_prompt(prompt: object) -> bool:
    """A completions ``prompt`` that is one text (a string, or a list of one string)."""
    return isinstance(prompt, str) or (isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_text(token_ids: list[int]) -> str:
    """Token ids as text the prefix tree can match (a prefix of ids is a prefix of this text)."""
    return "".join(f"{t} " for t in token_ids)


def _message_text(message: object, i: int) -> str:
    if not isinstance(message, dict):
        raise RouterError(f"messages[{i}] must be an object, got {type(message).__name__}", param=f"messages[{i}]")
    content = message.get("content")
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    raise RouterError(f"messages[{i}].content must be a string, a list of parts or null", param=f"messages[{i}].content")


def route_request(kind: str, body: dict, session_header: str | None) -> RouteRequest:
    """The ``RouteRequest`` of a completions (``kind="completions"``) or chat body.

    ``text``: the (first) prompt, token ids written as numbers, or the messages' contents joined by
    newlines. ``num_prompt_tokens``: exact for token-id prompts, else ``len(text) // 4``.
    ``max_tokens``: the output budget times ``n`` (chat without one counts CHAT_MAX_TOKENS_ESTIMATE).

    Raises:
        RouterError: a field routing reads is missing or of the wrong type, or a session id (``user``,
            ``X-Session-Id``) is longer than ``MAX_SESSION_ID_LENGTH`` (400 naming it).
    """
    for name in ("stream",):
        if name in body and not isinstance(body[name], bool):
            raise RouterError(f"{name} must be a boolean, got {body[name]!r}", param=name)
    n = body.get("n", 1)
    if n is None:
        n = 1
    if not _is_int(n) or n < 1:
        raise RouterError(f"n must be an integer >= 1, got {n!r}", param="n")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise RouterError(f"user must be a string, got {user!r}", param="user")
    for value, param in ((user, "user"), (session_header, "X-Session-Id")):
        if value is not None and len(value) > MAX_SESSION_ID_LENGTH:
            raise RouterError(f"{param} may be at most {MAX_SESSION_ID_LENGTH} characters long, got {len(value)}",
                              param=param)
    prompt_token_ids = None
    if kind == "completions":
        if "prompt" not in body:
            raise RouterError("prompt is required", param="prompt")
        prompt = body["prompt"]
        if isinstance(prompt, str):
            prompts: list = [prompt]
        elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
            prompts = [prompt]
        elif isinstance(prompt, list) and prompt and all(
                isinstance(p, str) or (isinstance(p, list) and all(_is_int(t) for t in p)) for p in prompt):
            prompts = prompt
        else:
            raise RouterError("prompt must be a string, a list of strings, token ids, or lists of token ids",
                              param="prompt")
        texts = [p if isinstance(p, str) else _token_text(p) for p in prompts]
        num_prompt_tokens = sum(len(p) if isinstance(p, list) else len(p) // 4 for p in prompts)
        if len(prompts) == 1 and isinstance(prompts[0], list):
            prompt_token_ids = tuple(prompts[0])
        max_tokens = body.get("max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS)
        budget_param = "max_tokens"
        if max_tokens is None:
            max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
        n *= len(prompts)
    else:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RouterError("messages must be a non-empty list", param="messages")
        texts = ["\n".join(_message_text(m, i) for i, m in enumerate(messages))]
        num_prompt_tokens = len(texts[0]) // 4
        budget_param = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = body.get(budget_param)
        if max_tokens is None:
            max_tokens = CHAT_MAX_TOKENS_ESTIMATE
    if not _is_int(max_tokens) or max_tokens < 0:
        raise RouterError(f"{budget_param} must be an integer >= 0, got {max_tokens!r}", param=budget_param)
    return RouteRequest(request_id=f"router-{uuid.uuid4().hex}", text=texts[0], prompt_token_ids=prompt_token_ids,
                        num_prompt_tokens=num_prompt_tokens, max_tokens=max_tokens * n,
                        session_id=session_header or user)


def end_router_span(tracing: Tracing, span, response: Response | None) -> None:
    """End a ``router_request`` span with the response's status and worker; status error for a 5xx, a client
    that left (499, or mid-stream), or no response at all (the handler was cancelled or failed)."""
    status = getattr(response, "status_code", None)
    if status is None and isinstance(getattr(response, "response", None), Response):  # a stream whose every
        status = response.response.status_code  # worker failed after its head went out (proxy._ErrorAfterHead)
    if status is not None:
        span.set_attribute(SpanAttributes.HTTP_STATUS_CODE, status)
    worker_id = response.headers.get(WORKER_HEADER) if isinstance(response, Response) else None
    if worker_id:
        span.set_attribute(SpanAttributes.ROUTER_WORKER_ID, worker_id)
    error = None
    if response is None:
        error = "the request ended without a response"
    elif getattr(response, "client_gone", False) or status == 499:
        error = "the client disconnected"
    elif status is not None and status >= 500:
        error = f"answered {status}"
    tracing.end_span(span, error)


# ---- the app --------------------------------------------------------------------------------------
_GENERATE_PATHS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}


class _RouterApp(FastAPI):
    """FastAPI, with every request passing ``guard`` first (router/access.py: Host, keys, JSON, body
    cap; set by ``build_app``), and the two generation routes served straight from ``__call__``
    (``generate``): each request then skips FastAPI's middleware stack, routing and dependency solving,
    which cost the router a third of a millisecond per request here."""

    generate = None
    guard = None

    async def __call__(self, scope, receive, send) -> None:
        if self.guard is not None:
            await self.guard(scope, receive, send)
        else:
            await self.dispatch(scope, receive, send)

    async def dispatch(self, scope, receive, send) -> None:
        """The app behind the guard: ``generate`` for the generation routes, FastAPI for the rest."""
        if (self.generate is not None and scope["type"] == "http" and scope["method"] == "POST"
                and scope["path"] in _GENERATE_PATHS):
            await self.generate(scope, receive, send)
        else:
            await super().__call__(scope, receive, send)


def build_app(config: RouterConfig) -> FastAPI:
    """The router app; its lifespan opens the HTTP client, checks the workers once, and runs the health
    and housekeeping loops.

    Raises:
        ValueError: the policy cannot be built (e.g. ``kv_aware`` missing from this build).
    """
    policy = make_policy(config.policy)
    metrics = RouterMetrics()
    tracing = Tracing(config.otlp_traces_endpoint, "tokenmill-router") if config.otlp_traces_endpoint else None
    client = httpx.AsyncClient(timeout=httpx.Timeout(config.request_timeout, connect=10.0),
                               limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
                               trust_env=False)
    registry = WorkerRegistry(client, policy, config.worker_api_key, config.health_check_timeout)
    proxy = Proxy(client, registry, policy, metrics, config.worker_api_key,
                  stream_stall_timeout=config.stream_stall_timeout)
    url_policy = WorkerURLPolicy(config.allowed_worker_urls, config.worker_urls + config.prefill_urls)
    for url in config.worker_urls:
        registry.add(url)
    pd = None
    if config.pd_disaggregation:
        from tokenmill.router.pd import PDRouter

        prefill_policy = make_policy(config.prefill_policy or config.policy)
        prefill_registry = WorkerRegistry(client, prefill_policy, config.worker_api_key, config.health_check_timeout)
        for url in config.prefill_urls:
            prefill_registry.add(url)
        from tokenmill.security import load_cluster_secret

        pd = PDRouter(prefill_registry, prefill_policy, proxy, metrics, config.pd_local_prefill_threshold,
                      config.worker_api_key, secret=load_cluster_secret(file=config.kv_transfer_secret_file))
    # kv_aware hashes prompt blocks, so it needs the prompt's token ids.
    tokenizer = None
    if config.policy.name == "kv_aware" or config.pd_disaggregation:  # exact prompt lengths for sessions' rounds
        tokenizer = RequestTokenizer(config.tokenizer)

    async def with_token_ids(kind: str, body: dict, route: RouteRequest, content: bytes) -> RouteRequest:
        """``route`` with the prompt's token ids and the worker's prefix-cache extra keys (cache_salt)."""
        salt = body.get("cache_salt")
        if isinstance(salt, str) and len(salt) > MAX_CACHE_SALT_LENGTH:  # hashed into every block of the prompt
            raise RouterError(f"cache_salt may be at most {MAX_CACHE_SALT_LENGTH} characters long, got {len(salt)}",
                              param="cache_salt")
        extra_keys = (salt,) if isinstance(salt, str) and salt else ()
        ids = route.prompt_token_ids
        if ids is None:
            for worker in registry.workers.values():
                if worker.is_tokenmill:
                    tokenizer.offer_source(worker.model_path)
                    break
            if tokenizer.ready and len(content) <= INLINE_TOKENIZE_BYTES:
                token_ids = tokenizer.token_ids(kind, body)  # short: a thread hop costs more than the encode
            else:  # the first load, or a long prompt: off the event loop
                token_ids = await asyncio.to_thread(tokenizer.token_ids, kind, body)
            ids = tuple(token_ids) if token_ids is not None else None
        return dataclasses.replace(route, prompt_token_ids=ids, extra_keys=extra_keys,
                                   num_prompt_tokens=len(ids) if ids is not None else route.num_prompt_tokens)

    async def housekeeping_loop() -> None:
        while True:
            await asyncio.sleep(config.policy.eviction_interval)
            try:
                policy.housekeeping()
            except Exception:
                logger.exception("policy housekeeping failed")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        proxy.session = upstream_session(config.request_timeout)
        await registry.check_all()
        tasks = [asyncio.ensure_future(registry.health_loop(config.health_check_interval)),
                 asyncio.ensure_future(housekeeping_loop())]
        if pd is not None:
            await pd.prefill.check_all()
            tasks.append(asyncio.ensure_future(pd.prefill.health_loop(config.health_check_interval)))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            policy.close()
            if pd is not None:
                pd.prefill_policy.close()
            await client.aclose()
            await proxy.session.close()
            if tracing is not None:
                await asyncio.to_thread(tracing.shutdown)

    app = _RouterApp(title="tokenmill router", lifespan=lifespan)
    app.state.registry, app.state.policy, app.state.metrics = registry, policy, metrics
    document_error_responses(app)  # /openapi.json: the OpenAI error body under 4XX and 503, not 422
    app.guard = guarded(app.dispatch, config.api_key, config.admin_api_key,
                        allowed_hosts_for(config.host, config.allowed_hosts), config.max_request_body_bytes,
                        config.metrics_without_auth, routes=app.router.routes)

    @app.exception_handler(RouterError)
    async def _router_error(request: Request, exc: RouterError) -> JSONResponse:
        return openai_error(exc.message, exc.status_code, exc.type, exc.param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        response = openai_error(str(exc.detail), exc.status_code, kind)
        response.headers.update(exc.headers or {})
        if exc.status_code == 405:  # RFC 9110: a 405 names the methods the path takes
            response.headers["Allow"] = allowed_methods(app.router.routes, request.url.path)
        return response

    @app.exception_handler(Exception)
    async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return openai_error(f"internal router error: {type(exc).__name__}: {exc}", 500, "internal_server_error")

    async def read_json(request: Request) -> tuple[bytes, dict]:
        content = await request.body()
        try:
            body = json.loads(content)
        except (ValueError, UnicodeDecodeError) as exc:
            raise RouterError(f"request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise RouterError(f"request body must be a JSON object, got {type(body).__name__}")
        return content, body

    async def forward(kind: str, path: str, request: Request, send=None) -> Response:
        arrival = time.perf_counter()
        content, body = await read_json(request)
        if "kv_transfer_params" in body:  # a client must never steer KV transfer (the PD path adds signed ones)
            del body["kv_transfer_params"]
            content = json.dumps(body).encode()
        route = route_request(kind, body, request.headers.get("x-session-id"))
        if tokenizer is not None:
            route = await with_token_ids(kind, body, route, content)
        if pd is not None:
            return await pd.forward(path, body, route, bool(body.get("stream", False)), request, send)
        prompt_ids = None
        if (tokenizer is not None and kind == "completions" and route.prompt_token_ids is not None
                and not body.get("echo") and _single_text_prompt(body.get("prompt"))):
            prompt_ids = PromptIds(route.prompt_token_ids,
                                   lambda w: w.is_tokenmill and tokenizer.shared_with(w.model_path))
        return await proxy.forward(path, content, route, bool(body.get("stream", False)), request, body, arrival,
                                   send, prompt_ids)

    async def generate(scope, receive, send) -> None:
        """``/v1/completions`` and ``/v1/chat/completions`` without FastAPI's routing and middleware
        (what the routes below do, with the same errors, in about half the time)."""
        request = Request(scope, receive)
        span = None
        if tracing is not None:  # the workers' spans become children of this request's router_request span
            span = tracing.start_span(ROUTER_REQUEST_SPAN, trace_headers(request.headers),
                                      attributes={SpanAttributes.HTTP_METHOD: "POST", SpanAttributes.URL_PATH:
                                                  scope["path"]})
            scope[TRACE_SCOPE_KEY] = tracing.headers_of(span)
        else:  # passed on as they came, so the workers' spans still join the client's trace
            scope[TRACE_SCOPE_KEY] = trace_headers(request.headers)
        response = None
        try:
            try:
                response = await forward(_GENERATE_PATHS[scope["path"]], scope["path"], request, send)
            except RouterError as exc:
                response = openai_error(exc.message, exc.status_code, exc.type, exc.param)
            except StarletteHTTPException as exc:  # the body cap's 413, raised while the body is read
                response = await _http_error(request, exc)
            except Exception as exc:
                response = await _unexpected_error(request, exc)
            await response(scope, receive, send)
        finally:
            if span is not None:  # after the last byte of the response (a stream's too), or its failure
                end_router_span(tracing, span, response)

    app.generate = generate

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await forward("completions", "/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await forward("chat", "/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models() -> dict:
        """The union of the healthy workers' models (first card of each id wins)."""
        async def one(worker) -> list:
            try:
                response = await client.get(f"{worker.url}/v1/models", headers=worker.headers(registry.auth),
                                            timeout=HEALTH_TIMEOUT_S)
                data = response.json().get("data") if response.status_code == 200 else None
            except (httpx.HTTPError, ValueError, AttributeError):
                return []
            return data if isinstance(data, list) else []

        cards: dict[str, dict] = {}
        for data in await asyncio.gather(*(one(w) for w in registry.routable())):
            for card in data:
                if isinstance(card, dict) and isinstance(card.get("id"), str):
                    cards.setdefault(card["id"], card)
        return {"object": "list", "data": list(cards.values())}

    @app.get("/health")
    async def health() -> Response:
        if registry.routable() and (pd is None or pd.prefill.routable()):
            return JSONResponse({"status": "ok", "healthy_workers": len(registry.routable())})
        return openai_error("no healthy worker", 503, "service_unavailable_error")

    @app.get("/metrics", response_class=PlainTextResponse)  # documented as text/plain in /openapi.json
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(registry.workers.values()), media_type=CONTENT_TYPE_LATEST)

    if not config.worker_admin:  # data-parallel replicas beyond loopback: the workers are fixed
        return app

    @app.get("/workers")
    async def list_workers() -> dict:
        listed = {"policy": policy.name, "workers": [w.as_json() for w in registry.workers.values()]}
        if pd is not None:  # the decode workers above; the prefill workers here
            listed.update(prefill_policy=pd.prefill_policy.name,
                          prefill_workers=[w.as_json() for w in pd.prefill.workers.values()])
        return listed

    @app.post("/workers", status_code=201)
    async def add_worker(request: Request) -> JSONResponse:
        """Register ``{"url": ...}``; answers 201 once its first health check ran (state in the body),
        403 for a URL outside ``--allowed-worker-urls``."""
        _, body = await read_json(request)
        try:
            url = normalize_url(body.get("url"))
            if not url_policy.allows(url):
                raise RouterError(f"url {url} is not allowed by the router's --allowed-worker-urls", 403,
                                  "permission_error", "url")
            worker = registry.add(url, trusted=config.runtime_workers_trusted or url in url_policy.implicit)
        except DuplicateWorker as exc:
            raise RouterError(str(exc), 409, param="url") from None
        except ValueError as exc:
            raise RouterError(str(exc), param="url") from None
        await registry.check(worker)
        return JSONResponse(worker.as_json(), 201)

    @app.delete("/workers/{worker_id}")
    async def remove_worker(worker_id: str) -> dict:
        """Unregister a worker; its requests in flight finish."""
        try:
            worker = registry.remove(worker_id)
        except KeyError:
            raise RouterError(f"no worker with id {worker_id!r}", 404, "not_found_error", "worker_id") from None
        return {"id": worker.worker_id, "url": worker.url, "deleted": True}

    @app.post("/workers/{worker_id}/drain")
    async def drain_worker(worker_id: str) -> dict:
        """Send the worker no new request (state ``draining``) while its requests in flight finish; until undrain."""
        try:
            return registry.drain(worker_id).as_json()
        except KeyError:
            raise RouterError(f"no worker with id {worker_id!r}", 404, "not_found_error", "worker_id") from None

    @app.post("/workers/{worker_id}/undrain")
    async def undrain_worker(worker_id: str) -> dict:
        """Route to a drained worker again; answers once its health check (run now) decided its state."""
        try:
            return (await registry.undrain(worker_id)).as_json()
        except KeyError:
            raise RouterError(f"no worker with id {worker_id!r}", 404, "not_found_error", "worker_id") from None

    return app


def run_router(config: RouterConfig) -> int:
    """Serve until SIGINT/SIGTERM; returns the exit code."""
    app = build_app(config)
    logging.getLogger("httpx2").setLevel(logging.WARNING)  # not a line per forwarded request
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_config=None,
                                           timeout_graceful_shutdown=5))
    for signum in (signal.SIGINT, signal.SIGTERM):  # uvicorn re-raises the signal after shutdown: ignore it
        signal.signal(signum, lambda s, f: None)
    logger.info("router (%s) on http://%s:%d over %d worker(s)", config.policy.name, config.host, config.port,
                len(config.worker_urls))
    if config.worker_admin and config.api_key and not config.admin_api_key:
        logger.warning("--api-key is set but --admin-api-key is not: --api-key also guards /workers, so every "
                       "client may register workers%s", "" if config.runtime_workers_trusted else
                       " (they get no --worker-api-key)")
    server.run()
    return 0
