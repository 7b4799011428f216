"""KV cache events and the router's KV index: the engine reports every block that enters or leaves a
tier (with the prefix cache's own hashes), the publisher numbers and replays batches, KVIndex mirrors
each worker's tiers, and ``kv_aware`` routes repeats to the worker that holds their blocks while the
bounded-load cap holds. Engines run in process on a tiny random Llama; the last tests start two real
``tokenmill serve`` workers."""
from __future__ import annotations

import json
import random
import re
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler

import httpx2 as httpx
import msgpack

import pytest
import zmq

from tests.server_fixtures import LocalHTTPServer, ServerProcess, free_port
from tests.tiny_models import make_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.config import ConfigError
from tokenmill.engine.llm import build_engine_config
from tokenmill.kv_cache.block_hash import ROOT_HASH, hash_block_tokens
from tokenmill.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventCollector,
    decode_batch,
    encode_batch,
)
from tokenmill.kv_events.events import decode_seq
from tokenmill.kv_events.publisher import ZmqEventPublisher
from tokenmill.config import KVEventsConfig
from tokenmill.router.kv_aware import KVAwarePolicy, load_cap, request_block_hashes
from tokenmill.router.kv_index import KVIndex, kv_event_endpoints
from tokenmill.router.policy import RouteRequest, WorkerView
from tokenmill.router.tokenize import load_router_tokenizer

BLOCK_SIZE = 4
EVENTS = {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*"}
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
GIB = 1024**3
BLOCK_BYTES = 2 * 2 * 2 * BLOCK_SIZE * 16 * 4  # tiny llama: 2 layers x K,V x 2 KV heads x 4 tokens x head_dim 16 x fp32


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("llama")))


