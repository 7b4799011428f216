"""KV transfer transports (tokenmill/kv_transfer/): leases, TCP and shared-memory pulls, and every way a
pull can fail (unknown or expired lease, another model or prompt, corrupt bytes, a producer that
dies or stalls mid-transfer), each reported with its reason, each leaving no lease behind.
"""
from __future__ import annotations

import math
import socket
import threading
import time

import pytest
import torch

from tokenmill.kv_cache.block_hash import extend_block_hashes
from tokenmill.kv_transfer.consumer import Expected, is_local_host, pull_blocks
from tokenmill.kv_transfer.producer import KVProducer
from tokenmill.kv_transfer.protocol import (TransferError, TransferMeta, new_nonce, recv_frame, send_frame,
                                            sign_frame)
from tokenmill.runner.kv_pool import KVPool

LAYERS, BLOCK_SIZE, HEADS, DIM, NUM_BLOCKS = 2, 4, 2, 8, 8
SHAPE = [LAYERS, 2, BLOCK_SIZE, HEADS, DIM]
PROMPT = list(range(1000, 1011))  # 11 tokens: 3 blocks, the last one partial
SECRET = b"kv-transfer-test-secret-0123456789"  # the cluster secret both ends hold


def make_producer(dtype=torch.float32, ttl: float = 30.0) -> KVProducer:
    kv = torch.randn(LAYERS, 2, NUM_BLOCKS, BLOCK_SIZE, HEADS, DIM).to(dtype)
    return KVProducer(KVPool.over(kv), BLOCK_SIZE, lambda: "fp-a", lease_ttl_s=ttl, secret=SECRET)


def expected(**overrides) -> Expected:
    dtype = getattr(torch, overrides.get("kv_dtype", "float32"))
    fields = dict(model_fingerprint="fp-a", kv_dtype="float32", block_size=BLOCK_SIZE, block_shape=SHAPE,
                  block_bytes=math.prod(SHAPE) * dtype.itemsize, prompt_token_ids=PROMPT + [5, 6], extra_keys=[])
    return Expected(**{**fields, **overrides})


@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pull_returns_the_leased_blocks_and_the_lease_is_released(transport, dtype):
    producer = make_producer(dtype)
    try:
        lease = producer.add_lease("req-1", [5, 2, 7], PROMPT, ())
        meta, blocks, nbytes = pull_blocks("127.0.0.1", producer.port, lease.lease_id,
                                           expected(kv_dtype=str(dtype).removeprefix("torch.")), transport,
                                           secret=SECRET)
        want = producer.pool.kv[:, :, [5, 2, 7]].permute(2, 0, 1, 3, 4, 5)
        assert blocks.dtype == torch.uint8 and torch.equal(producer.pool.split(blocks)[0], want)  # the pool's rows
        assert meta.num_tokens == len(PROMPT) and meta.token_ids == PROMPT and meta.num_blocks == 3
        assert len(meta.block_hashes) == len(PROMPT) // BLOCK_SIZE  # the chain of the full blocks
        assert nbytes == blocks.numel() == producer.stats.bytes_sent_total
        shm_path = next(iter(producer._leases.values())).shm_path
        assert (shm_path is not None) == (transport == "shm")
        assert producer.take_released() == ["req-1"] and producer.num_leases == 0
        lease = producer.add_lease("req-2", [5, 2, 7], PROMPT, ())  # only the blocks after a local hit
        meta, blocks, _ = pull_blocks("127.0.0.1", producer.port, lease.lease_id,
                                      expected(kv_dtype=str(dtype).removeprefix("torch.")), transport, first_block=2,
                                      secret=SECRET)
        assert meta.first_block == 2 and torch.equal(producer.pool.split(blocks)[0], want[2:])
        assert producer.take_released() == ["req-2"]
        assert shm_path is None or not shm_path.exists()
        with pytest.raises(TransferError) as info:  # one pull per lease
            pull_blocks("127.0.0.1", producer.port, lease.lease_id, expected(), transport, secret=SECRET)
        assert info.value.reason == "refused"
    finally:
        producer.close()


