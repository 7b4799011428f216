"""KVConnector: prefill/decode disaggregation inside one engine, split as vLLM's KV connector is: a torch-free
scheduler half (``scheduler_side.KVConnectorScheduler``: how many prompt tokens arrive from elsewhere, which
loads ended, what to do when a request finishes) that the ``Scheduler`` is built with, and a worker half
(``worker_side.KVConnectorWorker``: pulls, copies through the KV pool, serves leases) that the engine runs
beside the KV tiers' copies before each schedule. ``KVConnector`` holds both for the engine and reports them.

Producer (``kv_role`` kv_producer or kv_both), for a request with ``kv_transfer_params``
``{"do_remote_decode": true}``: when it finishes, ``request_finished`` leases its blocks instead of
freeing them (``producer.py``) and puts where to pull them in ``request.kv_transfer_params_out``
(``do_remote_prefill``, ``remote_host``, ``remote_port``, ``remote_lease_id``, ``remote_num_tokens``);
``released`` hands back the requests whose leases were confirmed or expired, to be freed.

Consumer (kv_consumer or kv_both), for a request with ``{"do_remote_prefill": true, ...}``: on its
first scheduling, ``num_remote_tokens`` says how many prompt tokens (all but the last, after any
local prefix hit) to load; the scheduler allocates their blocks without indexing them, parks the
request and plans a ``KVLoad``; the worker half pulls the lease on a thread and, on the engine thread before
the next schedule, copies the arrived blocks into the request's blocks; the scheduler half then reports the
load as done or failed. A failed, corrupt or late load (``transfer_timeout_s``) makes the request compute its
prompt locally, counted by reason in ``stats.local_fallbacks``; ``stats.remote_tokens`` counts the prompt
tokens that really came from a producer, so a silent local prefill is visible.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from tokenmill.kv_transfer.config import KVTransferConfig
from tokenmill.kv_transfer.params_auth import RELEASE_PURPOSE, SignedParamsVerifier
from tokenmill.kv_transfer.scheduler_side import KVConnectorScheduler, KVLoad, KVTransferStats
from tokenmill.kv_transfer.worker_side import KVConnectorWorker

if TYPE_CHECKING:
    from tokenmill.runner.kv_pool import KVPool

__all__ = ["KVConnector", "KVTransferStats"]


class KVConnector:
    """Both halves of KV transfer for one engine.

    Args:
        config: the ``--kv-transfer-config``.
        pool: the engine's ``KVPool``.
        block_size: tokens per block.
        fingerprint: returns the engine's model fingerprint (computed once, off the engine thread).

    Raises:
        tokenmill.security.SecretError: the cluster secret (``secret_file`` or the default sources) is unusable.
    """

    def __init__(self, config: KVTransferConfig, pool: KVPool, block_size: int,
                 fingerprint: Callable[[], str]) -> None:
        from tokenmill.security import load_cluster_secret

        self.config = config
        secret = load_cluster_secret(file=config.secret_file)
        self.params_verifier = SignedParamsVerifier(secret)
        self.worker = KVConnectorWorker(config, pool, block_size, fingerprint, secret)
        self.scheduler_side = KVConnectorScheduler(config, block_size, self.worker.producer)

    @property
    def stats(self) -> KVTransferStats:
        return self.scheduler_side.stats

    @property
    def producer(self):
        """The producer's lease server (kv_producer / kv_both), else None."""
        return self.worker.producer

    def verify_params(self, params: dict) -> dict:
        """``kv_transfer_params`` from the HTTP API, without their signature, once it checks out.

        Raises:
            tokenmill.security.AuthError: not signed with the cluster secret, stale, or replayed.
        """
        return self.params_verifier.verify(params)

    def release_lease(self, request: dict) -> bool:
        """Free a lease early at the PD router's word: ``request`` is ``{"lease_id", "nonce"}`` signed with the
        cluster secret for the purpose ``RELEASE_PURPOSE`` (``sign_params``). Whether a lease was released
        (False: unknown, already pulled, being sent, or this worker is no producer).

        Raises:
            tokenmill.security.AuthError: not signed with the cluster secret, stale, or replayed.
        """
        lease_id = self.params_verifier.verify(request, RELEASE_PURPOSE).get("lease_id")
        return self.producer is not None and isinstance(lease_id, str) and self.producer.release(lease_id)

    def before_schedule(self) -> None:
        """Engine thread, before ``Scheduler.schedule``: arrived K/V into its blocks (cancelled loads dropped
        first), then the ended loads to the scheduler half."""
        self.scheduler_side.loads_finished(self.worker.collect(self.scheduler_side.take_cancelled()))

    def after_schedule(self, loads: list[KVLoad]) -> None:
        """Engine thread, after ``Scheduler.schedule``: start the pulls it planned."""
        if loads:
            self.worker.start_loads(loads)

    @property
    def has_pending(self) -> bool:
        """Loads in flight or leases held: the engine must keep stepping to finish or free them."""
        return self.scheduler_side.has_pending

    def wait(self, timeout: float) -> None:
        """Block up to ``timeout`` seconds for a load to arrive (nothing else to run)."""
        self.worker.wait(timeout)

    def status(self) -> dict:
        """For /debug/status."""
        stats = self.stats
        out = {"kv_role": self.config.kv_role, "kv_connector": self.config.kv_connector or "TokenmillConnector",
               "transport": self.config.transport, "loads_in_flight": self.scheduler_side.num_loads,
               "remote_prefill_requests": stats.remote_prefill_requests,
               "remote_tokens": stats.remote_tokens, "bytes_received": stats.bytes_received,
               "transfer_seconds": round(stats.transfer_seconds, 6),
               "local_fallbacks": dict(stats.local_fallbacks)}
        if self.producer is not None:
            s = self.producer.stats
            out.update(producer_address=f"{self.producer.host}:{self.producer.port}", leases=self.producer.num_leases,
                       leases_total=s.leases_total, leases_expired_total=s.leases_expired_total,
                       transfers_total=s.transfers_total, bytes_sent_total=s.bytes_sent_total,
                       send_failures_total=s.send_failures_total, leases_refused_total=s.leases_refused_total,
                       connections=self.producer.num_connections,
                       connections_refused_total=s.connections_refused_total,
                       leases_released_total=s.leases_released_total,
                       handshakes_evicted_total=s.handshakes_evicted_total,
                       auth_failures_total=s.auth_failures_total)
        return out

    def close(self) -> list[str]:
        """Stop the producer server and the pull threads; returns request ids still leased."""
        return self.worker.close()
