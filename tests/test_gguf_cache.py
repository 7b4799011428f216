"""The GGUF cache returns exactly what the GGUF loader produced, keyed by the file's version; quantized blocks
are used in place from the memory-mapped file (no copy in the cache, the mapping released with the tensor)."""
from __future__ import annotations

import json
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


def test_entries_of_files_gone_changed_or_unrecorded_are_pruned_when_a_new_entry_is_made(cache_dir, tmp_path):
    """A file moved, replaced or reinstalled leaves its entry behind; the next new entry removes it. Entries of
    files still there, unchanged, stay; so does a maker's fresh ``.new-*`` directory."""
    def index_of(path):  # a real cache write: the tensor index
        return gguf_cache.cached_tensor_index(path, list)

    files = {name: tmp_path / f"{name}.gguf" for name in ("kept", "removed", "changed")}
    for name, path in files.items():
        path.write_bytes(name.encode())
        index_of(path)
    entries = {name: gguf_cache.entry_dir(path) for name, path in files.items()}
    assert all(json.loads((e / "source.json").read_text())["path"] == str(files[n].resolve())
               for n, e in entries.items())
    legacy = gguf_cache.cache_root() / "old-0123456789abcdef"  # an older tokenmill's entry: no source.json
    (legacy / "tokenizer").mkdir(parents=True)
    maker = gguf_cache.cache_root() / ".new-abc"  # another process making an entry right now
    maker.mkdir()
    files["removed"].unlink()
    os.utime(files["changed"], ns=(1, 1))

    index_of(files["kept"])  # a cached load: makes nothing, removes nothing
    assert entries["removed"].is_dir() and legacy.is_dir()
    newer = tmp_path / "newer.gguf"
    newer.write_bytes(b"newer")
    index_of(newer)
    left = {p.name for p in gguf_cache.cache_root().iterdir()}
    assert left == {entries["kept"].name, gguf_cache.entry_dir(newer).name, maker.name}
    index_of(files["changed"])  # the changed file's next load makes its new entry
    assert gguf_cache.entry_dir(files["changed"]) != entries["changed"]
    assert gguf_cache.entry_dir(files["changed"]).is_dir()
    assert entries["kept"].is_dir() and maker.is_dir()


def test_an_older_entry_still_in_use_gets_its_record_and_is_kept(cache_dir, tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"m")
    gguf_cache.cached_tensor_index(gguf, list)
    entry = gguf_cache.entry_dir(gguf)
    (entry / "source.json").unlink()  # as an older tokenmill wrote it
    assert gguf_cache.tile_directory(gguf) == entry  # the loader's cached load claims it
    other = tmp_path / "other.gguf"
    other.write_bytes(b"other")
    gguf_cache.cached_tensor_index(other, list)
    assert (entry / "source.json").is_file() and (entry / "tensors.json").is_file()


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
    built = []  # transformers' tokenizer rebuilt from the GGUF metadata (the cache directory starts empty)
    first = gguf_cache.cached_tokenizer(path, lambda: built.append(load_gguf_tokenizer(path)) or built[0])
    fresh = built[0]
    reloaded = gguf_cache.cached_tokenizer(path, lambda: pytest.fail("tokenizer rebuilt instead of cached"))
    assert type(first) is type(reloaded)  # the first load serves what later ones do
    texts = ["Hello world <|im_end|> ünïcödé 🤖", "<|im_start|>user\nhi<|im_end|>\n", "  spaces\tand\ttabs  "]
    assert [reloaded.encode(t) for t in texts] == [fresh.encode(t) for t in texts]
    messages = [{"role": "user", "content": "hi"}]
    assert reloaded.apply_chat_template(messages, tokenize=False) == fresh.apply_chat_template(messages, tokenize=False)
    assert reloaded.eos_token_id == fresh.eos_token_id and reloaded.all_special_ids == fresh.all_special_ids
    ids = list(range(0, 49152, 997))
    assert reloaded.decode(ids) == fresh.decode(ids)
    # served without transformers (tokenmill/light_tokenizer.py), reporting the class it was saved as
    assert type(reloaded).__name__ == "LightTokenizer" and reloaded.hf_class_name == type(fresh).__name__
    # a tokenizer_config.json that is JSON but not an object: the entry is rebuilt from the file, no crash
    saved = gguf_cache.entry_dir(path) / "tokenizer" / "tokenizer_config.json"
    saved.write_text("[]")
    rebuilt = gguf_cache.cached_tokenizer(path, lambda: load_gguf_tokenizer(path))
    assert [rebuilt.encode(t) for t in texts] == [fresh.encode(t) for t in texts]
    assert json.loads(saved.read_text())["tokenizer_class"] == "TokenizersBackend"  # stored again


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


