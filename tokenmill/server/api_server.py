"""The FastAPI app (routes, API-key check, lifespan of the engine thread) and ``run_server``.

Routes: /v1/models, /v1/completions, /v1/chat/completions, /health, /ready, /version, /metrics, /tokenize,
/detokenize, /tokenizer_info, the debug views /debug/kv_cache and /debug/status (engine configuration, CPU
ISA path and kernel choice, KV pool, the /metrics counters as JSON), and the web page at / with its files
under /static (tokenmill/server/static). Every request first passes the surface guards of
``tokenmill.security.http`` (``install_surface_guards``): Host header, CORS, API key (every path but
``PUBLIC_PATHS``), JSON content type on POST/PUT/PATCH/DELETE, request-body cap.
Tokenizing, chat templating and detokenizing run in worker threads (``asyncio.to_thread``), so a
large input never stalls the event loop and the requests of other clients. SIGTERM/SIGINT drains the
server before it stops (``DrainingServer``, docs/deployment.md).
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import platform
import signal
import sys
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Callable

import torch
import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.middleware.cors import CORSMiddleware

import tokenmill
from tokenmill import csrc_build
from tokenmill.config import ConfigError
from tokenmill.security.http import (AllowedHostsMiddleware, APIKeyMiddleware, BodySizeLimitMiddleware,
                                     JSONContentTypeMiddleware, allowed_hosts_for, is_loopback)
from tokenmill.server.async_engine import EngineDeadError, RequestFailedError
from tokenmill.openapi_errors import document_error_responses
from tokenmill.server.errors import APIError, error_response, install_error_handlers
from tokenmill.server.kv_transfer_params import kv_transfer_router
from tokenmill.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from tokenmill.server.serving_chat import create_chat_completion, render_chat
from tokenmill.server.serving_completions import create_completion
from tokenmill.server.serving_lora import lora_router
from tokenmill.server.serving_rl import rl_router
from tokenmill.server.serving_sessions import sessions_router
from tokenmill.server.state import ServerConfig, ServerState

logger = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).with_name("static")  # the web page (plain HTML/JS/CSS, no build step)
# Served without the API key: the liveness and readiness probes and the web page (static files, no data; its API
# calls carry the key). /metrics joins them with --metrics-without-auth. Every other path needs the key.
PUBLIC_PATHS = ("/health", "/ready", "/")
PUBLIC_PREFIXES = ("/static/",)
DRAIN_POLL_S = 0.05  # how often a drain looks whether the requests in flight have finished
RESPONSE_GRACE_S = 5.0  # after a drain: seconds the last responses get to reach their clients


def kv_cache_snapshot(engine, check_integrity: bool = True) -> dict:
    """The KV pool and scheduler counts, with the result of ``check_integrity()`` (O(blocks); "skipped"
    when ``check_integrity`` is False). Engine thread only."""
    kv = engine.kv_cache_manager
    integrity = "skipped"
    try:
        if check_integrity:
            engine.check_integrity()
            integrity = "ok"
    except AssertionError as exc:
        integrity = f"failed: {exc}"
    return {
        "num_blocks": kv.num_blocks,
        "num_free_blocks": kv.block_pool.num_free_blocks,
        "block_size": kv.block_size,
        "usage": kv.usage(),
        "num_running": engine.scheduler.num_running,
        "num_waiting": engine.scheduler.num_waiting,
        "num_preemptions_total": engine.scheduler.num_preemptions_total,
        "prefix_cache_queries": kv.prefix_cache_queries,
        "prefix_cache_hits": kv.prefix_cache_hits,
        "sessions": kv.session_snapshot(),
        "integrity": integrity,
        "kv_offload": engine.kv_store.snapshot() if engine.kv_store is not None else None,
    }


@functools.cache
def _cpu_facts() -> dict:
    """The CPU's model, architecture, ISA paths and bf16 arithmetic (fixed for the process)."""
    return {
        "model": csrc_build.cpu_model_name(),
        "machine": platform.machine(),
        "isa_path": csrc_build.selected_isa(),
        "isa_paths_supported": list(csrc_build.supported_isas()),
        "native_bf16": csrc_build.cpu_has_native_bf16(),
    }


