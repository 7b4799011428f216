"""Resident memory stays flat when a server's step shapes keep changing (issue 44's soak finding).

On a CPU with bf16 support, torch sends bf16 matmuls and bf16 flash attention through oneDNN, which
JIT-compiles a kernel per shape and keeps it (about 1.6-2 MiB each; the flash-attention brgemm kernels
without any bound). The engine's torch paths whose shapes follow the step (the SDPA prefill path of
``paged_attention``, the batched LoRA GEMMs, a dense bf16 ``Linear``) must keep that set bounded. Each check runs in a fresh
interpreter: the process's resident memory after 96-192 distinct shapes, minus after a warm-up of a few,
must stay under a bound far below what one cached kernel per shape costs (after the fix a few tens of MiB
at most, for LoRA mostly its workspace growing to the largest step). On a CPU where bf16 never
reaches oneDNN's JIT the growth is near zero either way, and the check still holds.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

GROWTH_BOUND_MIB = 100  # before the fix, on an AVX-512 BF16/AMX box: 129 MiB (SDPA), 203 MiB (LoRA); after: 6-68

PRELUDE = """
import json, random, psutil, torch
torch.set_num_threads(1)
rss = lambda: psutil.Process().memory_info().rss / 2**20
rng = random.Random(0)
"""

SDPA = """
from tokenmill.attention.metadata import build_attention_metadata
from tokenmill.attention.torch_paged import paged_attention

def prefill(length, cached):
    block_size, total = 16, length + cached
    blocks = -(-total // block_size)
    cache = torch.randn(2, blocks, block_size, 2, 64).to(torch.bfloat16)
    q = torch.randn(length, 6, 64).to(torch.bfloat16)
    table = torch.arange(blocks, dtype=torch.int64).view(1, blocks)
    metadata, _ = build_attention_metadata([length], [cached], table.numpy(), block_size)
    out = paged_attention(q, cache[0], cache[1], metadata, 0.125, use_prefill_kernel=False)
    assert torch.isfinite(out.float()).all()

for length in (32, 64, 96):
    prefill(length, 0)
before = rss()
for i in range(96):
    prefill(rng.randint(1, 600), rng.randint(0, 600))
print(json.dumps({"before": before, "after": rss()}))
"""

LORA = """
import numpy as np
from tokenmill.lora.adapter import BaseModelShapes, FusedModuleShape, LoRAAdapter, LoRASliceWeights
from tokenmill.lora.mapping import build_lora_mapping
from tokenmill.lora.ops import add_lora
from tokenmill.lora.slots import LoRASlots
from tokenmill.lora_request import LoRARequest

module, in_features, sizes = "mlp.gate_up_proj", 576, (1536, 1536)
shapes = BaseModelShapes(1, {module: FusedModuleShape(in_features, tuple((sum(sizes[:i]), s) for i, s in enumerate(sizes)))})
slots = LoRASlots(shapes, 2, 8, torch.bfloat16)
for slot in range(2):
    weights = {(0, module, i): LoRASliceWeights(torch.randn(8, in_features) * 0.05, torch.randn(size, 8) * 0.05, 2.0)
               for i, size in enumerate(sizes)}
    slots.load(slot, LoRAAdapter(LoRARequest(f"a{slot}", slot + 1, "/unused"), 8, weights))
operands = slots.operands[(0, module)]

def step(lens, request_slots):
    x = torch.randn(int(sum(lens)), in_features).to(torch.bfloat16)
    y = torch.zeros(x.shape[0], sum(sizes), dtype=torch.bfloat16)
    add_lora(y, x, operands, build_lora_mapping(request_slots, np.array(lens)))
    assert torch.isfinite(y.float()).all()

for n in (1, 8, 64):
    step([n], [0])
before = rss()
for i in range(192):
    if i % 2:
        step([rng.randint(1, 700)], [rng.randint(0, 1)])  # one adapter: the batch is the layout
    else:
        step([rng.randint(1, 40) for _ in range(3)], [0, None, 1])  # two adapters and the base model
print(json.dumps({"before": before, "after": rss()}))
"""

LINEAR = """
from tokenmill.layers.linear import Linear, MergedLinear

layers = [MergedLinear(576, [1536, 1536]), Linear(1536, 576, bias=True)]
for layer in layers:
    torch.nn.init.normal_(layer.weight, std=0.02)
    if layer.bias is not None:
        torch.nn.init.normal_(layer.bias)
    layer.to(torch.bfloat16)

def step(rows):
    h = layers[0](torch.randn(rows, 576).to(torch.bfloat16))
    y = layers[1](h[:, :1536] * h[:, 1536:])
    assert torch.isfinite(y.float()).all()

for rows in (1, 8, 64):
    step(rows)
before = rss()
for i in range(96):
    step(rng.randint(1, 600))  # up to 600 rows: 18 buckets (gemm_rows), far fewer than the 96 shapes
print(json.dumps({"before": before, "after": rss()}))
"""


@pytest.mark.parametrize("body", [SDPA, LORA, LINEAR], ids=["sdpa_prefill", "lora_gemms", "dense_linear"])
def test_step_shapes_do_not_grow_resident_memory(body):
    code = textwrap.dedent(PRELUDE) + textwrap.dedent(body)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rss = json.loads(result.stdout.strip().splitlines()[-1])
    growth = rss["after"] - rss["before"]
    assert growth < GROWTH_BOUND_MIB, f"resident memory grew {growth:.0f} MiB over the step shapes"


@pytest.mark.parametrize("rows", [1, 3, 17, 256, 300, 777, 1024])
@pytest.mark.parametrize("bias", [False, True])
def test_bounded_products_equal_the_plain_ones(rows, bias):
    """The bucketed products give each row what the plain product gives it (bf16: to bf16 rounding, since
    oneDNN may pick a different kernel at another row count; float32 never takes the bucketed path)."""
    import torch
    import torch.nn.functional as F

    from tokenmill.layers.gemm_shapes import bounded_bmm, bounded_linear, gemm_rows, needs_bounded_shapes

    assert [gemm_rows(n) for n in (1, 2, 3, 5, 17, 256, 257, 600, 1000, 1025)] == [1, 2, 4, 8, 32, 256, 288, 640,
                                                                                  1024, 1152]
    assert len({gemm_rows(n) for n in range(1, 4097)}) == 9 + 8 * 4  # powers of two to 256, then 8 per doubling
    assert all(n <= gemm_rows(n) <= max(n * 9 // 8, 2 * n - 1) for n in range(1, 4097))
    torch.manual_seed(rows)
    x, w = torch.randn(rows, 96), torch.randn(80, 96) / 10
    b = torch.randn(80) if bias else None
    for dtype, tol in ((torch.bfloat16, dict(atol=0.05, rtol=0.02)), (torch.float32, dict(atol=0, rtol=0))):
        xd, wd, bd = x.to(dtype), w.to(dtype), None if b is None else b.to(dtype)
        assert needs_bounded_shapes(xd) == (dtype == torch.bfloat16 and torch._C._get_mkldnn_enabled()
                                            and torch.backends.mkldnn.is_available())
        torch.testing.assert_close(bounded_linear(xd, wd, bd).float(), F.linear(xd, wd, bd).float(), **tol)
        a3, b3 = xd.view(1, rows, 96).expand(3, rows, 96), wd.t().unsqueeze(0).expand(3, 96, 80)
        torch.testing.assert_close(bounded_bmm(a3, b3).float(), torch.bmm(a3, b3).float(), **tol)
