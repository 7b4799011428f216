"""The GGUF cache returns exactly what the GGUF loader produced, keyed by the file's version."""
from __future__ import annotations

import os

import pytest
import torch

from tokenmill.models import gguf_cache
from tokenmill.models.default_model import default_model_path
from tokenmill.models.gguf_loader import load_gguf_tokenizer


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_weights_come_back_exactly_and_follow_the_file_version(cache_dir, tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"version 1")
    gen = torch.Generator().manual_seed(0)
    made = {"a.weight": torch.randn(3, 5, generator=gen), "b.bias": torch.randn(7, generator=gen).to(torch.bfloat16)}
    calls = []

    def produce():
        calls.append(1)
        yield from made.items()

    first = dict(gguf_cache.cached_weights(gguf, produce))
    second = dict(gguf_cache.cached_weights(gguf, produce))
    assert len(calls) == 1  # the second load came from the cache
    for got in (first, second):
        assert got.keys() == made.keys()
        assert all(torch.equal(got[k], made[k]) and got[k].dtype == made[k].dtype for k in made)
    os.utime(gguf, ns=(1, 1))  # a new version of the file: parsed again
    dict(gguf_cache.cached_weights(gguf, produce))
    assert len(calls) == 2


def test_unwritable_cache_only_costs_the_speedup(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(blocker))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x")
    got = dict(gguf_cache.cached_weights(gguf, lambda: iter([("w", torch.ones(2))])))
    assert torch.equal(got["w"], torch.ones(2)) and "GGUF cache" in caplog.text


def test_cached_tokenizer_behaves_like_the_gguf_one(cache_dir):
    path = default_model_path()
    fresh = gguf_cache.cached_tokenizer(path, lambda: load_gguf_tokenizer(path))
    reloaded = gguf_cache.cached_tokenizer(path, lambda: pytest.fail("tokenizer rebuilt instead of cached"))
    texts = ["Hello world <|im_end|> ünïcödé 🤖", "<|im_start|>user\nhi<|im_end|>\n", "  spaces\tand\ttabs  "]
    assert [reloaded.encode(t) for t in texts] == [fresh.encode(t) for t in texts]
    messages = [{"role": "user", "content": "hi"}]
    assert reloaded.apply_chat_template(messages, tokenize=False) == fresh.apply_chat_template(messages, tokenize=False)
    assert reloaded.eos_token_id == fresh.eos_token_id and reloaded.all_special_ids == fresh.all_special_ids
    ids = list(range(0, 49152, 997))
    assert reloaded.decode(ids) == fresh.decode(ids)
