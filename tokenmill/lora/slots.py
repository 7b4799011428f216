"""LoRASlots: the adapters resident on the device, in ``max_loras`` fixed slots, and the Linear hook.

Per target module (layer, fused module) one stacked A [S, R, n, in] and one block-diagonal B
[S, out, R, n] (each slice's scale folded in) hold every slot's weights zero-padded to
``max_lora_rank`` R, so a step's forward reads them in place (layout: ``ops.add_lora``; on CUDA,
or with ``use_triton``, the Triton kernels of ``triton_ops.py`` read the same tensors). On CPU a
third tensor, B^T [S, R, out] without the block-diagonal zeros, feeds the default path's expand
(``ops.StackedOperands``); the block-diagonal B serves deterministic mode. Which
adapter a slot holds, and when to replace it, is the manager's business (``manager.py``); this file
only stores, copies and applies.
"""
from __future__ import annotations

import functools

import torch

from tokenmill.lora.adapter import BaseModelShapes, LoRAAdapter
from tokenmill.lora.mapping import LoRAMapping
from tokenmill.lora.ops import LoRAWorkspace, SlotOperands, StackedOperands, add_lora, slot_operands

ModuleKey = tuple[int, str]  # (layer index, fused module name such as "self_attn.qkv_proj")


class LoRASlots:
    """Stacked slot weights for every target module of the model.

    Args:
        shapes: the base model's layer count and fused module shapes.
        max_loras: number of slots S.
        max_lora_rank: R, the padded rank.
        dtype, device: of the stacked weights (the model's).

    Attributes:
        lora_a / lora_b: per ModuleKey, [S, R, n, in] / [S, out, R, n] (see ``ops.slot_operands``).
        lora_bt: per ModuleKey, [S, R, out] (see ``ops.StackedOperands``); CPU only (empty elsewhere).
        operands: per ModuleKey, the default CPU path's ``StackedOperands`` (CPU only).
        full_operands: per ModuleKey, [S] views of each slot's GEMM operands over the padded rank R
            (deterministic mode); None for an empty slot.
        ranks: [S] rank of each slot's adapter (0 when empty).
        device_ranks: [S] int32 on the device, ``ranks`` as loaded, for the Triton kernels (a slot
            emptied by the manager keeps its last rank here: no mapping names an empty slot).
        use_triton: apply adapters with the Triton kernels even on CPU (tests, under triton's
            interpreter; the CUDA runner sets it); CUDA inputs always take that path.
        lora_ids: [S] the ``lora_int_id`` each slot holds, None when empty.
        mapping: the current step's token -> slot mapping (set by the model runner), None when no
            token of the step uses an adapter.
    """

    def __init__(
        self, shapes: BaseModelShapes, max_loras: int, max_lora_rank: int, dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        self.shapes = shapes
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.lora_a: dict[ModuleKey, torch.Tensor] = {}
        self.lora_b: dict[ModuleKey, torch.Tensor] = {}
        self.lora_bt: dict[ModuleKey, torch.Tensor] = {}
        self.operands: dict[ModuleKey, StackedOperands] = {}
        self.ranks: list[int] = [0] * max_loras
        on_cpu = torch.device(device).type == "cpu"
        workspace = LoRAWorkspace()  # one for all modules: the hooked layers run one at a time
        for layer in range(shapes.num_layers):
            for name, shape in shapes.modules.items():
                key, n, out = (layer, name), len(shape.output_slices), shape.out_features
                self.lora_a[key] = torch.zeros(max_loras, max_lora_rank, n, shape.in_features, dtype=dtype,
                                               device=device)
                self.lora_b[key] = torch.zeros(max_loras, out, max_lora_rank, n, dtype=dtype, device=device)
                if on_cpu:
                    self.lora_bt[key] = torch.zeros(max_loras, max_lora_rank, out, dtype=dtype)
                    self.operands[key] = StackedOperands(self.lora_a[key], self.lora_b[key], self.lora_bt[key],
                                                         self.ranks, shape.output_slices, workspace)
        self.full_operands: dict[ModuleKey, list[SlotOperands | None]] = {k: [None] * max_loras for k in self.lora_a}
        self.device_ranks = torch.zeros(max_loras, dtype=torch.int32, device=device)
        self.use_triton = False
        self.lora_ids: list[int | None] = [None] * max_loras
        self.mapping: LoRAMapping | None = None

    @property
    def num_bytes(self) -> int:
        tensors = [*self.lora_a.values(), *self.lora_b.values(), *self.lora_bt.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    @torch.no_grad()
    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copy ``adapter`` into ``slot`` (whatever it held before is overwritten; the rest stays zero).

        B is scaled in float32 before the cast to the slot dtype."""
        for key in self.lora_a:
            self.lora_a[key][slot].zero_()
            self.lora_b[key][slot].zero_()
            if key in self.lora_bt:
                self.lora_bt[key][slot].zero_()
        for (layer, name, shard), weights in adapter.weights.items():
            key = (layer, name)
            offset, size = self.shapes.modules[name].output_slices[shard]
            rank = weights.rank
            self.lora_a[key][slot, :rank, shard].copy_(weights.lora_a)  # (r, in)
            scaled_b = weights.lora_b.float() * weights.scale  # (size, r)
            self.lora_b[key][slot, offset : offset + size, :rank, shard].copy_(scaled_b)
            if key in self.lora_bt:
                self.lora_bt[key][slot, :rank, offset : offset + size].copy_(scaled_b.t())  # (r, size)
        for key in self.lora_a:
            self.full_operands[key][slot] = slot_operands(self.lora_a[key], self.lora_b[key], slot, self.max_lora_rank)
        self.ranks[slot] = adapter.rank
        self.device_ranks[slot] = adapter.rank
        self.lora_ids[slot] = adapter.lora_request.lora_int_id

    def hook(self, layer: int, name: str) -> ModuleLoRA:
        """The hook to install as ``Linear.lora`` on module ``name`` of decoder layer ``layer``."""
        return ModuleLoRA(self, (layer, name))


class ModuleLoRA:
    """A Linear's LoRA hook: ``Linear.forward`` calls ``apply(x, y, batch_invariant)`` after its GEMM."""

    def __init__(self, slots: LoRASlots, key: ModuleKey) -> None:
        self.slots = slots
        self.key = key

    def apply(self, x: torch.Tensor, y: torch.Tensor, batch_invariant: bool) -> None:
        """y [T, out] += the adapter delta of every token of x [T, in] that has one (in place)."""
        slots = self.slots
        if slots.mapping is None:
            return
        if x.is_cuda or slots.use_triton:  # deterministic mode (batch_invariant) is CPU-only
            _add_lora_triton()(y, x, slots.lora_a[self.key], slots.lora_b[self.key], slots.device_ranks, slots.mapping)
            return
        operands = slots.full_operands if batch_invariant else slots.operands
        add_lora(y, x, operands[self.key], slots.mapping, batch_invariant)


@functools.cache
def _add_lora_triton():
    """``triton_ops.add_lora_triton``, imported on first use (importing it imports triton)."""
    from tokenmill.lora.triton_ops import add_lora_triton

    return add_lora_triton
