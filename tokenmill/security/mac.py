"""HMAC-SHA256 message authentication with a purpose label (domain separation), and signed parameter
objects (``kv_transfer_params`` from the router to a worker).

A MAC binds the purpose, then each part with its length, so ``("ab", "c")`` and ``("a", "bc")`` differ and
a MAC made for one purpose (a KV frame) is never accepted for another (a session file).
"""
from __future__ import annotations

import hashlib
import hmac
import json
import struct
import time

_LEN = struct.Struct(">Q")
PARAMS_FIELD = "auth"  # the signature's key inside a signed parameter object


class AuthError(PermissionError):
    """A message whose MAC is missing, wrong or stale."""


def _as_bytes(part) -> bytes:
    if isinstance(part, (bytes, bytearray, memoryview)):
        return bytes(part)
    if isinstance(part, str):
        return part.encode()
    raise TypeError(f"MAC parts are bytes or str, got {type(part).__name__}")


def sign(secret: bytes, purpose: str, *parts) -> str:
    """Hex HMAC-SHA256 under ``secret`` of the purpose label and each part (bytes or str), length-prefixed.

    For payloads too large to join in memory, pass ``hashlib.sha256(payload).digest()`` as a part.
    """
    mac = hmac.new(secret, digestmod=hashlib.sha256)
    for part in (purpose, *parts):
        data = _as_bytes(part)
        mac.update(_LEN.pack(len(data)))
        mac.update(data)
    return mac.hexdigest()


def verify(secret: bytes, purpose: str, mac: str | None, *parts) -> bool:
    """Whether ``mac`` is ``sign(secret, purpose, *parts)`` (constant-time compare)."""
    if not isinstance(mac, str):
        return False
    return hmac.compare_digest(mac.encode(), sign(secret, purpose, *parts).encode())


def _canonical(params: dict) -> bytes:
    body = {k: v for k, v in params.items() if k != PARAMS_FIELD}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def sign_params(secret: bytes, params: dict, purpose: str = "kv_transfer_params", now: float | None = None) -> dict:
    """``params`` with ``"auth": {"ts": unix seconds, "mac": hex}`` added: an HMAC of the canonical JSON of
    the other fields and the time, so a worker can tell the router's parameters from a client's."""
    ts = int(time.time() if now is None else now)
    return {**params, PARAMS_FIELD: {"ts": ts, "mac": sign(secret, purpose, _canonical(params), str(ts))}}


def verify_params(secret: bytes, params: dict, purpose: str = "kv_transfer_params", max_age_s: float = 300.0,
                  now: float | None = None) -> dict:
    """The parameters without their ``auth`` field, once its MAC and age are checked.

    Raises:
        AuthError: no ``auth`` field, a wrong MAC, or a timestamp further than ``max_age_s`` from now.
    """
    if not isinstance(params, dict):
        raise AuthError("parameters must be an object")
    auth = params.get(PARAMS_FIELD)
    if not isinstance(auth, dict) or not isinstance(auth.get("ts"), int) or isinstance(auth.get("ts"), bool):
        raise AuthError(f"{purpose} is not signed with the cluster secret")
    ts = auth["ts"]
    if abs((time.time() if now is None else now) - ts) > max_age_s:
        raise AuthError(f"{purpose} signature is stale")
    if not verify(secret, purpose, auth.get("mac"), _canonical(params), str(ts)):
        raise AuthError(f"{purpose} signature does not match the cluster secret")
    return {k: v for k, v in params.items() if k != PARAMS_FIELD}
