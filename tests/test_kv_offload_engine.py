"""The lower KV tiers inside the engine: block data survives eviction and reload through the real
scheduler; greedy tokens and log-probabilities are the same whether a prefix was recomputed or
served from the primary pool, RAM or disk (also after a restart); a workload whose prefixes are
5x the pool is served from RAM and disk; damaged disk files are recomputed, never used."""
from __future__ import annotations

import logging
import random
import shutil

import pytest
import torch

from tests.scheduler_helpers import fake_forward, make_request, runner_output
from tests.tiny_models import make_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.config import SchedulerConfig
from tokenmill.engine.stats_logger import offload_summary
from tokenmill.kv_cache import KVCacheManager
from tokenmill.kv_cache.block_hash import extend_block_hashes
from tokenmill.kv_offload import DiskTier, TieredKVStore
from tokenmill.kv_offload.disk_format import scan_segment
from tokenmill.runner.kv_pool import KVPool
from tokenmill.scheduler import Scheduler

BLOCK_SIZE = 4
TOKEN_BYTES = 2 * 2 * 2 * 16 * 4  # tiny llama: 2 layers x K,V x 2 KV heads x head_dim 16 x float32
BLOCK_BYTES = BLOCK_SIZE * TOKEN_BYTES
GIB = 1024**3


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("llama")))


def test_block_data_survives_eviction_and_reload_through_the_scheduler(tmp_path):
    """A fake forward writes f(block_hash) into each block it completes and checks every block a
    request already counts as computed (prefix hits from any tier included) holds f(its hash)."""
    num_blocks = 10
    kv_cache = torch.zeros(1, 2, num_blocks, BLOCK_SIZE, 1, 2)  # (layers, 2, blocks, block_size, heads, dim)
    disk = DiskTier(tmp_path, "ab" * 32, 1 * 2 * BLOCK_SIZE * 1 * 2 * 4, capacity_bytes=1 << 20)
    store = TieredKVStore(KVPool.over(kv_cache), ram_blocks=6, disk=disk, max_staged_blocks=64)
    kv = KVCacheManager(num_blocks, BLOCK_SIZE, lower_tiers=store)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4, max_model_len=40), kv)
    rng = random.Random(3)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(8, 25))] for _ in range(6)]

    added = checked = 0
    for _ in range(5000):
        if added < 120 and rng.random() < 0.3:
            prompt = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(1, 8))]
            scheduler.add_request(make_request(f"r{added}", prompt, max_tokens=rng.randrange(1, 4)))
            added += 1
        if not scheduler.has_unfinished_requests():
            if added >= 120:
                break
            continue
        out = scheduler.schedule()
        store.transfer(out.blocks_to_offload, out.blocks_to_load)
        if out.is_empty:
            store.wait_for_loads(timeout=5)
            continue
        checked += fake_forward(out, kv_cache, BLOCK_SIZE)
        scheduler.update_from_output(out, runner_output(out, rng.randrange(3, 1000)))
    assert added == 120 and not scheduler.has_unfinished_requests()
    kv.check_integrity()
    assert store.ram.stats.hits > 0 and disk.stats.hits > 0 and checked > 500
    store.close(kv.cached_blocks())


def make_llm(path: str, **kwargs) -> LLM:
    kwargs.setdefault("max_model_len", 96)
    return LLM(model=path, dtype="float32", block_size=BLOCK_SIZE, max_num_batched_tokens=64, **kwargs)


def prompt_set(seed: int = 0):
    rng = random.Random(seed)
    prefix = [rng.randrange(100, 40000) for _ in range(40)]  # 10 blocks
    fillers = [[rng.randrange(100, 40000) for _ in range(40)] for _ in range(4)]  # evict the prefix from 24 blocks
    probes = [prefix + [rng.randrange(100, 40000) for _ in range(5)] for _ in range(2)]
    return prefix, fillers, probes


GREEDY = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)
PROMPT_LP = SamplingParams(temperature=0, max_tokens=2, logprobs=3, prompt_logprobs=2, ignore_eos=True)


def warm_evict_probe(llm: LLM, warm: bool = True):
    prefix, fillers, probes = prompt_set()
    if warm:
        llm.generate({"prompt_token_ids": prefix + [1, 2, 3]}, GREEDY)
        for filler in fillers:
            llm.generate({"prompt_token_ids": filler}, GREEDY)
    outs = llm.generate([{"prompt_token_ids": p} for p in probes], GREEDY)
    # Prompt log-probabilities need every prompt position computed: that request never uses a cache.
    outs += llm.generate({"prompt_token_ids": probes[0]}, PROMPT_LP)
    llm.engine.check_integrity()
    return outs


def token_logprobs(out) -> list[dict[int, float]]:
    return [{t: lp.logprob for t, lp in pos.items()} for pos in out.outputs[0].logprobs]


