"""On-disk record format of the disk KV tier and the header-only segment scan. Pure Python.

A segment file is a sequence of records; each record is a 64-byte header then the payload (one
KV block's bytes, then for a hybrid model's block with a state checkpoint that checkpoint's bytes)::

    magic "TMKV" | version u16 | header size u16 | model fingerprint (32 bytes) |
    block_hash u64 | payload length u64 | crc32 u32 | state length u32

all little-endian. Version 1 records hold a KV block only (their last 4 bytes are zero); version 2
records carry ``state length`` bytes of linear-attention state (the conv and recurrent state of every
linear layer, ``LinearStateCache.checkpoint_payload``) at the end of the payload, after the KV block.
A reader that knows no state treats a version 2 record as unreadable, never as a plain block, and a
version 1 record read by a hybrid model's engine is a KV block without a checkpoint (its prefix is
recomputed from the last checkpoint before it). The crc32 covers the header (with its crc field
zeroed) and the payload, so a torn, truncated or corrupted record is detected on read and never used.
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"TMKV"
VERSION = 1  # a KV block only
VERSION_STATE = 2  # a KV block and a linear-attention state checkpoint
HEADER = struct.Struct("<4sHH32sQQII")
HEADER_SIZE = HEADER.size  # 64
_CRC_OFFSET = 4 + 2 + 2 + 32 + 8 + 8


@dataclass(frozen=True)
class RecordHeader:
    fingerprint: bytes
    block_hash: int
    payload_len: int  # KV block + state bytes
    crc: int
    state_len: int = 0  # bytes of linear-attention state at the end of the payload (version 2 records)


def encode_record(fingerprint: bytes, block_hash: int, payload: bytes, state_len: int = 0) -> bytes:
    """Header + payload of one block, checksummed; ``state_len`` > 0: the payload's last ``state_len`` bytes
    are the block's linear-attention state checkpoint (a version 2 record)."""
    assert len(fingerprint) == 32 and 0 <= state_len < len(payload)
    version = VERSION_STATE if state_len else VERSION
    header = HEADER.pack(MAGIC, version, HEADER_SIZE, fingerprint, block_hash, len(payload), 0, state_len)
    crc = zlib.crc32(payload, zlib.crc32(header))
    return HEADER.pack(MAGIC, version, HEADER_SIZE, fingerprint, block_hash, len(payload), crc, state_len) + payload


def decode_header(buf: bytes) -> RecordHeader | None:
    """The header at the start of ``buf``, or None if it is short or not a version 1 (no state) or version 2
    (state length > 0, inside the payload) record header."""
    if len(buf) < HEADER_SIZE:
        return None
    magic, version, header_size, fingerprint, block_hash, payload_len, crc, state_len = HEADER.unpack_from(buf)
    if magic != MAGIC or header_size != HEADER_SIZE:
        return None
    if not ((version == VERSION and state_len == 0) or (version == VERSION_STATE and 0 < state_len < payload_len)):
        return None
    return RecordHeader(fingerprint, block_hash, payload_len, crc, state_len)


def check_record(record: bytes | bytearray | memoryview, fingerprint: bytes, block_hash: int,
                 payload_len: int, state_len: int = 0) -> str | None:
    """Why ``record`` (header + payload as read back) is not the expected block (``payload_len`` bytes after the
    header, the last ``state_len`` of them linear-attention state), or None if it is."""
    if len(record) != HEADER_SIZE + payload_len:
        return f"truncated record ({len(record)} of {HEADER_SIZE + payload_len} bytes)"
    header = decode_header(bytes(record[:HEADER_SIZE]))
    if header is None:
        return "bad record header"
    if (header.fingerprint != fingerprint or header.block_hash != block_hash or header.payload_len != payload_len
            or header.state_len != state_len):
        return "header does not match the index"
    zeroed = bytes(record[:_CRC_OFFSET]) + b"\0\0\0\0" + bytes(record[_CRC_OFFSET + 4 : HEADER_SIZE])
    crc = zlib.crc32(memoryview(record)[HEADER_SIZE:], zlib.crc32(zeroed))
    if crc != header.crc:
        return "checksum mismatch"
    return None


@dataclass(frozen=True)
class ScannedRecord:
    block_hash: int
    offset: int  # of the header, from the start of the segment
    state_len: int = 0  # bytes of linear-attention state after the KV block (0: none)


def scan_segment(path: Path, fingerprint: bytes, payload_len: int,
                 state_len: int = 0) -> tuple[list[ScannedRecord], int, str | None]:
    """Read only the headers of a segment.

    ``payload_len``: one KV block's bytes; ``state_len``: one state checkpoint's bytes (0: a model without
    linear-attention state, whose records never carry any). Returns (records of this fingerprint holding a
    KV block of ``payload_len`` bytes and either no state or ``state_len`` bytes of it, bytes up to the end of
    the last complete record, problem) where problem describes a torn or unreadable tail (the scan stops
    there; nothing after it is used) or is None. Checksums are verified on read, not here.
    """
    records: list[ScannedRecord] = []
    offset = 0
    size = path.stat().st_size
    with open(path, "rb") as f:
        while offset < size:
            f.seek(offset)
            header = decode_header(f.read(HEADER_SIZE))
            if header is None:
                return records, offset, f"unreadable record header at byte {offset}"
            end = offset + HEADER_SIZE + header.payload_len
            if end > size:
                return records, offset, f"truncated record at byte {offset} ({size - offset} of {end - offset} bytes)"
            if (header.fingerprint == fingerprint and header.state_len in (0, state_len)
                    and header.payload_len - header.state_len == payload_len):
                records.append(ScannedRecord(header.block_hash, offset, header.state_len))
            offset = end
    return records, offset, None