def wait_until(predicate, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached in {timeout}s")
        time.sleep(0.01)


class RawSubscriber:
    """A plain SUB socket that keeps every (seq, batch) it receives, for exact assertions."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.batches: list[tuple[int, list]] = []

    def ready(self, publisher) -> None:
        """Publish probes until one arrives (the PUB/SUB handshake is asynchronous), then forget them."""
        wait_until(lambda: self._probe(publisher), what="subscription")
        self.batches.clear()

    def _probe(self, publisher) -> bool:
        publisher.collector.all_cleared("probe")
        publisher.publish_pending()
        return self.sock.poll(50) and bool(self.receive())

    def receive(self, until_seq: int | None = None, timeout: float = 5.0) -> list[tuple[int, list]]:
        deadline = time.monotonic() + timeout
        while self.sock.poll(10 if until_seq is None else 100):
            _, seq, payload = self.sock.recv_multipart()
            self.batches.append((decode_seq(seq), decode_batch(payload).events))
            if until_seq is not None and decode_seq(seq) >= until_seq or time.monotonic() > deadline:
                break
        return self.batches

    def events(self) -> list:
        return [e for _, events in self.batches for e in events]

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def make_llm(path: str, **kwargs) -> LLM:
    kwargs.setdefault("kv_events_config", EVENTS)
    return LLM(model=path, dtype="float32", block_size=BLOCK_SIZE, num_threads=1, max_model_len=96,
               max_num_batched_tokens=64, **kwargs)


def prompts(seed: int, n: int, length: int = 22, shared: int = 12) -> list[list[int]]:
    rng = random.Random(seed)
    head = [rng.randrange(100, 40000) for _ in range(shared)]
    return [head + [rng.randrange(100, 40000) for _ in range(length - shared)] for _ in range(n)]


def synced(index: KVIndex, worker_id: str, publisher) -> bool:
    """The index applied every batch the engine has handed to its publisher."""
    return publisher.num_batches > 0 and index.last_seq(worker_id) == publisher.num_batches - 1


# ---- wire format and collector -------------------------------------------------------------------
def test_batch_round_trip_keeps_64_bit_hashes_and_skips_unknown_event_types():
    top = 2**64 - 1  # block hashes are unsigned 64-bit: JSON readers that use doubles would round this
    events = [BlockStored((top, 5), None, (1, 2, 3, 4, 5, 6, 7, 8), 4, "pool", 3, "adapter", ("salt", "lora:ab")),
              BlockStored((7,), None, None, 4, "disk"), BlockRemoved((top,), "ram"), AllBlocksCleared(None)]
    batch = decode_batch(encode_batch(12.5, events, instance=99))
    assert batch.events == events and batch.ts == 12.5 and batch.instance == 99
    wire = msgpack.unpackb(encode_batch(1.0, events))
    wire["events"].insert(1, {"type": "SomethingNew", "x": 1})  # a newer publisher's event
    assert decode_batch(msgpack.packb(wire)).events == events
    with pytest.raises(ValueError, match="not a KV event batch"):
        decode_batch(b"\x01\x02")


def test_collector_merges_consecutive_hash_only_events_of_one_tier_and_keeps_order():
    collector = KVEventCollector(block_size=4)
    collector.block_removed([1], "pool")
    collector.block_removed([2], "pool")
    collector.hashes_stored([1, 2], "ram")
    collector.hashes_stored([3], "ram")
    collector.block_removed([9], "ram")
    collector.block_stored([5, 6], 4, list(range(8)), ("salt",))
    collector.block_removed([], "pool")  # nothing: dropped
    assert collector.take() == [BlockRemoved((1, 2), "pool"), BlockStored((1, 2, 3), None, None, 4, "ram"),
                                BlockRemoved((9,), "ram"), BlockStored((5, 6), 4, tuple(range(8)), 4, "pool",
                                                                       extra_keys=("salt",))]
    assert collector.take() == []


def test_config_is_checked_and_named_like_vllm():
    assert build_engine_config().kv_events_config.enable_kv_cache_events is False
    config = build_engine_config(kv_events_config='{"enable_kv_cache_events": true, "topic": "kv"}').kv_events_config
    assert (config.publisher, config.endpoint, config.replay_endpoint, config.topic) == ("zmq", "tcp://127.0.0.1:5557", None,
                                                                                        "kv")
    for bad, message in [('{"publisher": "kafka"}', "publisher must be 'zmq' or 'null'"),
                         ('{"endpoint": "localhost:5557"}', "endpoint must be a ZeroMQ endpoint"),
                         ('{"buffer_steps": 0}', "buffer_steps must be an integer >= 1"),
                         ('{"enable": true}', "unknown keys"), ("{not json", "must be JSON")]:
        with pytest.raises(ConfigError, match=message) as info:
            build_engine_config(kv_events_config=bad)
        assert info.value.for_cli().startswith("--kv-events-config")


# ---- the index and the policy, fed directly ----------------------------------------------------------
def test_index_keeps_tiers_per_worker_and_overlap_counts_leading_blocks():
    index = KVIndex()
    index.apply("a", [BlockStored((1, 2, 3), None, tuple(range(12)), 4, "pool")])
    index.apply("b", [BlockStored((1, 2), None, tuple(range(8)), 4, "pool")])
    index.apply("a", [BlockRemoved((2,), "pool"), BlockStored((2,), None, None, 4, "ram")])
    assert index.tiers(2) == {"a": {"ram"}, "b": {"pool"}}
    assert index.overlaps([1, 2, 3, 4], ["a", "b", "c"]) == {"a": 3, "b": 2, "c": 0}
    assert index.overlap("a", [1, 2, 3]) == 3 and index.overlap("a", [2, 3]) == 2 and index.overlap("b", [3]) == 0
    assert index.overlap("a", [1, 2, 3], tiers=1) == 1  # pool only: block 2 is in RAM
    index.apply("a", [AllBlocksCleared("ram")])
    assert index.tiers(2) == {"b": {"pool"}} and index.worker_blocks("a") == {1, 3}
    index.apply("b", [AllBlocksCleared(None)])
    assert index.overlaps([1], ["a", "b"]) == {"a": 1, "b": 0} and index.num_blocks("b") == 0
    index.remove_worker("a")
    assert index.tiers(1) == {} and index.num_blocks("a") == 0


def view(worker_id: str, load: int = 0, block_size: int | None = BLOCK_SIZE) -> WorkerView:
    return WorkerView(worker_id, f"http://{worker_id}", True, load, 0, True, block_size)


def route_request(token_ids, max_tokens: int = 8, extra_keys=None) -> RouteRequest:
    ids = tuple(token_ids) if token_ids is not None else None
    return RouteRequest("r", "text", ids, len(token_ids) if token_ids is not None else 20, max_tokens,
                        extra_keys=extra_keys)


def hold(index: KVIndex, worker_id: str, token_ids, extra_keys=(), block_size: int = BLOCK_SIZE) -> list[int]:
    hashes = request_block_hashes(token_ids, block_size, extra_keys)
    index.apply(worker_id, [BlockStored(tuple(hashes), None, tuple(token_ids[: len(hashes) * block_size]),
                                        block_size, "pool")])
    return hashes


def test_kv_aware_prefers_the_holder_until_the_cap_forbids_it():
    index = KVIndex()
    policy = KVAwarePolicy(index, overlap_weight=1.0, epsilon=0.25)
    prompt = list(range(100, 141))  # 41 tokens: 10 blocks can hit
    hold(index, "b", prompt[:25])  # b holds 6 blocks
    decision = policy.select(route_request(prompt), [view("a"), view("b"), view("c")])
    assert (decision.worker_id, decision.reason, decision.expected_hit_tokens) == ("b", "kv_overlap", 24)
    # b is busier, but 6 blocks saved outweigh 4 blocks of extra decode load: still b.
    decision = policy.select(route_request(prompt), [view("a", 30), view("b", 46), view("c", 30)])
    assert decision.worker_id == "b"
    # b above (1 + eps) x the mean (with this request's 49 tokens) is not eligible, however much a
    # prefill block weighs (without the cap, weight 10 would pick b: cost 40 + 30 against 100 + 2.5).
    workers = [view("a", 10), view("b", 120), view("c", 10)]
    assert 120 > load_cap(workers, 49, 0.25)
    heavy = KVAwarePolicy(index, overlap_weight=10.0, epsilon=0.25)
    decision = heavy.select(route_request(prompt), workers)
    assert decision.reason == "load_cap" and decision.worker_id in ("a", "c")
    assert heavy.select(route_request(prompt), [view("a", 10), view("b", 45), view("c", 10)]).worker_id == "b"
    # With overlap_weight 0 the cache is ignored: least load wins.
    assert KVAwarePolicy(index, overlap_weight=0).select(route_request(prompt), [view("a", 9), view("b", 10)]).worker_id == "a"


def test_kv_aware_without_token_ids_is_least_load_under_the_cap():
    policy = KVAwarePolicy(KVIndex())
    decision = policy.select(route_request(None), [view("a", 50), view("b", 7), view("c", 9)])
    assert (decision.worker_id, decision.reason, decision.expected_hit_tokens) == ("b", "least_load", 0)


def test_kv_aware_hashes_with_the_requests_extra_keys_and_each_workers_block_size():
    index = KVIndex()
    policy = KVAwarePolicy(index)
    prompt = list(range(200, 233))
    hold(index, "salted", prompt, extra_keys=("tenant-1",))
    hold(index, "b8", prompt, block_size=8)
    workers = [view("salted"), view("b8", block_size=8), view("other")]
    plain = policy.select(route_request(prompt), workers)
    assert plain.worker_id == "b8" and plain.expected_hit_tokens == 32
    salted = policy.select(route_request(prompt, extra_keys=("tenant-1",)), workers)
    assert salted.worker_id == "salted" and salted.expected_hit_tokens == 32


def test_kv_aware_sends_a_new_prefix_to_a_stable_home_on_an_idle_fleet():
    policy = KVAwarePolicy(KVIndex())
    workers = [view(f"w{i}") for i in range(4)]
    homes = [policy.select(route_request([7 + i] * 9 + [1, 2, 3]), workers).worker_id for i in range(40)]
    again = [policy.select(route_request([7 + i] * 9 + [4, 5]), workers[::-1]).worker_id for i in range(40)]
    assert homes == again  # the first block decides, not the order of the workers or the rest of the prompt
    assert len(set(homes)) == 4  # and prefixes spread over the fleet


def test_kv_aware_predicts_a_dispatched_prompts_blocks_until_events_arrive_or_the_ttl_ends():
    now = [100.0]
    policy = KVAwarePolicy(KVIndex(), predicted_ttl=10.0, clock=lambda: now[0])
    shared = list(range(300, 364))  # 64 tokens: 4 full blocks shared by the burst
    first = route_request(shared + [1, 2, 3])
    home = policy.select(first, [view("a"), view("b")])
    assert home.reason == "cache_miss"
    policy.on_dispatched(first, home)
    other = "b" if home.worker_id == "a" else "a"
    # The second request of the burst: no KV event yet, its home is busier (40 outstanding tokens,
    # 2.5 blocks of load), yet the 4 predicted blocks outweigh that: it stays with the prefix.
    loads = {home.worker_id: 40, other: 0}
    second = route_request(shared + [4, 5])
    decision = policy.select(second, [view(w, loads[w]) for w in ("a", "b")])
    assert (decision.worker_id, decision.reason, decision.expected_hit_tokens) == (home.worker_id, "kv_overlap", 64)
    # Once the prediction has expired (and no event confirmed it), the load decides again.
    now[0] += 10.5
    policy.housekeeping()
    assert policy.select(second, [view(w, loads[w]) for w in ("a", "b")]).worker_id == other
    # predicted_ttl 0: events only.
    events_only = KVAwarePolicy(KVIndex(), predicted_ttl=0)
    events_only.on_dispatched(first, events_only.select(first, [view("a"), view("b")]))
    assert events_only.select(second, [view(w, loads[w]) for w in ("a", "b")]).worker_id == other
    with pytest.raises(ValueError, match="predicted_ttl"):
        KVAwarePolicy(KVIndex(), predicted_ttl=-1)


def test_kv_event_endpoints_from_a_workers_status():
    status = {"kv_events": {"enabled": True, "publisher": "zmq", "endpoint": "tcp://0.0.0.0:5557",
                            "replay_endpoint": "tcp://*:5558"}}
    assert kv_event_endpoints(status, "http://10.1.2.3:8000") == ("tcp://10.1.2.3:5557", "tcp://10.1.2.3:5558")
    assert kv_event_endpoints({"kv_events": {"enabled": False}}, "http://h:1") == (None, None)
    assert kv_event_endpoints({}, "http://h:1") == (None, None)


def test_kv_events_endpoints_flag_overrides_what_a_worker_reports():
    from tokenmill.cli.router import parse_kv_events_endpoints

    parsed = parse_kv_events_endpoints(["http://10.0.0.5:8000/=tcp://1.2.3.4:5557,tcp://1.2.3.4:5558",
                                        "w1=tcp://5.6.7.8:9"])
    assert parsed == {"http://10.0.0.5:8000": ("tcp://1.2.3.4:5557", "tcp://1.2.3.4:5558"), "w1": ("tcp://5.6.7.8:9", None)}
    for bad in ["tcp://1.2.3.4:5557", "w1=", "w1=a,b,c"]:
        with pytest.raises(ValueError, match="--kv-events-endpoints"):
            parse_kv_events_endpoints([bad])
    subscribed = []

    class Recording(KVIndex):
        def add_worker(self, worker_id, endpoint, replay_endpoint=None):
            subscribed.append((worker_id, endpoint, replay_endpoint))

    policy = KVAwarePolicy(Recording(), endpoints=parsed)
    policy.on_worker_added(WorkerView("w0", "http://10.0.0.5:8000", True, 0, 0, True, 16, "tcp://10.0.0.5:1", None))
    policy.on_worker_added(WorkerView("w1", "http://h:1", True, 0, 0, True, 16, None, None))
    policy.on_worker_added(WorkerView("w2", "http://h:2", True, 0, 0, True, 16, "tcp://h:3", "tcp://h:4"))
    assert subscribed == [("w0", "tcp://1.2.3.4:5557", "tcp://1.2.3.4:5558"), ("w1", "tcp://5.6.7.8:9", None),
                          ("w2", "tcp://h:3", "tcp://h:4")]


# ---- publisher and subscriber over ZeroMQ ------------------------------------------------------------
class DropSequence:
    """Stands in for the publisher's PUB socket and loses the batches numbered in ``drop``."""

    def __init__(self, sock: zmq.Socket, drop: set[int]) -> None:
        self.sock, self.drop = sock, drop

    def send_multipart(self, frames, flags=0):
        if decode_seq(frames[1]) not in self.drop:
            self.sock.send_multipart(frames, flags)

    def close(self, *args, **kwargs):
        self.sock.close(*args, **kwargs)


def test_late_subscriber_replays_the_buffer_and_a_missed_batch_is_replayed():
    publisher = ZmqEventPublisher(KVEventsConfig(**EVENTS, buffer_steps=100), KVEventCollector(4))
    publisher._pub = DropSequence(publisher._pub, drop=set())
    index = KVIndex()
    try:
        for i in range(3):  # before anyone listens
            publisher.collector.block_stored([i], None, [i] * 4)
            publisher.publish_pending()
        wait_until(lambda: publisher.next_seq == 3)
        index.add_worker("w", publisher.endpoint, publisher.replay_endpoint)
        wait_until(lambda: index.last_seq("w") == 2, what="replay on join")
        assert index.worker_blocks("w") == {0, 1, 2}
        wait_until(lambda: _probe_until_live(publisher, index), what="live subscription")
        # A lost batch is noticed at the next one and fetched from the replay socket.
        lost = publisher.num_batches
        publisher._pub.drop = {lost}
        publisher.collector.block_stored([100], None, [0] * 4)
        publisher.publish_pending()
        publisher.collector.block_removed([0], "pool")
        publisher.publish_pending()
        wait_until(lambda: index.last_seq("w") == lost + 1, what="gap filled")
        stats = index.stats()["w"]
        assert stats["gaps"] == 1 and stats["replays"] == 2 and stats["lost_batches"] == 0
        assert index.worker_blocks("w") == {1, 2, 100}
    finally:
        index.close()
        publisher.close()


def _probe_until_live(publisher, index, worker_id: str = "w") -> bool:
    """Publish a batch that changes nothing and see whether the index received it live."""
    publisher.collector.all_cleared("probe")  # an unknown tier: the index ignores it
    publisher.publish_pending()
    time.sleep(0.05)
    return index.last_seq(worker_id) == publisher.num_batches - 1


def test_a_restarted_publisher_replaces_the_workers_entries():
    ports = (free_port(), free_port())
    config = KVEventsConfig(True, endpoint=f"tcp://127.0.0.1:{ports[0]}", replay_endpoint=f"tcp://127.0.0.1:{ports[1]}")
    index = KVIndex()
    first = ZmqEventPublisher(config, KVEventCollector(4))
    try:
        index.add_worker("w", first.endpoint, first.replay_endpoint)
        wait_until(lambda: _probe_until_live(first, index), what="live subscription")
        first.collector.block_stored([1, 2], None, [0] * 8)
        first.publish_pending()
        wait_until(lambda: index.worker_blocks("w") == {1, 2})
        first.collector.all_cleared = lambda medium=None: None  # a crash: no farewell batch
        first.close()
        second = ZmqEventPublisher(config, KVEventCollector(4))  # the engine restarted on the same ports
        wait_until(lambda: _probe_until_live(second, index), timeout=20, what="resubscribed")
        second.collector.block_stored([3], None, [0] * 4)
        second.publish_pending()
        wait_until(lambda: index.worker_blocks("w") == {3}, what="entries of the old instance dropped")
        assert index.stats()["w"]["restarts"] == 1
        second.close()  # a clean stop: its last batch clears everything
        wait_until(lambda: index.num_blocks("w") == 0, what="AllBlocksCleared on close")
    finally:
        index.close()


# ---- the engine, in process --------------------------------------------------------------------------
def chain_ok(event: BlockStored) -> bool:
    """The stored tokens hash, block after block, to the announced hashes (the prefix cache's scheme)."""
    parent = ROOT_HASH if event.parent_block_hash is None else event.parent_block_hash
    for i, block_hash in enumerate(event.block_hashes):
        parent = hash_block_tokens(parent, list(event.token_ids[i * event.block_size : (i + 1) * event.block_size]),
                                   event.extra_keys)
        if parent != block_hash:
            return False
    return True


def test_engine_reports_exactly_the_blocks_its_prefix_cache_holds_and_evicts(tiny_llama):
    llm = make_llm(tiny_llama, num_kv_blocks=24)
    publisher, pool = llm.engine.kv_events, llm.engine.kv_cache_manager.block_pool
    sub, index = RawSubscriber(publisher.endpoint), KVIndex()
    try:
        sub.ready(publisher)
        index.add_worker("w", publisher.endpoint, publisher.replay_endpoint)
        wait_until(lambda: _probe_until_live(publisher, index), what="live subscription")
        llm.generate([{"prompt_token_ids": p} for p in prompts(0, 3)], GREEDY)
        llm.generate([{"prompt_token_ids": p} for p in prompts(0, 2)], GREEDY, lora_request=None)  # prefix hits
        llm.generate({"prompt_token_ids": prompts(1, 1)[0]}, GREEDY)
        for p in prompts(2, 6, length=40, shared=0):  # 6 x 11 blocks through a 24-block pool: evictions
            llm.generate({"prompt_token_ids": p}, GREEDY)
        llm.engine.check_integrity()
        wait_until(lambda: synced(index, "w", publisher), what="index synced")
        sub.receive(until_seq=publisher.num_batches - 1)
        stored = [e for e in sub.events() if isinstance(e, BlockStored)]
        removed = {h for e in sub.events() if isinstance(e, BlockRemoved) for h in e.block_hashes}
        cached = set(pool.cached_block_hash_to_block)
        assert stored and all(e.medium == "pool" and e.block_size == BLOCK_SIZE and chain_ok(e) for e in stored)
        announced = [h for e in stored for h in e.block_hashes]
        assert len(announced) == len(set(announced))  # each block is announced once while it stays cached
        assert set(pool.evicted_block_hashes) == removed and removed  # every eviction, nothing else
        assert set(announced) - removed == cached  # replaying the stream gives the prefix cache exactly
        assert index.worker_blocks("w", "pool") == cached and index.worker_blocks("w") == cached
    finally:
        sub.close()
        index.close()
        llm.close()


def test_ram_tier_moves_are_reported_per_tier(tiny_llama):
    ram_blocks = 12
    llm = make_llm(tiny_llama, num_kv_blocks=24, kv_offload_memory=ram_blocks * BLOCK_BYTES / GIB)
    publisher, ram = llm.engine.kv_events, llm.engine.kv_store.ram
    pool = llm.engine.kv_cache_manager.block_pool
    index = KVIndex()
    try:
        index.add_worker("w", publisher.endpoint, publisher.replay_endpoint)
        wait_until(lambda: _probe_until_live(publisher, index), what="live subscription")
        first = prompts(3, 1, length=30, shared=0)[0]
        llm.generate({"prompt_token_ids": first}, GREEDY)
        first_hashes = request_block_hashes(first, BLOCK_SIZE)
        for p in prompts(4, 3, length=30, shared=0):  # push the first prompt's blocks out of the pool into RAM
            llm.generate({"prompt_token_ids": p}, GREEDY)
        wait_until(lambda: synced(index, "w", publisher), what="index synced")
        assert any(index.tiers(h) == {"w": {"ram"}} for h in first_hashes)
        again = llm.generate({"prompt_token_ids": first}, GREEDY)[0]
        assert again.num_cached_tokens > 0 and ram.stats.hits > 0  # served back from RAM
        for p in prompts(5, 4, length=30, shared=0):  # more than RAM holds: RAM evicts too
            llm.generate({"prompt_token_ids": p}, GREEDY)
        llm.engine.check_integrity()
        wait_until(lambda: synced(index, "w", publisher), what="index synced")
        assert ram.stats.evictions > 0
        assert index.worker_blocks("w", "ram") == set(ram.hashes())
        assert index.worker_blocks("w", "pool") == set(pool.cached_block_hash_to_block)
    finally:
        index.close()
        llm.close()


def test_events_change_nothing_outputs_and_cache_equal_and_off_costs_nothing(tiny_llama):
    batch = [{"prompt_token_ids": p} for p in prompts(6, 4) + prompts(7, 2, length=40, shared=0)]
    with make_llm(tiny_llama, num_kv_blocks=24, kv_events_config=None) as off, \
            make_llm(tiny_llama, num_kv_blocks=24, kv_events_config={**EVENTS, "publisher": "null"}) as null, \
            make_llm(tiny_llama, num_kv_blocks=24) as on:
        assert off.engine.kv_events is None and off.engine.kv_cache_manager.block_pool.kv_events is None
        runs = [llm.generate(batch, GREEDY) for llm in (off, null, on)]
        assert all([o.outputs[0].token_ids for o in run] == [o.outputs[0].token_ids for o in runs[0]] for run in runs)
        assert all([o.num_cached_tokens for o in run] == [o.num_cached_tokens for o in runs[0]] for run in runs)
        caches = [dict(llm.engine.kv_cache_manager.block_pool.cached_block_hash_to_block) for llm in (off, null, on)]
        assert all({h: b.block_id for h, b in c.items()} == {h: b.block_id for h, b in caches[0].items()}
                   for c in caches)
        assert null.engine.kv_events.num_batches > 0


# ---- two real workers ----------------------------------------------------------------------------------
SERVER_BLOCK_SIZE = 16
SERVER_ARGS = ["--dtype", "float32", "--num-kv-blocks", "128", "--block-size", str(SERVER_BLOCK_SIZE),
               "--num-threads", "1", "--kv-events-config", json.dumps(EVENTS)]
EPSILON = 0.25


@pytest.fixture(scope="module", autouse=True)
def starting_workers(tiny_llama, tmp_path_factory):
    """Two workers, started with the module so they load while the in-process tests run."""
    logs = tmp_path_factory.mktemp("logs")
    procs = [ServerProcess(tiny_llama, SERVER_ARGS, logs / f"worker{i}.log") for i in range(2)]
    yield procs
    for proc in procs:
        proc.proc.terminate()  # both at once: each waits for its engine thread
    for proc in procs:
        try:  # one SIGTERM each: stop() would send another to a worker still shutting down
            proc.proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
        code = proc.stop()
        assert code == 0 or not getattr(proc, "served", False), proc.log()[-3000:]


@pytest.fixture(scope="module")
def workers(starting_workers):
    for proc in starting_workers:
        proc.wait_healthy()
        proc.served = True  # from now on it must stop cleanly
    return starting_workers


def worker_view(proc: ServerProcess, worker_id: str, outstanding: int = 0) -> WorkerView:
    endpoint, replay = kv_event_endpoints(proc.get_json("/debug/status"), proc.url)
    return WorkerView(worker_id, proc.url, True, outstanding, 0, True, SERVER_BLOCK_SIZE, endpoint, replay)


def wait_synced(index: KVIndex, procs: dict[str, ServerProcess]) -> None:
    """Until the index has applied every batch each worker has published."""
    def done() -> bool:
        for worker_id, proc in procs.items():
            num_batches = proc.get_json("/debug/status")["kv_events"]["num_batches"]
            if num_batches and index.last_seq(worker_id) != num_batches - 1:
                return False
        return True

    wait_until(done, what="index synced with the workers")


def test_worker_status_names_its_block_size_and_publisher_and_its_events_reach_an_index(workers, tiny_llama):
    status = workers[0].get_json("/debug/status")
    assert status["block_size"] == SERVER_BLOCK_SIZE and status["kv_events"]["enabled"]
    assert status["config"]["kv_events_config"]["enable_kv_cache_events"] is True
    endpoint, replay = kv_event_endpoints(status, workers[0].url)
    assert endpoint.startswith("tcp://127.0.0.1:") and replay.startswith("tcp://127.0.0.1:")
    index = KVIndex()
    try:
        index.add_worker("w0", endpoint, replay)
        prompt = "The quick brown fox jumps over the lazy dog. " * 6
        ids = workers[0].post("/tokenize", {"prompt": prompt}).json()["tokens"]
        body = workers[0].post("/v1/completions", {"model": tiny_llama, "prompt": prompt, "max_tokens": 3,
                                                   "temperature": 0}).json()
        assert body["usage"]["prompt_tokens"] == len(ids)
        wait_synced(index, {"w0": workers[0]})
        assert set(request_block_hashes(ids, SERVER_BLOCK_SIZE)) <= index.worker_blocks("w0", "pool")
    finally:
        index.close()


def test_router_tokenization_equals_the_workers(workers, tiny_llama):
    tokenizer = load_router_tokenizer(tiny_llama)
    for prompt in ["Hello world", "  spaces and <|im_start|> inside", "déjà vu ✓ 12345"]:
        assert tokenizer.encode_prompt(prompt) == workers[0].post("/tokenize", {"prompt": prompt}).json()["tokens"]
    conversations = [
        [{"role": "user", "content": "Name a colour."}],
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi<|im_end|>\n<|im_start|>x"}],
        [{"role": "user", "content": [{"type": "text", "text": "two "}, {"type": "text", "text": "parts"}]},
         {"role": "assistant", "content": "ok"}, {"role": "user", "content": "again"}],
    ]
    for messages in conversations:
        want = workers[0].post("/tokenize", {"messages": messages}).json()["tokens"]
        assert tokenizer.render_chat(messages) == want
    for prompt in ["Hello world", "  spaces and <|im_start|> inside"]:  # rendering chats leaves encoding as it was
        assert tokenizer.encode_prompt(prompt) == workers[0].post("/tokenize", {"prompt": prompt}).json()["tokens"]


def tenant_messages(tenant: int, question: str) -> list[dict]:
    rng = random.Random(tenant)
    words = ["alpha", "river", "copper", "meadow", "signal", "harbor", "violet", "summit", "lantern", "orbit"]
    system = f"You are the assistant of tenant {tenant}. " + " ".join(rng.choice(words) for _ in range(70))
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def test_kv_aware_routes_each_tenants_repeats_to_the_worker_holding_its_blocks(workers, tiny_llama):
    tokenizer = load_router_tokenizer(tiny_llama)
    procs = {"w0": workers[0], "w1": workers[1]}
    policy = KVAwarePolicy(epsilon=EPSILON)
    outstanding = dict.fromkeys(procs, 0)
    lock = threading.Lock()

    def decide(messages: list[dict], max_tokens: int = 4, policy: KVAwarePolicy = policy):
        ids = tokenizer.render_chat(messages)
        request = RouteRequest("r", messages[-1]["content"], tuple(ids), len(ids), max_tokens)
        with lock:
            views = [WorkerView(w, procs[w].url, True, outstanding[w], 0, True, SERVER_BLOCK_SIZE) for w in procs]
            decision = policy.select(request, views)
            cap = load_cap(views, len(ids) + max_tokens, EPSILON)
            assert outstanding[decision.worker_id] <= cap  # the bounded-load cap held at every decision
            outstanding[decision.worker_id] += len(ids) + max_tokens
        return decision, len(ids) + max_tokens

    def send(messages: list[dict], decision, size: int) -> dict:
        try:
            response = procs[decision.worker_id].post("/v1/chat/completions", {
                "model": tiny_llama, "messages": messages, "max_tokens": 4, "temperature": 0})
            assert response.status_code == 200, response.text
            return response.json()
        finally:
            with lock:
                outstanding[decision.worker_id] -= size

    try:
        for worker_id, proc in procs.items():
            policy.on_worker_added(worker_view(proc, worker_id))
        # Round 1: each tenant's first question, all in flight at once; where each lands is its home.
        first = [tenant_messages(t, "What is the weather like today?") for t in range(4)]
        decisions = [decide(m) for m in first]
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda args: send(*args), [(m, d, s) for m, (d, s) in zip(first, decisions)]))
        home = {t: d.worker_id for t, (d, _) in enumerate(decisions)}
        assert set(home.values()) == set(procs)  # four new prefixes spread over both workers
        wait_synced(policy.index, procs)
        # Round 2: every repeat goes home, and the worker's cached tokens are exactly the policy's estimate.
        for tenant in range(4):
            messages = tenant_messages(tenant, f"Tell me a fact about number {tenant + 7}.")
            decision, size = decide(messages)
            assert (decision.worker_id, decision.reason) == (home[tenant], "kv_overlap")
            assert decision.expected_hit_tokens >= 4 * SERVER_BLOCK_SIZE  # the system prompt's blocks
            body = send(messages, decision, size)
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == decision.expected_hit_tokens
        # Round 3: a burst at one tenant, scored by a policy for which cached blocks outweigh any load
        # (weight 10): without the cap all six would go home; the cap moves part of the burst away.
        heavy = KVAwarePolicy(policy.index, overlap_weight=10.0, epsilon=EPSILON)
        burst = [tenant_messages(0, f"Question {i} of a burst?") for i in range(6)]
        decisions = [decide(m, policy=heavy) for m in burst]
        placed = [d.worker_id for d, _ in decisions]
        assert 3 <= placed.count(home[0]) < 6 and any(d.reason == "load_cap" for d, _ in decisions)
        assert all(d.reason == "kv_overlap" for d, _ in decisions if d.worker_id == home[0])
        loads = list(outstanding.values())
        assert max(loads) <= (1 + EPSILON) * sum(loads) / len(loads) + max(s for _, s in decisions)
        with ThreadPoolExecutor(6) as pool:
            bodies = list(pool.map(lambda args: send(*args), [(m, d, s) for m, (d, s) in zip(burst, decisions)]))
        for (decision, _), body in zip(decisions, bodies):
            hit = body["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert hit >= decision.expected_hit_tokens if decision.worker_id == home[0] else hit >= 0
    finally:
        policy.close()


def test_router_process_with_kv_aware_sends_each_repeat_to_the_worker_holding_its_prefix(workers, tiny_llama,
                                                                                          tmp_path):
    from tests.test_router import WORKER_HEADER, RouterProcess

    router = RouterProcess([w.url for w in workers], ["--policy", "kv_aware"], tmp_path / "router.log")
    try:
        router.wait_up()
        router.wait_workers_healthy()
        assert all(w["kv_events_endpoint"] for w in router.workers().values())
        prefixes = {t: [random.Random(100 + t).randrange(100, 40000) for _ in range(80)] for t in range(4)}

        def complete(tenant: int, question: int):
            prompt = prefixes[tenant] + [random.Random(question).randrange(100, 40000) for _ in range(10)]
            response = router.post("/v1/completions", {"model": tiny_llama, "prompt": prompt, "max_tokens": 2,
                                                       "temperature": 0})
            assert response.status_code == 200, response.text
            return response.headers[WORKER_HEADER], response.json()["usage"]

        home = {t: complete(t, question=t)[0] for t in prefixes}
        time.sleep(0.5)  # the workers' events reach the router's index
        for t in prefixes:
            worker, usage = complete(t, question=10 + t)
            assert worker == home[t]
            assert usage["prompt_tokens_details"]["cached_tokens"] == 5 * SERVER_BLOCK_SIZE  # the 80-token prefix

        # Text: the router tokenizes chats with the model the workers report (as they do), so repeats of a
        # tenant's conversation go home too, and a cache_salt (a worker-side extra key) is hashed alike.
        def chat(tenant: int, question: str, salt: str | None = None):
            body = {"model": tiny_llama, "messages": tenant_messages(10 + tenant, question), "max_tokens": 2,
                    "temperature": 0}
            if salt is not None:
                body["cache_salt"] = salt
            response = router.post("/v1/chat/completions", body)
            assert response.status_code == 200, response.text
            return response.headers[WORKER_HEADER], response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        def kv_overlap_decisions() -> float:
            text = httpx.get(f"{router.url}/metrics", timeout=10).text
            line = re.search(r'^tokenmill_router:routing_decisions_total\{policy="kv_aware",reason="kv_overlap"\} (\S+)$',
                             text, re.M)
            return float(line.group(1)) if line else 0.0

        chat_home = {t: chat(t, "First question?", salt="s")[0] for t in range(4)}
        time.sleep(0.5)
        before = kv_overlap_decisions()
        for t in range(4):
            worker, cached = chat(t, f"Second question number {t}?", salt="s")
            assert worker == chat_home[t] and cached >= 4 * SERVER_BLOCK_SIZE
        assert kv_overlap_decisions() == before + 4  # chosen for the blocks the router hashed, not by chance
    finally:
        router.stop()


class RecordingPassThrough:
    """An HTTP hop in front of a worker that records every POST body (JSON) and forwards requests whole
    (a stream's events arrive at once, which the router's SSE reader takes as well)."""

    def __init__(self, target: str) -> None:
        self.bodies: list[dict] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _relay(self, response: httpx.Response) -> None:
                self.send_response(response.status_code)
                self.send_header("content-type", response.headers.get("content-type", "application/json"))
                self.send_header("content-length", str(len(response.content)))
                self.end_headers()
                self.wfile.write(response.content)

            def do_GET(self) -> None:
                self._relay(httpx.get(target + self.path, timeout=30))

            def do_POST(self) -> None:
                content = self.rfile.read(int(self.headers.get("content-length", 0)))
                outer.bodies.append(json.loads(content))
                self._relay(httpx.post(target + self.path, content=content, timeout=60,
                                       headers={"content-type": "application/json"}))

        self.http = LocalHTTPServer(Handler)
        self.url = self.http.url
        self.close = self.http.close


def same_reply(got: dict, want: dict) -> None:
    """Equal completions: text, tokens, offsets and token counts exactly; log-probabilities to float32
    rounding (a repeat hits the prefix cache, whose blocks were computed in another chunking)."""
    assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
    assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]
    for a, b in zip(got["choices"], want["choices"], strict=True):
        la, lb = a.pop("logprobs"), b.pop("logprobs")
        assert a == b
        assert la["tokens"] == lb["tokens"] and la["text_offset"] == lb["text_offset"]
        assert la["token_logprobs"] == pytest.approx(lb["token_logprobs"], abs=1e-4)
        a["logprobs"], b["logprobs"] = la, lb


