"""The GGUF cache returns exactly what the GGUF loader produced, keyed by the file's version; quantized blocks
are used in place from the memory-mapped file (no copy in the cache, the mapping released with the tensor)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tokenmill.models import gguf_cache
from tokenmill.models.default_model import default_model_path
from tokenmill.models.gguf_loader import load_gguf_tokenizer


def fresh_gguf_cache(root: Path, monkeypatch) -> Path:
    """Point TOKENMILL_CACHE_DIR at ``root`` for a GGUF cache of its own, with ``root/kernels`` linked to this
    machine's kernel builds (the same variable locates them: without the link every engine would compile
    the C kernels again, tens of seconds)."""
    from tokenmill.csrc_build import kernel_cache_dir

    kernels = kernel_cache_dir()
    kernels.mkdir(parents=True, exist_ok=True)
    root.mkdir(parents=True, exist_ok=True)
    (root / "kernels").symlink_to(kernels, target_is_directory=True)
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(root))
    return root


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    return fresh_gguf_cache(tmp_path / "cache", monkeypatch)


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


def _mappings_of(path) -> list[tuple[int, int]]:
    """Address ranges of this process's memory maps of ``path`` (from /proc/self/maps)."""
    spans = []
    for line in open("/proc/self/maps"):
        fields = line.split()
        if len(fields) >= 6 and fields[5] == str(path):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            spans.append((start, end))
    return spans


def test_quantized_blocks_are_used_in_place_from_the_file_and_released_with_the_tensor(cache_dir):
    import warnings

    import numpy as np

    from tokenmill.models.gguf_loader import (gguf_to_hf_config, iter_mapped_weights, read_gguf_metadata,
                                              read_tensor_index)

    path = default_model_path().resolve()
    header = read_gguf_metadata(path)
    config = gguf_to_hf_config(header)
    index = gguf_cache.cached_tensor_index(path, lambda: read_tensor_index(header))
    assert gguf_cache.cached_tensor_index(path, lambda: pytest.fail("index parsed again")) == index
    info = next(t for t in index if t.name == "blk.3.attn_output.weight")
    expected = np.fromfile(path, dtype=np.uint8, count=info.nbytes, offset=info.offset)
    before = len(_mappings_of(path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no read-only-array warning from torch
        weights = dict(iter_mapped_weights(path, index, config, dense=False))
    o_proj = weights["model.layers.3.self_attn.o_proj.weight"]
    assert o_proj.qtype == 3 and o_proj.shape == (576, 576)  # Q4_1, as stored
    assert np.array_equal(o_proj.data.numpy().reshape(-1), expected)
    ptr = o_proj.data.data_ptr()
    assert any(start <= ptr < end for start, end in _mappings_of(path))  # the file's pages, not a copy
    assert len(_mappings_of(path)) > before
    del weights, o_proj
    import gc

    gc.collect()
    assert len(_mappings_of(path)) == before  # the last reference gone, the mapping is gone


def test_loading_a_quantized_gguf_writes_no_copy_of_its_blocks(cache_dir):
    from tokenmill.models.loader import load_model

    path = default_model_path()
    loaded = load_model(str(path), dtype="float32")
    assert loaded.quantization == "gguf"
    entry = gguf_cache.entry_dir(path)
    files = [f for f in entry.rglob("*") if f.is_file()]
    assert {f.name for f in files} >= {"config.json", "tensors.json"}
    assert not any(f.suffix == ".safetensors" for f in files)
    assert sum(f.stat().st_size for f in files) < path.stat().st_size / 20  # config, index and tokenizer only
    again = load_model(str(path), dtype="float32")  # from the cache entry: no metadata parse
    assert ({k: v for k, v in again.hf_config.to_dict().items() if k != "_name_or_path"}
            == {k: v for k, v in loaded.hf_config.to_dict().items() if k != "_name_or_path"})
