"""The prefill side of a KV transfer: leases on finished prompts' blocks and the server that hands them out.

When a request marked ``do_remote_decode`` finishes, its blocks are not freed: the engine thread
takes a lease (``add_lease``) that pins them, and the request's answer says where to pull them from.
A server thread answers pulls (``protocol.py``) by copying the pinned blocks out of the KV tensor,
over the socket or through a ``/dev/shm`` file, and marks the lease done when the consumer confirms.
A lease that nobody confirms expires after ``lease_ttl_s``. Each step the engine thread calls
``take_released`` and frees the blocks of every done or expired lease, so nothing leaks whatever the
consumer does. Reading pinned blocks from the server thread is safe: no step writes a block while a
lease holds a reference to it.
"""
from __future__ import annotations

import hashlib
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tokenmill.kv_cache.block_hash import extend_block_hashes
from tokenmill.kv_transfer.protocol import TransferError, TransferMeta, recv_frame, send_frame

if TYPE_CHECKING:
    from tokenmill.runner.kv_pool import KVPool

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
SOCKET_TIMEOUT_S = 30.0  # a consumer that stalls this long mid-transfer is dropped


@dataclass
class Lease:
    """Pinned blocks of one finished prefill (``state``: leased, sending, done, expired)."""

    lease_id: str
    request_id: str
    block_ids: list[int]
    num_tokens: int
    token_ids: list[int]
    extra_keys: list
    expires_at: float
    state: str = "leased"
    shm_path: Path | None = None
    created: float = field(default_factory=time.monotonic)


@dataclass
class ProducerStats:
    """Counters of the producer side (read by /metrics)."""

    leases_total: int = 0
    transfers_total: int = 0
    bytes_sent_total: int = 0
    leases_expired_total: int = 0
    send_failures_total: int = 0


