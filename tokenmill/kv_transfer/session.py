"""Session save/restore: a conversation's KV blocks written to a portable file and read back into the
prefix cache later, by this server or another with the same model (llama.cpp's slot save/restore,
with the checks that make it safe: model and tokenizer fingerprints, KV dtype, block size, checksum).

A session ``ID`` under ``--session-save-path DIR`` is the directory ``DIR/ID/`` holding
``kv.safetensors`` (tensor ``kv``: ``(num_blocks, layers, 2, block_size, kv_heads, head_dim)``, and for a
hybrid model the state checkpoints of some of the blocks, ``state_conv`` and ``state_recurrent``, see
``BlockIO.export_blocks``) and ``session.json`` (``KVBlockMeta`` plus the session id and time). It is written to a temporary
directory and renamed, so a reader never sees half a session. File I/O only; the engine-side copies
are ``blocks.py``'s.

Limits (``SessionQuota``): a session larger than ``max_session_bytes`` (413) or one that would take the
directory past ``max_total_bytes`` (507) is refused before anything is renamed into place; saving the
same blocks under new ids counts every copy. Integrity: with a secret, ``session.mac`` holds an
HMAC-SHA256 (tokenmill.security) of the id and both files, and a read refuses a session whose MAC is
missing or wrong (changed on disk, or planted by someone without the secret).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load, load_file, save_file

from tokenmill.kv_transfer.blocks import KVBlockMeta, KVBlocksError
from tokenmill.security import sign, verify

SESSION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
META_FILE, KV_FILE, MAC_FILE = "session.json", "kv.safetensors", "session.mac"
MAC_PURPOSE = "kv_session"
_write_lock = threading.Lock()  # one quota check + write at a time in this process


@dataclass(frozen=True)
class SessionQuota:
    """Disk limits of a session directory, in bytes (None: no limit).

    Args:
        max_session_bytes: the files of one session (``--session-max-bytes``).
        max_total_bytes: every file under the directory (``--session-max-total-bytes``).

    Raises:
        ValueError: a limit below 1.
    """

    max_session_bytes: int | None = None
    max_total_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_session_bytes", "max_total_bytes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def directory_bytes(path: str | Path) -> int:
    """Bytes of the regular files under ``path`` (symlinks not followed; 0 when it does not exist)."""
    total = 0
    for dirpath, _, filenames in os.walk(path):
        for name in filenames:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except FileNotFoundError:
                continue
            total += st.st_size
    return total


def session_dir(root: str | Path, session_id: str) -> Path:
    """``root/session_id``.

    Raises:
        KVBlocksError: an id that is not 1-128 of ``[A-Za-z0-9_.-]`` starting with a letter or digit
            (so it can never name a path outside ``root``).
    """
    if not isinstance(session_id, str) or not SESSION_ID.fullmatch(session_id):
        raise KVBlocksError(f"session_id must be 1-128 characters of [A-Za-z0-9_.-] starting with a letter or "
                            f"digit, got {session_id!r}", "session_id")
    return Path(root) / session_id


def _file_digest(path: Path) -> bytes:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.digest()


def session_mac(secret: bytes, session_id: str, kv_digest: bytes, meta_bytes: bytes) -> str:
    """The HMAC-SHA256 (hex) of a session: its id, the sha256 of ``kv.safetensors`` and ``session.json``'s bytes."""
    return sign(secret, MAC_PURPOSE, session_id, kv_digest, meta_bytes)


def _check_quota(quota: SessionQuota, used: int, size: int, param: str) -> None:
    """Raise KVBlocksError when a session of ``size`` bytes breaks ``quota`` with ``used`` bytes already taken."""
    if quota.max_session_bytes is not None and size > quota.max_session_bytes:
        raise KVBlocksError(f"{param}: the session would take {size} bytes, over the server's limit of "
                            f"{quota.max_session_bytes} per session (--session-max-bytes)", param, 413)
    if quota.max_total_bytes is not None and used + size > quota.max_total_bytes:
        raise KVBlocksError(f"the session directory holds {used} bytes and this session needs {size} more, over "
                            f"its quota of {quota.max_total_bytes} (--session-max-total-bytes); delete sessions "
                            "first (DELETE /v1/sessions/{id})", "session_id", 507)


