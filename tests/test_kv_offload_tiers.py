"""The lower KV tiers without a model: RAM LRU order and capacity, disk records (round trip,
restart, fingerprint isolation, LRU segment deletion, damaged files), the disk tier switching
itself off (unwritable path, directory in use, disk full) while the RAM tier keeps working."""
from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from tokenmill.config import CacheConfig, ConfigError
from tokenmill.kv_cache.offload_planner import DISK_TIER, RAM_TIER
from tokenmill.kv_offload import DiskTier, RamTier, TieredKVStore
from tokenmill.kv_offload.disk_format import HEADER_SIZE, VERSION_STATE, decode_header
from tokenmill.kv_offload.fingerprint import model_fingerprint
from tokenmill.kv_offload.stats import drive_writes_per_day
from tokenmill.runner.kv_pool import KVPool

REPO = Path(__file__).resolve().parents[1]
FP = "ab" * 32  # a model fingerprint (hex sha256)
OTHER_FP = "ab" * 8 + "cd" * 24  # same directory prefix, different model
BLOCK_BYTES = 1024
RECORD = HEADER_SIZE + BLOCK_BYTES


def payload(i: int) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(BLOCK_BYTES))


def load_sync(tier: DiskTier, hashes: list[int]) -> dict[int, bytes | None]:
    """Read blocks through the loader thread and wait for all of them."""
    got: dict[int, bytes | None] = {}
    done = threading.Event()

    def on_done(h, data):
        got[h] = None if data is None else bytes(data)
        if len(got) == len(hashes):
            done.set()

    tier.load(hashes, on_done)
    assert done.wait(10)
    return got


def write_segments(tier: DiskTier, groups: list[list[int]]) -> None:
    """Write each group of block ids with one flush (so each lands in its own segment when the
    segment holds one group)."""
    for group in groups:
        for i in group:
            assert tier.put(i, payload(i))
        tier.flush()


def segment_files(tier: DiskTier) -> list[Path]:
    return sorted(tier.directory.glob("segment-*.kvseg"))


def test_ram_tier_evicts_least_recently_used_first_and_keeps_data():
    ram = RamTier(3, 8)  # 8-byte blocks: two float32 values each
    data = {h: torch.tensor([float(h), -float(h)]).view(torch.uint8) for h in range(10)}
    assert ram.write([1, 2, 3], torch.stack([data[1], data[2], data[3]])) == []
    ram.touch(1)  # order now 2, 3, 1
    evicted = ram.write([4], data[4][None])
    assert [h for h, _ in evicted] == [2] and torch.equal(evicted[0][1], data[2])
    # Four new blocks into three slots: every stored block goes, then the oldest of the batch.
    evicted = ram.write([5, 6, 7, 8], torch.stack([data[h] for h in (5, 6, 7, 8)]))
    assert [h for h, _ in evicted] == [3, 1, 4, 5]
    assert all(torch.equal(t, data[h]) for h, t in evicted)
    assert ram.hashes() == [6, 7, 8] and len(ram) == 3
    assert torch.equal(ram.read([8, 6]), torch.stack([data[8], data[6]]))
    assert ram.hashes() == [7, 8, 6]  # a read makes blocks most recent
    assert ram.stats.evictions == 5 and ram.stats.bytes_written == 7 * 8 and ram.stats.bytes_read == 2 * 8


def test_disk_records_round_trip_and_survive_a_restart(tmp_path):
    tier = DiskTier(tmp_path, FP, BLOCK_BYTES, capacity_bytes=1 << 20)
    write_segments(tier, [list(range(10))])
    assert tier.put(3, payload(3)) is False  # already stored: not written twice
    assert load_sync(tier, list(range(10))) == {i: payload(i) for i in range(10)}
    assert tier.stats.bytes_written == 10 * RECORD and tier.stats.bytes_read == 10 * RECORD
    tier.close()
    restarted = DiskTier(tmp_path, FP, BLOCK_BYTES, capacity_bytes=1 << 20)
    assert len(restarted) == 10 and 7 in restarted
    assert load_sync(restarted, [7, 0]) == {7: payload(7), 0: payload(0)}
    restarted.close()


