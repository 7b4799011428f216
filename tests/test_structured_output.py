"""Structured outputs end to end: the embedded SmolLM2-135M-Instruct through ``LLM``, once per backend
(llguidance, xgrammar).

Proves: sampled outputs (temperature 1, 20 seeds, 8 JSON schemas) always parse and validate and end
with ``stop``; choice, regex, GBNF and Lark grammars, json_object; constrained and unconstrained
requests batched together under chunked prefill and recompute preemption give each request exactly
the tokens it gets alone (deterministic mode), so unconstrained rows pay nothing in correctness;
``n > 1`` gives each sequence its own matcher; logit bias, penalties, top-k/top-p and ``min_tokens``
cannot push an output out of its constraint; ``max_tokens`` still cuts (``length``); an invalid
constraint is refused before anything is queued and leaks nothing; the manager's metrics move.

The engines load the embedded GGUF's weights from a safetensors copy written once per module with
tokenmill's own GGUF reader (the very tensors ``LLM()`` loads): parsing the GGUF takes ~25 s, and
this module builds six engines.
"""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.models.default_model import default_model_path
from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.structured_output import ConstraintError

SEEDS = range(20)
MAX_TOKENS = 200
# One thread per engine: on a shared 2-core machine, two OpenMP threads per step wait on each other
# whenever another process holds a core (measured: the mixed-batch test took 210 s with 2 threads
# under such load, 17 s with 1).
NUM_THREADS = 1

SCHEMAS: dict[str, tuple[dict, str]] = {
    "person": ({
        "type": "object",
        "properties": {"name": {"type": "string", "pattern": "^[A-Z][a-z]{1,9}$"},
                       "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"], "additionalProperties": False,
    }, "Give a person's name and age as JSON."),
    "nested": ({
        "type": "object",
        "properties": {
            "user": {"type": "object",
                     "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99},
                                    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                             "minItems": 1, "maxItems": 2}},
                     "required": ["id", "tags"], "additionalProperties": False},
            "on": {"type": "boolean"},
        },
        "required": ["user", "on"], "additionalProperties": False,
    }, "Describe a user account as JSON."),
    "enums": ({
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": ["S", "M", "L", "XL"]},
                       "count": {"const": 1}},
        "required": ["color", "size", "count"], "additionalProperties": False,
    }, "Pick a T-shirt colour and size as JSON."),
    "optional": ({
        "type": "object",
        "properties": {"title": {"type": "string", "minLength": 1, "maxLength": 24},
                       "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
                       "rating": {"type": "integer", "minimum": 0, "maximum": 10}},
        "required": ["title"], "additionalProperties": False,
    }, "Name a film as JSON, with its year and rating if you know them."),
    "numbers": ({
        "type": "object",
        "properties": {"x": {"type": "number", "minimum": -100, "maximum": 100},
                       "p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
                       "n": {"type": "integer", "minimum": -5, "exclusiveMaximum": 6}},
        "required": ["x", "p", "n"], "additionalProperties": False,
    }, "Give three numbers x, p and n as JSON."),
    "array": ({
        "type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 12}, "minItems": 2, "maxItems": 4,
    }, "List a few fruits as a JSON array."),
    "any_of": ({
        "type": "object",
        "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 100},
                                           {"type": "string", "maxLength": 10}, {"type": "null"}]}},
        "required": ["value"], "additionalProperties": False,
    }, "Give any value as JSON."),
    "refs": ({
        "$defs": {"point": {"type": "object",
                            "properties": {"x": {"type": "integer", "minimum": -10, "maximum": 10},
                                           "y": {"type": "integer", "minimum": -10, "maximum": 10}},
                            "required": ["x", "y"], "additionalProperties": False}},
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"], "additionalProperties": False,
    }, "Give a line segment's start and end points as JSON."),
}
CHOICES = ["Paris", "London", "Berlin", "Madrid", "Rome"]
REGEX = r"[A-Z]{2}-\d{3}( (red|blue))?"
GBNF = 'root ::= "The answer is " digit digit? "."\ndigit ::= [0-9]'
GBNF_RE = r"The answer is \d\d?\."
LARK = 'start: greeting " " NAME "!"\ngreeting: "Hello" | "Hi"\nNAME: /[A-Z][a-z]{1,8}/'
LARK_RE = r"(Hello|Hi) [A-Z][a-z]{1,8}!"
NICKNAME_SCHEMA = {
    "type": "object",
    "properties": {"nickname": {"type": "string", "minLength": 3, "maxLength": 16},
                   "lucky": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["nickname", "lucky"], "additionalProperties": False,
}
FLAG_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
               "additionalProperties": False}


