"""KVIndex: the router's global view of which worker holds which KV block, in which tier, built from
the workers' KV events (tokenmill.kv_events).

One background thread owns the ZeroMQ sockets: a SUB socket per worker, and a short-lived DEALER
per replay request. Each worker's batches are numbered; a gap (or a late join) is filled from the
worker's replay socket, a changed publisher ``instance`` (the engine restarted) clears the worker's
entries first. Workers may publish tokenmill's batches or vLLM's (``"format": "vllm"``, or a vLLM engine):
``decode_batch`` reads both. With CURVE keys (``transport.ClientKeys``) every socket authenticates to the publishers
and the stream is encrypted (docs/kv_events.md). Lookups (``overlap``, ``overlaps``) take a lock and run on any thread; never imports
torch.
"""
from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from urllib.parse import urlparse

import zmq

from tokenmill.kv_events.events import (
    END_OF_REPLAY,
    MEDIUMS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    decode_batch,
    decode_seq,
    encode_seq,
)
from tokenmill.kv_events.transport import ClientKeys
from tokenmill.security.addresses import is_loopback

logger = logging.getLogger(__name__)

TIER_BITS = {medium: 1 << i for i, medium in enumerate(MEDIUMS)}  # pool 1, ram 2, disk 4
ALL_TIERS = sum(TIER_BITS.values())


@dataclass
class FeedStats:
    """Per-worker subscription state and counters (``KVIndex.stats``)."""

    endpoint: str
    replay_endpoint: str | None
    last_seq: int | None = None
    instance: int | None = None
    batches: int = 0
    events: int = 0
    gaps: int = 0  # sequence gaps seen on the live stream
    replays: int = 0  # replay requests answered
    replay_failures: int = 0  # replay requests that timed out
    lost_batches: int = 0  # batches neither received live nor replayable (older than the buffer)
    restarts: int = 0  # publisher instance changes (the engine restarted)


