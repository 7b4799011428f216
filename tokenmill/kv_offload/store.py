"""TieredKVStore: the KV tiers below the primary pool (host RAM, then disk) behind one facade.

Engine thread only (the disk tier runs its own writer and loader threads). It implements the KV
cache manager's ``LowerTiers`` (lookup, load_async) and does each step's copies through the runner's
``KVPool`` (``transfer``), so the scheduler and the KV cache manager stay torch-free. A block is the pool's
byte row (``KVPool.block_bytes``: K/V, then the scales of an int8/fp8 KV cache) in every tier.

Flow (write-back): a cached block evicted from the primary pool is copied to RAM before the step's
forward can overwrite it; RAM evicts least recently used blocks to the disk writer (unless the
disk already holds them). A prefix hit in RAM is copied back into the pool before the forward; a
hit on disk is first read by the disk loader into a staging area while the request waits.

Hybrid models (``linear_state``, set by the engine hook): a block written to disk carries its linear-attention
state checkpoint when one is held for its hash, and a checkpoint read back with its block is installed among the
prefix cache's checkpoints as soon as it arrives, so the hit resumes from it as from a RAM-tier hit.
"""
from __future__ import annotations

import logging
import queue
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Protocol

import torch

from tokenmill.config import ConfigError
from tokenmill.kv_cache.offload_planner import DISK_TIER, RAM_TIER
from tokenmill.kv_offload.disk_format import HEADER_SIZE
from tokenmill.kv_offload.disk_tier import DiskTier
from tokenmill.kv_offload.ram_tier import RamTier
from tokenmill.kv_offload.stats import TierStats, drive_writes_per_day

if TYPE_CHECKING:
    from tokenmill.runner.kv_pool import KVPool

logger = logging.getLogger(__name__)

GIB = 1024**3


class LinearStateCheckpoints(Protocol):
    """What the store asks of a hybrid model's state checkpoints (``LinearStateCache``)."""

    def checkpoint_payload(self, block_hash: int) -> bytes | None:
        """The bytes of the checkpoint held for ``block_hash`` (``bytes_per_sequence`` of them), or None."""
        ...

    def install_checkpoint(self, block_hash: int, payload: memoryview | bytes) -> bool:
        """Make ``payload`` (as ``checkpoint_payload`` gave it) the checkpoint of ``block_hash``; False when
        it is already held or no checkpoint slot can be taken now."""
        ...


