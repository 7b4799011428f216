"""The decode side of a KV transfer: pull a lease's blocks from a producer and check them.

``pull_blocks`` runs in a worker thread (never on the engine thread): it connects (only to an allowed
producer, when ``allowed_producers`` is set; once more if the producer hangs up before answering), answers the
producer's nonce with a pull signed with the cluster secret, checks the producer's signed answer, refuses a
payload larger than the load needs before allocating a byte, reads the blocks from the socket or from the
``/dev/shm`` file the producer wrote, checks them against what this engine expects (model fingerprint, KV
dtype, block size and shape, the request's own prompt tokens and extra keys, the sha256 the producer signed)
and confirms, so the producer frees its blocks whatever the outcome. One deadline, ``timeout_s`` from the
call, covers the whole exchange.
"""
from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenmill.kv_cache.block_hash import extend_block_hashes
from tokenmill.kv_transfer.protocol import (
    HELLO_FRAME_MAX, ConnectionClosed, TransferError, TransferMeta, frame_is_signed, is_nonce, new_nonce, recv_exact, recv_frame,
    remaining, send_frame, sign_frame,
)

SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "tokenmill-kv-"


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


def allowed_address(host: str, port: int, allowed: tuple[str, ...] | None) -> str:
    """The address to connect to for ``host``: ``host`` itself when ``allowed`` is None or names it, else the
    first of its addresses inside one of the ``allowed`` CIDRs (or equal to a listed address), so the
    connection goes exactly where the check looked.

    Raises:
        TransferError: ``not_allowed`` when none of ``host``'s addresses is allowed.
    """
    if allowed is None:
        return host
    names = {a.lower() for a in allowed if "/" not in a}
    if host.lower() in names:
        return host
    networks = []
    for entry in allowed:
        try:
            networks.append(ipaddress.ip_network(entry, strict=False))
        except ValueError:
            continue  # a host name
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise TransferError("connect", f"cannot resolve the producer {host!r}: {exc}") from None
    for info in infos:
        address = ipaddress.ip_address(info[4][0].split("%", 1)[0])
        if any(address.version == net.version and address in net for net in networks):
            return str(address)
    raise TransferError("not_allowed", f"the producer {host} is not in kv_connector_extra_config.allowed_producers")


def reply_cap(expected: Expected) -> int:
    """Largest producer answer frame this pull accepts: the metadata of a prompt no longer than ours."""
    return 65536 + 32 * len(expected.prompt_token_ids) + 4 * len(json.dumps(expected.extra_keys))


