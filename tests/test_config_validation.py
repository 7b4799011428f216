"""Engine settings are checked before anything loads: every bad value is a ConfigError (a ValueError)
that names the setting as an ``LLM(...)`` keyword, and as a flag through ``for_cli()``."""
from __future__ import annotations

import math

import pytest

from tokenmill.config import ConfigError
from tokenmill.engine.llm import build_engine_config

BAD = [
    ("max_model_len", math.nan, "max_model_len must be an integer", "--max-model-len must be an integer"),
    ("max_model_len", 100.5, "max_model_len must be an integer", "--max-model-len"),
    ("max_num_seqs", 1.5, "max_num_seqs must be an integer", "--max-num-seqs"),
    ("max_num_seqs", None, "max_num_seqs must be an integer", "--max-num-seqs"),
    ("max_num_batched_tokens", math.inf, "max_num_batched_tokens must be an integer", "--max-num-batched-tokens"),
    ("max_num_batched_tokens", 0, "max_num_batched_tokens must be >= 1", "--max-num-batched-tokens must be >= 1"),
    ("seed", 1.5, "seed must be an integer", "--seed"),
    ("seed", -1, "seed must be in [0, ", "--seed must be in [0, "),
    ("seed", 2**64, "seed must be in [0, ", "--seed"),
    ("num_threads", 0, "num_threads must be >= 1", "--num-threads must be >= 1"),
    ("num_threads", 1.5, "num_threads must be an integer", "--num-threads"),
    ("block_size", True, "block_size must be an integer", "--block-size"),
    ("block_size", "16", "block_size must be an integer", "--block-size"),
    ("num_kv_blocks", 2.5, "num_kv_blocks must be an integer", "--num-kv-blocks"),
    ("kv_cache_memory", True, "kv_cache_memory must be a number", "--kv-cache-memory"),
    ("kv_cache_memory", math.nan, "kv_cache_memory must be a finite number > 0", "--kv-cache-memory"),
    ("kv_cache_memory", "2", "kv_cache_memory must be a number", "--kv-cache-memory"),
    ("enable_prefix_caching", "no", "enable_prefix_caching must be True or False", "--no-enable-prefix-caching"),
    ("enable_chunked_prefill", 0, "enable_chunked_prefill must be True or False", "--no-enable-chunked-prefill"),
    ("kv_offload_disk_path", 123, "kv_offload_disk_path must be a path", "--kv-offload-disk-path"),
    ("device", None, "device must be 'auto'", "--device must be 'auto'"),
    ("device", 0, "device must be 'auto'", "--device"),
    ("gpu_memory_utilization", "0.5", "gpu_memory_utilization must be a number", "--gpu-memory-utilization"),
    ("gpu_memory_utilization", 1.5, "gpu_memory_utilization must be in (0, 1]", "--gpu-memory-utilization"),
]


@pytest.mark.parametrize("name, value, keyword_message, flag_message", BAD, ids=[f"{b[0]}={b[1]!r}" for b in BAD])
def test_bad_setting_is_refused_naming_it(name, value, keyword_message, flag_message):
    with pytest.raises(ConfigError) as info:
        build_engine_config(**{name: value})
    assert keyword_message in str(info.value)
    assert flag_message in info.value.for_cli()
    assert "`" not in str(info.value) and "`" not in info.value.for_cli()


def test_switch_turned_off_is_spelled_per_interface():
    with pytest.raises(ConfigError) as info:
        build_engine_config(enable_chunked_prefill=False, max_model_len=2048, max_num_batched_tokens=1024)
    assert "when enable_chunked_prefill=False turns chunked prefill off (1024 < 2048)" in str(info.value)
    assert "when --no-enable-chunked-prefill turns chunked prefill off" in info.value.for_cli()


def test_good_settings_and_numpy_integers_are_accepted():
    np = pytest.importorskip("numpy")
    config = build_engine_config(max_num_seqs=np.int64(4), kv_cache_memory=0.5, seed=2**63 - 1, num_threads=None)
    assert config.scheduler.max_num_seqs == 4 and config.cache.kv_cache_memory_gib == 0.5