def test_kv_aware_router_sends_the_prompt_it_tokenized_as_token_ids(workers, tiny_llama, tmp_path):
    """The router tokenized a text prompt to hash its blocks; a tokenmill worker with the same tokenizer gets
    the ids instead of the text (it skips tokenizing), unless the reply quotes the text (echo). Replies are
    those of a direct request either way."""
    from tests.test_router import RouterProcess

    hop = RecordingPassThrough(workers[0].url)
    router = RouterProcess([hop.url], ["--policy", "kv_aware"], tmp_path / "router.log")
    try:
        router.wait_up()
        router.wait_workers_healthy()
        prompt = "The quick brown fox, déjà vu, jumps over 12345 lazy dogs."
        ids = workers[0].post("/tokenize", {"prompt": prompt}).json()["tokens"]
        body = {"model": tiny_llama, "prompt": prompt, "max_tokens": 5, "temperature": 0, "logprobs": 1}
        direct = workers[0].post("/v1/completions", body).json()
        routed = router.post("/v1/completions", body).json()
        assert hop.bodies[-1]["prompt"] == ids
        same_reply(routed, direct)

        listed = router.post("/v1/completions", {**body, "prompt": [prompt]}).json()  # one prompt in a list
        assert hop.bodies[-1]["prompt"] == ids
        same_reply(listed, direct)

        stream = router.post("/v1/completions", {**body, "stream": True})
        assert hop.bodies[-1]["prompt"] == ids and hop.bodies[-1]["return_token_ids"] is True
        text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in stream.text.splitlines()
                       if line.startswith("data: {") and json.loads(line[6:])["choices"])
        assert text == direct["choices"][0]["text"]

        echoed = router.post("/v1/completions", {**body, "echo": True}).json()
        assert hop.bodies[-1]["prompt"] == prompt  # the reply quotes the text: sent as it came
        assert echoed["choices"][0]["text"] == prompt + direct["choices"][0]["text"]

        messages = [{"role": "user", "content": "Name a colour."}]
        router.post("/v1/chat/completions", {"model": tiny_llama, "messages": messages, "max_tokens": 2})
        assert hop.bodies[-1]["messages"] == messages and "prompt" not in hop.bodies[-1]
    finally:
        router.stop()
        hop.close()