def pull_blocks(host: str, port: int, lease_id: str, expected: Expected, transport: str = "auto",
                timeout_s: float = 30.0, first_block: int = 0, *, secret: bytes, num_blocks: int | None = None,
                allowed_producers: tuple[str, ...] | None = None) -> tuple[TransferMeta, torch.Tensor, int]:
    """Blocks of a lease from its block ``first_block`` on (at most ``num_blocks``; None: as many as the
    request's prompt can fill): (meta, blocks as the pool's byte rows, uint8 ``(n, block_bytes)``, bytes moved).

    ``transport``: ``tcp``, ``shm`` or ``auto`` (shm when ``host`` is this machine). ``secret``: the cluster
    secret. ``allowed_producers``: hosts or CIDRs the producer must be (None: any). A connection refused, reset
    or closed before the producer's first answer is tried once more within the deadline (a producer closes its
    oldest unauthenticated connections when anonymous ones crowd its port).

    Raises:
        TransferError: ``connect`` (no producer), ``timeout`` (the whole pull took over ``timeout_s``),
            ``not_allowed``, ``auth`` (the producer does not hold the secret, or refused ours), ``refused``
            (unknown or expired lease), ``too_large`` (more bytes than the load needs), ``mismatch`` (another
            model, dtype, layout or prompt), ``corrupt`` (checksum), ``protocol``.
    """
    if transport == "auto":
        transport = "shm" if is_local_host(host) else "tcp"
    deadline = time.monotonic() + timeout_s
    limit = -(-len(expected.prompt_token_ids) // expected.block_size) - first_block
    if num_blocks is not None:
        limit = min(limit, num_blocks)
    if limit < 1:
        raise TransferError("params", f"no block to pull from block {first_block} of a "
                                      f"{len(expected.prompt_token_ids)}-token prompt")
    address = allowed_address(host, port, allowed_producers)
    pull = {"op": "pull", "lease_id": lease_id, "transport": transport, "first_block": first_block,
            "num_blocks": limit}
    for attempt in range(2):  # a connection refused, reset or closed before any answer is tried once more
        try:
            sock, server_nonce, client_nonce, reply = _handshake(address, port, pull, secret, expected, deadline)
            break
        except TransferError as exc:
            if attempt or not (exc.reason == "connect" or isinstance(exc, ConnectionClosed)):
                raise
    with sock:
        if not frame_is_signed(secret, "reply", server_nonce, client_nonce, reply):
            why = reply.get("error") if "mac" not in reply and not reply.get("ok") else "an unsigned answer"
            raise TransferError("auth", f"the producer at {host}:{port} does not prove the cluster secret ({why})")
        if not reply.get("ok"):
            raise TransferError("refused", str(reply.get("error")))
        meta = TransferMeta.from_dict(reply.get("meta") or {})
        nbytes = reply.get("nbytes")
        problem = _mismatch(meta, expected)
        if problem is None and meta.first_block != first_block:
            problem = f"the payload starts at block {meta.first_block}, not {first_block}"
        budget = limit * expected.block_bytes  # what this load can use: nothing larger is allocated
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or not 0 < nbytes <= budget:
            raise TransferError("mismatch", problem) if problem is not None else TransferError(
                "too_large", f"a payload of {nbytes!r} bytes; this load takes at most {limit} blocks of "
                             f"{expected.block_bytes} bytes")  # closed unread: the producer frees the lease
        if problem is None and (nbytes != meta.num_blocks * expected.block_bytes
                                or meta.num_blocks < min(limit, -(-meta.num_tokens // meta.block_size) - first_block)):
            problem = f"a payload of {nbytes} bytes does not hold the {meta.num_blocks} blocks this load needs"
        buf = bytearray(nbytes)  # at most the load's own size
        shm_path = reply.get("shm_path")
        if shm_path is None:  # the bytes follow on the socket: read them even to refuse them
            recv_exact(sock, nbytes, buf, deadline)
        elif problem is None:
            problem = _read_shm(shm_path, buf)
        reason = "mismatch"
        if problem is None and hashlib.sha256(buf).hexdigest() != meta.sha256:
            reason, problem = "corrupt", "the blocks' checksum does not match"
        confirm = {"op": "confirm", "lease_id": lease_id, "ok": problem is None}
        send_frame(sock, sign_frame(secret, "confirm", server_nonce, client_nonce, confirm), deadline=deadline)
        ack = recv_frame(sock, HELLO_FRAME_MAX, deadline)
        if problem is not None:
            raise TransferError(reason, problem)
        if not frame_is_signed(secret, "ack", server_nonce, client_nonce, ack):
            raise TransferError("auth", "the producer's acknowledgement is not signed")
    blocks = torch.frombuffer(buf, dtype=torch.uint8).view(meta.num_blocks, expected.block_bytes)
    return meta, blocks, nbytes


def _handshake(address: str, port: int, pull: dict, secret: bytes, expected: Expected,
               deadline: float) -> tuple[socket.socket, str, str, dict]:
    """Connect, answer the producer's nonce with ``pull`` signed, and read its first answer: (socket, server
    nonce, client nonce, answer). The socket is closed on failure.

    Raises:
        TransferError: ``connect`` (refused, reset), ``timeout``, ``protocol`` (``ConnectionClosed`` when the
            producer hung up before answering: it may have dropped a connection not yet authenticated).
    """
    try:
        sock = socket.create_connection((address, port), timeout=remaining(deadline))
    except socket.timeout:
        raise TransferError("timeout", f"no connection to the producer at {address}:{port} in time") from None
    except OSError as exc:
        raise TransferError("connect", f"cannot reach the producer at {address}:{port}: {exc}") from None
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        server_nonce = recv_frame(sock, HELLO_FRAME_MAX, deadline).get("nonce")
        if not is_nonce(server_nonce):
            raise TransferError("protocol", "the producer sent no nonce")
        client_nonce = new_nonce()
        signed = sign_frame(secret, "pull", server_nonce, client_nonce, {**pull, "nonce": client_nonce})
        send_frame(sock, signed, deadline=deadline)
        reply = recv_frame(sock, reply_cap(expected), deadline)
    except TransferError:
        sock.close()
        raise
    return sock, server_nonce, client_nonce, reply


def _read_shm(shm_path, buf: bytearray) -> str | None:
    """Fill ``buf`` from the producer's shared-memory file; why not, or None."""
    path = Path(shm_path) if isinstance(shm_path, str) else None
    if path is None or path.parent != SHM_DIR or not path.name.startswith(SHM_PREFIX):
        return f"shm_path {shm_path!r} is not a transfer file in {SHM_DIR}"
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | os.O_CLOEXEC)
    except OSError as exc:
        return f"cannot open the shared-memory file: {exc.strerror}"
    with open(fd, "rb") as f:
        if os.fstat(fd).st_size != len(buf) or f.readinto(buf) != len(buf):
            return "the shared-memory file does not hold the payload"
    return None


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
    return None