def engine_status(engine, check_integrity: bool = True) -> dict:
    """The engine's configuration, where it runs (device, dtype, threads, CPU model and ISA path, which
    kernels run), the KV snapshot and the structured-output state (engine thread only)."""
    runner = engine.runner
    plan = runner.kernel_plan
    return {
        "model": engine.model_name,
        "version": tokenmill.__version__,
        "device": str(engine.device),
        "dtype": str(engine.loaded.dtype).removeprefix("torch."),
        "num_threads": torch.get_num_threads(),
        "cpu": _cpu_facts(),
        "kernels": runner.kernel_choice,
        "kernel_plan": dataclasses.asdict(plan) if plan is not None else None,
        "config": dataclasses.asdict(engine.config),
        "kv_cache": kv_cache_snapshot(engine, check_integrity),
        "structured_outputs": structured_outputs_snapshot(engine.structured_output_manager),
        "lora": lora_snapshot(engine),
        # What a KV-aware router needs: the block size it hashes prompts with, and where events are published.
        "block_size": engine.config.cache.block_size,
        "kv_events": engine.kv_events.status() if engine.kv_events is not None else {"enabled": False},
        "kv_transfer": engine.kv_connector.status() if engine.kv_connector is not None else None,
        # a mixture-of-experts model's expert load (tokens per expert, per-layer skew); None for dense models
        "moe": engine.expert_load.snapshot().summary() if engine.expert_load is not None else None,
    }


def lora_snapshot(engine) -> dict | None:
    """Adapters registered, resident in slots and in host memory, and the load/evict counters (None: LoRA off)."""
    manager = engine.lora_manager
    if manager is None:
        return None
    names = {r.lora_int_id: r.lora_name for r in manager.list_loras()}
    running, waiting = engine.lora_adapters_by_state()
    return {
        "max_loras": manager.config.max_loras,
        "max_lora_rank": manager.config.max_lora_rank,
        "max_cpu_loras": manager.config.host_capacity,
        "registered": [{"lora_int_id": i, "lora_name": n} for i, n in sorted(names.items())],
        "slots": [names.get(i, i) for i in manager.resident_lora_ids],
        "host": [names.get(i, i) for i in manager.host_lora_ids],
        "running_lora_adapters": running,
        "waiting_lora_adapters": waiting,
        **manager.stats(),
    }


def structured_outputs_snapshot(manager) -> dict:
    """The constrained-decoding backend, its compiled-constraint cache and its counters."""
    return {
        "backend": manager.backend_name,
        "cached_constraints": manager.cache_size(),
        "requests_by_kind": dict(manager.requests_by_kind),
        "mask_seconds_total": manager.mask_seconds_total,
        "mask_steps_total": manager.mask_steps_total,
        "mask_rows_total": manager.mask_rows_total,
    }


def tokenizer_info(tokenizer, max_model_len: int) -> dict:
    """What a client needs to tokenize and template like the server (vLLM's ``/tokenizer_info``; lm-eval's
    remote tokenizer reads ``eos_token``, ``bos_token``, ``pad_token`` and ``chat_template``): special tokens
    as strings (None when the tokenizer has none) and ids, the chat template, ``model_max_length`` (tokens)."""
    info = {"tokenizer_class": getattr(tokenizer, "hf_class_name", type(tokenizer).__name__), "vocab_size": len(tokenizer),
            "model_max_length": max_model_len, "chat_template": tokenizer.chat_template}
    for name in ("eos", "bos", "pad", "unk"):
        info[f"{name}_token"] = getattr(tokenizer, f"{name}_token", None)
        info[f"{name}_token_id"] = getattr(tokenizer, f"{name}_token_id", None)
    info["add_bos_token"] = bool(getattr(tokenizer, "add_bos_token", False))
    return info


