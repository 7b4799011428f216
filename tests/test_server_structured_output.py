"""Structured outputs and tool calling through the OpenAI-compatible server, as real processes over
real HTTP (the ``openai`` client, raw httpx for error bodies), on the embedded SmolLM2 model and
on both constraint backends (llguidance and xgrammar, one server each).

What it proves, per backend: seeded temperature-1 constrained outputs (json_schema, regex, choice;
chat and completions) equal the offline ``LLM`` in this process token for token and satisfy their
constraint; streams join to the non-streamed text; a table of bad constraints, tools and tool
choices gets 400s naming the field without reaching the engine, and the server serves on;
forced tool calls (required, required without parallel calls, named) come back as ``tool_calls``
whose arguments validate against their tool, with streamed deltas joining to exactly the
non-streamed arguments; /metrics counts constrained sequences by kind, bitmask steps and time.
Once (no constraint is involved, so the backend plays no part): "auto" parses the Hermes block the
model writes after a few-shot history of tool calls and tool results exactly as
``extract_tool_calls`` reads the offline text, "none" never yields tool calls, and a tool-result
turn is answered as offline. A server without --enable-auto-tool-choice refuses "auto" (and the
default choice with tools) but still forces a named call.
"""
from __future__ import annotations

import gc
import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

from tests.server_fixtures import ServerProcess
from tokenmill import LLM, SamplingParams
from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.tool_calling import extract_tool_calls

MODEL = "SmolLM2-135M-Instruct"  # the served name of the embedded model
# Engine settings shared by the servers and the offline LLMs (everything else is the default).
# The dense path (--quantization none): the tool-call tests rely on what this model writes after tool
# turns, which the GGUF's native quantized execution changes.
ENGINE_ARGS = ["--kv-cache-memory", "0.25", "--max-model-len", "2048", "--quantization", "none"]
LLM_KWARGS = {"kv_cache_memory": 0.25, "max_model_len": 2048, "quantization": "none"}
TOOL_ARGS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
BACKENDS = ["guidance", "xgrammar"]

CITY_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12},
                   "population": {"type": "integer", "minimum": 0, "maximum": 99999}},
    "required": ["name", "population"],
    "additionalProperties": False,
}
CODE_REGEX = r"[A-Z][a-z]{2,7}-[0-9]{2}"
COLOURS = ["red", "green", "blue", "yellow"]
SEEDS = [3, 11]


def valid_city(text: str) -> bool:
    jsonschema.validate(json.loads(text), CITY_SCHEMA)
    return True

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object",
                       "properties": {"city": {"type": "string", "maxLength": 30},
                                      "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                       "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Current time in a timezone",
        "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 40}},
                       "required": ["timezone"], "additionalProperties": False}}},
]
TOOL_PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


def _call(i: int, name: str, arguments: dict) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}]}


def _result(i: int, result: dict) -> dict:
    return {"role": "tool", "tool_call_id": f"call_{i}", "content": json.dumps(result)}


# Earlier questions answered by tool calls, tool results and replies: after it, SmolLM2-135M (greedy)
# answers the last question with a <tool_call> block of its own (checked below, not assumed).
FEW_SHOT = [
    {"role": "user", "content": "What is the weather in Berlin?"}, _call(1, "get_weather", {"city": "Berlin", "unit": "celsius"}),
    _result(1, {"temperature": 12}), {"role": "assistant", "content": "It is 12 degrees in Berlin."},
    {"role": "user", "content": "What time is it in Tokyo?"}, _call(2, "get_time", {"timezone": "Asia/Tokyo"}),
    _result(2, {"time": "10:00"}), {"role": "assistant", "content": "It is 10:00 in Tokyo."},
    {"role": "user", "content": "What is the weather in Rome?"}, _call(3, "get_weather", {"city": "Rome", "unit": "celsius"}),
    _result(3, {"temperature": 20}), {"role": "assistant", "content": "It is 20 degrees in Rome."},
    {"role": "user", "content": "What is the weather in Madrid?"},
]


