"""Multi-LoRA through the HTTP server (real `tokenmill serve` processes, the `openai` client): adapters
from --lora-modules (both spellings) and loaded at run time are listed with their parent, reached with
``model``, equal to the offline engine with the same adapter, and unloaded only after their requests in
flight finish; every bad load/unload is a 4xx with an OpenAI error body while a normal request
succeeds alongside; metrics and the request log name the adapters."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx2 as httpx
import openai
import pytest

from tests.server_fixtures import REPO, ServerProcess
from tests.test_lora import random_prompts, save_adapter
from tests.tiny_models import make_tiny_model
from tokenmill import LLM, LoRARequest, SamplingParams

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny Llama, three adapters for it (ranks 4, 8, 2), one of rank 32 and one made for another base model."""
    root = tmp_path_factory.mktemp("server_lora")
    base = str(make_tiny_model("llama", root / "base"))
    other = str(make_tiny_model("qwen3", root / "other"))
    targets = ["q_proj", "v_proj", "o_proj", "down_proj"]
    adapters = {
        "a": save_adapter(base, root / "a", seed=1, r=4, lora_alpha=8, target_modules=targets),
        "b": save_adapter(base, root / "b", seed=2, r=8, lora_alpha=8, target_modules=["k_proj", "up_proj"]),
        "c": save_adapter(base, root / "c", seed=3, r=2, lora_alpha=4, target_modules=targets),
        "big": save_adapter(base, root / "big", seed=4, r=32, lora_alpha=8, target_modules=targets),
        "other": save_adapter(other, root / "other_adapter", seed=5, r=4, lora_alpha=8, target_modules=targets),
    }
    not_adapter = root / "not_adapter"
    not_adapter.mkdir()
    (not_adapter / "notes.txt").write_text("no adapter here")
    return base, adapters, str(not_adapter), root


ENGINE_FLAGS = ["--dtype", "float32", "--num-threads", "1", "--num-kv-blocks", "256", "--max-num-seqs", "8"]


@pytest.fixture(scope="module")
def server(files):
    base, adapters, _, root = files
    b_json = json.dumps({"name": "b", "path": adapters["b"], "base_model_name": "tiny-base"})
    proc = ServerProcess(base, [*ENGINE_FLAGS, "--served-model-name", "tiny-base", "--enable-lora", "--max-loras", "2",
                                "--max-lora-rank", "16", "--max-cpu-loras", "2", "--lora-modules", f"a={adapters['a']}",
                                "--lora-modules", b_json, "--allow-runtime-lora-updating"], root / "server.log")
    yield proc.wait_healthy()
    proc.stop()


@pytest.fixture(scope="module")
def offline(files):
    base, adapters, _, _ = files
    llm = LLM(model=base, dtype="float32", num_threads=1, num_kv_blocks=256, enable_lora=True, max_loras=2,
              max_lora_rank=16)
    return llm, {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(adapters.items())}


def greedy_completion(server: ServerProcess, model: str, prompt: list[int], max_tokens: int = MAX_TOKENS):
    return server.client().completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                              extra_body={"ignore_eos": True})


def expect_error(response: httpx.Response, status: int, param: str | None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"], error
    return error


def test_models_lists_adapters_with_their_parent(server, files):
    _, adapters, _, _ = files
    cards = {card["id"]: card for card in server.client().models.list().model_dump()["data"]}
    assert {"tiny-base", "a", "b"} <= set(cards)
    assert cards["tiny-base"]["parent"] is None
    assert (cards["a"]["parent"], cards["a"]["root"]) == ("tiny-base", adapters["a"])
    assert (cards["b"]["parent"], cards["b"]["root"]) == ("tiny-base", adapters["b"])  # the JSON form
    assert server.get_json("/v1/models/a")["parent"] == "tiny-base"
    expect_error(httpx.get(f"{server.url}/v1/models/nope"), 404, "model")


def test_adapter_requests_equal_offline_and_differ_from_base(server, offline):
    """Completions and chat with ``model`` = adapter give the offline engine's greedy tokens for that adapter."""
    llm, loras = offline
    prompts = random_prompts(3, seed=7)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for model in ("tiny-base", "a", "b"):
        lora = None if model == "tiny-base" else loras[model]
        want = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                             lora_request=lora)]
        with ThreadPoolExecutor(3) as pool:  # one batch holding the three requests
            got = list(pool.map(lambda p: greedy_completion(server, model, p), prompts))
        tokenizer = llm.get_tokenizer()
        assert [c.choices[0].text for c in got] == [tokenizer.decode(w) for w in want], model
        assert all(c.model == model for c in got)
    base_text = greedy_completion(server, "tiny-base", prompts[0]).choices[0].text
    assert greedy_completion(server, "a", prompts[0]).choices[0].text != base_text
    chat = server.client().chat.completions.create(model="b", messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=4, temperature=0)
    assert chat.model == "b" and chat.choices[0].message.content is not None


