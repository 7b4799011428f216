"""KV event publishers: once per engine step the collected events become one numbered batch on a
ZeroMQ PUB socket, with a replay socket for subscribers that missed some.

The engine thread only encodes the batch and hands it to the publisher thread through an in-process
PUSH/PULL pair, without waiting (a full queue drops the batch and counts it). The publisher thread
numbers batches (0, 1, 2, ...), keeps the last ``buffer_steps`` of them and sends each as three
frames ``[topic, seq (8 bytes, big-endian), payload (msgpack)]``; the payload is tokenmill's batch or,
with ``"format": "vllm"``, vLLM's ``KVEventBatch`` (``events.encode_vllm_batch``). A subscriber that sees a
gap (or joins late) sends one frame, the first sequence number it wants (8 bytes, big-endian), to the
replay ROUTER socket (from a DEALER; a REQ socket's empty delimiter frame is echoed back, as vLLM's
consumers expect); the reply is one ``[seq, payload]`` message per buffered batch from there on,
then ``[END_OF_REPLAY, b""]``.

Events carry prompt token ids, so the sockets are private (docs/kv_events.md): loopback or a 0600
``ipc://`` file by default, CURVE with an allow-list of subscriber keys across hosts; cache salts and
adapter names leave only as keyed tags (``events.redact``, under the cluster secret). Never imports torch.
"""
from __future__ import annotations

import itertools
import logging
import random
import threading
import time
from collections import deque

import zmq
from zmq.auth.thread import ThreadAuthenticator

from tokenmill.config import ConfigError, KVEventsConfig
from tokenmill.kv_events.collector import KVEventCollector
from tokenmill.kv_events.events import (END_OF_REPLAY, decode_seq, encode_batch, encode_seq, encode_vllm_batch,
                                        redact)
from tokenmill.kv_events.transport import (TransportKeyError, apply_server_keys, check_client_keys_dir,
                                           load_secret_certificate, prepare_ipc, restrict_ipc)
from tokenmill.security import SecretError, load_cluster_secret

logger = logging.getLogger(__name__)

_STOP = b""  # on the in-process queue: the engine is closing
_instances = itertools.count()


class NullEventPublisher:
    """Collects and drops (``publisher: "null"``): the hooks run, nothing leaves the process."""

    def __init__(self, config: KVEventsConfig, collector: KVEventCollector) -> None:
        self.config = config
        self.collector = collector
        self.endpoint: str | None = None
        self.replay_endpoint: str | None = None
        self.num_batches = 0
        self._closed = False

    def publish_pending(self) -> None:
        if self.collector.take():
            self.num_batches += 1

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.collector.all_cleared()
            self.publish_pending()

    def status(self) -> dict:
        return {"enabled": True, "publisher": "null", "endpoint": None, "replay_endpoint": None,
                "format": self.config.format, "topic": self.config.topic, "block_size": self.collector.block_size, "num_batches": self.num_batches,
                "dropped_batches": 0}


