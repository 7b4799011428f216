"""RL rollout endpoints against one real `tokenmill serve --enable-rl-endpoints` process (tiny Llama,
float32, pool + RAM + disk KV tiers, an API key): weights updated in place over HTTP equal
transformers loaded with the new weights; no prefix-cache tier serves a block of the old weights
afterwards (flushed, or keyed when flush_cache is false); every response names its weight version;
mismatched checkpoints are refused with 400 and the old weights keep serving; an update during 16
streams with pause "wait" lets them finish on the old weights; pause "abort" ends streams with
finish reason abort; requests held while paused over the limit get 503 + Retry-After; sleep levels
1 and 2 then wake_up give the same greedy outputs, requests during sleep get 503; without the
flag the routes are 404s naming it."""
from __future__ import annotations

import asyncio
import json
import random
import time

import httpx2 as httpx
import pytest

from tests.rl_checkpoints import Reference, perturbed_copy
from tests.server_fixtures import ServerProcess
from tests.tiny_models import make_tiny_model

API_KEY = "rl-secret"
MAX_PAUSED = 3
BLOCK = 4


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl_server")
    base = make_tiny_model("llama", root / "base")
    paths = {
        "base": base,
        "new": perturbed_copy(base, root / "new", scale=0.05, seed=1),
        "other": perturbed_copy(base, root / "other", scale=0.05, seed=2),
        "missing": perturbed_copy(base, root / "missing", drop=("model.layers.1.mlp.down_proj.weight",)),
        "misshaped": perturbed_copy(base, root / "misshaped", reshape={"model.norm.weight": (65,)}),
    }
    args = ["--dtype", "float32", "--block-size", str(BLOCK), "--num-kv-blocks", "96", "--max-model-len", "128",
            "--max-num-seqs", "32", "--num-threads", "1",
            "--kv-offload-memory", str(48 * 2048 / 1024**3), "--kv-offload-disk-path", str(root / "kv"),
            "--kv-offload-disk-size", "0.01", "--kv-offload-disk-drive-size", "1",
            "--enable-rl-endpoints", "--max-paused-requests", str(MAX_PAUSED)]
    server = ServerProcess(str(base), args, root / "server.log", api_key=API_KEY).wait_healthy()
    yield server, paths, root
    server.stop()


def _post(server: ServerProcess, path: str, body: dict | None = None, **params) -> httpx.Response:
    """POST ``body`` (none: an empty body, still labelled JSON, as every POST must be)."""
    headers = {**server.headers(), "content-type": "application/json"}
    return httpx.post(f"{server.url}{path}", json=body, params=params, headers=headers, timeout=120)


def _update(server: ServerProcess, path, **fields) -> httpx.Response:
    response = _post(server, "/update_weights_from_disk", {"model_path": str(path), **fields})
    return response


