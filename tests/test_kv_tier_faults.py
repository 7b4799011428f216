"""Faults below the engine: the lower KV tiers under a full disk, a read-only directory, corrupted segments (at a
restart and while serving) and a RAM slab that cannot be allocated. Each time the engine keeps serving the greedy
tokens of a run without tiers, the tier logs one line, counts the fault in tokenmill:kv_offload_errors_total and
tokenmill:kv_offload_enabled, no corrupt block is ever served and no KV block leaks (check_integrity).

The faults are real where the machine allows: a full disk is RLIMIT_FSIZE (the kernel's EFBIG on the segment
write), a read-only directory is chmod 0500 (or, as root, which chmod does not stop, ``chattr +i``); only as a
root without CAP_LINUX_IMMUTABLE does the read-only test fall back on TOKENMILL_KV_OFFLOAD_DISK_FAULT=EROFS, the
documented test hook that raises the OSError where the tier calls the OS. Corruption is bytes written into the
segment files on disk.
"""
from __future__ import annotations

import logging
import os
import resource
import shutil
import signal
import subprocess

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.test_kv_offload_engine import BLOCK_BYTES, BLOCK_SIZE, GREEDY, make_llm, prompt_set, warm_evict_probe
from tests.tiny_models import make_tiny_model
from tokenmill import envs
from tokenmill.kv_cache.block_hash import extend_block_hashes
from tokenmill.kv_offload.disk_format import HEADER_SIZE, encode_record, scan_segment
from tokenmill.kv_offload.disk_tier import SEGMENT_GLOB, DiskTier
from tokenmill.server.metrics import EngineStats, ServerMetrics

RECORD = HEADER_SIZE + BLOCK_BYTES
LOGGERS = "tokenmill.kv_offload"


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("llama")))


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """The greedy outputs with no tier and no prefix cache: every prompt token computed."""
    return warm_evict_probe(make_llm(tiny_llama, num_kv_blocks=256, enable_prefix_caching=False))


def token_ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def tier_metrics(store) -> dict[str, float]:
    """The tier samples of /metrics (rendered by the server's own registry) as ``name{labels}`` -> value."""
    text = ServerMetrics("m", lambda: EngineStats(kv_offload=store.tier_stats())).render().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith(("tokenmill:kv_offload_errors", "tokenmill:kv_offload_enabled")):
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
                samples[f"{s.name}{{{labels}}}"] = s.value
    return samples


def log_lines(caplog) -> list[str]:
    """Lines at WARNING or above from the KV tiers."""
    return [r.getMessage() for r in caplog.records if r.name.startswith(LOGGERS) and r.levelno >= logging.WARNING]


def test_a_full_disk_switches_the_disk_tier_off_and_serving_goes_on(tiny_llama, reference, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=LOGGERS)
    # 1 MiB of disk: segments of 128 KiB, so the writes run past the 32 KiB file-size limit inside one segment.
    with make_llm(tiny_llama, num_kv_blocks=24, kv_offload_disk_path=str(tmp_path / "kv"),
                  kv_offload_disk_size=1 / 1024) as llm:
        disk = llm.engine.kv_store.disk
        limits = resource.getrlimit(resource.RLIMIT_FSIZE)
        old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (32 * 1024, limits[1]))
        try:
            outs = warm_evict_probe(llm)
            disk.flush()
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, limits)
            signal.signal(signal.SIGXFSZ, old_handler)
        assert not disk.enabled and "File too large" in disk.error
        assert disk.stats.bytes_written <= 32 * 1024  # whole records written before the limit (maybe none)
        assert all(p.stat().st_size <= 32 * 1024 for p in disk.directory.glob(SEGMENT_GLOB))
        assert tier_metrics(llm.engine.kv_store) == {"tokenmill:kv_offload_enabled{tier=disk}": 0.0,
                                                     "tokenmill:kv_offload_errors_total{kind=enospc,tier=disk}": 1.0}
    assert token_ids(outs) == token_ids(reference)
    lines = log_lines(caplog)
    assert len(lines) == 1 and "KV offload disk tier disabled" in lines[0], lines


def _read_only(directory) -> tuple[str, callable]:
    """Make ``directory`` refuse new files for real: chmod 0500, or as root ``chattr +i``. Returns (how, undo);
    ("", no-op) when neither stops this process (root without CAP_LINUX_IMMUTABLE)."""
    if os.geteuid() != 0:
        directory.chmod(0o500)
        return "chmod", lambda: directory.chmod(0o700)
    if shutil.which("chattr") and subprocess.run(["chattr", "+i", str(directory)], capture_output=True).returncode == 0:
        return "chattr", lambda: subprocess.run(["chattr", "-i", str(directory)], check=True)
    return "", lambda: None


