"""Session save/restore over HTTP, behind ``--session-save-path DIR`` (docs/sessions.md):

- ``POST /v1/sessions/{id}/save`` with exactly one of ``token_ids``, ``prompt`` or ``messages`` (a chat
  rendered without a generation prompt, e.g. the history including the last assistant answer), plus
  optional ``model`` (a LoRA adapter) and ``cache_salt``: computes what is not cached yet (a 1-token
  request), then writes the full blocks to ``DIR/id``.
- ``POST /v1/sessions/{id}/restore``: reads ``DIR/id`` and makes its blocks prefix-cache entries, all or
  nothing; a later request that starts with those tokens prefills only the rest.
- ``DELETE /v1/sessions/{id}``: erases it.

Without the flag every route answers 404 naming it. The engine-side copies run on the engine thread
(``AsyncEngine.call``), file I/O in worker threads. ``--session-max-bytes`` (413) and
``--session-max-total-bytes`` (507) bound the disk a client can fill; with ``--session-secret-file`` each
session carries an HMAC and a restore refuses one that fails it (``kv_transfer.session``).
"""
from __future__ import annotations

import asyncio
import uuid

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from tokenmill.kv_transfer.blocks import KVBlocksError
from tokenmill.kv_transfer.session import SessionQuota, delete_session, read_session, session_dir, write_session
from tokenmill.security import SecretError, read_secret_file
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.async_engine import EngineDeadError, EngineRequest
from tokenmill.server.errors import APIError
from tokenmill.server.protocol import ChatMessage

SAVE_ATTEMPTS = 3  # a block evicted between computing and copying it is computed again


class SaveSessionRequest(BaseModel):
    """``POST /v1/sessions/{id}/save``: exactly one of ``token_ids``, ``prompt``, ``messages``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    token_ids: list[int] | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    model: str | None = None
    cache_salt: str | None = Field(default=None, max_length=1024)  # as the completions routes bound it


def _api_error(exc: KVBlocksError) -> APIError:
    kind = {404: "not_found_error", 409: "conflict_error", 507: "insufficient_storage_error"}.get(
        exc.status_code, "invalid_request_error")
    code = {413: "request_too_large", 507: "insufficient_storage"}.get(exc.status_code)
    return APIError(str(exc), exc.status_code, kind, param=exc.param, code=code)


def sessions_router(state, save_path: str | None) -> APIRouter:
    """The session routes, mounted under /v1; limits and secret from ``state.config`` (``ServerConfig``).

    Raises:
        SecretError: ``session_secret_file`` cannot be used (missing, open to other users, too short).
    """
    router = APIRouter()
    config = state.config
    quota = SessionQuota(config.session_max_bytes, config.session_max_total_bytes)
    try:
        secret = read_secret_file(config.session_secret_file) if config.session_secret_file else None
    except SecretError as exc:
        raise SecretError(f"--session-secret-file: {exc}") from None

    def root(session_id: str) -> str:
        if save_path is None:
            raise APIError("session save/restore is off; start the server with --session-save-path DIR", 404,
                           "not_found_error")
        try:
            session_dir(save_path, session_id)
        except KVBlocksError as exc:
            raise _api_error(exc) from None
        return save_path

    async def on_engine(fn):
        try:
            return await state.engine.call(fn)
        except EngineDeadError as exc:
            raise APIError(str(exc), 503, "service_unavailable_error") from None
        except KVBlocksError as exc:
            raise _api_error(exc) from None

    async def token_ids_of(body: SaveSessionRequest) -> tuple[list[int], str]:
        given = [name for name in ("token_ids", "prompt", "messages") if getattr(body, name) is not None]
        if len(given) != 1:
            raise APIError("give exactly one of token_ids, prompt or messages", param="token_ids")
        if body.token_ids is not None:
            bad = [t for t in body.token_ids if not 0 <= t < state.vocab_size]
            if bad:
                raise APIError(f"token_ids must be in [0, {state.vocab_size}), got {bad[:5]}", param="token_ids")
            return list(body.token_ids), "token_ids"
        if body.prompt is not None:
            return await asyncio.to_thread(state.tokenizer.encode, body.prompt), "prompt"
        from tokenmill.server.serving_chat import render_chat

        return await asyncio.to_thread(render_chat, state, body.messages, False), "messages"

    @router.post("/sessions/{session_id}/save")
    async def save(session_id: str, body: SaveSessionRequest) -> dict:
        """Compute (if needed) and write the session's full KV blocks."""
        save_root = root(session_id)
        lora_request = state.check_model(body.model)
        token_ids, param = await token_ids_of(body)
        if len(token_ids) + 1 > state.max_model_len:
            raise APIError(f"{param}: {len(token_ids)} tokens do not fit max_model_len {state.max_model_len}",
                           param=param)
        extra_keys = await on_engine(lambda engine: engine.block_io.extra_keys_of(body.cache_salt, lora_request))
        lora_name = lora_request.lora_name if lora_request is not None else None
        for attempt in range(SAVE_ATTEMPTS):
            # One greedy token over the tokens: their blocks are computed (or found) and cached.
            request = EngineRequest(f"session-save-{uuid.uuid4().hex}", token_ids,
                                    SamplingParams(max_tokens=1, temperature=0.0), None, body.cache_salt,
                                    lora_request)
            stream = await state.submit([request], param)
            try:
                async for _ in stream:
                    pass
            finally:
                stream.close()
            try:
                meta, blocks, state_ckpts = await on_engine(
                    lambda engine: engine.block_io.export_blocks(token_ids, extra_keys, lora_name))
                break
            except APIError as exc:
                if exc.status_code != 409 or attempt == SAVE_ATTEMPTS - 1:
                    raise
        try:
            written = await asyncio.to_thread(write_session, save_root, session_id, meta, blocks, state_ckpts,
                                              quota=quota, secret=secret, param=param)
        except KVBlocksError as exc:
            raise _api_error(exc) from None
        return {**written, "num_tokens": len(meta.token_ids), "num_blocks": len(meta.block_hashes),
                "num_prompt_tokens": len(token_ids)}

    @router.post("/sessions/{session_id}/restore")
    async def restore(session_id: str) -> dict:
        """Load a saved session into the prefix cache (all or nothing)."""
        save_root = root(session_id)
        try:
            meta, blocks, state_ckpts = await asyncio.to_thread(read_session, save_root, session_id, secret=secret)
        except KVBlocksError as exc:
            raise _api_error(exc) from None
        result = await on_engine(lambda engine: engine.block_io.import_blocks(meta, blocks, state_ckpts))
        return {"id": session_id, **result}

    @router.delete("/sessions/{session_id}")
    async def delete(session_id: str) -> dict:
        """Erase a saved session."""
        save_root = root(session_id)
        if not await asyncio.to_thread(delete_session, save_root, session_id):
            raise APIError(f"no saved session {session_id!r}", 404, "not_found_error", param="session_id")
        return {"id": session_id, "deleted": True}

    return router
