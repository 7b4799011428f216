"""Conformance found by replaying peers' public bug reports (issue 44, item 7), through one real server
on the embedded SmolLM2 model, over real HTTP (the ``openai`` client; httpx for /tokenize and error bodies).

What it proves:
- ``continue_final_message`` (vLLM's) leaves the last assistant message open: the prompt ends with its
  content (no end-of-turn token), in chat completions, /tokenize and the router's tokenizer alike, and
  the model continues it; ``echo`` puts that content in front of the answer (streamed too); with both
  ``add_generation_prompt`` and ``continue_final_message`` true, or a last message not the assistant's,
  a 400 names ``continue_final_message``. ``add_generation_prompt: false`` alone closes the turn.
- ``finish_reason`` with tools, as OpenAI and vLLM: a named tool choice "stop", "required" and a parsed
  "auto" call "tool_calls", a hit of ``max_tokens`` "length", per choice (n = 2), streamed or not;
  ``tool_choice: "none"`` never yields tool calls.
- ``response_format: json_object`` on a prompt that never asks for JSON ends (greedy) with "stop" and
  valid JSON where the unbounded object grammar (still what a ``json_schema`` of ``{"type": "object"}``
  is) nests the same key until ``max_tokens``; on both backends the bounds hold token by token.
"""
from __future__ import annotations

import json

import pytest

from tests.server_fixtures import ServerProcess
from tokenmill.config import StructuredOutputsConfig
from tokenmill.models.default_model import default_model_path
from tokenmill.models.gguf_loader import load_gguf_tokenizer
from tokenmill.router.tokenize import RouterTokenizer
from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.structured_output import StructuredOutputManager
from tokenmill.structured_output.json_object import JSON_OBJECT_MAX_DEPTH, JSON_OBJECT_MAX_PROPERTIES

MODEL = "SmolLM2-135M-Instruct"
# The dense path, as in test_server_structured_output.py: the "auto" few-shot below relies on what this
# model writes after tool turns there.
SERVER_ARGS = ["--kv-cache-memory", "0.25", "--max-model-len", "2048", "--quantization", "none",
               "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
PREFILL = [{"role": "user", "content": "What is the capital of France?"},
           {"role": "assistant", "content": "The capital of France is"}]
CONTINUE = {"add_generation_prompt": False, "continue_final_message": True}
END_OF_TURN = "<|im_end|>"

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
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_time"}}


def _call(i: int, name: str, arguments: dict) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}]}


def _result(i: int, result: dict) -> dict:
    return {"role": "tool", "tool_call_id": f"call_{i}", "content": json.dumps(result)}