def test_a_read_only_directory_switches_the_disk_tier_off_and_serving_goes_on(tiny_llama, reference, tmp_path,
                                                                               caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger=LOGGERS)
    probe_dir = tmp_path / "probe"
    probe_dir.mkdir()
    how, undo = _read_only(probe_dir)
    undo()
    if not how:  # no real way to make a read-only directory here: the documented hook raises EROFS
        monkeypatch.setenv(envs.KV_OFFLOAD_DISK_FAULT, "EROFS")
    with make_llm(tiny_llama, num_kv_blocks=24, kv_offload_disk_path=str(tmp_path / "kv")) as llm:
        disk = llm.engine.kv_store.disk
        assert disk.enabled
        undo = _read_only(disk.directory)[1] if how else (lambda: None)
        try:
            outs = warm_evict_probe(llm)
            disk.flush()
        finally:
            undo()
        assert not disk.enabled and disk.stats.bytes_written == 0, disk.error
        assert tier_metrics(llm.engine.kv_store) == {"tokenmill:kv_offload_enabled{tier=disk}": 0.0,
                                                     "tokenmill:kv_offload_errors_total{kind=readonly,tier=disk}": 1.0}
    assert token_ids(outs) == token_ids(reference)
    lines = log_lines(caplog)
    assert len(lines) == 1 and "KV offload disk tier disabled" in lines[0], (how, lines)


def _records(directory, fingerprint) -> list[tuple[object, int, int]]:
    """(segment path, record offset, block hash) of every record on disk."""
    return [(path, r.offset, r.block_hash) for path in sorted(directory.glob(SEGMENT_GLOB))
            for r in scan_segment(path, fingerprint, BLOCK_BYTES)[0]]


def _flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0xA5]))


