"""The prefill side of a KV transfer: leases on finished prompts' blocks and the server that hands them out.

When a request marked ``do_remote_decode`` finishes, its blocks are not freed: the engine thread
takes a lease (``add_lease``) that pins them, and the request's answer says where to pull them from.
A server thread answers pulls (``protocol.py``) by copying the pinned blocks out of the KV tensor,
over the socket or through a ``/dev/shm`` file, and marks the lease done when the consumer confirms.
A lease that nobody confirms expires after ``lease_ttl_s``. Each step the engine thread calls
``take_released`` and frees the blocks of every done or expired lease, so nothing leaks whatever the
consumer does. Reading pinned blocks from the server thread is safe: no step writes a block while a
lease holds a reference to it.

Nobody without the cluster secret gets anything: a connection first answers the producer's nonce with a
signed pull (within ``HANDSHAKE_TIMEOUT_S``, in a frame of at most ``REQUEST_FRAME_MAX`` bytes) or is closed.
Connections not yet authenticated wait in their own small pool (``max_handshakes``); when it is full the
oldest one of the address holding the most is closed to admit the newcomer, so idle anonymous connections
never use the capacity of authenticated ones, and a consumer that signs within milliseconds gets through
however many an attacker opens. At most ``max_connections`` authenticated transfers are served at once (a
pull beyond is answered "busy"), each by one thread and under one deadline. With ``allowed_consumers`` a
connection from any other address is closed on accept. Leases are capped in number (``max_leases``) and in
pinned blocks (``max_lease_blocks``): a finished prefill over a cap is not leased (its consumer computes the
prompt). Shared-memory files are created 0600 with random names that carry the producer's pid, so a
starting producer removes the files of producers that died (``remove_stale_shm_files``).
"""
from __future__ import annotations

import hashlib
import ipaddress
import logging
import os
import secrets
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tokenmill.kv_cache.block_hash import extend_block_hashes
from tokenmill.kv_transfer.protocol import (
    REQUEST_FRAME_MAX, TransferError, TransferMeta, frame_is_signed, is_nonce, new_nonce, recv_frame, send_frame,
    sign_frame,
)

if TYPE_CHECKING:
    from tokenmill.runner.kv_pool import KVPool

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "tokenmill-kv-"  # then "<creator pid>-<32 random hex>"
HANDSHAKE_TIMEOUT_S = 1.0  # a connection must present a signed pull this soon (a consumer takes milliseconds)


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
    """Counters of the producer side (read by /metrics and /debug/status)."""

    leases_total: int = 0
    transfers_total: int = 0
    bytes_sent_total: int = 0
    leases_expired_total: int = 0
    send_failures_total: int = 0
    leases_refused_total: int = 0  # finished prefills not leased: over max_leases or max_lease_blocks
    connections_refused_total: int = 0  # not served: outside allowed_consumers, or signed pulls over max_connections
    handshakes_evicted_total: int = 0  # unauthenticated connections closed to admit a newer one (max_handshakes)
    auth_failures_total: int = 0  # connections that never presented a signed pull
    leases_released_total: int = 0  # leases given up before any pull (``release``: the request failed downstream)


def write_shm_file(data: bytes | memoryview, shm_dir: Path = SHM_DIR) -> Path:
    """``data`` in a new file ``<shm_dir>/tokenmill-kv-<pid>-<random>``, mode 0600, never an existing path."""
    path = shm_dir / f"{SHM_PREFIX}{os.getpid()}-{secrets.token_hex(16)}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | os.O_CLOEXEC, 0o600)
    try:
        with open(fd, "wb", closefd=False) as f:
            f.write(data)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)
    return path


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_stale_shm_files(shm_dir: Path = SHM_DIR) -> list[Path]:
    """Remove this user's transfer files whose creating process is dead (left by a crash); returns them."""
    removed = []
    try:
        entries = list(shm_dir.glob(f"{SHM_PREFIX}*"))
    except OSError:
        return removed
    for path in entries:
        pid_text = path.name[len(SHM_PREFIX):].split("-", 1)[0]
        if not pid_text.isdigit() or int(pid_text) == os.getpid():
            continue
        try:
            if path.lstat().st_uid != os.getuid() or _pid_alive(int(pid_text)):
                continue
            path.unlink()
        except OSError:
            continue
        removed.append(path)
    if removed:
        logger.info("removed %d KV transfer files left in %s by dead processes", len(removed), shm_dir)
    return removed


