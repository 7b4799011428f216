"""Tiled (repacked) GGUF weights kept on disk per machine, so a second load maps them instead of repacking.

``qgemm.repack`` regroups a weight's blocks into 16-row tiles at load: about 1 s of one core per GB of
weights (a 1-2 B Q4_K_M model: 1.3 s of a 2.3 s cached load on a 2-core Xeon). The result depends only on
the file's bytes and on the layout code, so the first load writes every tiled segment, in the order the
model asks for them, into one file (``tiles-<key>.bin``, no larger than the weights it replaces, with
``tiles-<key>.json`` listing each segment's format, shape, byte range and a CRC-32 of the first 4 KiB of its
source bytes); later loads memory-map it and hand out views: no repack, no copy, and the pages are the
page cache's, shared by every process serving the same file.

The loader opens one ``TileCache`` per GGUF file (``active``) in the file's GGUF cache entry; the cache
file's name carries a hash of the layout code (``quantization/csrc``) and of the tiled formats, so a
build with another layout writes its own file (and removes the others). A segment that does not match
what was recorded (format, shape, source CRC) ends the reuse for the rest of the load: those segments
are repacked and a fresh file is written. A directory that cannot be written only costs the speed-up.

A load with no usable file writes through: each segment is repacked straight into the new file (its bytes
reserved with ``posix_fallocate``, so a full disk is an error rather than a fault, then mapped shared for the
repack) and the model gets a copy-on-write view of that mapping, so the first load holds the tiles in the page
cache, not in process memory (a 16.7 GB Q8_0 file no longer needs 16.7 GB of anonymous memory on top of its
own pages while loading: the 24 GiB machine ran out of memory), and nothing is copied to write the file.
"""
from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import logging
import os
import tempfile
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from tokenmill.quantization.formats import QuantizedTensor

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_ACTIVE: contextvars.ContextVar[TileCache | None] = contextvars.ContextVar("tokenmill_tile_cache", default=None)
_ALIGN = 4096  # each segment starts on a page: the SIMD loads and the prefetches see aligned rows


def layout_key(tiled: Sequence[int]) -> str:
    """A hash of the layout code (every file under ``quantization/csrc``) and the tiled formats' type ids."""
    digest = hashlib.sha256(repr(sorted(tiled)).encode())
    for source in sorted(_CSRC.glob("*")):
        if source.suffix in (".c", ".h"):
            digest.update(source.name.encode() + b"\0" + source.read_bytes())
    return digest.hexdigest()[:16]


def _source_crc(parts: Sequence[QuantizedTensor]) -> int:
    """CRC-32 of the first 4 KiB of the first part's bytes (what tells two segments of one shape apart)."""
    head = parts[0].data.reshape(-1)[:4096]
    return zlib.crc32(head.contiguous().numpy().tobytes())