def test_outputs_identical_recomputed_or_from_primary_ram_disk_and_after_restart(tiny_llama, tmp_path):
    disk_dir = str(tmp_path / "kv")
    runs = {"recompute": warm_evict_probe(make_llm(tiny_llama, num_kv_blocks=256, enable_prefix_caching=False)),
            "primary": warm_evict_probe(make_llm(tiny_llama, num_kv_blocks=256))}
    ram_llm = make_llm(tiny_llama, num_kv_blocks=24, kv_offload_memory=200 * BLOCK_BYTES / GIB)
    runs["ram"] = warm_evict_probe(ram_llm)
    assert ram_llm.engine.kv_store.ram.stats.hits == 10
    with make_llm(tiny_llama, num_kv_blocks=24, kv_offload_disk_path=disk_dir) as disk_llm:
        runs["disk"] = warm_evict_probe(disk_llm)
        assert disk_llm.engine.kv_store.disk.stats.hits == 10 and disk_llm.engine.kv_store.ram is None
    with make_llm(tiny_llama, num_kv_blocks=24, kv_offload_disk_path=disk_dir) as restarted:
        runs["restart"] = warm_evict_probe(restarted, warm=False)
        assert restarted.engine.kv_store.disk.stats.hits >= 10

    reference = runs.pop("recompute")
    assert [o.num_cached_tokens for o in reference] == [0, 0, 0]
    for name, outs in runs.items():
        assert outs[0].num_cached_tokens >= 40 and outs[1].num_cached_tokens >= 40, name
        assert outs[2].num_cached_tokens == 0  # prompt log-probabilities are always computed
        for out, ref in zip(outs, reference):
            assert out.outputs[0].token_ids == ref.outputs[0].token_ids, name
            for pos, ref_pos in zip(token_logprobs(out), token_logprobs(ref)):
                assert pos.keys() == ref_pos.keys() and all(abs(pos[t] - ref_pos[t]) < 1e-5 for t in pos), name
        for pos, ref_pos in zip(outs[2].prompt_logprobs[1:], reference[2].prompt_logprobs[1:]):
            assert all(abs(lp.logprob - ref_pos[t].logprob) < 1e-5 for t, lp in pos.items())
    # The same KV bytes under the same batch shapes: the cached paths agree bit for bit.
    for name in ("ram", "disk"):
        assert [token_logprobs(o) for o in runs[name][:2]] == [token_logprobs(o) for o in runs["primary"][:2]], name


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_a_quantized_kv_cache_comes_back_from_ram_disk_and_a_restart_bit_for_bit(tiny_llama, tmp_path, kv_cache_dtype):
    """int8/fp8 blocks travel with their scales (the pool's byte rows): a prefix served from RAM, disk or a
    restarted engine's disk gives the tokens and log-probabilities of the same prefix served from the pool."""
    disk_dir = str(tmp_path / "kv")
    kw = {"kv_cache_dtype": kv_cache_dtype}
    runs = {"primary": warm_evict_probe(make_llm(tiny_llama, num_kv_blocks=256, **kw))}
    ram_llm = make_llm(tiny_llama, num_kv_blocks=24, kv_offload_memory=200 * BLOCK_BYTES / GIB, **kw)
    assert ram_llm.engine.kv_store.block_bytes == ram_llm.engine.runner.kv_pool.block_bytes > (
        ram_llm.engine.runner.kv_pool.kv_block_bytes)  # the scales travel in the same row
    runs["ram"] = warm_evict_probe(ram_llm)
    assert ram_llm.engine.kv_store.ram.stats.hits == 10
    with make_llm(tiny_llama, num_kv_blocks=24, kv_offload_disk_path=disk_dir, **kw) as disk_llm:
        runs["disk"] = warm_evict_probe(disk_llm)
        assert disk_llm.engine.kv_store.disk.stats.hits == 10
    with make_llm(tiny_llama, num_kv_blocks=24, kv_offload_disk_path=disk_dir, **kw) as restarted:
        runs["restart"] = warm_evict_probe(restarted, warm=False)
        assert restarted.engine.kv_store.disk.stats.hits >= 10
    with make_llm(tiny_llama, num_kv_blocks=24, kv_offload_disk_path=disk_dir) as other_dtype:  # float KV: not its blocks
        warm_evict_probe(other_dtype, warm=False)
        assert other_dtype.engine.kv_store.disk.stats.hits == 0
    for name in ("ram", "disk", "restart"):
        outs = runs[name]
        assert outs[0].num_cached_tokens >= 40 and outs[1].num_cached_tokens >= 40, name
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in runs["primary"]], name
        for out, ref in zip(outs[:2], runs["primary"][:2]):
            for pos, ref_pos in zip(token_logprobs(out), token_logprobs(ref)):
                assert pos.keys() == ref_pos.keys() and all(abs(pos[t] - ref_pos[t]) < 1e-5 for t in pos), name
    # The same KV bytes under the same batch shapes (warmed the same way): the cached paths agree bit for bit.
    for name in ("ram", "disk"):
        assert [token_logprobs(o) for o in runs[name][:2]] == [token_logprobs(o) for o in runs["primary"][:2]], name