class KVProducer:
    """Leases and the pull server of one prefill worker.

    Args:
        pool: the engine's ``KVPool`` (blocks leave as its byte rows).
        block_size: tokens per block.
        fingerprint: returns the model fingerprint (called once, on the first pull, from the server thread).
        host, port: where the server listens (port 0: any free port; see ``address``).
        lease_ttl_s: seconds a lease waits for its consumer before its blocks are freed.
    """

    def __init__(self, pool: KVPool, block_size: int, fingerprint: Callable[[], str], host: str = "127.0.0.1",
                 port: int = 0, lease_ttl_s: float = 30.0) -> None:
        self.pool = pool
        self.block_size = block_size
        self._fingerprint_fn = fingerprint
        self._fingerprint: str | None = None
        self.lease_ttl_s = lease_ttl_s
        self.stats = ProducerStats()
        self._leases: dict[str, Lease] = {}
        self._lock = threading.Lock()
        self._sock = socket.create_server((host, port), reuse_port=False)
        self._sock.settimeout(0.2)
        self.host, self.port = host, self._sock.getsockname()[1]
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-transfer-producer", daemon=True)
        self._thread.start()

    # ---- engine thread ---------------------------------------------------------------------------
    def add_lease(self, request_id: str, block_ids: list[int], token_ids: list[int], extra_keys: tuple) -> Lease:
        """Pin a finished prefill's blocks (the caller keeps their references until ``take_released``)."""
        lease = Lease(uuid.uuid4().hex, request_id, list(block_ids), len(token_ids), list(token_ids),
                      list(extra_keys), time.monotonic() + self.lease_ttl_s)
        with self._lock:
            self._leases[lease.lease_id] = lease
            self.stats.leases_total += 1
        return lease

    def take_released(self, now: float | None = None) -> list[str]:
        """Request ids whose leases are done (confirmed) or expired: free their blocks now."""
        now = time.monotonic() if now is None else now
        released = []
        with self._lock:
            for lease_id, lease in list(self._leases.items()):
                if lease.state == "leased" and now > lease.expires_at:
                    lease.state = "expired"
                    self.stats.leases_expired_total += 1
                    logger.warning("KV lease %s of %s expired after %.0f s unclaimed: blocks freed",
                                   lease_id, lease.request_id, self.lease_ttl_s)
                if lease.state in ("done", "expired"):
                    del self._leases[lease_id]
                    released.append(lease.request_id)
                    if lease.shm_path is not None:
                        lease.shm_path.unlink(missing_ok=True)
        return released

    @property
    def num_leases(self) -> int:
        with self._lock:
            return len(self._leases)

    def close(self) -> list[str]:
        """Stop serving; returns the request ids still leased (the caller frees them)."""
        self._closed.set()
        self._thread.join(timeout=5)
        self._sock.close()
        with self._lock:
            leases, self._leases = list(self._leases.values()), {}
        for lease in leases:
            if lease.shm_path is not None:
                lease.shm_path.unlink(missing_ok=True)
        return [lease.request_id for lease in leases]

    # ---- server thread ---------------------------------------------------------------------------
    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), name="kv-transfer-send", daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        lease: Lease | None = None
        with conn:
            conn.settimeout(SOCKET_TIMEOUT_S)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                request = recv_frame(conn)
                if request.get("op") != "pull":
                    send_frame(conn, {"ok": False, "error": f"unknown op {request.get('op')!r}"})
                    return
                with self._lock:
                    lease = self._leases.get(str(request.get("lease_id")))
                    if lease is None or lease.state != "leased":
                        why = "unknown" if lease is None else lease.state
                        lease = None
                    else:
                        lease.state = "sending"
                if lease is None:
                    send_frame(conn, {"ok": False, "error": f"lease {request.get('lease_id')!r} is {why}"})
                    return
                first_block = request.get("first_block", 0)
                if not isinstance(first_block, int) or not 0 <= first_block < len(lease.block_ids):
                    send_frame(conn, {"ok": False, "error": f"first_block {first_block!r} is not a block of the lease"})
                    return
                self._send(conn, lease, request.get("transport") == "shm", first_block)
                confirm = recv_frame(conn)
                if confirm.get("op") != "confirm" or confirm.get("lease_id") != lease.lease_id:
                    raise TransferError("protocol", f"expected a confirm of {lease.lease_id}, got {confirm}")
                with self._lock:
                    lease.state = "done"  # before the answer: a consumer that got it finds the lease released
                send_frame(conn, {"ok": True})
            except (TransferError, OSError) as exc:
                self.stats.send_failures_total += 1
                logger.warning("KV transfer of lease %s failed: %s", lease.lease_id if lease else "?", exc)
            finally:
                if lease is not None:
                    with self._lock:  # sent or not, the consumer had its chance: free the blocks
                        lease.state = "done"

    def _send(self, conn: socket.socket, lease: Lease, use_shm: bool, first_block: int) -> None:
        rows = self.pool.gather(lease.block_ids[first_block:]).cpu()  # (n, block_bytes) uint8
        data = memoryview(rows.reshape(-1).numpy())
        if self._fingerprint is None:
            self._fingerprint = self._fingerprint_fn()
        chain: list[int] = []
        extend_block_hashes(chain, lease.token_ids, self.block_size, tuple(lease.extra_keys))
        meta = TransferMeta(lease.num_tokens, lease.token_ids, lease.extra_keys, [f"{h:016x}" for h in chain],
                            self._fingerprint,
                            self.pool.dtype_name, self.block_size, list(self.pool.block_shape), self.pool.block_bytes,
                            first_block, rows.shape[0], hashlib.sha256(data).hexdigest())
        reply = {"ok": True, "meta": meta.as_dict(), "nbytes": len(data)}
        if use_shm and SHM_DIR.is_dir():
            path = SHM_DIR / f"tokenmill-kv-{os.getpid()}-{lease.lease_id}"
            with open(path, "wb") as f:
                f.write(data)
            lease.shm_path = path
            send_frame(conn, {**reply, "shm_path": str(path)})
        else:
            send_frame(conn, reply, data)
        self.stats.transfers_total += 1
        self.stats.bytes_sent_total += len(data)
