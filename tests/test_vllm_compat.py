"""What a worker shows the machinery built for vLLM: KV events in vLLM's own ``KVEventBatch`` encoding
(``"format": "vllm"``), read here with msgspec structs written from vLLM's published definitions
(vllm/distributed/kv_events.py) and never with tokenmill's decoder; tokenmill's ``kv_aware`` policy reading
a vLLM-format worker beside a tokenmill-format one; and ``/metrics`` under vLLM's names
(``--metrics-compat vllm``), parsed with prometheus_client. Two real ``tokenmill serve`` workers on a tiny
random Llama, one with a LoRA adapter."""
from __future__ import annotations

import json
import random
import subprocess
import time
from typing import Any

import httpx2 as httpx
import msgpack
import msgspec
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from tests.server_fixtures import ServerProcess
from tests.tiny_models import make_tiny_model
from tokenmill.kv_events import AllBlocksCleared as TMCleared
from tokenmill.kv_events import BlockRemoved as TMRemoved
from tokenmill.kv_events import BlockStored as TMStored
from tokenmill.kv_events import decode_batch, encode_vllm_batch
from tokenmill.kv_events.events import key_tag
from tokenmill.router.kv_aware import KVAwarePolicy, request_block_hashes
from tokenmill.router.kv_index import kv_event_endpoints
from tokenmill.router.policy import RouteRequest, WorkerView
from tokenmill.security import load_cluster_secret

