"""AsyncEngine: runs the synchronous LLMEngine in one engine-owner thread for the asyncio server.

Only that thread touches the engine's mutable state. The event loop sends it commands (add,
abort, call, stop) through a queue; the thread drains them, steps while there is work, blocks
on the queue when idle, and hands each step's RequestOutputs to per-request asyncio queues
with one ``loop.call_soon_threadsafe`` per step. Reading the tokenizer and fixed facts
(``max_model_len``, vocab size) from the event loop is fine; nothing else is.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from tokenmill import envs
from tokenmill.engine.llm import LLM
from tokenmill.engine.llm_engine import StepFailedError
from tokenmill.engine_args import EngineArgs
from tokenmill.lora_request import LoRARequest
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.metrics import EngineStats, RequestMetricsTracker

logger = logging.getLogger(__name__)

KV_SAVE_TIMEOUT_S = 300.0  # how long shutdown waits for cached KV blocks to be written to the disk tier
# Failed engine steps in a row after which the engine is taken for broken and reports dead (docs/deployment.md).
MAX_CONSECUTIVE_STEP_FAILURES = 3


class RequestFailedError(RuntimeError):
    """The engine dropped a request before it finished. ``status_code`` and ``error_type`` say how the server
    answers: the status of a non-streamed response, the ``error`` event that ends a stream."""

    def __init__(self, message: str, status_code: int = 500, error_type: str = "internal_server_error") -> None:
        super().__init__(message)
        self.status_code = status_code
        self.error_type = error_type


class EngineDeadError(RequestFailedError):
    """The engine thread is not serving (still loading, crashed, or shut down): 503."""

    def __init__(self, message: str) -> None:
        super().__init__(message, 503, "service_unavailable_error")


class QueueFullError(RuntimeError):
    """Too many sequences wait for the engine already (``max_queued_requests``); retry later."""


@dataclass(frozen=True)
class EngineRequest:
    """One prompt to generate for: already tokenized and validated by the server."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    cache_salt: str | None = None
    lora_request: LoRARequest | None = None
    kv_transfer_params: dict | None = None
    priority: int = 0  # lower runs first under the priority scheduling policy
    session_id: str | None = None  # the agent session (``ServerState.session_of``)
    trace_headers: dict[str, str] | None = None  # W3C traceparent / tracestate of its HTTP request (tracing on)


@dataclass
class _Add:
    requests: list[EngineRequest]
    outputs: asyncio.Queue
    accepted: concurrent.futures.Future
    arrival_time: float


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class _Call:
    fn: Callable[[Any], Any]
    result: concurrent.futures.Future


@dataclass
class _FailAll:
    error: RequestFailedError
    result: concurrent.futures.Future


class _Stop:
    pass


class RequestStream:
    """Async iterator over the RequestOutputs of a group of requests (one per prompt) until all finish.

    Always ``close()`` it (a ``finally`` block): unfinished requests are then aborted, which
    frees their KV blocks at once.
    """

    def __init__(self, engine: AsyncEngine, request_ids: list[str], outputs: asyncio.Queue) -> None:
        self._engine = engine
        self._outputs = outputs
        self.unfinished = set(request_ids)
        self.weight_version: str | None = None  # the weights these requests are generated with (RLGate)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self.unfinished:
            raise StopAsyncIteration
        item = await self._outputs.get()
        if isinstance(item, BaseException):  # RequestFailedError: the engine already dropped them
            self.unfinished.clear()
            raise item
        if item.finished:
            self.unfinished.discard(item.request_id)
        return item

    def close(self) -> None:
        """Abort the requests that have not finished (idempotent)."""
        if self.unfinished:
            self._engine.abort(list(self.unfinished))
            self.unfinished.clear()


