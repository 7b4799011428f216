"""Prefill/decode disaggregation (tokenmill/kv_transfer/connector.py, tokenmill/router/pd.py).

In-process engines first (a producer and a consumer LLM side by side): the decode side's greedy
tokens equal one colocated engine's, it computes one prompt token, the producer's lease is freed;
every failure (another model, a gone producer, an expired lease) falls back to local compute with
its reason counted, and both pools end empty. Then real processes: prefill worker, decode worker and
``tokenmill router --pd-disaggregation``, streamed and not, a producer SIGKILLed between its lease
and the pull, and a multi-round conversation whose short rounds stay on the decode worker.
"""
from __future__ import annotations

import json
import re
import socket
import threading
import time

import httpx2 as httpx
import pytest
import torch

from tests.server_fixtures import ServerProcess
from tests.tiny_models import make_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.security import load_cluster_secret, sign_params

BLOCK_SIZE = 16
KW = dict(dtype="float32", num_threads=1, block_size=BLOCK_SIZE, num_kv_blocks=64)
PROMPT = list(range(100, 160))  # 60 tokens: 3 full blocks and a partial one
GREEDY = SamplingParams(max_tokens=12, temperature=0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("tiny_pd")))


@pytest.fixture(scope="module")
def engines(tiny):
    """(producer, consumer over shm, consumer over tcp, colocated reference)."""
    llms = [LLM(tiny, kv_transfer_config={"kv_role": "kv_producer",
                                          "kv_connector_extra_config": {"lease_ttl_s": 5.0}}, **KW),
            LLM(tiny, kv_transfer_config={"kv_role": "kv_consumer", "kv_connector": "SharedMemoryConnector",
                                          "kv_connector_extra_config": {"transfer_timeout_s": 3.0}}, **KW),
            LLM(tiny, kv_transfer_config={"kv_role": "kv_consumer", "kv_connector": "TCPConnector",
                                          "kv_connector_extra_config": {"transfer_timeout_s": 3.0}}, **KW),
            LLM(tiny, **KW)]
    yield llms
    for llm in llms:
        llm.close()


def run(llm: LLM, request_id: str, prompt: list[int], params: SamplingParams, kv: dict | None):
    llm.engine.add_request(request_id, {"prompt_token_ids": prompt}, params, kv_transfer_params=kv)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for output in llm.engine.step():
            if output.finished and output.request_id == request_id:
                return output
    raise TimeoutError(request_id)


def prefill(producer: LLM, request_id: str, prompt: list[int] = PROMPT) -> dict:
    out = run(producer, request_id, prompt, SamplingParams(max_tokens=1, temperature=0), {"do_remote_decode": True})
    params = out.kv_transfer_params
    assert params["do_remote_prefill"] and params["remote_num_tokens"] == len(prompt)
    return params


def settle(*llms: LLM) -> None:
    """Step until no transfer is pending (leases ended), then check every pool is whole and idle."""
    for llm in llms:
        deadline = time.monotonic() + 10
        while llm.engine.has_unfinished_requests():
            assert time.monotonic() < deadline
            llm.engine.step()
        llm.engine.check_integrity()
        pool = llm.engine.kv_cache_manager.block_pool
        assert pool.num_free_blocks == pool.num_blocks


@pytest.mark.parametrize("consumer_index", [1, 2], ids=["shm", "tcp"])
def test_decode_side_equals_colocated_and_computes_one_prompt_token(engines, consumer_index):
    producer, consumer, reference = engines[0], engines[consumer_index], engines[3]
    want = run(reference, f"ref-{consumer_index}", PROMPT, GREEDY, None).outputs[0].token_ids
    before = dict(consumer.engine.kv_connector.stats.__dict__)
    params = prefill(producer, f"p-{consumer_index}")
    assert producer.engine.kv_connector.producer.num_leases == 1
    out = run(consumer, f"d-{consumer_index}", PROMPT, GREEDY, params)
    assert out.outputs[0].token_ids == want
    stats = consumer.engine.kv_connector.stats
    remote = stats.remote_tokens - before["remote_tokens"]
    assert remote == len(PROMPT) - 1 and out.num_cached_tokens == 0  # computed here: 60 - 0 - 59 = 1 token
    assert stats.remote_prefill_requests == before["remote_prefill_requests"] + 1
    settle(producer, consumer)
    assert producer.engine.kv_connector.producer.stats.send_failures_total == 0


