"""The decode side of a KV transfer: pull a lease's blocks from a producer and check them.

``pull_blocks`` runs in a worker thread (never on the engine thread): it connects, asks for the
lease, reads the blocks from the socket or from the ``/dev/shm`` file the producer wrote, checks
them against what this engine expects (model fingerprint, KV dtype, block size and shape, the
request's own prompt tokens and extra keys, the sha256 of the bytes) and confirms, so the producer
frees its blocks whatever the outcome. Every wait is bounded by ``timeout_s``.
"""
from __future__ import annotations

import hashlib
import ipaddress
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenmill.kv_cache.block_hash import extend_block_hashes
from tokenmill.kv_transfer.protocol import TransferError, TransferMeta, recv_exact, recv_frame, send_frame


@dataclass(frozen=True)
class Expected:
    """What the pulled blocks must match: this engine's layout and the request's prompt."""

    model_fingerprint: str
    kv_dtype: str
    block_size: int
    block_shape: list[int]
    block_bytes: int
    prompt_token_ids: list[int]
    extra_keys: list


def is_local_host(host: str) -> bool:
    """Whether ``host`` is this machine (loopback, or one of its own names/addresses): shared memory works."""
    try:
        if ipaddress.ip_address(host).is_loopback:
            return True
    except ValueError:
        if host in ("localhost",):
            return True
    try:
        own = {socket.gethostname(), socket.getfqdn()}
        addresses = {info[4][0] for name in own for info in socket.getaddrinfo(name, None)}
        return host in own or host in addresses
    except OSError:
        return False


def pull_blocks(host: str, port: int, lease_id: str, expected: Expected, transport: str = "auto",
                timeout_s: float = 30.0, first_block: int = 0) -> tuple[TransferMeta, torch.Tensor, int]:
    """Blocks of a lease from its block ``first_block`` on: (meta, blocks as the pool's byte rows, uint8
    ``(n, block_bytes)``, bytes moved).

    ``transport``: ``tcp``, ``shm`` or ``auto`` (shm when ``host`` is this machine).

    Raises:
        TransferError: ``connect`` (no producer), ``timeout``, ``refused`` (unknown or expired lease),
            ``mismatch`` (another model, dtype, layout or prompt), ``corrupt`` (checksum), ``protocol``.
    """
    if transport == "auto":
        transport = "shm" if is_local_host(host) else "tcp"
    deadline = time.monotonic() + timeout_s
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except OSError as exc:
        raise TransferError("connect", f"cannot reach the producer at {host}:{port}: {exc}") from None
    with sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        send_frame(sock, {"op": "pull", "lease_id": lease_id, "transport": transport, "first_block": first_block})
        sock.settimeout(max(0.1, deadline - time.monotonic()))
        reply = recv_frame(sock)
        if not reply.get("ok"):
            raise TransferError("refused", str(reply.get("error")))
        meta = TransferMeta.from_dict(reply.get("meta") or {})
        nbytes = int(reply.get("nbytes", -1))
        problem = _mismatch(meta, expected)
        if problem is None and meta.first_block != first_block:
            problem = f"the payload starts at block {meta.first_block}, not {first_block}"
        if problem is None and nbytes != meta.num_blocks * expected.block_bytes:
            problem = f"payload of {nbytes} bytes does not hold {meta.num_blocks} blocks of {expected.block_bytes}"
        buf = bytearray(max(nbytes, 0))
        shm_path = reply.get("shm_path")
        if shm_path is None:  # the bytes follow on the socket: read them even to refuse them
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            recv_exact(sock, nbytes, buf)
        elif problem is None:
            with open(Path(shm_path), "rb") as f:
                if f.readinto(buf) != nbytes:
                    problem = "the shared-memory file is short"
        if problem is None and hashlib.sha256(buf).hexdigest() != meta.sha256:
            reason = "corrupt"
            problem = "the blocks' checksum does not match"
        else:
            reason = "mismatch"
        sock.settimeout(max(0.1, deadline - time.monotonic()))
        send_frame(sock, {"op": "confirm", "lease_id": lease_id, "ok": problem is None})
        recv_frame(sock)
        if problem is not None:
            raise TransferError(reason, problem)
    blocks = torch.frombuffer(buf, dtype=torch.uint8).view(meta.num_blocks, expected.block_bytes)
    return meta, blocks, nbytes


def _mismatch(meta: TransferMeta, expected: Expected) -> str | None:
    """Why ``meta`` cannot be used by this engine for this request, or None."""
    if meta.model_fingerprint != expected.model_fingerprint:
        return "the producer runs another model (weights, config, dtype, block size or KV dtype differ)"
    if meta.kv_dtype != expected.kv_dtype:
        return f"kv_dtype {meta.kv_dtype} is not this engine's {expected.kv_dtype}"
    if (meta.block_size != expected.block_size or list(meta.block_shape) != list(expected.block_shape)
            or meta.block_bytes != expected.block_bytes):
        return (f"block shape {meta.block_shape} ({meta.block_bytes} bytes) is not this engine's "
                f"{expected.block_shape} ({expected.block_bytes} bytes)")
    if list(meta.extra_keys) != list(expected.extra_keys):
        return "the producer hashed the prompt with other extra keys (cache_salt or adapter)"
    if meta.token_ids != expected.prompt_token_ids[: meta.num_tokens] or meta.num_tokens < 1:
        return "the lease holds another prompt"
    chain: list[int] = []
    extend_block_hashes(chain, meta.token_ids, expected.block_size, tuple(expected.extra_keys))
    if list(meta.block_hashes) != [f"{h:016x}" for h in chain]:
        return "the lease's block hash chain differs from this engine's for the same tokens"
    if (meta.first_block + meta.num_blocks) * meta.block_size < meta.num_tokens:
        return f"{meta.first_block} + {meta.num_blocks} blocks cannot hold {meta.num_tokens} tokens"
    return None
