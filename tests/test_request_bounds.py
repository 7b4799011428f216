"""Bounded requests (issue 41, item 4): one client cannot stall or exhaust a server for everyone.

One real ``tokenmill serve`` (embedded SmolLM2) answers each over-limit field with a 400 naming it and
keeps serving; a full waiting queue gives 503 with ``Retry-After``; a constraint that does not compile
in time gives 400. Without a server: the stop-string check looks only at new text (counted through its
real code path), stop strings spanning tokens still match, and constraint compiles are bounded.
"""
from __future__ import annotations

import json
import time
import random
import sys
import threading
from pathlib import Path

import httpx2 as httpx
import pytest

from tests.server_fixtures import ServerProcess
from tests.tiny_models import smollm2_tokenizer
from tokenmill.config import StructuredOutputsConfig
from tokenmill.detokenizer import IncrementalDetokenizer, StopStringMatcher
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams
from tokenmill.structured_output import ConstraintError, ConstraintTimeoutError, StructuredOutputManager

MAX_MODEL_LEN = 512
MAX_TOKENS_PER_REQUEST = 900
COMPILE_TIMEOUT_S = 0.1
# One running sequence and one waiting: the queue test fills both. The other limits are the defaults.
SERVER_ARGS = ["--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "1", "--max-queued-requests", "1",
               "--max-tokens-per-request", str(MAX_TOKENS_PER_REQUEST),
               "--structured-outputs-compile-timeout", str(COMPILE_TIMEOUT_S)]
CHAT = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = ServerProcess(None, SERVER_ARGS, tmp_path_factory.mktemp("logs") / "server.log").wait_healthy()
    yield proc
    assert proc.stop() == 0, proc.log()[-3000:]


def _tool(i: int) -> dict:
    return {"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object", "properties": {}}}}


# (route, body, the field the 400 names). Each was accepted before the limits existed.
OVER_LIMIT = {
    # the stall: 32 stop strings of 20,000 characters (--max-stop-string-length 1024)
    "long stop strings": ("/v1/completions", {"prompt": "Hi", "stop": ["x" * 20_000] * 32}, "stop"),
    # the victim-stalling request had 2,000,000; these are valid ids (the vocabulary has 49,152)
    "many stop_token_ids": ("/v1/completions", {"prompt": "Hi", "n": 64, "stop_token_ids": list(range(49_152)) * 2},
                            "stop_token_ids"),
    "many logit_bias entries": ("/v1/completions", {"prompt": "Hi", "logit_bias": {str(i): 0 for i in range(1025)}},
                                "logit_bias"),
    "many prompts": ("/v1/completions", {"prompt": [[1, 2]] * 1025, "max_tokens": 1}, "prompt"),
    # the 400 prompts × n = 128 = 51,200 sequences
    "prompts × n sequences": ("/v1/completions", {"prompt": [[1, 2]] * 400, "n": 128, "max_tokens": 1}, "n"),
    "n × max_tokens": ("/v1/completions", {"prompt": "Hi", "n": 4, "max_tokens": 300}, "max_tokens"),
    "n × what is left of max_model_len (chat)": ("/v1/chat/completions", {"messages": CHAT, "n": 2}, "max_tokens"),
    "n × max_completion_tokens (chat)": ("/v1/chat/completions", {"messages": CHAT, "n": 4,
                                                                  "max_completion_tokens": 300},
                                         "max_completion_tokens"),
    "many tools": ("/v1/chat/completions", {"messages": CHAT, "tools": [_tool(i) for i in range(129)],
                                            "tool_choice": "none", "max_tokens": 1}, "tools"),
    "large regex": ("/v1/completions", {"prompt": "Hi", "structured_outputs": {"regex": "a" * 300_000}},
                    "structured_outputs.regex"),
    "large JSON schema": ("/v1/chat/completions", {
        "messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": {
            "type": "object", "properties": {f"p{i:05d}": {"type": "string", "description": "d" * 64}
                                             for i in range(4000)}}}}},
        "response_format.json_schema.schema"),
}


@pytest.mark.parametrize("case", list(OVER_LIMIT))
def test_over_limit_field_gets_400_naming_it_and_the_server_still_serves(server, case):
    route, body, param = OVER_LIMIT[case]
    response = server.post(route, body)
    assert response.status_code == 400, response.text[:500]
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 1}),
])
def test_priority_is_refused_under_fcfs_naming_it(server, route, body):
    """As vLLM: a non-zero ``priority`` needs --scheduling-policy priority (tests/test_priority_scheduling.py)."""
    response = server.post(route, {**body, "priority": 3})
    assert response.status_code == 400 and response.json()["error"]["param"] == "priority", response.text[:300]
    assert server.post(route, {**body, "priority": 0}).status_code == 200


