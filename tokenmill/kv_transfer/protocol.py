"""The KV transfer wire protocol between a prefill (producer) and a decode (consumer) worker.

One TCP connection per transfer. Every message is a frame: a 4-byte big-endian length, then that
many bytes of UTF-8 JSON; a frame may be followed by raw bytes whose length the JSON states.

    consumer -> producer   {"op": "pull", "lease_id", "transport": "tcp" | "shm", "first_block": k}
    producer -> consumer   {"ok": true, "meta": TransferMeta, "nbytes", "shm_path"?} [nbytes of blocks, tcp]
                           or {"ok": false, "error": "..."}
    consumer -> producer   {"op": "confirm", "lease_id", "ok": bool}     (the producer frees the lease)
    producer -> consumer   {"ok": true}

Blocks travel as ``(num_blocks, layers, 2, block_size, kv_heads, head_dim)`` in the KV cache dtype
(the session file layout), from the lease's block ``first_block`` on: a consumer that already holds
the leading blocks (a multi-round conversation's history) moves only the new ones. With ``shm`` they are written to a file in ``/dev/shm`` (tmpfs: shared
memory between processes of one host) instead of the socket; the producer removes it on confirm
or when the lease expires. Pure Python and sockets; no engine imports.
"""
from __future__ import annotations

import json
import socket
import struct
from dataclasses import asdict, dataclass

_LEN = struct.Struct(">I")
MAX_FRAME = 64 * 1024 * 1024  # a JSON frame (token ids included) larger than this is refused


class TransferError(RuntimeError):
    """A transfer that failed: ``reason`` is a short label for the counters (``connect``, ``timeout``,
    ``refused``, ``corrupt``, ``mismatch``, ``protocol``)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


@dataclass(frozen=True)
class TransferMeta:
    """What a lease holds. num_tokens: prompt tokens whose K/V the blocks hold (the last block may be
    partial). token_ids: those tokens. extra_keys: what the producer hashed the prompt with
    (``cache_salt``, adapter digest). block_hashes: the prefix-cache hash chain of the full blocks among
    those tokens (hex), as the producer computed it. model_fingerprint: see ``kv_offload.fingerprint``. kv_dtype,
    block_size, block_shape ``(layers, 2, block_size, kv_heads, head_dim)``, block_bytes: one block's byte row
    (``KVPool.block_bytes``: K/V, then an int8/fp8 cache's scales). first_block: the lease's block the payload
    starts at; num_blocks: blocks in the payload (``num_blocks * block_bytes`` bytes). sha256: of the payload."""

    num_tokens: int
    token_ids: list[int]
    extra_keys: list
    block_hashes: list[str]
    model_fingerprint: str
    kv_dtype: str
    block_size: int
    block_shape: list[int]
    block_bytes: int
    first_block: int
    num_blocks: int
    sha256: str

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict) -> TransferMeta:
        try:
            return cls(**raw)
        except TypeError as exc:
            raise TransferError("protocol", f"bad transfer metadata: {exc}") from None


def send_frame(sock: socket.socket, message: dict, payload: bytes | memoryview | None = None) -> None:
    """One JSON frame, then ``payload`` (if any) as raw bytes."""
    data = json.dumps(message).encode()
    sock.sendall(_LEN.pack(len(data)) + data)
    if payload is not None:
        sock.sendall(payload)


def recv_exact(sock: socket.socket, n: int, into: bytearray | memoryview | None = None) -> bytes | memoryview:
    """Exactly ``n`` bytes (into ``into`` when given).

    Raises:
        TransferError: ``protocol`` when the peer closes first; ``timeout`` on the socket's timeout.
    """
    buf = memoryview(into) if into is not None else memoryview(bytearray(n))
    got = 0
    try:
        while got < n:
            k = sock.recv_into(buf[got:], n - got)
            if k == 0:
                raise TransferError("protocol", f"connection closed after {got} of {n} bytes")
            got += k
    except socket.timeout:
        raise TransferError("timeout", f"no data for the socket timeout after {got} of {n} bytes") from None
    except OSError as exc:
        if isinstance(exc, TransferError):
            raise
        raise TransferError("connect", f"{type(exc).__name__}: {exc}") from None
    return buf if into is not None else bytes(buf)


def recv_frame(sock: socket.socket) -> dict:
    """One JSON frame.

    Raises:
        TransferError: ``protocol`` for a closed connection, an oversized or non-object frame.
    """
    (length,) = _LEN.unpack(recv_exact(sock, _LEN.size))
    if length > MAX_FRAME:
        raise TransferError("protocol", f"frame of {length} bytes exceeds {MAX_FRAME}")
    try:
        message = json.loads(bytes(recv_exact(sock, length)))
    except ValueError as exc:
        raise TransferError("protocol", f"frame is not JSON: {exc}") from None
    if not isinstance(message, dict):
        raise TransferError("protocol", "frame is not a JSON object")
    return message