def chat(content: str) -> list[dict]:
    return [{"role": "system", "content": "Reply briefly."}, {"role": "user", "content": content}]


def json_params(schema: dict, **kwargs) -> SamplingParams:
    kwargs.setdefault("max_tokens", MAX_TOKENS)
    return SamplingParams(structured_outputs=StructuredOutputsParams(json=schema), **kwargs)


def assert_valid_json(completion, schema: dict) -> None:
    assert completion.finish_reason == "stop", (completion.finish_reason, completion.text)
    value = json.loads(completion.text)
    jsonschema.validate(value, schema)


# ---------------------------------------------------------------- engines

@pytest.fixture(scope="module")
def smollm2_dir() -> str:
    """The embedded GGUF (its dequantized tensors and tokenizer come from the per-machine GGUF cache)."""
    return str(default_model_path())


@pytest.fixture(scope="module", params=["guidance", "xgrammar"])
def backend(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def llm(smollm2_dir, backend):
    engine = LLM(model=smollm2_dir, dtype="float32", max_model_len=512, num_kv_blocks=3000, block_size=8,
                 max_num_seqs=256, max_num_batched_tokens=2048, num_threads=NUM_THREADS,
                 structured_outputs_config={"backend": backend})
    assert engine.engine.structured_output_manager.backend.name == backend
    yield engine
    engine.close()


def batch_requests(tokenizer) -> dict[str, list[tuple[list[dict], SamplingParams]]]:
    """Every sampled-output check's requests, by group name."""
    groups: dict[str, list[tuple[list[dict], SamplingParams]]] = {}
    for name, (schema, prompt) in SCHEMAS.items():
        groups[f"json:{name}"] = [(chat(prompt), json_params(schema, temperature=1.0, seed=s)) for s in SEEDS]
    groups["choice"] = [(chat("Name a European capital city."), SamplingParams(
        temperature=1.0, seed=s, max_tokens=20, structured_outputs=StructuredOutputsParams(choice=CHOICES)))
        for s in SEEDS]
    groups["regex"] = [(chat("Invent a product code like AB-123, optionally with a colour."), SamplingParams(
        temperature=1.0, seed=s, max_tokens=20, structured_outputs=StructuredOutputsParams(regex=REGEX)))
        for s in SEEDS]
    groups["lark"] = [(chat("Greet someone by name."), SamplingParams(
        temperature=1.0, seed=s, max_tokens=30, structured_outputs=StructuredOutputsParams(grammar=LARK)))
        for s in range(5)]
    groups["json_object"] = [(chat(prompt), SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=StructuredOutputsParams(json_object=True)))
        for prompt in ("Give a JSON object for a book with title and author.",
                       'Reply with the JSON object {"city": "Paris", "country": "France"}.')]
    groups["n3"] = [(chat("Invent a nickname and a lucky number, as JSON."),
                     json_params(NICKNAME_SCHEMA, n=3, temperature=1.0, seed=11))]
    # +100 on tokens the constraint forbids: end-of-sequence before the object is complete, and " Sure".
    eos = tokenizer.eos_token_id
    space_sure = tokenizer.encode(" Sure", add_special_tokens=False)[0]  # no space can appear in a person
    groups["bias_forbidden"] = [(chat(SCHEMAS["person"][1]), json_params(
        SCHEMAS["person"][0], temperature=1.0, seed=s, logit_bias={eos: 100.0, space_sure: 100.0})) for s in range(5)]
    maybe = tokenizer.encode("Maybe", add_special_tokens=False)[0]
    no = tokenizer.encode("No", add_special_tokens=False)[0]
    groups["bias_choice"] = [(chat("Is it raining?"), SamplingParams(
        temperature=1.0, seed=s, max_tokens=10, logit_bias={maybe: 100.0, no: 100.0},
        structured_outputs=StructuredOutputsParams(choice=["Yes", "No"]))) for s in range(5)]
    groups["min_tokens"] = [
        (chat("Is it ok? Answer as JSON."), json_params(FLAG_SCHEMA, temperature=1.0, seed=3, min_tokens=60)),
        (chat("Name a European capital city."), SamplingParams(
            temperature=1.0, seed=4, max_tokens=50, min_tokens=40,
            structured_outputs=StructuredOutputsParams(choice=CHOICES))),
    ]
    groups["max_tokens"] = [(chat(SCHEMAS["nested"][1]), json_params(SCHEMAS["nested"][0], temperature=0.0,
                                                                     max_tokens=4))]
    return groups