def _complete(server: ServerProcess, prompt: list[int], max_tokens: int = 1, **fields) -> dict:
    response = server.post("/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                               "return_token_ids": True, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def _cached(server: ServerProcess, prompt: list[int]) -> int:
    return _complete(server, prompt)["usage"]["prompt_tokens_details"]["cached_tokens"]


def _tier_hits(server: ServerProcess) -> dict[str, float]:
    metrics = server.metrics()
    return {tier: metrics[f"tokenmill:kv_offload_hits_total{{tier={tier}}}"] for tier in ("ram", "disk")}


def _prompts(seed: int, n: int, length: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(n)]


def _place(server: ServerProcess, seed: int) -> dict[str, list[int]]:
    """From empty tiers, leave one 40-token prompt on disk, one in RAM and one in the pool: the disk
    one is pushed through the pool and RAM by 120-token fillers, the RAM one through the pool only."""
    disk, ram, pool = _prompts(seed, 3, 40)
    fillers = iter(_prompts(seed + 1000, 16, 120))
    assert _post(server, "/reset_prefix_cache").status_code == 200
    for prompt in [disk, *[next(fillers) for _ in range(6)], ram, *[next(fillers) for _ in range(4)], pool]:
        _complete(server, prompt)
    return {"pool": pool, "ram": ram, "disk": disk}


def test_rl_routes_need_the_api_key(env):
    server, _, _ = env
    assert httpx.get(f"{server.url}/weight_info", timeout=30).status_code == 401
    assert httpx.post(f"{server.url}/pause_generation", timeout=30).status_code == 401
    assert server.get_json("/weight_info")["weight_version"]


def test_update_serves_new_weights_and_no_tier_serves_old_blocks(env):
    server, paths, root = env
    assert _update(server, paths["base"], weight_version="base").status_code == 200
    probe = _prompts(7, 1, 24)[0]

    def logprobs_now() -> list[float]:
        body = _complete(server, probe, echo=True, logprobs=1)
        return body["choices"][0]["logprobs"]["token_logprobs"][1:len(probe)]

    assert logprobs_now() == pytest.approx(Reference(paths["base"]).prompt_logprobs(probe), abs=2e-4)

    # Control: the placement puts a prompt's blocks in each tier, and each tier serves them back.
    placed = _place(server, seed=1)
    before = _tier_hits(server)
    assert _cached(server, placed["pool"]) == 36
    assert _tier_hits(server) == before
    assert _cached(server, placed["ram"]) == 36
    after_ram = _tier_hits(server)
    assert after_ram["ram"] - before["ram"] == 9 and after_ram["disk"] == before["disk"]
    assert _cached(server, placed["disk"]) == 36
    assert _tier_hits(server)["disk"] - after_ram["disk"] >= 1

    # The same placement, then an update (flush_cache defaults to true): nothing is served from any tier.
    placed = _place(server, seed=2)
    old_fingerprint = server.get_json("/weight_info")["fingerprint"]
    assert _complete(server, placed["pool"], max_tokens=1)["metadata"]["weight_version"] == "base"
    response = _update(server, paths["new"], weight_version="step-1")
    assert response.status_code == 200, response.text
    assert response.json()["weight_version"] == "step-1"
    hits = _tier_hits(server)
    for tier in ("pool", "ram", "disk"):
        body = _complete(server, placed[tier])
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, tier
        assert body["metadata"]["weight_version"] == "step-1"
    assert _tier_hits(server) == hits
    assert logprobs_now() == pytest.approx(Reference(paths["new"]).prompt_logprobs(probe), abs=2e-4)
    info = server.get_json("/weight_info")
    assert info["fingerprint"] != old_fingerprint and info["weight_version"] == "step-1"
    # The disk tier moved to the new fingerprint's directory; the old records stay under the old one.
    old_dir = root / "kv" / old_fingerprint[:16]
    assert any(f.stat().st_size for f in old_dir.glob("segment-*.kvseg"))
    assert (root / "kv" / info["fingerprint"][:16]).is_dir()

    # flush_cache false: the old blocks stay in the tiers but are never hit (block hashes carry the weights).
    placed = _place(server, seed=3)
    flushes = server.metrics()["tokenmill:prefix_cache_flushes_total{reason=update}"]
    response = _update(server, paths["other"], flush_cache=False, weight_version="step-2")
    assert response.status_code == 200, response.text
    assert server.metrics()["tokenmill:prefix_cache_flushes_total{reason=update}"] == flushes
    hits = _tier_hits(server)
    for tier in ("pool", "ram", "disk"):
        assert _cached(server, placed[tier]) == 0, tier
    assert _tier_hits(server) == hits
    assert _cached(server, placed["pool"]) == 36  # blocks made with the new weights are cached as usual
    assert logprobs_now() == pytest.approx(Reference(paths["other"]).prompt_logprobs(probe), abs=2e-4)
    metrics = server.metrics()
    assert metrics["tokenmill:weight_updates_total{result=success,source=disk}"] >= 3


def test_mismatched_checkpoints_are_refused_and_old_weights_keep_serving(env):
    server, paths, root = env
    assert _update(server, paths["base"], weight_version="base").status_code == 200
    prompt = _prompts(11, 1, 12)[0]
    expected = _complete(server, prompt, max_tokens=8)["choices"][0]["token_ids"]
    errors = server.metrics().get("tokenmill:weight_updates_total{result=error,source=disk}", 0)
    for name, needle in (("missing", "model.layers.1.mlp.down_proj.weight"), ("misshaped", "model.norm.weight")):
        response = _update(server, paths[name], weight_version="bad")
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "model_path" and needle in error["message"], error
    response = _update(server, root / "does-not-exist")
    assert response.status_code == 400 and "does not exist" in response.json()["error"]["message"]
    assert _post(server, "/update_weights_from_disk", {"model_path": 3}).status_code == 400
    assert server.metrics()["tokenmill:weight_updates_total{result=error,source=disk}"] == errors + 3
    body = _complete(server, prompt, max_tokens=8)
    assert body["choices"][0]["token_ids"] == expected
    assert body["metadata"]["weight_version"] == "base"
    assert server.get_json("/weight_info")["weight_version"] == "base"
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}
    assert server.post("/v1/chat/completions", chat).json()["metadata"] == {"weight_version": "base"}
    streamed = server.post("/v1/chat/completions", {**chat, "stream": True})
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert chunks and all(c["metadata"] == {"weight_version": "base"} for c in chunks)