# After it SmolLM2-135M (greedy) answers the last question with a <tool_call> block of its own.
FEW_SHOT = [
    {"role": "user", "content": "What is the weather in Berlin?"}, _call(1, "get_weather", {"city": "Berlin", "unit": "celsius"}),
    _result(1, {"temperature": 12}), {"role": "assistant", "content": "It is 12 degrees in Berlin."},
    {"role": "user", "content": "What time is it in Tokyo?"}, _call(2, "get_time", {"timezone": "Asia/Tokyo"}),
    _result(2, {"time": "10:00"}), {"role": "assistant", "content": "It is 10:00 in Tokyo."},
    {"role": "user", "content": "What is the weather in Rome?"}, _call(3, "get_weather", {"city": "Rome", "unit": "celsius"}),
    _result(3, {"temperature": 20}), {"role": "assistant", "content": "It is 20 degrees in Rome."},
    {"role": "user", "content": "What is the weather in Madrid?"},
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = ServerProcess(None, SERVER_ARGS, tmp_path_factory.mktemp("logs") / "server.log")
    yield proc.wait_healthy()
    assert proc.stop() == 0, proc.log()[-2000:]


def prompt_text(server: ServerProcess, **body) -> tuple[list[int], str]:
    response = server.post("/tokenize", {"messages": PREFILL, **body})
    assert response.status_code == 200, response.text
    tokens = response.json()["tokens"]
    return tokens, server.post("/detokenize", {"tokens": tokens}).json()["prompt"]


# ---- 1. continue_final_message, echo, add_generation_prompt ------------------------------------------
def test_continue_final_message_continues_the_assistant_message(server):
    continued, text = prompt_text(server, **CONTINUE)
    assert text.endswith("<|im_start|>assistant\nThe capital of France is"), text
    closed, closed_text = prompt_text(server, add_generation_prompt=False)  # alone: the turn is closed
    assert closed_text.endswith(f"The capital of France is{END_OF_TURN}\n") and closed[: len(continued)] == continued
    opened, opened_text = prompt_text(server)  # the default opens a new assistant turn after it
    assert opened_text.endswith(f"The capital of France is{END_OF_TURN}\n<|im_start|>assistant\n")

    # The router hashes the prompt a worker computes: the same ids.
    assert RouterTokenizer(_tokenizer()).render_chat(PREFILL, **CONTINUE) == continued

    client = server.client()
    body = dict(model=MODEL, messages=PREFILL, max_tokens=12, temperature=0, extra_body=CONTINUE)
    answer = client.chat.completions.create(**body).choices[0]
    raw = client.completions.create(model=MODEL, prompt=continued, max_tokens=12, temperature=0).choices[0]
    assert answer.message.content and answer.message.content == raw.text, (answer, raw)
    assert answer.finish_reason == raw.finish_reason
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **body))
    assert streamed == answer.message.content

    # echo: the continued message's content comes first, streamed as non-streamed.
    echo = dict(body, extra_body={**CONTINUE, "echo": True})
    echoed = client.chat.completions.create(**echo).choices[0].message.content
    assert echoed == PREFILL[-1]["content"] + answer.message.content
    assert "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **echo)) == echoed


