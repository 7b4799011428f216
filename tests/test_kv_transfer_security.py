"""KV transfer is authenticated and never steered by clients (issue 41, tokenmill/kv_transfer/).

A real worker process (kv_both, TCP) and a hostile client: ``kv_transfer_params`` a client writes itself
(unsigned, signed with another secret, re-pointed after signing, stale, replayed) get a 403 naming the field
and the worker connects nowhere; an unsigned ``do_remote_decode`` takes no lease; anonymous connections to the
producer port are capped and cost no memory; a lease id known to a party without the secret cannot be pulled.
In process: producers without the secret, with an oversized ``nbytes`` or dripping their bytes past the deadline
are refused (the oversized payload never allocated); leases cannot pin more than half the pool; shared-memory
files are 0600 with random names and a crashed producer's files are removed by the next one.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import secrets
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import pytest
import torch

from tests.server_fixtures import REPO, ServerProcess
from tests.tiny_models import make_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.config import ConfigError
from tokenmill.kv_cache.block_hash import extend_block_hashes
from tokenmill.kv_transfer.config import KVTransferConfig
from tokenmill.kv_transfer.consumer import Expected, pull_blocks
from tokenmill.kv_transfer.producer import SHM_DIR, KVProducer
from tokenmill.kv_transfer.protocol import (TransferError, TransferMeta, new_nonce, recv_frame, send_frame,
                                            sign_frame)
from tokenmill.runner.kv_pool import KVPool
from tokenmill.security import load_cluster_secret, sign_params

SECRET = load_cluster_secret()  # the test session's per-user default: the servers started here load it too
OTHER_SECRET = b"a-different-cluster-secret-0123456789"
BLOCK_SIZE = 16
ARGS = ["--dtype", "float32", "--num-threads", "1", "--num-kv-blocks", "64", "--block-size", str(BLOCK_SIZE),
        "--disable-log-requests"]

# The in-process transport tests' pool: 2 layers, blocks of 4 tokens, 2 KV heads of 8.
LAYERS, SMALL_BLOCK, HEADS, DIM = 2, 4, 2, 8
SHAPE = [LAYERS, 2, SMALL_BLOCK, HEADS, DIM]
BLOCK_BYTES = math.prod(SHAPE) * 4
SMALL_PROMPT = list(range(1000, 1011))  # 11 tokens: 3 blocks


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("tiny_kv_security")))


@pytest.fixture(scope="module")
def worker(tiny, tmp_path_factory):
    """One worker that is both producer and consumer (TCP), leases expiring after 3 s."""
    config = {"kv_role": "kv_both", "kv_connector": "TCPConnector",
              "kv_connector_extra_config": {"lease_ttl_s": 3.0, "transfer_timeout_s": 5.0}}
    server = ServerProcess(tiny, [*ARGS, "--kv-transfer-config", json.dumps(config)],
                           tmp_path_factory.mktemp("kv_security_logs") / "worker.log")
    server.wait_healthy()
    yield server
    server.stop()


def kv_status(server: ServerProcess) -> dict:
    return server.get_json("/debug/status?check_integrity=false")["kv_transfer"]


def completion(server: ServerProcess, prompt: list[int], max_tokens: int, params: dict | None = None):
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    if params is not None:
        body["kv_transfer_params"] = params
    return server.post("/v1/completions", body)


def signed(params: dict, secret: bytes = SECRET, **kw) -> dict:
    """What the PD router sends: the parameters with a fresh nonce, signed."""
    return sign_params(secret, {**params, "nonce": secrets.token_hex(16)}, **kw)


def small_expected(**overrides) -> Expected:
    fields = dict(model_fingerprint="fp-a", kv_dtype="float32", block_size=SMALL_BLOCK, block_shape=SHAPE,
                  block_bytes=BLOCK_BYTES, prompt_token_ids=SMALL_PROMPT + [5, 6], extra_keys=[])
    return Expected(**{**fields, **overrides})


def small_producer(**kw) -> KVProducer:
    kv = torch.randn(LAYERS, 2, 8, SMALL_BLOCK, HEADS, DIM)
    return KVProducer(KVPool.over(kv), SMALL_BLOCK, lambda: "fp-a", **{"secret": SECRET, **kw})


class FakeProducer:
    """A listener at an address of the attacker's choosing. It counts connections and answers the first pull
    the protocol's way: its nonce, then a reply declaring ``nbytes`` of blocks signed with ``secret`` (None: not
    signed), then ``payload`` in ``chunk``-byte pieces every ``pause`` seconds; ``sent`` counts those bytes and
    ``peer_closed`` is set when the consumer hangs up."""

    def __init__(self, secret: bytes | None, nbytes: int, payload: bytes = b"", chunk: int = 1 << 20,
                 pause: float = 0.0, drop_first: bool = False) -> None:
        self.secret, self.nbytes, self.payload, self.chunk, self.pause = secret, nbytes, payload, chunk, pause
        self.drop_first = drop_first  # close the first connection at once, unanswered
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.connections, self.sent = 0, 0
        self.peer_closed = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        if self.drop_first:
            self.sock.accept()[0].close()
            self.connections += 1
        conn, _ = self.sock.accept()
        self.connections += 1
        with conn:
            try:
                server_nonce = new_nonce()
                send_frame(conn, {"nonce": server_nonce})
                client_nonce = recv_frame(conn)["nonce"]
                chain: list[int] = []
                extend_block_hashes(chain, SMALL_PROMPT, SMALL_BLOCK)
                meta = TransferMeta(len(SMALL_PROMPT), SMALL_PROMPT, [], [f"{h:016x}" for h in chain], "fp-a",
                                    "float32", SMALL_BLOCK, SHAPE, BLOCK_BYTES, 0, self.nbytes // BLOCK_BYTES,
                                    hashlib.sha256(self.payload).hexdigest())
                reply = {"ok": True, "meta": meta.as_dict(), "nbytes": self.nbytes}
                if self.secret is not None:
                    reply = sign_frame(self.secret, "reply", server_nonce, client_nonce, reply)
                send_frame(conn, reply)
                for i in range(0, len(self.payload), self.chunk):
                    conn.sendall(self.payload[i:i + self.chunk])
                    self.sent += len(self.payload[i:i + self.chunk])
                    time.sleep(self.pause)
                conn.settimeout(30)
                while conn.recv(4096):
                    pass
            except OSError:
                pass
            self.peer_closed.set()

    def close(self) -> None:
        self.sock.close()


# ---- the HTTP API: kv_transfer_params only from the holder of the cluster secret --------------------------------
def test_client_written_kv_transfer_params_get_403_and_the_worker_connects_nowhere(worker):
    trap = socket.create_server(("127.0.0.1", 0))  # the attacker's "producer"
    trap.setblocking(False)
    steer = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": trap.getsockname()[1],
             "remote_lease_id": "a" * 32, "remote_num_tokens": 40}
    forged = {
        "unsigned": steer,
        "another secret": signed(steer, OTHER_SECRET),
        "re-pointed after signing": {**signed({**steer, "remote_port": 1}), "remote_port": steer["remote_port"]},
        "stale": signed(steer, now=time.time() - 3600),
        "made-up mac": {**steer, "auth": {"ts": int(time.time()), "mac": "0" * 64}},
    }
    before = kv_status(worker)
    prompt = list(range(100, 140))
    for why, params in forged.items():
        for path, body in [("/v1/completions", {"prompt": prompt, "max_tokens": 4}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                     "max_tokens": 4})]:
            response = worker.post(path, {**body, "kv_transfer_params": params})
            assert response.status_code == 403, (why, path, response.text)
            assert response.json()["error"]["param"] == "kv_transfer_params", why
    with pytest.raises(BlockingIOError):
        trap.accept()  # nobody ever connected to the client's address
    trap.close()
    after = kv_status(worker)
    assert after["local_fallbacks"] == before["local_fallbacks"] and after["loads_in_flight"] == 0
    assert after["remote_tokens"] == before["remote_tokens"]
    assert completion(worker, prompt, 2).status_code == 200  # still serving


def test_unsigned_do_remote_decode_takes_no_lease_and_a_signature_works_once(worker):
    prompt = list(range(200, 240))
    leases = kv_status(worker)["leases_total"]
    refused = completion(worker, prompt, 1, {"do_remote_decode": True})
    assert refused.status_code == 403 and "kv_transfer_params" not in refused.json()
    assert kv_status(worker)["leases_total"] == leases  # nothing pinned, no address or lease id handed out
    params = signed({"do_remote_decode": True})
    first = completion(worker, prompt, 1, params)
    assert first.status_code == 200 and first.json()["kv_transfer_params"]["do_remote_prefill"]
    replay = completion(worker, prompt, 1, params)  # the same signed parameters again
    assert replay.status_code == 403 and "already used" in replay.json()["error"]["message"]
    assert kv_status(worker)["leases_total"] == leases + 1


def test_only_the_cluster_secret_releases_a_lease_early(worker):
    """``POST /kv_transfer/release`` (the PD router's, when the decode step failed): unsigned, signed with
    another secret or for another purpose, or replayed, it is a 403 naming ``auth`` and the lease stays
    pullable; signed, the lease is freed at once and can no longer be pulled."""
    from tokenmill.kv_transfer.params_auth import RELEASE_PATH, RELEASE_PURPOSE

    prompt = list(range(500, 540))
    lease = completion(worker, prompt, 1, signed({"do_remote_decode": True})).json()["kv_transfer_params"]
    request = {"lease_id": lease["remote_lease_id"]}
    released_before = kv_status(worker)["leases_released_total"]
    for forged in (request, signed(request, OTHER_SECRET, purpose=RELEASE_PURPOSE), signed(request)):
        response = worker.post(RELEASE_PATH, forged)
        assert response.status_code == 403 and response.json()["error"]["param"] == "auth", response.text
    assert kv_status(worker)["leases_released_total"] == released_before
    good = signed(request, purpose=RELEASE_PURPOSE)
    assert worker.post(RELEASE_PATH, good).json() == {"released": True}
    assert worker.post(RELEASE_PATH, good).status_code == 403  # a replay
    assert worker.post(RELEASE_PATH, signed(request, purpose=RELEASE_PURPOSE)).json() == {"released": False}
    assert kv_status(worker)["leases_released_total"] == released_before + 1
    with pytest.raises(TransferError) as info:
        pull_blocks(lease["remote_host"], lease["remote_port"], lease["remote_lease_id"], small_expected(), "tcp",
                    timeout_s=5, secret=SECRET)
    assert info.value.reason == "refused"


def test_a_cache_salt_is_bounded(worker):
    """``cache_salt`` is hashed into every block hash of the prompt and travels in each lease: more than
    1024 characters is a 400 naming it (a 16 MiB salt would cost the engine thread seconds per request)."""
    for path, body in [("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 1}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1})]:
        response = worker.post(path, {**body, "cache_salt": "s" * 1025})
        assert response.status_code == 400 and response.json()["error"]["param"] == "cache_salt", response.text
        assert worker.post(path, {**body, "cache_salt": "s" * 1024}).status_code == 200


def test_a_lease_id_is_useless_without_the_secret(worker):
    """Whoever learns a lease id (and the producer's address) cannot pull it, nor spend it: the real consumer
    still gets it."""
    prompt = list(range(300, 340))
    lease = completion(worker, prompt, 1, signed({"do_remote_decode": True})).json()["kv_transfer_params"]
    host, port = lease["remote_host"], lease["remote_port"]
    for secret in (None, OTHER_SECRET):
        with socket.create_connection((host, port), timeout=10) as sock:
            server_nonce = recv_frame(sock)["nonce"]
            pull = {"op": "pull", "lease_id": lease["remote_lease_id"], "transport": "tcp", "first_block": 0,
                    "num_blocks": None, "nonce": new_nonce()}
            if secret is not None:
                pull = sign_frame(secret, "pull", server_nonce, pull["nonce"], pull)
            send_frame(sock, pull)
            answer = recv_frame(sock)
            assert answer["ok"] is False and "meta" not in answer, answer
    status = kv_status(worker)
    assert status["leases"] >= 1 and status["auth_failures_total"] >= 2
    # A consumer holding the secret with another lease id is refused too (ids are 128 random bits).
    with pytest.raises(TransferError) as info:
        pull_blocks(host, port, secrets.token_hex(16), small_expected(), "tcp", timeout_s=5, secret=SECRET)
    assert info.value.reason == "refused"
    # The real consumer (this worker, told by the "router") still pulls the lease.
    before = kv_status(worker)["remote_tokens"]
    decoded = completion(worker, prompt, 2, signed(lease))
    assert decoded.status_code == 200
    assert kv_status(worker)["remote_tokens"] > before


def test_a_producer_without_the_secret_is_refused_and_its_bytes_never_used(worker):
    """Signed parameters whose address an impostor holds (say, the producer died and another process took its
    port): the worker connects, sees no proof of the secret, and computes the prompt itself."""
    impostor = FakeProducer(secret=None, nbytes=3 * BLOCK_BYTES, payload=bytes(3 * BLOCK_BYTES))
    prompt = list(range(400, 440))
    before = kv_status(worker)
    params = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": impostor.port,
              "remote_lease_id": "b" * 32, "remote_num_tokens": len(prompt)}
    answer = completion(worker, prompt, 4, signed(params))
    assert answer.status_code == 200
    after = kv_status(worker)
    assert impostor.connections == 1
    assert after["local_fallbacks"].get("auth", 0) == before["local_fallbacks"].get("auth", 0) + 1
    assert after["remote_tokens"] == before["remote_tokens"]
    again = completion(worker, prompt, 4)  # the prefix cache holds the locally computed blocks
    assert again.json()["choices"][0]["text"] == answer.json()["choices"][0]["text"]
    impostor.close()


def test_anonymous_connections_to_the_producer_port_are_capped_and_allocate_nothing(worker):
    host, port = kv_status(worker)["producer_address"].rsplit(":", 1)
    proc = Path(f"/proc/{worker.proc.pid}/status")

    def rss_and_threads() -> tuple[int, int]:
        text = proc.read_text()
        return (int(re.search(r"VmRSS:\s+(\d+)", text).group(1)) * 1024,
                int(re.search(r"Threads:\s+(\d+)", text).group(1)))

    before = kv_status(worker)
    rss0, threads0 = rss_and_threads()
    socks = [socket.create_connection((host, int(port)), timeout=30) for _ in range(24)]
    for sock in socks:
        try:
            sock.recv(4)  # the producer's nonce frame, or b"": closed to admit a newer connection
        except ConnectionResetError:
            pass
    rss1, threads1 = rss_and_threads()
    assert threads1 - threads0 <= 16 + 2  # a thread per unauthenticated connection kept (max_connections)
    status = kv_status(worker)
    assert status["handshakes_evicted_total"] - before["handshakes_evicted_total"] >= 24 - 16  # oldest closed
    assert status["connections"] <= 16
    for sock in socks:
        try:
            sock.sendall(struct.pack(">I", (64 << 20) - 1))  # "a 64 MiB frame follows"
        except OSError:
            pass  # already closed
    for sock in socks:
        try:
            while sock.recv(65536):  # the rest of the nonce frame, then the producer hangs up
                pass
        except ConnectionResetError:
            pass
        sock.close()
    rss2, _ = rss_and_threads()
    assert rss2 - rss0 < 64 << 20, (rss0, rss1, rss2)  # no buffer sized from the peer's length word
    with socket.create_connection((host, int(port)), timeout=30) as sock:  # the slots were given back
        assert sock.recv(4)


def test_idle_anonymous_connections_from_several_addresses_do_not_block_a_real_pull(worker):
    """Anonymous connections from 127.0.0.2-4, held idle and re-opened whenever the producer closes them, do not
    keep a consumer holding the secret from pulling: they wait in their own pool, the oldest of the most
    crowded address closed to admit a newcomer, and never use the authenticated transfers' capacity."""
    host, port = kv_status(worker)["producer_address"].rsplit(":", 1)
    stop, greeted, lock = threading.Event(), [0], threading.Lock()

    def crowd(source: str) -> None:  # 8 idle connections from ``source``, each re-opened when closed
        socks: list[socket.socket] = []
        while not stop.is_set():
            while len(socks) < 8 and not stop.is_set():
                try:
                    sock = socket.create_connection((host, int(port)), timeout=5, source_address=(source, 0))
                    socks.append(sock)
                    if sock.recv(4):
                        with lock:
                            greeted[0] += 1
                except OSError:
                    time.sleep(0.01)
            readable, _, _ = select.select(socks, [], [], 0.05)
            for sock in readable:  # readable and then b"": the producer hung up
                try:
                    gone = not sock.recv(4096)
                except OSError:
                    gone = True
                if gone:
                    socks.remove(sock)
                    sock.close()
        for sock in socks:
            sock.close()

    threads = [threading.Thread(target=crowd, args=(f"127.0.0.{i}",), daemon=True) for i in (2, 3, 4)]
    for thread in threads:
        thread.start()
    try:
        deadline = time.monotonic() + 30
        while greeted[0] < 24 and time.monotonic() < deadline:  # more than max_connections (16) are open
            time.sleep(0.05)
        assert greeted[0] >= 24
        prompt = list(range(500, 540))
        before = kv_status(worker)
        lease = completion(worker, prompt, 1, signed({"do_remote_decode": True})).json()["kv_transfer_params"]
        decoded = completion(worker, prompt, 2, signed(lease))
        assert decoded.status_code == 200
        after = kv_status(worker)
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)
    assert after["local_fallbacks"] == before["local_fallbacks"], after["local_fallbacks"]
    assert after["remote_tokens"] > before["remote_tokens"]
    assert after["handshakes_evicted_total"] > before["handshakes_evicted_total"]  # the crowd was there


# ---- the transport: the consumer believes nothing it cannot check -----------------------------------------------
def test_an_oversized_nbytes_is_refused_before_anything_is_allocated():
    for secret, reason in [(SECRET, "too_large"), (None, "auth")]:
        fake = FakeProducer(secret=secret, nbytes=3 << 29)  # "1.5 GiB of blocks follow"
        tracemalloc.start()
        try:
            with pytest.raises(TransferError) as info:
                pull_blocks("127.0.0.1", fake.port, "c" * 32, small_expected(), "tcp", timeout_s=10, secret=SECRET)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert info.value.reason == reason, info.value
        assert peak < 16 << 20, peak
        assert fake.peer_closed.wait(10)  # the consumer hung up instead of waiting for the bytes
        fake.close()


def test_one_deadline_covers_the_whole_pull():
    """A producer dripping its blocks (each read well within any per-read timeout) is cut off at the pull's
    deadline, not after its last byte."""
    payload = bytes(3 * BLOCK_BYTES)
    fake = FakeProducer(secret=SECRET, nbytes=len(payload), payload=payload, chunk=64, pause=0.1)  # ~5 s of drip
    with pytest.raises(TransferError) as info:
        pull_blocks("127.0.0.1", fake.port, "d" * 32, small_expected(), "tcp", timeout_s=1.0, secret=SECRET)
    assert info.value.reason == "timeout"
    assert fake.peer_closed.wait(30) and fake.sent < len(payload)
    fake.close()


def test_the_consumer_tries_once_more_when_the_producer_hangs_up_before_answering():
    """A producer that closes a connection unanswered (it was crowding its unauthenticated pool) is connected
    to once more: the second connection's answer decides (here an unsigned one: ``auth``)."""
    fake = FakeProducer(secret=None, nbytes=3 * BLOCK_BYTES, drop_first=True)
    with pytest.raises(TransferError) as info:
        pull_blocks("127.0.0.1", fake.port, "f" * 32, small_expected(), "tcp", timeout_s=10, secret=SECRET)
    assert info.value.reason == "auth" and fake.connections == 2
    fake.close()


def test_allowed_consumers_and_the_busy_answer():
    """A producer with ``allowed_consumers`` closes connections from elsewhere on accept; with
    ``max_connections`` authenticated transfers running, one more signed pull is answered "busy" (no lease spent)."""
    producer = small_producer(allowed_consumers=("127.0.0.1/32",), max_connections=1, max_lease_blocks=8)
    try:
        with socket.create_connection(("127.0.0.1", producer.port), timeout=10,
                                      source_address=("127.0.0.2", 0)) as sock:
            assert sock.recv(4) == b""  # closed unanswered
        assert producer.stats.connections_refused_total == 1
        first = producer.add_lease("req-1", [0, 1, 2], SMALL_PROMPT, ())
        second = producer.add_lease("req-2", [3, 4, 5], SMALL_PROMPT, ())
        with socket.create_connection(("127.0.0.1", producer.port), timeout=10) as held:
            server_nonce, client_nonce = recv_frame(held)["nonce"], new_nonce()
            pull = {"op": "pull", "lease_id": first.lease_id, "transport": "tcp", "first_block": 0,
                    "num_blocks": None, "nonce": client_nonce}
            send_frame(held, sign_frame(SECRET, "pull", server_nonce, client_nonce, pull))
            assert recv_frame(held)["ok"] is True  # the blocks follow; no confirm yet: the transfer is running
            with pytest.raises(TransferError, match="busy") as info:
                pull_blocks("127.0.0.1", producer.port, second.lease_id, small_expected(), "tcp", timeout_s=10,
                            secret=SECRET)
            assert info.value.reason == "refused"
        deadline = time.monotonic() + 30
        while producer.num_connections and time.monotonic() < deadline:  # the held transfer's thread ends
            time.sleep(0.01)
        _, blocks, _ = pull_blocks("127.0.0.1", producer.port, second.lease_id, small_expected(), "tcp",
                                   timeout_s=10, secret=SECRET)  # the slot is free again; the lease was kept
        assert blocks.shape == (3, BLOCK_BYTES)
    finally:
        producer.close()
    for bad in [{"allowed_consumers": ["10.0.0.0/33"]}, {"allowed_consumers": "10.0.0.0/8"},
                {"allowed_consumers": ["consumer.internal"]}]:
        with pytest.raises(ConfigError, match="allowed_consumers"):
            KVTransferConfig(kv_role="kv_both", kv_connector_extra_config=bad)
    assert KVTransferConfig(kv_connector_extra_config={"allowed_consumers": ["10.0.0.0/8", "::1"]}
                            ).allowed_consumers == ("10.0.0.0/8", "::1")


def test_consumer_and_producer_with_different_secrets_refuse_each_other():
    producer = small_producer(secret=OTHER_SECRET)
    try:
        lease = producer.add_lease("req", [0, 1, 2], SMALL_PROMPT, ())
        with pytest.raises(TransferError) as info:
            pull_blocks("127.0.0.1", producer.port, lease.lease_id, small_expected(), "tcp", secret=SECRET)
        assert info.value.reason == "auth"
        assert producer.num_leases == 1 and producer.take_released() == []  # the lease was not spent
        assert producer.stats.auth_failures_total == 1
        # A pull signed for one connection's nonce is refused on another (no replay of a captured frame).
        with socket.create_connection(("127.0.0.1", producer.port), timeout=10) as sock:
            first_nonce = recv_frame(sock)["nonce"]
        with socket.create_connection(("127.0.0.1", producer.port), timeout=10) as sock:
            recv_frame(sock)
            client_nonce = new_nonce()
            pull = {"op": "pull", "lease_id": lease.lease_id, "transport": "tcp", "first_block": 0,
                    "num_blocks": None, "nonce": client_nonce}
            send_frame(sock, sign_frame(OTHER_SECRET, "pull", first_nonce, client_nonce, pull))
            assert recv_frame(sock)["ok"] is False
        meta, blocks, _ = pull_blocks("127.0.0.1", producer.port, lease.lease_id, small_expected(), "tcp",
                                      secret=OTHER_SECRET)
        assert blocks.shape == (3, BLOCK_BYTES) and meta.num_tokens == len(SMALL_PROMPT)
    finally:
        producer.close()


def test_allowed_producers_keep_the_consumer_from_connecting_elsewhere():
    trap = socket.create_server(("127.0.0.1", 0))
    trap.setblocking(False)
    with pytest.raises(TransferError) as info:
        pull_blocks("127.0.0.1", trap.getsockname()[1], "e" * 32, small_expected(), "tcp", timeout_s=5,
                    secret=SECRET, allowed_producers=("10.0.0.0/8", "prefill-0.internal"))
    assert info.value.reason == "not_allowed"
    with pytest.raises(BlockingIOError):
        trap.accept()
    trap.close()
    producer = small_producer()
    try:
        lease = producer.add_lease("req", [0, 1, 2], SMALL_PROMPT, ())
        _, blocks, _ = pull_blocks("127.0.0.1", producer.port, lease.lease_id, small_expected(), "tcp",
                                   secret=SECRET, allowed_producers=("127.0.0.0/8",))
        assert blocks.shape[0] == 3
    finally:
        producer.close()
    for bad in [{"allowed_producers": ["10.0.0.0/33"]}, {"allowed_producers": "10.0.0.0/8"},
                {"max_connections": 0}, {"max_leases": 1.5}, {"max_lease_blocks": True}, {"secret_file": 7}]:
        with pytest.raises(ConfigError, match=next(iter(bad))):
            KVTransferConfig(kv_role="kv_both", kv_connector_extra_config=bad)


# ---- leases ------------------------------------------------------------------------------------------------------
def test_leases_cannot_pin_more_than_half_the_pool_nor_exceed_max_leases(tiny):
    """The issue's attack: finished prefills nobody pulls would pin most of a 48-block pool for the lease TTL and
    another request would wait for them. Now a prefill over the cap is not leased (its answer carries no
    parameters) and the other request runs at once."""
    with LLM(tiny, kv_transfer_config={"kv_role": "kv_producer"}, dtype="float32", num_threads=1,
             block_size=BLOCK_SIZE, num_kv_blocks=48) as llm:
        engine = llm.engine
        outputs = []
        for i in range(3):  # 240 tokens: 15 blocks each
            prompt = list(range(10 + i * 240, 10 + (i + 1) * 240))
            engine.add_request(f"pin-{i}", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, temperature=0),
                               kv_transfer_params={"do_remote_decode": True})  # in process: plain parameters
            outputs.append(_run_until_finished(engine, f"pin-{i}"))
        assert [o.kv_transfer_params is not None for o in outputs] == [True, False, False]
        producer = engine.kv_connector.producer
        assert producer.stats.leases_refused_total == 2 and producer.num_leases == 1
        engine.add_request("victim", {"prompt_token_ids": list(range(1000, 1300))},
                           SamplingParams(max_tokens=4, temperature=0))
        victim = _run_until_finished(engine, "victim")
        assert len(victim.outputs[0].token_ids) == 4
        assert producer.stats.leases_expired_total == 0  # it did not wait for a lease to expire
    producer = small_producer(max_leases=2)
    try:
        assert producer.max_lease_blocks == 4  # half of the 8-block pool
        assert producer.add_lease("a", [0], SMALL_PROMPT[:4], ()) is not None
        assert producer.add_lease("b", [1, 2, 3, 4], SMALL_PROMPT, ()) is None  # 5 blocks > 4
        assert producer.add_lease("c", [1], SMALL_PROMPT[:4], ()) is not None
        assert producer.add_lease("d", [2], SMALL_PROMPT[:4], ()) is None  # a third lease
        assert producer.stats.leases_refused_total == 2
    finally:
        producer.close()


