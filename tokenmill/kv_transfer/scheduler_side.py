"""The scheduler half of the KV connector: which prompt tokens arrive from a producer, which loads ended, and
what happens to a finished request's blocks. Torch-free: it never sees a byte of K/V.

The split follows vLLM's KV connector (a scheduler-side object the scheduler asks, a worker-side object that
moves bytes). ``Scheduler`` takes this object as its ``connector`` argument. Per engine step:

1. the engine hands the worker half's ended loads (``KVLoadResult``; their bytes already copied into the KV
   pool by then) to ``loads_finished``;
2. ``Scheduler.schedule`` asks ``num_remote_tokens`` for a new request and, when it parks one, ``start_load``
   returns a ``KVLoad`` that goes out in ``SchedulerOutput.kv_loads``; ``poll_loads`` reports loads that
   ended (or timed out) so the scheduler requeues their requests;
3. the engine gives ``SchedulerOutput.kv_loads`` to the worker half, which starts the pulls.

Loads cancelled here (an abort, a timeout) are handed to the worker half (``take_cancelled``) before it copies
anything again, so a late pull never writes into blocks that were freed. Producer side: ``request_finished``
leases a finished ``do_remote_decode`` request's blocks through the worker half's lease table (``Leases``) and
``released`` hands back the requests whose leases ended, to be freed.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

from tokenmill.kv_transfer.config import KVTransferConfig

logger = logging.getLogger(__name__)


@dataclass
class KVTransferStats:
    """Counters (the ``tokenmill:kv_transfer_*`` metrics)."""

    remote_prefill_requests: int = 0  # requests whose prompt KV came from a producer
    remote_tokens: int = 0  # prompt tokens loaded instead of computed
    bytes_received: int = 0
    transfer_seconds: float = 0.0
    local_fallbacks: dict[str, int] = field(default_factory=dict)  # reason -> requests computed locally


@dataclass(frozen=True)
class KVLoad:
    """A pull for the worker half: lease ``params`` (the request's ``kv_transfer_params``) into
    ``block_ids[first_block : first_block + num_blocks]`` (the request's blocks, local prefix hits first)."""

    request_id: str
    params: dict
    block_ids: list[int]
    first_block: int
    num_blocks: int
    prompt_token_ids: list[int]
    extra_keys: list


@dataclass(frozen=True)
class KVLoadResult:
    """How a load ended in the worker half: ``ok`` (its bytes are in the pool), else ``reason`` and
    ``message``; ``nbytes`` moved."""

    request_id: str
    ok: bool
    reason: str = ""
    message: str = ""
    nbytes: int = 0


class Leases(Protocol):
    """The producer's lease table as the scheduler half uses it (``producer.KVProducer``)."""

    host: str
    port: int

    def add_lease(self, request_id: str, block_ids: list[int], token_ids: list[int], extra_keys: tuple):
        """A lease, or None when the producer's caps refuse it."""

    def take_released(self) -> list[str]: ...

    @property
    def num_leases(self) -> int: ...


@dataclass
class _Load:
    request_id: str
    started: float


class KVConnectorScheduler:
    """Scheduler half of KV transfer for one engine.

    Args:
        config: the ``--kv-transfer-config``.
        block_size: tokens per block.
        leases: the producer's lease table (kv_producer / kv_both), else None.
    """

    def __init__(self, config: KVTransferConfig, block_size: int, leases: Leases | None = None) -> None:
        self.config = config
        self.block_size = block_size
        self.leases = leases
        self.stats = KVTransferStats()
        self._loads: dict[str, _Load] = {}
        self._ended: list[tuple[str, bool]] = []
        self._cancelled: list[str] = []

    # ---- consumer --------------------------------------------------------------------------------
    def num_remote_tokens(self, request, num_hit_tokens: int) -> int:
        """Prompt tokens of a request's first scheduling to load from its producer (0: compute them).

        Only a fresh request (nothing computed, no output yet) whose ``kv_transfer_params`` ask for
        ``do_remote_prefill`` loads, once; the last prompt token is always computed here (its logits
        start the decode), so at most one prompt token is computed on this side.
        """
        params = request.kv_transfer_params
        if not self.config.is_consumer or not params or not params.get("do_remote_prefill") or request.remote_kv_tried:
            return 0
        if request.num_computed_tokens or request.num_output_tokens:
            return 0
        request.remote_kv_tried = True
        remote_num_tokens = params.get("remote_num_tokens")
        if not isinstance(remote_num_tokens, int) or remote_num_tokens < request.num_prompt_tokens - 1:
            self._fallback("params", request.request_id, f"remote_num_tokens {remote_num_tokens!r} does not cover "
                                                          f"the prompt ({request.num_prompt_tokens} tokens)")
            return 0
        return max(0, request.num_prompt_tokens - 1 - num_hit_tokens)

    def start_load(self, request, num_hit_tokens: int, num_remote_tokens: int, block_ids: list[int],
                   extra_keys: tuple) -> KVLoad:
        """Record a load of the request's remote tokens into ``block_ids`` (its blocks, hits first); the
        returned ``KVLoad`` goes to the worker half through ``SchedulerOutput.kv_loads``."""
        first = num_hit_tokens // self.block_size
        end = -(-(num_hit_tokens + num_remote_tokens) // self.block_size)
        self._loads[request.request_id] = _Load(request.request_id, time.monotonic())
        return KVLoad(request.request_id, dict(request.kv_transfer_params), list(block_ids), first, end - first,
                      list(request.prompt_token_ids), list(extra_keys))

    def loads_finished(self, results: list[KVLoadResult]) -> None:
        """Take the worker half's ended loads (bytes already in the pool); ``poll_loads`` reports them."""
        now = time.monotonic()
        for result in results:
            load = self._loads.pop(result.request_id, None)
            if load is None:  # cancelled meanwhile: dropped
                continue
            if result.ok:
                self.stats.remote_prefill_requests += 1
                self.stats.bytes_received += result.nbytes
                self.stats.transfer_seconds += now - load.started
            else:
                self._fallback(result.reason, result.request_id, result.message)
            self._ended.append((result.request_id, result.ok))

    def poll_loads(self) -> list[tuple[str, bool]]:
        """Loads that ended since the last call, as (request_id, ok). Loads past ``transfer_timeout_s`` end as
        failed here and are cancelled in the worker half (a late result is dropped)."""
        ended, self._ended = self._ended, []
        now = time.monotonic()
        for request_id, load in list(self._loads.items()):
            if now - load.started > self.config.transfer_timeout_s + 1.0:  # the pull's own timeout failed
                self.cancel_load(request_id)
                self._fallback("timeout", request_id, "no answer from the producer in time")
                ended.append((request_id, False))
        return ended

    def cancel_load(self, request_id: str) -> None:
        """The request left while loading (abort, timeout): the worker half drops its result."""
        if self._loads.pop(request_id, None) is not None:
            self._cancelled.append(request_id)

    def take_cancelled(self) -> list[str]:
        """Loads cancelled since the last call (for the worker half, before it copies anything)."""
        cancelled, self._cancelled = self._cancelled, []
        return cancelled

    def count_remote_tokens(self, num_tokens: int) -> None:
        self.stats.remote_tokens += num_tokens

    def _fallback(self, reason: str, request_id: str, message: str) -> None:
        self.stats.local_fallbacks[reason] = self.stats.local_fallbacks.get(reason, 0) + 1
        logger.warning("request %s: remote KV not used (%s); computing its prompt here", request_id, message)

    # ---- producer --------------------------------------------------------------------------------
    def request_finished(self, request, block_ids: list[int], extra_keys: tuple) -> bool:
        """Lease a finished ``do_remote_decode`` request's prompt blocks: True means the caller must not
        free them now (``released`` hands the request back later). Aborted or failed requests are not leased, nor
        any over the producer's ``max_leases`` / ``max_lease_blocks`` (the answer then has no parameters)."""
        params = request.kv_transfer_params
        if self.leases is None or not params or not params.get("do_remote_decode"):
            return False
        if request.status.name not in ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED"):
            return False
        num_tokens = request.num_prompt_tokens  # every prompt token's K/V was computed here
        num_blocks = -(-num_tokens // self.block_size)
        if len(block_ids) < num_blocks:
            return False
        lease = self.leases.add_lease(request.request_id, block_ids[:num_blocks], list(request.prompt_token_ids),
                                      extra_keys)
        if lease is None:
            return False
        host, port = self.leases.host, self.leases.port
        request.kv_transfer_params_out = {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_host": host, "remote_port": port,
            "remote_lease_id": lease.lease_id, "remote_num_tokens": num_tokens,
            "remote_block_ids": block_ids[:num_blocks], "remote_engine_id": f"{host}:{port}",
        }
        return True

    def released(self) -> list[str]:
        """Request ids whose leases ended (confirmed or expired): free their blocks now."""
        return self.leases.take_released() if self.leases is not None else []

    # ---- both ------------------------------------------------------------------------------------
    @property
    def num_loads(self) -> int:
        """Loads in flight."""
        return len(self._loads)

    @property
    def has_pending(self) -> bool:
        """Loads in flight or leases held: the engine must keep stepping to finish or free them."""
        return bool(self._loads) or (self.leases is not None and self.leases.num_leases > 0)
