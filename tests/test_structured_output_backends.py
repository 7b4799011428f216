"""Structured-output backends (llguidance and xgrammar) without model weights: the SmolLM2 tokenizer
alone, one StructuredOutputManager per backend for the whole module.

Proves, for each backend: every constraint kind compiles and a valid output walks the mask token by
token to a state where only end-of-sequence remains; rollback and reset restore earlier masks; the
compile cache shares compiled constraints per (backend, kind, spec); bad constraints are refused
with ConstraintError naming the kind and the problem; and every JSON-schema keyword and string
format that xgrammar is trusted with (``schema_check.XGRAMMAR_KEYWORDS`` / ``XGRAMMAR_FORMATS``)
really constrains its output. Also: ``apply_token_bitmask_`` against a slow per-token reference, and
the manager's batch fill (which rows, ``only_stop``, ``allows_none``).
"""
from __future__ import annotations

import json
import random
import re
from types import SimpleNamespace

import jsonschema
import numpy as np
import pytest
import torch

from tokenmill.config import StructuredOutputsConfig
from tokenmill.models.default_model import default_model_path
from tokenmill.models.gguf_loader import load_gguf_tokenizer
from tokenmill.sampling.grammar_mask import apply_token_bitmask_, unpack_bitmask
from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.structured_output import (
    ConstraintError,
    StructuredOutputBackend,
    StructuredOutputManager,
)
from tokenmill.structured_output import manager as manager_module
from tokenmill.structured_output.schema_check import (
    ANNOTATION_KEYWORDS,
    XGRAMMAR_FORMATS,
    XGRAMMAR_KEYWORDS,
)
from tokenmill.structured_output.tool_call_format import (
    CALL_END,
    CALL_SEPARATOR,
    call_begin,
)

BACKENDS = ["guidance", "xgrammar"]
VOCAB_SIZE = 49152  # SmolLM2's logits width (= its tokenizer's size)


# ---------------------------------------------------------------- fixtures and helpers

@pytest.fixture(scope="module")
def tokenizer():
    return load_gguf_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def eos_id(tokenizer) -> int:
    return int(tokenizer.eos_token_id)


@pytest.fixture(scope="module")
def managers(tokenizer, eos_id) -> dict[str, StructuredOutputManager]:
    """One manager per backend, backends built once for the module."""
    out = {}
    for name in BACKENDS:
        manager = StructuredOutputManager(StructuredOutputsConfig(backend=name), tokenizer, VOCAB_SIZE, {eos_id})
        assert manager.backend.name == name
        out[name] = manager
    yield out
    for manager in out.values():
        manager.close()


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


def allowed_tokens(backend: StructuredOutputBackend, matcher) -> set[int]:
    """The token ids ``matcher`` allows next, read from a freshly filled bitmask."""
    bitmask = backend.allocate_bitmask(1)
    backend.fill_bitmask([matcher], bitmask)
    bits = (bitmask[:, :, None] >> np.arange(32, dtype=np.int32)) & 1  # (1, W, 32)
    return set(np.flatnonzero(bits.reshape(-1)[: backend.vocab_size]).tolist())


def raw_mask(backend: StructuredOutputBackend, matcher) -> np.ndarray:
    bitmask = backend.allocate_bitmask(1)
    backend.fill_bitmask([matcher], bitmask)
    return bitmask[0].copy()


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def walks_to_completion(backend: StructuredOutputBackend, compiled, tokenizer, text: str, eos_id: int) -> bool:
    """True when every token of ``text`` is allowed by the mask and accepted in turn, and
    end-of-sequence is allowed afterwards; False at the first refusal."""
    matcher = backend.new_matcher(compiled)
    for token in encode(tokenizer, text):
        if token not in allowed_tokens(backend, matcher) or not matcher.accept_token(token):
            return False
    return eos_id in allowed_tokens(backend, matcher)


def tool_call(name: str, arguments: str) -> str:
    return call_begin(name) + arguments + CALL_END


WEATHER_TOOL = {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city"], "additionalProperties": False}}
TIME_TOOL = {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
    "additionalProperties": False}}

NESTED_SCHEMA = {
    "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                        "required": ["x", "y"], "additionalProperties": False}},
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3},
        "where": {"$ref": "#/$defs/point"},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "tags", "where", "ok"],
    "additionalProperties": False,
}

# (id, StructuredOutputsParams kwargs, a valid complete output); parallel tool calls stay open for
# another call (see test_parallel_tool_calls_may_continue_or_end).
KIND_CASES = [
    ("json", {"json": NESTED_SCHEMA}, '{"name":"Ann Lee","tags":["b","a"],"where":{"x":-3,"y":14},"ok":true}'),
    ("json_text", {"json": json.dumps({"type": "array", "items": {"type": "number"}, "maxItems": 2})}, "[1.5,-2e3]"),
    ("json_object", {"json_object": True}, '{"k":[1,{"z":null}],"s":"x"}'),
    ("regex", {"regex": r"\d{3}-[a-z]{3}"}, "123-abc"),
    ("choice", {"choice": ["red", "green", "blue"]}, "green"),
    ("grammar_gbnf", {"grammar": 'root ::= "The answer is " digit digit? "."\ndigit ::= [0-9]'}, "The answer is 42."),
    ("grammar_lark", {"grammar": 'start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]+/'}, "(1,22,333)"),
    ("tool_calls", {"tool_calls": {"tools": [WEATHER_TOOL, TIME_TOOL], "parallel": False}},
     tool_call("get_weather", '{"city":"Paris","days":3}')),
    ("tool_calls_parallel", {"tool_calls": {"tools": [WEATHER_TOOL, TIME_TOOL], "parallel": True}},
     tool_call("get_weather", '{"city":"Oslo"}') + CALL_SEPARATOR + tool_call("get_time", '{"tz":"CET"}')),
]


