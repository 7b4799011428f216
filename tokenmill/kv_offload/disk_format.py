"""On-disk record format of the disk KV tier and the header-only segment scan. Pure Python.

A segment file is a sequence of records; each record is a 64-byte header then the payload (one
KV block's bytes)::

    magic "TMKV" | version u16 | header size u16 | model fingerprint (32 bytes) |
    block_hash u64 | payload length u64 | crc32 u32 | 4 zero bytes

all little-endian. The crc32 covers the header (with its crc field zeroed) and the payload, so a
torn, truncated or corrupted record is detected on read and never used.
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"TMKV"
VERSION = 1
HEADER = struct.Struct("<4sHH32sQQI4x")
HEADER_SIZE = HEADER.size  # 64
_CRC_OFFSET = 4 + 2 + 2 + 32 + 8 + 8


@dataclass(frozen=True)
class RecordHeader:
    fingerprint: bytes
    block_hash: int
    payload_len: int
    crc: int


def encode_record(fingerprint: bytes, block_hash: int, payload: bytes) -> bytes:
    """Header + payload of one block, checksummed."""
    assert len(fingerprint) == 32
    header = HEADER.pack(MAGIC, VERSION, HEADER_SIZE, fingerprint, block_hash, len(payload), 0)
    crc = zlib.crc32(payload, zlib.crc32(header))
    return HEADER.pack(MAGIC, VERSION, HEADER_SIZE, fingerprint, block_hash, len(payload), crc) + payload


def decode_header(buf: bytes) -> RecordHeader | None:
    """The header at the start of ``buf``, or None if it is short or not a version-1 record header."""
    if len(buf) < HEADER_SIZE:
        return None
    magic, version, header_size, fingerprint, block_hash, payload_len, crc = HEADER.unpack_from(buf)
    if magic != MAGIC or version != VERSION or header_size != HEADER_SIZE:
        return None
    return RecordHeader(fingerprint, block_hash, payload_len, crc)


def check_record(record: bytes | bytearray | memoryview, fingerprint: bytes, block_hash: int,
                 payload_len: int) -> str | None:
    """Why ``record`` (header + payload as read back) is not the expected block, or None if it is."""
    if len(record) != HEADER_SIZE + payload_len:
        return f"truncated record ({len(record)} of {HEADER_SIZE + payload_len} bytes)"
    header = decode_header(bytes(record[:HEADER_SIZE]))
    if header is None:
        return "bad record header"
    if header.fingerprint != fingerprint or header.block_hash != block_hash or header.payload_len != payload_len:
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


def scan_segment(path: Path, fingerprint: bytes, payload_len: int) -> tuple[list[ScannedRecord], int, str | None]:
    """Read only the headers of a segment.

    Returns (records of this fingerprint with the expected payload length, bytes up to the end of
    the last complete record, problem) where problem describes a torn or unreadable tail (the scan
    stops there; nothing after it is used) or is None. Checksums are verified on read, not here.
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
            if header.fingerprint == fingerprint and header.payload_len == payload_len:
                records.append(ScannedRecord(header.block_hash, offset))
            offset = end
    return records, offset, None
