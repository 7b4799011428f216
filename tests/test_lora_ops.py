"""Batched LoRA ops: the grouped shrink/expand path equals the per-token reference over a grid of shapes,
dtypes, ranks, slices and token -> slot assignments; base-model tokens are untouched bit for bit; the
batch-invariant path gives a token the same bits whatever else is batched; the mapping groups tokens
by slot without a per-token loop."""
from __future__ import annotations

import dataclasses
import itertools
import random

import numpy as np
import pytest
import torch

from tokenmill.layers import batch_invariant
from tokenmill.layers.linear import Linear, MergedLinear
from tokenmill.lora.adapter import BaseModelShapes, FusedModuleShape, LoRAAdapter, LoRASliceWeights
from tokenmill.lora.mapping import build_lora_mapping
from tokenmill.lora.ops import add_lora, add_lora_reference
from tokenmill.lora_request import LoRARequest
from tokenmill.lora.slots import LoRASlots

needs_kernels = pytest.mark.skipif(not batch_invariant.available(), reason="no C compiler for the batch-invariant kernels")
MODULE = "self_attn.qkv_proj"  # the module name the packed test slots use, whatever its slices


def slices_of(sizes: list[int]) -> tuple[tuple[int, int], ...]:
    return tuple((sum(sizes[:i]), size) for i, size in enumerate(sizes))


def random_adapter(lora_id: int, in_features: int, sizes: list[int], max_rank: int, rng: random.Random) -> LoRAAdapter:
    """An adapter on one module with a random rank per slice (some slices untargeted when n > 1)."""
    weights = {}
    for i, size in enumerate(sizes):
        if len(sizes) > 1 and rng.random() < 0.3:
            continue
        rank = rng.randint(1, max_rank)
        weights[(0, MODULE, i)] = LoRASliceWeights(
            torch.randn(rank, in_features) / in_features**0.5, torch.randn(size, rank), rng.choice([0.5, 2.0, rank**-0.5])
        )
    if not weights:
        return random_adapter(lora_id, in_features, sizes, max_rank, rng)
    return LoRAAdapter(LoRARequest(f"a{lora_id}", lora_id, "/unused"), max(w.rank for w in weights.values()), weights)


def packed_slots(adapters: list[LoRAAdapter], in_features: int, sizes: list[int], max_rank: int, dtype) -> LoRASlots:
    """LoRASlots for one module holding ``adapters[s]`` in slot s (the real packing code)."""
    shapes = BaseModelShapes(1, {MODULE: FusedModuleShape(in_features, slices_of(sizes))})
    slots = LoRASlots(shapes, len(adapters), max_rank, dtype)
    for slot, adapter in enumerate(adapters):
        slots.load(slot, adapter)
    return slots


def operands(slots: LoRASlots, invariant: bool) -> list:
    """The slot GEMM operands add_lora takes: over each adapter's rank, or the padded rank (deterministic)."""
    return (slots.full_operands if invariant else slots.operands)[(0, MODULE)]


def slot_weights(adapters: list[LoRAAdapter], num_slices: int) -> list[list[LoRASliceWeights | None]]:
    return [[a.weights.get((0, MODULE, i)) for i in range(num_slices)] for a in adapters]


GRID = list(itertools.product(
    [1, 3],  # slots
    [[48], [32, 16, 16], [40, 40]],  # output slice sizes (o_proj-like, qkv-like, gate_up-like)
    [4, 16],  # padded rank R
    [1, 7, 33],  # tokens
))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_slots,sizes,max_rank,num_tokens", GRID)
def test_grouped_path_equals_per_token_reference(num_slots, sizes, max_rank, num_tokens, dtype):
    rng = random.Random(hash((num_slots, tuple(sizes), max_rank, num_tokens)) % 2**32)
    torch.manual_seed(rng.randrange(2**31))
    in_features = 24
    adapters = [random_adapter(s + 1, in_features, sizes, max_rank, rng) for s in range(num_slots)]
    slots = packed_slots(adapters, in_features, sizes, max_rank, dtype)
    x = torch.randn(num_tokens, in_features).to(dtype)
    y = torch.randn(num_tokens, sum(sizes)).to(dtype)
    # Requests of random lengths, each with a random slot or the base model; the tokens follow them.
    lens, request_slots = [], []
    while sum(lens) < num_tokens:
        lens.append(min(rng.randint(1, 5), num_tokens - sum(lens)))
        request_slots.append(rng.choice([None, *range(num_slots)]))
    token_slots = [s for s, n in zip(request_slots, lens) for _ in range(n)]
    mapping = build_lora_mapping(request_slots, np.array(lens))

    expected = y.clone().float()  # the reference in float32 from the float32 adapter weights
    add_lora_reference(expected, x.float(), slot_weights(adapters, len(sizes)), token_slots, slices_of(sizes))
    for invariant in [False, True] if batch_invariant.available() else [False]:
        got = y.clone()
        if mapping is not None:
            add_lora(got, x, operands(slots, invariant), mapping, invariant)
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.15, rtol=0.05)
        torch.testing.assert_close(got.float(), expected, **tol)
        base_rows = [t for t, s in enumerate(token_slots) if s is None]
        assert torch.equal(got[base_rows], y[base_rows])  # base-model tokens: untouched bits