# ---------------------------------------------------------------- every kind: mask, accept, complete

@pytest.mark.parametrize("case_id,kwargs,text", KIND_CASES, ids=[c[0] for c in KIND_CASES])
def test_valid_output_is_allowed_token_by_token_then_only_eos_remains(managers, tokenizer, eos_id, backend,
                                                                      case_id, kwargs, text):
    manager = managers[backend]
    params = StructuredOutputsParams(**kwargs)
    compiled = manager.compile(params)
    assert (compiled.backend, compiled.kind) == (backend, params.kind)
    matcher = manager.backend.new_matcher(compiled)
    tokens = encode(tokenizer, text)
    for i, token in enumerate(tokens):
        assert not matcher.is_terminated(), f"terminated before token {i} of {text!r}"
        allowed = allowed_tokens(manager.backend, matcher)
        assert token in allowed, f"token {i} ({tokenizer.decode([token])!r}) of {text!r} not in the mask"
        assert eos_id not in allowed, f"end-of-sequence allowed after an incomplete prefix ({i} tokens)"
        assert matcher.accept_token(token)
    allowed = allowed_tokens(manager.backend, matcher)
    if case_id == "tool_calls_parallel":
        assert eos_id in allowed and encode(tokenizer, call_begin("get_time"))[0] in allowed
    else:
        assert allowed == {eos_id}
    assert matcher.accept_token(eos_id)
    assert matcher.is_terminated()


def test_parallel_tool_calls_may_continue_or_end(managers, tokenizer, eos_id, backend):
    manager = managers[backend]
    calls = [tool_call("get_time", '{"tz":"UTC"}'), tool_call("get_weather", '{"city":"Rome"}'),
             tool_call("get_time", '{"tz":"CET"}')]
    parallel = StructuredOutputsParams(tool_calls={"tools": [WEATHER_TOOL, TIME_TOOL], "parallel": True})
    single = StructuredOutputsParams(tool_calls={"tools": [WEATHER_TOOL, TIME_TOOL], "parallel": False})
    assert walks_to_completion(manager.backend, manager.compile(parallel), tokenizer, CALL_SEPARATOR.join(calls),
                               eos_id)
    assert not walks_to_completion(manager.backend, manager.compile(single), tokenizer, CALL_SEPARATOR.join(calls[:2]),
                                   eos_id)
    # arguments are held to the tool's own schema, and only declared tools may be called
    for bad in (tool_call("get_time", '{"tz":"PST"}'), tool_call("get_weather", '{"days":2}'),
                tool_call("get_news", '{}'), '{"name": "get_time", "arguments": {"tz":"UTC"}}'):
        assert not walks_to_completion(manager.backend, manager.compile(parallel), tokenizer, bad, eos_id), bad


def test_guidance_terminates_when_nothing_can_follow_xgrammar_waits_for_eos(managers, tokenizer):
    params = StructuredOutputsParams(choice=["red", "green"])
    ends = {}
    for name, manager in managers.items():
        matcher = manager.new_matcher(params)
        for token in encode(tokenizer, "green"):
            assert matcher.accept_token(token)
        ends[name] = matcher.is_terminated()
    assert ends == {"guidance": True, "xgrammar": False}


def test_forbidden_token_and_early_eos_are_refused(managers, tokenizer, eos_id, backend):
    manager = managers[backend]
    params = StructuredOutputsParams(choice=["red", "green"])
    matcher = manager.new_matcher(params)
    blue = encode(tokenizer, "blue")[0]
    assert blue not in allowed_tokens(manager.backend, matcher)
    assert not matcher.accept_token(blue)
    matcher = manager.new_matcher(params)
    assert not matcher.accept_token(eos_id)  # nothing complete yet


@pytest.mark.parametrize("backend_name", ["guidance", "xgrammar"])
def test_refused_token_leaves_the_matcher_unchanged(managers, tokenizer, backend_name):
    manager = managers[backend_name]
    matcher = manager.new_matcher(StructuredOutputsParams(choice=["red", "green"]))
    before = raw_mask(manager.backend, matcher)
    assert not matcher.accept_token(encode(tokenizer, "blue")[0])
    assert np.array_equal(raw_mask(manager.backend, matcher), before)
    assert not matcher.is_terminated()
    matcher.reset()
    assert all(matcher.accept_token(t) for t in encode(tokenizer, "green"))


@pytest.fixture(scope="module")
def control_or_special_tokens(tokenizer, eos_id) -> set[int]:
    """Token ids whose text holds a raw control character (< 0x20), and special tokens but EOS."""
    out = {t for t in range(VOCAB_SIZE) if any(ord(c) < 0x20 for c in tokenizer.decode([t]))}
    out |= set(tokenizer.all_special_ids) | {i for i, tok in tokenizer.added_tokens_decoder.items() if tok.special}
    out.discard(eos_id)
    assert encode(tokenizer, "\n")[0] in out and len(out) > 20
    return out