def _run_until_finished(engine, request_id: str, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for output in engine.step():
            if output.finished and output.request_id == request_id:
                return output
    raise TimeoutError(request_id)


# ---- shared-memory files -----------------------------------------------------------------------------------------
CRASHING_PRODUCER = """
import sys, time, torch
from tokenmill.kv_transfer.producer import KVProducer
from tokenmill.runner.kv_pool import KVPool
producer = KVProducer(KVPool.over(torch.randn(2, 2, 8, 4, 2, 8)), 4, lambda: "fp-a", secret=sys.argv[1].encode())
lease = producer.add_lease("r", [1, 2, 3], list(range(1000, 1011)), ())
print(producer.port, lease.lease_id, flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(not SHM_DIR.is_dir(), reason="needs /dev/shm")
def test_shm_files_are_private_random_and_a_crashed_producers_files_are_removed():
    secret = secrets.token_hex(24)
    child = subprocess.Popen([sys.executable, "-c", CRASHING_PRODUCER, secret], stdout=subprocess.PIPE, text=True,
                             cwd=REPO)
    try:
        port, lease_id = child.stdout.readline().split()
        with socket.create_connection(("127.0.0.1", int(port)), timeout=30) as sock:
            server_nonce = recv_frame(sock)["nonce"]
            client_nonce = new_nonce()
            pull = {"op": "pull", "lease_id": lease_id, "transport": "shm", "first_block": 0, "num_blocks": None,
                    "nonce": client_nonce}
            send_frame(sock, sign_frame(secret.encode(), "pull", server_nonce, client_nonce, pull))
            path = Path(recv_frame(sock)["shm_path"])
            assert re.fullmatch(rf"tokenmill-kv-{child.pid}-[0-9a-f]{{32}}", path.name), path
            assert path.stat().st_mode & 0o777 == 0o600
            child.send_signal(signal.SIGKILL)  # dies before the confirm: nobody removes its file
            child.wait(30)
        assert path.exists()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    alive = SHM_DIR / f"tokenmill-kv-{os.getppid()}-{secrets.token_hex(16)}"  # a live process's file
    alive.write_bytes(b"x")
    try:
        producer = small_producer()  # a starting producer sweeps the dead ones' files
        producer.close()
        assert not path.exists() and alive.exists()
    finally:
        alive.unlink(missing_ok=True)
        path.unlink(missing_ok=True)
