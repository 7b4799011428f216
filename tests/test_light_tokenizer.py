"""LightTokenizer (tokenmill/light_tokenizer.py) against transformers' tokenizer of the same saved files: the
same ids, texts, special tokens and rendered chat templates, for the embedded GGUF's tokenizer under several
chat templates (its own, a tool-calling one, one that trims contents)."""
from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys

import jinja2
import pytest
from transformers import PreTrainedTokenizerFast

from tests.tiny_models import smollm2_gguf_path, smollm2_tokenizer
from tokenmill.light_tokenizer import LightTokenizer, light_tokenizer_fits, open_light_tokenizer, transformers_tokenizer

# Templates written for these tests: tools through tojson, tool calls, raise_exception, a date, extra variables
TOOLS_TEMPLATE = """{{ bos_token }}{% if tools %}<tools>{{ tools | tojson(indent=2) }}</tools>
{% endif %}{% for m in messages %}{% if m.role == 'system' and not loop.first %}{{ raise_exception('system must come first') }}{% endif %}
<|im_start|>{{ m.role }}
{% if m.content is defined %}{{ m.content }}{% endif %}{% if m.tool_calls is defined %}{% for c in m.tool_calls %}<call>{{ c.function | tojson }}</call>{% endfor %}{% endif %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}{{ '' if strftime_now('%Y') else 'no date' }}"""
DOCS_TEMPLATE = """{% if documents is defined %}D{% endif %}{% if documents is none %}N{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"""
TRIM_TEMPLATE = """{% for m in messages %}[{{ m.role | upper }}] {{ m.content | trim }}{{ eos_token }}{% endfor %}{% if add_generation_prompt %}[ASSISTANT] {% endif %}"""


def save_as_qwen2(saved) -> None:
    """Make the tokenizer saved in ``saved`` a Qwen2Tokenizer one, as a Qwen2/Qwen3 GGUF's is cached (its
    pipeline stays the saved one: the first load's, llama.cpp's split for the file)."""
    config = saved / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "tokenizer_class": "Qwen2Tokenizer",
                                  "add_prefix_space": None}))


@pytest.fixture(scope="module", params=["own", "tools", "trim", "docs", "qwen2"])
def pair(request, tmp_path_factory):
    """(LightTokenizer, transformers tokenizer) of the embedded GGUF's saved tokenizer with one chat template,
    or saved as a Qwen2Tokenizer ("qwen2": transformers' fast class over the saved pipeline, as the first load
    served it)."""
    hf0 = transformers_tokenizer(smollm2_tokenizer())
    saved = tmp_path_factory.mktemp(f"tok-{request.param}")
    hf0.save_pretrained(str(saved))
    if request.param in ("tools", "trim", "docs"):
        template = {"tools": TOOLS_TEMPLATE, "trim": TRIM_TEMPLATE, "docs": DOCS_TEMPLATE}[request.param]
        (saved / "chat_template.jinja").write_text(template)
    if request.param == "qwen2":
        save_as_qwen2(saved)
    hf = PreTrainedTokenizerFast.from_pretrained(str(saved))
    light = open_light_tokenizer(saved)
    assert light is not None and light_tokenizer_fits(saved)
    return light, hf


def texts() -> list[str]:
    rng = random.Random(0)
    pieces = ["Hello", " world", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "\n", "  ", "é", "日本語", "🦙", "123",
              "def f(x):\n    return x", "\t", "'s", "<|im_start", "user", "I'M", "DON'T", " 12345", "\n\n", "ＡＢ", "ﬁ",
              "e\u0301", "!!\r\n", "x=1;"]
    return ["".join(rng.choice(pieces) for _ in range(rng.randint(0, 12))) for _ in range(60)] + [""]


def test_ids_texts_and_special_tokens_are_transformers(pair):
    light, hf = pair
    for text in texts():
        for add in (True, False):
            assert light.encode(text, add_special_tokens=add) == hf.encode(text, add_special_tokens=add), text
        ids = hf.encode(text)
        for skip in (True, False):
            assert light.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    ids = list(range(0, len(hf), 997)) + [len(hf) - 1]
    assert light.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
    assert light.convert_ids_to_tokens(5) == hf.convert_ids_to_tokens(5)
    assert light.convert_tokens_to_ids(["<|im_end|>", "no-such-token"]) == hf.convert_tokens_to_ids(
        ["<|im_end|>", "no-such-token"])
    assert light.batch_decode([[1, 2, 3], [4]]) == hf.batch_decode([[1, 2, 3], [4]])
    for name in ("bos_token", "eos_token", "unk_token", "pad_token", "bos_token_id", "eos_token_id", "unk_token_id",
                 "pad_token_id", "all_special_ids", "all_special_tokens", "special_tokens_map", "vocab_size",
                 "chat_template", "clean_up_tokenization_spaces", "model_max_length"):
        assert getattr(light, name) == getattr(hf, name), name
    assert len(light) == len(hf) and light.get_vocab() == hf.get_vocab()


CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3 <|im_end|>?"}],
    [{"role": "user", "content": "weather?"},
     {"role": "assistant", "content": None, "tool_calls": [
         {"type": "function", "function": {"name": "get", "arguments": {"city": "Zürich"}}}]},
     {"role": "tool", "content": "sunny"}],
    [{"role": "user", "content": "Write a poem"}, {"role": "assistant", "content": "Roses are red,  "}],
    [{"role": "user", "content": "  padded  "}, {"role": "assistant", "content": "  so far\n"}],
]
TOOLS = [{"type": "function", "function": {"name": "get", "description": "weather — now",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def outcome(call):
    """What ``call()`` gives: ("ok", result), or ("raises", the exception's type and message)."""
    try:
        return "ok", call()
    except Exception as exc:  # noqa: BLE001 - compared between the two tokenizers
        return "raises", (type(exc), str(exc))


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_chat_templates_render_as_transformers_renders_them(pair, index):
    light, hf = pair
    conversation = CONVERSATIONS[index]
    rendered = 0
    for tools in (None, TOOLS):
        for extra in ({}, {"enable_thinking": False}):
            options = [dict(add_generation_prompt=True), dict(add_generation_prompt=False)]
            if conversation[-1]["role"] == "assistant":
                options.append(dict(continue_final_message=True))
            for option in options:
                kwargs = dict(tools=tools, **option, **extra)
                expected = outcome(lambda: hf.apply_chat_template(conversation, tokenize=False, **kwargs))
                assert outcome(lambda: light.apply_chat_template(conversation, tokenize=False, **kwargs)) == expected
                rendered += expected[0] == "ok"
    assert rendered or light.chat_template != TOOLS_TEMPLATE  # the tools template renders every conversation
    assert light.hf_class_name in (type(hf).__name__, "Qwen2Tokenizer") and light._hf is None  # no transformers


def test_template_errors_and_bad_options_are_raised_as_transformers_raises_them(pair):
    light, hf = pair
    with pytest.raises(ValueError, match="continue_final_message and add_generation_prompt"):
        light.apply_chat_template(CONVERSATIONS[3], continue_final_message=True, add_generation_prompt=True,
                                  tokenize=False)
    with pytest.raises(ValueError, match="empty conversation"):
        light.apply_chat_template([], tokenize=False)
    if light.chat_template == TOOLS_TEMPLATE:
        late_system = [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]
        for tokenizer in (light, hf):
            with pytest.raises(jinja2.TemplateError, match="system must come first"):
                tokenizer.apply_chat_template(late_system, tokenize=False)


def test_attributes_the_server_reads_need_no_transformers(pair):
    _, hf = pair
    light = LightTokenizer(hf.name_or_path)
    for name in ("add_bos_token", "add_eos_token", "split_special_tokens", "padding_side", "truncation_side"):
        assert getattr(light, name) == getattr(hf, name), name
    assert light._hf is None


def test_what_it_does_not_render_itself_goes_to_transformers(pair):
    light, hf = pair
    documents = [{"title": "t", "text": "body"}]
    assert light.apply_chat_template(CONVERSATIONS[0], documents=documents, tokenize=False) == hf.apply_chat_template(
        CONVERSATIONS[0], documents=documents, tokenize=False)
    other = "{% for m in messages %}<{{ m.role }}>{% endfor %}"
    assert light.apply_chat_template(CONVERSATIONS[1], chat_template=other, tokenize=False) == "<system><user><assistant><user>"
    assert light.apply_chat_template(CONVERSATIONS[0]) == hf.apply_chat_template(CONVERSATIONS[0])  # tokenize=True
    assert light.encode("Hello", "world") == hf.encode("Hello", "world")  # a pair
    assert light("Hello world")["input_ids"] == hf("Hello world")["input_ids"]  # __call__
    assert light.init_kwargs == hf.init_kwargs  # any other attribute
    assert transformers_tokenizer(light) is light.hf and isinstance(light.hf, PreTrainedTokenizerFast)


def test_transformers_tokenizer_is_built_from_memory_once_the_files_are_gone(tmp_path):
    hf = transformers_tokenizer(smollm2_tokenizer())
    hf.save_pretrained(str(tmp_path / "tok"))
    light = LightTokenizer(tmp_path / "tok")
    shutil.rmtree(tmp_path / "tok")  # e.g. the cache cleared while the server runs
    assert light.hf.encode("Hello <|im_end|> world") == hf.encode("Hello <|im_end|> world")
    assert light.hf.chat_template == hf.chat_template


def test_templates_cannot_reach_private_names():
    import jinja2.exceptions

    from tokenmill.light_tokenizer import _compile

    for source in ("{% set ns = namespace(_x=1) %}{{ ns._x }}", "{% set ns = namespace(a=1) %}{% set ns._b = 2 %}"):
        with pytest.raises(jinja2.exceptions.SecurityError):
            _compile(source).render()
    assert _compile("{{ dict.__class__ }}").render() == ""  # the sandbox hides private attributes
    with pytest.raises(jinja2.exceptions.UndefinedError):  # and `dict` is a builder, not the type (dict.mro())
        _compile("{{ dict.mro() }}").render()
    assert _compile("{% set ns = namespace(a=1) %}{% set ns.a = ns.a + 1 %}{{ ns.a }}{{ dict(b=2).b }}").render() == "22"


def test_only_plain_saved_tokenizers_are_served_light(tmp_path):
    hf = transformers_tokenizer(smollm2_tokenizer())
    hf.save_pretrained(str(tmp_path / "plain"))
    assert light_tokenizer_fits(tmp_path / "plain")
    for name, edit in (("bos", {"add_bos_token": True}), ("class", {"tokenizer_class": "GemmaTokenizer"}),
                       ("cleanup", {"clean_up_tokenization_spaces": True}), ("prefix", {"add_prefix_space": True})):
        shutil.copytree(tmp_path / "plain", tmp_path / name)
        config = tmp_path / name / "tokenizer_config.json"
        config.write_text(json.dumps({**json.loads(config.read_text()), **edit}))
        assert not light_tokenizer_fits(tmp_path / name), name
    (tmp_path / "plain" / "tokenizer.json").unlink()
    assert not light_tokenizer_fits(tmp_path / "plain") and not light_tokenizer_fits(tmp_path / "missing")


def test_a_cached_qwen2_tokenizer_keeps_the_pipeline_the_first_load_saved(tmp_path, monkeypatch):
    """A Qwen2/Qwen3 GGUF's tokenizer is cached as a Qwen2Tokenizer. Reloaded, it splits as the first load did
    (llama.cpp's split for the file: here SmolLM2's, digits cut out first) on the light path and on the
    transformers one, not as transformers' Qwen2Tokenizer class rebuilds it (NFC, then Qwen2's split)."""
    from transformers import AutoTokenizer

    from tests.test_gguf_cache import fresh_gguf_cache
    from tokenmill.models import gguf_cache

    fresh_gguf_cache(tmp_path / "cache", monkeypatch)
    first = transformers_tokenizer(smollm2_tokenizer())  # what the first load built (llama.cpp's split)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    gguf_cache.cached_tokenizer(gguf, lambda: first)
    saved = gguf_cache.entry_dir(gguf) / "tokenizer"
    save_as_qwen2(saved)
    cached = gguf_cache.cached_tokenizer(gguf, lambda: pytest.fail("the cached entry is read back"))
    assert isinstance(cached, LightTokenizer) and cached.hf_class_name == "Qwen2Tokenizer"
    rebuilt = AutoTokenizer.from_pretrained(str(saved))  # the class's own pipeline
    assert type(rebuilt).__name__ == "Qwen2Tokenizer"
    differs = 0
    for text in texts() + ["x\n\n1 22\n\n3", "e\u0301 ＡＢ I'M"]:
        assert cached.encode(text) == first.encode(text), repr(text)
        assert gguf_cache._tokenizer_class(saved).from_pretrained(str(saved)).encode(text) == first.encode(text)
        differs += rebuilt.encode(text) != first.encode(text)
    assert differs  # the class's rebuild would have changed the ids


def test_a_cached_gguf_serves_chat_without_importing_transformers():
    """A fresh process: the embedded GGUF (cached), a chat turn, a completion and a constrained completion
    (llguidance) through the offline API, and transformers never imported."""
    probe = ("import sys; from tokenmill import LLM, SamplingParams; "
             "llm = LLM(model=sys.argv[1], dtype='float32', kv_cache_memory=0.05); p = SamplingParams(max_tokens=3); "
             "llm.chat([{'role': 'user', 'content': 'Hi'}], p); llm.generate(['Hello'], p); "
             "from tokenmill.sampling_params import StructuredOutputsParams as S; "
             "out = llm.generate(['A JSON object:'], SamplingParams(max_tokens=24, temperature=0, "
             "structured_outputs=S(choice=['yes', 'no'])))[0].outputs[0].text; assert out in ('yes', 'no'), out; "
             "print(type(llm.get_tokenizer()).__name__, sorted(m for m in sys.modules if m.split('.')[0] in "
             "('transformers', 'huggingface_hub')))")
    for _ in range(2):  # the first run completes the cache entry (in the test run's cache directory)
        done = subprocess.run([sys.executable, "-c", probe, str(smollm2_gguf_path())], capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "LightTokenizer []"


def test_llguidance_gets_the_tokenizer_its_own_transformers_reader_builds(pair):
    import llguidance.hf

    from tokenmill.structured_output.guidance_backend import ll_tokenizer

    light, hf = pair
    ours, theirs = ll_tokenizer(light, len(hf), None), llguidance.hf.from_tokenizer(hf, n_vocab=len(hf))
    assert (ours.vocab_size, ours.eos_token, ours.eos_tokens) == (theirs.vocab_size, theirs.eos_token, theirs.eos_tokens)
    for text in texts():
        assert ours.tokenize_str(text) == theirs.tokenize_str(text)
    assert [ours.decode_bytes([i]) for i in range(len(hf))] == [theirs.decode_bytes([i]) for i in range(len(hf))]