def test_records_with_state_checkpoints_round_trip_and_say_so_in_their_header(tmp_path):
    state = 96  # bytes of one linear-attention state checkpoint
    old = DiskTier(tmp_path, FP, BLOCK_BYTES, capacity_bytes=1 << 20)  # an engine that knew no state
    write_segments(old, [[1, 2]])
    old.close()
    tier = DiskTier(tmp_path, FP, BLOCK_BYTES, capacity_bytes=1 << 20, state_bytes=state)
    assert len(tier) == 2  # the version 1 records are plain KV blocks here
    with_state = {3: payload(3) + bytes(range(state)), 4: payload(4) + bytes(range(5, 5 + state))}
    for h, data in with_state.items():
        assert tier.put(h, data)
    tier.flush()
    assert load_sync(tier, [1, 3, 4]) == {1: payload(1), **with_state}
    tier.close()
    segment = sorted(tier.directory.glob("segment-*.kvseg"))[-1]
    headers = [decode_header(segment.read_bytes()[i * (RECORD + state):][:HEADER_SIZE]) for i in range(2)]
    assert [(h.block_hash, h.payload_len, h.state_len) for h in headers] == [(3, BLOCK_BYTES + state, state),
                                                                             (4, BLOCK_BYTES + state, state)]
    assert segment.read_bytes()[4:6] == VERSION_STATE.to_bytes(2, "little") == b"\x02\x00"
    restarted = DiskTier(tmp_path, FP, BLOCK_BYTES, capacity_bytes=1 << 20, state_bytes=state)
    assert load_sync(restarted, [4, 2]) == {4: with_state[4], 2: payload(2)}
    restarted.close()
    # A reader expecting another state size, or none, never takes a record with state for a plain block.
    for other in (0, state + 4):
        reader = DiskTier(tmp_path, FP, BLOCK_BYTES, capacity_bytes=1 << 20, state_bytes=other)
        assert sorted(reader.hashes()) == [1, 2] and load_sync(reader, [3]) == {3: None}
        reader.close()


def test_a_different_model_never_finds_the_blocks(tmp_path):
    tier = DiskTier(tmp_path, FP, BLOCK_BYTES, capacity_bytes=1 << 20)
    write_segments(tier, [[1, 2]])
    tier.close()
    other_dir = DiskTier(tmp_path, "cd" * 32, BLOCK_BYTES, capacity_bytes=1 << 20)
    assert len(other_dir) == 0 and load_sync(other_dir, [1]) == {1: None}
    other_dir.close()
    # Same 16-hex-digit directory, different fingerprint: the records' own fingerprint keeps them apart.
    same_dir = DiskTier(tmp_path, OTHER_FP, BLOCK_BYTES, capacity_bytes=1 << 20)
    assert same_dir.directory == tier.directory
    assert len(same_dir) == 0 and load_sync(same_dir, [1, 2]) == {1: None, 2: None}
    same_dir.close()


def test_capacity_deletes_the_least_recently_used_segment(tmp_path):
    # Two records per segment, three segments of room.
    tier = DiskTier(tmp_path, FP, BLOCK_BYTES, capacity_bytes=6 * RECORD, segment_bytes=2 * RECORD)
    write_segments(tier, [[0, 1], [2, 3], [4, 5]])
    assert len(segment_files(tier)) == 3
    assert load_sync(tier, [0]) == {0: payload(0)}  # segment 1 is now more recent than segment 2
    write_segments(tier, [[6, 7]])
    assert [i for i in range(8) if i in tier] == [0, 1, 4, 5, 6, 7]
    assert load_sync(tier, [2]) == {2: None}
    assert tier.snapshot()["used_bytes"] <= 6 * RECORD and tier.stats.evictions == 2
    assert sum(p.stat().st_size for p in segment_files(tier)) <= 6 * RECORD
    tier.close()