def test_requests_at_the_limits_are_served(server):
    body = {"prompt": "Hi", "max_tokens": 4, "stop": ["s" * 1024] * 32, "stop_token_ids": list(range(1024)),
            "logit_bias": {str(i): 0 for i in range(1024)}, "n": 2, "temperature": 0}
    response = server.post("/v1/completions", body)
    assert response.status_code == 200, response.text[:500]
    assert len(response.json()["choices"]) == 2


def test_full_waiting_queue_gets_503_with_retry_after(server):
    """--max-num-seqs 1 and --max-queued-requests 1: one request runs, one waits, the third is refused."""
    long = {"prompt": "Count: 1, 2, 3,", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=120) as client:
        with client.stream("POST", "/v1/completions", json=long) as running:
            assert running.status_code == 200
            lines = running.iter_lines()
            assert next(line for line in lines if line.startswith("data: ")).startswith("data: {")  # it runs
            with client.stream("POST", "/v1/completions", json=long) as waiting:
                assert waiting.status_code == 200  # queued behind it
                refused = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
                assert refused.status_code == 503, refused.text
                assert int(refused.headers["Retry-After"]) >= 1
                assert refused.json()["error"]["type"] == "service_unavailable_error"
                assert "--max-queued-requests" in refused.json()["error"]["message"]
                # once a step has seen the full queue, a request is refused before any work on it: a prompt the
                # tokenizer would refuse (400) gets the 503 too
                deadline = time.monotonic() + 10
                while (early := client.post("/v1/completions", json={"prompt": [10**9], "max_tokens": 1})
                       ).status_code != 503 and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert early.status_code == 503 and early.headers["Retry-After"], early.text
    server.wait_idle()  # leaving the streams aborted both
    assert server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2}).status_code == 200


def _slow_schema(num_properties: int = 3500) -> dict:
    """A schema of many distinct patterns: llguidance and xgrammar take seconds to compile it."""
    return {"type": "object", "required": [f"p{i}" for i in range(num_properties)],
            "properties": {f"p{i}": {"type": "string", "pattern": f"[a-z]{{{i % 7 + 1},{i % 50 + 10}}}"}
                           for i in range(num_properties)}}


def test_constraint_compile_past_the_timeout_gets_400(server):
    """Last in this module: the compile goes on in the background after the 400."""
    schema = _slow_schema()
    assert len(json.dumps(schema)) < 262_144  # under --max-structured-output-bytes: only the time refuses it
    response = server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 4,
                                               "structured_outputs": {"json": schema}})
    assert response.status_code == 400, response.text[:500]
    error = response.json()["error"]
    assert error["param"] == "structured_outputs.json"
    assert f"did not compile within {COMPILE_TIMEOUT_S:g} s" in error["message"]
    assert server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2}).status_code == 200


# ---- the stop-string check looks at new text only ---------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    return smollm2_tokenizer()


def _lines_run_in_detokenizer(fn) -> int:
    """Python lines executed in tokenmill/detokenizer.py while ``fn()`` runs (a deterministic work count)."""
    target = str(Path(sys.modules[IncrementalDetokenizer.__module__].__file__).resolve())
    count = 0

    def local(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
        return local

    def call(frame, event, arg):
        return local if frame.f_code.co_filename == target else None

    sys.settrace(call)
    try:
        fn()
    finally:
        sys.settrace(None)
    return count


@pytest.mark.parametrize("text, stops", [
    # stop strings that never complete: the old check tried every prefix length of each at every step
    ("The quick brown fox jumps over the lazy dog. " * 60, ["x" * 1999 + "y", "q" * 2000, "The end" + "." * 1993]),
    # output that keeps matching a long prefix of a stop string
    ("ab" * 1200, ["ab" * 1000 + "c", "b" * 1500]),
])
def test_stop_string_work_per_step_is_bounded_by_the_new_text(tokenizer, text, stops):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=stops, max_tokens=None))
    outcomes = []

    def generate():
        for token_id in ids:
            outcomes.append(detok.update([token_id]))
        detok.finish()

    lines = _lines_run_in_detokenizer(generate)
    assert outcomes == [None] * len(ids)
    assert detok.output_text == tokenizer.decode(ids)
    assert len(text) >= max(map(len, stops))  # the output grows as long as the stop strings
    # A few lines per token and per character per stop string, whatever the stop strings' lengths
    # (the check before this change ran about len(stop) lines per stop string per token here).
    assert lines <= 20 * len(stops) * (len(ids) + len(text)), (lines, len(ids), len(text))


