"""The LoRA adapters a server serves by name: ``--lora-modules``, ``/v1/models`` entries, and vLLM's
runtime ``POST /v1/load_lora_adapter`` / ``POST /v1/unload_lora_adapter`` (behind
``--allow-runtime-lora-updating``).

Event-loop side only: names map to ``LoRARequest``s here; reading and checking an adapter runs in a
worker thread (``LoRAManager.check`` touches no engine state) and registering or removing it runs
on the engine thread (``AsyncEngine.call``), between steps.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from tokenmill.lora.adapter import LoRAAdapterError
from tokenmill.lora_request import LoRAModulePath, LoRARequest
from tokenmill.server.async_engine import EngineDeadError
from tokenmill.server.errors import APIError

UNLOAD_POLL_S = 0.05  # how often an unload checks whether the adapter's requests have finished


class LoadLoRAAdapterRequest(BaseModel):
    """``POST /v1/load_lora_adapter`` (vLLM's fields)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(BaseModel):
    """``POST /v1/unload_lora_adapter`` (vLLM's fields; ``lora_int_id`` is accepted and ignored)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


@dataclass
class ServedAdapter:
    """An adapter clients reach by ``model: name``; ``unloading`` once an unload has started."""

    lora_request: LoRARequest
    parent: str
    created: int = field(default_factory=lambda: int(time.time()))
    unloading: bool = False


class ServedAdapters:
    """Adapter names of one server (``state.adapters``), their ids, and load/unload.

    Args:
        base_model_name: the served base model's name (``parent`` of every adapter by default;
            no adapter may take it).
        modules: the ``--lora-modules`` entries, registered on the engine at load (``register_static``).
        enabled: the engine runs with ``--enable-lora``.
    """

    def __init__(self, base_model_name: str, modules: tuple[LoRAModulePath, ...] = (), enabled: bool = False) -> None:
        self.base_model_name = base_model_name
        self.enabled = enabled
        self._next_id = 1
        self._adapters: dict[str, ServedAdapter] = {}
        self._pending: set[str] = set()  # names being loaded right now
        for module in modules:
            if module.name == base_model_name or module.name in self._adapters:
                raise ValueError(f"--lora-modules: name {module.name!r} is used twice (or is the base model's name)")
            self._adapters[module.name] = ServedAdapter(self._new_request(module.name, module.path),
                                                        module.base_model_name or base_model_name)

    def _new_request(self, name: str, path: str) -> LoRARequest:
        lora_request = LoRARequest(name, self._next_id, path)  # ids are never reused
        self._next_id += 1
        return lora_request

    def register_static(self, engine) -> None:
        """Load the ``--lora-modules`` adapters into ``engine`` (an LLMEngine; engine thread, at startup).

        Raises:
            LoRAAdapterError: one is refused (the server then fails to start, naming it and why).
        """
        for adapter in self._adapters.values():
            engine.add_lora(adapter.lora_request)

    # ---- lookups -------------------------------------------------------------------------
    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names; None for the base model (or no ``model``).

        Raises:
            APIError: 404 naming ``model`` for an unknown name or an adapter being unloaded.
        """
        if model is None or model == self.base_model_name:
            return None
        adapter = self._adapters.get(model)
        if adapter is None or adapter.unloading:
            why = "is being unloaded" if adapter is not None else "does not exist"
            served = ", ".join(repr(n) for n in [self.base_model_name, *self.names()])
            raise APIError(f"model {model!r} {why}; this server serves {served}", 404, "not_found_error",
                           param="model", code="model_not_found")
        return adapter.lora_request

    def names(self) -> list[str]:
        """Names of the adapters clients can use now."""
        return [name for name, adapter in self._adapters.items() if not adapter.unloading]

    def cards(self, max_model_len: int | None) -> list[dict]:
        """``/v1/models`` entries of the adapters (``root``: the adapter directory, ``parent``: its base model)."""
        cards = []
        for name in self.names():
            adapter = self._adapters[name]
            card = {"id": name, "object": "model", "created": adapter.created, "owned_by": "tokenmill",
                    "root": adapter.lora_request.lora_path, "parent": adapter.parent}
            if max_model_len is not None:
                card["max_model_len"] = max_model_len
            cards.append(card)
        return cards

    # ---- runtime updates -----------------------------------------------------------------
    async def load(self, state, name: str, path: str) -> LoRARequest:
        """Read, check and register an adapter under ``name`` (``state``: the ServerState).

        Raises:
            APIError: 400 without ``--enable-lora``, for a name in use, a directory that is not a
                servable adapter (the reason named); 404 for a path that does not exist.
        """
        if not self.enabled:
            raise APIError("LoRA adapters need a server started with --enable-lora", param="lora_name")
        if name == self.base_model_name or name in self._adapters or name in self._pending:
            raise APIError(f"the name {name!r} is already in use (loaded, loading or the base model); unload it "
                           "first or pick another name", param="lora_name", code="lora_adapter_exists")
        if not Path(path).expanduser().exists():
            raise APIError(f"lora_path {path!r} does not exist", 404, "not_found_error", param="lora_path")
        self._pending.add(name)
        try:
            lora_request = self._new_request(name, path)
            manager = state.llm().engine.lora_manager
            try:
                adapter = await asyncio.to_thread(manager.check, lora_request)  # file reads off the event loop
                await state.engine.call(lambda engine: engine.lora_manager.add(adapter))
            except LoRAAdapterError as exc:
                raise APIError(str(exc), param="lora_path") from None
            except EngineDeadError as exc:
                raise APIError(str(exc), 503, "service_unavailable_error") from None
            self._adapters[name] = ServedAdapter(lora_request, self.base_model_name)
            return lora_request
        finally:
            self._pending.discard(name)

    async def unload(self, state, name: str) -> None:
        """Stop taking requests for ``name``, wait for its requests in flight to finish, then remove it
        from the engine (slot, host cache) and from the names. Survives the caller going away.

        Raises:
            APIError: 404 for an unknown name (or one already being unloaded); 400 for the base model.
        """
        if name == self.base_model_name:
            raise APIError(f"{name!r} is the base model, not a LoRA adapter", param="lora_name")
        adapter = self._adapters.get(name)
        if adapter is None or adapter.unloading:
            raise APIError(f"LoRA adapter {name!r} is not loaded" + (" (it is being unloaded)" if adapter else ""),
                           404, "not_found_error", param="lora_name", code="lora_adapter_not_found")
        adapter.unloading = True
        await asyncio.shield(asyncio.ensure_future(self._finish_unload(state, name, adapter.lora_request)))

    async def _finish_unload(self, state, name: str, lora_request: LoRARequest) -> None:
        def try_remove(engine) -> bool:  # engine thread: removed only once nothing uses it
            if engine.lora_requests_in_flight(lora_request.lora_int_id):
                return False
            engine.remove_lora(lora_request.lora_int_id)
            return True

        try:
            while not await state.engine.call(try_remove):
                await asyncio.sleep(UNLOAD_POLL_S)
        except EngineDeadError:
            pass  # the engine is gone: nothing left to remove
        self._adapters.pop(name, None)


def lora_router(state, allow_runtime_updates: bool) -> APIRouter:
    """The runtime adapter routes, mounted under /v1; without ``--allow-runtime-lora-updating`` both
    answer 404 saying so (as vLLM, whose routes exist only with its environment switch)."""
    router = APIRouter()

    def check_allowed() -> None:
        if not allow_runtime_updates:
            raise APIError("runtime LoRA updating is off; start the server with --allow-runtime-lora-updating "
                           "(and --enable-lora)", 404, "not_found_error")

    @router.post("/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        """Load a PEFT adapter directory and serve it as ``model: lora_name``."""
        check_allowed()
        await state.adapters.load(state, body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @router.post("/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        """Unload an adapter once its requests in flight have finished."""
        check_allowed()
        await state.adapters.unload(state, body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    return router