class TileCache:
    """The tiled segments of one model load, read from or written to ``directory``/tiles-<key>.bin.

    ``tiled(parts, make)`` returns the tiled ``QuantizedTensor`` for the segment made of ``parts`` (row
    blocks of one format, stacked): the recorded copy when the next recorded entry matches, else
    ``make()`` (recorded for the file written by ``close``). Not thread-safe: one loader thread calls it.
    """

    def __init__(self, directory: Path, key: str) -> None:
        self.directory = directory
        self.key = key
        self.hits = 0
        self._entries: list[dict] = []
        self._mapped: np.memmap | None = None
        self._next = 0
        self._made: list[tuple[dict, torch.Tensor]] = []  # every segment of this load, in order
        self._stale = False  # a miss: write the file again
        self._writer: tuple | None = None  # (fd, temporary path) of the file written through, segment by segment
        self._offset = 0  # its length so far
        self._written = 0  # segments written through
        index, data = self._paths()
        try:
            if index.is_file() and data.is_file():
                entries = json.loads(index.read_text())["segments"]
                size = data.stat().st_size
                if entries and all(e["offset"] + e["nbytes"] <= size for e in entries):
                    self._entries = entries
                    self._mapped = np.memmap(data, dtype=np.uint8, mode="c")  # copy-on-write: writable views
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.warning("tile cache %s cannot be read (%s); repacking", data, exc)
            self._entries, self._mapped = [], None

    def _paths(self) -> tuple[Path, Path]:
        return self.directory / f"tiles-{self.key}.json", self.directory / f"tiles-{self.key}.bin"

    def tiled(self, parts: Sequence[QuantizedTensor],
              make: Callable[[torch.Tensor | None], QuantizedTensor]) -> QuantizedTensor:
        """The tiled segment of ``parts`` (one format, same in_features), from the file or from ``make(out)``:
        ``out`` is where to repack it (a view of the file being written, uint8 with the parts' stacked data
        shape) or None (``make`` allocates)."""
        qtype = parts[0].qtype
        shape = [sum(p.shape[0] for p in parts), parts[0].shape[1]]
        crc = _source_crc(parts)
        if not self._stale and self._mapped is not None and self._next < len(self._entries):
            e = self._entries[self._next]
            if e["source_qtype"] == qtype and e["shape"] == shape and e["crc"] == crc:
                self._next += 1
                self.hits += 1
                data = torch.from_numpy(self._mapped[e["offset"]:e["offset"] + e["nbytes"]]).reshape(shape[0], -1)
                out = QuantizedTensor(e["qtype"], tuple(shape), data)
                self._made.append((e, data))
                return out
        if not self._stale:
            self._stale = True
            if self._entries:
                logger.info("tile cache: segment %d differs from the recorded one; repacking the rest", self._next)
            if not self._made:  # nothing reused: write the new file through, segment by segment
                self._open_writer()
        data_shape = (shape[0], parts[0].data.shape[1])
        target = self._reserve(data_shape) if self._writer is not None else None
        out = make(None if target is None else target[1])
        entry = {"source_qtype": qtype, "qtype": out.qtype, "shape": shape, "crc": crc, "nbytes": out.data.numel()}
        if target is not None:
            offset, view = target
            if out.data.data_ptr() != view.data_ptr():  # made elsewhere: its bytes into the file
                view.copy_(out.data.reshape(view.shape))
            entry["offset"] = offset
            try:  # the model gets a copy-on-write mapping of the same pages, not the shared writable one
                mapped = np.memmap(self._writer[1], dtype=np.uint8, mode="c", offset=offset, shape=(entry["nbytes"],))
                out = QuantizedTensor(out.qtype, out.shape, torch.from_numpy(mapped).reshape(data_shape))
                self._written += 1
            except (OSError, ValueError) as exc:  # no mapping to spare: this segment in memory, no file
                logger.warning("tile cache: could not map %s (%s); the tiles stay in memory", self._writer[1], exc)
                out = QuantizedTensor(out.qtype, out.shape, view.clone())
                self.abort()
            del view, target
        self._made.append((entry, out.data))
        return out

    def _open_writer(self) -> None:
        """A temporary file to write through, locked (``flock``) while this load writes it; first removes the
        temporary files of loads that ended without finishing theirs (killed: nobody holds their lock), which
        would otherwise keep their reserved space for good."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            _remove_abandoned(self.directory)
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tiles-")
            _try_lock(fd)
            self._writer = (fd, tmp)
        except OSError as exc:
            logger.warning("tile cache: cannot write under %s (%s); the tiles stay in memory", self.directory, exc)

    def _reserve(self, data_shape: tuple[int, int]) -> tuple[int, torch.Tensor] | None:
        """Room for a segment of ``data_shape`` bytes at the file's next page: (offset, a shared writable view of
        it), or None when the disk refuses (then nothing more is written: the tiles stay in memory, no file)."""
        fd, tmp = self._writer
        nbytes = data_shape[0] * data_shape[1]
        offset = self._offset + (-self._offset % _ALIGN)
        try:
            os.posix_fallocate(fd, offset, nbytes)  # blocks reserved now: no SIGBUS from a full disk later
            view = np.memmap(tmp, dtype=np.uint8, mode="r+", offset=offset, shape=(nbytes,))
        except (OSError, ValueError) as exc:
            logger.warning("tile cache: could not write %s (%s); the tiles stay in memory", tmp, exc)
            self.abort()
            return None
        self._offset = offset + nbytes
        return offset, torch.from_numpy(view).reshape(data_shape)

    def abort(self) -> None:
        """Drop the file being written through (an error during the load, or a failed write). Views already
        mapped from it stay valid: the pages live until they are unmapped."""
        writer, self._writer = self._writer, None
        if writer is not None:
            with contextlib.suppress(OSError):
                os.close(writer[0])
            with contextlib.suppress(OSError):
                os.unlink(writer[1])
        self._written = -1  # never publish a partial file

    def close(self) -> None:
        """Write the file when this load repacked anything (removing other layouts' files), else nothing."""
        made, self._made = self._made, []
        if self._writer is not None:  # written through: publish it
            self._publish(made)
            return
        if not self._stale or not made or self._written < 0:
            return
        data = self._paths()[1]
        tmp = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tiles-")
            entries, offset = [], 0
            with os.fdopen(fd, "wb") as f:
                for entry, tensor in made:
                    pad = -offset % _ALIGN
                    f.write(b"\0" * pad)
                    offset += pad
                    f.write(memoryview(tensor.contiguous().numpy()).cast("B"))
                    entries.append({**entry, "offset": offset})
                    offset += entry["nbytes"]
            self._install(tmp, entries)
        except OSError as exc:
            logger.warning("tile cache: could not write %s (%s); the next load repacks again", data, exc)
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)

    def _publish(self, made: list[tuple[dict, torch.Tensor]]) -> None:
        """Publish the file written through (every segment of this load must have gone into it)."""
        fd, tmp = self._writer
        self._writer = None
        try:
            os.close(fd)
            if self._written != len(made):
                raise OSError("not every segment was written")
            self._install(tmp, [entry for entry, _ in made])
        except OSError as exc:
            logger.warning("tile cache: could not write %s (%s); the next load repacks again", self._paths()[1], exc)
            with contextlib.suppress(OSError):
                os.unlink(tmp)

    def _install(self, data_tmp: str, entries: list[dict]) -> None:
        """Move the complete data file ``data_tmp`` into place as this layout's file, removing
        the old ones, then write its index: the index last, so a reader finds both files or neither.

        Raises:
            OSError: a rename or the index write failed (``data_tmp`` may then still exist).
        """
        index, data = self._paths()
        for old in self.directory.glob("tiles-*"):  # this layout's old pair and other layouts'
            old.unlink(missing_ok=True)
        os.replace(data_tmp, data)
        ifd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tiles-index-")  # a name of this load's own
        try:
            with os.fdopen(ifd, "w") as f:
                f.write(json.dumps({"segments": entries}))
            os.replace(tmp, index)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