def test_loading_a_quantized_gguf_caches_at_most_its_tiled_blocks(cache_dir):
    """The cache entry holds config, index, tokenizer and (where this build tiles) the repacked blocks: no
    dequantized copy, and less than the file's own size."""
    from tokenmill.models.loader import load_model
    from tokenmill.quantization.gguf_weight import tiled_formats

    path = default_model_path()
    loaded = load_model(str(path), dtype="float32")
    assert loaded.quantization == "gguf"
    entry = gguf_cache.entry_dir(path)
    files = [f for f in entry.rglob("*") if f.is_file()]
    assert {f.name for f in files} >= {"config.json", "tensors.json"}
    assert not any(f.suffix == ".safetensors" for f in files)
    tiles = [f for f in files if f.name.startswith("tiles-")]
    assert bool(tiles) == bool(tiled_formats())
    assert sum(f.stat().st_size for f in tiles) <= path.stat().st_size  # the repacked blocks: no more than the file
    assert sum(f.stat().st_size for f in files if f not in tiles) < path.stat().st_size / 20  # config, index, tokenizer
    again = load_model(str(path), dtype="float32")  # from the cache entry: no metadata parse
    assert ({k: v for k, v in again.hf_config.to_dict().items() if k != "_name_or_path"}
            == {k: v for k, v in loaded.hf_config.to_dict().items() if k != "_name_or_path"})


def _segments(loaded) -> list:
    """Every GGUFWeight segment (QuantizedTensor) of a loaded model, in module order."""
    from tokenmill.quantization.gguf_weight import GGUFWeight

    found = []
    for module in loaded.model.modules():
        for value in vars(module).values():
            if isinstance(value, GGUFWeight):
                found.extend(value.parts)
    return found