async def _stream(server: ServerProcess, prompt: list[int], max_tokens: int, started: list) -> list[dict]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "return_token_ids": True, "stream_options": {"include_usage": True}}
    chunks = []
    async with httpx.AsyncClient(timeout=120) as client:
        async with client.stream("POST", f"{server.url}/v1/completions", json=body, headers=server.headers()) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[len("data: "):]))
                    if len(chunks) == 1:
                        started.append(time.monotonic())
    return chunks


def _stream_result(chunks: list[dict]) -> tuple[list[int], str | None, set]:
    token_ids = [t for c in chunks for choice in c["choices"] for t in choice.get("token_ids", [])]
    reasons = [choice["finish_reason"] for c in chunks for choice in c["choices"] if choice["finish_reason"]]
    return token_ids, reasons[-1] if reasons else None, {c["metadata"]["weight_version"] for c in chunks}


def test_update_during_16_streams_waits_for_them_and_labels_every_response(env):
    server, paths, _ = env
    assert _update(server, paths["base"], weight_version="old").status_code == 200
    prompts = _prompts(21, 4, 6)
    old_ref, new_ref = Reference(paths["base"]), Reference(paths["new"])
    max_tokens = 16

    async def scenario():
        started: list[float] = []
        streams = [asyncio.ensure_future(_stream(server, prompts[i % 4], max_tokens, started)) for i in range(16)]
        while len(started) < 16:
            await asyncio.sleep(0.005)
        pause = await asyncio.to_thread(_post, server, "/pause_generation", {"mode": "wait"})
        assert pause.status_code == 200 and pause.json()["num_aborted_requests"] == 0
        results = await asyncio.gather(*streams)  # all finished: pause "wait" returns once the engine is idle
        held = [asyncio.ensure_future(asyncio.to_thread(_complete, server, prompts[i], 8)) for i in range(MAX_PAUSED)]
        while server.get_json("/weight_info")["num_queued_requests"] < MAX_PAUSED:
            await asyncio.sleep(0.01)
        refused = await asyncio.to_thread(server.post, "/v1/completions", {"prompt": prompts[0], "max_tokens": 1})
        assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
        update = await asyncio.to_thread(_update, server, paths["new"], abort_all_requests=False,
                                         weight_version="new")
        assert update.status_code == 200, update.text
        assert not any(h.done() for h in held)  # still paused: the update does not resume generation
        assert _post(server, "/resume_generation").status_code == 200
        return results, await asyncio.gather(*held)

    results, held = asyncio.run(scenario())
    old_tokens = [old_ref.greedy(p, max_tokens) for p in prompts]
    for i, chunks in enumerate(results):
        token_ids, reason, versions = _stream_result(chunks)
        assert reason == "length" and versions == {"old"}
        assert token_ids == old_tokens[i % 4], i
    for i, body in enumerate(held):
        assert body["metadata"]["weight_version"] == "new"
        assert body["choices"][0]["token_ids"] == new_ref.greedy(prompts[i], 8)
    assert server.metrics()["tokenmill:generation_pauses_total{mode=wait}"] >= 1