def test_corrupt_segments_at_a_restart_are_never_served(tiny_llama, reference, tmp_path, caplog):
    """A flipped payload byte, a header of an unknown version, a torn segment tail and a segment of another
    model's fingerprint holding the prefix's hashes: the restarted engine serves only the records that pass."""
    root = tmp_path / "kv"
    with make_llm(tiny_llama, num_kv_blocks=24, kv_offload_disk_path=str(root)) as first:
        warm_evict_probe(first)
        disk = first.engine.kv_store.disk
        directory, fingerprint = disk.directory, disk.fingerprint
    records = _records(directory, fingerprint)
    by_hash = {h: (path, offset) for path, offset, h in records}
    prefix, _, _ = prompt_set()
    hashes: list[int] = []
    extend_block_hashes(hashes, prefix, BLOCK_SIZE)
    assert all(h in by_hash for h in hashes)  # the 10 prefix blocks were saved
    path, offset = by_hash[hashes[6]]
    _flip(path, offset + HEADER_SIZE + 11)  # block 6: one payload byte
    # The last record that is not a prefix block gets a header of version 9: the scan stops before it.
    path, offset = max(((p, o) for p, o, h in records if h not in hashes), key=lambda r: (r[0].name, r[1]))
    with open(path, "r+b") as f:
        f.seek(offset + 4)
        f.write((9).to_bytes(2, "little"))
    lost = {h for p, o, h in records if p == path and o >= offset}
    assert not lost & set(hashes[:7])  # the prefix's blocks 0-6 stay indexed, so block 6 is read (and rejected)
    torn = directory / "segment-00000500.kvseg"  # a whole record, then a torn last write: half a record
    torn.write_bytes(encode_record(fingerprint, 12345, bytes(BLOCK_BYTES))
                     + encode_record(fingerprint, 12346, bytes(BLOCK_BYTES))[: RECORD // 2])
    foreign = bytes(31) + b"\x01"  # another model's blocks under the same hashes, checksummed, in the same directory
    (directory / "segment-00000999.kvseg").write_bytes(
        b"".join(encode_record(foreign, h, bytes([7]) * BLOCK_BYTES) for h in hashes))

    caplog.set_level(logging.INFO, logger=LOGGERS)
    with make_llm(tiny_llama, num_kv_blocks=24, kv_offload_disk_path=str(root)) as llm:
        outs = warm_evict_probe(llm, warm=False)
        store = llm.engine.kv_store
        assert store.disk.enabled and store.disk.stats.hits == 6  # blocks 0-5; block 6 failed its checksum
        # The torn tail and the version-9 header at startup, block 6 when read.
        assert store.disk.stats.errors == {"corrupt": 3}
        assert tier_metrics(store) == {"tokenmill:kv_offload_enabled{tier=disk}": 1.0,
                                       "tokenmill:kv_offload_errors_total{kind=corrupt,tier=disk}": 3.0}
    assert token_ids(outs) == token_ids(reference)
    assert outs[0].num_cached_tokens == 6 * BLOCK_SIZE
    assert torn.stat().st_size == RECORD  # the torn tail was cut off
    lines = log_lines(caplog)
    assert len(lines) == 1 and "corrupt" in lines[0], lines


def test_segments_corrupted_while_serving_are_recomputed(tiny_llama, reference, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=LOGGERS)
    with make_llm(tiny_llama, num_kv_blocks=24, kv_offload_disk_path=str(tmp_path / "kv")) as llm:
        prefix, fillers, _ = prompt_set()
        llm.generate({"prompt_token_ids": prefix + [1, 2, 3]}, GREEDY)
        for filler in fillers:
            llm.generate({"prompt_token_ids": filler}, GREEDY)
        disk = llm.engine.kv_store.disk
        disk.flush()
        records = _records(disk.directory, disk.fingerprint)
        assert len(records) >= 10
        for path, offset, _ in records:  # every record on disk: one payload byte each
            _flip(path, offset + HEADER_SIZE + 3)
        outs = warm_evict_probe(llm, warm=False)
        assert disk.enabled and disk.stats.hits == 0
        num_corrupt = disk.stats.errors["corrupt"]
        assert disk.stats.errors == {"corrupt": num_corrupt} and num_corrupt >= 1
        assert tier_metrics(llm.engine.kv_store)["tokenmill:kv_offload_errors_total{kind=corrupt,tier=disk}"] == (
            num_corrupt)
    assert token_ids(outs) == token_ids(reference) and outs[0].num_cached_tokens == 0
    lines = log_lines(caplog)
    assert len(lines) == 1 and "checksum mismatch" in lines[0], lines


def test_a_ram_tier_that_cannot_be_allocated_is_switched_off(tiny_llama, reference, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=LOGGERS)
    # A pebibyte of RAM tier: no allocator gives it; the disk tier below still works.
    with make_llm(tiny_llama, num_kv_blocks=24, kv_offload_memory=2.0**20,
                  kv_offload_disk_path=str(tmp_path / "kv")) as llm:
        outs = warm_evict_probe(llm)
        store = llm.engine.kv_store
        assert store.ram is None and store.disk.stats.hits == 10
        assert tier_metrics(store) == {"tokenmill:kv_offload_enabled{tier=disk}": 1.0,
                                       "tokenmill:kv_offload_enabled{tier=ram}": 0.0,
                                       "tokenmill:kv_offload_errors_total{kind=alloc,tier=ram}": 1.0}
    assert token_ids(outs) == token_ids(reference)
    lines = log_lines(caplog)
    assert len(lines) == 1 and "KV offload RAM tier disabled" in lines[0], lines


def test_the_fault_hook_fails_the_disk_writes_where_the_tier_calls_the_os(tmp_path, monkeypatch, caplog):
    """TOKENMILL_KV_OFFLOAD_DISK_FAULT=ENOSPC@BYTES: the records that fit in BYTES are written and readable, the
    next write fails as a full disk would, the tier switches off with one logged line."""
    monkeypatch.setenv(envs.KV_OFFLOAD_DISK_FAULT, f"ENOSPC@{2 * RECORD}")
    caplog.set_level(logging.INFO, logger=LOGGERS)
    disk = DiskTier(tmp_path, "ab" * 32, BLOCK_BYTES, capacity_bytes=1 << 20, batch_bytes=1)
    for h in range(4):
        disk.put(h, bytes([h]) * BLOCK_BYTES)
        disk.flush()
    assert not disk.enabled and "No space left on device" in disk.error
    assert disk.stats.bytes_written == 2 * RECORD and disk.stats.errors == {"enospc": 1} and disk.stats.enabled == 0
    disk.close()
    monkeypatch.delenv(envs.KV_OFFLOAD_DISK_FAULT)
    restarted = DiskTier(tmp_path, "ab" * 32, BLOCK_BYTES, capacity_bytes=1 << 20)
    assert sorted(restarted.hashes()) == [0, 1]  # what was written before the fault is kept for the next start
    restarted.close()
    assert len(log_lines(caplog)) == 1
    monkeypatch.setenv(envs.KV_OFFLOAD_DISK_FAULT, "ENOSPC@-1")
    with pytest.raises(ValueError, match="ERRNO@BYTES"):
        envs.kv_offload_disk_fault()