def write_session(root: str | Path, session_id: str, meta: KVBlockMeta, blocks: torch.Tensor,
                  state: dict[str, torch.Tensor] | None = None, *, quota: SessionQuota | None = None,
                  secret: bytes | None = None, param: str = "token_ids") -> dict:
    """Write (or replace) a session atomically: ``blocks`` and ``state`` as ``export_blocks`` returns them.
    Returns ``{"id", "path", "bytes"}``.

    Args:
        quota: disk limits, checked before writing (from the tensors' sizes) and on the written files
            before they are renamed into place; a replaced session's old files do not count.
        secret: when given, ``session.mac`` is written too (``read_session`` with the same secret checks it).
        param: the request field named by a per-session limit error.

    Raises:
        KVBlocksError: 413 over ``max_session_bytes``, 507 over ``max_total_bytes`` or the free disk
            space (nothing is left behind), 400 for a bad id.
    """
    target = session_dir(root, session_id)
    Path(root).mkdir(parents=True, exist_ok=True)
    quota = quota or SessionQuota()
    tensors = {"kv": blocks.contiguous(), **{name: t.contiguous() for name, t in (state or {}).items()}}
    record = {**dataclasses.asdict(meta), "session_id": session_id, "saved_at": round(time.time(), 3)}
    meta_bytes = json.dumps(record, indent=1).encode()
    estimate = sum(t.numel() * t.element_size() for t in tensors.values()) + len(meta_bytes)
    with _write_lock:
        used = directory_bytes(root) - directory_bytes(target)
        _check_quota(quota, used, estimate, param)
        if shutil.disk_usage(root).free < estimate:
            raise KVBlocksError(f"not enough free disk space under the session directory for {estimate} bytes",
                                "session_id", 507)
        staging = Path(tempfile.mkdtemp(prefix=f".{session_id}.", dir=root))
        try:
            _write_staged(staging, target, session_id, tensors, meta_bytes, secret)
            _check_quota(quota, used, directory_bytes(staging), param)
            _replace(staging, target, session_id)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return {"id": session_id, "path": str(target),
            "bytes": sum(p.stat().st_size for p in target.iterdir())}


def _write_staged(staging: Path, target: Path, session_id: str, tensors: dict[str, torch.Tensor],
                  meta_bytes: bytes, secret: bytes | None) -> None:
    save_file(tensors, str(staging / KV_FILE), metadata={"format": "tokenmill-kv-session"})
    (staging / META_FILE).write_bytes(meta_bytes)
    names = [KV_FILE, META_FILE]
    if secret is not None:
        mac = session_mac(secret, session_id, _file_digest(staging / KV_FILE), meta_bytes)
        (staging / MAC_FILE).write_text(json.dumps({"alg": "hmac-sha256", "mac": mac}))
        names.append(MAC_FILE)
    for name in names:
        with open(staging / name, "rb") as f:
            os.fsync(f.fileno())


def _replace(staging: Path, target: Path, session_id: str) -> None:
    """Rename ``staging`` to ``target``, replacing an older session of that id."""
    if not target.exists():
        staging.rename(target)
        return
    old = target.with_name(f".{session_id}.old.{os.getpid()}")
    target.rename(old)
    staging.rename(target)
    shutil.rmtree(old, ignore_errors=True)


def read_session(root: str | Path, session_id: str, *, secret: bytes | None = None
                 ) -> tuple[KVBlockMeta, torch.Tensor, dict[str, torch.Tensor]]:
    """(metadata, blocks, state) of a saved session (state: its linear-attention state checkpoints, empty for a
    model without them).

    Args:
        secret: when given, the session's ``session.mac`` must match its id and files under this secret
            (the bytes checked are the bytes loaded).

    Raises:
        KVBlocksError: 404 when there is no such session; 400 when its files are unreadable or, with
            ``secret``, its MAC is missing or wrong.
    """
    path = session_dir(root, session_id)
    if not (path / META_FILE).is_file() or not (path / KV_FILE).is_file():
        raise KVBlocksError(f"no saved session {session_id!r}", "session_id", 404)
    meta_bytes = (path / META_FILE).read_bytes()
    kv_bytes = None
    if secret is not None:
        kv_bytes = (path / KV_FILE).read_bytes()
        try:
            mac = json.loads((path / MAC_FILE).read_text()).get("mac")
        except (OSError, ValueError, AttributeError):
            mac = None
        if not verify(secret, MAC_PURPOSE, mac, session_id, hashlib.sha256(kv_bytes).digest(), meta_bytes):
            raise KVBlocksError(f"session {session_id!r} fails its integrity check (HMAC): its files were changed, "
                                "or written without this server's --session-secret-file", "session_id")
    try:
        raw = json.loads(meta_bytes)
    except ValueError as exc:
        raise KVBlocksError(f"session {session_id!r}: unreadable {META_FILE}: {exc}", "session_id") from None
    if not isinstance(raw, dict):
        raise KVBlocksError(f"session {session_id!r}: {META_FILE} is not an object", "session_id")
    raw.pop("session_id", None)
    raw.pop("saved_at", None)
    meta = KVBlockMeta.from_json(json.dumps(raw))
    try:
        tensors = load(kv_bytes) if kv_bytes is not None else load_file(str(path / KV_FILE))
        blocks = tensors.pop("kv")
    except Exception as exc:  # noqa: BLE001 — any unreadable file is the client's 400, not a crash
        raise KVBlocksError(f"session {session_id!r}: unreadable {KV_FILE}: {exc}", "session_id") from None
    return meta, blocks, tensors


def delete_session(root: str | Path, session_id: str) -> bool:
    """Erase a session; returns whether it existed."""
    path = session_dir(root, session_id)
    if not path.is_dir():
        return False
    shutil.rmtree(path)
    return True