def install_surface_guards(app: FastAPI, config: ServerConfig) -> None:
    """Wrap ``app`` in the HTTP guards, outermost first: allowed Host header (400), CORS when
    ``allowed_origins`` is set (preflights answered before the key check), the API key (401, every path
    but the public ones), a JSON content type on state-changing methods (415), the body cap (413)."""
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=config.max_request_body_bytes,
                       timeout_s=config.request_body_timeout, max_buffered_bytes=config.max_buffered_body_bytes)
    app.add_middleware(JSONContentTypeMiddleware, routes=app.router.routes)  # no route: 404/405, not 415
    if config.api_key:
        public = PUBLIC_PATHS + (("/metrics",) if config.metrics_without_auth else ())
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key, public_paths=public,
                           public_prefixes=PUBLIC_PREFIXES)
    if config.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                           allow_methods=list(config.allowed_methods), allow_headers=list(config.allowed_headers),
                           allow_credentials=config.allow_credentials)
    app.add_middleware(AllowedHostsMiddleware, allowed_hosts=allowed_hosts_for(config.host, config.allowed_hosts))


def build_app(config: ServerConfig, on_load_failure: Callable[[BaseException], None] | None = None) -> FastAPI:
    """The app; its lifespan starts the engine thread (model loading) and stops it on shutdown."""
    state = ServerState(config, on_load_failure)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.engine.start(asyncio.get_running_loop())
        yield
        await asyncio.to_thread(state.engine.shutdown)
        if state.tracing is not None:  # the last requests' spans (aborted ones included) go out before the exit
            await asyncio.to_thread(state.tracing.shutdown)

    app = FastAPI(title="tokenmill", version=tokenmill.__version__, lifespan=lifespan)
    app.state.server = state
    install_error_handlers(app)
    document_error_responses(app)  # /openapi.json: the OpenAI error body under 4XX and 503, not 422
    install_surface_guards(app, config)
    v1 = APIRouter(prefix="/v1")

    def model_cards() -> list[dict]:
        """The base model, then each LoRA adapter (``parent``: its base model)."""
        max_model_len = state.max_model_len if state.engine.is_healthy else None
        card = {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "tokenmill",
                "root": config.engine_args.model or state.model_name, "parent": None}
        if max_model_len is not None:
            card["max_model_len"] = max_model_len
        return [card, *state.adapters.cards(max_model_len)]

    @v1.get("/models")
    async def list_models() -> dict:
        """The served model and its LoRA adapters."""
        return {"object": "list", "data": model_cards()}

    @v1.get("/models/{model:path}")
    async def get_model(model: str) -> dict:
        """One model or adapter by name (404 unless it is served)."""
        state.check_model(model)
        return next(card for card in model_cards() if card["id"] == model)

    @v1.post("/completions")
    async def completions(body: CompletionRequest, raw_request: Request):
        """OpenAI text completions."""
        return await create_completion(body, raw_request, state)

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw_request: Request):
        """OpenAI chat completions."""
        return await create_chat_completion(body, raw_request, state)

    v1.include_router(lora_router(state, config.allow_runtime_lora_updating))
    v1.include_router(sessions_router(state, config.session_save_path))
    app.include_router(v1)
    app.include_router(rl_router(state, config.enable_rl_endpoints))  # docs/rl.md
    app.include_router(kv_transfer_router(state))  # POST /kv_transfer/release (docs/pd_disaggregation.md)

    def not_serving() -> str:
        return "the model is loading" if state.engine.is_loading else f"the engine is not running ({state.engine.error})"

    @app.get("/health")
    async def health():
        """Liveness: 200 while the engine loop runs (draining too); 503 while loading and once the engine died."""
        if state.engine.is_healthy:
            return {"status": "ok"}
        return error_response(not_serving(), 503, "service_unavailable_error")

    @app.get("/ready")
    async def ready():
        """Readiness: 200 when the model is loaded, the engine runs and the server is not draining; else 503."""
        if not state.engine.is_healthy:
            return error_response(not_serving(), 503, "service_unavailable_error")
        if state.draining:
            return error_response("the server is draining (shutting down): send requests elsewhere", 503,
                                  "service_unavailable_error")
        return {"status": "ready"}

    @app.get("/version")
    async def version() -> dict:
        """The tokenmill version."""
        return {"version": tokenmill.__version__}

    @app.get("/metrics", response_class=PlainTextResponse)  # documented as text/plain in /openapi.json
    async def metrics() -> Response:
        """Prometheus text exposition."""
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        """Token ids of a prompt, or of messages rendered with the chat template."""
        state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError("give exactly one of prompt or messages", param="prompt")
        if body.messages is not None:
            token_ids = await asyncio.to_thread(render_chat, state, body.messages, body.add_generation_prompt,
                                                body.allow_special_tokens_in_content,
                                                continue_final_message=body.continue_final_message)
        else:
            token_ids = await asyncio.to_thread(state.tokenizer.encode, body.prompt,
                                                add_special_tokens=body.add_special_tokens)
        return {"tokens": token_ids, "count": len(token_ids), "max_model_len": state.max_model_len}

    @app.get("/tokenizer_info")
    async def get_tokenizer_info() -> dict:
        """Special tokens, chat template and length limit of the served tokenizer."""
        return tokenizer_info(state.tokenizer, state.max_model_len)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        """Text of token ids."""
        state.check_model(body.model)
        vocab_size = state.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab_size]
        if bad:
            raise APIError(f"tokens must be in [0, {vocab_size}), got {bad[:5]}", param="tokens")
        return {"prompt": await asyncio.to_thread(state.decode, body.tokens)}

    @app.get("/debug/kv_cache")
    async def debug_kv_cache() -> JSONResponse:
        """The KV pool, scheduler counts and check_integrity() result, read on the engine thread."""
        try:
            return JSONResponse(await state.engine.call(kv_cache_snapshot))
        except EngineDeadError as exc:
            raise APIError(str(exc), 503, "service_unavailable_error") from None

    @app.get("/debug/status")
    async def debug_status(check_integrity: bool = True) -> JSONResponse:
        """Configuration, CPU ISA path and kernel choice, KV pool (read on the engine thread; with
        ``check_integrity=false`` without the O(blocks) pool check, for pollers), and ``metrics``: the
        /metrics counters and gauges as JSON with ``time`` (Unix seconds) and ``started``."""
        try:
            status = await state.engine.call(functools.partial(engine_status, check_integrity=check_integrity))
        except EngineDeadError as exc:
            raise APIError(str(exc), 503, "service_unavailable_error") from None
        status.update(time=time.time(), started=state.created, served_model_name=state.model_name,
                      api_key_required=bool(config.api_key), metrics=state.metrics.snapshot())
        return JSONResponse(jsonable_encoder(status))

    @app.get("/", include_in_schema=False)
    async def web_page() -> FileResponse:
        """The web page: chat playground and status view (public; its API calls carry the key)."""
        return FileResponse(STATIC_DIR / "index.html")

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    return app