class KVIndex:
    """Block hash -> {worker_id: tier bits} for every worker subscribed, plus the per-worker reverse map.

    ``apply`` feeds events directly (tests, the simulator); ``add_worker`` subscribes to a worker's
    publisher and feeds them from the background thread.

    Args:
        replay_timeout: seconds a replay request may take before it counts as failed.
        topic: the publishers' topic (subscription prefix).
        curve: this subscriber's CURVE key pair and the publishers' public key (None: plain sockets,
            for publishers on loopback or ipc://).
    """

    def __init__(self, replay_timeout: float = 2.0, topic: str = "", curve: ClientKeys | None = None) -> None:
        self.replay_timeout = replay_timeout
        self.topic = topic.encode()
        self.curve = curve
        self._lock = threading.Lock()
        self._holders: dict[int, dict[str, int]] = {}  # block_hash -> worker_id -> tier bits
        self._blocks: dict[str, set[int]] = {}  # worker_id -> block hashes it holds in some tier
        self._feeds: dict[str, FeedStats] = {}
        self._subscriber: _Subscriber | None = None

    # ---- the index ------------------------------------------------------------------------------
    def apply(self, worker_id: str, events: list[KVEvent]) -> None:
        """Apply one batch of ``worker_id``'s events, in order."""
        with self._lock:
            for event in events:
                if isinstance(event, BlockStored):
                    self._store(worker_id, event.block_hashes, TIER_BITS.get(event.medium, 0))
                elif isinstance(event, BlockRemoved):
                    self._remove(worker_id, event.block_hashes, TIER_BITS.get(event.medium, 0))
                elif isinstance(event, AllBlocksCleared):
                    bits = ALL_TIERS if event.medium is None else TIER_BITS.get(event.medium, 0)
                    self._remove(worker_id, list(self._blocks.get(worker_id, ())), bits)

    def _store(self, worker_id: str, block_hashes, bits: int) -> None:
        blocks = self._blocks.setdefault(worker_id, set())
        for h in block_hashes:
            holders = self._holders.get(h)
            if holders is None:
                self._holders[h] = {worker_id: bits}
            else:
                holders[worker_id] = holders.get(worker_id, 0) | bits
            blocks.add(h)

    def _remove(self, worker_id: str, block_hashes, bits: int) -> None:
        blocks = self._blocks.get(worker_id)
        if not blocks:
            return
        for h in block_hashes:
            holders = self._holders.get(h)
            if holders is None or worker_id not in holders:
                continue
            left = holders[worker_id] & ~bits
            if left:
                holders[worker_id] = left
                continue
            del holders[worker_id]
            if not holders:
                del self._holders[h]
            blocks.discard(h)

    def forget_worker(self, worker_id: str) -> None:
        """Drop every entry of ``worker_id`` (its feed, if any, keeps running)."""
        with self._lock:
            for h in self._blocks.pop(worker_id, ()):
                holders = self._holders.get(h)
                if holders is not None:
                    holders.pop(worker_id, None)
                    if not holders:
                        del self._holders[h]

    def overlap(self, worker_id: str, block_hashes: list[int], tiers: int = ALL_TIERS) -> int:
        """How many leading ``block_hashes`` ``worker_id`` holds (in any of ``tiers``)."""
        with self._lock:
            for i, h in enumerate(block_hashes):
                holders = self._holders.get(h)
                if holders is None or not holders.get(worker_id, 0) & tiers:
                    return i
            return len(block_hashes)

    def overlaps(self, block_hashes: list[int], worker_ids: list[str] | None = None,
                 tiers: int = ALL_TIERS) -> dict[str, int]:
        """``overlap`` for every worker at once (workers not listed count 0): one walk down the
        prefix, O(blocks x workers still matching)."""
        counts = dict.fromkeys(worker_ids, 0) if worker_ids is not None else {}
        with self._lock:
            alive: set[str] | None = set(worker_ids) if worker_ids is not None else None
            for i, h in enumerate(block_hashes):
                holders = self._holders.get(h)
                if not holders:
                    break
                matching = {w for w, bits in holders.items() if bits & tiers}
                alive = matching if alive is None else alive & matching
                if not alive:
                    break
                for w in alive:
                    counts[w] = i + 1
        return counts

    def num_blocks(self, worker_id: str) -> int:
        """Distinct blocks ``worker_id`` holds in some tier."""
        with self._lock:
            return len(self._blocks.get(worker_id, ()))

    def tiers(self, block_hash: int) -> dict[str, set[str]]:
        """worker_id -> tier names holding ``block_hash``."""
        with self._lock:
            holders = dict(self._holders.get(block_hash, {}))
        return {w: {m for m, bit in TIER_BITS.items() if bits & bit} for w, bits in holders.items()}

    def worker_blocks(self, worker_id: str, medium: str | None = None) -> set[int]:
        """Block hashes ``worker_id`` holds (in ``medium``, or in any tier)."""
        bits = ALL_TIERS if medium is None else TIER_BITS[medium]
        with self._lock:
            return {h for h in self._blocks.get(worker_id, ()) if self._holders[h][worker_id] & bits}

    # ---- subscriptions ----------------------------------------------------------------------------
    def add_worker(self, worker_id: str, endpoint: str, replay_endpoint: str | None = None) -> None:
        """Subscribe to ``worker_id``'s publisher at ``endpoint`` (a connectable address such as
        ``tcp://10.0.0.5:5557``); with ``replay_endpoint`` its recent batches are fetched at once and
        gaps are filled. Re-adding a worker resubscribes it from scratch."""
        self.remove_worker(worker_id)
        with self._lock:
            self._feeds[worker_id] = FeedStats(endpoint, replay_endpoint)
            if self._subscriber is None:
                self._subscriber = _Subscriber(self)
        self._subscriber.command(("add", worker_id, endpoint, replay_endpoint))

    def remove_worker(self, worker_id: str) -> None:
        """Unsubscribe from ``worker_id`` and forget its blocks."""
        with self._lock:
            had_feed = self._feeds.pop(worker_id, None) is not None
            subscriber = self._subscriber
        if had_feed and subscriber is not None:
            subscriber.command(("remove", worker_id))
        self.forget_worker(worker_id)

    def stats(self) -> dict[str, dict]:
        """Per worker: endpoints, last sequence number, counters and blocks held."""
        with self._lock:
            feeds = {w: dict(vars(f)) for w, f in self._feeds.items()}
            for w in feeds:
                feeds[w]["num_blocks"] = len(self._blocks.get(w, ()))
        return feeds

    def last_seq(self, worker_id: str) -> int | None:
        """The last batch number applied for ``worker_id`` (None: none yet)."""
        with self._lock:
            feed = self._feeds.get(worker_id)
            return None if feed is None else feed.last_seq

    def close(self) -> None:
        """Stop the background thread and close every socket."""
        with self._lock:
            subscriber, self._subscriber = self._subscriber, None
            self._feeds.clear()
        if subscriber is not None:
            subscriber.stop()

    # ---- called by the subscriber thread ----------------------------------------------------------
    def _feed(self, worker_id: str) -> FeedStats | None:
        with self._lock:
            return self._feeds.get(worker_id)


