"""A GGUF's tokenizer splits text as llama.cpp does for the file's ``tokenizer.ggml.pre``.

On the embedded SmolLM2 GGUF (``pre = "smollm"``: llama.cpp cuts every digit out first) tokenmill's ids equal
llama.cpp's own tokenizer (the ``llama-tokenize`` binary scripts/build_llama_server.sh builds; skipped where it
is not built) on texts with "\\n\\n" before digits and words, runs of spaces and tabs, numbers, apostrophes and
non-ASCII text, fixed and random; transformers' conversion alone differs. The router's fallback (a GGUF without a
cached tokenizer) builds the same tokenizer as the worker's loader; an HF directory keeps its tokenizer.json.
"""
from __future__ import annotations

import json
import random
import subprocess

import pytest

from tests.test_gguf_cache import fresh_gguf_cache
from tests.tiny_models import smollm2_gguf_path, smollm2_tokenizer
from tokenmill.models.gguf_loader import load_gguf_tokenizer
from tokenmill.models.gguf_metadata import read_gguf_metadata


def _llama_tokenize():
    from tokenmill.bench.llama_server import default_binary_path

    binary = default_binary_path().parent / "llama-tokenize"
    return binary if binary.is_file() else None


LLAMA_TOKENIZE = _llama_tokenize()  # looked up at import, before a fixture points TOKENMILL_CACHE_DIR elsewhere

TEXTS = ["x\n\n1", "Hello\n\nWorld", "a   b\t\tc \n d", "year 2024, 3.14159 and 1000000", "naïve café 東京 😀 Ελληνικά",
         "  leading\n\n\nthree\n \n", "It's we'll they're I'D", "code:\n    if x == 10:\n        return y\n\n\n42",
         " = Title = \n \n The 1990s were\n\n7 things", "tabs\t1\t22\n\n\n333 end  "]
_PIECES = ["a", "Zb", "the", " ", "  ", "\n", "\n\n", "\t", "1", "23", "456", ",", ".", "'s", "'ll", "é", "東", "😀",
           "-", "  \n", "\r\n", "!?", "(", "\u00a0", "\u2003"]


def random_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(_PIECES) for _ in range(40)) for _ in range(n)]


def llama_cpp_ids(text: str, tmp_path) -> list[int]:
    """llama.cpp's ids for ``text`` with the embedded GGUF's vocabulary (no BOS)."""
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(text, encoding="utf-8", newline="")
    done = subprocess.run([str(LLAMA_TOKENIZE), "-m", str(smollm2_gguf_path()), "-f", str(prompt), "--ids",
                           "--log-disable", "--no-bos"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(LLAMA_TOKENIZE is None, reason="llama-tokenize is not built here (scripts/build_llama_server.sh)")
def test_embedded_gguf_tokenizes_as_llama_cpp(tmp_path):
    from transformers import AutoTokenizer

    path = smollm2_gguf_path()
    assert read_gguf_metadata(path).fields["tokenizer.ggml.pre"] == "smollm"
    ours = load_gguf_tokenizer(path)
    plain = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)  # transformers' split alone
    differs = 0
    for text in TEXTS + random_texts(12):
        ref = llama_cpp_ids(text, tmp_path)
        assert ours(text, add_special_tokens=False).input_ids == ref, repr(text)
        differs += plain(text, add_special_tokens=False).input_ids != ref
    assert differs >= 3  # "\n\n" before a digit: one token in llama.cpp, two after GPT-2's split
    # the engine's cached copy (tests/tiny_models.py) is the same tokenizer
    assert smollm2_tokenizer()("x\n\n1 22\n\n3", add_special_tokens=False).input_ids == \
        ours("x\n\n1 22\n\n3", add_special_tokens=False).input_ids


def test_router_fallback_builds_the_loaders_tokenizer(tmp_path, monkeypatch):
    """The router reading a GGUF whose tokenizer is not cached yet splits as the worker's loader does."""
    from tokenmill.router.tokenize import load_router_tokenizer

    fresh_gguf_cache(tmp_path / "cache", monkeypatch)
    router = load_router_tokenizer(str(smollm2_gguf_path()))
    loader = load_gguf_tokenizer(smollm2_gguf_path())
    assert router.tokenizer.backend_tokenizer.pre_tokenizer.__getstate__() == \
        loader.backend_tokenizer.pre_tokenizer.__getstate__()
    text = "a\n\n1\n\n22 b"
    assert router.tokenizer(text, add_special_tokens=False).input_ids == loader(text, add_special_tokens=False).input_ids
    assert loader(text, add_special_tokens=False).input_ids.count(1116) == 2  # "\n\n" whole before each digit


def test_hf_directory_keeps_its_own_pre_tokenizer(tmp_path):
    """A model directory's tokenizer.json is used as written: GPT-2's split stays GPT-2's."""
    from tokenmill.router.tokenize import load_router_tokenizer
    from transformers import AutoTokenizer

    path = smollm2_gguf_path()
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(tmp_path)
    written = json.loads((tmp_path / "tokenizer.json").read_text())["pre_tokenizer"]
    assert written["type"] == "ByteLevel" and written["use_regex"]
    router = load_router_tokenizer(str(tmp_path))
    assert router.tokenizer("x\n\n1", add_special_tokens=False).input_ids == [104, 198, 198, 33]


def test_the_fast_config_read_picks_the_tokenizer_transformers_picks_and_is_taken_out_again():
    """load_gguf_tokenizer lets AutoTokenizer pick the tokenizer class from the file's model type without parsing
    every metadata field (gguf_loader._fast_tokenizer_config): the same class, special tokens, chat template and
    ids as AutoTokenizer on its own full parse, and transformers' GGUF config readers are as they were after."""
    from transformers import AutoTokenizer
    from transformers.integrations.gguf import gguf_config_mapping

    from tokenmill.models.gguf_tokenizer import apply_llama_cpp_split

    path = smollm2_gguf_path()
    readers = dict(gguf_config_mapping.GGUF_CONFIG_ARCHS)
    fast = load_gguf_tokenizer(path)
    assert gguf_config_mapping.GGUF_CONFIG_ARCHS == readers
    full = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    fields = read_gguf_metadata(path).fields
    apply_llama_cpp_split(full, fields["tokenizer.ggml.model"], fields.get("tokenizer.ggml.pre"))
    assert type(fast) is type(full)
    assert (fast.bos_token, fast.eos_token, fast.chat_template, len(fast)) == \
        (full.bos_token, full.eos_token, full.chat_template, len(full))
    text = "Hello world! It's 2026, naïve café — 東京 12345 <|im_start|>user\n  spaces\tand tabs"
    assert fast(text)["input_ids"] == full(text)["input_ids"]
