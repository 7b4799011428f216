"""KVConnector: prefill/decode disaggregation inside one engine, in the shape of vLLM's KV connector
(scheduler side: how many prompt tokens arrive from elsewhere, what to do when a request finishes;
worker side: start loading, collect finished loads, lease and send).

Producer (``kv_role`` kv_producer or kv_both), for a request with ``kv_transfer_params``
``{"do_remote_decode": true}``: when it finishes, ``request_finished`` leases its blocks instead of
freeing them (``producer.py``) and puts where to pull them in ``request.kv_transfer_params_out``
(``do_remote_prefill``, ``remote_host``, ``remote_port``, ``remote_lease_id``, ``remote_num_tokens``);
``released`` hands back the requests whose leases were confirmed or expired, to be freed.

Consumer (kv_consumer or kv_both), for a request with ``{"do_remote_prefill": true, ...}``: on its
first scheduling, ``num_remote_tokens`` says how many prompt tokens (all but the last, after any
local prefix hit) to load; the scheduler allocates their blocks without indexing them and parks the
request; ``start_load`` pulls the lease on a worker thread; ``poll_loads`` (engine thread, between
steps) copies arrived blocks into the request's blocks and reports each load as done or failed. A
failed, corrupt or late load (``transfer_timeout_s``) makes the request compute its prompt locally,
counted by reason in ``stats.local_fallbacks``; ``stats.remote_tokens`` counts the prompt tokens that
really came from a producer, so a silent local prefill is visible.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import torch

from tokenmill.kv_transfer.config import KVTransferConfig
from tokenmill.kv_transfer.consumer import Expected, pull_blocks
from tokenmill.kv_transfer.producer import KVProducer
from tokenmill.kv_transfer.protocol import TransferError

logger = logging.getLogger(__name__)


@dataclass
class KVTransferStats:
    """Counters (the ``tokenmill:kv_transfer_*`` metrics)."""

    remote_prefill_requests: int = 0  # requests whose prompt KV came from a producer
    remote_tokens: int = 0  # prompt tokens loaded instead of computed
    bytes_received: int = 0
    transfer_seconds: float = 0.0
    local_fallbacks: dict[str, int] = field(default_factory=dict)  # reason -> requests computed locally


@dataclass
class _Load:
    request_id: str
    block_ids: list[int]
    first_block: int  # the first of the request's blocks to fill (after its local prefix hit)
    num_blocks: int  # how many blocks to fill from there
    started: float
    cancelled: bool = False


class KVConnector:
    """Both sides of KV transfer for one engine.

    Args:
        config: the ``--kv-transfer-config``.
        kv_cache: the engine's KV tensor ``(layers, 2, num_blocks, block_size, kv_heads, head_dim)``.
        block_size: tokens per block.
        fingerprint: returns the engine's model fingerprint (computed once, off the engine thread).
    """

    def __init__(self, config: KVTransferConfig, kv_cache: torch.Tensor, block_size: int,
                 fingerprint: Callable[[], str]) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.block_size = block_size
        self._fingerprint_fn = fingerprint
        self._fingerprint: str | None = None
        self._fingerprint_lock = threading.Lock()
        self.stats = KVTransferStats()
        self.producer: KVProducer | None = None
        if config.is_producer:
            self.producer = KVProducer(kv_cache, block_size, self.fingerprint, config.kv_ip, config.kv_port,
                                       config.lease_ttl_s)
        self._loads: dict[str, _Load] = {}
        self._arrived: queue.SimpleQueue = queue.SimpleQueue()  # (request_id, (meta, blocks, nbytes) | error)
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-pull") if config.is_consumer else None

    def fingerprint(self) -> str:
        with self._fingerprint_lock:
            if self._fingerprint is None:
                self._fingerprint = self._fingerprint_fn()
            return self._fingerprint

    # ---- consumer: scheduler side (engine thread) ------------------------------------------------
    def num_remote_tokens(self, request, num_hit_tokens: int) -> int:
        """Prompt tokens of a request's first scheduling to load from its producer (0: compute them).

        Only a fresh request (nothing computed, no output yet) whose ``kv_transfer_params`` ask for
        ``do_remote_prefill`` loads, once; the last prompt token is always computed here (its logits
        start the decode), so at most one prompt token is computed on this side.
        """
        params = request.kv_transfer_params
        if self._pool is None or not params or not params.get("do_remote_prefill") or request.remote_kv_tried:
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
                   extra_keys: tuple) -> None:
        """Pull the request's lease on a worker thread into ``block_ids`` (its blocks, hits first)."""
        params = request.kv_transfer_params
        first = num_hit_tokens // self.block_size
        end = -(-(num_hit_tokens + num_remote_tokens) // self.block_size)
        load = _Load(request.request_id, list(block_ids), first, end - first, time.monotonic())
        self._loads[request.request_id] = load
        kv = self.kv_cache
        prompt = list(request.prompt_token_ids)

        def pull():
            try:
                expected = Expected(self.fingerprint(), str(kv.dtype).removeprefix("torch."), self.block_size,
                                    [kv.shape[0], 2, self.block_size, kv.shape[4], kv.shape[5]], prompt,
                                    list(extra_keys))
                result = pull_blocks(str(params.get("remote_host")), int(params.get("remote_port")),
                                     str(params.get("remote_lease_id")), expected, self.config.transport,
                                     self.config.transfer_timeout_s, first_block=first)
            except TransferError as exc:
                result = exc
            except Exception as exc:  # noqa: BLE001 — bad params and the like: computed locally, logged
                result = TransferError("params", f"{type(exc).__name__}: {exc}")
            self._arrived.put((load.request_id, result))

        self._pool.submit(pull)

    def poll_loads(self) -> list[tuple[str, bool]]:
        """Loads that ended since the last call, as (request_id, ok); arrived blocks are copied into the
        requests' blocks first. Loads past ``transfer_timeout_s`` end as failed (their pull thread's
        late result is dropped). Engine thread, between steps."""
        done: list[tuple[str, bool]] = []
        while True:
            try:
                request_id, result = self._arrived.get_nowait()
            except queue.Empty:
                break
            load = self._loads.pop(request_id, None)
            if load is None or load.cancelled:
                continue
            if isinstance(result, TransferError):
                self._fallback(result.reason, request_id, str(result))
                done.append((request_id, False))
                continue
            meta, blocks, nbytes = result
            if blocks.shape[0] < load.num_blocks:  # the payload starts at the load's first block
                self._fallback("mismatch", request_id, f"{blocks.shape[0]} blocks arrived, {load.num_blocks} needed")
                done.append((request_id, False))
                continue
            source = blocks[: load.num_blocks].to(self.kv_cache.device)
            target = torch.tensor(load.block_ids[load.first_block: load.first_block + load.num_blocks],
                                  device=self.kv_cache.device)
            self.kv_cache[:, :, target] = source.permute(1, 2, 0, 3, 4, 5)  # (layers, 2, n, block_size, h, d)
            self.stats.remote_prefill_requests += 1
            self.stats.bytes_received += nbytes
            self.stats.transfer_seconds += time.monotonic() - load.started
            done.append((request_id, True))
        now = time.monotonic()
        for request_id, load in list(self._loads.items()):
            if now - load.started > self.config.transfer_timeout_s + 1.0:  # the pull's own timeout failed
                load.cancelled = True
                del self._loads[request_id]
                self._fallback("timeout", request_id, "no answer from the producer in time")
                done.append((request_id, False))
        return done

    def count_remote_tokens(self, num_tokens: int) -> None:
        self.stats.remote_tokens += num_tokens

    def cancel_load(self, request_id: str) -> None:
        """The request left while loading (abort): its late result is dropped."""
        load = self._loads.pop(request_id, None)
        if load is not None:
            load.cancelled = True

    def _fallback(self, reason: str, request_id: str, message: str) -> None:
        self.stats.local_fallbacks[reason] = self.stats.local_fallbacks.get(reason, 0) + 1
        logger.warning("request %s: remote KV not used (%s); computing its prompt here", request_id, message)

    # ---- producer: scheduler side (engine thread) ------------------------------------------------
    def request_finished(self, request, block_ids: list[int], extra_keys: tuple) -> bool:
        """Lease a finished ``do_remote_decode`` request's prompt blocks: True means the caller must not
        free them now (``released`` hands the request back later). Aborted or failed requests are not leased."""
        params = request.kv_transfer_params
        if self.producer is None or not params or not params.get("do_remote_decode"):
            return False
        if request.status.name not in ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED"):
            return False
        num_tokens = request.num_prompt_tokens  # every prompt token's K/V was computed here
        num_blocks = -(-num_tokens // self.block_size)
        if len(block_ids) < num_blocks:
            return False
        lease = self.producer.add_lease(request.request_id, block_ids[:num_blocks],
                                        list(request.prompt_token_ids), extra_keys)
        request.kv_transfer_params_out = {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_host": self.producer.host,
            "remote_port": self.producer.port, "remote_lease_id": lease.lease_id, "remote_num_tokens": num_tokens,
            "remote_block_ids": block_ids[:num_blocks], "remote_engine_id": f"{self.producer.host}:{self.producer.port}",
        }
        return True

    def released(self) -> list[str]:
        """Request ids whose leases ended (confirmed or expired): free their blocks now."""
        return self.producer.take_released() if self.producer is not None else []

    # ---- both -------------------------------------------------------------------------------
    @property
    def has_pending(self) -> bool:
        """Loads in flight or leases held: the engine must keep stepping to finish or free them."""
        return bool(self._loads) or (self.producer is not None and self.producer.num_leases > 0)

    def wait(self, timeout: float) -> None:
        """Block up to ``timeout`` seconds for a load to arrive (nothing else to run)."""
        if self._loads:
            try:
                item = self._arrived.get(timeout=timeout)
            except queue.Empty:
                return
            self._arrived.put(item)
        else:
            time.sleep(min(timeout, 0.05))

    def status(self) -> dict:
        """For /debug/status."""
        out = {"kv_role": self.config.kv_role, "kv_connector": self.config.kv_connector or "TokenmillConnector",
               "transport": self.config.transport, "loads_in_flight": len(self._loads),
               "remote_prefill_requests": self.stats.remote_prefill_requests,
               "remote_tokens": self.stats.remote_tokens, "bytes_received": self.stats.bytes_received,
               "transfer_seconds": round(self.stats.transfer_seconds, 6),
               "local_fallbacks": dict(self.stats.local_fallbacks)}
        if self.producer is not None:
            s = self.producer.stats
            out.update(producer_address=f"{self.producer.host}:{self.producer.port}", leases=self.producer.num_leases,
                       leases_total=s.leases_total, leases_expired_total=s.leases_expired_total,
                       transfers_total=s.transfers_total, bytes_sent_total=s.bytes_sent_total,
                       send_failures_total=s.send_failures_total)
        return out

    def close(self) -> list[str]:
        """Stop the producer server and the pull threads; returns request ids still leased."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        return self.producer.close() if self.producer is not None else []