class TieredKVStore:
    """Host-RAM and disk tiers under one primary KV pool.

    Args:
        pool: the primary pool (the runner's ``KVPool``).
        ram_blocks: RAM tier capacity in blocks (0: no RAM tier).
        disk: the disk tier, or None.
        max_staged_blocks: most blocks read back from disk and not yet taken by a request.
        drive_bytes: size of the drive under the disk tier, for the DWPD estimate.
        linear_state: a hybrid model's prefix-cache state checkpoints, written to disk with their block and read
            back with it; None for other models.
    """

    def __init__(self, pool: KVPool, ram_blocks: int, disk: DiskTier | None, max_staged_blocks: int,
                 drive_bytes: int = 0, linear_state: LinearStateCheckpoints | None = None) -> None:
        self.pool = pool
        self.block_bytes = pool.block_bytes
        self.ram: RamTier | None = None
        self.ram_off: TierStats | None = None  # the RAM tier's counters when its slab could not be allocated
        if ram_blocks:
            try:
                self.ram = RamTier(ram_blocks, self.block_bytes, pin_memory=pool.device.type == "cuda")
            except (RuntimeError, MemoryError) as exc:  # torch's allocators raise RuntimeError subclasses
                self.ram_off = TierStats(capacity_blocks=ram_blocks, enabled=0, errors={"alloc": 1})
                logger.warning("KV offload RAM tier disabled: cannot allocate %d blocks (%.2f GiB): %s; serving "
                               "continues without it", ram_blocks, ram_blocks * self.block_bytes / GIB,
                               str(exc).splitlines()[0] if str(exc) else repr(exc))
        self.disk = disk
        self.max_staged_blocks = max(1, max_staged_blocks)
        self.drive_bytes = drive_bytes
        self._staged: OrderedDict[int, torch.Tensor] = OrderedDict()  # read back from disk, oldest first
        self._loading: set[int] = set()  # block hashes the disk loader is reading
        self._arrived: queue.SimpleQueue = queue.SimpleQueue()  # (block_hash, payload | None) from the loader
        self._start = time.monotonic()
        self._closed = False
        # Blocks made with weights no longer served (an update without a flush): never written below the pool.
        self.stale_hashes: set[int] = set()
        self.linear_state = linear_state  # hybrid models: checkpoints travel with blocks
        self.transfer_seconds = 0.0  # engine-thread time spent in per-step copies
        self.load_wait_seconds = 0.0  # engine-thread time spent waiting for disk reads (nothing else to run)

    def set_kv_events(self, collector) -> None:
        """Report every block stored in or evicted from the RAM and disk tiers to ``collector`` (a
        ``tokenmill.kv_events.KVEventCollector``); the disk's blocks from an earlier run are reported now."""
        if self.ram is not None:
            self.ram.kv_events = collector
        if self.disk is not None:
            self.disk.kv_events = collector
            if self._disk_on:
                collector.hashes_stored(self.disk.hashes(), self.disk.name)

    @property
    def _disk_on(self) -> bool:
        return self.disk is not None and self.disk.enabled

    # ---- LowerTiers (called while the scheduler plans; changes nothing stored) ------------------
    def lookup(self, block_hashes: list[int]) -> list[str]:
        """RAM_TIER / DISK_TIER for each leading hash held below the primary pool, up to the first miss."""
        tiers = []
        for h in block_hashes:
            if h in self._staged or (self.ram is not None and h in self.ram):
                tiers.append(RAM_TIER)
            elif h in self._loading or (self._disk_on and h in self.disk):
                tiers.append(DISK_TIER)
            else:
                break
        return tiers

    def load_async(self, block_hashes: list[int]) -> None:
        """Start reading blocks from disk (those not already read or being read)."""
        new = [h for h in block_hashes if h not in self._loading and h not in self._staged]
        if new and self.disk is not None:
            self._loading.update(new)
            self.disk.load(new, self._on_loaded)

    def _on_loaded(self, block_hash: int, payload) -> None:  # disk loader thread
        self._arrived.put((block_hash, payload))

    def has_pending_loads(self) -> bool:
        return bool(self._loading)

    def wait_for_loads(self, timeout: float) -> None:
        """Block until at least one disk read in flight finishes (or ``timeout`` seconds pass)."""
        if not self._loading:
            return
        t0 = time.perf_counter()
        try:
            self._stage(*self._arrived.get(timeout=timeout))
        except queue.Empty:
            return
        finally:
            self.load_wait_seconds += time.perf_counter() - t0
        self._drain_arrived()

    def _drain_arrived(self) -> None:
        while True:
            try:
                item = self._arrived.get_nowait()
            except queue.Empty:
                return
            self._stage(*item)

    def _stage(self, block_hash: int, payload) -> None:
        self._loading.discard(block_hash)
        if payload is None:  # gone or bad: later lookups stop before it and the block is recomputed
            return
        if len(payload) > self.block_bytes:  # a hybrid model's block with its state checkpoint after the KV bytes
            if self.linear_state is not None:
                self.linear_state.install_checkpoint(block_hash, memoryview(payload)[self.block_bytes:])
            payload = memoryview(payload)[: self.block_bytes]
        buf = payload if isinstance(payload, memoryview) and not payload.readonly else bytearray(payload)
        self._staged[block_hash] = torch.frombuffer(buf, dtype=torch.uint8)  # one byte row
        self._staged.move_to_end(block_hash)
        while len(self._staged) > self.max_staged_blocks:
            self._staged.popitem(last=False)

    # ---- the per-step copies ------------------------------------------------------------------
    @torch.inference_mode()
    def transfer(self, blocks_to_offload: list[tuple[int, int]], blocks_to_load: list[tuple[int, int]]) -> None:
        """Before the step's forward: copy evicted blocks out, then fill loaded blocks in, then store
        what was copied out (so storing cannot push out a block this step loads)."""
        t0 = time.perf_counter()
        gathered = self._gather(blocks_to_offload) if blocks_to_offload else None
        if blocks_to_load:
            self._load(blocks_to_load)
        if gathered is not None:
            self._store(*gathered)
        self._drain_arrived()
        self.transfer_seconds += time.perf_counter() - t0

    def _gather(self, blocks: list[tuple[int, int]]) -> tuple[list[int], torch.Tensor] | None:
        block_ids, hashes, seen = [], [], set()
        for block_id, h in blocks:
            if h in seen:
                continue
            seen.add(h)
            if h in self.stale_hashes:  # made with earlier weights: dropped, not kept below the pool
                if self.ram is None or h not in self.ram:
                    self.stale_hashes.discard(h)
                continue
            if self.ram is not None and h in self.ram:
                self.ram.touch(h)
                continue
            if self.ram is None and (not self._disk_on or h in self.disk):
                continue
            block_ids.append(block_id)
            hashes.append(h)
        if not block_ids:
            return None
        return hashes, self.pool.gather(block_ids)  # (k, block_bytes) uint8

    def _load(self, blocks: list[tuple[int, int]]) -> None:
        from_ram = [(b, h) for b, h in blocks if self.ram is not None and h in self.ram]
        from_disk = [(b, h) for b, h in blocks if self.ram is None or h not in self.ram]  # staged disk reads
        if from_ram:
            self._copy_in([b for b, _ in from_ram], self.ram.read([h for _, h in from_ram]))
            self.ram.stats.hits += len(from_ram)
        if from_disk:
            assert all(h in self._staged for _, h in from_disk), "a block planned for loading is not in host memory"
            self._copy_in([b for b, _ in from_disk], torch.stack([self._staged[h] for _, h in from_disk]))
            self.disk.stats.hits += len(from_disk)
        for _, h in blocks:
            self._staged.pop(h, None)

    def _copy_in(self, block_ids: list[int], data: torch.Tensor) -> None:
        self.pool.scatter(block_ids, data)  # data: (k, block_bytes) uint8

    def _store(self, hashes: list[int], data: torch.Tensor) -> None:
        evicted = self.ram.write(hashes, data) if self.ram is not None else list(zip(hashes, data))
        for h, block in evicted:
            if h in self.stale_hashes:
                self.stale_hashes.discard(h)
            elif self._disk_on and h not in self.disk:
                self.disk.put(h, self._disk_payload(h, block))

    # ---- weight updates (tokenmill/rl): flush, or keep old blocks out of reach ---------------------
    def mark_stale(self, pool_hashes: list[int]) -> None:
        """The weights changed without a flush: the pool's cached blocks (``pool_hashes``) and the RAM
        tier's were made with the old weights. They stay where they are (their block hashes no longer
        match any request) but are never written to a lower tier, so no tier under a new fingerprint
        ever holds them."""
        self.stale_hashes.update(pool_hashes)
        if self.ram is not None:
            self.stale_hashes.update(self.ram.hashes())

    def clear(self, clear_disk: bool) -> None:
        """Drop every block below the pool: the RAM tier, blocks read back from disk and not yet
        taken, and with ``clear_disk`` every disk record of this fingerprint (files deleted)."""
        if self.ram is not None:
            self.ram.clear()
        self._drop_staged()
        self.stale_hashes.clear()
        if clear_disk and self._disk_on:
            self.disk.clear()

    def _drop_staged(self) -> None:
        self._staged.clear()
        while True:
            try:
                block_hash, _ = self._arrived.get_nowait()
            except queue.Empty:
                return
            self._loading.discard(block_hash)

    def replace_disk(self, fingerprint: str) -> None:
        """Move the disk tier to ``<root>/<fingerprint[:16]>`` (the weights changed): the old tier is
        flushed and closed, so its records stay under the old fingerprint, readable only by an engine
        serving those weights; the new directory's records (if an earlier run served these weights) are
        reported stored. Reads in flight are dropped."""
        old = self.disk
        if old is None:
            return
        collector = old.kv_events
        old.close()  # its loader finishes the reads queued so far; they are dropped just below
        self._drop_staged()
        self._loading.clear()
        if collector is not None:
            collector.all_cleared(old.name)
        self.disk = DiskTier(old.root, fingerprint, old.block_bytes, old.capacity_bytes, old.segment_bytes,
                             old.batch_bytes, old.max_pending_bytes, old.max_delay_s, old.state_bytes)
        self.disk.kv_events = collector
        if collector is not None and self._disk_on:
            collector.hashes_stored(self.disk.hashes(), self.disk.name)

    # ---- reporting and shutdown -----------------------------------------------------------------
    def dwpd(self) -> float | None:
        """Disk drive-writes-per-day at the average write rate since start (None without a disk tier)."""
        if self.disk is None:
            return None
        return drive_writes_per_day(self.disk.stats.bytes_written, time.monotonic() - self._start, self.drive_bytes)

    def tier_stats(self) -> dict[str, dict[str, int]]:
        """Counters per enabled tier ("ram", "disk"): bytes_written, bytes_read, hits (blocks), ..."""
        out = {}
        if self.ram_off is not None:
            out[RamTier.name] = self.ram_off.as_dict()
        for tier in (self.ram, self.disk):
            if tier is not None:
                out[tier.name] = tier.stats.as_dict()
        return out

    def snapshot(self) -> dict:
        """Everything for /debug/kv_cache."""
        return {
            "ram": self.ram.stats.as_dict() if self.ram is not None else
            self.ram_off.as_dict() if self.ram_off is not None else None,
            "disk": {**self.disk.snapshot(), "dwpd": self.dwpd()} if self.disk is not None else None,
            "staged_blocks": len(self._staged),
            "loading_blocks": len(self._loading),
            "transfer_seconds": self.transfer_seconds,
            "load_wait_seconds": self.load_wait_seconds,
        }

    def close(self, cached_blocks: list[tuple[int, int]] | None = None) -> None:
        """Shut down. With ``cached_blocks`` (the primary pool's (block_id, block_hash), least recent
        first; their data must be valid), first write every block held only in the primary pool or
        in RAM to disk, so that a restarted engine finds them; then flush the disk tier, sync it and
        release its directory lock. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self.disk is None:
            return
        if self._disk_on and cached_blocks is not None:
            t0 = time.perf_counter()
            num_saved = 0
            if self.ram is not None:
                for h in self.ram.hashes():
                    if h not in self.disk and h not in self.stale_hashes:
                        num_saved += self.disk.put(h, self._disk_payload(h, self.ram.block(h)), wait=True)
            todo = [(b, h) for b, h in cached_blocks if h not in self.disk and h not in self.stale_hashes]
            for start in range(0, len(todo), 64):
                chunk = todo[start : start + 64]
                data = self.pool.gather([b for b, _ in chunk])
                for (_, h), block in zip(chunk, data):
                    num_saved += self.disk.put(h, self._disk_payload(h, block), wait=True)
            self.disk.flush()
            logger.info("KV offload: saved %d blocks to disk at shutdown in %.2fs", num_saved, time.perf_counter() - t0)
        self.disk.close()

    def _disk_payload(self, block_hash: int, block: torch.Tensor) -> bytes:
        """A block's disk payload: its KV bytes, then its state checkpoint's when one is held (hybrid models)."""
        data = _block_bytes(block)
        if self.linear_state is not None:
            state = self.linear_state.checkpoint_payload(block_hash)
            if state is not None:
                data += state
        return data


def _block_bytes(block: torch.Tensor) -> bytes:
    """One block's byte row (``KVPool.block_bytes``) as bytes."""
    return block.to("cpu").contiguous().numpy().tobytes()


