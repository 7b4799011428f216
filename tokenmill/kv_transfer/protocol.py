"""The KV transfer wire protocol between a prefill (producer) and a decode (consumer) worker.

One TCP connection per transfer. Every message is a frame: a 4-byte big-endian length, then that
many bytes of UTF-8 JSON; a frame may be followed by raw bytes whose length the JSON states. Every
frame after the first carries ``mac``: an HMAC under the cluster secret (``tokenmill.security``) of its
role, both sides' nonces and its canonical JSON, so neither side acts on a frame from a party without
the secret, and no frame is replayed into another connection or role.

    producer -> consumer   {"nonce": s}                                      (the producer's challenge)
    consumer -> producer   {"op": "pull", "lease_id", "transport": "tcp" | "shm", "first_block": k,
                            "num_blocks": n | null, "nonce": c, "mac"}
    producer -> consumer   {"ok": true, "meta": TransferMeta, "nbytes", "shm_path"?, "mac"} [nbytes of blocks, tcp]
                           or {"ok": false, "error": "...", "mac"?}          (no mac: the pull was not authenticated)
    consumer -> producer   {"op": "confirm", "lease_id", "ok": bool, "mac"}  (the producer frees the lease)
    producer -> consumer   {"ok": true, "mac"}

The payload is authenticated through the ``sha256`` in the MAC'd metadata. Blocks travel as
``(num_blocks, layers, 2, block_size, kv_heads, head_dim)`` in the KV cache dtype (the session file layout),
from the lease's block ``first_block`` on (at most ``num_blocks`` of them): a consumer that already holds the
leading blocks (a multi-round conversation's history) moves only the new ones. With ``shm`` they are
written to a file in ``/dev/shm`` (tmpfs: shared memory between processes of one host; mode 0600, a random
name) instead of the socket; the producer removes it on confirm or when the lease expires. Every read is
bounded twice: by a byte cap fixed before anything is allocated and by a deadline (``time.monotonic()``
seconds) covering the whole exchange. Pure Python and sockets; no engine imports.
"""
from __future__ import annotations

import json
import secrets
import socket
import struct
import time
from dataclasses import asdict, dataclass

from tokenmill.security import sign, verify

_LEN = struct.Struct(">I")
MAX_FRAME = 64 * 1024 * 1024  # no frame is larger than this, whatever the caller's cap
HELLO_FRAME_MAX = 256  # the producer's challenge
REQUEST_FRAME_MAX = 4096  # a pull or confirm: a few short fields
NONCE_HEX = 32  # characters of a nonce (16 random bytes)
_MAC_PURPOSE = "kv_transfer_frame"


class TransferError(RuntimeError):
    """A transfer that failed: ``reason`` is a short label for the counters (``connect``, ``timeout``,
    ``refused``, ``corrupt``, ``mismatch``, ``protocol``, ``auth``, ``not_allowed``, ``too_large``)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


class ConnectionClosed(TransferError):
    """The peer closed the connection in the middle of a read (reason ``protocol``)."""

    def __init__(self, message: str) -> None:
        super().__init__("protocol", message)


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


def new_nonce() -> str:
    """A fresh random nonce (hex)."""
    return secrets.token_hex(NONCE_HEX // 2)


def is_nonce(value) -> bool:
    """Whether ``value`` looks like a ``new_nonce()`` (hex of the right length)."""
    return (isinstance(value, str) and len(value) == NONCE_HEX
            and all(c in "0123456789abcdef" for c in value))


def _canonical(message: dict) -> bytes:
    body = {k: v for k, v in message.items() if k != "mac"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def sign_frame(secret: bytes, role: str, server_nonce: str, client_nonce: str, message: dict) -> dict:
    """``message`` with ``mac``: HMAC of ``role`` (``pull``, ``reply``, ``confirm``, ``ack``), both nonces
    and the message's canonical JSON."""
    return {**message, "mac": sign(secret, _MAC_PURPOSE, role, server_nonce, client_nonce, _canonical(message))}


def frame_is_signed(secret: bytes, role: str, server_nonce: str, client_nonce: str, message: dict) -> bool:
    """Whether ``message["mac"]`` is ``sign_frame``'s for this role and these nonces (constant time)."""
    return verify(secret, _MAC_PURPOSE, message.get("mac"), role, server_nonce, client_nonce, _canonical(message))


def remaining(deadline: float | None) -> float | None:
    """Seconds left to ``deadline`` (None: no deadline).

    Raises:
        TransferError: ``timeout`` once the deadline has passed.
    """
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise TransferError("timeout", "the transfer's deadline passed")
    return left


def send_frame(sock: socket.socket, message: dict, payload: bytes | memoryview | None = None,
               deadline: float | None = None) -> None:
    """One JSON frame, then ``payload`` (if any) as raw bytes, all before ``deadline``.

    Raises:
        TransferError: ``timeout`` past the deadline; ``connect`` when the peer has gone.
    """
    data = json.dumps(message).encode()
    try:
        if deadline is not None:
            sock.settimeout(remaining(deadline))
        sock.sendall(_LEN.pack(len(data)) + data)
        if payload is not None:
            sock.sendall(payload)
    except socket.timeout:
        raise TransferError("timeout", "the peer did not take the data before the deadline") from None
    except OSError as exc:
        if isinstance(exc, TransferError):
            raise
        raise TransferError("connect", f"{type(exc).__name__}: {exc}") from None


def recv_exact(sock: socket.socket, n: int, into: bytearray | memoryview | None = None,
               deadline: float | None = None) -> bytes | memoryview:
    """Exactly ``n`` bytes (into ``into`` when given), all before ``deadline`` (else the socket's timeout
    bounds each read).

    Raises:
        TransferError: ``protocol`` when the peer closes first; ``timeout`` past the deadline or timeout.
    """
    buf = memoryview(into) if into is not None else memoryview(bytearray(n))
    got = 0
    try:
        while got < n:
            if deadline is not None:
                sock.settimeout(remaining(deadline))
            k = sock.recv_into(buf[got:], n - got)
            if k == 0:
                raise ConnectionClosed(f"connection closed after {got} of {n} bytes")
            got += k
    except socket.timeout:
        raise TransferError("timeout", f"no data in time after {got} of {n} bytes") from None
    except OSError as exc:
        if isinstance(exc, TransferError):
            raise
        raise TransferError("connect", f"{type(exc).__name__}: {exc}") from None
    return buf if into is not None else bytes(buf)


def recv_frame(sock: socket.socket, max_bytes: int = MAX_FRAME, deadline: float | None = None) -> dict:
    """One JSON frame of at most ``max_bytes`` (refused from its length word, before anything is allocated).

    Raises:
        TransferError: ``protocol`` for a closed connection, an oversized or non-object frame; ``timeout``.
    """
    (length,) = _LEN.unpack(recv_exact(sock, _LEN.size, deadline=deadline))
    if length > min(max_bytes, MAX_FRAME):
        raise TransferError("protocol", f"frame of {length} bytes exceeds {min(max_bytes, MAX_FRAME)}")
    try:
        message = json.loads(bytes(recv_exact(sock, length, deadline=deadline)))
    except ValueError as exc:
        raise TransferError("protocol", f"frame is not JSON: {exc}") from None
    if not isinstance(message, dict):
        raise TransferError("protocol", "frame is not a JSON object")
    return message