def test_multi_round_moves_only_the_new_blocks(engines):
    producer, consumer, reference = engines[0], engines[2], engines[3]
    first = PROMPT + list(range(300, 310))
    second = first + list(range(400, 440))  # the consumer holds the first round's full blocks
    run(consumer, "mr-1", first, GREEDY, prefill(producer, "mr-p1", first))
    received = consumer.engine.kv_connector.stats.bytes_received
    assert received > 0
    out = run(consumer, "mr-2", second, GREEDY, prefill(producer, "mr-p2", second))
    assert out.outputs[0].token_ids == run(reference, "mr-ref", second, GREEDY, None).outputs[0].token_ids
    assert out.num_cached_tokens == 4 * BLOCK_SIZE  # the first round's 4 full blocks were a local hit
    moved = consumer.engine.kv_connector.stats.bytes_received - received
    kv = consumer.engine.runner.kv_cache  # (layers, 2, num_blocks, block_size, kv_heads, head_dim)
    block_bytes = kv[:, :, 0].numel() * kv.element_size()
    assert moved == (-(-(len(second) - 1) // BLOCK_SIZE) - 4) * block_bytes  # blocks 4.. only
    settle(producer, consumer)


def test_failed_transfers_fall_back_to_local_compute_with_their_reason(engines, tiny, tmp_path):
    producer, consumer, reference = engines[0], engines[2], engines[3]
    want = run(reference, "fb-ref", PROMPT, GREEDY, None).outputs[0].token_ids
    stats = consumer.engine.kv_connector.stats

    def fallback(request_id: str, params: dict, reason: str) -> None:
        count = stats.local_fallbacks.get(reason, 0)
        out = run(consumer, request_id, PROMPT, GREEDY, params)
        assert out.outputs[0].token_ids == want
        assert stats.local_fallbacks.get(reason, 0) == count + 1, stats.local_fallbacks

    other = str(make_tiny_model("llama", tmp_path / "other", seed=77))  # same shapes, other weights
    with LLM(other, kv_transfer_config={"kv_role": "kv_producer"}, **KW) as stranger:
        fallback("fb-model", prefill(stranger, "fb-p-model"), "mismatch")
        settle(stranger)  # the stranger's lease was confirmed (refused) and freed
    params = prefill(producer, "fb-p-twice")
    run(consumer, "fb-ok", PROMPT, GREEDY, params)
    fallback("fb-twice", params, "refused")  # a lease is pulled once
    gone = LLM(tiny, kv_transfer_config={"kv_role": "kv_producer"}, **KW)
    params = prefill(gone, "fb-p-gone")
    gone.close()  # the producer is gone before the pull
    fallback("fb-gone", params, "connect")
    fallback("fb-params", {**params, "remote_num_tokens": 3}, "params")
    settle(producer, consumer)


class CuttingRelay:
    """A TCP relay in front of a real producer: it passes the consumer's bytes through and the producer's first
    ``limit`` bytes (the handshake, the reply, part of the blocks), then ``stall``s (sends nothing more, keeps both
    connections open until the consumer gives up) or ``die``s (closes both), as a hung or killed producer would
    in the middle of a transfer."""

    def __init__(self, producer_port: int, limit: int, mode: str) -> None:
        self.producer_port, self.limit, self.mode = producer_port, limit, mode
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            upstream = socket.create_connection(("127.0.0.1", self.producer_port))
            done = threading.Event()
            threading.Thread(target=self._pump, args=(client, upstream, None, done), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, self.limit, done), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, limit: int | None, done: threading.Event) -> None:
        sent = 0
        try:
            while limit is None or sent < limit:
                data = src.recv(min(65536, limit - sent) if limit is not None else 65536)
                if not data:
                    break
                dst.sendall(data)
                sent += len(data)
            if limit is not None and self.mode == "stall":
                done.wait(30)  # hung: hold the connection until the consumer closes its side
        except OSError:
            pass
        finally:
            done.set()
            for conn in (src, dst):  # shutdown first: it ends the other pump's recv and sends the FIN now
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                conn.close()

    def close(self) -> None:
        self.sock.close()


def test_transfers_stalling_or_dying_midway_under_concurrent_load_fall_back_to_local_compute(engines):
    """Six requests at once on the consumer: two pull through a producer that hangs halfway through the blocks, one
    through one that dies there, one pulls normally and two have no remote prefill. Each completes with the colocated
    engine's greedy tokens; the broken pulls are counted as timeout / protocol fallbacks; every pool ends whole."""
    producer, consumer, reference = engines[0], engines[2], engines[3]  # the consumer pulls over TCP
    prompts = [list(range(5000 + 100 * i, 5060 + 100 * i)) for i in range(6)]  # no block cached by other tests
    want = [run(reference, f"load-ref-{i}", p, GREEDY, None).outputs[0].token_ids for i, p in enumerate(prompts)]
    params = [prefill(producer, f"load-p-{i}", prompts[i]) for i in range(4)]
    block_bytes = consumer.engine.runner.kv_pool.block_bytes
    stall = CuttingRelay(params[0]["remote_port"], 2 * block_bytes, "stall")  # the reply and ~1.5 of 4 blocks
    die = CuttingRelay(params[2]["remote_port"], 2 * block_bytes, "die")
    kv = [{**params[0], "remote_port": stall.port}, {**params[1], "remote_port": stall.port},
          {**params[2], "remote_port": die.port}, params[3], None, None]
    stats = consumer.engine.kv_connector.stats
    before = (dict(stats.local_fallbacks), stats.remote_prefill_requests)
    try:
        for i, prompt in enumerate(prompts):
            consumer.engine.add_request(f"load-{i}", {"prompt_token_ids": prompt}, GREEDY, kv_transfer_params=kv[i])
        done = {}
        deadline = time.monotonic() + 60
        while consumer.engine.has_unfinished_requests():
            assert time.monotonic() < deadline
            for output in consumer.engine.step():
                if output.finished:
                    done[output.request_id] = output
    finally:
        stall.close()
        die.close()
    assert [done[f"load-{i}"].outputs[0].token_ids for i in range(6)] == want
    assert stall.connections == 2 and die.connections == 1
    fallbacks = {k: v - before[0].get(k, 0) for k, v in stats.local_fallbacks.items() if v != before[0].get(k, 0)}
    assert fallbacks == {"timeout": 2, "protocol": 1}, fallbacks
    assert stats.remote_prefill_requests == before[1] + 1
    deadline = time.monotonic() + 15  # the broken pulls' leases end (released, or expired after lease_ttl_s)
    while producer.engine.kv_connector.producer.num_leases:
        assert time.monotonic() < deadline
        producer.engine.step()
        time.sleep(0.05)
    settle(producer, consumer)


def test_an_unclaimed_lease_expires_and_frees_the_producers_blocks(tiny):
    with LLM(tiny, kv_transfer_config={"kv_role": "kv_producer",
                                       "kv_connector_extra_config": {"lease_ttl_s": 0.3}}, **KW) as producer:
        prefill(producer, "orphan")
        pool = producer.engine.kv_cache_manager.block_pool
        assert pool.num_free_blocks < pool.num_blocks and producer.engine.has_unfinished_requests()
        time.sleep(0.4)
        settle(producer)
        assert producer.engine.kv_connector.producer.stats.leases_expired_total == 1


def test_kv_transfer_params_are_checked(engines, tiny):
    with pytest.raises(ValueError, match="kv-transfer-config"):
        engines[3].engine.add_request("x", {"prompt_token_ids": PROMPT}, GREEDY, kv_transfer_params={})
    with pytest.raises(ValueError, match="n = 1"):
        engines[0].engine.add_request("y", {"prompt_token_ids": PROMPT}, SamplingParams(n=2), kv_transfer_params={})
    for bad, field in [({"kv_role": "kv_sender"}, "kv_role"), ({"kv_connector": "Nixl"}, "kv_connector"),
                       ({"kv_port": 70000}, "kv_port"), ({"kv_connector_extra_config": {"x": 1}}, "extra_config"),
                       ({"lease": 1}, "unknown keys")]:
        with pytest.raises(ValueError, match=field):
            LLM(tiny, kv_transfer_config=bad, **KW)


# ---- real processes: prefill worker, decode worker, router -------------------------------------------
ARGS = ["--dtype", "float32", "--num-threads", "1", "--num-kv-blocks", "128", "--block-size", str(BLOCK_SIZE),
        "--disable-log-requests"]
CHAT = [{"role": "system", "content": "You are a careful assistant. " * 4},
        {"role": "user", "content": "Describe a quiet harbour town at dawn in some detail."}]


def metric(server_url: str, name: str, labels: str = "") -> float:
    text = httpx.get(f"{server_url}/metrics", timeout=10).text
    pattern = rf"^{re.escape(name)}\{{[^}}]*{re.escape(labels)}[^}}]*\}} (\S+)$"
    return sum(float(v) for v in re.findall(pattern, text, re.M))


def test_router_pd_disaggregation_end_to_end(tiny, tmp_path):
    from tests.test_router import RouterProcess

    producer_args = [*ARGS, "--kv-transfer-config", json.dumps({"kv_role": "kv_producer"})]
    consumer_args = [*ARGS, "--kv-transfer-config", json.dumps(
        {"kv_role": "kv_consumer", "kv_connector_extra_config": {"transfer_timeout_s": 5.0}})]
    p = ServerProcess(tiny, producer_args, tmp_path / "p.log")
    d = ServerProcess(tiny, consumer_args, tmp_path / "d.log")
    colocated = LLM(tiny, **KW)  # the reference: one engine doing prefill and decode

    def direct(messages: list[dict], max_tokens: int) -> dict:
        text = colocated.chat(messages, SamplingParams(max_tokens=max_tokens, temperature=0))[0].outputs[0].text
        return {"role": "assistant", "content": text}

    router = None
    try:
        for server in (p, d):
            server.wait_healthy()
        router = RouterProcess([], ["--pd-disaggregation", "--prefill", p.url, "--decode", d.url,
                                    "--pd-local-prefill-threshold", "64"], tmp_path / "router.log")
        router.wait_up()
        body = {"model": tiny, "messages": CHAT, "max_tokens": 16, "temperature": 0}
        want = {"choices": [{"message": direct(CHAT, 16)}]}
        got = router.post("/v1/chat/completions", body).json()
        assert got["choices"][0]["message"] == want["choices"][0]["message"]
        prompt_tokens = got["usage"]["prompt_tokens"]
        assert metric(d.url, "tokenmill:kv_transfer_remote_tokens_total") == prompt_tokens - 1  # 1 computed on D
        client = router.client()
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            **{k: v for k, v in body.items()}, stream=True) if c.choices)
        assert streamed == want["choices"][0]["message"]["content"]
        assert metric(d.url, "tokenmill:kv_transfer_remote_prefill_requests_total") == 2
        # n > 1: one transfer fills one sequence, so the decode worker computes the shared prompt for all of them
        two = router.post("/v1/chat/completions", {**body, "n": 2}).json()
        assert [c["message"] for c in two["choices"]] == [want["choices"][0]["message"]] * 2
        assert metric(router.url, "tokenmill_router:pd_requests_total", 'path="local_n"') == 1

        # Multi-round with a session: short rounds stay on the decode worker (local incremental prefill).
        history, rounds = [CHAT[0]], []
        for i in range(6):
            history.append({"role": "user", "content": f"Round {i}: one more detail, briefly."})
            reply = router.post("/v1/chat/completions", {**body, "messages": history, "user": "agent-7",
                                                         "max_tokens": 8}).json()
            assert reply["choices"][0]["message"] == direct(history, 8), i
            history.append(reply["choices"][0]["message"])
            rounds.append(reply["usage"]["prompt_tokens_details"]["cached_tokens"])
        assert metric(router.url, "tokenmill_router:pd_requests_total", 'path="local"') == 5
        assert all(cached > 0 for cached in rounds[1:])  # each later round reused the decode worker's history
        # A long round goes to the prefill worker, and only its new blocks move.
        history.append({"role": "user", "content": "Now a long question: " + "tell me more about it; " * 40})
        remote_before = metric(d.url, "tokenmill:kv_transfer_remote_tokens_total")
        reply = router.post("/v1/chat/completions", {**body, "messages": history, "user": "agent-7",
                                                     "max_tokens": 8}).json()
        assert reply["choices"][0]["message"] == direct(history, 8)
        cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
        remote = metric(d.url, "tokenmill:kv_transfer_remote_tokens_total") - remote_before
        assert cached > 0 and remote == reply["usage"]["prompt_tokens"] - 1 - cached  # history local, rest pulled
        # The producer dies after leasing, before the pull: the decode worker computes the prompt itself.
        secret = load_cluster_secret()  # the test session's per-user default, which the workers loaded too
        lease = p.post("/v1/chat/completions", {**body, "max_tokens": 1, "kv_transfer_params": sign_params(
            secret, {"do_remote_decode": True})}).json()
        params = lease["kv_transfer_params"]
        assert params["do_remote_prefill"] and params["remote_num_tokens"] == prompt_tokens
        p.proc.kill()
        p.proc.wait()
        fallback = d.post("/v1/chat/completions", {**body, "kv_transfer_params": sign_params(secret, params)}).json()
        assert fallback["choices"][0]["message"] == want["choices"][0]["message"]
        assert metric(d.url, "tokenmill:kv_transfer_local_fallbacks_total", 'reason="connect"') == 1
        # Through the router with the prefill worker down, requests still complete (decode-side prefill).
        assert router.post("/v1/chat/completions", body).json()["choices"][0]["message"] == \
            want["choices"][0]["message"]

        assert d.kv_cache()["integrity"] == "ok" and d.wait_idle()
    finally:
        if router is not None:
            router.stop()
        for server in (p, d):
            server.stop()
        colocated.close()