def test_tiled_blocks_come_back_from_the_tile_cache_exactly(cache_dir):
    """The first load (an empty cache) writes each repacked segment through to tiles-*.bin and keeps a view of
    the file's mapping, not the repacked copy; the second load maps the same segments (no repack) with the same
    bytes; a damaged tiles file is rebuilt, and a segment that differs is repacked."""
    import logging

    from tokenmill.models.loader import load_model
    from tokenmill.quantization import qgemm, tile_cache
    from tokenmill.quantization.formats import is_tiled
    from tokenmill.quantization.gguf_weight import tiled_formats

    if not tiled_formats():
        pytest.skip(f"this build ({qgemm.library.built() and qgemm.isa()}) keeps the stored layout: nothing to cache")
    import gc

    path = default_model_path()
    assert not list(gguf_cache.entry_dir(path).glob("tiles-*.bin"))  # a fresh cache
    loaded = _segments(load_model(str(path), dtype="float32"))
    tiles = next(gguf_cache.entry_dir(path).glob("tiles-*.bin"))
    tiled = [i for i, s in enumerate(loaded) if is_tiled(s.qtype)]
    assert tiled, "the embedded model has tiled segments on this build"
    spans = _mappings_of(tiles)
    assert all(any(lo <= loaded[i].data.data_ptr() < hi for lo, hi in spans) for i in tiled)  # written through
    first = [qgemm.QuantizedTensor(s.qtype, s.shape, s.data.clone()) for s in loaded]
    second = _segments(load_model(str(path), dtype="float32"))
    assert [s.qtype for s in first] == [s.qtype for s in second]
    assert all(torch.equal(a.data, b.data) for a, b in zip(first, second))
    spans = _mappings_of(tiles)
    assert all(any(lo <= second[i].data.data_ptr() < hi for lo, hi in spans) for i in tiled)  # mapped, not made
    del second, loaded  # their pages are the file's: cutting the file under them would fault
    gc.collect()
    with open(tiles, "r+b") as f:  # cut in half: its index points past the end, so it is repacked and rewritten
        f.truncate(tiles.stat().st_size // 2)
    third = _segments(load_model(str(path), dtype="float32"))
    assert all(torch.equal(a.data, b.data) for a, b in zip(first, third))
    assert tiles.stat().st_size > 0 and tile_cache.TileCache(tiles.parent, tiles.stem[6:])._mapped is not None
    # a recorded segment that is not the one asked for (its source bytes differ): repacked, and recorded anew
    cache = tile_cache.TileCache(tiles.parent, tiles.stem[6:])
    made = []
    part = next(s for s in first if is_tiled(s.qtype))
    stored = qgemm.QuantizedTensor(part.qtype - qgemm.TILED, part.shape, torch.zeros_like(part.data))
    logging.getLogger("tokenmill.quantization.tile_cache").setLevel(logging.INFO)
    got = cache.tiled([stored], lambda out=None: made.append(1) or qgemm.repack(stored))
    assert made == [1] and cache.hits == 0 and torch.equal(got.data, qgemm.repack(stored).data)
    cache.abort()


def test_segments_of_whole_tiles_repack_apart_into_the_stacked_layout():
    """GGUFWeight repacks a fused segment's row blocks one by one into their rows (no stacked copy) when all but
    the last are whole tiles: the same bytes as the stacked weight repacked, into a given buffer too."""
    from tests.gguf_quantizers import quantize
    from tokenmill.quantization import qgemm
    from tokenmill.quantization.formats import QuantizedTensor
    from tokenmill.quantization.gguf_weight import _merge, _tiled

    if not qgemm.library.available():
        pytest.skip("qgemm kernels unavailable")
    gen = torch.Generator().manual_seed(3)
    for qtype, rows in ((2, (32, 48, 7)), (12, (16, 32)), (8, (20, 16))):  # Q4_0, Q4_K, Q8_0 (20: not whole)
        parts = []
        for n in rows:
            w = torch.randn(n, 256, generator=gen)
            parts.append(QuantizedTensor(qtype, (n, 256), torch.from_numpy(quantize(w.numpy(), qtype)).reshape(n, -1)))
        want = qgemm.repack(_merge(parts))
        assert torch.equal(_tiled(parts).data, want.data) and _tiled(parts).qtype == want.qtype
        out = torch.full_like(want.data, 7)
        got = _tiled(parts, out)
        assert got.data.data_ptr() == out.data_ptr() and torch.equal(out, want.data)


def test_a_killed_loads_temporary_tiles_file_is_removed_and_a_live_one_kept(tmp_path):
    """A first load writes its tiles through a locked temporary file; the next load that writes removes the
    temporary files nobody holds (a load killed half-way would otherwise keep its reserved space for good), not
    one another load is still writing."""
    from tokenmill.quantization import tile_cache

    abandoned = tmp_path / ".tiles-abandoned"
    abandoned.write_bytes(b"\0" * 4096)
    first = tile_cache.TileCache(tmp_path, "one")
    first._open_writer()
    assert not abandoned.exists() and Path(first._writer[1]).exists()
    second = tile_cache.TileCache(tmp_path, "two")
    second._open_writer()
    assert Path(first._writer[1]).exists() and Path(second._writer[1]).exists()
    first.abort()
    second.abort()
    assert list(tmp_path.iterdir()) == []


# the methods a config class of a plain type may define: construction and validation, nothing the models read
_PLAIN_CLASS_METHODS = {"__init__", "__post_init__", "__eq__", "__setattr__", "validate", "validate_architecture"}
# not compared: where the config was read from and the version that wrote it
_NOT_COMPARED = {"_name_or_path", "transformers_version"}


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "llama_rope_llama3", "llama_rope_yarn",
                                  "llama_tied"])