def test_pause_abort_ends_streams_with_finish_reason_abort(env):
    server, _, _ = env
    prompt = _prompts(31, 1, 6)[0]

    async def scenario():
        started: list[float] = []
        streams = [asyncio.ensure_future(_stream(server, prompt, 100, started)) for _ in range(4)]
        while len(started) < 4:
            await asyncio.sleep(0.005)
        pause = await asyncio.to_thread(_post, server, "/pause_generation", {"mode": "abort"})
        results = await asyncio.gather(*streams)
        assert _post(server, "/resume_generation").status_code == 200
        return pause, results

    pause, results = asyncio.run(scenario())
    assert pause.status_code == 200
    aborted = [_stream_result(chunks) for chunks in results]
    assert sum(reason == "abort" for _, reason, _ in aborted) == pause.json()["num_aborted_requests"] >= 1
    assert all(reason in ("abort", "length") for _, reason, _ in aborted)
    assert _complete(server, prompt)["choices"][0]["finish_reason"] == "length"  # resumed


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_then_wake_up_gives_the_same_greedy_outputs(env, level):
    server, paths, _ = env
    assert _update(server, paths["new"], weight_version="awake").status_code == 200
    prompts = _prompts(41, 2, 10)
    before = [_complete(server, p, max_tokens=8)["choices"][0]["token_ids"] for p in prompts]
    assert server.get_json("/is_sleeping") == {"is_sleeping": False}
    assert _post(server, "/sleep", level=level).status_code == 200
    assert server.get_json("/is_sleeping") == {"is_sleeping": True}
    refused = server.post("/v1/completions", {"prompt": prompts[0], "max_tokens": 4})
    assert refused.status_code == 503 and "sleeping" in refused.json()["error"]["message"]
    assert "retry-after" in refused.headers
    assert _post(server, "/wake_up").status_code == 200
    assert server.get_json("/is_sleeping") == {"is_sleeping": False}
    after = [_complete(server, p, max_tokens=8)["choices"][0]["token_ids"] for p in prompts]
    assert after == before
    assert server.get_json("/weight_info")["weight_version"] == "awake"


def test_without_the_flag_the_routes_are_404s_naming_it():
    """In-process app (no engine started): the flag check answers before anything else."""
    from tokenmill.server.api_server import build_app
    from tokenmill.server.state import ServerConfig

    app = build_app(ServerConfig(served_model_name="m"))

    async def calls():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1",
                                     headers={"content-type": "application/json"}) as client:
            return [await client.post("/update_weights_from_disk", json={"model_path": "/x"}),
                    await client.post("/pause_generation"), await client.get("/weight_info"),
                    await client.post("/sleep", params={"level": 1})]

    for response in asyncio.run(calls()):
        assert response.status_code == 404
        assert "--enable-rl-endpoints" in response.json()["error"]["message"]


def test_update_from_tensor_takes_base64_safetensors_and_refuses_bad_ones(env):
    import base64

    from safetensors.torch import load_file, save

    server, paths, _ = env
    assert _update(server, paths["base"], weight_version="base").status_code == 200
    prompt = _prompts(51, 1, 12)[0]
    expected = _complete(server, prompt, max_tokens=8)["choices"][0]["token_ids"]
    new_norm = load_file(paths["new"] / "model.safetensors")["model.norm.weight"]

    def blob(tensors: dict) -> str:
        return base64.b64encode(save(tensors)).decode()

    for body, needle in (({"serialized_named_tensors": ["not base64!"]}, "not base64 safetensors"),
                         ({"serialized_named_tensors": [blob({"model.norm.weight": new_norm[:10]})]}, "shape")):
        response = _post(server, "/update_weights_from_tensor", body)
        assert response.status_code == 400 and needle in response.json()["error"]["message"], response.text
        assert response.json()["error"]["param"] == "serialized_named_tensors"
    base_norm = load_file(paths["base"] / "model.safetensors")["model.norm.weight"]
    response = _post(server, "/update_weights_from_tensor",
                     {"serialized_named_tensors": [blob({"model.norm.weight": base_norm})], "weight_version": "t1"})
    assert response.status_code == 200, response.text
    body = _complete(server, prompt, max_tokens=8)
    assert body["choices"][0]["token_ids"] == expected and body["metadata"]["weight_version"] == "t1"
    assert server.get_json("/weight_info")["model_path"] is None