def test_stop_strings_spanning_tokens_still_match(tokenizer):
    text = "Once upon a time, the quick brown fox jumps over the lazy dog. The end."
    ids = tokenizer.encode(text, add_special_tokens=False)
    for stop, include in (("the quick brown fox jumps", False), ("the quick brown fox jumps", True),
                          ("azy dog. The e", False), ("ime, t", True)):
        for chunk in (1, 3):
            detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["zzz" * 300, stop],
                                                                         include_stop_str_in_output=include))
            found, emitted = None, ""
            for i in range(0, len(ids), chunk):
                found = detok.update(ids[i : i + chunk])
                emitted += detok.get_delta_text()
                if found:
                    break
                assert stop not in emitted and not any(emitted.endswith(stop[:k]) for k in range(1, len(stop)))
            cut = text.index(stop) + (len(stop) if include else 0)
            assert found == stop and detok.output_text == emitted == text[:cut]


def test_stop_matcher_agrees_with_a_search_of_the_whole_text():
    """Repetitive stop strings (where a partial match must fall back) fed in random pieces: the first
    completed match and the held-back suffix equal those of a search of the whole text."""
    rng = random.Random(41)
    for _ in range(3000):
        text = "".join(rng.choice("ab") for _ in range(rng.randint(1, 40)))
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 7))) for _ in range(rng.randint(1, 3))]
        matcher = StopStringMatcher(stops)
        pos, found = 0, None
        while pos < len(text) and found is None:
            piece = text[pos : pos + rng.randint(1, 5)]
            hit = matcher.feed(piece)
            if hit is not None:
                found = (hit[0], pos + hit[1])
            pos += len(piece)
            if found is None:
                held = max((k for s in stops for k in range(len(s)) if text[:pos].endswith(s[:k])), default=0)
                assert matcher.num_held == held, (text, stops, pos)
        ends = [(text.find(s) + len(s), -len(s), s) for s in stops if s in text]
        expected = min(ends) if ends else None
        assert found == (None if expected is None else (expected[2], expected[0])), (text, stops)


def test_stop_token_ids_are_a_set_built_once():
    params = SamplingParams(stop_token_ids=list(range(5000)))
    assert params.stop_token_id_set is params.stop_token_id_set == frozenset(range(5000))


# ---- constraint compiles are bounded --------------------------------------------------------------


def _manager(backend: str, tokenizer) -> StructuredOutputManager:
    return StructuredOutputManager(StructuredOutputsConfig(backend=backend), tokenizer, tokenizer.vocab_size,
                                   {tokenizer.eos_token_id})


@pytest.mark.parametrize("backend", ["guidance", "xgrammar"])
def test_deeply_nested_schema_is_a_constraint_error(backend, tokenizer):
    manager = _manager(backend, tokenizer)
    schema = '{"type": "string"}'
    for _ in range(400):
        schema = '{"type": "object", "properties": {"a": ' + schema + '}, "required": ["a"]}'
    with pytest.raises(ConstraintError, match="nested too deeply|recursion"):
        manager.compile(StructuredOutputsParams(json=schema), timeout=60)


def test_compile_past_its_timeout_raises_and_finishes_in_the_background(tokenizer):
    manager = _manager("guidance", tokenizer)  # the default backend; xgrammar takes tens of seconds on this schema
    constraint = StructuredOutputsParams(json=_slow_schema(1200))
    with pytest.raises(ConstraintTimeoutError, match="did not compile within 0.01 s"):
        manager.compile(constraint, timeout=0.01)
    done = threading.Event()

    def wait_cached():  # the same constraint again waits for the compile in flight
        manager.compile(constraint, timeout=600)
        done.set()

    waiter = threading.Thread(target=wait_cached)
    waiter.start()
    waiter.join(600)
    assert done.is_set()
    assert manager.cache_size() == 1
    manager.compile(constraint, timeout=0.01)  # cached now: no deadline to meet
    manager.close()
