"""Property tests with hypothesis (issue 44, item 1): streaming changes nothing but the chunking.

- Hermes tool-call parser (pure, no server): for model outputs drawn by hypothesis (content, well-formed
  calls with arbitrary JSON arguments, blocks malformed before their name, a last block cut off), the
  deltas of ``HermesStreamParser`` fed the text at hypothesis-drawn split points join to the calls and
  content of ``extract_tool_calls`` on the whole text; and for any text at all, any chunking gives the
  same joined deltas as the text fed in one piece.
- One real ``tokenmill serve`` (the embedded model, 127.0.0.1) through the ``openai`` client: for drawn
  sampling parameters (greedy or seeded temperature, max_tokens, stop strings, logprobs / top_logprobs,
  n, echo, a forced tool call), the streamed response joined equals the non-streamed one: text, token
  ids (``return_token_ids``), logprobs, tool calls and finish reasons, per choice. The engine runs
  ``--deterministic`` so a seeded sample does not depend on what else shares its batch.
"""
from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenmill.tool_calling import TOOL_CALL_END, TOOL_CALL_START, HermesStreamParser, extract_tool_calls
from tests.server_fixtures import ServerProcess


def ids(index: int) -> str:
    return f"call_prop{index}"


# ------------------------------------------------------------------ Hermes parser in any chunking
def joined(text: str, cuts: list[int]) -> tuple[str, list[tuple[str, str, str]]]:
    """Feeds ``text`` cut at the sorted positions ``cuts``; returns (content, [(id, name, arguments)])
    joined from the deltas, checking that every arguments fragment belongs to the last call announced."""
    parser = HermesStreamParser(ids)
    bounds = [0, *cuts, len(text)]
    deltas = [d for a, b in zip(bounds, bounds[1:]) for d in parser.feed(text[a:b])] + parser.finish()
    content, calls = "", []
    for delta in deltas:
        if "content" in delta:
            content += delta["content"]
            continue
        [item] = delta["tool_calls"]
        if "id" in item:
            assert item["index"] == len(calls)
            calls.append([item["id"], item["function"]["name"], item["function"]["arguments"]])
        else:
            assert item["index"] == len(calls) - 1
            calls[-1][2] += item["function"]["arguments"]
    return content, [tuple(c) for c in calls]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8)
json_ws = st.text(alphabet=" \t\n\r", max_size=3)


@st.composite
def well_formed_call(draw) -> str:
    """A ``<tool_call>`` block the parser must take: a name, maybe arguments (or ``parameters``), maybe
    other keys, JSON whitespace anywhere it may go; the arguments written compactly or indented."""
    name = draw(st.text(min_size=1, max_size=12))
    members = [("name", name)]
    if draw(st.booleans()):
        arguments = draw(st.dictionaries(st.text(max_size=8), json_values, max_size=3))
        members.append((draw(st.sampled_from(["arguments", "parameters"])), arguments))
    members += draw(st.lists(st.tuples(st.sampled_from(["id", "type", "extra"]), json_values), max_size=2))
    members = draw(st.permutations(members))
    indent = draw(st.sampled_from([None, 2]))
    ascii_only = draw(st.booleans())
    body = ("," + draw(json_ws)).join(
        json.dumps(k) + draw(json_ws) + ":" + draw(json_ws) + json.dumps(v, indent=indent, ensure_ascii=ascii_only)
        for k, v in members)
    return TOOL_CALL_START + draw(json_ws) + "{" + draw(json_ws) + body + draw(json_ws) + "}" + draw(json_ws) + TOOL_CALL_END


malformed_before_name = st.sampled_from([
    "<tool_call>not json</tool_call>", "<tool_call>{}</tool_call>", '<tool_call>{"name": 3}</tool_call>',
    '<tool_call>{"arguments": {"a": 1}}</tool_call>', '<tool_call>{"name": ""}</tool_call>', "<tool_call>",
    "</tool_call>", "<tool_", '<tool_call>["name"]</tool_call>'])
content_text = st.text(max_size=12) | st.sampled_from([" ", "\n", "<", "<tool", "{", '"name"', "é 🎉"])


