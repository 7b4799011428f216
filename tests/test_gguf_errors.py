"""A GGUF file the engine cannot run gets one clear error: the `tokenmill` command (real processes of
`generate`, `chat` and `serve`) prints one ``error:`` line naming the file and what is missing (metadata key
or tensor), exits with status 2 and shows no traceback; ``LLM(...)`` raises ``UnsupportedModelError`` (a
``ValueError``) with the same message.

Proves it for an unknown architecture, a tensor type id nobody knows, a tensor type the engine can neither
run nor dequantize, an unknown RoPE scaling type, a tensor no model of the architecture has, and a
tokenizer transformers cannot build; and that a file built the same way without the fault loads (so the
errors come from the fault, not from the hand-written file).
"""
from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from tests.test_gguf_cache import fresh_gguf_cache
from tokenmill import LLM
from tokenmill.models.errors import UnsupportedModelError

HIDDEN, FFN, VOCAB = 32, 64, 8


def write_gguf(path: Path, arch: str = "llama", tokenizer_model: str = "gpt2", strings: dict | None = None,
               int32_matrix: bool = False, extra_tensor: str | None = None) -> Path:
    """A one-layer F32 model of ``arch`` with an 8-token BPE tokenizer; the keyword arguments add one fault."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_token_list(["a", "b", "ab", "c", "d", "e", "<s>", "</s>"])
    writer.add_token_types([1] * 6 + [3, 3])
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(6)
    writer.add_eos_token_id(7)
    for key, value in (strings or {}).items():
        writer.add_string(key, value)
    rng = np.random.default_rng(0)
    ones = np.ones(HIDDEN, dtype=np.float32)
    tensors = {"token_embd.weight": (VOCAB, HIDDEN), "blk.0.attn_q.weight": (HIDDEN, HIDDEN),
               "blk.0.attn_k.weight": (HIDDEN, HIDDEN), "blk.0.attn_v.weight": (HIDDEN, HIDDEN),
               "blk.0.attn_output.weight": (HIDDEN, HIDDEN), "blk.0.ffn_gate.weight": (FFN, HIDDEN),
               "blk.0.ffn_up.weight": (FFN, HIDDEN), "blk.0.ffn_down.weight": (HIDDEN, FFN)}
    for name in ("output_norm.weight", "blk.0.attn_norm.weight", "blk.0.ffn_norm.weight"):
        writer.add_tensor(name, ones)
    for name, shape in tensors.items():
        if int32_matrix and name == "blk.0.attn_q.weight":
            writer.add_tensor(name, np.zeros(shape, dtype=np.int32), raw_dtype=gguf.GGMLQuantizationType.I32)
        else:
            writer.add_tensor(name, rng.standard_normal(shape, dtype=np.float32))
    if extra_tensor is not None:
        writer.add_tensor(extra_tensor, ones)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def set_tensor_type_id(path: Path, tensor: str, type_id: int) -> None:
    """Overwrite the ggml type id in ``tensor``'s info record (name, u32 n_dims, u64 dims, u32 type)."""
    data = bytearray(path.read_bytes())
    name = tensor.encode()
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    (n_dims,) = struct.unpack_from("<I", data, at)
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, type_id)
    path.write_bytes(bytes(data))


def unknown_type_id(path: Path) -> Path:
    write_gguf(path)
    set_tensor_type_id(path, "blk.0.attn_q.weight", 99)
    return path