# ---- servers and offline engines, one pair per backend -------------------------------------------
@pytest.fixture(scope="module")
def processes(tmp_path_factory):
    """Every server of this module, started at once so that later ones load while earlier ones are
    tested: one per backend, and one without --enable-auto-tool-choice."""
    logs = tmp_path_factory.mktemp("logs")
    procs = {backend: ServerProcess(None, [*ENGINE_ARGS, *TOOL_ARGS, "--structured-outputs-config",
                                           json.dumps({"backend": backend})], logs / f"{backend}.log")
             for backend in BACKENDS}
    procs["no-auto-flag"] = ServerProcess(None, ENGINE_ARGS, logs / "no-auto-flag.log")
    yield procs
    with ThreadPoolExecutor(len(procs)) as pool:  # they shut down side by side
        codes = dict(zip(procs, pool.map(lambda proc: proc.stop(), procs.values())))
    assert set(codes.values()) == {0}, {name: (code, procs[name].log()[-2000:]) for name, code in codes.items()}


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def stack(backend, processes):
    """(server, offline LLM) on one backend; the LLM loads while the server process loads."""
    llm = LLM(**LLM_KWARGS, structured_outputs_config={"backend": backend})
    yield processes[backend].wait_healthy(), llm
    llm.close()
    del llm
    gc.collect()


@pytest.fixture(scope="module")
def server(stack) -> ServerProcess:
    return stack[0]


@pytest.fixture(scope="module")
def llm(stack) -> LLM:
    return stack[1]


def sampled(seed: int, max_tokens: int, constraint: StructuredOutputsParams) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, structured_outputs=constraint)


# ---- 1. offline and server agree, and the output obeys its constraint -----------------------------
# (endpoint, kind, offline constraint, request fields, prompt or messages, max_tokens, check of the text)
CASES = [
    ("chat", "json", StructuredOutputsParams(json=CITY_SCHEMA),
     {"response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA, "strict": True}}},
     [{"role": "user", "content": "Describe a city as JSON with its name and population."}], 40,
     valid_city),
    ("completions", "json", StructuredOutputsParams(json=CITY_SCHEMA),
     {"extra_body": {"structured_outputs": {"json": CITY_SCHEMA}}},
     "A city described as JSON:", 40, valid_city),
    ("chat", "regex", StructuredOutputsParams(regex=CODE_REGEX),
     {"extra_body": {"structured_outputs": {"regex": CODE_REGEX}}},
     [{"role": "user", "content": "Invent a product code."}], 16, lambda text: re.fullmatch(CODE_REGEX, text)),
    ("completions", "regex", StructuredOutputsParams(regex=CODE_REGEX),
     {"extra_body": {"structured_outputs": {"regex": CODE_REGEX}}},
     "Product code:", 16, lambda text: re.fullmatch(CODE_REGEX, text)),
    ("chat", "choice", StructuredOutputsParams(choice=COLOURS),
     {"extra_body": {"structured_outputs": {"choice": COLOURS}}},
     [{"role": "user", "content": "Name a colour."}], 8, lambda text: text in COLOURS),
    ("completions", "choice", StructuredOutputsParams(choice=COLOURS),
     {"extra_body": {"structured_outputs": {"choice": COLOURS}}},
     "My favourite colour is", 8, lambda text: text in COLOURS),
]


def server_text(server: ServerProcess, endpoint: str, prompt, max_tokens: int, seed: int, fields: dict):
    """(text, finish_reason, completion_tokens) of one seeded temperature-1 request."""
    client = server.client()
    if endpoint == "chat":
        got = client.chat.completions.create(model=MODEL, messages=prompt, max_tokens=max_tokens, temperature=1.0,
                                             seed=seed, **fields)
        return got.choices[0].message.content, got.choices[0].finish_reason, got.usage.completion_tokens
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=1.0, seed=seed,
                                    **fields)
    return got.choices[0].text, got.choices[0].finish_reason, got.usage.completion_tokens