class _Subscriber:
    """The background thread: SUB sockets, replay requests, sequence checks."""

    def __init__(self, index: KVIndex) -> None:
        self.index = index
        self.ctx = zmq.Context()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_address = f"inproc://tokenmill-kv-index-{id(self)}"
        self._wake_recv = self.ctx.socket(zmq.PULL)
        self._wake_recv.bind(self._wake_address)
        self._wake_send = self.ctx.socket(zmq.PUSH)
        self._wake_send.connect(self._wake_address)
        self._wake_lock = threading.Lock()
        self._subs: dict[str, tuple[zmq.Socket, zmq.Socket]] = {}  # worker_id -> (SUB, its monitor) (thread only)
        self._workers: dict[zmq.Socket, str] = {}  # SUB socket -> worker_id
        self._monitors: dict[zmq.Socket, str] = {}  # monitor socket -> worker_id
        self._thread = threading.Thread(target=self._run, name="tokenmill-kv-index", daemon=True)
        self._thread.start()

    def command(self, command: tuple) -> None:
        self._commands.put(command)
        with self._wake_lock:
            self._wake_send.send(b"", zmq.NOBLOCK)

    def stop(self, timeout: float = 5.0) -> None:
        self.command(("stop",))
        self._thread.join(timeout)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_recv, zmq.POLLIN)
        try:
            while True:
                for sock, _ in poller.poll():
                    if sock is self._wake_recv:
                        while self._wake_recv.poll(0):
                            self._wake_recv.recv()
                        if not self._apply_commands(poller):
                            return
                    elif sock in self._monitors:
                        self._on_monitor(sock)
                    else:
                        self._drain(sock)
        except Exception:  # noqa: BLE001 - the index goes stale but the router keeps routing
            logger.exception("KV index: the subscriber thread crashed; KV-aware routing falls back to load only")
        finally:
            for sub, monitor in list(self._subs.values()):
                sub.disable_monitor()
                monitor.close(linger=0)
                sub.close(linger=0)
            self._wake_recv.close(linger=0)
            self._wake_send.close(linger=0)
            self.ctx.term()

    def _apply_commands(self, poller: zmq.Poller) -> bool:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
            if command[0] == "stop":
                return False
            worker_id = command[1]
            old = self._subs.pop(worker_id, None)
            if old is not None:
                sub, monitor = old
                for sock, table in ((sub, self._workers), (monitor, self._monitors)):
                    poller.unregister(sock)
                    del table[sock]
                sub.disable_monitor()
                monitor.close(linger=0)
                sub.close(linger=0)
            if command[0] == "add":
                sub = self.ctx.socket(zmq.SUB)
                sub.setsockopt(zmq.SUBSCRIBE, self.index.topic)
                if self.index.curve is not None:
                    self.index.curve.apply(sub)
                # Each (re)connection fetches what was missed meanwhile from the replay socket.
                monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED)
                sub.connect(command[2])
                self._subs[worker_id] = sub, monitor
                self._workers[sub] = worker_id
                self._monitors[monitor] = worker_id
                poller.register(sub, zmq.POLLIN)
                poller.register(monitor, zmq.POLLIN)

    def _on_monitor(self, monitor: zmq.Socket) -> None:
        """The SUB socket (re)connected: a late join, or the worker came back. Ask for what was missed."""
        while True:
            try:
                monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
        worker_id = self._monitors[monitor]
        feed = self.index._feed(worker_id)
        if feed is not None and feed.replay_endpoint is not None:
            self._replay(worker_id, feed, 0 if feed.last_seq is None else feed.last_seq + 1)

    def _drain(self, sock: zmq.Socket) -> None:
        worker_id = self._workers.get(sock)
        while worker_id is not None:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            feed = self.index._feed(worker_id)
            if feed is None or len(frames) != 3:
                continue
            self._on_batch(worker_id, feed, decode_seq(frames[1]), frames[2], live=True)

    def _on_batch(self, worker_id: str, feed: FeedStats, seq: int, payload: bytes, live: bool) -> bool:
        """Apply one batch (filling a gap first); False when a replay must start again from 0 (the
        worker restarted under it)."""
        try:
            batch = decode_batch(payload)
        except ValueError as exc:
            logger.warning("KV index: worker %s sent a bad batch %d (%s); ignored", worker_id, seq, exc)
            return True
        if batch.instance is not None:
            restarted = feed.instance is not None and batch.instance != feed.instance
        else:  # vLLM's format names no publisher instance: a live stream that starts again at 0 restarted
            restarted = live and seq == 0 and feed.last_seq is not None and feed.last_seq > 0
        if restarted:
            logger.info("KV index: worker %s restarted its publisher; resynchronising", worker_id)
            feed.restarts += 1
            self.index.forget_worker(worker_id)
            feed.last_seq = None
            feed.instance = batch.instance
            if not live and seq > 0:
                return False
        feed.instance = batch.instance
        if feed.last_seq is not None and seq <= feed.last_seq:
            return True  # already applied (replayed, then received live)
        expected = 0 if feed.last_seq is None else feed.last_seq + 1
        if live and seq > expected:
            if feed.last_seq is not None:
                feed.gaps += 1
            if feed.replay_endpoint is not None:
                self._replay(worker_id, feed, expected)
            if feed.last_seq is not None and seq <= feed.last_seq:
                return True
            expected = 0 if feed.last_seq is None else feed.last_seq + 1
            if seq > expected and feed.replay_endpoint is None:
                feed.lost_batches += seq - expected
            if seq > expected and feed.last_seq is not None:
                logger.warning("KV index: worker %s: batches %d-%d are lost; its index entries may be stale",
                               worker_id, expected, seq - 1)
        self.index.apply(worker_id, batch.events)
        feed.last_seq = seq
        feed.batches += 1
        feed.events += len(batch.events)
        return True

    def _replay(self, worker_id: str, feed: FeedStats, start: int) -> None:
        """Ask the worker's replay socket for every buffered batch from ``start`` on and apply them."""
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        if self.index.curve is not None:
            self.index.curve.apply(dealer)
        try:
            dealer.connect(feed.replay_endpoint)
            dealer.send(encode_seq(start))
            timeout_ms = int(self.index.replay_timeout * 1000)
            while True:
                if not dealer.poll(timeout_ms):
                    feed.replay_failures += 1
                    logger.warning("KV index: worker %s did not answer a replay request within %.1fs", worker_id,
                                   self.index.replay_timeout)
                    return
                frames = dealer.recv_multipart()
                if len(frames) != 2 or frames[0] == END_OF_REPLAY:
                    feed.replays += 1
                    return
                seq = decode_seq(frames[0])
                if seq > start:
                    feed.lost_batches += seq - start  # older than the worker's buffer
                start = seq + 1
                if not self._on_batch(worker_id, feed, seq, frames[1], live=False):
                    break  # a new publisher instance: its history starts at 0
        finally:
            dealer.close()
        self._replay(worker_id, feed, 0)