class AsyncEngine:
    """Owns the engine thread. ``start()`` builds the engine there (``/health`` is 503 meanwhile).

    Args:
        engine_args: the engine options (model, dtype, max_model_len, ...).
        tracker: per-request latency/counter metrics, updated from the engine thread.
        on_load_failure: called (from the engine thread) if the engine cannot be built.
        on_loaded: called with the LLM on the engine thread once it is built, before it serves (an
            exception there is a load failure).
        max_queued_requests: most sequences waiting in the scheduler; an add that would go past it
            (while any wait) fails with QueueFullError. None: no limit.
    """

    def __init__(
        self,
        engine_args: EngineArgs,
        tracker: RequestMetricsTracker | None = None,
        on_load_failure: Callable[[BaseException], None] | None = None,
        on_loaded: Callable[[LLM], None] | None = None,
        max_queued_requests: int | None = None,
    ) -> None:
        self._engine_args = engine_args
        self._max_queued_requests = max_queued_requests
        self._on_loaded = on_loaded
        self._tracker = tracker
        self._on_load_failure = on_load_failure
        self._commands: queue.Queue = queue.Queue()
        self._closed = False  # set (under _lock) once the thread takes no more commands
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.llm: LLM | None = None  # set once loaded; read-only for the event loop
        self.ready = threading.Event()  # set once the engine is built
        self._load_ended = threading.Event()  # set once loading succeeded or failed
        self.error: BaseException | None = None
        self.stats = EngineStats()
        self._closing = threading.Event()  # set once the engine thread is saving / releasing the KV tiers
        self._streams: dict[str, asyncio.Queue] = {}  # engine thread only: request id -> its outputs
        self._num_live = 0  # len(_streams), published by the engine thread for the event loop
        self._num_adding = 0  # event loop only: adds sent and not answered yet
        self._consecutive_step_failures = 0  # engine thread only

    # ---- event-loop side ------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the engine thread; outputs are delivered on ``loop``."""
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="tokenmill-engine", daemon=True)
        self._thread.start()

    def wait_loaded(self, timeout: float | None = None) -> bool:
        """Block until loading ends (either way); True if the engine is then healthy."""
        self._load_ended.wait(timeout)
        return self.is_healthy

    @property
    def is_loading(self) -> bool:
        """Still building the engine (no load error yet)."""
        return self.error is None and not self.ready.is_set()

    @property
    def is_healthy(self) -> bool:
        """Loaded and the engine thread still running."""
        return self.ready.is_set() and self.error is None and self._thread is not None and self._thread.is_alive()

    @property
    def num_in_flight(self) -> int:
        """Requests taken and not finished: queued for the engine, or in it with a stream to feed (event loop)."""
        return self._num_adding + self._num_live

    def queue_looks_full(self) -> bool:
        """Whether ``max_queued_requests`` sequences waited for the engine after its latest step (event loop; a
        cheap early answer so an overloaded server refuses before tokenizing; the engine thread decides for
        the requests it is sent)."""
        limit = self._max_queued_requests
        return limit is not None and self.stats.num_requests_waiting >= limit

    def check_healthy(self) -> None:
        """Raise EngineDeadError unless the engine can take requests."""
        if self.is_loading:
            raise EngineDeadError("the model is still loading; retry when /health returns 200")
        if not self.is_healthy:
            raise EngineDeadError(f"the engine is not running ({self.error or 'stopped'})")

    async def add(self, requests: list[EngineRequest]) -> RequestStream:
        """Queue requests atomically: all are added, or none (the engine's ValueError is re-raised;
        QueueFullError past ``max_queued_requests``)."""
        self.check_healthy()
        outputs: asyncio.Queue = asyncio.Queue()
        accepted: concurrent.futures.Future = concurrent.futures.Future()
        self._send(_Add(requests, outputs, accepted, time.monotonic()))
        self._num_adding += 1
        try:
            await asyncio.wrap_future(accepted)
        except asyncio.CancelledError:  # the client left while the add was pending
            self.abort([r.request_id for r in requests])
            raise
        finally:
            self._num_adding -= 1
        return RequestStream(self, [r.request_id for r in requests], outputs)

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests (no-op for finished or unknown ids, or once the engine has stopped)."""
        try:
            self._send(_Abort(request_ids))
        except EngineDeadError:
            pass

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(llm_engine)`` on the engine thread between steps and return its result."""
        self.check_healthy()
        result: concurrent.futures.Future = concurrent.futures.Future()
        self._send(_Call(fn, result))
        return await asyncio.wrap_future(result)

    async def fail_all(self, error: RequestFailedError) -> int:
        """End every request in flight with ``error`` (its stream raises it) and free its blocks; returns how
        many were ended. The engine goes on serving (used when ``--shutdown-timeout`` runs out)."""
        try:
            self.check_healthy()
        except EngineDeadError:
            return 0
        result: concurrent.futures.Future = concurrent.futures.Future()
        self._send(_FailAll(error, result))
        return await asyncio.wrap_future(result)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; requests still running get EngineDeadError."""
        try:
            self._send(_Stop())
        except EngineDeadError:
            pass
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive() and self._closing.is_set():
                logger.info("waiting for the KV offload tiers to reach disk")
                self._thread.join(KV_SAVE_TIMEOUT_S)

    def _send(self, command: object) -> None:
        with self._lock:
            if self._closed:
                raise EngineDeadError(f"the engine is not running ({self.error or 'stopped'})")
            self._commands.put(command)

    # ---- engine-thread side ----------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.llm = LLM.from_engine_args(self._engine_args)
            if self._on_loaded is not None:
                self._on_loaded(self.llm)
        except BaseException as exc:  # noqa: BLE001 - reported through /health and on_load_failure
            if isinstance(exc, ValueError):  # a bad setting: the message says which; no traceback
                logger.error("engine failed to load: %s", exc)
            else:
                logger.exception("engine failed to load")
            self.error = exc
            if self.llm is not None:  # built, but its startup hook failed: release its KV tiers
                self.llm.close()
            self._fail_pending(EngineDeadError(f"engine failed to load: {exc}"))
            self._load_ended.set()
            if self._on_load_failure is not None:
                self._on_load_failure(exc)
            return
        self._update_stats()
        self.ready.set()
        self._load_ended.set()
        crashed = False
        try:
            self._serve()
        except BaseException as exc:  # noqa: BLE001 - the thread must report, not vanish
            logger.exception("engine thread crashed")
            self.error = exc
            crashed = True
            self._fail_pending(EngineDeadError(f"engine crashed: {type(exc).__name__}: {exc}"))
        else:
            self._fail_pending(EngineDeadError("the server is shutting down"))
        self._close_engine(save_cached=not crashed)

    def _close_engine(self, save_cached: bool) -> None:
        """Release the engine's KV tiers (saving cached blocks to the disk tier after a clean stop)."""
        self._closing.set()
        try:
            self.llm.engine.close(save_cached=save_cached)
        except Exception:  # noqa: BLE001 - shutdown must go on
            logger.exception("closing the KV offload tiers failed")

    def _serve(self) -> None:
        engine = self.llm.engine
        while True:
            idle = not engine.has_unfinished_requests()
            if not self._drain_commands(engine, block=idle):
                return
            if engine.has_unfinished_requests():
                step_start = time.monotonic()
                try:
                    outputs = engine.step()
                except StepFailedError as exc:
                    self._step_failed(engine, exc)
                    outputs = []
                else:
                    self._consecutive_step_failures = 0
                if self._tracker is not None:
                    self._tracker.on_step(engine, step_start, outputs)
                self._deliver(outputs)
            self._update_stats()

    def _step_failed(self, engine, exc: StepFailedError) -> None:
        """Fail the requests of a failed step (500 naming the error) and go on, unless too many steps in a row
        failed: then re-raise, and the engine reports dead."""
        self._consecutive_step_failures += 1
        if self._consecutive_step_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
            raise RuntimeError(f"{self._consecutive_step_failures} engine steps in a row failed; the last: "
                               f"{type(exc.cause).__name__}: {exc.cause}") from exc.cause
        cause = exc.cause
        self._fail_streams(engine, exc.request_ids, RequestFailedError(
            f"the engine step that ran this request failed: {type(cause).__name__}: {cause}"))

    def _fail_streams(self, engine, request_ids: list[str], error: RequestFailedError) -> int:
        """Abort ``request_ids`` and every request sharing a stream with one of them; each stream gets ``error``.
        Returns how many requests were aborted. Engine thread only."""
        targets = {id(q): q for q in (self._streams.get(r) for r in request_ids) if q is not None}
        grouped = [r for r, q in self._streams.items() if id(q) in targets]
        for request_id in grouped:  # count them before the engine forgets them
            del self._streams[request_id]
            if self._tracker is not None:
                self._tracker.on_aborted(engine, request_id)
        doomed = list(dict.fromkeys([*request_ids, *grouped]))
        engine.abort_request(doomed)
        if envs.check_integrity() and not engine.has_unfinished_requests():  # as step() checks on going idle
            engine.check_integrity(idle=True)
        if targets:
            self._post([(q, error) for q in targets.values()])
        return len(doomed)

    def _drain_commands(self, engine, block: bool) -> bool:
        """Apply queued commands (waiting for one if ``block``); False once a stop arrives."""
        try:
            command = self._commands.get(block=block)
        except queue.Empty:
            return True
        while True:
            if isinstance(command, _Stop):
                return False
            if isinstance(command, _Add):
                self._add(engine, command)
            elif isinstance(command, _Abort):
                for request_id in command.request_ids:  # count them before the engine forgets them
                    if self._streams.pop(request_id, None) is not None and self._tracker is not None:
                        self._tracker.on_aborted(engine, request_id)
                engine.abort_request(command.request_ids)
            elif isinstance(command, _Call):
                try:
                    command.result.set_result(command.fn(engine))
                except Exception as exc:  # noqa: BLE001 - handed to the caller
                    command.result.set_exception(exc)
            elif isinstance(command, _FailAll):
                try:
                    command.result.set_result(self._fail_streams(engine, list(self._streams), command.error))
                except BaseException as exc:  # a broken invariant: the engine thread ends, reporting dead
                    command.result.set_exception(EngineDeadError(f"engine crashed: {type(exc).__name__}: {exc}"))
                    raise
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _add(self, engine, command: _Add) -> None:
        num_waiting = engine.scheduler.num_waiting
        num_new = sum(r.params.n for r in command.requests)
        if self._max_queued_requests is not None and num_waiting and num_waiting + num_new > self._max_queued_requests:
            command.accepted.set_exception(QueueFullError(
                f"{num_waiting} sequences wait for the engine already; this request's {num_new} would pass the "
                f"server's limit of {self._max_queued_requests} (--max-queued-requests); retry later"))
            return
        added: list[str] = []
        try:
            for r in command.requests:
                engine.add_request(r.request_id, {"prompt_token_ids": r.prompt_token_ids}, r.params,
                                   arrival_time=command.arrival_time, cache_salt=r.cache_salt,
                                   lora_request=r.lora_request, kv_transfer_params=r.kv_transfer_params,
                                   priority=r.priority, session_id=r.session_id)
                added.append(r.request_id)
        except Exception as exc:  # noqa: BLE001 - a rejected request, handed to the caller
            engine.abort_request(added)
            command.accepted.set_exception(exc)
            return
        for r in command.requests:
            self._streams[r.request_id] = command.outputs
            if self._tracker is not None:
                self._tracker.on_added(engine, r.request_id, command.arrival_time, r)
        self._num_live = len(self._streams)  # before the add is answered: num_in_flight never misses it
        command.accepted.set_result(None)

    def deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand outputs made outside ``step`` (by a ``call`` function, e.g. an abort with final outputs)
        to their streams and the metrics, as a step's are. Engine thread only."""
        if self._tracker is not None:
            self._tracker.on_step(self.llm.engine, time.monotonic(), outputs)
        self._deliver(outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        batch = []
        for output in outputs:
            target = self._streams.get(output.request_id)
            if target is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
            batch.append((target, output))
        if batch:
            self._post(batch)

    def _post(self, batch: list[tuple[asyncio.Queue, Any]]) -> None:
        try:
            self._loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _fail_pending(self, error: EngineDeadError) -> None:
        """Fail every live request and every command still queued (the engine takes no more)."""
        with self._lock:
            self._closed = True
        batch = [(target, error) for target in {id(q): q for q in self._streams.values()}.values()]
        self._streams.clear()
        self._num_live = 0
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, (_Add, _Call, _FailAll)):
                future = command.accepted if isinstance(command, _Add) else command.result
                future.set_exception(error)
        if batch:
            self._post(batch)

    def _update_stats(self) -> None:
        self._num_live = len(self._streams)
        engine = self.llm.engine
        kv = engine.kv_cache_manager
        constraints = engine.structured_output_manager
        self.stats = EngineStats(
            num_requests_running=engine.scheduler.num_running,
            num_requests_waiting=engine.scheduler.num_waiting,
            kv_cache_usage=kv.usage(),
            num_preemptions_total=engine.scheduler.num_preemptions_total,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            kv_sessions=len(kv.block_pool.session_blocks),
            kv_session_blocks=kv.block_pool.num_session_blocks,
            session_prefix_cache_queries=kv.session_queries,
            session_prefix_cache_hits=kv.session_hits,
            kv_offload=engine.kv_store.tier_stats() if engine.kv_store is not None else {},
            kv_offload_disk_dwpd=engine.kv_store.dwpd() if engine.kv_store is not None else None,
            structured_output_requests=dict(constraints.requests_by_kind),
            structured_output_mask_seconds=constraints.mask_seconds_total,
            structured_output_mask_steps=constraints.mask_steps_total,
            spec_decode=engine.speculator.stats.snapshot() if engine.speculator is not None else None,
            kv_transfer=engine.kv_connector.status() if engine.kv_connector is not None else None,
            moe_expert_load=expert_load.snapshot() if (expert_load := engine.expert_load) is not None else None,
            block_size=kv.block_size,
            num_gpu_blocks=kv.num_blocks,
            enable_prefix_caching=kv.enable_caching,
            **self._lora_stats(engine),
        )

    @staticmethod
    def _lora_stats(engine) -> dict:
        manager = engine.lora_manager
        if manager is None:
            return {}
        running, waiting = engine.lora_adapters_by_state()
        return dict(max_lora=manager.config.max_loras, running_lora_adapters=tuple(running),
                    waiting_lora_adapters=tuple(waiting), lora_counters=manager.stats())


def _put_all(batch: list[tuple[asyncio.Queue, Any]]) -> None:
    for target, item in batch:
        target.put_nowait(item)