def test_seeded_constrained_outputs_equal_offline_and_obey_the_constraint(server, llm):
    # Both engines see the same requests in the same order, one at a time (same batches, same
    # prefix-cache hits), so the same seed must give the same tokens. The offline engine runs in a
    # second thread meanwhile.
    runs = [(case, seed) for case in CASES for seed in SEEDS]

    def offline() -> list:
        outputs = []
        for (endpoint, _, constraint, _, prompt, max_tokens, _), seed in runs:
            params = sampled(seed, max_tokens, constraint)
            outputs.append((llm.chat(prompt, params) if endpoint == "chat" else llm.generate(prompt, params))[0].outputs[0])
        return outputs

    with ThreadPoolExecutor(1) as pool:
        offline_outputs = pool.submit(offline)
        served = [server_text(server, endpoint, prompt, max_tokens, seed, fields)
                  for (endpoint, _, _, fields, prompt, max_tokens, _), seed in runs]
        wants = offline_outputs.result()
    for ((endpoint, kind, *_, max_tokens, check), seed), (text, finish_reason, num_tokens), want in zip(runs, served, wants):
        where = f"{endpoint} {kind} seed {seed}"
        assert (text, finish_reason, num_tokens) == (want.text, want.finish_reason, len(want.token_ids)), where
        assert finish_reason == "stop", f"{where}: {text!r} did not finish within {max_tokens} tokens"
        assert check(text), f"{where}: {text!r}"


# ---- 2. a stream joins to the non-streamed text -------------------------------------------------
@pytest.mark.parametrize("case", [0, 3], ids=["chat-json_schema", "completions-regex"])
def test_streamed_constrained_output_joins_to_non_streamed(server, case):
    endpoint, _, _, fields, prompt, max_tokens, check = CASES[case]
    seed = 5
    text, finish_reason, _ = server_text(server, endpoint, prompt, max_tokens, seed, fields)
    client = server.client()
    if endpoint == "chat":
        chunks = list(client.chat.completions.create(model=MODEL, messages=prompt, max_tokens=max_tokens,
                                                     temperature=1.0, seed=seed, stream=True, **fields))
        pieces = [c.choices[0].delta.content or "" for c in chunks]
    else:
        chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=1.0,
                                                seed=seed, stream=True, **fields))
        pieces = [c.choices[0].text for c in chunks]
    assert len(pieces) > 2  # streamed in pieces, not in one chunk
    assert "".join(pieces) == text
    assert [c.choices[0].finish_reason for c in chunks][-1] == finish_reason == "stop"
    assert check(text), text


# ---- 3. bad constraints, tools and tool choices: 400 naming the field, nothing queued ---------------
RF_SCHEMA = "response_format.json_schema.schema"