def test_unclaimed_leases_expire_and_close_returns_the_rest():
    producer = make_producer(ttl=0.2)
    try:
        producer.add_lease("old", [1], PROMPT[:4], ())
        assert producer.take_released() == []
        assert producer.take_released(now=time.monotonic() + 1.0) == ["old"]
        assert producer.stats.leases_expired_total == 1
        producer.add_lease("open", [2], PROMPT[:4], ())
    finally:
        assert producer.close() == ["open"]


def released(producer: KVProducer, timeout: float = 10.0) -> list[str]:
    """The producer's released leases once there are any (a consumer that refuses an oversized payload closes
    the connection, and the producer's thread notices a moment later)."""
    deadline = time.monotonic() + timeout
    while not (ids := producer.take_released()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return ids


@pytest.mark.parametrize("override, why", [
    (dict(model_fingerprint="fp-b"), "another model"),
    (dict(kv_dtype="bfloat16"), "kv_dtype"),
    (dict(block_size=8, block_shape=[LAYERS, 2, 8, HEADS, DIM]), "block shape"),
    (dict(prompt_token_ids=[1] + PROMPT), "another prompt"),
    (dict(extra_keys=["salt"]), "extra keys"),
])
def test_a_mismatched_lease_is_refused_and_still_released(override, why):
    producer = make_producer()
    try:
        lease = producer.add_lease("req", [0, 1, 2], PROMPT, ())
        with pytest.raises(TransferError, match=why) as info:
            pull_blocks("127.0.0.1", producer.port, lease.lease_id, expected(**override), "tcp", secret=SECRET)
        assert info.value.reason == "mismatch"
        assert released(producer) == ["req"]  # a payload this consumer cannot use is not even read
    finally:
        producer.close()


class HostileProducer:
    """A producer holding the secret and speaking the protocol that misbehaves on purpose: ``mode`` is
    ``corrupt`` (one byte changed after the checksum), ``cut`` (closes halfway through the blocks) or ``stall``
    (never sends them)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        conn, _ = self.sock.accept()
        with conn:
            server_nonce = new_nonce()
            send_frame(conn, {"nonce": server_nonce})
            client_nonce = recv_frame(conn)["nonce"]
            blocks = torch.randn(3, *SHAPE)
            data = bytearray(blocks.numpy().tobytes())
            import hashlib

            chain: list[int] = []
            extend_block_hashes(chain, PROMPT, BLOCK_SIZE)
            meta = TransferMeta(len(PROMPT), PROMPT, [], [f"{h:016x}" for h in chain], "fp-a", "float32", BLOCK_SIZE,
                                SHAPE, math.prod(SHAPE) * 4, 0, 3, hashlib.sha256(data).hexdigest())
            if self.mode == "corrupt":
                data[100] ^= 0xFF
            send_frame(conn, sign_frame(SECRET, "reply", server_nonce, client_nonce,
                                        {"ok": True, "meta": meta.as_dict(), "nbytes": len(data)}))
            if self.mode == "cut":
                conn.sendall(data[: len(data) // 2])
                return
            if self.mode == "stall":
                time.sleep(3)
                return
            conn.sendall(data)
            recv_frame(conn)
            send_frame(conn, sign_frame(SECRET, "ack", server_nonce, client_nonce, {"ok": True}))


@pytest.mark.parametrize("mode, reason", [("corrupt", "corrupt"), ("cut", "protocol"), ("stall", "timeout")])
def test_corrupt_cut_and_stalled_transfers_fail_with_their_reason_within_the_timeout(mode, reason):
    hostile = HostileProducer(mode)
    t0 = time.monotonic()
    with pytest.raises(TransferError) as info:
        pull_blocks("127.0.0.1", hostile.port, "any", expected(), "tcp", timeout_s=1.0, secret=SECRET)
    assert info.value.reason == reason, info.value
    assert time.monotonic() - t0 < 2.5
    hostile.sock.close()


def test_no_producer_is_a_connect_error_and_local_hosts_are_recognised():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(TransferError) as info:
        pull_blocks("127.0.0.1", port, "x", expected(), "tcp", timeout_s=1.0, secret=SECRET)
    assert info.value.reason == "connect"
    assert is_local_host("127.0.0.1") and is_local_host("localhost") and is_local_host(socket.gethostname())
    assert not is_local_host("192.0.2.1")  # TEST-NET-1: never this machine