class ZmqEventPublisher:
    """PUB socket + replay ROUTER socket, served by one daemon thread.

    Args:
        config: the endpoints, buffer and queue sizes, topic.
        collector: where the engine's hooks put events.

    Raises:
        ConfigError: an endpoint cannot be bound (in use, bad address), a CURVE certificate or the
            cluster secret cannot be read.
    """

    def __init__(self, config: KVEventsConfig, collector: KVEventCollector) -> None:
        self.config = config
        self.collector = collector
        self._topic = config.topic.encode()
        self.instance = random.getrandbits(63)  # tells subscribers a restarted engine from a gap
        curve_keys = None
        try:
            self._secret = load_cluster_secret()  # keys the tags of salts and adapter names
            if config.curve_secret_key_file is not None:
                curve_keys = load_secret_certificate(config.curve_secret_key_file, "kv_events_config")
                check_client_keys_dir(config.curve_client_keys_dir, "kv_events_config")
        except (SecretError, TransportKeyError) as exc:
            raise ConfigError(f"`kv_events_config`: {exc}") from None
        self._ctx = zmq.Context()
        self._auth: ThreadAuthenticator | None = None
        if curve_keys is not None:  # the ZAP handler of this context: only listed subscriber keys get in
            self._auth = ThreadAuthenticator(self._ctx)
            self._auth.start()
            self._auth.configure_curve(domain="*", location=config.curve_client_keys_dir)
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 1000)
        if curve_keys is not None:
            apply_server_keys(self._pub, *curve_keys)
        self._replay = None
        inproc = f"inproc://tokenmill-kv-events-{next(_instances)}"
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, config.max_queue_size)
        self._pull.bind(inproc)
        self._push = self._ctx.socket(zmq.PUSH)  # engine thread only
        self._push.setsockopt(zmq.SNDHWM, config.max_queue_size)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.connect(inproc)
        try:
            self.endpoint = _bind(self._pub, config.endpoint, "endpoint")
            self.replay_endpoint: str | None = None
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                if curve_keys is not None:
                    apply_server_keys(self._replay, *curve_keys)
                self.replay_endpoint = _bind(self._replay, config.replay_endpoint, "replay_endpoint")
        except ConfigError:
            self._close_sockets()
            raise
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)  # publisher thread only
        self.next_seq = 0  # written by the publisher thread
        self.num_batches = 0  # engine thread: batches handed to the publisher thread (numbered 0, 1, ... there)
        self.dropped_batches = 0  # engine thread: queue full
        self.num_replays = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="tokenmill-kv-events", daemon=True)
        self._thread.start()
        logger.info("KV events: publishing on %s%s%s", self.endpoint,
                    f", replay on {self.replay_endpoint}" if self.replay_endpoint else " (no replay)",
                    " (CURVE)" if curve_keys is not None else "")

    # ---- engine thread ------------------------------------------------------------------------
    def publish_pending(self) -> None:
        """Send the events collected since the last call as one batch (nothing if there are none);
        never blocks."""
        events = self.collector.take()
        if not events or self._closed:
            return
        try:
            events = [redact(e, self._secret) for e in events]
            payload = (encode_vllm_batch(time.time(), events) if self.config.format == "vllm"
                       else encode_batch(time.time(), events, self.instance))
            self._push.send(payload, zmq.NOBLOCK)
            self.num_batches += 1
        except zmq.Again:
            self.dropped_batches += 1
            if self.dropped_batches == 1:
                logger.warning("KV events: the publisher queue is full (max_queue_size=%d); batches are dropped",
                               self.config.max_queue_size)

    def close(self, timeout: float = 5.0) -> None:
        """Publish what is pending and a last ``AllBlocksCleared`` (the engine is going away), stop the
        thread and release the sockets. Idempotent."""
        if self._closed:
            return
        self.collector.all_cleared()
        self.publish_pending()
        self._closed = True
        try:
            self._push.send(_STOP, zmq.NOBLOCK)
        except zmq.Again:
            pass
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("KV events: the publisher thread did not stop within %.0fs", timeout)
            return
        self._close_sockets()

    def status(self) -> dict:
        return {"enabled": True, "publisher": "zmq", "endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint,
                "curve": self._auth is not None, "format": self.config.format, "topic": self.config.topic, "block_size": self.collector.block_size, "next_seq": self.next_seq,
                "num_batches": self.num_batches, "dropped_batches": self.dropped_batches,
                "num_replays": self.num_replays}

    # ---- publisher thread ------------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            ready = dict(poller.poll(1000))
            if self._replay is not None and self._replay in ready:
                self._serve_replay()
            if self._pull in ready and not self._drain():
                return
            if self._closed and not ready:
                return  # the stop marker was dropped (full queue): stop once idle

    def _drain(self) -> bool:
        """Publish every queued batch; False once the stop marker arrives."""
        while True:
            try:
                payload = self._pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return True
            if payload == _STOP:
                return False
            seq = self.next_seq
            self._buffer.append((seq, payload))
            try:
                self._pub.send_multipart([self._topic, encode_seq(seq), payload], zmq.NOBLOCK)
            except zmq.Again:  # PUB drops at its high-water mark rather than block; kept for replay
                pass
            self.next_seq = seq + 1

    def _serve_replay(self) -> None:
        while True:
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            # The envelope: the peer's identity, then the empty delimiter a REQ socket adds (none from a DEALER).
            envelope, start = frames[:-1], decode_seq(frames[-1]) if len(frames[-1]) == 8 else 0
            self.num_replays += 1
            first = self._buffer[0][0] if self._buffer else self.next_seq
            for seq, payload in itertools.islice(self._buffer, max(0, start - first), None):
                self._replay.send_multipart([*envelope, encode_seq(seq), payload])
            self._replay.send_multipart([*envelope, END_OF_REPLAY, b""])

    def _close_sockets(self) -> None:
        for sock in (self._push, self._pull, self._pub, self._replay):
            if sock is not None:
                sock.close()
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()


def _bind(sock: zmq.Socket, endpoint: str, field: str) -> str:
    """Bind ``sock`` and return the endpoint it got (``tcp://127.0.0.1:*`` becomes a real port)."""
    try:
        prepare_ipc(endpoint)
        sock.bind(endpoint)
        bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        restrict_ipc(bound)
    except (zmq.ZMQError, OSError) as exc:
        raise ConfigError(f"`kv_events_config` {field} {endpoint!r} cannot be bound: {exc}") from None
    return bound


def build_kv_event_publisher(
    config: KVEventsConfig, collector: KVEventCollector | None
) -> ZmqEventPublisher | NullEventPublisher | None:
    """The publisher of ``collector``'s events for ``config`` (None when events are off).

    Raises:
        ConfigError: an endpoint cannot be bound.
    """
    if not config.enable_kv_cache_events or collector is None:
        return None
    if config.publisher == "null":
        return NullEventPublisher(config, collector)
    return ZmqEventPublisher(config, collector)