def build_kv_store(cache, pool: KVPool, loaded, max_model_len: int,
                   linear_state: LinearStateCheckpoints | None = None) -> TieredKVStore | None:
    """The store for a ``CacheConfig`` (None when no lower tier is configured). For a hybrid model the disk
    tier's records may carry one state checkpoint each (its size from the model's linear layers), from and to
    ``linear_state`` (the runner's state cache when it keeps prefix-cache checkpoints).

    Raises:
        ValueError: ``kv_offload_memory`` too small for one block.
    """
    if not cache.kv_offload_enabled:
        return None
    block_size, num_blocks, block_bytes = pool.block_shape[2], pool.num_blocks, pool.block_bytes
    ram_blocks = int(cache.kv_offload_memory_gib * GIB) // block_bytes
    if cache.kv_offload_memory_gib > 0 and ram_blocks < 1:
        raise ConfigError(
            f"`kv_offload_memory` of {cache.kv_offload_memory_gib} GiB holds no KV block of {block_bytes} bytes"
        )
    if cache.kv_offload_disk_path and int(cache.disk_tier_size_gib * GIB) < HEADER_SIZE + block_bytes:
        raise ConfigError(
            f"`kv_offload_disk_size` of {cache.disk_tier_size_gib} GiB holds no KV block of "
            f"{HEADER_SIZE + block_bytes} bytes (with its record header)"
        )
    disk = None
    if cache.kv_offload_disk_path:
        from tokenmill.kv_offload.fingerprint import model_fingerprint

        t0 = time.perf_counter()
        fingerprint = model_fingerprint(loaded.model, loaded.hf_config, loaded.dtype, block_size, pool.dtype)
        logger.info("KV offload: model fingerprint %s (%.2fs)", fingerprint[:16], time.perf_counter() - t0)
        disk = DiskTier(cache.kv_offload_disk_path, fingerprint, block_bytes, int(cache.disk_tier_size_gib * GIB),
                        state_bytes=_checkpoint_bytes(loaded) if cache.enable_prefix_caching else 0)
    drive_gib = cache.kv_offload_disk_drive_size_gib or cache.disk_tier_size_gib
    max_staged = min(num_blocks, 4 * -(-max_model_len // block_size))
    store = TieredKVStore(pool, ram_blocks, disk, max_staged, int(drive_gib * GIB), linear_state)
    logger.info("KV offload tiers: RAM %d blocks (%.2f GiB), disk %s", ram_blocks, ram_blocks * block_bytes / GIB,
                "off" if disk is None
                else f"{cache.disk_tier_size_gib} GiB at {cache.kv_offload_disk_path}" if disk.enabled
                else f"DISABLED ({disk.error})")
    return store


def _checkpoint_bytes(loaded) -> int:
    """Bytes of one linear-attention state checkpoint of a hybrid model (0 for other models)."""
    if not getattr(loaded.model, "is_hybrid", False):
        return 0
    from tokenmill.kv_cache.state_slots import state_bytes_per_sequence

    return state_bytes_per_sequence(*loaded.model.linear_state_shapes(), loaded.dtype.itemsize)