def test_a_plain_config_carries_what_its_transformers_class_does(arch, tmp_path, cache_dir):
    """A cached config of a plain type comes back without its transformers class (whose import costs seconds
    on a slow machine) with the same attributes, and the class still adds nothing the models would miss: no
    attribute aliases, no properties, no methods beyond construction and validation."""
    import json

    from tests.tiny_models import tiny_config

    config = tiny_config(arch)
    assert config.model_type in gguf_cache.PLAIN_CONFIG_TYPES or config.model_type == "mistral"
    config.save_pretrained(tmp_path)
    fields = json.loads((tmp_path / "config.json").read_text())
    if config.model_type == "mistral":  # GGUF files make Mistral a llama config; its own class is not plain
        with pytest.raises(ValueError, match="no plain config for model type 'mistral'"):
            gguf_cache.plain_config(fields)
        return
    plain = gguf_cache.plain_config(fields)
    assert plain.model_type == config.model_type and type(plain) is not type(config)
    strip = lambda c: {k: v for k, v in vars(c).items() if k not in _NOT_COMPARED}  # noqa: E731
    assert strip(plain) == strip(config)
    # and the transformers-free PlainConfig a cached start reads (config-attributes.json, saved at the first load)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"m")
    gguf_cache._store_plain(gguf, config)
    entry = gguf_cache.entry_dir(gguf)
    light = gguf_cache._read_plain(entry)
    assert isinstance(light, gguf_cache.PlainConfig) and light.model_type == config.model_type
    assert vars(light) == vars(config) and light.to_dict() == config.to_dict()
    assert light.get_text_config() is light and strip(light.as_transformers()) == strip(config)
    # attributes another transformers version wrote are not trusted: the config goes through transformers again
    record = json.loads((entry / "config-attributes.json").read_text())
    record["transformers"] = "0.0.1"
    (entry / "config-attributes.json").write_text(json.dumps(record))
    assert gguf_cache._read_plain(entry) is None
    cls = type(config)
    assert not cls.attribute_map
    assert not [k for k, v in vars(cls).items() if isinstance(v, property)]
    assert {k for k, v in vars(cls).items() if callable(v)} <= _PLAIN_CLASS_METHODS


def test_a_cached_load_builds_the_same_model_without_importing_config_classes(cache_dir):
    """The embedded (llama) GGUF loaded twice: the cached load's config has the first load's attributes, the
    same greedy tokens come out, and a cached load in a fresh process never imports transformers' concrete
    config classes (their import pulls in transformers.activations, torch.distributed.tensor and sympy)."""
    import subprocess
    import sys

    from tokenmill import LLM, SamplingParams

    path = default_model_path()
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompt = "The capital of France is"
    first = LLM(model=str(path), dtype="float32", kv_cache_memory=0.05)
    tokens = first.generate([prompt], params)[0].outputs[0].token_ids
    config = first.engine.loaded.hf_config
    del first
    second = LLM(model=str(path), dtype="float32", kv_cache_memory=0.05)
    assert second.generate([prompt], params)[0].outputs[0].token_ids == tokens
    del second
    cached = gguf_cache.cached_config(path, lambda: pytest.fail("config parsed again instead of cached"))
    assert cached.model_type == "llama" and type(cached) is gguf_cache.PlainConfig
    assert type(config).__name__ == "LlamaConfig"  # the first load built the class's config from the file
    assert {k: v for k, v in vars(cached).items() if k not in _NOT_COMPARED} == {
        k: v for k, v in vars(config).items() if k not in _NOT_COMPARED}
    # nor transformers at all (importing it scans the source of every model it has), and the tokenizer comes back
    # as a LightTokenizer, which reports the class the first load saved
    probe = ("import sys; from tokenmill.models.loader import load_model; m = load_model(sys.argv[1], dtype='float32'); "
             "print(type(m.tokenizer).__name__, m.tokenizer.hf_class_name, "
             "sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'sympy')))")
    done = subprocess.run([sys.executable, "-c", probe, str(path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "LightTokenizer TokenizersBackend []"