def test_mapping_groups_tokens_by_slot_in_batch_order():
    mapping = build_lora_mapping([2, None, 0, 2, None], np.array([3, 2, 1, 2, 1]))
    # tokens: r0 -> 0..2 (slot 2), r1 -> 3..4 (base), r2 -> 5 (slot 0), r3 -> 6..7 (slot 2), r4 -> 8 (base)
    assert mapping.token_indices.tolist() == [5, 0, 1, 2, 6, 7]
    assert mapping.segments == ((0, 0, 1), (2, 1, 6))
    assert mapping.num_lora_tokens == 6 and mapping.single_slot is None
    assert build_lora_mapping([None, None], np.array([4, 1])) is None
    one = build_lora_mapping([1, 1], np.array([2, 3]))
    assert one.single_slot == 1 and one.token_indices.tolist() == [0, 1, 2, 3, 4] and one.segments == ((1, 0, 5),)
    assert build_lora_mapping([1, None], np.array([2, 3])).single_slot is None


@pytest.mark.parametrize("invariant", [False, pytest.param(True, marks=needs_kernels)], ids=["default", "invariant"])
def test_one_adapter_shortcut_equals_the_gather_scatter_path(invariant):
    """When every token uses one slot, add_lora skips the gather and scatter; the rows are the same
    (bit for bit in the batch-invariant mode, where alone-vs-batched equality depends on it)."""
    rng = random.Random(11)
    torch.manual_seed(11)
    sizes = [32, 16, 16]
    slots = packed_slots([random_adapter(s + 1, 24, sizes, 8, rng) for s in range(2)], 24, sizes, 8, torch.bfloat16)
    x, y = torch.randn(9, 24).to(torch.bfloat16), torch.randn(9, 64).to(torch.bfloat16)
    mapping = build_lora_mapping([1, 1, 1], np.array([2, 4, 3]))
    assert mapping.single_slot == 1
    short, general = y.clone(), y.clone()
    add_lora(short, x, operands(slots, invariant), mapping, invariant)
    add_lora(general, x, operands(slots, invariant), dataclasses.replace(mapping, single_slot=None), invariant)
    if invariant:
        assert torch.equal(short, general)
    else:
        torch.testing.assert_close(short, general)
    assert not torch.equal(short, y)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_batch_invariant_path_gives_a_token_the_same_bits_in_any_batch(dtype):
    """A token's delta depends only on its row and its adapter: alone or among 40 others, first or
    last in its segment, in slot 0 or slot 2 (same adapter), the bits are equal."""
    rng = random.Random(7)
    torch.manual_seed(7)
    in_features, sizes, max_rank = 64, [64, 32, 32], 16
    adapters = [random_adapter(s + 1, in_features, sizes, max_rank, rng) for s in range(2)]
    slots = packed_slots([*adapters, adapters[0]], in_features, sizes, max_rank, dtype)
    token = torch.randn(1, in_features).to(dtype)
    base = torch.randn(1, sum(sizes)).to(dtype)

    def run(num_before: int, num_after: int, slot: int, other_slots: list[int | None]) -> torch.Tensor:
        x = torch.cat([torch.randn(num_before, in_features).to(dtype), token, torch.randn(num_after, in_features).to(dtype)])
        y = torch.cat([torch.randn(num_before, sum(sizes)).to(dtype), base, torch.randn(num_after, sum(sizes)).to(dtype)])
        request_slots = [rng.choice(other_slots) for _ in range(num_before)] + [slot]
        request_slots += [rng.choice(other_slots) for _ in range(num_after)]
        mapping = build_lora_mapping(request_slots, np.ones(len(request_slots), dtype=np.int64))
        add_lora(y, x, operands(slots, True), mapping, batch_invariant=True)
        return y[num_before]

    alone = run(0, 0, 0, [None])
    for before, after, slot, others in [(5, 0, 0, [0]), (0, 40, 0, [None, 1, 0]), (17, 23, 2, [0, 1, 2, None])]:
        assert torch.equal(run(before, after, slot, others), alone)


def test_slots_and_linear_hook_apply_only_with_a_mapping():
    """A MergedLinear with the hook: no mapping -> the base output bit for bit; with one -> base + the
    adapter's delta on its slice only (here k of q|k|v)."""
    torch.manual_seed(3)
    layer = MergedLinear(16, [16, 8, 8])
    layer.weight.data.normal_()
    shapes = BaseModelShapes(1, {"self_attn.qkv_proj": FusedModuleShape(16, ((0, 16), (16, 8), (24, 8)))})
    slots = LoRASlots(shapes, max_loras=2, max_lora_rank=8, dtype=torch.float32)
    lora_a, lora_b = torch.randn(4, 16), torch.randn(8, 4)
    adapter = LoRAAdapter(LoRARequest("k", 5, "/unused"), 4,
                          {(0, "self_attn.qkv_proj", 1): LoRASliceWeights(lora_a, lora_b, 0.25)})
    slots.load(1, adapter)
    assert slots.lora_ids == [None, 5] and slots.ranks == [0, 4]
    layer.lora = slots.hook(0, "self_attn.qkv_proj")
    x = torch.randn(3, 16)
    base = torch.nn.functional.linear(x, layer.weight)
    assert torch.equal(layer(x), base)
    slots.mapping = build_lora_mapping([None, 1], np.array([1, 2]))
    got = layer(x)
    assert torch.equal(got[0], base[0])
    assert torch.equal(got[1:, :16], base[1:, :16]) and torch.equal(got[1:, 24:], base[1:, 24:])
    torch.testing.assert_close(got[1:, 16:24], base[1:, 16:24] + (x[1:] @ lora_a.t() @ lora_b.t()) * 0.25)
    # Reloading the slot with another adapter leaves nothing of the first behind.
    other = LoRAAdapter(LoRARequest("o", 6, "/unused"), 2,
                        {(0, "self_attn.qkv_proj", 0): LoRASliceWeights(torch.randn(2, 16), torch.randn(16, 2), 1.0)})
    slots.load(1, other)
    got = layer(x)
    assert torch.equal(got[1:, 16:], base[1:, 16:])
    assert not torch.equal(got[1:, :16], base[1:, :16])
    assert isinstance(layer, Linear)