@pytest.mark.parametrize("kwargs,prefix", [
    ({"json": {"type": "object", "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 8}},
               "required": ["s"]}}, '{"s":"'),
    ({"json": {"type": "object", "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 8}},
               "required": ["s"]}}, '{"s":"ab'),
    ({"json": {"type": "string"}}, '"'),
    ({"json_object": True}, '{"k":"'),
    ({"json_object": True}, '{'),
], ids=["bounded-string-start", "bounded-string-inside", "string", "json-object-string", "json-object-start"])
def test_json_mask_never_allows_raw_control_characters_or_special_tokens(managers, tokenizer, backend,
                                                                          control_or_special_tokens, kwargs, prefix):
    manager = managers[backend]
    matcher = manager.new_matcher(StructuredOutputsParams(**kwargs))
    for token in encode(tokenizer, prefix):
        assert matcher.accept_token(token)
    allowed = allowed_tokens(manager.backend, matcher)
    assert len(allowed) > 10
    bad = sorted(allowed & control_or_special_tokens)
    assert not bad, [tokenizer.decode([t]) for t in bad[:10]]


# ---------------------------------------------------------------- rollback and reset

def test_rollback_restores_the_earlier_masks(managers, tokenizer, eos_id, backend):
    manager = managers[backend]
    params = StructuredOutputsParams(json=NESTED_SCHEMA)
    text = '{"name":"Bo","tags":["a"],"where":{"x":1,"y":2},"ok":false}'
    tokens = encode(tokenizer, text)
    k = len(tokens)
    assert k >= 10
    matcher = manager.new_matcher(params)
    masks = []
    for token in tokens:
        masks.append(raw_mask(manager.backend, matcher))
        assert matcher.accept_token(token)
    masks.append(raw_mask(manager.backend, matcher))  # complete: EOS only
    matcher.rollback(1)
    assert np.array_equal(raw_mask(manager.backend, matcher), masks[k - 1])
    assert not matcher.is_terminated()
    matcher.rollback(4)
    assert np.array_equal(raw_mask(manager.backend, matcher), masks[k - 5])
    matcher.rollback(0)
    assert np.array_equal(raw_mask(manager.backend, matcher), masks[k - 5])
    for token in tokens[k - 5:]:  # the same tokens are accepted again after the rollback
        assert matcher.accept_token(token)
    assert np.array_equal(raw_mask(manager.backend, matcher), masks[k])
    matcher.rollback(k)
    assert np.array_equal(raw_mask(manager.backend, matcher), masks[0])
    # a different path after rolling back: '"x":-7' instead of '"x":1'
    other = '{"name":"Bo","tags":["a"],"where":{"x":-7,"y":2},"ok":false}'
    assert all(matcher.accept_token(t) for t in encode(tokenizer, other))
    assert allowed_tokens(manager.backend, matcher) == {eos_id}


def test_reset_returns_to_the_start(managers, tokenizer, eos_id, backend):
    manager = managers[backend]
    matcher = manager.new_matcher(StructuredOutputsParams(regex=r"(cat|dog)s? [0-9]{2}"))
    start = raw_mask(manager.backend, matcher)
    for token in encode(tokenizer, "dogs 4"):
        assert matcher.accept_token(token)
    assert not np.array_equal(raw_mask(manager.backend, matcher), start)
    matcher.reset()
    assert np.array_equal(raw_mask(manager.backend, matcher), start)
    for token in encode(tokenizer, "cat 07"):
        assert matcher.accept_token(token)
    assert allowed_tokens(manager.backend, matcher) == {eos_id}
    assert matcher.accept_token(eos_id) and matcher.is_terminated()
    matcher.reset()  # a finished matcher starts over too
    assert not matcher.is_terminated()
    assert np.array_equal(raw_mask(manager.backend, matcher), start)


# ---------------------------------------------------------------- compile cache

def test_compile_cache_shares_per_backend_kind_and_spec(managers):
    schema = {"type": "object", "properties": {"cache_probe": {"type": "integer"}}, "required": ["cache_probe"]}
    compiled = {}
    for name, manager in managers.items():
        size = manager.cache_size()
        first = manager.compile(StructuredOutputsParams(json=schema))
        assert manager.compile(StructuredOutputsParams(json=dict(schema))) is first
        # the same schema as its canonical text is the same (kind, spec)
        assert manager.compile(StructuredOutputsParams(json=json.dumps(schema, separators=(",", ":")))) is first
        assert manager.cache_size() == size + 1
        other = manager.compile(StructuredOutputsParams(regex="cache_probe"))
        assert other is not first and manager.cache_size() == size + 2
        # a refused constraint is not cached
        with pytest.raises(ConstraintError):
            manager.compile(StructuredOutputsParams(json={"type": "objec"}))
        assert manager.cache_size() == size + 2
        # matchers are per sequence, over the one compiled constraint
        a = manager.new_matcher(StructuredOutputsParams(json=schema))
        b = manager.new_matcher(StructuredOutputsParams(json=schema))
        assert a is not b
        compiled[name] = first
    assert compiled["guidance"] is not compiled["xgrammar"]
    assert {c.backend for c in compiled.values()} == {"guidance", "xgrammar"}
    assert compiled["guidance"].spec == compiled["xgrammar"].spec


