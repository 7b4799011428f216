"""The runner's KV pool (tokenmill/runner/kv_pool.py): blocks leave and come back as byte rows holding K/V and,
for an int8/fp8 cache, their scales, bit for bit and in any order; split/join are inverses; bad rows are
refused; release/restore give the memory back and bring it back zeroed with every view still valid."""
from __future__ import annotations

import pytest
import torch

from tokenmill.attention.kv_quant import SCALE_DTYPE
from tokenmill.runner.kv_pool import KVPool

LAYERS, BLOCKS, BLOCK_SIZE, HEADS, DIM = 3, 40, 4, 2, 8


def random_pool(dtype: torch.dtype, blocks: int = BLOCKS) -> KVPool:
    quantized = dtype in (torch.int8, torch.float8_e4m3fn)
    pool = KVPool(LAYERS, blocks, BLOCK_SIZE, HEADS, DIM, dtype, "cpu", SCALE_DTYPE if quantized else None)
    gen = torch.Generator().manual_seed(0)
    pool.kv.view(torch.uint8).copy_(torch.randint(0, 256, pool.kv.shape, dtype=torch.uint8, generator=gen)) \
        if pool.kv.element_size() == 1 else pool.kv.copy_(torch.randn(pool.kv.shape, generator=gen))
    if pool.scales is not None:
        pool.scales.copy_(torch.rand(pool.scales.shape, generator=gen))
    return pool


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn])
def test_blocks_round_trip_as_byte_rows(dtype):
    pool = random_pool(dtype)
    scales = 0 if pool.scales is None else LAYERS * 2 * BLOCK_SIZE * HEADS * SCALE_DTYPE.itemsize
    assert pool.block_bytes == LAYERS * 2 * BLOCK_SIZE * HEADS * DIM * pool.kv.element_size() + scales
    assert pool.nbytes == BLOCKS * pool.block_bytes
    source, target = [5, 0, 17, 3], [30, 31, 2, 9]
    rows = pool.gather(source)
    assert rows.dtype == torch.uint8 and rows.shape == (4, pool.block_bytes)
    kv, sc = pool.split(rows)
    for i, b in enumerate(source):  # the row is the block's K/V in (layers, 2, block_size, heads, dim) order
        assert torch.equal(kv[i].view(torch.uint8), pool.kv[:, :, b].contiguous().view(torch.uint8))
        assert sc is None or torch.equal(sc[i], pool.scales[:, :, b])
    assert torch.equal(pool.join(kv, sc), rows)
    untouched = [b for b in range(BLOCKS) if b not in target]
    before = pool.gather(untouched)
    pool.scatter(target, rows)
    assert torch.equal(pool.gather(target), rows) and torch.equal(pool.gather(untouched), before)
    assert pool.gather([]).shape == (0, pool.block_bytes)
    pool.scatter([], rows[:0])


def test_bad_rows_and_tensors_are_refused():
    pool = random_pool(torch.int8)
    rows = pool.gather([1, 2])
    with pytest.raises(ValueError, match="scatter needs uint8 rows"):
        pool.scatter([1], rows)
    with pytest.raises(ValueError, match="scatter needs uint8 rows"):
        pool.scatter([1, 2], rows[:, :-1])
    kv, sc = pool.split(rows)
    with pytest.raises(ValueError, match="scales are needed"):
        pool.join(kv, None)
    with pytest.raises(ValueError, match="scales must be"):
        pool.join(kv, sc[:, :1])
    with pytest.raises(ValueError, match="blocks must be int8"):
        pool.join(kv.float(), sc)
    with pytest.raises(ValueError, match="scales are needed"):
        random_pool(torch.float32).join(torch.zeros(1, LAYERS, 2, BLOCK_SIZE, HEADS, DIM), sc[:1])


@pytest.mark.parametrize("blocks", [40, 4000], ids=["small", "mapped"])  # 4000 blocks: its own mapping
def test_release_and_restore_keep_views_and_come_back_zeroed(blocks):
    pool = random_pool(torch.int8, blocks)
    layer0 = pool.kv[0, 0]  # a view, as the per-layer caches are
    pool.release()
    assert pool.released
    pool.release()  # no-op
    pool.restore()
    assert not pool.released and not pool.kv.any() and not pool.scales.any()
    layer0[1, 2, 1, 3] = 7
    assert pool.kv[0, 0, 1, 2, 1, 3] == 7  # the view still points into the pool


def test_over_wraps_existing_tensors_without_copying():
    kv = torch.randn(2, 2, 6, 4, 1, 8)
    pool = KVPool.over(kv)
    assert pool.kv is kv and pool.block_shape == (2, 2, 4, 1, 8) and pool.num_blocks == 6
    pool.scatter([4], pool.gather([1]))
    assert torch.equal(kv[:, :, 4], kv[:, :, 1])
    with pytest.raises(ValueError, match="KVPool.over"):
        KVPool.over(torch.zeros(2, 2, 6, 4, 8))
