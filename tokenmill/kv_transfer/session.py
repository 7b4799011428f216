"""Session save/restore: a conversation's KV blocks written to a portable file and read back into the
prefix cache later, by this server or another with the same model (llama.cpp's slot save/restore,
with the checks that make it safe: model and tokenizer fingerprints, KV dtype, block size, checksum).

A session ``ID`` under ``--session-save-path DIR`` is the directory ``DIR/ID/`` holding
``kv.safetensors`` (tensor ``kv``: ``(num_blocks, layers, 2, block_size, kv_heads, head_dim)``, and for a
hybrid model the state checkpoints of some of the blocks, ``state_conv`` and ``state_recurrent``, see
``blocks.export_blocks``) and ``session.json`` (``KVBlockMeta`` plus the session id and time). It is written to a temporary
directory and renamed, so a reader never sees half a session. File I/O only; the engine-side copies
are ``blocks.py``'s.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tokenmill.kv_transfer.blocks import KVBlockMeta, KVBlocksError

SESSION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
META_FILE, KV_FILE = "session.json", "kv.safetensors"


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


def write_session(root: str | Path, session_id: str, meta: KVBlockMeta, blocks: torch.Tensor,
                  state: dict[str, torch.Tensor] | None = None) -> dict:
    """Write (or replace) a session atomically: ``blocks`` and ``state`` as ``export_blocks`` returns them.
    Returns ``{"id", "path", "bytes"}``."""
    target = session_dir(root, session_id)
    Path(root).mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{session_id}.", dir=root))
    try:
        tensors = {"kv": blocks.contiguous(), **{name: t.contiguous() for name, t in (state or {}).items()}}
        save_file(tensors, str(staging / KV_FILE), metadata={"format": "tokenmill-kv-session"})
        record = {**dataclasses.asdict(meta), "session_id": session_id, "saved_at": round(time.time(), 3)}
        (staging / META_FILE).write_text(json.dumps(record, indent=1))
        for name in (KV_FILE, META_FILE):
            with open(staging / name, "rb") as f:
                os.fsync(f.fileno())
        if target.exists():
            old = target.with_name(f".{session_id}.old.{os.getpid()}")
            target.rename(old)
            staging.rename(target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return {"id": session_id, "path": str(target),
            "bytes": sum(p.stat().st_size for p in target.iterdir())}


def read_session(root: str | Path, session_id: str) -> tuple[KVBlockMeta, torch.Tensor, dict[str, torch.Tensor]]:
    """(metadata, blocks, state) of a saved session (state: its linear-attention state checkpoints, empty for a
    model without them).

    Raises:
        KVBlocksError: 404 when there is no such session; 400 when its files are unreadable.
    """
    path = session_dir(root, session_id)
    if not (path / META_FILE).is_file() or not (path / KV_FILE).is_file():
        raise KVBlocksError(f"no saved session {session_id!r}", "session_id", 404)
    try:
        raw = json.loads((path / META_FILE).read_text())
    except ValueError as exc:
        raise KVBlocksError(f"session {session_id!r}: unreadable {META_FILE}: {exc}", "session_id") from None
    if not isinstance(raw, dict):
        raise KVBlocksError(f"session {session_id!r}: {META_FILE} is not an object", "session_id")
    raw.pop("session_id", None)
    raw.pop("saved_at", None)
    meta = KVBlockMeta.from_json(json.dumps(raw))
    try:
        tensors = load_file(str(path / KV_FILE))
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
