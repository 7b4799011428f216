"""The rotary C kernel (layers/csrc/rotary.c) gives torch's bits: apply_rotary_emb's torch expression and the
kernel agree exactly, on every ISA path this CPU can run, for the layouts the models pass (a column slice
of the fused QKV output, q and k after per-head norms), float32 and bf16, odd row counts, and for the
model's own cos/sin cache views."""
from __future__ import annotations

import functools

import pytest
import torch
from transformers import LlamaConfig

from tokenmill import csrc_build
from tokenmill.layers import rotary_embedding as rope
from tokenmill.layers.rotary_embedding import RotaryEmbedding, apply_rotary_emb, rope_cpu

pytestmark = pytest.mark.skipif(not rope.rope_library.available(), reason="rotary CPU kernel unavailable (no C compiler?)")


@functools.cache
def _lib(isa: str):
    return rope.rope_library.load(isa)


def lib_for(isa: str):
    if not csrc_build.isa_supported(isa):
        pytest.skip(f"this CPU cannot run the {isa} path (missing: {', '.join(csrc_build.missing_cpu_flags(isa))})")
    lib = _lib(isa)
    assert lib is not None, f"the {isa} build failed"
    return lib


def torch_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> torch.Tensor:
    """apply_rotary_emb's torch path, written out (the specification)."""
    x = x.reshape(x.shape[0], -1, head_dim)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def cos_sin(positions: torch.Tensor, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    config = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, max_position_embeddings=4096,
                         rope_theta=10000.0)
    return RotaryEmbedding(config, head_dim)(positions, dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    assert a.is_contiguous()
    assert torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a.view(torch.int32),
                       b.contiguous().view(torch.int16) if b.dtype == torch.bfloat16 else b.contiguous().view(torch.int32))


@pytest.mark.parametrize("isa", csrc_build.ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_isa_path_gives_torchs_bits(isa, dtype):
    lib = lib_for(isa)
    gen = torch.Generator().manual_seed(0)
    for T, heads, kv_heads, head_dim in [(1, 9, 3, 64), (7, 9, 3, 64), (33, 4, 2, 128), (5, 3, 1, 6), (130, 2, 2, 16)]:
        qkv = (torch.randn(T, (heads + 2 * kv_heads) * head_dim, generator=gen) * 4).to(dtype)
        positions = torch.randint(0, 4000, (T,), generator=gen)
        cos, sin = cos_sin(positions, head_dim, dtype)
        qk = qkv[:, : (heads + kv_heads) * head_dim]  # strided rows: the fused projection's q|k columns
        same_bits(rope_cpu(qk, cos, sin, head_dim, lib), torch_rope(qk, cos, sin, head_dim))
        q = qkv[:, : heads * head_dim].reshape(T, heads, head_dim)  # [T, H, D] with a row stride
        same_bits(rope_cpu(q, cos, sin, head_dim, lib), torch_rope(q, cos, sin, head_dim))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rotary_emb_takes_the_kernel_and_keeps_special_values(dtype):
    head_dim, T = 64, 11
    x = torch.randn(T, 3 * head_dim).to(dtype)
    x[0, 0], x[1, 1], x[2, 2], x[3, 40] = float("inf"), float("-inf"), float("nan"), 3e38
    cos, sin = cos_sin(torch.arange(T), head_dim, dtype)
    assert rope._kernel_takes(x, cos, sin, head_dim)
    got, want = apply_rotary_emb(x, cos, sin, head_dim), torch_rope(x, cos, sin, head_dim)
    assert torch.equal(got.isnan(), want.isnan())
    finite = ~want.isnan()
    assert torch.equal(got[finite], want[finite])
    old = torch.get_num_threads()
    for threads in (1, 2):  # rows split over threads: same bits
        torch.set_num_threads(threads)
        try:
            assert torch.equal(rope_cpu(x, cos, sin, head_dim).nan_to_num(), want.nan_to_num())
        finally:
            torch.set_num_threads(old)
    assert rope_cpu(x[:0], cos[:0], sin[:0], head_dim).shape == (0, 3, head_dim)