def kv_event_endpoints(status: dict, worker_url: str) -> tuple[str | None, str | None]:
    """(endpoint, replay_endpoint) to connect to, from a tokenmill worker's ``/debug/status``
    (``kv_events``), with a wildcard host (``*``, ``0.0.0.0``, ``[::]``) replaced by ``worker_url``'s
    host; (None, None) when the worker publishes no events over ZeroMQ, or publishes on its loopback
    (or an ipc:// file) while ``worker_url`` is another host (give ``--kv-events-endpoints`` then)."""
    info = status.get("kv_events") if isinstance(status, dict) else None
    if not isinstance(info, dict) or not info.get("enabled") or info.get("publisher") != "zmq":
        return None, None
    host = urlparse(worker_url).hostname or "127.0.0.1"
    endpoint, replay = _connectable(info.get("endpoint"), host), _connectable(info.get("replay_endpoint"), host)
    if endpoint is not None and not is_loopback(host) and _host_only(endpoint):
        logger.warning("KV index: worker %s publishes its KV events on %s, which this router cannot reach; "
                       "bind a reachable address with CURVE keys and/or pass --kv-events-endpoints", worker_url,
                       endpoint)
        return None, None
    return endpoint, replay




def _host_only(endpoint: str) -> bool:
    """An endpoint only the publisher's own host can connect to (ipc://, tcp on loopback)."""
    if endpoint.startswith("ipc://"):
        return True
    return endpoint.startswith("tcp://") and is_loopback(endpoint[len("tcp://"):].rpartition(":")[0])


def _connectable(endpoint: str | None, host: str) -> str | None:
    if not isinstance(endpoint, str) or not endpoint.startswith("tcp://"):
        return endpoint if isinstance(endpoint, str) else None
    address = endpoint[len("tcp://"):]
    bound_host, _, port = address.rpartition(":")
    if bound_host in ("*", "0.0.0.0", "[::]", "::", ""):
        bound_host = f"[{host}]" if ":" in host else host
    return f"tcp://{bound_host}:{port}"