def test_new_matcher_counts_requests_by_kind(managers):
    manager = managers["xgrammar"]
    before = dict(manager.requests_by_kind)
    manager.new_matcher(StructuredOutputsParams(regex="a+"))
    manager.new_matcher(StructuredOutputsParams(regex="a+"))
    manager.new_matcher(StructuredOutputsParams(choice=["x"]))
    assert manager.requests_by_kind["regex"] == before.get("regex", 0) + 2
    assert manager.requests_by_kind["choice"] == before.get("choice", 0) + 1


# ---------------------------------------------------------------- bad constraints

TOOL_BAD_SCHEMA = {"tools": [{"name": "f", "parameters": {"type": "objec"}}]}
TOOL_NOT = {"tools": [{"name": "f", "parameters": {"type": "object",
                                                   "properties": {"x": {"not": {"type": "string"}}}}}]}

# (id, StructuredOutputsParams kwargs, expected kind, regex the reason must match on every backend)
BAD_CONSTRAINTS = [
    ("json_text_not_json", {"json": "{not json"}, "json", r"not valid JSON"),
    ("schema_not_object", {"json": "[1, 2]"}, "json", r"must be a JSON object.*list"),
    ("schema_bad_type", {"json": {"type": "objec"}}, "json", r"objec"),
    ("schema_dangling_ref", {"json": {"$ref": "#/nope"}}, "json", r"nope"),
    ("schema_dangling_ref_nested", {"json": {"type": "object", "additionalProperties": {"$ref": "#/$defs/gone"}}},
     "json", r"gone"),
    ("keyword_not", {"json": {"not": {"type": "string"}}}, "json", r"\bnot\b"),
    ("keyword_not_nested", {"json": {"type": "object", "properties": {"x": {"not": {"type": "string"}}}}},
     "json", r"\bnot\b"),
    ("keyword_oneOf", {"json": {"oneOf": [{"type": "integer"}, {"type": "number"}]}}, "json", r"oneOf"),
    ("keyword_if", {"json": {"type": "integer", "if": {"minimum": 3}, "then": {"maximum": 5}}}, "json", r"\bif\b"),
    ("keyword_uniqueItems", {"json": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}},
     "json", r"uniqueItems"),
    ("keyword_dependentRequired", {"json": {"type": "object", "properties": {"a": {"type": "integer"}},
                                            "dependentRequired": {"a": ["b"]}}}, "json", r"dependentRequired"),
    ("keyword_contains", {"json": {"type": "array", "contains": {"type": "integer"}}}, "json", r"contains"),
    ("unknown_format", {"json": {"type": "string", "format": "iban"}}, "json", r"iban"),
    ("regex_unclosed_group", {"regex": "(ab"}, "regex", r"(?i)unclosed|not closed"),
    ("regex_lookbehind", {"regex": "a(?<=b)"}, "regex", r"(?i)look"),
    ("gbnf_undefined_rule", {"grammar": 'root ::= "a" undefined_rule'}, "grammar", r"undefined_rule"),
    ("gbnf_unclosed_group", {"grammar": 'root ::= ("a"'}, "grammar", r"(?i)expect(ed)? '?\)"),
    ("lark_unknown_rule", {"grammar": "start: missing_rule"}, "grammar", r"missing_rule"),
    ("lark_unclosed_group", {"grammar": 'start: ("a"'}, "grammar", r"(?i)expected.*'?\)"),
    ("pattern_look_around", {"json": {"type": "string", "pattern": "^(?!a)[a-z]+$"}}, "json", r"(?i)look"),
    ("tool_calls_bad_parameters", {"tool_calls": TOOL_BAD_SCHEMA}, "tool_calls", r"objec"),
    ("tool_calls_unenforceable_parameters", {"tool_calls": TOOL_NOT}, "tool_calls", r"\bnot\b"),
    ("tool_calls_no_tools", {"tool_calls": {"tools": []}}, "tool_calls", r"at least one tool"),
]


@pytest.mark.parametrize("case_id,kwargs,kind,reason", BAD_CONSTRAINTS, ids=[c[0] for c in BAD_CONSTRAINTS])
def test_bad_constraint_is_refused_naming_kind_and_problem(managers, backend, case_id, kwargs, kind, reason):
    params = StructuredOutputsParams(**kwargs)
    with pytest.raises(ConstraintError) as info:
        managers[backend].compile(params)
    assert isinstance(info.value, ValueError)
    assert info.value.kind == kind
    assert re.search(reason, info.value.reason), info.value.reason
    assert str(info.value).startswith(f"invalid {kind} constraint: ")


def test_xgrammar_refuses_multiple_of_on_numbers_guidance_enforces_it(managers, tokenizer, eos_id):
    params = StructuredOutputsParams(json={"type": "number", "multipleOf": 0.5})
    with pytest.raises(ConstraintError, match="multipleOf"):
        managers["xgrammar"].compile(params)
    guidance = managers["guidance"]
    compiled = guidance.compile(params)
    assert walks_to_completion(guidance.backend, compiled, tokenizer, "2.5", eos_id)
    assert not walks_to_completion(guidance.backend, compiled, tokenizer, "2.25", eos_id)


def test_xgrammar_names_the_refused_keyword_and_its_place(managers):
    with pytest.raises(ConstraintError) as info:
        managers["xgrammar"].compile(StructuredOutputsParams(
            json={"type": "object", "properties": {"x": {"type": "array", "uniqueItems": True}}}))
    assert "'uniqueItems'" in info.value.reason and "#/properties/x" in info.value.reason
    assert "xgrammar" in info.value.reason


