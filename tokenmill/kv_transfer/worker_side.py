"""The worker half of the KV connector: pulls on worker threads, copies through the KV pool, serves leases.

``start_loads`` starts a pull per ``KVLoad`` the scheduler half planned (``consumer.pull_blocks`` on a
thread of its own); ``collect`` runs on the engine thread before each schedule, beside the KV tiers' copies:
it first drops the loads the scheduler half cancelled, then copies every arrived payload into its request's
blocks with ``KVPool.scatter`` and returns how each load ended (``KVLoadResult``). The producer's server
(``producer.KVProducer``) answers other engines' pulls from the same pool. Nothing here decides what a
request does next: that is the scheduler half's (``scheduler_side.py``).
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from tokenmill.kv_transfer.config import KVTransferConfig
from tokenmill.kv_transfer.consumer import Expected, pull_blocks
from tokenmill.kv_transfer.producer import KVProducer
from tokenmill.kv_transfer.protocol import TransferError
from tokenmill.kv_transfer.scheduler_side import KVLoad, KVLoadResult

if TYPE_CHECKING:
    from tokenmill.runner.kv_pool import KVPool


class KVConnectorWorker:
    """Worker half of KV transfer for one engine.

    Args:
        config: the ``--kv-transfer-config``.
        pool: the engine's KV pool (every block copy goes through it).
        block_size: tokens per block.
        fingerprint: returns the engine's model fingerprint (computed once, off the engine thread).
        secret: the cluster secret (every frame to and from a producer is signed with it).
    """

    def __init__(self, config: KVTransferConfig, pool: KVPool, block_size: int,
                 fingerprint: Callable[[], str], secret: bytes) -> None:
        self.config = config
        self._secret = secret
        self.pool = pool
        self.block_size = block_size
        self._fingerprint_fn = fingerprint
        self._fingerprint: str | None = None
        self._fingerprint_lock = threading.Lock()
        self.producer: KVProducer | None = None
        if config.is_producer:
            self.producer = KVProducer(pool, block_size, self.fingerprint, config.kv_ip, config.kv_port,
                                       config.lease_ttl_s, secret=secret, max_connections=config.max_connections,
                                       max_leases=config.max_leases, max_lease_blocks=config.max_lease_blocks,
                                       transfer_timeout_s=config.transfer_timeout_s,
                                       allowed_consumers=config.allowed_consumers)
        self._active: dict[str, KVLoad] = {}
        self._arrived: queue.SimpleQueue = queue.SimpleQueue()  # (request_id, (meta, rows, nbytes) | error)
        self._threads = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-pull") if config.is_consumer else None

    def fingerprint(self) -> str:
        with self._fingerprint_lock:
            if self._fingerprint is None:
                self._fingerprint = self._fingerprint_fn()
            return self._fingerprint

    def start_loads(self, loads: list[KVLoad]) -> None:
        """Pull each planned load's lease on a worker thread."""
        for load in loads:
            self._active[load.request_id] = load
            self._threads.submit(self._pull, load)

    def _pull(self, load: KVLoad) -> None:  # a pull thread
        params, pool = load.params, self.pool
        try:
            expected = Expected(self.fingerprint(), pool.dtype_name, self.block_size, list(pool.block_shape),
                                pool.block_bytes, load.prompt_token_ids, list(load.extra_keys))
            host, port, lease_id = params.get("remote_host"), params.get("remote_port"), params.get("remote_lease_id")
            if not isinstance(host, str) or not host or isinstance(port, bool) or not isinstance(port, int) \
                    or not 0 < port < 65536 or not isinstance(lease_id, str) or not 0 < len(lease_id) <= 128:
                raise TransferError("params", "remote_host, remote_port or remote_lease_id is missing or malformed")
            result = pull_blocks(host, port, lease_id, expected, self.config.transport,
                                 self.config.transfer_timeout_s, first_block=load.first_block, secret=self._secret,
                                 num_blocks=load.num_blocks, allowed_producers=self.config.allowed_producers)
        except TransferError as exc:
            result = exc
        except Exception as exc:  # noqa: BLE001 — bad params and the like: computed locally, logged
            result = TransferError("params", f"{type(exc).__name__}: {exc}")
        self._arrived.put((load.request_id, result))

    def collect(self, cancelled: list[str]) -> list[KVLoadResult]:
        """Engine thread, before planning: forget the ``cancelled`` loads (their late results are dropped),
        copy every other arrived payload into its request's blocks, and say how each load ended."""
        for request_id in cancelled:
            self._active.pop(request_id, None)
        ended = []
        while True:
            try:
                request_id, result = self._arrived.get_nowait()
            except queue.Empty:
                return ended
            load = self._active.pop(request_id, None)
            if load is None:
                continue
            if isinstance(result, TransferError):
                ended.append(KVLoadResult(request_id, False, result.reason, str(result)))
                continue
            meta, rows, nbytes = result
            if rows.shape[0] < load.num_blocks:  # the payload starts at the load's first block
                ended.append(KVLoadResult(request_id, False, "mismatch",
                                          f"{rows.shape[0]} blocks arrived, {load.num_blocks} needed"))
                continue
            self.pool.scatter(load.block_ids[load.first_block: load.first_block + load.num_blocks],
                              rows[: load.num_blocks])
            ended.append(KVLoadResult(request_id, True, nbytes=nbytes))

    def wait(self, timeout: float) -> None:
        """Block up to ``timeout`` seconds for a load to arrive (nothing else to run)."""
        if self._active:
            try:
                item = self._arrived.get(timeout=timeout)
            except queue.Empty:
                return
            self._arrived.put(item)
        else:
            time.sleep(min(timeout, 0.05))

    def close(self) -> list[str]:
        """Stop the producer server and the pull threads; returns request ids still leased."""
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)
        return self.producer.close() if self.producer is not None else []