BLOCK_SIZE = 16
NUM_BLOCKS = 32
TOPIC = "kv-events"
ADAPTER = "tenant-adapter-q7"  # must never appear on the wire
EVENTS = {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*"}
COMMON = ["--dtype", "float32", "--num-kv-blocks", str(NUM_BLOCKS), "--block-size", str(BLOCK_SIZE),
          "--num-threads", "1"]


# ---- vLLM's structures, written from vllm/distributed/kv_events.py (the array-like layout) --------------
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Tagged union member: encoded as [class name, fields...]."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# vLLM after its switch to map-shaped events: the same fields, each event a map with its tag under "type".
class MapEvent(msgspec.Struct, omit_defaults=True, tag=True):
    pass


class MapBlockStored(MapEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class MapBlockRemoved(MapEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class MapAllBlocksCleared(MapEvent, tag="AllBlocksCleared"):
    pass


DECODER = msgspec.msgpack.Decoder(KVEventBatch)


# ---- pure wire checks -----------------------------------------------------------------------------------
def test_lower_tier_events_and_tier_clears_take_vllms_shapes():
    payload = encode_vllm_batch(12.5, [TMStored((2**64 - 1, 5), None, None, 4, "ram"), TMRemoved((7,), "disk"),
                                       TMCleared("disk")])
    batch = DECODER.decode(payload)
    assert (batch.ts, batch.data_parallel_rank) == (12.5, 0)
    assert batch.events == [BlockStored([2**64 - 1, 5], None, [], 4, None, "CPU", None),
                            BlockRemoved([7], "DISK"), AllBlocksCleared()]
    assert msgpack.unpackb(payload)[1][2] == ["AllBlocksCleared"]  # vLLM's clear names no tier


def test_tokenmill_decoder_reads_vllms_array_and_map_shaped_events():
    encoder = msgspec.msgpack.Encoder()
    for batch in (KVEventBatch(3.0, [BlockStored([11, 12], 10, list(range(8)), 4, 2, "GPU", "x"),
                                     BlockRemoved([11], "CPU"), AllBlocksCleared()], 1),
                  EventBatch(3.0, [MapBlockStored([11, 12], 10, list(range(8)), 4, 2, "GPU", "x"),
                                   MapBlockRemoved([11], "CPU"), MapAllBlocksCleared()], 1)):
        got = decode_batch(encoder.encode(batch))
        assert (got.ts, got.instance, got.data_parallel_rank) == (3.0, None, 1)
        assert got.events == [TMStored((11, 12), 10, tuple(range(8)), 4, "pool", 2, "x"), TMRemoved((11,), "ram"),
                              TMCleared(None)]


# ---- two real workers -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    """"vllm": vLLM-format events, --metrics-compat vllm, a LoRA adapter; "tm": the default format and metrics."""
    root = tmp_path_factory.mktemp("vllm_compat")
    base = str(make_tiny_model("llama", root / "base"))
    vllm_events = {**EVENTS, "format": "vllm", "topic": TOPIC}
    procs = {
        "vllm": ServerProcess(base, [*COMMON, "--kv-events-config", json.dumps(vllm_events), "--metrics-compat", "vllm",
                                     "--enable-lora", "--max-lora-rank", "8", "--allow-runtime-lora-updating",
                                     "--enable-rl-endpoints"], root / "vllm.log"),
        "tm": ServerProcess(base, [*COMMON, "--kv-events-config", json.dumps(EVENTS)], root / "tm.log"),
    }
    try:
        import torch  # the adapter is written while the workers load
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        torch.manual_seed(7)
        peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                    LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
        peft_model.save_pretrained(root / "adapter")
        for proc in procs.values():
            proc.wait_healthy()
            proc.model = base
        loaded = procs["vllm"].post("/v1/load_lora_adapter", {"lora_name": ADAPTER, "lora_path": str(root / "adapter")})
        assert loaded.status_code == 200, loaded.text
        yield procs
    finally:
        for proc in procs.values():
            proc.proc.terminate()  # both at once
        for proc in procs.values():
            try:  # one SIGTERM each: stop() would send another to a worker still shutting down
                proc.proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
            proc.stop()


def prompt(seed: int, length: int = 90, head: list[int] | None = None) -> list[int]:
    rng = random.Random(seed)
    ids = list(head or [])
    return ids + [rng.randrange(100, 40000) for _ in range(length - len(ids))]


def complete(proc: ServerProcess, ids: list[int], max_tokens: int = 2, model: str | None = None) -> dict:
    response = proc.post("/v1/completions", {"model": model or proc.model, "prompt": ids, "max_tokens": max_tokens,
                                             "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    return response.json()


def replay_from(endpoint: str, start: int, timeout: float = 5.0) -> list[tuple[int, bytes]]:
    """Ask the replay socket as vLLM's consumers do: a DEALER sending [empty delimiter, seq]; each answer is
    [empty delimiter, seq, payload], the last one seq -1 with an empty payload."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.connect(endpoint)
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        got = []
        while True:
            assert sock.poll(int(timeout * 1000)), "the replay socket did not answer"
            empty, seq, payload = sock.recv_multipart()
            assert empty == b""
            if seq == b"\xff" * 8:
                assert payload == b""
                return got
            got.append((int.from_bytes(seq, "big"), payload))
    finally:
        sock.close(linger=0)
        ctx.term()


def wait_batches(proc: ServerProcess, at_least: int, timeout: float = 10.0) -> int:
    """The worker's published batch count once it is at least ``at_least`` and stopped growing."""
    deadline = time.monotonic() + timeout
    last = -1
    while time.monotonic() < deadline:
        status = proc.get_json("/debug/status")["kv_events"]
        if status["next_seq"] >= at_least and status["next_seq"] == last:
            return last
        last = status["next_seq"]
        time.sleep(0.1)
    raise TimeoutError(f"the worker published {last} batches, fewer than {at_least} or still growing")


def test_vllm_format_events_of_a_real_server_decode_with_vllms_definitions(workers):
    worker = workers["vllm"]
    status = worker.get_json("/debug/status")
    assert status["kv_events"]["format"] == "vllm" and status["kv_events"]["topic"] == TOPIC
    endpoint, replay_endpoint = kv_event_endpoints(status, worker.url)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
    sub.connect(endpoint)
    time.sleep(0.5)  # PUB/SUB joins asynchronously; anything missed comes from the replay below
    t0 = time.time()
    a = prompt(1)
    a_branch = prompt(2, head=a[:3 * BLOCK_SIZE])  # shares A's first three blocks
    b = prompt(3)
    complete(worker, a)
    complete(worker, a_branch)
    complete(worker, b, model=ADAPTER)
    for seed in range(10, 17):  # 7 more prompts of 6 blocks each overflow the 32-block pool: evictions
        complete(worker, prompt(seed))
    assert worker.post("/reset_prefix_cache", {}).status_code == 200
    num_batches = wait_batches(worker, 1)
    t1 = time.time()

    live: dict[int, bytes] = {}
    while sub.poll(200):
        topic, seq, payload = sub.recv_multipart()
        assert topic == TOPIC.encode() and len(seq) == 8
        live[int.from_bytes(seq, "big")] = payload
    sub.close(linger=0)
    ctx.term()
    replayed = replay_from(replay_endpoint, 0)
    assert [seq for seq, _ in replayed] == list(range(num_batches))  # 0, 1, 2, ... and nothing lost
    assert live and all(live[seq] == payload for seq, payload in replayed if seq in live)  # the same bytes

    stored: dict[int, tuple[int | None, list[int]]] = {}  # block hash -> (parent hash, its tokens)
    lora_events, removed, cleared = [], [], []
    for _, payload in replayed:
        raw = msgpack.unpackb(payload)
        assert isinstance(raw, list) and len(raw) == 3  # [ts, events, data_parallel_rank]
        batch = DECODER.decode(payload)
        assert t0 - 5 <= batch.ts <= t1 and batch.data_parallel_rank == 0
        assert ADAPTER.encode() not in payload
        for raw_event, event in zip(raw[1], batch.events):
            assert raw_event[0] == type(event).__name__
            if isinstance(event, BlockStored):
                assert len(raw_event) == 8  # tag + the 7 fields up to lora_name; later defaults left out
                assert (event.block_size, event.medium, event.extra_keys, event.group_idx) == (BLOCK_SIZE, "GPU",
                                                                                             None, None)
                assert len(event.token_ids) == len(event.block_hashes) * BLOCK_SIZE
                for i, h in enumerate(event.block_hashes):
                    parent = event.parent_block_hash if i == 0 else event.block_hashes[i - 1]
                    stored[h] = (parent, event.token_ids[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE])
                if event.lora_id is None:
                    assert event.lora_name is None
                else:
                    lora_events.append(event)
            elif isinstance(event, BlockRemoved):
                assert len(raw_event) == 3 and event.medium == "GPU"
                removed.extend(event.block_hashes)
            else:
                assert raw_event == ["AllBlocksCleared"]
                cleared.append(event)

    # Every block of every prompt, with the hash the router computes, its parent and its tokens.
    for ids in (a, a_branch):
        hashes = request_block_hashes(ids, BLOCK_SIZE)
        assert len(hashes) == 5
        for k, h in enumerate(hashes):
            assert stored[h] == (hashes[k - 1] if k else None, ids[k * BLOCK_SIZE:(k + 1) * BLOCK_SIZE])
    assert request_block_hashes(a_branch, BLOCK_SIZE)[:3] == request_block_hashes(a, BLOCK_SIZE)[:3]
    # The adapter's blocks: vLLM's integer lora_id, and for lora_name the keyed tag, never the name.
    assert [t for e in lora_events for t in e.token_ids] == b[:5 * BLOCK_SIZE]
    assert {(type(e.lora_id), e.lora_name) for e in lora_events} == {(int, key_tag(load_cluster_secret(), ADAPTER))}
    assert removed and set(removed) <= set(stored)
    assert cleared and isinstance(batch.events[-1], AllBlocksCleared)  # the reset is the last batch's last event


def worker_view(proc: ServerProcess, worker_id: str) -> WorkerView:
    endpoint, replay = kv_event_endpoints(proc.get_json("/debug/status"), proc.url)
    return WorkerView(worker_id, proc.url, True, 0, 0, True, BLOCK_SIZE, endpoint, replay)


def test_kv_aware_reads_vllm_format_workers_beside_tokenmill_format_ones(workers):
    policy = KVAwarePolicy(epsilon=0.25)
    try:
        for worker_id, proc in workers.items():
            policy.on_worker_added(worker_view(proc, worker_id))
        heads = {worker_id: prompt(100 + i, length=5 * BLOCK_SIZE) for i, worker_id in enumerate(workers)}
        for worker_id, proc in workers.items():  # straight to the worker: only its events can tell the policy
            complete(proc, prompt(200, head=heads[worker_id]))

        def synced() -> bool:
            return all(policy.index.last_seq(w) == p.get_json("/debug/status")["kv_events"]["next_seq"] - 1
                       for w, p in workers.items())

        deadline = time.monotonic() + 10
        while not synced():
            assert time.monotonic() < deadline, "the index did not catch up with the workers' events"
            time.sleep(0.05)
        views = [WorkerView(w, p.url, True, 0, 0, True, BLOCK_SIZE) for w, p in workers.items()]
        for worker_id, proc in workers.items():
            ids = prompt(300, head=heads[worker_id])  # shares the 5-block head, nothing else
            decision = policy.select(RouteRequest("r", "", tuple(ids), len(ids), 2), views)
            assert (decision.worker_id, decision.reason, decision.expected_hit_tokens) == (
                worker_id, "kv_overlap", 5 * BLOCK_SIZE)
            assert complete(proc, ids)["usage"]["prompt_tokens_details"]["cached_tokens"] == 5 * BLOCK_SIZE
    finally:
        policy.close()


def scrape(proc: ServerProcess) -> dict:
    response = httpx.get(f"{proc.url}/metrics", timeout=10)
    assert response.status_code == 200
    return {family.name: family for family in text_string_to_metric_families(response.text)}


def value(families: dict, name: str, sample: str | None = None, **labels: str) -> float:
    found = [s.value for s in families[name].samples
             if s.name == (sample or name) and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, (name, sample, labels, found)
    return found[0]


VLLM_TYPES = {
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge", "vllm:kv_cache_usage_perc": "gauge",
    "vllm:gpu_cache_usage_perc": "gauge", "vllm:cache_config_info": "gauge", "vllm:lora_requests_info": "gauge",
    "vllm:time_to_first_token_seconds": "histogram", "vllm:inter_token_latency_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram", "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram", "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter", "vllm:request_success": "counter", "vllm:num_preemptions": "counter",
    "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter",
}


def test_metrics_compat_vllm_exports_vllms_series_from_the_same_measurements(workers):
    worker = workers["vllm"]
    assert not [n for n in scrape(workers["tm"]) if n.startswith("vllm:")]  # off by default
    before = scrape(worker)
    assert {n: before[n].type for n in VLLM_TYPES} == VLLM_TYPES
    model = {"model_name": worker.model, "engine": "0"}
    for name in VLLM_TYPES:
        for sample in before[name].samples:
            if name == "vllm:lora_requests_info":
                assert set(sample.labels) == {"max_lora", "waiting_lora_adapters", "running_lora_adapters"}
            elif name == "vllm:cache_config_info":
                assert sample.labels["block_size"] == str(BLOCK_SIZE) and sample.labels["engine"] == "0"
                assert sample.labels["num_gpu_blocks"] == str(NUM_BLOCKS) and sample.value == 1
            else:
                assert {k: sample.labels[k] for k in model} == model, (name, sample)

    ids = prompt(500, length=40)
    max_tokens = 200
    body = {"model": ADAPTER, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{worker.url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        during = scrape(worker)  # the request is generating
        for _ in lines:
            pass
    assert value(during, "vllm:num_requests_running", **model) == 1
    assert value(during, "vllm:num_requests_waiting", **model) == 0
    usage = value(during, "vllm:kv_cache_usage_perc", **model)
    assert 0 < usage <= 1 and usage == value(during, "vllm:gpu_cache_usage_perc", **model)
    lora = during["vllm:lora_requests_info"].samples
    assert len(lora) == 1 and lora[0].labels == {"max_lora": "1", "waiting_lora_adapters": "",
                                                 "running_lora_adapters": ADAPTER}
    assert abs(lora[0].value - time.time()) < 60  # vLLM's value: a timestamp

    worker.wait_idle()
    after = scrape(worker)
    assert value(after, "vllm:num_requests_running", **model) == 0
    delta = {}
    for name, sample in (("vllm:prompt_tokens", "vllm:prompt_tokens_total"),
                         ("vllm:generation_tokens", "vllm:generation_tokens_total"),
                         ("vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_count"),
                         ("vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_count"),
                         ("vllm:request_queue_time_seconds", "vllm:request_queue_time_seconds_count"),
                         ("vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_count"),
                         ("vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total")):
        delta[name] = value(after, name, sample, **model) - value(before, name, sample, **model)
    assert delta["vllm:prompt_tokens"] == len(ids) and delta["vllm:generation_tokens"] == max_tokens
    assert delta["vllm:time_to_first_token_seconds"] == delta["vllm:e2e_request_latency_seconds"] == 1
    assert delta["vllm:request_queue_time_seconds"] == 1
    assert 0 < delta["vllm:inter_token_latency_seconds"] < max_tokens and delta["vllm:prefix_cache_queries"] > 0
    success = "vllm:request_success_total"
    assert value(after, "vllm:request_success", success, finished_reason="length", **model) == value(
        before, "vllm:request_success", success, finished_reason="length", **model) + 1
    # One measurement each: a vLLM series is its tokenmill twin, to the last bit.
    for name, suffix in (("time_to_first_token_seconds", "_sum"), ("inter_token_latency_seconds", "_sum"),
                         ("e2e_request_latency_seconds", "_sum"), ("prompt_tokens", "_total"),
                         ("generation_tokens", "_total"), ("prefix_cache_hits", "_total")):
        own = value(after, f"tokenmill:{name}", f"tokenmill:{name}{suffix}", model_name=worker.model)
        assert value(after, f"vllm:{name}", f"vllm:{name}{suffix}", **model) == own, name
    assert value(after, "vllm:time_per_output_token_seconds", "vllm:time_per_output_token_seconds_sum", **model) == \
        value(after, "vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_sum", **model)
