"""StructuredOutputManager: the engine's one door to constrained decoding.

Owns the backend (chosen by ``--structured-outputs-config``), the compiled-constraint cache keyed by
(backend, kind, spec), each constrained request's matcher (``Request.grammar``), and the per-step
bitmask fill, which runs on a worker thread while the forward pass computes (both libraries release
the GIL). Never imports torch: the runner applies the bitmask to the logits.
"""
from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass

import numpy as np

from tokenmill.config import StructuredOutputsConfig
from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.structured_output.backend import (
    BITS_PER_WORD, CompiledConstraint, ConstraintError, ConstraintTimeoutError, Matcher, StructuredOutputBackend,
)

# Compiled constraints kept (least recently used dropped first).
CACHE_SIZE = 512
# Threads that compile constraints with a deadline (``compile(..., timeout=...)``): a compile past its
# deadline keeps its thread until the library returns, so a few slow ones cannot start more threads.
COMPILE_THREADS = 2
BACKENDS = ("guidance", "xgrammar")


@dataclass
class GrammarBitmask:
    """The next-token masks of this step's constrained requests that sample a token.

    Attributes:
        req_indices: indices into ``SchedulerOutput.scheduled_requests``, ascending.
        num_rows: with speculative decoding, the bitmask rows of each request (one per draft
            position, then the bonus position: the masks after accepting the drafts before it), in
            ``req_indices`` order; None: one row each.
        future: resolves to ``(bitmask, only_stop, allows_none)``: bitmask [N, ceil(V/32)] int32
            (token t allowed iff bit t % 32 of word t // 32 is set), only_stop [N] bool (the
            constraint allows nothing but end-of-sequence tokens: ``min_tokens`` must not mask
            them), allows_none [N] bool (the matcher allows nothing: a matcher error; the mask is
            not applied and the request fails when its token is refused).
    """

    req_indices: list[int]
    future: Future
    num_rows: list[int] | None = None  # rows per request (1 + its draft tokens), consecutive; None: one each

    def result(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Wait for the fill and return ``(bitmask, only_stop, allows_none)``."""
        return self.future.result()


class StructuredOutputManager:
    """Compiles constraints, gives requests their matchers and fills each step's bitmask.

    Args:
        config: which backend (``auto`` = guidance).
        tokenizer: the model's transformers tokenizer.
        vocab_size: the model's logits width V.
        eos_token_ids: ids that end a sequence (allowed where the constraint is complete).

    Thread safety: :meth:`compile` may be called from any thread (the server validates
    constraints before queueing, with a deadline); everything else runs on the engine's thread.
    """

    def __init__(self, config: StructuredOutputsConfig, tokenizer, vocab_size: int, eos_token_ids: set[int]) -> None:
        self.config = config
        self.backend_name = "guidance" if config.backend == "auto" else config.backend
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self._backend: StructuredOutputBackend | None = None
        self._cache: OrderedDict[tuple[str, str, str], CompiledConstraint] = OrderedDict()
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._compiling: dict[tuple[str, str, str], Future] = {}  # key -> its compile in flight
        self._compile_executor: ThreadPoolExecutor | None = None
        eos_bits = np.zeros((vocab_size + BITS_PER_WORD - 1) // BITS_PER_WORD, dtype=np.uint32)
        for t in self.eos_token_ids:
            if 0 <= t < vocab_size:
                eos_bits[t // BITS_PER_WORD] |= np.uint32(1 << (t % BITS_PER_WORD))
        self._not_eos = (~eos_bits).view(np.int32)  # [W]: every bit but the end-of-sequence tokens'
        # Metrics (read by the server's /metrics).
        self.requests_by_kind: Counter[str] = Counter()
        self.mask_seconds_total = 0.0
        self.mask_rows_total = 0
        self.mask_steps_total = 0

    @property
    def backend(self) -> StructuredOutputBackend:
        """The backend, built on first use (building its token tables takes a moment)."""
        with self._lock:
            if self._backend is None:
                self._backend = _build_backend(self.backend_name, self._tokenizer, self.vocab_size,
                                               set(self.eos_token_ids))
            return self._backend

    def compile(self, params: StructuredOutputsParams, timeout: float | None = None) -> CompiledConstraint:
        """The compiled constraint of ``params`` (from the cache when seen before).

        ``timeout``: None compiles on the calling thread. Otherwise the compile runs on one of
        ``COMPILE_THREADS`` worker threads and the caller waits at most ``timeout`` seconds (building
        the backend's token tables on first use is not counted); a compile past it goes on and its
        result is cached for later requests. A constraint already compiling is waited for, never
        compiled twice at once.

        Raises:
            ConstraintError: the constraint is invalid or cannot be enforced exactly.
            ConstraintTimeoutError (a ConstraintError): not compiled within ``timeout`` seconds.
        """
        backend = self.backend
        kind, spec = params.kind, params.spec()
        key = (backend.name, kind, spec)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled
            future = self._compiling.get(key)
            started = future is None
            if started:
                future = self._compiling[key] = Future()
                future.set_running_or_notify_cancel()
        if started:
            if timeout is None:
                self._compile_into(future, key, backend, kind, spec)
            else:
                if self._compile_executor is None:
                    with self._lock:
                        if self._compile_executor is None:
                            self._compile_executor = ThreadPoolExecutor(COMPILE_THREADS,
                                                                        thread_name_prefix="tokenmill-compile")
                self._compile_executor.submit(self._compile_into, future, key, backend, kind, spec)
        try:
            return future.result(timeout)
        except FutureTimeoutError:
            raise ConstraintTimeoutError(kind, f"it did not compile within {timeout:g} s") from None

    def _compile_into(self, future: Future, key: tuple[str, str, str], backend: StructuredOutputBackend,
                      kind: str, spec: str) -> None:
        """Compile (outside the lock: it may take a while), cache, and settle ``future``."""
        try:
            try:
                compiled = backend.compile(kind, spec)
            except RecursionError:  # a deeply nested schema or grammar (Python's json, jsonschema, gbnf_to_lark)
                raise ConstraintError(kind, "it is nested too deeply") from None
        except BaseException as exc:  # noqa: BLE001 - handed to every waiter
            with self._lock:
                del self._compiling[key]
            future.set_exception(exc)
            return
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
            del self._compiling[key]
        future.set_result(compiled)

    def cache_size(self) -> int:
        """How many compiled constraints are cached."""
        with self._lock:
            return len(self._cache)

    def new_matcher(self, params: StructuredOutputsParams) -> Matcher:
        """A fresh matcher for one sequence (``n > 1`` gives each sequence its own).

        Raises:
            ConstraintError: as :meth:`compile`.
        """
        matcher = self.backend.new_matcher(self.compile(params))
        self.requests_by_kind[params.kind] += 1
        return matcher

    def start_bitmask(self, scheduled_requests: list, num_scheduled_tokens: list[int],
                      spec_tokens: dict[str, list[int]] | None = None) -> GrammarBitmask | None:
        """Start filling the bitmask of every constrained request that samples this step (its
        scheduled tokens reach the end of its sequence) on the worker thread; None if there is none.
        ``spec_tokens`` (request id -> draft tokens it verifies) gives such a request one row per
        draft position and the bonus position (the matcher advances over the drafts, then rolls back).
        """
        req_indices = [
            i for i, (r, n) in enumerate(zip(scheduled_requests, num_scheduled_tokens))
            if r.grammar is not None and r.num_computed_tokens + n >= r.num_tokens
        ]
        if not req_indices:
            return None
        matchers = [scheduled_requests[i].grammar for i in req_indices]
        drafts = [spec_tokens.get(scheduled_requests[i].request_id, []) if spec_tokens else [] for i in req_indices]
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-grammar")
        num_rows = [len(d) + 1 for d in drafts] if any(drafts) else None
        return GrammarBitmask(req_indices, self._executor.submit(self._fill, matchers, drafts), num_rows)

    def valid_draft_prefix(self, matcher: Matcher, draft_token_ids: list[int]) -> int:
        """How many leading drafts the constraint allows from ``matcher``'s state (stopping after one
        that completes it); the matcher is left as it was."""
        n = 0
        for token_id in draft_token_ids:
            if not matcher.accept_token(token_id):
                break
            n += 1
            if matcher.is_terminated():
                break
        matcher.rollback(n)
        return n

    def _fill(self, matchers: list[Matcher], drafts: list[list[int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        t0 = time.perf_counter()
        backend = self.backend
        if not any(drafts):
            bitmask = backend.allocate_bitmask(len(matchers))
            backend.fill_bitmask(matchers, bitmask)
        else:  # row j of a request: its mask after accepting its first j drafts (validated by the proposer)
            counts = np.array([len(d) + 1 for d in drafts])
            first = np.cumsum(counts) - counts
            bitmask = backend.allocate_bitmask(int(counts.sum()))
            for j in range(int(counts.max())):
                active = [k for k in range(len(matchers)) if counts[k] > j]
                rows = backend.allocate_bitmask(len(active))
                backend.fill_bitmask([matchers[k] for k in active], rows)
                bitmask[first[active] + j] = rows
                for k in active:
                    if j < len(drafts[k]):
                        accepted = matchers[k].accept_token(drafts[k][j])
                        assert accepted, f"draft token {drafts[k][j]} was not checked against its constraint"
            for matcher, d in zip(matchers, drafts):
                matcher.rollback(len(d))
        allows_none = ~bitmask.any(axis=1)
        only_stop = ~(bitmask & self._not_eos).any(axis=1) & ~allows_none
        self.mask_seconds_total += time.perf_counter() - t0
        self.mask_rows_total += len(bitmask)
        self.mask_steps_total += 1
        return bitmask, only_stop, allows_none

    def close(self) -> None:
        """Stop the worker threads (a compile past its deadline is not waited for)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        if self._compile_executor is not None:
            self._compile_executor.shutdown(wait=False, cancel_futures=True)
            self._compile_executor = None


def _build_backend(name: str, tokenizer, vocab_size: int, eos_token_ids: set[int]) -> StructuredOutputBackend:
    if name == "guidance":
        from tokenmill.structured_output.guidance_backend import GuidanceBackend

        return GuidanceBackend(tokenizer, vocab_size, eos_token_ids)
    if name == "xgrammar":
        from tokenmill.structured_output.xgrammar_backend import XgrammarBackend

        return XgrammarBackend(tokenizer, vocab_size, eos_token_ids)
    raise ConstraintError("structured_outputs", f"unknown backend {name!r}; choose one of {BACKENDS}")
