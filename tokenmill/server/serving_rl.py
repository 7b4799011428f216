"""The RL rollout routes (behind ``--enable-rl-endpoints``; docs/rl.md), with SGLang's names and
vLLM's where SGLang has none:

``POST /update_weights_from_disk``, ``POST /update_weights_from_tensor``, ``POST /reset_prefix_cache``,
``POST /pause_generation``, ``POST /resume_generation``, ``POST /sleep?level=1|2``, ``POST /wake_up``,
``GET /is_sleeping``, ``GET /weight_info``. Without the flag each answers 404 naming it; with
``--api-key`` each needs the key (the server's middleware), and every POST needs a JSON content type. Checkpoints are read and checked in a worker thread while the
requests in flight finish; the copy runs on the engine thread once it is idle (``RLGate``).
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import time
from typing import Literal

from fastapi import APIRouter, Depends
from prometheus_client import Counter
from pydantic import BaseModel, ConfigDict, Field
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from tokenmill.rl.checkpoint import WeightUpdateError, check_dense, check_tensor_specs, read_checkpoint
from tokenmill.server.errors import APIError
from tokenmill.server.rl_gate import RLGate


class UpdateWeightsFromDiskRequest(BaseModel):
    """``POST /update_weights_from_disk`` (SGLang's fields; others are ignored)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model_path: str = Field(min_length=1)
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None


class UpdateWeightsFromTensorRequest(BaseModel):
    """``POST /update_weights_from_tensor``: ``serialized_named_tensors`` holds base64 safetensors
    blobs (``safetensors.torch.save({name: tensor})``), never pickles; any subset of the weights."""

    model_config = ConfigDict(extra="ignore", strict=True)

    serialized_named_tensors: list[str] = Field(min_length=1)
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None


class PauseGenerationRequest(BaseModel):
    """``POST /pause_generation``: ``abort`` the requests in flight (finish reason ``abort``) or ``wait``."""

    model_config = ConfigDict(extra="ignore", strict=True)

    mode: Literal["abort", "wait"] = "abort"


class RLMetrics:
    """``tokenmill:weight_updates_total{source,result}``, ``tokenmill:prefix_cache_flushes_total{reason}``,
    ``tokenmill:generation_pauses_total{mode}`` in the server's registry."""

    def __init__(self, registry, model_name: str) -> None:
        self.model_name = model_name
        self.updates = Counter("tokenmill:weight_updates", "Weight updates by source (disk, tensor) and result.",
                               ["model_name", "source", "result"], registry=registry)
        self.flushes = Counter("tokenmill:prefix_cache_flushes", "Prefix-cache flushes by reason (update, reset, "
                               "sleep).", ["model_name", "reason"], registry=registry)
        self.pauses = Counter("tokenmill:generation_pauses", "pause_generation calls by mode (abort, wait).",
                              ["model_name", "mode"], registry=registry)


def _check_load_format(load_format: str | None) -> None:
    if load_format not in (None, "auto"):
        raise APIError(f"load_format {load_format!r} is not supported; leave it unset", param="load_format")


def _decode_tensors(blobs: list[str], served_config, targets) -> dict:
    """base64 safetensors blobs -> name -> tensor, checked against the model (partial update)."""
    tensors = {}
    for i, blob in enumerate(blobs):
        try:
            part = load_safetensors(base64.b64decode(blob, validate=True))
        except (binascii.Error, SafetensorError, ValueError) as exc:
            raise WeightUpdateError(f"serialized_named_tensors[{i}] is not base64 safetensors data: {exc}",
                                    "serialized_named_tensors") from None
        for name in part:
            if name in tensors:
                raise WeightUpdateError(f"serialized_named_tensors: tensor {name!r} is given twice",
                                        "serialized_named_tensors")
        tensors.update(part)
    tie = bool(getattr(served_config, "tie_word_embeddings", False))
    check_tensor_specs(targets, ((n, tuple(t.shape), t.dtype) for n, t in tensors.items()), tie, partial=True,
                       param="serialized_named_tensors")
    return {n: t for n, t in tensors.items() if n in targets}


def rl_router(state, enabled: bool) -> APIRouter:
    """The RL routes at the server root. ``state``: the ServerState (``state.rl``: its RLGate). Without
    ``enabled`` every route answers 404 naming the flag."""

    def check_enabled() -> None:
        if not enabled:
            raise APIError("the RL endpoints are off; start the server with --enable-rl-endpoints", 404,
                           "not_found_error")

    router = APIRouter(dependencies=[Depends(check_enabled)])
    gate: RLGate = state.rl
    metrics = RLMetrics(state.metrics.registry, state.model_name)

    def info_response(info: dict) -> dict:
        return {"success": True, "message": "Succeeded to update model weights.",
                "num_paused_requests": gate.num_queued, **info}

    async def apply_update(read, source: str, body) -> dict:
        """``read()`` (blocking) gives (tensors, source_path); runs in a worker thread while the gate drains."""
        started = time.perf_counter()
        llm = state.llm()
        check_and_read = asyncio.ensure_future(asyncio.to_thread(read, llm.engine))

        def apply(engine, prepared) -> dict:
            tensors, source_path = prepared
            return engine.update_weights(tensors, source_path=source_path, flush_cache=body.flush_cache,
                                             weight_version=body.weight_version, started=started)

        try:
            info = await gate.exclusive(apply, abort=body.abort_all_requests, prepare=check_and_read)
        except WeightUpdateError as exc:
            metrics.updates.labels(metrics.model_name, source, "error").inc()
            raise APIError(str(exc), param=exc.param) from None
        finally:
            if not check_and_read.done():
                check_and_read.cancel()
        gate.weight_version = info["weight_version"]
        metrics.updates.labels(metrics.model_name, source, "success").inc()
        if body.flush_cache:
            metrics.flushes.labels(metrics.model_name, "update").inc()
        return info_response(info)

    @router.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: UpdateWeightsFromDiskRequest) -> dict:
        """Load a safetensors directory or GGUF file of the served architecture into the weights in place."""
        _check_load_format(body.load_format)

        def read(engine):
            check_dense(engine.loaded.model)
            tensors = read_checkpoint(body.model_path, engine.loaded.hf_config, engine.rl_state.targets,
                                      use_gguf_cache=engine.is_served_gguf(body.model_path))
            return tensors, body.model_path

        return await apply_update(read, "disk", body)

    @router.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(body: UpdateWeightsFromTensorRequest) -> dict:
        """Replace the named tensors given (any subset of the checkpoint names) in place."""
        _check_load_format(body.load_format)

        def read(engine):
            check_dense(engine.loaded.model)
            return _decode_tensors(body.serialized_named_tensors, engine.loaded.hf_config,
                                   engine.rl_state.targets), None

        return await apply_update(read, "tensor", body)

    @router.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict:
        """Forget every cached KV block (pool, RAM and disk tiers) once the requests in flight finish."""
        try:
            await gate.exclusive(lambda engine: engine.flush_prefix_cache(clear_disk=True))
        except WeightUpdateError as exc:
            raise APIError(str(exc), param=exc.param) from None
        metrics.flushes.labels(metrics.model_name, "reset").inc()
        return {"success": True}

    @router.post("/pause_generation")
    async def pause_generation(body: PauseGenerationRequest | None = None) -> dict:
        """Stop starting requests; abort or wait for those in flight; returns once the engine is idle."""
        mode = body.mode if body is not None else "abort"
        metrics.pauses.labels(metrics.model_name, mode).inc()
        num_aborted = await gate.pause(mode)
        return {"success": True, "paused": True, "mode": mode, "num_aborted_requests": num_aborted}

    @router.post("/resume_generation")
    async def resume_generation() -> dict:
        """Start the requests queued while paused and take new ones."""
        gate.resume()
        return {"success": True, "paused": False}

    @router.post("/sleep")
    async def sleep(level: int = 1) -> dict:
        """Free the KV pool (level 1) and the weights (level 2) once the requests in flight finish;
        requests get 503 until ``/wake_up``."""
        if level not in (1, 2):
            raise APIError(f"level must be 1 or 2, got {level}", param="level")
        try:
            await gate.sleep(level)
        except WeightUpdateError as exc:
            raise APIError(str(exc), param=exc.param) from None
        metrics.flushes.labels(metrics.model_name, "sleep").inc()
        return {"success": True, "is_sleeping": True, "level": level}

    @router.post("/wake_up")
    async def wake_up() -> dict:
        """Restore the KV pool and the weights; requests are taken again."""
        await gate.wake_up()
        return {"success": True, "is_sleeping": False}

    @router.get("/is_sleeping")
    async def is_sleeping() -> dict:
        """``{"is_sleeping": bool}`` (vLLM's route)."""
        return {"is_sleeping": gate.sleeping}

    @router.get("/weight_info")
    async def weight_info() -> dict:
        """Version, fingerprint, path and load time of the served weights, update and flush counts,
        pause and sleep state."""
        state.llm()
        info = await gate.call_engine(lambda engine: engine.weight_info())
        return {**info, "paused": gate.user_paused, "num_queued_requests": gate.num_queued}

    return router