# case -> (how to write the file, the message's distinctive part)
CASES = {
    "architecture": (lambda p: write_gguf(p, arch="mamba"), "general.architecture 'mamba' is not supported"),
    "type_id": (unknown_type_id, "tensor 'blk.0.attn_q.weight' has tensor type id 99"),
    "type": (lambda p: write_gguf(p, int32_matrix=True),
             "tensor 'blk.0.attn_q.weight' has type I32, which tokenmill cannot run or dequantize"),
    "rope": (lambda p: write_gguf(p, strings={"llama.rope.scaling.type": "longrope"}),
             "llama.rope.scaling.type 'longrope' is not supported"),
    "tensor": (lambda p: write_gguf(p, extra_tensor="blk.0.ssm_conv1d.weight"),
               "tensor 'blk.0.ssm_conv1d.weight' is not part of a llama model"),
    "tokenizer": (lambda p: write_gguf(p, tokenizer_model="rwkv"), "tokenizer.ggml.model 'rwkv'"),
}


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bad_gguf")
    return {case: make(root / f"{case}.gguf") for case, (make, _) in CASES.items()}


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A GGUF cache of the test's own (the machine's kernel builds linked in); subprocesses inherit it."""
    return fresh_gguf_cache(tmp_path / "cache", monkeypatch)


def tokenmill(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokenmill.cli.main", "--log-level", "WARNING", *args],
                          input=stdin, capture_output=True, text=True, timeout=300)


def test_the_same_file_without_a_fault_loads(tmp_path, cache_dir):
    llm = LLM(model=str(write_gguf(tmp_path / "good.gguf")), dtype="float32", kv_cache_memory=0.01)
    assert llm.engine.loaded.hf_config.num_hidden_layers == 1 and llm.engine.loaded.tokenizer.eos_token_id == 7
    llm.close()


@pytest.mark.parametrize("case", list(CASES))
def test_llm_raises_one_clear_error(case, bad_files, cache_dir):
    path = bad_files[case]
    with pytest.raises(UnsupportedModelError) as excinfo:
        LLM(model=str(path), dtype="float32", kv_cache_memory=0.01)
    message = str(excinfo.value)
    assert isinstance(excinfo.value, ValueError)
    assert message.startswith(f"{path}: ") and CASES[case][1] in message and "\n" not in message


@pytest.mark.parametrize("case", list(CASES))
def test_generate_prints_one_error_line_and_exits_2(case, bad_files, cache_dir):
    result = tokenmill("generate", "hi", "--model", str(bad_files[case]), "--max-tokens", "1")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {bad_files[case]}: " + errors[0].split(": ", 2)[2]] and CASES[case][1] in errors[0]


@pytest.mark.parametrize("command, case", [("chat", "rope"), ("serve", "type_id")])
def test_chat_and_serve_print_one_error_line_and_exit_2(command, case, bad_files, cache_dir):
    args = [command, str(bad_files[case])] + (["--port", "0"] if command == "serve" else [])
    result = tokenmill(*args, stdin="hi\n\n")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and CASES[case][1] in errors[0] and str(bad_files[case]) in errors[0]


# ---------------------------------------------------------------- what a user gets wrong by accident


def test_files_cut_short_or_empty_and_paths_that_are_not_there_are_named(tmp_path, cache_dir):
    good = write_gguf(tmp_path / "good.gguf")
    data = good.read_bytes()
    (tmp_path / "header.gguf").write_bytes(data[:200])  # stops inside the metadata
    (tmp_path / "empty.gguf").write_bytes(b"")
    cases = {
        tmp_path / "header.gguf": "the file ends inside its GGUF header (200 bytes): truncated",
        tmp_path / "empty.gguf": "empty file (not a GGUF file)",
        tmp_path / "missing.gguf": f"model path '{tmp_path / 'missing.gguf'}' does not exist",
        tmp_path / "no" / "such" / "dir": "does not exist",
    }
    for path, expected in cases.items():
        with pytest.raises(ValueError) as excinfo:
            LLM(model=str(path), dtype="float32", kv_cache_memory=0.01)
        assert expected in str(excinfo.value) and "\n" not in str(excinfo.value), str(excinfo.value)
    result = tokenmill("generate", "hi", "--model", str(tmp_path / "header.gguf"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "ends inside its GGUF header" in result.stderr.strip().splitlines()[-1]
    assert not list((cache_dir / "gguf").glob("header-*"))  # nothing cached for a file that cannot be read


def test_a_directory_of_several_gguf_files_names_them(tmp_path, cache_dir):
    for name in ("a-Q4_K_M.gguf", "a-Q8_0.gguf"):
        write_gguf(tmp_path / name)
    with pytest.raises(ValueError, match=r"holds 2 GGUF files and no config.json: pass one of them as the model "
                                         r"\(a-Q4_K_M.gguf, a-Q8_0.gguf\)"):
        LLM(model=str(tmp_path), dtype="float32", kv_cache_memory=0.01)


def test_a_damaged_cache_entry_is_rebuilt_from_the_file(tmp_path, cache_dir):
    from tokenmill.models import gguf_cache

    path = write_gguf(tmp_path / "good.gguf")
    LLM(model=str(path), dtype="float32", kv_cache_memory=0.01).close()
    entry = gguf_cache.entry_dir(path)
    (entry / "tensors.json").write_text("")
    (entry / "config" / "config.json").write_text("{not json")
    llm = LLM(model=str(path), dtype="float32", kv_cache_memory=0.01)
    assert llm.engine.loaded.hf_config.num_hidden_layers == 1
    llm.close()
    assert json.loads((entry / "tensors.json").read_text())  # written again
    assert json.loads((entry / "config" / "config.json").read_text())["num_hidden_layers"] == 1