@st.composite
def hermes_output(draw) -> str:
    """Content, calls and harmless malformed blocks in any order; maybe a last call cut off inside its
    closing tag (still a call)."""
    pieces = draw(st.lists(well_formed_call() | malformed_before_name | content_text, max_size=6))
    text = "".join(pieces)
    if draw(st.booleans()):
        call = draw(well_formed_call())
        text += call[:len(call) - draw(st.integers(0, len(TOOL_CALL_END)))]
    return text


@st.composite
def text_and_cuts(draw, texts) -> tuple[str, list[int]]:
    text = draw(texts)
    cuts = draw(st.lists(st.integers(0, len(text)), max_size=12)) if text else []
    return text, sorted(cuts)


@given(text_and_cuts(hermes_output()))
@settings(max_examples=300, deadline=None)
def test_hermes_stream_in_any_chunking_equals_the_whole_output_parse(sample):
    text, cuts = sample
    reference = extract_tool_calls(text, ids)
    content, calls = joined(text, cuts)
    assert calls == [(c.id, c.name, c.arguments) for c in reference.tool_calls]
    assert content == (reference.content or "")


tag_soup = st.lists(st.sampled_from([TOOL_CALL_START, TOOL_CALL_END, "{", "}", "[", "]", '"', ":", ",", " ", "\n",
                                     "\\", "name", "arguments", "a", "1", "true", "<", "/", "é"]), max_size=30).map("".join)


@given(text_and_cuts(tag_soup | st.text(max_size=40)))
@settings(max_examples=300, deadline=None)
def test_hermes_stream_of_any_text_does_not_depend_on_the_chunking(sample):
    """Any text, malformed blocks after a name included: the chunked stream joins to the one-piece stream."""
    text, cuts = sample
    assert joined(text, cuts) == joined(text, [])


# ------------------------------------------------------------------ streamed vs non-streamed, real server
MODEL = "SmolLM2-135M-Instruct"  # the embedded model's served name
MAX_MODEL_LEN = 512  # the forced tool call's prompt (tools in the system turn) is about 230 tokens
SERVER_ARGS = ["--max-model-len", str(MAX_MODEL_LEN), "--num-threads", "1", "--deterministic",
               "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
NUM_SERVER_EXAMPLES = 10  # each is 2 requests of at most n=2 x 12 tokens on the embedded model
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
                   "additionalProperties": False}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = ServerProcess(None, SERVER_ARGS, tmp_path_factory.mktemp("stream_props") / "server.log")
    try:
        yield proc.wait_healthy()
    finally:
        code = proc.stop()
    assert code == 0, proc.log()[-2000:]


greedy_or_seeded = st.just({"temperature": 0.0}) | st.builds(lambda seed: {"temperature": 0.8, "seed": seed},
                                                              st.integers(0, 2**31 - 1))
sampling = st.builds(lambda base, how: {**base, **how}, st.fixed_dictionaries({
    "max_tokens": st.integers(1, 12),
    "n": st.integers(1, 2),
    "stop": st.none() | st.lists(st.sampled_from([".", ",", " the", "\n", "a", "!"]), min_size=1, max_size=2),
}), greedy_or_seeded)


def _logprob_entries(content) -> list[tuple]:
    return [(e.token, e.logprob, e.bytes, [(t.token, t.logprob) for t in e.top_logprobs]) for e in content or []]


@given(params=sampling, logprobs=st.sampled_from([None, 0, 2]), echo=st.booleans(),
       prompt=st.sampled_from(["The capital of France is", "Once upon a time", "1, 2, 3,"]))
@settings(max_examples=NUM_SERVER_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
          database=None)
def test_completion_stream_joins_to_the_non_streamed_response(server, params, logprobs, echo, prompt):
    client = server.client()
    body = {**params, "model": MODEL, "prompt": prompt, "logprobs": logprobs, "echo": echo}
    extra = {"return_token_ids": True}
    whole = client.completions.create(**body, extra_body=extra)
    chunks = list(client.completions.create(**body, extra_body=extra, stream=True))
    text = {c.index: "" for c in whole.choices}
    token_ids = {c.index: [] for c in whole.choices}
    lp = {c.index: {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []} for c in whole.choices}
    finish = {}
    for chunk in chunks:
        for choice in chunk.choices:
            text[choice.index] += choice.text
            token_ids[choice.index] += getattr(choice, "token_ids", None) or []
            if choice.logprobs is not None:
                for key in lp[choice.index]:
                    lp[choice.index][key] += getattr(choice.logprobs, key) or []
            if choice.finish_reason is not None:
                finish[choice.index] = choice.finish_reason
    for choice in whole.choices:
        i = choice.index
        assert text[i] == choice.text, (i, body)
        assert finish[i] == choice.finish_reason, (i, body)
        streamed_ids = token_ids[i]
        whole_ids = choice.token_ids
        assert streamed_ids == whole_ids, (i, body)
        if logprobs is None:
            assert choice.logprobs is None
        else:
            for key, streamed in lp[i].items():
                assert streamed == (getattr(choice.logprobs, key) or []), (i, key, body)