# ---------------------------------------------------------------- the xgrammar whitelist is honest

# keyword -> (schema, a valid compact output, an output that violates only that keyword)
KEYWORD_CASES = {
    "type": ({"type": "integer"}, "12", '"12"'),
    "enum": ({"enum": ["a", 1]}, "1", '"b"'),
    "const": ({"const": "x"}, '"x"', '"y"'),
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "boolean"}]}, "true", '"s"'),
    "$ref": ({"$defs": {"p": {"type": "integer"}}, "$ref": "#/$defs/p"}, "3", "true"),
    "$defs": ({"type": "object", "properties": {"a": {"$ref": "#/$defs/p"}}, "required": ["a"],
               "$defs": {"p": {"type": "integer", "maximum": 5}}}, '{"a":5}', '{"a":6}'),
    "definitions": ({"type": "object", "properties": {"a": {"$ref": "#/definitions/p"}}, "required": ["a"],
                     "definitions": {"p": {"type": "string", "maxLength": 1}}}, '{"a":"z"}', '{"a":"zz"}'),
    "properties": ({"type": "object", "properties": {"a": {"type": "integer"}}}, '{"a":1}', '{"a":"x"}'),
    "required": ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, '{"a":1}', "{}"),
    "additionalProperties": ({"type": "object", "properties": {"a": {"type": "integer"}},
                              "additionalProperties": {"type": "integer"}}, '{"a":1,"b":2}', '{"a":1,"b":"x"}'),
    "patternProperties": ({"type": "object", "patternProperties": {"^x[0-9]$": {"type": "integer"}}},
                          '{"x1":1}', '{"x1":"s"}'),
    "propertyNames": ({"type": "object", "additionalProperties": {"type": "integer"},
                       "propertyNames": {"pattern": "^[a-z]+$"}}, '{"ab":1}', '{"A1":1}'),
    "unevaluatedProperties": ({"type": "object", "properties": {"a": {"type": "integer"}},
                               "unevaluatedProperties": {"type": "string"}}, '{"a":1,"b":"s"}', '{"a":1,"b":2}'),
    "minProperties": ({"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2},
                      '{"a":1,"b":2}', '{"a":1}'),
    "maxProperties": ({"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 1},
                      '{"a":1}', '{"a":1,"b":2}'),
    "items": ({"type": "array", "items": {"type": "integer"}}, "[1,2]", '[1,"a"]'),
    "prefixItems": ({"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}]}, '["a",1]', "[1,1]"),
    "unevaluatedItems": ({"type": "array", "prefixItems": [{"type": "integer"}],
                          "unevaluatedItems": {"type": "string"}},
                         '[1,"a"]', "[1,2]"),
    "minItems": ({"type": "array", "items": {"type": "integer"}, "minItems": 2}, "[1,2]", "[1]"),
    "maxItems": ({"type": "array", "items": {"type": "integer"}, "maxItems": 2}, "[1,2]", "[1,2,3]"),
    "minLength": ({"type": "string", "minLength": 3}, '"abc"', '"ab"'),
    "maxLength": ({"type": "string", "maxLength": 3}, '"abc"', '"abcd"'),
    "pattern": ({"type": "string", "pattern": "^[a-c]+$"}, '"abc"', '"abd"'),
    "minimum": ({"type": "integer", "minimum": 5}, "5", "4"),
    "maximum": ({"type": "integer", "maximum": 5}, "5", "6"),
    "exclusiveMinimum": ({"type": "integer", "exclusiveMinimum": 5}, "6", "5"),
    "exclusiveMaximum": ({"type": "integer", "exclusiveMaximum": 5}, "4", "5"),
    "multipleOf": ({"type": "integer", "multipleOf": 3}, "9", "10"),
    "format": ({"type": "string", "format": "uuid"}, '"123e4567-e89b-12d3-a456-426614174000"', '"123e4567"'),
}
# more (keyword, schema, valid, invalid) cases of a keyword on other types; xgrammar may refuse these
# (it refuses multipleOf on numbers, which it would otherwise drop with a log warning)
EXTRA_KEYWORD_CASES = [
    ("minimum", {"type": "number", "minimum": 1.5}, "2.25", "1.25"),
    ("exclusiveMaximum", {"type": "number", "exclusiveMaximum": 1}, "0.5", "1.0"),
    ("multipleOf", {"type": "number", "multipleOf": 0.5}, "1.5", "1.25"),
    ("additionalProperties",
     {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False},
     '{"a":1}', '{"a":1,"b":2}'),
    ("enum", {"type": "object", "properties": {"c": {"enum": ["red", "green"]}}, "required": ["c"]},
     '{"c":"red"}', '{"c":"blue"}'),
]
FORMAT_CASES = {
    "email": ('"a.b@example.com"', '"a.b.example.com"'),
    "time": ('"12:30:00Z"', '"12h30"'),
    "duration": ('"P3D"', '"3 days"'),
    "uuid": ('"123e4567-e89b-12d3-a456-426614174000"', '"123e4567-e89b"'),
    "ipv6": ('"2001:db8::1"', '"2001:db8:::1:2:3:4:5:6:7"'),
    "hostname": ('"example.com"', '"exa mple.com"'),
    "uri": ('"https://example.com/a?b=c"', '"no scheme here"'),
    "uri-reference": ('"/a/b?c=d"', '"a b"'),
    "json-pointer": ('"/a/b"', '"a/b"'),
}
# (keyword, schema, valid, invalid, xgrammar must compile it)
HONESTY_CASES = (
    [(k, s, v, i, True) for k, (s, v, i) in KEYWORD_CASES.items()]
    + [(*case, False) for case in EXTRA_KEYWORD_CASES]
    + [(f"format={f}", {"type": "string", "format": f}, v, i, True) for f, (v, i) in FORMAT_CASES.items()]
)
_FORMAT_CHECKER = jsonschema.Draft202012Validator.FORMAT_CHECKER


def test_honesty_table_covers_the_whole_whitelist():
    assert set(KEYWORD_CASES) == XGRAMMAR_KEYWORDS - ANNOTATION_KEYWORDS
    assert set(FORMAT_CASES) == XGRAMMAR_FORMATS


@pytest.mark.parametrize("keyword,schema,valid,invalid,xgrammar_compiles", HONESTY_CASES,
                         ids=[f"{c[0]}-{n}" for n, c in enumerate(HONESTY_CASES)])
def test_schema_table_is_right_by_jsonschema(keyword, schema, valid, invalid, xgrammar_compiles):
    """The table itself: ``valid`` satisfies the schema and ``invalid`` does not (formats jsonschema
    can check here only)."""
    validator = jsonschema.Draft202012Validator(schema, format_checker=_FORMAT_CHECKER)
    assert validator.is_valid(json.loads(valid))
    fmt = schema.get("format")
    if fmt is None or fmt in _FORMAT_CHECKER.checkers:
        assert not validator.is_valid(json.loads(invalid))


@pytest.mark.parametrize("keyword,schema,valid,invalid,xgrammar_compiles", HONESTY_CASES,
                         ids=[f"{c[0]}-{n}" for n, c in enumerate(HONESTY_CASES)])
def test_keyword_is_enforced_or_refused(managers, tokenizer, eos_id, backend, keyword, schema, valid, invalid,
                                        xgrammar_compiles):
    """xgrammar must compile every whitelisted keyword and refuse its violations; either backend may
    refuse a schema, but never accept it and ignore a keyword."""
    manager = managers[backend]
    try:
        compiled = manager.compile(StructuredOutputsParams(json=schema))
    except ConstraintError:
        if backend == "xgrammar" and xgrammar_compiles:
            raise
        return
    assert walks_to_completion(manager.backend, compiled, tokenizer, valid, eos_id), f"valid {valid!r} refused"
    assert not walks_to_completion(manager.backend, compiled, tokenizer, invalid, eos_id), (
        f"{backend} accepted {invalid!r}, which violates {keyword}")


# Keywords in combination: (id, schema, a valid output or None when the schema is unsatisfiable, an
# output that violates it). Each keyword is whitelisted alone; these check they survive together.
COMBINATION_CASES = [
    ("format_with_maxLength", {"type": "string", "format": "email", "maxLength": 8},
     '"a@b.co"', '"abcdef@example.com"'),
    ("format_with_minLength", {"type": "string", "format": "email", "minLength": 12},
     '"abc@example.com"', '"a@b.co"'),
    ("format_unsatisfiable_maxLength", {"type": "string", "format": "uuid", "maxLength": 10},
     None, '"123e4567-e89b-12d3-a456-426614174000"'),
    ("pattern_with_maxLength", {"type": "string", "pattern": "^a+$", "maxLength": 3}, '"aa"', '"aaaa"'),
    ("pattern_with_minLength", {"type": "string", "pattern": "^[a-z]+$", "minLength": 3}, '"abc"', '"ab"'),
    ("enum_with_maxLength", {"type": "string", "enum": ["aa", "bbbb"], "maxLength": 2}, '"aa"', '"bbbb"'),
    ("enum_with_pattern", {"type": "string", "pattern": "^[a-z]+$", "enum": ["ab", "CD"]}, '"ab"', '"CD"'),
    ("enum_with_type", {"type": "string", "enum": ["a", 1]}, '"a"', "1"),
    ("const_with_type", {"type": "string", "const": 1}, None, "1"),
    ("anyOf_branches_without_type", {"type": "integer", "anyOf": [{"minimum": 5}, {"maximum": -5}]}, "7", "0"),
    ("anyOf_with_sibling", {"anyOf": [{"type": "string", "maxLength": 2}], "minLength": 2}, '"ab"', '"a"'),
    ("ref_with_sibling", {"$defs": {"p": {"type": "integer"}}, "$ref": "#/$defs/p", "maximum": 3}, "2", "4"),
    ("required_without_properties", {"type": "object", "required": ["a"]}, '{"a":1}', "{}"),
    ("required_beyond_properties", {"type": "object", "properties": {"a": {"type": "integer"}},
                                    "required": ["a", "b"]}, '{"a":1,"b":true}', '{"a":1}'),
    ("required_in_anyOf", {"type": "object", "properties": {"a": {"type": "integer"}},
                           "anyOf": [{"required": ["a"]}], "unevaluatedProperties": False}, '{"a":1}', "{}"),
    ("date_day_of_month", {"type": "string", "format": "date"}, '"2024-02-29"', '"2024-02-30"'),
    ("ipv4_leading_zero", {"type": "string", "format": "ipv4"}, '"1.2.3.4"', '"01.2.3.4"'),
    # these hold on both backends
    ("prefixItems_items_maxItems", {"type": "array", "prefixItems": [{"type": "integer"}],
                                    "items": {"type": "string"}, "maxItems": 2}, '[1,"a"]', '[1,"a","b"]'),
    ("properties_with_patternProperties", {"type": "object", "properties": {"a": {"type": "integer"}},
                                           "patternProperties": {"^b$": {"type": "string"}}},
     '{"a":1,"b":"x"}', '{"a":1,"b":2}'),
    ("multipleOf_with_range", {"type": "integer", "minimum": -2, "maximum": 2, "multipleOf": 2}, "-2", "1"),
    ("minItems_equals_maxItems", {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 1},
     "[1]", "[1,2]"),
]
# xgrammar 0.2 compiles the first 17 cases but drops a whitelisted keyword when it sits beside
# another one, or approximates the format; schema_check refuses them on xgrammar
# (``_check_xgrammar_combination``, XGRAMMAR_FORMATS), llguidance enforces them.
XGRAMMAR_REFUSES = {
    "format_with_maxLength", "format_with_minLength", "format_unsatisfiable_maxLength", "pattern_with_maxLength",
    "pattern_with_minLength", "enum_with_maxLength", "enum_with_pattern", "enum_with_type", "const_with_type",
    "anyOf_branches_without_type", "anyOf_with_sibling", "ref_with_sibling", "required_without_properties",
    "required_beyond_properties", "required_in_anyOf", "date_day_of_month", "ipv4_leading_zero",
}
COMBINATION_PARAMS = [
    pytest.param(name, case_id, schema, valid, invalid, id=f"{name}-{case_id}")
    for case_id, schema, valid, invalid in COMBINATION_CASES for name in BACKENDS
]


def test_xgrammar_refuses_the_combinations_it_would_drop(managers):
    for case_id, schema, _valid, _invalid in COMBINATION_CASES:
        if case_id in XGRAMMAR_REFUSES:
            with pytest.raises(ConstraintError):
                managers["xgrammar"].compile(StructuredOutputsParams(json=schema))


@pytest.mark.parametrize("case_id,schema,valid,invalid", [c[:4] for c in COMBINATION_CASES],
                         ids=[c[0] for c in COMBINATION_CASES])
def test_combination_table_is_right_by_jsonschema(case_id, schema, valid, invalid):
    validator = jsonschema.Draft202012Validator(schema, format_checker=_FORMAT_CHECKER)
    assert valid is None or validator.is_valid(json.loads(valid))
    assert not validator.is_valid(json.loads(invalid))


@pytest.mark.parametrize("backend_name,case_id,schema,valid,invalid", COMBINATION_PARAMS)
def test_keywords_in_combination_are_enforced_or_refused(managers, tokenizer, eos_id, backend_name, case_id, schema,
                                                         valid, invalid):
    manager = managers[backend_name]
    try:
        compiled = manager.compile(StructuredOutputsParams(json=schema))
    except ConstraintError:
        return  # refused: fine
    if valid is not None:
        assert walks_to_completion(manager.backend, compiled, tokenizer, valid, eos_id), f"valid {valid!r} refused"
    assert not walks_to_completion(manager.backend, compiled, tokenizer, invalid, eos_id), (
        f"{backend_name} accepted {invalid!r}, which violates {json.dumps(schema)}")


# ---------------------------------------------------------------- apply_token_bitmask_

def reference_apply(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Per-token Python: token t of row rows[k] survives iff bit t % 32 of word t // 32 of bitmask[k] is set."""
    out = logits.clone()
    words = bitmask.tolist()
    for k, row in enumerate(rows):
        for t in range(logits.shape[1]):
            if not ((words[k][t // 32] & 0xFFFFFFFF) >> (t % 32)) & 1:
                out[row, t] = float("-inf")
    return out


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 95, 100, 257])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_token_bitmask_matches_per_token_reference(vocab, dtype):
    gen = torch.Generator().manual_seed(vocab)
    rng = random.Random(vocab)
    batch = 7
    num_words = (vocab + 31) // 32
    logits = torch.randn(batch, vocab, generator=gen).to(dtype)
    rows = rng.sample(range(batch), 4)  # distinct, unsorted
    bitmask = torch.randint(-(2**31), 2**31, (len(rows), num_words), dtype=torch.int32, generator=gen)
    bitmask[0, :] = 0
    bitmask[0, 0] = -(2**31)  # bit 31 alone (the sign bit): token 31 only
    bitmask[1, :] = -1  # everything allowed
    bitmask[2, 0] |= -(2**31)  # bit 31 together with others
    want = reference_apply(logits, bitmask, rows)
    got = logits.clone()
    apply_token_bitmask_(got, bitmask, torch.tensor(rows, dtype=torch.int64))
    assert torch.equal(got, want)
    untouched = [r for r in range(batch) if r not in rows]
    assert torch.equal(got[untouched], logits[untouched])
    assert torch.equal(got[rows[1]], logits[rows[1]])
    if vocab > 31:
        assert got[rows[0], 31] == logits[rows[0], 31] and torch.isinf(got[rows[0], :31]).all()


def test_unpack_bitmask_matches_reference():
    gen = torch.Generator().manual_seed(0)
    vocab = 70
    bitmask = torch.randint(-(2**31), 2**31, (5, 3), dtype=torch.int32, generator=gen)
    got = unpack_bitmask(bitmask, vocab)
    assert got.shape == (5, vocab) and got.dtype == torch.bool
    words = bitmask.tolist()
    want = [[bool(((words[r][t // 32] & 0xFFFFFFFF) >> (t % 32)) & 1) for t in range(vocab)] for r in range(5)]
    assert got.tolist() == want


def test_apply_token_bitmask_with_no_rows_is_a_no_op():
    logits = torch.randn(3, 40)
    before = logits.clone()
    apply_token_bitmask_(logits, torch.zeros((0, 2), dtype=torch.int32), torch.zeros(0, dtype=torch.int64))
    assert torch.equal(logits, before)


# ---------------------------------------------------------------- the manager's batch fill

def fake_request(grammar, num_computed: int, num_tokens: int) -> SimpleNamespace:
    return SimpleNamespace(grammar=grammar, num_computed_tokens=num_computed, num_tokens=num_tokens)


# VOCAB_SIZE + 3: logits wider than the tokenizer, and V % 32 != 0
@pytest.mark.parametrize("vocab_size", [VOCAB_SIZE, VOCAB_SIZE + 3])
def test_start_bitmask_fills_sampling_constrained_rows_with_only_stop_flags(tokenizer, eos_id, backend, vocab_size):
    manager = StructuredOutputManager(StructuredOutputsConfig(backend=backend), tokenizer, vocab_size, {eos_id})
    try:
        params = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "boolean"}},
                                               "required": ["a"], "additionalProperties": False})
        fresh, done, half = manager.new_matcher(params), manager.new_matcher(params), manager.new_matcher(params)
        for token in encode(tokenizer, '{"a":true}'):
            assert done.accept_token(token)
        for token in encode(tokenizer, '{"a":'):
            assert half.accept_token(token)
        requests = [
            fake_request(None, 0, 10),  # unconstrained
            fake_request(fresh, 3, 10),  # constrained, mid chunked prefill: does not sample
            fake_request(fresh, 0, 10),  # constrained, samples
            fake_request(done, 12, 13),  # complete: only EOS
            fake_request(half, 12, 17),  # prefill ends this step and samples
        ]
        steps = manager.mask_steps_total
        grammar_bitmask = manager.start_bitmask(requests, [10, 4, 10, 1, 5])
        assert grammar_bitmask.req_indices == [2, 3, 4]
        bitmask, only_stop, allows_none = grammar_bitmask.result()
        assert bitmask.shape == (3, (vocab_size + 31) // 32) and bitmask.dtype == np.int32
        assert only_stop.tolist() == [False, True, False]
        assert allows_none.tolist() == [False, False, False]
        allowed = unpack_bitmask(torch.from_numpy(bitmask), vocab_size)
        assert allowed[1].nonzero().flatten().tolist() == [eos_id]
        assert not allowed[0, eos_id] and allowed[0, encode(tokenizer, '{"a":true}')[0]]
        assert allowed[2, encode(tokenizer, "true")[0]] and not allowed[2, eos_id]
        if vocab_size % 32:  # no bit past the vocabulary
            assert (bitmask[:, -1].view(np.uint32) >> np.uint32(vocab_size % 32)).tolist() == [0, 0, 0]
        assert manager.mask_steps_total == steps + 1 and manager.mask_rows_total >= 3
        assert manager.mask_seconds_total > 0
        assert manager.start_bitmask([requests[0], requests[1]], [10, 4]) is None  # nothing constrained samples
    finally:
        manager.close()


class _ScriptedBackend(StructuredOutputBackend):
    """Writes given bitmask rows, to test the manager's flags on exact bit patterns."""

    name = "scripted"

    def __init__(self, vocab_size: int, rows: list[list[int]]) -> None:
        super().__init__(vocab_size)
        self.rows = rows

    def compile(self, kind, spec):  # pragma: no cover - not used
        raise NotImplementedError

    def new_matcher(self, compiled):  # pragma: no cover - not used
        raise NotImplementedError

    def fill_bitmask(self, matchers, bitmask):
        for i, row in enumerate(self.rows):
            bitmask[i] = np.array(row, dtype=np.int64).astype(np.int32)


def test_only_stop_and_allows_none_on_exact_bit_patterns(monkeypatch):
    vocab, eos = 70, {31, 64}  # token 31 is the sign bit of word 0
    rows = [
        [0, 0, 0],  # nothing allowed: a matcher error
        [-(2**31), 0, 1],  # both EOS tokens only
        [-(2**31), 0, 0],  # one EOS token only
        [-(2**31) | 1, 0, 0],  # EOS and token 0
        [0, 0, 2],  # token 65 only
        [-1, -1, 0x3F],  # everything
    ]
    monkeypatch.setattr(manager_module, "_build_backend", lambda *args: _ScriptedBackend(vocab, rows))
    manager = StructuredOutputManager(StructuredOutputsConfig(), tokenizer=None, vocab_size=vocab, eos_token_ids=eos)
    try:
        requests = [fake_request(object(), 0, 1) for _ in rows]
        _, only_stop, allows_none = manager.start_bitmask(requests, [1] * len(rows)).result()
        assert only_stop.tolist() == [False, True, True, False, False, False]
        assert allows_none.tolist() == [True, False, False, False, False, False]
    finally:
        manager.close()
