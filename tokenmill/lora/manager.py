"""LoRAManager: registration, the host LRU of loaded adapters, slot placement between steps, counters.

Adapters are read from disk into a host LRU of ``max_cpu_loras``; before each forward, the adapters of
the step are made resident in the ``max_loras`` device slots, a missing one taking a free slot or the
least recently used slot no request of this step needs. The scheduler guarantees a step never has
more than ``max_loras`` distinct adapters (``step_adapters.py``), so placement always succeeds.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import nn

from tokenmill.config import LoRAConfig
from tokenmill.lora.adapter import (FUSED_MODULES, BaseModelShapes, FusedModuleShape, LoRAAdapter, LoRAAdapterError,
                                    load_adapter)
from tokenmill.lora_request import LoRARequest
from tokenmill.lora.slots import LoRASlots

logger = logging.getLogger(__name__)


def _has_submodule(module: nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True


def base_model_shapes(model: nn.Module) -> BaseModelShapes:
    """The fused projection shapes of a Llama-like model (``model.model.layers[i].self_attn.qkv_proj`` ...);
    a projection that not every layer has (the MLP of a mixture-of-experts model) is left out.

    Raises:
        ValueError: a model without that structure (LoRA cannot be enabled on it).
    """
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not layers:
        raise ValueError(f"LoRA needs a Llama-like decoder (model.layers); {type(model).__name__} has none")
    modules = {}
    for name in FUSED_MODULES:
        # a mixture-of-experts model's MLP is a router and experts: adapters reach its attention projections only
        if not all(_has_submodule(layer, name) for layer in layers):
            continue
        module = layers[0].get_submodule(name)
        sizes = getattr(module, "output_sizes", [module.out_features])
        offsets = getattr(module, "offsets", [0])
        modules[name] = FusedModuleShape(module.in_features, tuple(zip(offsets, sizes)))
    return BaseModelShapes(len(layers), modules)


class LoRAManager:
    """Owns the adapters of one engine: installs the Linear hooks and keeps the slots filled.

    Args:
        config: max_loras (slots), max_lora_rank, max_cpu_loras (host LRU size).
        model: the base model; every q/k/v/o/gate/up/down projection gets a ``lora`` hook.
        dtype, device: of the model's weights (slot weights use the same).

    Counters (cumulative): ``num_disk_loads`` (adapters read from disk), ``num_host_evictions``,
    ``num_slot_loads`` (adapters copied into a slot), ``num_slot_evictions`` (a resident adapter
    replaced by another), ``num_removed`` (adapters removed with ``remove``).

    Engine thread only, except ``check`` (reads files, touches no state).
    """

    def __init__(self, config: LoRAConfig, model: nn.Module, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        self.config = config
        self.shapes = base_model_shapes(model)
        self.slots = LoRASlots(self.shapes, config.max_loras, config.max_lora_rank, dtype, device)
        layers = model.model.layers
        for i in range(self.shapes.num_layers):
            for name in self.shapes.modules:
                layers[i].get_submodule(name).lora = self.slots.hook(i, name)
        self._host: OrderedDict[int, LoRAAdapter] = OrderedDict()  # lora_int_id -> adapter, least recent first
        self._slot_lru: OrderedDict[int, None] = OrderedDict((s, None) for s in range(config.max_loras))
        self._registered: dict[int, LoRARequest] = {}
        self._retired: set[int] = set()  # ids of removed adapters: never served again
        self.num_disk_loads = 0
        self.num_host_evictions = 0
        self.num_slot_loads = 0
        self.num_slot_evictions = 0
        self.num_removed = 0
        logger.info("LoRA: %d slots of rank %d (%.1f MiB), %d adapters kept in host memory", config.max_loras,
                    config.max_lora_rank, self.slots.num_bytes / 2**20, config.host_capacity)

    # ---- intake --------------------------------------------------------------------------
    def register(self, lora_request: LoRARequest) -> LoRAAdapter:
        """Check an incoming request's adapter, reading it into the host cache if it is not there.

        Returns the adapter (its ``digest`` keys the request's prefix-cache blocks).

        Raises:
            ValueError: the id already names another adapter (name or path), or names a removed one.
            LoRAAdapterError (a ValueError): the adapter is refused (the message names it and why).
        """
        self._check_id(lora_request)
        adapter = self._host_adapter(lora_request)
        self._registered[lora_request.lora_int_id] = lora_request
        return adapter

    def check(self, lora_request: LoRARequest) -> LoRAAdapter:
        """Read and validate an adapter without registering it (safe from any thread: no state is touched).

        Raises:
            LoRAAdapterError: refused (see ``adapter.load_adapter``).
        """
        return load_adapter(lora_request, self.shapes, self.config.max_lora_rank)

    def add(self, adapter: LoRAAdapter) -> bool:
        """Register an adapter read by ``check`` and keep it in the host cache (vLLM's ``add_lora``).

        Returns False if its id was already registered (the adapter is then left as it was).

        Raises:
            ValueError: the id names another adapter, or a removed one.
        """
        lora_request = adapter.lora_request
        self._check_id(lora_request)
        if lora_request.lora_int_id in self._registered:
            return False
        self._host[lora_request.lora_int_id] = adapter
        self.num_disk_loads += 1  # ``check`` read it
        self._evict_host()
        self._registered[lora_request.lora_int_id] = lora_request
        return True

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter: out of its slot, the host cache and the registry; its id is retired
        (a later request with it is refused). The caller makes sure no request still uses it.
        Returns False if the id was not registered."""
        if self._registered.pop(lora_int_id, None) is None:
            return False
        self._retired.add(lora_int_id)
        self._host.pop(lora_int_id, None)
        for slot, resident in enumerate(self.slots.lora_ids):
            if resident == lora_int_id:
                self.slots.lora_ids[slot] = None  # an empty slot: never in a mapping, reused first
                self.slots.ranks[slot] = 0
        self.num_removed += 1
        return True

    def list_loras(self) -> list[LoRARequest]:
        """The registered adapters, by id."""
        return [self._registered[i] for i in sorted(self._registered)]

    def _check_id(self, lora_request: LoRARequest) -> None:
        lora_id = lora_request.lora_int_id
        if lora_id in self._retired:
            raise LoRAAdapterError(lora_request.lora_name, f"lora_int_id {lora_id} belongs to an adapter that was "
                                   "removed; load it again under a new id")
        known = self._registered.get(lora_id)
        if known is not None and known != lora_request:
            raise ValueError(
                f"lora_int_id {lora_id} already names adapter {known.lora_name!r} at "
                f"{known.lora_path!r}; adapter {lora_request.lora_name!r} at {lora_request.lora_path!r} needs another id"
            )

    # ---- placement between steps ---------------------------------------------------------
    def activate(self, lora_requests: Sequence[LoRARequest | None]) -> list[int | None]:
        """Make the adapters of a step's requests resident; returns each request's slot (None: base model)."""
        wanted = list(dict.fromkeys(r.lora_int_id for r in lora_requests if r is not None))
        assert len(wanted) <= self.config.max_loras, f"{len(wanted)} adapters in one step, {self.config.max_loras} slots"
        slot_of = {lora_id: slot for slot, lora_id in enumerate(self.slots.lora_ids) if lora_id is not None}
        needed = set(wanted)
        for lora_request in (r for r in lora_requests if r is not None):
            lora_id = lora_request.lora_int_id
            if lora_id not in slot_of:
                slot = self._free_or_idle_slot(needed)
                if self.slots.lora_ids[slot] is not None:
                    del slot_of[self.slots.lora_ids[slot]]
                    self.num_slot_evictions += 1
                self.slots.load(slot, self._host_adapter(lora_request))
                self.num_slot_loads += 1
                slot_of[lora_id] = slot
            self._slot_lru.move_to_end(slot_of[lora_id])
        return [None if r is None else slot_of[r.lora_int_id] for r in lora_requests]

    def _free_or_idle_slot(self, needed: set[int]) -> int:
        """An empty slot, else the least recently used one whose adapter this step does not need."""
        for slot in self._slot_lru:
            if self.slots.lora_ids[slot] is None:
                return slot
        for slot in self._slot_lru:
            if self.slots.lora_ids[slot] not in needed:
                return slot
        raise AssertionError("no idle LoRA slot: the scheduler let more than max_loras adapters into a step")

    def _host_adapter(self, lora_request: LoRARequest) -> LoRAAdapter:
        """The adapter from the host LRU, read from disk (and inserted, evicting the LRU one) on a miss."""
        lora_id = lora_request.lora_int_id
        adapter = self._host.get(lora_id)
        if adapter is not None:
            self._host.move_to_end(lora_id)
            return adapter
        adapter = self.check(lora_request)
        self.num_disk_loads += 1
        self._host[lora_id] = adapter
        self._evict_host()
        return adapter

    def _evict_host(self) -> None:
        while len(self._host) > self.config.host_capacity:
            self._host.popitem(last=False)
            self.num_host_evictions += 1

    # ---- state -----------------------------------------------------------------------------
    @property
    def resident_lora_ids(self) -> list[int | None]:
        """The adapter id in each slot (None: empty)."""
        return list(self.slots.lora_ids)

    @property
    def host_lora_ids(self) -> list[int]:
        """Adapters in host memory, least recently used first."""
        return list(self._host)

    def stats(self) -> dict[str, int]:
        return {
            "disk_loads": self.num_disk_loads,
            "host_evictions": self.num_host_evictions,
            "slot_loads": self.num_slot_loads,
            "slot_evictions": self.num_slot_evictions,
        }