def test_damaged_files_are_detected_dropped_and_never_returned(tmp_path, caplog):
    tier = DiskTier(tmp_path, FP, BLOCK_BYTES, capacity_bytes=1 << 20, segment_bytes=2 * RECORD)
    write_segments(tier, [[0, 1], [2, 3], [4, 5], [6, 7]])
    tier.close()
    seg1, seg2, seg3, seg4 = segment_files(tier)
    with open(seg1, "r+b") as f:  # one payload byte of block 0
        f.seek(HEADER_SIZE + 100)
        byte = f.read(1)
        f.seek(HEADER_SIZE + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    with open(seg2, "r+b") as f:  # a torn tail: block 3's record is cut short
        f.truncate(RECORD + HEADER_SIZE + 10)
    caplog.set_level(logging.WARNING, logger="tokenmill.kv_offload.disk_tier")
    restarted = DiskTier(tmp_path, FP, BLOCK_BYTES, capacity_bytes=1 << 20)
    assert "truncated record" in caplog.text and seg2.name in caplog.text
    assert 3 not in restarted and 2 in restarted
    seg3.unlink()  # deleted while the server runs
    with open(seg4, "r+b") as f:  # truncated while the server runs
        f.truncate(RECORD + 10)
    caplog.clear()
    got = load_sync(restarted, [0, 1, 2, 3, 4, 6, 7])
    assert got == {0: None, 1: payload(1), 2: payload(2), 3: None, 4: None, 6: payload(6), 7: None}
    # One warning per fault kind (the corrupt one was logged at startup): the rest are counted, not logged.
    assert [r.levelno for r in caplog.records] == [logging.WARNING] and "cannot read the segment" in caplog.text
    assert restarted.stats.errors == {"corrupt": 3, "io": 1}  # torn seg2, flipped block 0, cut block 7; seg3 gone
    assert seg2.stat().st_size == RECORD  # the torn tail was cut off at startup
    assert [i for i in range(8) if i in restarted] == [1, 2, 6]  # bad ones left the index
    restarted.close()


def test_unwritable_path_disables_the_disk_tier_and_ram_keeps_serving(tmp_path, caplog):
    (tmp_path / "file").write_text("not a directory")
    caplog.set_level(logging.ERROR, logger="tokenmill.kv_offload.disk_tier")
    disk = DiskTier(tmp_path / "file" / "kv", FP, BLOCK_BYTES, capacity_bytes=1 << 20)
    assert not disk.enabled and "Not a directory" in disk.error and str(tmp_path / "file") in disk.error
    assert "KV offload disk tier disabled" in caplog.text and "serving continues" in caplog.text
    kv_cache = torch.arange(1 * 2 * 4 * 2 * 1 * 4, dtype=torch.float32).reshape(1, 2, 4, 2, 1, 4)
    store = TieredKVStore(KVPool.over(kv_cache.clone()), ram_blocks=2, disk=disk, max_staged_blocks=4)
    store.transfer([(0, 100), (1, 101)], [])
    assert store.lookup([100, 101, 102]) == [RAM_TIER, RAM_TIER]
    store.pool.kv[:, :, 2:4] = 0
    store.transfer([], [(2, 100), (3, 101)])
    assert torch.equal(store.pool.kv[:, :, 2:4], kv_cache[:, :, 0:2])
    store.close([(0, 100)])
    disk.close()


def test_a_second_process_cannot_share_the_directory(tmp_path, caplog):
    first = DiskTier(tmp_path, FP, BLOCK_BYTES, capacity_bytes=1 << 20)
    second = DiskTier(tmp_path, FP, BLOCK_BYTES, capacity_bytes=1 << 20)
    assert first.enabled and not second.enabled and "in use by another tokenmill process" in second.error
    first.close()
    third = DiskTier(tmp_path, FP, BLOCK_BYTES, capacity_bytes=1 << 20)  # the lock is released on close
    assert third.enabled
    third.close()


DISK_FULL_SCRIPT = textwrap.dedent("""
    import json, logging, resource, sys, torch
    from tokenmill.kv_cache.offload_planner import RAM_TIER
    from tokenmill.kv_offload import DiskTier, TieredKVStore
    from tokenmill.runner.kv_pool import KVPool
    logging.basicConfig(level=logging.ERROR)
    disk = DiskTier(sys.argv[1], "ab" * 32, 1 * 2 * 4 * 4 * 4, capacity_bytes=1 << 30, batch_bytes=1)
    # (layers, 2, blocks, block_size, heads, head_dim): 128-byte blocks
    kv_cache = torch.randn(1, 2, 8, 4, 1, 4)
    store = TieredKVStore(KVPool.over(kv_cache), ram_blocks=4, disk=disk, max_staged_blocks=8)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2000, 2000))  # ~10 records per file, then EFBIG
    for step in range(20):  # each step evicts 8 blocks to RAM; RAM evicts older ones to disk
        store.transfer([(i, 1000 * step + i) for i in range(8)], [])
        disk.flush()
    tiers = store.lookup([1000 * 19 + i for i in range(4, 8)])
    expected = kv_cache[:, :, 4:8].clone()
    kv_cache.zero_()
    store.transfer([], [(i, 1000 * 19 + 4 + i) for i in range(4)])
    print(json.dumps({"enabled": disk.enabled, "error": disk.error, "ram_tiers": tiers,
                      "restored": bool(torch.equal(kv_cache[:, :, 0:4], expected)),
                      "bytes_written": disk.stats.bytes_written, "stats": store.tier_stats()["disk"]}))
    store.close(None)
""")


def test_disk_full_disables_the_disk_tier_and_ram_keeps_serving(tmp_path):
    result = subprocess.run([sys.executable, "-c", DISK_FULL_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                            cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["enabled"] is False and "File too large" in report["error"]
    assert report["stats"]["enabled"] == 0 and report["stats"]["errors"] == {"enospc": 1}  # EFBIG: no room
    assert 0 < report["bytes_written"] <= 2000  # whole records that fit before the limit
    assert report["ram_tiers"] == [RAM_TIER] * 4 and report["restored"]
    assert "KV offload disk tier disabled" in result.stderr and "serving continues" in result.stderr


def test_store_lookup_reports_disk_hits_and_loads_them_back(tmp_path):
    disk = DiskTier(tmp_path, FP, 1 * 2 * 2 * 1 * 4 * 4, capacity_bytes=1 << 20)
    kv_cache = torch.randn(1, 2, 4, 2, 1, 4)
    original = kv_cache.clone()
    store = TieredKVStore(KVPool.over(kv_cache), ram_blocks=0, disk=disk, max_staged_blocks=8)
    store.transfer([(0, 10), (1, 11), (2, 12)], [])  # no RAM tier: straight to the disk writer
    assert store.lookup([10, 11, 12, 13]) == [DISK_TIER] * 3
    store.load_async([10, 11])
    while store.has_pending_loads():
        store.wait_for_loads(timeout=5)
    assert store.lookup([10, 11, 12]) == [RAM_TIER, RAM_TIER, DISK_TIER]
    kv_cache.zero_()
    store.transfer([], [(3, 10), (2, 11)])
    assert torch.equal(kv_cache[:, :, 3], original[:, :, 0]) and torch.equal(kv_cache[:, :, 2], original[:, :, 1])
    assert disk.stats.hits == 2 and store.lookup([10]) == [DISK_TIER]  # taken from staging, still on disk
    store.close(None)


def test_model_fingerprint_covers_weights_dtype_block_size_and_kv_dtype():
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    base = model_fingerprint(model, config, torch.float32, 16, torch.float32)
    assert base == model_fingerprint(model, config, torch.float32, 16, torch.float32)
    assert base != model_fingerprint(model, config, torch.bfloat16, 16, torch.float32)
    assert base != model_fingerprint(model, config, torch.float32, 32, torch.float32)
    assert base != model_fingerprint(model, config, torch.float32, 16, torch.bfloat16)
    other_rope = LlamaConfig(**{**config.to_dict(), "rope_parameters": {"rope_type": "default", "rope_theta": 1.0}})
    assert base != model_fingerprint(model, other_rope, torch.float32, 16, torch.float32)
    with torch.no_grad():
        model.weight[0, 0] += 1e-3
    assert base != model_fingerprint(model, config, torch.float32, 16, torch.float32)


@pytest.mark.parametrize("kwargs, keyword_message, flag_message", [
    ({"kv_offload_memory_gib": -1.0}, "kv_offload_memory must be", "--kv-offload-memory must be"),
    ({"kv_offload_memory_gib": float("nan")}, "kv_offload_memory must be", "--kv-offload-memory must be"),
    ({"kv_offload_disk_path": "/tmp/x", "kv_offload_disk_size_gib": 0.0},
     "kv_offload_disk_size must be", "--kv-offload-disk-size must be"),
    ({"kv_offload_disk_path": ""}, "kv_offload_disk_path must not be empty", "--kv-offload-disk-path must not"),
    ({"kv_offload_disk_path": "/tmp/x", "kv_offload_disk_drive_size_gib": -2.0},
     "kv_offload_disk_drive_size must be", "--kv-offload-disk-drive-size must be"),
    ({"kv_offload_memory_gib": 1.0, "enable_prefix_caching": False},
     "which enable_prefix_caching=False turns off", "which --no-enable-prefix-caching turns off"),
    ({"kv_offload_disk_size_gib": 4.0}, "kv_offload_disk_size sizes the disk KV tier, which is off: give "
     "kv_offload_disk_path too", "--kv-offload-disk-size sizes the disk KV tier, which is off: give "
     "--kv-offload-disk-path too"),
    ({"kv_offload_disk_drive_size_gib": 4.0}, "kv_offload_disk_drive_size sizes the disk KV tier",
     "--kv-offload-disk-drive-size sizes the disk KV tier"),
])
def test_cache_config_rejects_bad_offload_settings_naming_the_setting(kwargs, keyword_message, flag_message):
    with pytest.raises(ConfigError) as info:
        CacheConfig(**kwargs)
    assert keyword_message in str(info.value)  # as LLM(...) keywords
    assert flag_message in info.value.for_cli()  # as command-line flags


def test_disk_tier_size_defaults_to_16_gib_only_when_the_tier_is_on():
    assert CacheConfig(kv_offload_disk_path="/tmp/x").disk_tier_size_gib == 16.0
    assert CacheConfig(kv_offload_disk_path="/tmp/x", kv_offload_disk_size_gib=2.5).disk_tier_size_gib == 2.5


def test_drive_writes_per_day():
    assert drive_writes_per_day(2 << 30, 86400.0, 1 << 30) == pytest.approx(2.0)
    assert drive_writes_per_day(1 << 30, 3600.0, 1 << 30) == pytest.approx(24.0)
    # A startup burst is averaged over at least an hour, not projected from its first seconds.
    assert drive_writes_per_day(1 << 30, 10.0, 1 << 30) == pytest.approx(24.0)
    assert drive_writes_per_day(1 << 30, 7200.0, 1 << 30) == pytest.approx(12.0)