def test_router_releases_the_lease_of_a_request_the_decode_worker_refuses(tiny, tmp_path):
    """The prefill copy leaves out fields the decode worker checks (``logprobs``, ``min_tokens``...), so a
    request the decode worker refuses is still prefilled and leased. The router then releases that lease at
    once (signed ``/kv_transfer/release``) instead of letting it pin the producer's blocks for ``lease_ttl_s``
    (here 10 minutes, far beyond this test); the client gets the decode worker's 400."""
    from tests.test_router import RouterProcess

    producer_args = [*ARGS, "--kv-transfer-config", json.dumps(
        {"kv_role": "kv_producer", "kv_connector_extra_config": {"lease_ttl_s": 600.0}})]
    consumer_args = [*ARGS, "--kv-transfer-config", json.dumps({"kv_role": "kv_consumer"})]
    p = ServerProcess(tiny, producer_args, tmp_path / "p.log")
    d = ServerProcess(tiny, consumer_args, tmp_path / "d.log")
    router = None
    try:
        for server in (p, d):
            server.wait_healthy()
        router = RouterProcess([], ["--pd-disaggregation", "--prefill", p.url, "--decode", d.url],
                               tmp_path / "router.log")
        router.wait_up()
        refused = [("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "logprobs": 50}, "logprobs"),
                   ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, "logprobs": True,
                                             "top_logprobs": 50}, "top_logprobs"),
                   ("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "min_tokens": 8}, "min_tokens")]
        for path, body, param in refused:
            response = router.post(path, {"model": tiny, **body})
            assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
        kv = p.get_json("/debug/status?check_integrity=false")["kv_transfer"]
        assert kv["leases_total"] == len(refused)  # each was prefilled and leased...
        assert kv["leases_released_total"] == len(refused) and kv["leases_expired_total"] == 0  # ...and released
        deadline = time.monotonic() + 30  # the engine thread frees released leases on its next step
        while p.get_json("/debug/status?check_integrity=false")["kv_transfer"]["leases"]:
            assert time.monotonic() < deadline, "released leases still pin the producer's blocks"
            time.sleep(0.05)
        ok = router.post("/v1/completions", {"model": tiny, "prompt": PROMPT, "max_tokens": 4, "temperature": 0})
        assert ok.status_code == 200, ok.text
        assert metric(d.url, "tokenmill:kv_transfer_remote_tokens_total") == len(PROMPT) - 1
        idle = p.wait_idle()
        assert idle["num_free_blocks"] == idle["num_blocks"] and idle["integrity"] == "ok"
    finally:
        if router is not None:
            router.stop()
        for server in (p, d):
            server.stop()


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_a_quantized_kv_cache_transfers_with_its_scales(tiny, kv_cache_dtype):
    """int8/fp8 blocks move as the pool's byte rows (codes, then scales): the decode side's blocks hold the
    producer's bytes exactly, and its greedy tokens are a colocated engine's with the same KV dtype."""
    from tokenmill.kv_cache.block_hash import extend_block_hashes

    kw = {**KW, "kv_cache_dtype": kv_cache_dtype}
    with LLM(tiny, kv_transfer_config={"kv_role": "kv_producer"}, **kw) as producer, \
            LLM(tiny, kv_transfer_config={"kv_role": "kv_consumer", "kv_connector": "TCPConnector",
                                          "kv_connector_extra_config": {"transfer_timeout_s": 3.0}}, **kw) as consumer, \
            LLM(tiny, **kw) as reference:
        want = run(reference, "ref-q", PROMPT, GREEDY, None).outputs[0].token_ids
        params = prefill(producer, "p-q")
        out = run(consumer, "d-q", PROMPT, GREEDY, params)
        assert consumer.engine.kv_connector.stats.remote_tokens == len(PROMPT) - 1
        assert out.outputs[0].token_ids == want
        hashes: list[int] = []
        extend_block_hashes(hashes, PROMPT, BLOCK_SIZE, ())
        rows = []
        for llm in (producer, consumer):
            ids = llm.engine.kv_cache_manager.cached_prefix_block_ids(hashes)
            assert len(ids) == 3
            rows.append(llm.engine.runner.kv_pool.gather(ids))
        assert rows[0].shape[1] > consumer.engine.runner.kv_pool.kv_block_bytes  # scales included
        assert torch.equal(rows[0], rows[1])
        settle(producer, consumer)