def _ignore_signal(signum: int, frame) -> None:
    # uvicorn re-raises the signal that stopped it once it has shut down; nothing is left to do.
    logger.debug("signal %d re-raised after shutdown: ignored", signum)


class DrainingServer(uvicorn.Server):
    """uvicorn's server, drained before it stops. The first SIGTERM/SIGINT sets ``state.draining`` (new requests
    get 503 with ``Retry-After``, ``/ready`` 503, ``/health`` stays 200) and waits up to ``shutdown_timeout``
    seconds for the requests in flight; those still running then end with a 503 (a stream with an error event)
    and their blocks are freed. Only then does uvicorn stop listening, give the last responses
    ``RESPONSE_GRACE_S`` and run the app's shutdown, which saves the cached KV blocks to the disk tier. A second
    signal ends the wait at once.
    """

    def __init__(self, config: uvicorn.Config, state: ServerState, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.state = state
        self.shutdown_timeout = shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task | None = None
        self._hurry: asyncio.Event | None = None

    async def startup(self, sockets=None) -> None:
        self._loop, self._hurry = asyncio.get_running_loop(), asyncio.Event()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        """The signal handler (main thread, between two bytecodes of the event loop): hand over to the loop."""
        if self._loop is None or self.should_exit:  # before start-up, or already stopping: uvicorn's way
            super().handle_exit(sig, frame)
            return
        self._loop.call_soon_threadsafe(self._on_signal, sig)

    def _on_signal(self, sig: int) -> None:
        if self._drain is None:
            self._drain = self._loop.create_task(self.drain(), name="tokenmill-drain")
        else:
            logger.info("signal %d during the drain: ending the requests in flight now", sig)
            self._hurry.set()

    async def drain(self) -> None:
        """Refuse new requests, wait for the ones in flight (up to ``shutdown_timeout``), end the rest, then
        let uvicorn shut down."""
        engine = self.state.engine
        try:
            self.state.draining = True
            logger.info("draining: %d request(s) in flight get up to %g s to finish (--shutdown-timeout); new "
                        "requests get 503", engine.num_in_flight, self.shutdown_timeout)
            deadline = self._loop.time() + self.shutdown_timeout
            while engine.num_in_flight and self._loop.time() < deadline and not self._hurry.is_set():
                await asyncio.sleep(DRAIN_POLL_S)
            if engine.num_in_flight:
                num_ended = await engine.fail_all(RequestFailedError(
                    f"the server shut down before this request finished (--shutdown-timeout "
                    f"{self.shutdown_timeout:g} s)", 503, "service_unavailable_error"))
                logger.warning("drain: %d request(s) still running were ended", num_ended)
            else:
                logger.info("drained: no request in flight")
        except Exception:  # noqa: BLE001 - the server must stop all the same
            logger.exception("drain failed")
        finally:
            self.should_exit = True


def run_server(config: ServerConfig) -> int:
    """Serve until SIGINT/SIGTERM (then drain: ``DrainingServer``); returns the process exit code: 0, 2 if a
    setting was refused while the model loaded (printed as one ``error:`` line naming the flag), 1 for any
    other load failure."""
    load_failures: list[BaseException] = []

    def on_load_failure(exc: BaseException) -> None:
        load_failures.append(exc)
        server.should_exit = True

    app = build_app(config, on_load_failure)
    server = DrainingServer(uvicorn.Config(
        app, host=config.host, port=config.port, log_config=None, timeout_graceful_shutdown=RESPONSE_GRACE_S,
    ), app.state.server, config.shutdown_timeout)
    # uvicorn re-raises the signal that stopped it (when it handled the signal itself) under the handler
    # that was installed before it; with this one the re-raise is a no-op and we exit with 0.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _ignore_signal)
    logger.info("serving %r on http://%s:%d", config.served_model_name, config.host, config.port)
    if not config.api_key and not is_loopback(config.host):
        logger.warning("serving on %s beyond loopback WITHOUT --api-key: anyone who can reach port %d can use "
                       "every endpoint (generate, sleep, sessions, LoRA); set --api-key (docs/security.md)",
                       config.host, config.port)
    server.run()
    if load_failures and isinstance(load_failures[0], ValueError):
        exc = load_failures[0]
        print(f"error: {exc.for_cli() if isinstance(exc, ConfigError) else exc}", file=sys.stderr)
        return 2
    return 1 if load_failures else 0