@pytest.fixture(scope="module")
def batch(llm) -> dict[str, list]:
    """The requests of ``batch_requests``, all in one ``llm.chat`` call: group name -> RequestOutputs."""
    groups = batch_requests(llm.engine.tokenizer)
    conversations, params, spans = [], [], {}
    for name, items in groups.items():
        spans[name] = (len(params), len(params) + len(items))
        conversations += [c for c, _ in items]
        params += [p for _, p in items]
    # Saves test time only: each distinct prompt once first, so the batch reuses its cached KV blocks.
    distinct = list({json.dumps(c): c for c in conversations}.values())
    llm.chat(distinct, SamplingParams(temperature=0.0, max_tokens=1))
    outputs = llm.chat(conversations, params)
    assert len(outputs) == len(params)
    assert not llm.engine.has_unfinished_requests()
    llm.engine.check_integrity()
    return {name: outputs[a:b] for name, (a, b) in spans.items()}


# ---------------------------------------------------------------- sampled outputs are always valid

@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_outputs_validate_over_20_seeds(batch, name):
    schema = SCHEMAS[name][0]
    outputs = batch[f"json:{name}"]
    assert len(outputs) == len(SEEDS)
    for out in outputs:
        completion = out.outputs[0]
        assert_valid_json(completion, schema)
        assert len(completion.token_ids) < MAX_TOKENS // 2
    # temperature 1 explores: not every seed gives the same text (enums-only schemas included)
    assert len({o.outputs[0].text for o in outputs}) > 1


def whitespace_outside_strings(text: str) -> list[int]:
    """Positions of whitespace characters outside JSON string literals."""
    found, in_string, escaped = [], False, False
    for i, c in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in " \t\n\r":
            found.append(i)
    return found


def test_json_is_compact(batch):
    """Both backends force the compact separators (no whitespace outside strings)."""
    assert whitespace_outside_strings('{"a b": [1, 2]}') == [7, 11]
    for name in SCHEMAS:
        for out in batch[f"json:{name}"]:
            assert whitespace_outside_strings(out.outputs[0].text) == [], out.outputs[0].text


def test_how_outputs_end_per_backend(batch, backend, llm):
    """llguidance stops as soon as nothing can follow; xgrammar samples end-of-sequence."""
    eos = llm.engine.tokenizer.eos_token_id
    for name in SCHEMAS:
        for out in batch[f"json:{name}"]:
            assert (out.outputs[0].token_ids[-1] == eos) == (backend == "xgrammar"), out.outputs[0].token_ids


def test_choice_outputs_exactly_one_choice(batch):
    texts = [o.outputs[0].text for o in batch["choice"]]
    assert all(t in CHOICES for t in texts), texts
    assert all(o.outputs[0].finish_reason == "stop" for o in batch["choice"])
    assert len(set(texts)) > 1


def test_regex_outputs_fullmatch(batch):
    texts = [o.outputs[0].text for o in batch["regex"]]
    assert all(re.fullmatch(REGEX, t) for t in texts), texts
    assert all(o.outputs[0].finish_reason == "stop" for o in batch["regex"])


def test_lark_grammar_outputs_match(batch):
    for out in batch["lark"]:
        assert re.fullmatch(LARK_RE, out.outputs[0].text), out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop"


