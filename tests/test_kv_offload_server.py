"""The disk KV tier across a real server restart: `tokenmill serve` saves its cached blocks on
SIGTERM, and a second server process on the same directory answers the same long prompt with
cached tokens read back from disk (same text); the per-tier metrics and /debug/kv_cache report it."""
from __future__ import annotations

import random
import re

from tests.server_fixtures import ServerProcess
from tests.tiny_models import make_tiny_model


def test_restarted_server_serves_a_seen_prompt_from_disk(tmp_path):
    model = str(make_tiny_model("llama", tmp_path / "llama"))
    args = ["--dtype", "float32", "--block-size", "4", "--num-kv-blocks", "128", "--max-model-len", "256",
            "--kv-offload-memory", "0.001", "--kv-offload-disk-path", str(tmp_path / "kv"),
            "--kv-offload-disk-size", "0.01", "--kv-offload-disk-drive-size", "1"]
    rng = random.Random(0)
    prompt = [rng.randrange(100, 40000) for _ in range(150)]

    first = ServerProcess(model, args, tmp_path / "first.log").wait_healthy()
    try:
        before = first.client().completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
        assert before.usage.prompt_tokens_details.cached_tokens == 0
        snapshot = first.kv_cache()["kv_offload"]
        assert snapshot["disk"]["enabled"] and snapshot["ram"]["capacity_blocks"] > 0
        metrics = first.metrics()
        assert metrics["tokenmill:kv_offload_hits_total{tier=disk}"] == 0
        assert "tokenmill:kv_offload_bytes_written_total{tier=ram}" in metrics
        assert "tokenmill:kv_offload_disk_dwpd" in metrics
    finally:
        assert first.stop() == 0
    saved = re.search(r"saved (\d+) blocks to disk at shutdown", first.log())
    assert saved and int(saved.group(1)) >= 37, first.log()[-2000:]  # the prompt's 37 full blocks at least

    second = ServerProcess(model, args, tmp_path / "second.log").wait_healthy()
    try:
        after = second.client().completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
        assert after.usage.prompt_tokens_details.cached_tokens == 148  # all but the last prompt token's block
        assert after.choices[0].text == before.choices[0].text
        metrics = second.metrics()
        assert metrics["tokenmill:kv_offload_hits_total{tier=disk}"] == 37
        assert metrics["tokenmill:kv_offload_bytes_read_total{tier=disk}"] >= 37 * 4 * 512
        assert second.kv_cache()["kv_offload"]["disk"]["hits"] == 37
    finally:
        assert second.stop() == 0