@given(params=sampling, top_logprobs=st.none() | st.integers(0, 2),
       question=st.sampled_from(["Name a colour.", "What is 2+2?", "Say hi."]))
@settings(max_examples=NUM_SERVER_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
          database=None)
def test_chat_stream_joins_to_the_non_streamed_response(server, params, top_logprobs, question):
    client = server.client()
    body = {**params, "model": MODEL, "messages": [{"role": "user", "content": question}],
            "logprobs": top_logprobs is not None, "top_logprobs": top_logprobs}
    extra = {"return_token_ids": True}
    whole = client.chat.completions.create(**body, extra_body=extra)
    chunks = list(client.chat.completions.create(**body, extra_body=extra, stream=True))
    streamed = {c.index: {"content": "", "token_ids": [], "logprobs": [], "finish": None} for c in whole.choices}
    for chunk in chunks:
        for choice in chunk.choices:
            s = streamed[choice.index]
            s["content"] += choice.delta.content or ""
            s["token_ids"] += getattr(choice, "token_ids", None) or []
            if choice.logprobs is not None:
                s["logprobs"] += _logprob_entries(choice.logprobs.content)
            if choice.finish_reason is not None:
                s["finish"] = choice.finish_reason
    for choice in whole.choices:
        s = streamed[choice.index]
        assert s["content"] == (choice.message.content or ""), body
        assert s["finish"] == choice.finish_reason, body
        assert s["token_ids"] == choice.token_ids, body
        if top_logprobs is None:
            assert choice.logprobs is None
        else:
            assert s["logprobs"] == _logprob_entries(choice.logprobs.content), body


@given(params=sampling, tool_choice=st.sampled_from(["named", "required"]),
       city=st.sampled_from(["Paris", "Oslo", "Lima"]))
@settings(max_examples=NUM_SERVER_EXAMPLES // 3, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture], database=None)
def test_tool_call_stream_joins_to_the_non_streamed_response(server, params, tool_choice, city):
    """A forced tool call (named, or ``required``; closed arguments schema so the call ends well before
    max_tokens) parses; the streamed calls join to the same name and arguments, with the same finish reason."""
    client = server.client()
    choice_field = ({"type": "function", "function": {"name": "get_weather"}} if tool_choice == "named"
                    else "required")
    body = {**params, "n": 1, "stop": None, "max_tokens": 40, "model": MODEL, "tools": [WEATHER_TOOL],
            "tool_choice": choice_field,
            "messages": [{"role": "user", "content": f"What is the weather in {city}?"}]}
    whole = client.chat.completions.create(**body)
    chunks = list(client.chat.completions.create(**body, stream=True))
    streamed: dict[int, dict] = {c.index: {"calls": {}, "content": "", "finish": None} for c in whole.choices}
    for chunk in chunks:
        for choice in chunk.choices:
            s = streamed[choice.index]
            s["content"] += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                entry = s["calls"].setdefault(call.index, {"name": "", "arguments": ""})
                entry["name"] += (call.function.name or "") if call.function else ""
                entry["arguments"] += (call.function.arguments or "") if call.function else ""
            if choice.finish_reason is not None:
                s["finish"] = choice.finish_reason
    for choice in whole.choices:
        s = streamed[choice.index]
        assert choice.finish_reason != "length", choice  # else the stream keeps a cut-off call (hermes.py)
        calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in choice.message.tool_calls or []]
        assert [s["calls"][i] for i in sorted(s["calls"])] == calls, body
        assert s["content"] == (choice.message.content or ""), body
        assert s["finish"] == choice.finish_reason, body