def test_prefixes_five_times_the_pool_are_served_from_ram_and_disk(tiny_llama, tmp_path):
    rng = random.Random(1)
    prefixes = [[rng.randrange(100, 40000) for _ in range(48)] for _ in range(8)]  # 8 x 12 blocks = 96 blocks
    rounds = [[{"prompt_token_ids": p + [rng.randrange(100, 40000) for _ in range(3)]} for p in prefixes]
              for _ in range(3)]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    pool_blocks = 16  # the prefixes are 6x the pool
    recompute = make_llm(tiny_llama, num_kv_blocks=256, enable_prefix_caching=False)
    reference = [recompute.generate(r, params) for r in rounds]
    with make_llm(tiny_llama, num_kv_blocks=pool_blocks, max_model_len=64, kv_offload_memory=40 * BLOCK_BYTES / GIB,
                  kv_offload_disk_path=str(tmp_path / "kv")) as llm:
        outs = [llm.generate(r, params) for r in rounds]
        store = llm.engine.kv_store
        ram, disk = store.ram.stats, store.disk.stats
        assert ram.hits > 0 and disk.hits > 0, store.snapshot()
        assert ram.evictions > 0 and disk.bytes_written > 0 and ram.bytes_read == ram.hits * BLOCK_BYTES
        # Rounds 2 and 3 find (nearly) every prefix block, almost all of them below the pool.
        cached = sum(o.num_cached_tokens for r in outs[1:] for o in r)
        assert cached >= 0.9 * 2 * 8 * 48, [[o.num_cached_tokens for o in r] for r in outs]
        assert (ram.hits + disk.hits) * BLOCK_SIZE >= 0.75 * cached
        summary = offload_summary(store)  # the periodic stats line
        assert f"ram {ram.hits} hit blocks" in summary and f"disk {disk.hits} hit blocks" in summary
        assert "disk DWPD" in summary
    for got, ref in zip(outs, reference):
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]


def prefix_hashes() -> list[int]:
    prefix, _, _ = prompt_set()
    hashes: list[int] = []
    extend_block_hashes(hashes, prefix, BLOCK_SIZE)
    return hashes


def test_damaged_disk_files_are_recomputed_with_a_warning(tiny_llama, tmp_path, caplog):
    saved = tmp_path / "saved"
    with make_llm(tiny_llama, num_kv_blocks=24, kv_offload_disk_path=str(saved)) as first:
        reference = warm_evict_probe(first)
        fingerprint = first.engine.kv_store.disk.fingerprint
        subdir = first.engine.kv_store.disk.directory.name
    hashes = prefix_hashes()
    caplog.set_level(logging.WARNING, logger="tokenmill.kv_offload.disk_tier")

    def locate(root, block_hash):
        for path in sorted((root / subdir).glob("segment-*.kvseg")):
            for record in scan_segment(path, fingerprint, BLOCK_BYTES)[0]:
                if record.block_hash == block_hash:
                    return path, record.offset
        raise AssertionError("block not on disk")

    def probe(root, damage_after_start=None):
        caplog.clear()
        with make_llm(tiny_llama, num_kv_blocks=24, kv_offload_disk_path=str(root)) as llm:
            if damage_after_start is not None:
                damage_after_start()
            outs = warm_evict_probe(llm, warm=False)
        for out, ref in zip(outs, reference):
            assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        return outs[0].num_cached_tokens

    corrupt = tmp_path / "corrupt"
    shutil.copytree(saved, corrupt)
    path, offset = locate(corrupt, hashes[5])
    with open(path, "r+b") as f:  # flip one byte in block 5's payload
        f.seek(offset + 64 + 7)
        byte = f.read(1)[0]
        f.seek(offset + 64 + 7)
        f.write(bytes([byte ^ 0x55]))
    assert probe(corrupt) == 5 * BLOCK_SIZE  # blocks 0-4 from disk, the rest recomputed
    assert "checksum mismatch" in caplog.text

    truncated = tmp_path / "truncated"
    shutil.copytree(saved, truncated)
    path, offset = locate(truncated, hashes[5])
    with open(path, "r+b") as f:  # a torn write in the middle of block 5's record
        f.truncate(offset + 100)
    assert probe(truncated) < 10 * BLOCK_SIZE
    assert "truncated record" in caplog.text

    deleted = tmp_path / "deleted"
    shutil.copytree(saved, deleted)

    def delete_segments():
        for segment in (deleted / subdir).glob("segment-*.kvseg"):
            segment.unlink()

    assert probe(deleted, damage_after_start=delete_segments) == 0
    assert "cannot read the segment" in caplog.text


def test_unwritable_disk_path_keeps_serving_with_the_ram_tier(tiny_llama, tmp_path, caplog):
    (tmp_path / "file").write_text("")
    caplog.set_level(logging.ERROR, logger="tokenmill.kv_offload.disk_tier")
    with make_llm(tiny_llama, num_kv_blocks=24, kv_offload_memory=200 * BLOCK_BYTES / GIB,
                  kv_offload_disk_path=str(tmp_path / "file" / "kv")) as llm:
        outs = warm_evict_probe(llm)
        store = llm.engine.kv_store
        assert not store.disk.enabled and "Not a directory" in store.disk.error
        assert store.ram.stats.hits == 10 and outs[0].num_cached_tokens == 40
        assert store.snapshot()["disk"]["enabled"] is False
    assert "KV offload disk tier disabled" in caplog.text