def test_gbnf_grammar_outputs_match(llm):
    outs = llm.chat([chat("What is six times seven?")] * 5, [SamplingParams(
        temperature=1.0, seed=s, max_tokens=30, structured_outputs=StructuredOutputsParams(grammar=GBNF))
        for s in range(5)])
    for out in outs:
        assert re.fullmatch(GBNF_RE, out.outputs[0].text), out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop"


def test_json_object_output_is_an_object(batch):
    for out in batch["json_object"]:
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        assert isinstance(json.loads(completion.text), dict)
        assert whitespace_outside_strings(completion.text) == []


def test_n_3_sequences_are_each_valid_and_differ(batch):
    (out,) = batch["n3"]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for completion in out.outputs:
        assert_valid_json(completion, NICKNAME_SCHEMA)
    assert len({c.text for c in out.outputs}) == 3


# ---------------------------------------------------------------- sampling knobs cannot break the constraint

def test_logit_bias_toward_forbidden_tokens_cannot_break_json(batch, llm):
    space_sure = llm.engine.tokenizer.encode(" Sure", add_special_tokens=False)[0]
    for out in batch["bias_forbidden"]:
        assert_valid_json(out.outputs[0], SCHEMAS["person"][0])
        assert space_sure not in out.outputs[0].token_ids


def test_logit_bias_acts_within_the_allowed_tokens(batch):
    # "Maybe" is forbidden; "No" is allowed and pushed by +100, so every seed picks it
    assert [o.outputs[0].text for o in batch["bias_choice"]] == ["No"] * 5


def test_penalties_top_k_top_p_keep_json_valid(llm):
    # A call of its own: top-k/top-p and penalties make the sampler sort and penalise the whole batch.
    schema, prompt = SCHEMAS["nested"]
    knobs = [(1, 1.0), (3, 0.5), (0, 0.1), (50, 0.9), (2, 1.0)]  # (top_k, top_p); top_k 0 is off
    outs = llm.chat([chat(prompt)] * len(knobs), [json_params(
        schema, temperature=1.0, seed=s, repetition_penalty=1.8, presence_penalty=2.0, frequency_penalty=2.0,
        top_k=top_k, top_p=top_p) for s, (top_k, top_p) in enumerate(knobs)])
    for out in outs:
        assert_valid_json(out.outputs[0], schema)


def test_constraint_ends_the_output_before_min_tokens(batch):
    flag, city = batch["min_tokens"]
    assert_valid_json(flag.outputs[0], FLAG_SCHEMA)
    assert len(flag.outputs[0].token_ids) < 60
    assert city.outputs[0].text in CHOICES and city.outputs[0].finish_reason == "stop"
    assert len(city.outputs[0].token_ids) < 40


def test_max_tokens_too_small_finishes_length(batch):
    completion = batch["max_tokens"][0].outputs[0]
    assert completion.finish_reason == "length"
    assert len(completion.token_ids) == 4
    assert completion.text.startswith("{")
    with pytest.raises(ValueError):
        json.loads(completion.text)


# ---------------------------------------------------------------- errors and metrics

def test_invalid_constraint_is_refused_before_queueing_and_engine_keeps_working(llm):
    good = json_params(FLAG_SCHEMA, temperature=0.0)
    bad = json_params({"type": "object", "properties": {"x": {"not": {"type": "string"}}}})
    llm.engine.structured_output_manager.compile(good.structured_outputs)  # so the count below is order-independent
    cached = llm.engine.structured_output_manager.cache_size()
    with pytest.raises(ValueError) as info:  # the valid first request was queued, then withdrawn
        llm.generate(["Is it ok?", "Is it ok?"], [good, bad])
    assert isinstance(info.value, ConstraintError) and info.value.kind == "json"
    assert re.search(r"\bnot\b", info.value.reason)
    assert not llm.engine.has_unfinished_requests()
    assert not llm.engine.output_processor.parents
    assert llm.engine.structured_output_manager.cache_size() == cached
    llm.engine.check_integrity()
    out = llm.chat(chat("Is it ok? Answer as JSON."), good)[0].outputs[0]
    assert_valid_json(out, FLAG_SCHEMA)
    llm.engine.check_integrity()