def test_prefix_cache_never_crosses_adapters(server):
    prompt = random_prompts(1, seed=11, lo=40, hi=41)[0]
    first = {m: greedy_completion(server, m, prompt, 1) for m in ("tiny-base", "a", "b")}
    again = {m: greedy_completion(server, m, prompt, 1) for m in ("tiny-base", "a", "b")}
    for model in first:
        assert (first[model].usage.prompt_tokens_details is None
                or not first[model].usage.prompt_tokens_details.cached_tokens), model
        assert again[model].usage.prompt_tokens_details.cached_tokens >= 32, model


def test_load_use_and_unload_at_run_time(server, files, offline):
    _, adapters, _, _ = files
    llm, loras = offline
    response = server.post("/v1/load_lora_adapter", {"lora_name": "c", "lora_path": adapters["c"]})
    assert response.status_code == 200, response.text
    assert "c" in {card.id for card in server.client().models.list().data}
    prompt = random_prompts(1, seed=3)[0]
    want = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                                       ignore_eos=True), lora_request=loras["c"])
    assert greedy_completion(server, "c", prompt).choices[0].text == want[0].outputs[0].text
    response = server.post("/v1/unload_lora_adapter", {"lora_name": "c"})
    assert response.status_code == 200, response.text
    assert "c" not in {card.id for card in server.client().models.list().data}
    with pytest.raises(openai.NotFoundError):
        greedy_completion(server, "c", prompt)
    # The name is free again; reloaded, it gets a fresh id and computes the same.
    assert server.post("/v1/load_lora_adapter", {"lora_name": "c", "lora_path": adapters["c"]}).status_code == 200
    assert greedy_completion(server, "c", prompt).choices[0].text == want[0].outputs[0].text
    assert server.post("/v1/unload_lora_adapter", {"lora_name": "c"}).status_code == 200
    assert server.wait_idle()["integrity"] == "ok"