def _try_lock(fd: int) -> bool:
    """An exclusive, non-blocking ``flock`` on ``fd``: False when another process holds one (or no fcntl)."""
    try:
        import fcntl

        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except (ImportError, OSError):
        return False


def _remove_abandoned(directory: Path) -> None:
    """Delete the ``.tiles-*`` temporary files in ``directory`` that no live load holds locked."""
    for path in directory.glob(".tiles-*"):
        if path.name.startswith(".tiles-index-"):
            continue  # written and renamed in one go: an abandoned one is tiny
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            if _try_lock(fd):
                path.unlink(missing_ok=True)
        finally:
            os.close(fd)


@contextlib.contextmanager
def active(directory: Path | None, tiled: Sequence[int]) -> Iterator[TileCache | None]:
    """Within the block, ``tiled_segment`` reads and records through a ``TileCache`` in ``directory``
    (None: no cache, every segment repacked); the file is written when the block ends without an error."""
    if directory is None:
        yield None
        return
    cache = TileCache(directory, layout_key(tiled))
    token = _ACTIVE.set(cache)
    try:
        yield cache
    except BaseException:
        cache.abort()
        raise
    finally:
        _ACTIVE.reset(token)
    cache.close()


def tiled_segment(parts: Sequence[QuantizedTensor],
                  make: Callable[[torch.Tensor | None], QuantizedTensor]) -> QuantizedTensor:
    """``make(None)`` (the tiled segment of ``parts``), or under an ``active`` cache its recorded copy or
    ``make(out)`` into the file being written (``TileCache.tiled``)."""
    cache = _ACTIVE.get()
    return make(None) if cache is None else cache.tiled(parts, make)