def test_metrics_count_requests_and_mask_time(llm):
    manager = llm.engine.structured_output_manager
    json_before, regex_before = manager.requests_by_kind["json"], manager.requests_by_kind["regex"]
    seconds, steps = manager.mask_seconds_total, manager.mask_steps_total
    params = [json_params(FLAG_SCHEMA, temperature=1.0, seed=s) for s in range(3)]
    params.append(SamplingParams(temperature=0.0, max_tokens=10,
                                 structured_outputs=StructuredOutputsParams(regex=r"\d+")))
    params.append(SamplingParams(temperature=0.0, max_tokens=5))  # unconstrained: not counted
    llm.chat([chat("Is it ok? Answer as JSON.")] * 5, params)
    assert manager.requests_by_kind["json"] == json_before + 3
    assert manager.requests_by_kind["regex"] == regex_before + 1
    assert manager.mask_seconds_total > seconds > 0
    assert manager.mask_steps_total > steps


# ---------------------------------------------------------------- batched == alone, under preemption

def mixed_requests() -> list[tuple[list[dict], SamplingParams]]:
    """Constrained (seeded and greedy) and unconstrained (seeded, top-k, greedy) requests, one with a
    prompt long enough for two 64-token prefill chunks."""
    long_prompt = "Here is some context. " * 10
    return [
        (chat(SCHEMAS["person"][1]), json_params(SCHEMAS["person"][0], temperature=1.0, seed=1, max_tokens=40)),
        (chat("Tell me about the sea."), SamplingParams(temperature=0.8, seed=7, max_tokens=16)),
        (chat(long_prompt + SCHEMAS["enums"][1]), json_params(SCHEMAS["enums"][0], temperature=0.0, max_tokens=40)),
        (chat("Invent a product code."), SamplingParams(temperature=0.8, seed=2, max_tokens=20,
                                                          structured_outputs=StructuredOutputsParams(regex=REGEX))),
        (chat(long_prompt + "Write a poem."), SamplingParams(temperature=1.0, seed=9, top_k=20, max_tokens=16)),
        (chat("Name a European capital city."), SamplingParams(
            temperature=0.0, max_tokens=10, structured_outputs=StructuredOutputsParams(choice=CHOICES))),
        (chat("Why is the sky blue?"), SamplingParams(temperature=0.0, max_tokens=16)),
    ]


def test_mixed_batch_under_chunked_prefill_and_preemption_equals_each_request_alone(smollm2_dir, backend):
    common = {"model": smollm2_dir, "dtype": "float32", "deterministic": True, "block_size": 4, "max_model_len": 128,
              "num_threads": NUM_THREADS, "structured_outputs_config": {"backend": backend}}
    # 32 blocks of 4 = 128 token slots for 7 requests of ~25-100 tokens each; 64-token prefill chunks
    small = LLM(num_kv_blocks=32, max_num_batched_tokens=64, **common)
    ample = LLM(num_kv_blocks=1024, **common)
    try:
        requests = mixed_requests()
        batched = small.chat([c for c, _ in requests], [p for _, p in requests])
        assert small.engine.scheduler.num_preemptions_total > 0
        assert max(len(o.prompt_token_ids) for o in batched) > 64  # prefilled in more than one chunk
        assert not small.engine.has_unfinished_requests()
        small.engine.check_integrity()
        assert small.engine.kv_cache_manager.block_pool.num_free_blocks == 32
        for (conversation, params), got in zip(requests, batched):
            alone = ample.chat(conversation, params)[0].outputs[0]
            assert got.outputs[0].token_ids == alone.token_ids, (params, got.outputs[0].text, alone.text)
            assert got.outputs[0].finish_reason == alone.finish_reason
            constraint = params.structured_outputs
            if constraint is not None and constraint.json is not None:
                assert_valid_json(got.outputs[0], constraint.json)
        assert ample.engine.scheduler.num_preemptions_total == 0
    finally:
        small.close()
        ample.close()