def rf(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


# (id, request fields, param, a fragment of the message); sent to completions and chat.
BAD_CONSTRAINTS = [
    ("invalid-schema", rf({"type": "object", "properties": {"a": {"type": "nonsense"}}}), RF_SCHEMA,
     "not a valid JSON schema"),
    ("keyword-not", {"structured_outputs": {"json": {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}}},
     "structured_outputs.json", "not"),
    ("keyword-oneOf", rf({"oneOf": [{"type": "integer"}, {"type": "number"}]}), RF_SCHEMA, "oneOf"),
    ("unknown-format", rf({"type": "string", "format": "credit-card"}), RF_SCHEMA, "credit-card"),
    ("schema-not-json", {"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "not valid JSON"),
    ("invalid-regex", {"structured_outputs": {"regex": "(ab"}}, "structured_outputs.regex", "structured_outputs.regex"),
    ("invalid-gbnf", {"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs.grammar",
     "structured_outputs.grammar"),
    ("invalid-lark", {"structured_outputs": {"grammar": "start: ("}}, "structured_outputs.grammar",
     "structured_outputs.grammar"),
    ("two-constraints", {"structured_outputs": {"regex": "a+", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ("no-constraint", {"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ("response_format-and-structured_outputs",
     {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a+"}}, "structured_outputs", "not both"),
    ("json_schema-without-schema", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema", "schema"),
    ("empty-choice", {"structured_outputs": {"choice": []}}, "structured_outputs.choice", "at least one"),
]
WEATHER = TOOLS[0]
# Chat only.
BAD_TOOLS = [
    ("tool-without-function", {"tools": [{"type": "function"}]}, "tools[0].function", "must be an object"),
    ("bad-tool-name", {"tools": [{"type": "function", "function": {"name": "get weather!"}}]},
     "tools[0].function.name", "must match"),
    ("invalid-parameters-schema",
     {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
         "a": {"type": "nonsense"}}}}}]}, "tools[0].function.parameters", "not a valid JSON schema"),
    ("parameters-not-an-object", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters", "object"),
    ("duplicate-tool-names", {"tools": [WEATHER, WEATHER]}, "tools[1].function.name", "used by another tool"),
    ("tool_choice-unknown-tool", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_news"}}},
     "tool_choice.function.name", "get_news"),
    ("tool_choice-unknown-mode", {"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "sometimes"),
    ("required-without-tools", {"tool_choice": "required"}, "tool_choice", "tools"),
    ("required-and-response_format", {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "response_format"),
    ("named-and-structured_outputs",
     {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}},
      "structured_outputs": {"regex": "a+"}}, "tool_choice", "structured_outputs"),
    ("required-with-unenforceable-parameters",
     {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
         "a": {"not": {"type": "string"}}}}}}], "tool_choice": "required"}, "tools", "not"),
]


def test_bad_constraints_and_tools_get_400_naming_the_field_before_the_engine(server):
    kv_before = server.kv_cache()
    metrics_before = server.metrics()
    failures = []
    requests = [(path, case) for case in BAD_CONSTRAINTS for path in ("/v1/completions", "/v1/chat/completions")]
    requests += [("/v1/chat/completions", case) for case in BAD_TOOLS]
    for path, (case_id, fields, param, fragment) in requests:
        body = {"max_tokens": 4, **fields}
        body.update({"prompt": "Hi"} if path == "/v1/completions" else {"messages": WEATHER_QUESTION})
        response = server.post(path, body)
        error = response.json().get("error") if response.headers.get("content-type") == "application/json" else None
        got = (response.status_code, error and error["param"], error and error["type"])
        if got != (400, param, "invalid_request_error") or fragment not in error["message"]:
            failures.append(f"{case_id} {path}: {response.status_code} {response.text[:300]}")
    assert not failures, "\n".join(failures)
    # None of them reached the engine: no prompt was looked up, no constrained sequence started.
    kv_after = server.kv_cache()
    assert kv_after["prefix_cache_queries"] == kv_before["prefix_cache_queries"]
    assert (kv_after["num_running"], kv_after["num_waiting"]) == (0, 0)
    metrics_after = server.metrics()
    kinds = [k for k in metrics_after if k.startswith("tokenmill:structured_output_requests_total")]
    assert {k: metrics_after[k] for k in kinds} == {k: metrics_before.get(k) for k in kinds}
    # The server still serves.
    got = server.client().completions.create(model=MODEL, prompt="Hi", max_tokens=4, temperature=0,
                                             extra_body={"structured_outputs": {"choice": COLOURS}})
    assert got.choices[0].text in COLOURS
    assert server.kv_cache()["prefix_cache_queries"] > kv_after["prefix_cache_queries"]


# ---- 4. forced tool calls: required, required without parallel calls, named -------------------------
FORCED = {
    "required": {"tool_choice": "required"},
    "required-single": {"tool_choice": "required", "parallel_tool_calls": False},
    "named": {"tool_choice": {"type": "function", "function": {"name": "get_time"}}},
}


def streamed_tool_calls(chunks) -> tuple[list[dict], str, str | None]:
    """(calls as {id, name, arguments} from the deltas, joined content, last finish_reason), checking
    that each call's first delta carries its id and name and the later ones only arguments."""
    calls: list[dict] = []
    content = ""
    finish_reason = None
    for chunk in chunks:
        (choice,) = chunk.choices
        content += choice.delta.content or ""
        finish_reason = choice.finish_reason or finish_reason
        for delta in choice.delta.tool_calls or []:
            if delta.index == len(calls):  # a new call: announced with its id and complete name
                assert delta.id and delta.id.startswith("call_") and delta.type == "function", delta
                assert delta.function.name and delta.function.arguments == "", delta
                calls.append({"id": delta.id, "name": delta.function.name, "arguments": ""})
            else:
                assert delta.index == len(calls) - 1 and delta.id is None and delta.function.name is None, delta
                calls[-1]["arguments"] += delta.function.arguments
    return calls, content, finish_reason


@pytest.mark.parametrize("choice", list(FORCED))
def test_forced_tool_calls_validate_and_stream_to_the_same_arguments(server, choice):
    body = dict(model=MODEL, messages=WEATHER_QUESTION, tools=TOOLS, max_tokens=120, temperature=1.0, seed=1,
                **FORCED[choice])
    client = server.client()
    got = client.chat.completions.create(**body)
    (answer,) = got.choices
    want_finish = "stop" if choice == "named" else "tool_calls"  # as OpenAI answers (tests/test_conformance.py)
    assert answer.finish_reason == want_finish, answer
    assert answer.message.content is None and answer.message.role == "assistant"
    calls = answer.message.tool_calls
    assert calls and len({c.id for c in calls}) == len(calls)
    if choice != "required":
        assert len(calls) == 1
    if choice == "named":
        assert calls[0].function.name == "get_time"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), TOOL_PARAMETERS[call.function.name])

    streamed, content, finish_reason = streamed_tool_calls(client.chat.completions.create(stream=True, **body))
    assert [(c["name"], c["arguments"]) for c in streamed] == [(c.function.name, c.function.arguments) for c in calls]
    assert content == "" and finish_reason == want_finish


# ---- 4. auto and none (unconstrained: the backend plays no part, so run once) -----------------------
def test_auto_parses_the_call_the_model_writes_after_tool_turns(server, llm, backend):
    if backend != BACKENDS[0]:
        pytest.skip("no constraint is involved: the same on every backend")
    # The raw text, from the offline engine with the same prompt (tools as a Hermes system block,
    # earlier calls and results as Hermes text), computed in a second thread meanwhile.
    body = dict(model=MODEL, messages=FEW_SHOT, tools=TOOLS, tool_choice="auto", max_tokens=60, temperature=0)
    client = server.client()
    with ThreadPoolExecutor(1) as pool:
        offline = pool.submit(lambda: llm.chat(FEW_SHOT, SamplingParams(temperature=0, max_tokens=60), tools=TOOLS))
        (answer,) = client.chat.completions.create(**body).choices
        streamed, content, finish_reason = streamed_tool_calls(client.chat.completions.create(stream=True, **body))
        raw = offline.result()[0].outputs[0]
    assert "<tool_call>" in raw.text and raw.finish_reason == "stop", raw.text
    want = extract_tool_calls(raw.text)
    assert want.tool_calls

    assert answer.finish_reason == "tool_calls"
    assert answer.message.content == want.content
    got = [(c.function.name, c.function.arguments) for c in answer.message.tool_calls]
    assert got == [(c.name, c.arguments) for c in want.tool_calls]
    for name, arguments in got:
        jsonschema.validate(json.loads(arguments), TOOL_PARAMETERS[name])
    assert [(c["name"], c["arguments"]) for c in streamed] == got
    assert content == (want.content or "") and finish_reason == "tool_calls"


def test_tool_choice_none_never_yields_tool_calls(server, backend):
    if backend != BACKENDS[0]:
        pytest.skip("no constraint is involved: the same on every backend")
    body = dict(model=MODEL, messages=FEW_SHOT, tools=TOOLS, tool_choice="none", max_tokens=60, temperature=0)
    client = server.client()
    (answer,) = client.chat.completions.create(**body).choices
    assert answer.message.tool_calls is None and answer.finish_reason in ("stop", "length")
    assert answer.message.content  # whatever it wrote (even a <tool_call> block) stays text
    chunks = list(client.chat.completions.create(stream=True, **body))
    assert not any(c.choices[0].delta.tool_calls for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == answer.message.content
    assert chunks[-1].choices[0].finish_reason == answer.finish_reason


def test_tool_result_turn_is_answered_like_offline(server, llm, backend):
    if backend != BACKENDS[0]:
        pytest.skip("no constraint is involved: the same on every backend")
    messages = [*WEATHER_QUESTION, _call(7, "get_weather", {"city": "Paris", "unit": "celsius"}),
                _result(7, {"temperature": 18, "sky": "clear"})]
    # Both sides compute the whole prompt afresh: which earlier requests left blocks in each prefix cache
    # differs, and a prompt split differently runs kernels chosen per row count, so the last near-tie
    # (end of text against another line) could go either way.
    llm.reset_prefix_cache()
    raw = llm.chat(messages, SamplingParams(temperature=0, max_tokens=24), tools=TOOLS)[0].outputs[0]
    want = extract_tool_calls(raw.text)
    (answer,) = server.client().chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=24,
                                                        temperature=0,
                                                        extra_body={"cache_salt": "tool-result-turn"}).choices
    assert answer.message.content == want.content
    assert [(c.function.name, c.function.arguments) for c in answer.message.tool_calls or []] == [
        (c.name, c.arguments) for c in want.tool_calls]
    assert answer.message.content or answer.message.tool_calls


# ---- 5. metrics ----------------------------------------------------------------------------------------
def test_metrics_count_constrained_sequences_by_kind_and_mask_time(server):
    before = server.metrics()
    got = server.client().completions.create(model=MODEL, prompt="My favourite colour is", max_tokens=8,
                                              temperature=0, extra_body={"structured_outputs": {"choice": COLOURS}})
    assert got.choices[0].text in COLOURS
    after = server.metrics()
    # Everything this module sent on this server: json, regex, choice and tool-call sequences.
    for kind in ("json", "regex", "choice", "tool_calls"):
        assert after[f"tokenmill:structured_output_requests_total{{kind={kind}}}"] > 0, kind
    assert (after["tokenmill:structured_output_requests_total{kind=choice}"]
            - before["tokenmill:structured_output_requests_total{kind=choice}"]) == 1
    assert after["tokenmill:structured_output_requests_total{kind=json}"] == before[
        "tokenmill:structured_output_requests_total{kind=json}"]
    steps = after["tokenmill:structured_output_mask_steps_total"] - before["tokenmill:structured_output_mask_steps_total"]
    assert steps == got.usage.completion_tokens  # one bitmask per sampled token of the one request
    assert after["tokenmill:structured_output_mask_seconds_total"] > before["tokenmill:structured_output_mask_seconds_total"] > 0


# ---- "auto" needs --enable-auto-tool-choice ---------------------------------------------------------------
def test_auto_tool_choice_without_the_flag_is_refused(processes):
    proc = processes["no-auto-flag"].wait_healthy()
    for fields in ({"tool_choice": "auto"}, {}):  # no tool_choice with tools means "auto"
        response = proc.post("/v1/chat/completions", {"messages": WEATHER_QUESTION, "tools": TOOLS, "max_tokens": 4,
                                                      **fields})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "tool_choice"
        assert "--enable-auto-tool-choice" in response.json()["error"]["message"]
    assert proc.kv_cache()["prefix_cache_queries"] == 0
    # Forced calls need no parser flag.
    got = proc.client().chat.completions.create(model=MODEL, messages=WEATHER_QUESTION, tools=TOOLS, max_tokens=100,
                                                tool_choice={"type": "function", "function": {"name": "get_time"}},
                                                temperature=0)
    assert got.choices[0].finish_reason == "stop" and got.choices[0].message.tool_calls[0].function.name == "get_time"