class KVProducer:
    """Leases and the pull server of one prefill worker.

    Args:
        pool: the engine's ``KVPool`` (blocks leave as its byte rows).
        block_size: tokens per block.
        fingerprint: returns the model fingerprint (called once, on the first pull, from the server thread).
        host, port: where the server listens (port 0: any free port; see ``address``).
        lease_ttl_s: seconds a lease waits for its consumer before its blocks are freed.
        secret: the cluster secret (every pull and confirm must be signed with it).
        max_connections: authenticated transfers served at once (a signed pull beyond gets "busy").
        max_handshakes: connections not yet authenticated kept at once (None: ``max_connections``); when full,
            the oldest of the address holding the most is closed to admit a new one.
        allowed_consumers: networks (CIDRs; a bare address is one host) a connection may come from (None: any).
        max_leases: leases held at once.
        max_lease_blocks: blocks leases may pin at once (None: half the pool).
        transfer_timeout_s: the deadline of one connection after its signed pull.
    """

    def __init__(self, pool: KVPool, block_size: int, fingerprint: Callable[[], str], host: str = "127.0.0.1",
                 port: int = 0, lease_ttl_s: float = 30.0, *, secret: bytes, max_connections: int = 16,
                 max_leases: int = 64, max_lease_blocks: int | None = None, transfer_timeout_s: float = 30.0,
                 max_handshakes: int | None = None, allowed_consumers: tuple[str, ...] | None = None) -> None:
        self.pool = pool
        self.block_size = block_size
        self._fingerprint_fn = fingerprint
        self._fingerprint: str | None = None
        self.lease_ttl_s = lease_ttl_s
        self._secret = secret
        self.max_connections = max_connections
        self.max_handshakes = max_connections if max_handshakes is None else max_handshakes
        self.allowed_consumers = None if allowed_consumers is None else tuple(
            ipaddress.ip_network(entry, strict=False) for entry in allowed_consumers)
        self.max_leases = max_leases
        self.max_lease_blocks = max(1, pool.num_blocks // 2) if max_lease_blocks is None else max_lease_blocks
        self.transfer_timeout_s = transfer_timeout_s
        self.stats = ProducerStats()
        self._leases: dict[str, Lease] = {}
        self._pending: dict[int, tuple[socket.socket, str]] = {}  # connection number -> (socket, peer); oldest first
        self._next_connection = 0
        self._active = 0  # authenticated connections being served
        self._lock = threading.Lock()
        remove_stale_shm_files()
        self._sock = socket.create_server((host, port), reuse_port=False)
        self._sock.settimeout(0.2)
        self.host, self.port = host, self._sock.getsockname()[1]
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-transfer-producer", daemon=True)
        self._thread.start()

    # ---- engine thread ---------------------------------------------------------------------------
    def add_lease(self, request_id: str, block_ids: list[int], token_ids: list[int],
                  extra_keys: tuple) -> Lease | None:
        """Pin a finished prefill's blocks (the caller keeps their references until ``take_released``);
        None when ``max_leases`` or ``max_lease_blocks`` would be exceeded (the caller frees them now)."""
        with self._lock:
            held = sum(len(lease.block_ids) for lease in self._leases.values())
            if len(self._leases) >= self.max_leases or held + len(block_ids) > self.max_lease_blocks:
                self.stats.leases_refused_total += 1
                logger.warning("request %s: not leased (%d leases pin %d blocks; caps %d leases, %d blocks)",
                               request_id, len(self._leases), held, self.max_leases, self.max_lease_blocks)
                return None
            lease = Lease(secrets.token_hex(16), request_id, list(block_ids), len(token_ids), list(token_ids),
                          list(extra_keys), time.monotonic() + self.lease_ttl_s)
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
                    logger.warning("KV lease of %s expired after %.0f s unclaimed: blocks freed",
                                   lease.request_id, self.lease_ttl_s)
                if lease.state in ("done", "expired"):
                    del self._leases[lease_id]
                    released.append(lease.request_id)
                    if lease.shm_path is not None:
                        lease.shm_path.unlink(missing_ok=True)
        return released

    def release(self, lease_id: str) -> bool:
        """Give up a lease nobody will pull (the router's decode step failed or its client left): its blocks
        are freed at the next ``take_released``. Any thread. False when the lease is unknown, already ended,
        or being sent (a pull in progress finishes and frees it itself)."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or lease.state != "leased":
                return False
            lease.state = "done"
            self.stats.leases_released_total += 1
        logger.info("KV lease of %s released before any pull", lease.request_id)
        return True

    @property
    def num_leases(self) -> int:
        with self._lock:
            return len(self._leases)

    @property
    def num_connections(self) -> int:
        """Connections open now: authenticated transfers and connections not yet authenticated."""
        with self._lock:
            return self._active + len(self._pending)

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
                conn, peer = self._sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            host = str(peer[0])
            if not self._consumer_allowed(host):
                with self._lock:
                    self.stats.connections_refused_total += 1
                logger.debug("KV transfer connection from %s closed: not in allowed_consumers", host)
                conn.close()
                continue
            with self._lock:
                if len(self._pending) >= self.max_handshakes:
                    self._evict_oldest_handshake()
                key, self._next_connection = self._next_connection, self._next_connection + 1
                self._pending[key] = (conn, host)
            threading.Thread(target=self._handle, args=(conn, host, key), name="kv-transfer-send",
                             daemon=True).start()

    def _consumer_allowed(self, host: str) -> bool:
        if self.allowed_consumers is None:
            return True
        try:
            address = ipaddress.ip_address(host.split("%", 1)[0])
        except ValueError:
            return False
        if getattr(address, "ipv4_mapped", None) is not None:
            address = address.ipv4_mapped
        return any(address.version == net.version and address in net for net in self.allowed_consumers)

    def _evict_oldest_handshake(self) -> None:
        """Close the oldest unauthenticated connection of the address holding the most (caller holds the lock:
        its handler closes the socket only after taking the lock, so the shutdown never hits a reused fd)."""
        counts = Counter(host for _, host in self._pending.values())
        most = max(counts.values())
        key = next(k for k, (_, host) in self._pending.items() if counts[host] == most)
        sock, host = self._pending.pop(key)
        self.stats.handshakes_evicted_total += 1
        logger.debug("KV transfer connection from %s closed unauthenticated to admit a newer one", host)
        try:
            sock.shutdown(socket.SHUT_RDWR)  # wakes its handler, which then finds itself evicted
        except OSError:
            pass

    def _handle(self, conn: socket.socket, host: str, key: int) -> None:
        lease: Lease | None = None
        authenticated = active = False
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            deadline = time.monotonic() + min(HANDSHAKE_TIMEOUT_S, self.transfer_timeout_s)
            server_nonce = new_nonce()
            send_frame(conn, {"nonce": server_nonce}, deadline=deadline)
            request = recv_frame(conn, REQUEST_FRAME_MAX, deadline)
            client_nonce = request.get("nonce")
            if request.get("op") != "pull" or not is_nonce(client_nonce) or \
                    not frame_is_signed(self._secret, "pull", server_nonce, client_nonce, request):
                self.stats.auth_failures_total += 1
                send_frame(conn, {"ok": False, "error": "the pull is not signed with the cluster secret"},
                           deadline=deadline)
                return
            authenticated = True
            deadline = time.monotonic() + self.transfer_timeout_s

            def reply(message: dict, payload: memoryview | None = None) -> None:
                send_frame(conn, sign_frame(self._secret, "reply", server_nonce, client_nonce, message), payload,
                           deadline)

            with self._lock:
                evicted = self._pending.pop(key, None) is None
                active = not evicted and self._active < self.max_connections
                self._active += active
                if not evicted and not active:
                    self.stats.connections_refused_total += 1
            if evicted:  # closed just now to admit a newer connection
                return
            if not active:
                reply({"ok": False, "error": f"busy: the producer serves {self.max_connections} transfers at "
                                             "once (kv_connector_extra_config.max_connections)"})
                return

            lease = self._claim(str(request.get("lease_id")))
            if lease is None:
                reply({"ok": False, "error": "unknown, expired or already pulled lease"})
                return
            first_block, num_blocks = request.get("first_block", 0), request.get("num_blocks")
            if isinstance(first_block, bool) or not isinstance(first_block, int) \
                    or not 0 <= first_block < len(lease.block_ids):
                reply({"ok": False, "error": f"first_block {first_block!r} is not a block of the lease"})
                return
            if num_blocks is not None and (isinstance(num_blocks, bool) or not isinstance(num_blocks, int)
                                           or num_blocks < 1):
                reply({"ok": False, "error": f"num_blocks must be an integer >= 1, got {num_blocks!r}"})
                return
            end = len(lease.block_ids)
            if num_blocks is not None:
                end = min(end, first_block + num_blocks)
            self._send(reply, lease, request.get("transport") == "shm", first_block, end)
            confirm = recv_frame(conn, REQUEST_FRAME_MAX, deadline)
            if confirm.get("op") != "confirm" or confirm.get("lease_id") != lease.lease_id or \
                    not frame_is_signed(self._secret, "confirm", server_nonce, client_nonce, confirm):
                raise TransferError("protocol", "expected the consumer's signed confirm")
            with self._lock:
                lease.state = "done"  # before the answer: a consumer that got it finds the lease released
            send_frame(conn, sign_frame(self._secret, "ack", server_nonce, client_nonce, {"ok": True}),
                       deadline=deadline)
        except (TransferError, OSError) as exc:
            if authenticated:
                self.stats.send_failures_total += 1
                logger.warning("KV transfer of %s failed: %s", lease.request_id if lease else "a lease", exc)
            else:
                self.stats.auth_failures_total += 1
                logger.debug("KV transfer connection from %s dropped before a signed pull: %s", host, exc)
        finally:
            with self._lock:
                if lease is not None:  # sent or not, the consumer had its chance: free the blocks
                    lease.state = "done"
                self._pending.pop(key, None)
                self._active -= active
            conn.close()

    def _claim(self, lease_id: str) -> Lease | None:
        """The lease, now ``sending``; None when it is unknown or no longer ``leased``."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or lease.state != "leased":
                return None
            lease.state = "sending"
            return lease

    def _send(self, reply: Callable, lease: Lease, use_shm: bool, first_block: int, end: int) -> None:
        rows = self.pool.gather(lease.block_ids[first_block:end]).cpu()  # (n, block_bytes) uint8
        data = memoryview(rows.reshape(-1).numpy())
        if self._fingerprint is None:
            self._fingerprint = self._fingerprint_fn()
        chain: list[int] = []
        extend_block_hashes(chain, lease.token_ids, self.block_size, tuple(lease.extra_keys))
        meta = TransferMeta(lease.num_tokens, lease.token_ids, lease.extra_keys, [f"{h:016x}" for h in chain],
                            self._fingerprint,
                            self.pool.dtype_name, self.block_size, list(self.pool.block_shape), self.pool.block_bytes,
                            first_block, rows.shape[0], hashlib.sha256(data).hexdigest())
        message = {"ok": True, "meta": meta.as_dict(), "nbytes": len(data)}
        if use_shm and SHM_DIR.is_dir():
            lease.shm_path = write_shm_file(data)
            reply({**message, "shm_path": str(lease.shm_path)})
        else:
            reply(message, data)
        self.stats.transfers_total += 1
        self.stats.bytes_sent_total += len(data)