def test_unload_waits_for_requests_in_flight(server, files):
    """An unload sent while a long streamed request of the adapter runs returns only after that stream
    finished whole (finish_reason length, every token); then the name is gone."""
    _, adapters, _, _ = files
    assert server.post("/v1/load_lora_adapter", {"lora_name": "c", "lora_path": adapters["c"]}).status_code == 200
    max_tokens = 120
    stream = server.client().completions.create(model="c", prompt=random_prompts(1, seed=4)[0], max_tokens=max_tokens,
                                                temperature=0, stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    first = next(chunks)  # the request is running
    info = [k for k in server.metrics() if k.startswith("tokenmill:lora_requests_info")]
    assert len(info) == 1 and "running_lora_adapters=c" in info[0] and "max_lora=2" in info[0], info
    unloaded_at: list[float] = []
    unload = threading.Thread(target=lambda: (server.post("/v1/unload_lora_adapter", {"lora_name": "c"}),
                                              unloaded_at.append(time.monotonic())))
    unload.start()
    time.sleep(0.3)
    with pytest.raises(openai.NotFoundError):  # no new requests for an adapter being unloaded
        greedy_completion(server, "c", [5, 6, 7])
    rest = list(chunks)
    finished_at = time.monotonic()
    unload.join(60)
    texts = [first, *rest]
    assert texts[-1].choices[0].finish_reason == "length"
    assert unloaded_at and unloaded_at[0] >= finished_at - 0.5  # the unload answered after the stream ended
    assert "c" not in {card.id for card in server.client().models.list().data}


BAD_LOADS = [
    ("missing path", lambda a, n: {"lora_name": "x", "lora_path": "/nonexistent/adapter"}, 404, "lora_path"),
    ("not an adapter", lambda a, n: {"lora_name": "x", "lora_path": n}, 400, "lora_path"),
    ("duplicate name", lambda a, n: {"lora_name": "a", "lora_path": a["c"]}, 400, "lora_name"),
    ("base model's name", lambda a, n: {"lora_name": "tiny-base", "lora_path": a["c"]}, 400, "lora_name"),
    ("rank too large", lambda a, n: {"lora_name": "x", "lora_path": a["big"]}, 400, "lora_path"),
    ("another base model", lambda a, n: {"lora_name": "x", "lora_path": a["other"]}, 400, "lora_path"),
    ("no lora_path", lambda a, n: {"lora_name": "x"}, 400, "lora_path"),
    ("empty name", lambda a, n: {"lora_name": "", "lora_path": a["c"]}, 400, "lora_name"),
]


@pytest.mark.parametrize("case", BAD_LOADS, ids=[c[0] for c in BAD_LOADS])
def test_bad_loads_are_4xx_while_serving(server, files, case):
    _, adapters, not_adapter, _ = files
    _, body, status, param = case
    with ThreadPoolExecutor(2) as pool:
        normal = pool.submit(greedy_completion, server, "a", [10, 11, 12])
        expect_error(server.post("/v1/load_lora_adapter", body(adapters, not_adapter)), status, param)
        assert normal.result().choices[0].finish_reason == "length"
    assert "x" not in {card.id for card in server.client().models.list().data}


@pytest.mark.parametrize("name,status", [("unknown", 404), ("tiny-base", 400)])
def test_bad_unloads_are_4xx(server, name, status):
    expect_error(server.post("/v1/unload_lora_adapter", {"lora_name": name}), status, "lora_name")
    assert greedy_completion(server, "a", [1, 2, 3]).choices[0].finish_reason == "length"


def test_metrics_and_request_log_name_the_adapters(server):
    greedy_completion(server, "b", [4, 5, 6])
    metrics = server.metrics()
    assert metrics["tokenmill:lora_adapter_loads_total{tier=host}"] >= 3  # a, b at startup, c at run time
    assert metrics["tokenmill:lora_adapter_loads_total{tier=slot}"] >= 3
    assert metrics["tokenmill:lora_adapter_evictions_total{tier=slot}"] >= 1  # 3 adapters through 2 slots
    info = [k for k in metrics if k.startswith("tokenmill:lora_requests_info")]
    assert info == ["tokenmill:lora_requests_info{max_lora=2,running_lora_adapters=,waiting_lora_adapters=}"]
    log = server.log()
    assert "lora=b " in log and "lora=- " in log and "model=tiny-base" in log


def test_without_the_flags(files, tmp_path):
    """No --allow-runtime-lora-updating: the routes are 404s saying so; adapter names are unknown models;
    --lora-modules without --enable-lora, or naming a directory that is no adapter, stops the start."""
    base, adapters, not_adapter, _ = files
    result = subprocess.run([sys.executable, "-m", "tokenmill.cli.main", "serve", base, "--lora-modules",
                             f"a={adapters['a']}"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode != 0 and "--lora-modules needs --enable-lora" in result.stderr
    bad = ServerProcess(base, [*ENGINE_FLAGS, "--enable-lora", "--lora-modules", f"broken={not_adapter}"],
                        tmp_path / "bad.log")
    with pytest.raises(RuntimeError, match="broken"):
        bad.wait_healthy(120)
    plain = ServerProcess(base, [*ENGINE_FLAGS, "--enable-lora"], tmp_path / "plain.log").wait_healthy()
    try:
        error = expect_error(plain.post("/v1/load_lora_adapter", {"lora_name": "c", "lora_path": adapters["c"]}),
                             404, None)
        assert "--allow-runtime-lora-updating" in error["message"]
        with pytest.raises(openai.NotFoundError):
            greedy_completion(plain, "a", [1, 2])
    finally:
        plain.stop()