def _tokenizer():
    return load_gguf_tokenizer(default_model_path())


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
@pytest.mark.parametrize("case", ["both-true", "last-from-user"])
def test_continue_final_message_misuse_is_400_naming_the_field(server, path, case):
    fields = {"continue_final_message": True}
    messages = PREFILL if case == "both-true" else PREFILL[:1]
    if case == "last-from-user":
        fields["add_generation_prompt"] = False
    response = server.post(path, {"messages": messages, "max_tokens": 4, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "continue_final_message", error
    assert ("add_generation_prompt" if case == "both-true" else "assistant") in error["message"]
    assert server.client().chat.completions.create(model=MODEL, messages=PREFILL[:1], max_tokens=2).choices


# ---- 2. finish_reason with tools ------------------------------------------------------------------------
def streamed_finish(chunks) -> dict[int, tuple[str | None, int]]:
    """Per choice index: (its last finish_reason, how many tool-call deltas it streamed)."""
    out: dict[int, tuple[str | None, int]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            reason, calls = out.get(choice.index, (None, 0))
            out[choice.index] = (choice.finish_reason or reason, calls + len(choice.delta.tool_calls or []))
    return out


FORCED = [  # (tool_choice and other fields, the finish_reason OpenAI and vLLM give)
    ({"tool_choice": NAMED}, "stop"),
    ({"tool_choice": "required"}, "tool_calls"),
    ({"tool_choice": NAMED, "max_tokens": 6}, "length"),
    ({"tool_choice": "required", "max_tokens": 6}, "length"),
]


def test_tool_finish_reasons_are_openai_s(server):
    client = server.client()
    for fields, want in FORCED:  # n = 2: each choice on its own
        body = {"model": MODEL, "messages": WEATHER_QUESTION, "tools": TOOLS, "max_tokens": 80, "temperature": 1.0,
                "seed": 5, "n": 2, **fields}
        choices = client.chat.completions.create(**body).choices
        assert [c.finish_reason for c in choices] == [want, want], (fields, choices)
        for choice in choices:
            if want != "length":
                assert choice.message.tool_calls and choice.message.content is None
            if fields["tool_choice"] == NAMED and want != "length":
                assert [c.function.name for c in choice.message.tool_calls] == ["get_time"]
        streamed = streamed_finish(client.chat.completions.create(stream=True, **body))
        assert {i: reason for i, (reason, _) in streamed.items()} == {0: want, 1: want}, fields
        assert all(num_deltas for _, num_deltas in streamed.values()) or want == "length"

    # "auto" with a parsed call: "tool_calls"; "none": never a tool call.
    body = dict(model=MODEL, messages=FEW_SHOT, tools=TOOLS, max_tokens=60, temperature=0)
    answer = client.chat.completions.create(tool_choice="auto", **body).choices[0]
    assert answer.message.tool_calls and answer.finish_reason == "tool_calls", answer
    reason, num_deltas = streamed_finish(client.chat.completions.create(tool_choice="auto", stream=True, **body))[0]
    assert reason == "tool_calls" and num_deltas > 0
    none = client.chat.completions.create(tool_choice="none", **body).choices[0]
    assert none.message.tool_calls is None and none.finish_reason in ("stop", "length") and none.message.content
    assert streamed_finish(client.chat.completions.create(tool_choice="none", stream=True, **body))[0][1] == 0


# ---- 3. json_object ends ----------------------------------------------------------------------------------
# Never asks for JSON; greedy, the unbounded object grammar writes {"cat":{"cat":{"cat":... until max_tokens.
NOT_JSON = [{"role": "user", "content": "Translate 'cat' into French."}]


def test_json_object_on_a_prompt_not_asking_for_json_ends_with_valid_json(server):
    client = server.client()
    body = dict(model=MODEL, messages=NOT_JSON, max_tokens=80, temperature=0)
    unbounded = client.chat.completions.create(
        response_format={"type": "json_schema", "json_schema": {"name": "o", "schema": {"type": "object"}}},
        **body).choices[0]
    assert unbounded.finish_reason == "length" and unbounded.message.content.startswith('{"cat":{"cat":{"cat":')

    answer = client.chat.completions.create(response_format={"type": "json_object"}, **body).choices[0]
    assert answer.finish_reason == "stop", answer.message.content
    value = json.loads(answer.message.content)
    assert isinstance(value, dict)
    assert json.dumps(value, separators=(",", ":"), ensure_ascii=False) == answer.message.content  # compact
    chunks = list(client.chat.completions.create(response_format={"type": "json_object"}, stream=True, **body))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == answer.message.content
    assert chunks[-1].choices[0].finish_reason == "stop"


def _nested(depth: int) -> str:
    text = "1"
    for _ in range(depth):
        text = '{"a":' + text + "}"
    return text


@pytest.mark.parametrize("backend", ["guidance", "xgrammar"])
def test_json_object_bounds_hold_token_by_token_on_both_backends(backend):
    tokenizer = _tokenizer()
    eos_id = int(tokenizer.eos_token_id)
    manager = StructuredOutputManager(StructuredOutputsConfig(backend=backend), tokenizer, 49152, {eos_id})
    try:
        compiled = manager.compile(StructuredOutputsParams(json_object=True))

        def complete(text: str) -> bool:
            matcher = manager.backend.new_matcher(compiled)
            for token in tokenizer.encode(text, add_special_tokens=False):
                if not matcher.accept_token(token):
                    return False
            return matcher.accept_token(eos_id)

        def members(n: int) -> str:
            return "{" + ",".join(f'"k{i}":[{i},"x"]' for i in range(n)) + "}"

        assert complete(_nested(JSON_OBJECT_MAX_DEPTH)) and not complete(_nested(JSON_OBJECT_MAX_DEPTH + 1))
        assert complete(members(JSON_OBJECT_MAX_PROPERTIES)) and not complete(members(JSON_OBJECT_MAX_PROPERTIES + 1))
        assert complete('{"a":[' + ",".join(map(str, range(200))) + '],"' + "k" * 300 + '":"v"}')  # no other bound
        assert not complete("[1]")  # still an object
    finally:
        manager.close()
