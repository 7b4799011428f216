"""DiskTier: the disk KV tier, log-structured segment files under ``<root>/<fingerprint[:16]>/``.

- Writes are buffered in memory and written by one writer thread in large sequential batches
  (records appended to the current segment, a new segment once it is full); ``put`` never
  blocks on I/O. A block still in the buffer is served from it.
- Reads run on one loader thread; every read (after a restart too: the index rebuilt from the headers
  only points at records, and their bytes are checked when read) verifies the record's checksum,
  fingerprint and hash. A hybrid model's block may carry its linear-attention state checkpoint after the KV bytes
  (``state_bytes``; a version 2 record, ``disk_format``); the payload handed back then includes it. A bad record is dropped from the index and reported as a miss (recomputed).
- The index (block_hash -> segment, offset) lives in memory and is rebuilt at startup from the
  segment headers; a torn or truncated tail is detected there, ignored and cut off the file.
- Capacity is enforced by deleting whole segments, least recently used first; a segment's
  recency is that of its most recently read or written record.
- A lock file (flock) keeps two processes out of one directory. Any OSError while creating,
  locking or writing (unwritable path, ENOSPC, EFBIG, EROFS) disables the tier with one logged error;
  the engine keeps serving without it (the records already written stay for the next start).
- Faults are counted by kind in ``stats.errors`` (``stats.FAULT_KINDS``); only the first of each kind is
  logged as a warning, the rest at debug level, so a damaged directory never floods the log.
- ``TOKENMILL_KV_OFFLOAD_DISK_FAULT`` (tests only, ``envs.kv_offload_disk_fault``) makes the writes fail with
  a given errno at the OS-call boundary, where no real full or read-only filesystem can be made.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from tokenmill import envs
from tokenmill.kv_offload.disk_format import HEADER_SIZE, check_record, encode_record, scan_segment
from tokenmill.kv_offload.stats import TierStats

logger = logging.getLogger(__name__)

MIB = 1024**2
SEGMENT_GLOB = "segment-*.kvseg"
LOCK_NAME = "lock"
DEFAULT_SEGMENT_BYTES = 64 * MIB


@dataclass(eq=False)
class _Segment:
    seg_id: int
    path: Path
    size: int = 0  # bytes of the file counted against capacity
    recency: int = 0  # logical clock of its most recent read or write
    hashes: list[int] = field(default_factory=list)
    dropped: bool = False  # deleted (or found missing): its records are out of the index


class DiskTier:
    """Block store on local disk, keyed by (model fingerprint, block hash).

    Args:
        root: the ``--kv-offload-disk-path`` directory; blocks live in ``root/fingerprint[:16]/``.
        fingerprint: hex sha256 of the model (``model_fingerprint``); each record carries it too.
        block_bytes: payload size of one block.
        capacity_bytes: most bytes of segment files kept.
        segment_bytes: target segment size (default: capacity / 8, at most 64 MiB, at least one record).
        batch_bytes: the writer writes once this much is buffered (or after ``max_delay_s``).
        max_pending_bytes: buffer bound; blocks offered while it is full are dropped (counted),
            so a slow disk never stalls the engine.
        state_bytes: bytes of one linear-attention state checkpoint a block may carry after its KV bytes
            (hybrid models; 0: none). Records with state of another size are ignored at startup.
    """

    name = "disk"

    def __init__(
        self,
        root: str | Path,
        fingerprint: str,
        block_bytes: int,
        capacity_bytes: int,
        segment_bytes: int | None = None,
        batch_bytes: int = 8 * MIB,
        max_pending_bytes: int = 256 * MIB,
        max_delay_s: float = 0.5,
        state_bytes: int = 0,
    ) -> None:
        self.root = Path(root)
        self.fingerprint = bytes.fromhex(fingerprint)
        self.directory = self.root / fingerprint[:16]
        self.block_bytes = block_bytes
        self.state_bytes = state_bytes
        self.record_bytes = HEADER_SIZE + block_bytes  # without state
        self.capacity_bytes = capacity_bytes
        self.segment_bytes = segment_bytes or max(self.record_bytes, min(DEFAULT_SEGMENT_BYTES, capacity_bytes // 8))
        self.batch_bytes = batch_bytes
        self.max_pending_bytes = max(max_pending_bytes, self.record_bytes + state_bytes)
        self.max_delay_s = max_delay_s
        self.stats = TierStats(capacity_blocks=capacity_bytes // self.record_bytes)
        self.dropped_blocks = 0  # offered while the write buffer was full
        self.kv_events = None  # a KVEventCollector when KV events are on (reported from every thread)
        self.enabled = False
        self.error: str | None = None
        self._warned: set[str] = set()  # fault kinds already logged as a warning
        self._fault_injection = envs.kv_offload_disk_fault()  # (errno, bytes first written), tests only
        self._cond = threading.Condition()  # guards everything below
        self._index: dict[int, tuple[_Segment, int, int]] = {}  # block_hash -> (segment, record offset, state length)
        self._segments: dict[int, _Segment] = {}
        self._pending: OrderedDict[int, bytes] = OrderedDict()  # written by the writer, oldest first
        self._pending_bytes = 0
        self._pending_since: float | None = None
        self._writing = False
        self._flush_requests = 0
        self._stopping = False
        self._closed = False
        self._clock = 0
        self._used = 0
        self._current: _Segment | None = None  # the segment being appended (writer thread)
        self._file = None
        self._lock_fd: int | None = None
        self._loads: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        if capacity_bytes < self.record_bytes:
            self._disable(f"kv_offload_disk_size of {capacity_bytes} bytes holds no block of {self.record_bytes} bytes")
            return
        try:
            self._open()
        except OSError as exc:
            self._disable(f"cannot use {self.directory}: {exc}", fault_kind(exc))
            return
        self.enabled = True
        for target, name in ((self._write_loop, "tokenmill-kv-disk-writer"),
                             (self._load_loop, "tokenmill-kv-disk-loader")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    # ---- startup --------------------------------------------------------------------------
    def _open(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise OSError(errno.EBUSY, f"directory in use by another tokenmill process (pid {owner})") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd
        paths = sorted(self.directory.glob(SEGMENT_GLOB), key=lambda p: _segment_id(p) or 0)
        num_blocks = 0
        for path in paths:
            seg_id = _segment_id(path)
            if seg_id is None:
                continue
            records, valid_bytes, problem = scan_segment(path, self.fingerprint, self.block_bytes, self.state_bytes)
            if problem is not None:
                self._fault("corrupt", f"{path}: {problem}; the rest of the segment is ignored")
                if problem.startswith("truncated record") or path.stat().st_size - valid_bytes < HEADER_SIZE:
                    _truncate(path, valid_bytes)  # a torn write: cut it off (a segment is never appended to again)
            self._clock += 1
            seg = _Segment(seg_id, path, size=path.stat().st_size, recency=self._clock)
            for record in records:
                self._index[record.block_hash] = (seg, record.offset, record.state_len)
                seg.hashes.append(record.block_hash)
            num_blocks += len(records)
            self._segments[seg_id] = seg
            self._used += seg.size
        self._make_room(0)
        self.stats.blocks_stored = len(self._index)
        logger.info("KV offload disk tier at %s: %d blocks in %d segments (%.1f MiB of %.1f MiB)",
                    self.directory, len(self._index), len(self._segments), self._used / MIB, self.capacity_bytes / MIB)

    # ---- engine-thread side ---------------------------------------------------------------
    def __contains__(self, block_hash: int) -> bool:
        with self._cond:
            return block_hash in self._index or block_hash in self._pending

    def __len__(self) -> int:
        with self._cond:
            return len(self._index) + sum(1 for h in self._pending if h not in self._index)

    def hashes(self) -> list[int]:
        """Every block hash held (written or buffered)."""
        with self._cond:
            return list(self._index) + [h for h in self._pending if h not in self._index]

    def put(self, block_hash: int, payload: bytes, wait: bool = False) -> bool:
        """Queue one block for writing: ``payload`` is its ``block_bytes`` of KV, or those followed by
        ``state_bytes`` of its linear-attention state checkpoint. Returns False if it is already stored, the
        tier is off, or the buffer is full (``wait=False``; the block is dropped) — never blocks unless
        ``wait``."""
        assert len(payload) == self.block_bytes or (self.state_bytes and len(payload) == self.block_bytes
                                                    + self.state_bytes)
        with self._cond:
            if not self.enabled or block_hash in self._index or block_hash in self._pending:
                return False
            while wait and self.enabled and self._pending_bytes + len(payload) > self.max_pending_bytes:
                self._cond.wait()
            if not self.enabled:
                return False
            if self._pending_bytes + len(payload) > self.max_pending_bytes:
                self.dropped_blocks += 1
                return False
            if not self._pending:
                self._pending_since = time.monotonic()
                self._cond.notify_all()  # the writer starts its max_delay_s clock
            self._pending[block_hash] = payload
            self._pending_bytes += len(payload)
            if self.kv_events is not None:  # served from the buffer until written, so held from now on
                self.kv_events.hashes_stored((block_hash,), self.name)
            if self._pending_bytes >= self.batch_bytes:
                self._cond.notify_all()
            return True

    def load(self, block_hashes: list[int], on_done: Callable[[int, memoryview | bytes | None], None]) -> None:
        """Read blocks on the loader thread; ``on_done(block_hash, payload or None)`` for each, from
        that thread. None means a miss (gone, or bad and now dropped); a payload longer than ``block_bytes``
        carries the block's state checkpoint after its KV bytes."""
        self._loads.put((list(block_hashes), on_done))

    def flush(self) -> None:
        """Block until everything buffered so far is written (or the tier is disabled)."""
        with self._cond:
            self._flush_requests += 1
            self._cond.notify_all()
            while self.enabled and (self._pending or self._writing):
                self._cond.wait()
            self._flush_requests -= 1

    def clear(self) -> None:
        """Delete every record: flush the write buffer, then drop all segments (files deleted);
        reported as AllBlocksCleared. Engine thread (the only one that puts)."""
        if not self.enabled:
            return
        self.flush()
        with self._cond:
            collector, self.kv_events = self.kv_events, None  # one AllBlocksCleared, not one event per block
            try:
                for seg in list(self._segments.values()):
                    self._drop_segment(seg, delete_file=True)
            finally:
                self.kv_events = collector
            if collector is not None:
                collector.all_cleared(self.name)

    def close(self) -> None:
        """Flush, stop the threads, sync the current segment and release the directory lock."""
        if self._closed:
            return
        self._closed = True
        if self.enabled:
            self.flush()
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._loads.put(None)
        for thread in self._threads:
            thread.join(timeout=60)
        self._close_current(sync=True)
        if self._lock_fd is not None:
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
                os.close(self._lock_fd)
            except OSError:
                pass
            self._lock_fd = None

    def snapshot(self) -> dict:
        with self._cond:
            return {
                **self.stats.as_dict(), "enabled": self.enabled, "error": self.error, "path": str(self.directory),
                "capacity_bytes": self.capacity_bytes, "used_bytes": self._used, "num_segments": len(self._segments),
                "pending_bytes": self._pending_bytes, "dropped_blocks": self.dropped_blocks,
            }

    # ---- writer thread --------------------------------------------------------------------
    def _write_loop(self) -> None:
        while True:
            with self._cond:
                while True:
                    if not self.enabled or (self._stopping and not self._pending):
                        return
                    if self._pending and (
                        self._pending_bytes >= self.batch_bytes or self._flush_requests or self._stopping
                        or time.monotonic() - self._pending_since >= self.max_delay_s
                    ):
                        break
                    self._cond.wait(self.max_delay_s if self._pending else None)
                batch = list(self._pending.items())
                self._writing = True
            try:
                self._write_batch(batch)
            except OSError as exc:
                self._disable(f"writing to {self.directory} failed: {exc}", fault_kind(exc))
            except Exception as exc:  # noqa: BLE001 - the tier must switch off, not kill serving
                logger.exception("KV offload disk writer crashed")
                self._disable(f"the disk writer crashed: {exc!r}")
            with self._cond:
                gone = []  # written into a segment deleted meanwhile: no longer held anywhere
                for block_hash, payload in batch:
                    if self._pending.pop(block_hash, None) is not None:
                        self._pending_bytes -= len(payload)
                        if block_hash not in self._index:
                            gone.append(block_hash)
                if gone and self.kv_events is not None:
                    self.kv_events.block_removed(gone, self.name)
                self._pending_since = time.monotonic() if self._pending else None
                self._writing = False
                self._cond.notify_all()

    def _write_batch(self, batch: list[tuple[int, bytes]]) -> None:
        records = [(h, encode_record(self.fingerprint, h, payload, len(payload) - self.block_bytes))
                   for h, payload in batch]
        i = 0
        while i < len(records):
            current = self._current
            if current is not None and (current.dropped or (
                    current.size > 0 and current.size + len(records[i][1]) > self.segment_bytes)):
                self._close_current(sync=False)
                current = None
            seg_size = current.size if current is not None else 0
            j, size = i, 0
            # The records that fit in this segment (at least one, so a record larger than a segment still goes).
            while j < len(records) and (
                    seg_size + size == 0 or seg_size + size + len(records[j][1]) <= self.segment_bytes):
                size += len(records[j][1])
                j += 1
            with self._cond:
                fits = self._make_room(size)
            if not fits and current is not None and current.size > 0:
                self._close_current(sync=False)  # the open segment becomes the next one to delete
                continue
            if self._current is None:
                self._new_segment()
            seg = self._current
            data = b"".join(record for _, record in records[i:j])
            self._inject_fault(len(data), seg.path)
            _write_all(self._file, data)
            with self._cond:
                offset = seg.size
                for h, record in records[i:j]:
                    if not seg.dropped:
                        self._index[h] = (seg, offset, len(record) - self.record_bytes)
                        seg.hashes.append(h)
                    offset += len(record)
                seg.size = offset
                if not seg.dropped:
                    self._used += size
                self._clock += 1
                seg.recency = self._clock
                self.stats.bytes_written += size
                self.stats.blocks_stored = len(self._index)
            i = j

    def _new_segment(self) -> None:
        with self._cond:
            seg_id = max(self._segments, default=0) + 1
            seg = _Segment(seg_id, self.directory / f"segment-{seg_id:08d}.kvseg")
            self._inject_fault(0, seg.path)
            self._file = open(seg.path, "xb", buffering=0)
            self._segments[seg_id] = seg
            self._current = seg

    def _close_current(self, sync: bool) -> None:
        if self._file is not None:
            try:
                if sync:
                    os.fsync(self._file.fileno())
                self._file.close()
            except OSError as exc:
                self._fault(fault_kind(exc), f"closing {self._current.path if self._current else '?'}: {exc}")
        self._file = None
        self._current = None

    def _make_room(self, num_bytes: int) -> bool:
        """Delete least recently used segments (never the open one) until ``num_bytes`` more fit.
        Caller holds the lock. Returns whether they fit."""
        while self._used + num_bytes > self.capacity_bytes:
            victims = [s for s in self._segments.values() if s is not self._current]
            if not victims:
                return False
            self._drop_segment(min(victims, key=lambda s: s.recency), delete_file=True)
        return True

    def _drop_segment(self, seg: _Segment, delete_file: bool) -> None:
        """Forget a segment (and delete its file). Caller holds the lock."""
        if seg.dropped:
            return
        seg.dropped = True
        if delete_file:
            try:
                seg.path.unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                self._fault(fault_kind(exc), f"cannot delete {seg.path}: {exc}")
        dropped = []
        for h in seg.hashes:
            entry = self._index.get(h)
            if entry is not None and entry[0] is seg:
                del self._index[h]
                dropped.append(h)
        num_dropped = len(dropped)
        if self.kv_events is not None:
            self.kv_events.block_removed([h for h in dropped if h not in self._pending], self.name)
        self._segments.pop(seg.seg_id, None)
        self._used -= seg.size
        self.stats.evictions += num_dropped
        self.stats.blocks_stored = len(self._index)

    # ---- loader thread --------------------------------------------------------------------
    def _load_loop(self) -> None:
        while True:
            item = self._loads.get()
            if item is None:
                return
            block_hashes, on_done = item
            for block_hash in block_hashes:
                try:
                    payload = self._read(block_hash)
                except Exception:  # noqa: BLE001 - a failed read is a miss, never a crash
                    logger.exception("KV offload disk tier: reading block %016x failed", block_hash)
                    payload = None
                on_done(block_hash, payload)

    def _read(self, block_hash: int) -> memoryview | bytes | None:
        with self._cond:
            if not self.enabled:
                return None
            pending = self._pending.get(block_hash)
            if pending is not None:
                self.stats.bytes_read += len(pending)
                return pending
            entry = self._index.get(block_hash)
            if entry is None:
                return None
            seg, offset, state_len = entry
        record = bytearray(self.record_bytes + state_len)
        kind = "corrupt"
        try:
            with open(seg.path, "rb") as f:
                f.seek(offset)
                num_read = f.readinto(record)
            problem = check_record(memoryview(record)[:num_read], self.fingerprint, block_hash,
                                   self.block_bytes + state_len, state_len)
        except OSError as exc:
            problem, kind = f"cannot read the segment: {exc}", "io"
        if problem is None:
            with self._cond:
                self._clock += 1
                seg.recency = self._clock
                self.stats.bytes_read += len(record)
            return memoryview(record)[HEADER_SIZE:]
        with self._cond:
            if seg.dropped:  # deleted for room meanwhile: a plain miss
                return None
            if not seg.path.exists():
                self._drop_segment(seg, delete_file=False)
            elif self._index.get(block_hash) == entry:
                del self._index[block_hash]
                self.stats.blocks_stored = len(self._index)
                if self.kv_events is not None and block_hash not in self._pending:
                    self.kv_events.block_removed((block_hash,), self.name)
        self._fault(kind, f"block {block_hash:016x} in {seg.path} is unusable ({problem}); dropped, it will be "
                          "recomputed")
        return None

    # ---- failure --------------------------------------------------------------------------
    def _fault(self, kind: str, message: str) -> None:
        """Count one fault of ``kind`` (``stats.FAULT_KINDS``); the first of each kind is logged as a warning,
        later ones at debug level. Any thread."""
        with self._cond:
            self.stats.errors[kind] = self.stats.errors.get(kind, 0) + 1
            first = kind not in self._warned
            self._warned.add(kind)
        if first:
            logger.warning("KV offload disk tier: %s (later %s faults are counted in "
                           "tokenmill:kv_offload_errors_total, not logged)", message, kind)
        else:
            logger.debug("KV offload disk tier: %s", message)

    def _inject_fault(self, num_bytes: int, path: Path) -> None:
        """Raise the test-only injected OSError (``TOKENMILL_KV_OFFLOAD_DISK_FAULT``) if writing ``num_bytes`` more
        to ``path`` would pass the bytes allowed before it. Writer thread."""
        if self._fault_injection is not None:
            code, after_bytes = self._fault_injection
            if self.stats.bytes_written + num_bytes > after_bytes or (num_bytes == 0 and after_bytes == 0):
                raise OSError(code, os.strerror(code), str(path))

    def _disable(self, message: str, kind: str | None = None) -> None:
        """Switch the tier off for good (one logged error), counting a fault of ``kind`` when one caused it."""
        with self._cond:
            if self.error is not None:
                return
            self.enabled = False
            self.stats.enabled = 0
            if kind is not None:
                self.stats.errors[kind] = self.stats.errors.get(kind, 0) + 1
                self._warned.add(kind)
            self.error = message
            self._index.clear()
            self._pending.clear()
            self._pending_bytes = 0
            self.stats.blocks_stored = 0
            if self.kv_events is not None:
                self.kv_events.all_cleared(self.name)
            self._cond.notify_all()
        logger.error("KV offload disk tier disabled: %s; serving continues without it", message)


def fault_kind(exc: OSError) -> str:
    """The ``stats.FAULT_KINDS`` kind of an OSError: enospc (no room), readonly (refused), else io."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return "enospc"
    if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return "readonly"
    return "io"


def _truncate(path: Path, size: int) -> None:
    """Cut a segment's torn tail off at ``size`` bytes (best effort: a read-only file keeps it, unused)."""
    try:
        os.truncate(path, size)
    except OSError as exc:
        logger.debug("KV offload disk tier: cannot truncate %s: %s", path, exc)


def _segment_id(path: Path) -> int | None:
    try:
        return int(path.name[len("segment-") : -len(".kvseg")])
    except ValueError:
        return None


def _write_all(f, data: bytes) -> None:
    """Write every byte with the unbuffered file ``f`` (a raw write may be partial)."""
    view = memoryview(data)
    while view:
        num_written = f.write(view)
        if not num_written:
            raise OSError(errno.EIO, "write returned no progress")
        view = view[num_written:]
