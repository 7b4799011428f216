"""The `tokenmill` command as a user runs it: real processes on a tiny model."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.tiny_models import make_tiny_model
from tokenmill import LLM, SamplingParams


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("cli")))


def tokenmill(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokenmill.cli.main", "--log-level", "WARNING", *args],
                          input=stdin, capture_output=True, text=True, timeout=300)


def test_generate_prints_the_offline_greedy_text(tiny):
    result = tokenmill("generate", "Once upon a time", "--model", tiny, "--dtype", "float32",
                       "--max-tokens", "8", "--temperature", "0", "--kv-cache-memory", "0.05")
    assert result.returncode == 0, result.stderr
    expected = LLM(model=tiny, dtype="float32", kv_cache_memory=0.05).generate(
        "Once upon a time", SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text
    assert result.stdout == f"### Once upon a time\n{expected}\n\n"


def test_chat_reads_turns_from_stdin_until_an_empty_line(tiny):
    result = tokenmill("chat", tiny, "--max-tokens", "4", "--temperature", "0", "--kv-cache-memory", "0.05",
                       stdin="Hello\nAnd again\n\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("> ") == 3  # two turns answered, then the empty line ends the session


def test_bad_model_name_is_a_clear_error():
    result = tokenmill("generate", "hi", "--model", "meta-llama/Llama-3-8B")
    assert result.returncode == 2
    assert "never downloads" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("flags, message", [
    (["--kv-offload-disk-size", "4"],
     "error: --kv-offload-disk-size sizes the disk KV tier, which is off: give --kv-offload-disk-path too"),
    (["--kv-offload-memory", "1", "--no-enable-prefix-caching"],
     "need prefix caching, which --no-enable-prefix-caching turns off"),
    (["--max-num-seqs", "0"], "error: --max-num-seqs must be >= 1, got 0"),
])
def test_bad_engine_flags_are_named_as_flags(flags, message):
    result = tokenmill("serve", "--port", "1", *flags)  # validated before the model loads or the port binds
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


def test_setting_refused_while_serve_loads_the_model_is_one_line_naming_the_flag(tiny):
    # Only known once the model is loaded (its max_position_embeddings is the default max_model_len).
    result = tokenmill("serve", tiny, "--port", "0", "--no-enable-chunked-prefill", "--max-num-batched-tokens", "8")
    assert result.returncode == 2, result.stderr
    assert "error: --max-num-batched-tokens must be >= --max-model-len when --no-enable-chunked-prefill" in result.stderr
    assert "--max-model-len defaults to the model's max_position_embeddings" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("flags, message", [
    (["--kv-cache-memory", "1e6"], "cannot be allocated"),  # more than the machine has
    (["--kv-cache-memory", "1e-9"], "holds no KV block"),
])
def test_kv_pool_that_cannot_exist_is_a_clear_error(tiny, flags, message):
    result = tokenmill("generate", "hi", "--model", tiny, "--max-tokens", "1", *flags)
    assert result.returncode == 2
    assert message in result.stderr and "--kv-cache-memory" in result.stderr and "Traceback" not in result.stderr


def test_serve_port_out_of_range_is_refused():
    result = tokenmill("serve", "--port", "70000")
    assert result.returncode == 2 and "must be in [0, 65535]" in result.stderr
