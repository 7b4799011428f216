"""Triton device code for paged attention: KV-cache write, varlen prefill, split-KV decode and its reduction.

Only ``@triton.jit`` kernels live here; shapes, grids, tile sizes and checks are chosen by
``triton_attention.py``, the only caller. Importing this module requires triton; whether
TRITON_INTERPRET=1 was set when triton and this module were first imported decides whether the
kernels run compiled or under triton's CPU interpreter.

Layouts (strides are passed explicitly; the last dimension of every tensor has stride 1):
    query / out:  [T, H, D]            key / value: [T, KVH, D]
    k/v cache:    [num_blocks, block_size, KVH, D]
    block_table:  [B, max_blocks] int64; query_start_loc [B + 1] int64; seq_lens [B] int64.
Scores are kept in the log2 domain (``scale_log2e = scale * log2(e)``) so softmax uses exp2.
SLIDING (constexpr) with ``window``: sliding-window attention, a query at position p sees keys
p - window < j <= p only (transformers' masks); the key loops start at the first key any of their rows sees.
SOFTCAP (constexpr) with ``softcap_log2e`` (the cap times log2(e)): Gemma 2's attention logit soft-capping,
scores ``cap * tanh(score / cap)`` before the mask and softmax; in the log2 domain that is
``c * tanh(s / c)`` with ``c = cap * log2(e)``, since tanh is applied to ``s / c = score / cap`` either way.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _dot(a, b, DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """a @ b with a float32 accumulator. DOT_F32 upcasts the operands first: triton's
    interpreter multiplies bfloat16 operands as raw integers."""
    if DOT_F32:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b, input_precision=DOT_PRECISION)
    return out


@triton.jit
def _softcap(s, cap):
    """``cap * tanh(s / cap)`` elementwise (float32), tanh written with exp2 (triton has no tanh of its own that
    also runs under the interpreter): tanh(a) = (1 - e^(-2a)) / (1 + e^(-2a)) for a = |s| / cap >= 0, sign put
    back after, so the exponential never overflows."""
    a = tl.abs(s) / cap
    e = tl.exp2(a * -2.8853900817779268)  # e^(-2a) = 2^(-2a * log2(e))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(s < 0, -t, t) * cap


@triton.jit
def write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_key_t, stride_key_h, stride_value_t, stride_value_h,
    stride_kc_block, stride_kc_slot, stride_kc_head,
    stride_vc_block, stride_vc_slot, stride_vc_head,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program per token: copy its [KVH, D] key and value rows into slot_mapping[token]."""
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)  # int64
    if slot < 0:  # padding token: nothing to write
        return
    block_id = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads < NUM_KV_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]  # (BLOCK_H, BLOCK_D)

    key = tl.load(key_ptr + token * stride_key_t + heads[:, None] * stride_key_h + dims[None, :], mask=mask)
    k_dst = k_cache_ptr + block_id * stride_kc_block + offset * stride_kc_slot
    tl.store(k_dst + heads[:, None] * stride_kc_head + dims[None, :], key.to(k_cache_ptr.dtype.element_ty), mask=mask)

    value = tl.load(value_ptr + token * stride_value_t + heads[:, None] * stride_value_h + dims[None, :], mask=mask)
    v_dst = v_cache_ptr + block_id * stride_vc_block + offset * stride_vc_slot
    tl.store(v_dst + heads[:, None] * stride_vc_head + dims[None, :], value.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_table_ptr,
    scale_log2e, num_reqs, window, softcap_log2e,
    stride_q_t, stride_q_h, stride_o_t, stride_o_h,
    stride_k_block, stride_k_slot, stride_k_head,
    stride_v_block, stride_v_slot, stride_v_head,
    stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr, SLIDING: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """Grid (query tiles, H). Tile ``t`` of the step is the tile of BLOCK_M query rows of the
    request whose prefill tiles cover t (requests with one query token own no tiles); its rows
    attend causally to the request's cached prefix plus its chunk, gathered through block_table (under
    SLIDING, to the last ``window`` keys up to their own position)."""
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP

    # Find this tile's request: cumulative prefill tiles over all requests (B <= BLOCK_R).
    reqs = tl.arange(0, BLOCK_R)
    req_valid = reqs < num_reqs
    starts = tl.load(query_start_loc_ptr + reqs, mask=req_valid, other=0)
    ends = tl.load(query_start_loc_ptr + reqs + 1, mask=req_valid, other=0)
    query_lens = ends - starts  # (BLOCK_R,)
    num_tiles = tl.where(query_lens > 1, (query_lens + BLOCK_M - 1) // BLOCK_M, 0)
    tiles_end = tl.cumsum(num_tiles, 0)  # inclusive
    req = tl.sum((tiles_end <= tile).to(tl.int32), 0)
    if req >= num_reqs:  # the grid is an upper bound on the step's tile count
        return
    is_req = reqs == req
    first_tile = tl.sum(tl.where(is_req, tiles_end - num_tiles, 0), 0)
    q_start = tl.sum(tl.where(is_req, starts, 0), 0)
    query_len = tl.sum(tl.where(is_req, query_lens, 0), 0)
    seq_len = tl.load(seq_lens_ptr + req)
    num_prefix = seq_len - query_len  # keys already cached before this chunk

    rows = (tile - first_tile) * BLOCK_M + tl.arange(0, BLOCK_M)  # row index within the chunk
    row_valid = rows < query_len
    q_pos = num_prefix + rows  # position of each query row in its sequence
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < HEAD_DIM
    q_ptrs = q_ptr + (q_start + rows)[:, None] * stride_q_t + head * stride_q_h + dims[None, :]
    q = tl.load(q_ptrs, mask=row_valid[:, None] & dim_valid[None, :], other=0.0)  # (BLOCK_M, BLOCK_D)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Keys beyond the tile's last row are causally invisible to every row of the tile.
    kv_end = tl.minimum(seq_len, num_prefix + (tile - first_tile + 1) * BLOCK_M)
    kv_lo = 0
    if SLIDING:  # keys below the tile's first row's window are invisible to every row of the tile
        kv_lo = tl.maximum(num_prefix + (tile - first_tile) * BLOCK_M - window + 1, 0)
    block_row = block_table_ptr + req * stride_bt
    for kv_start in range(kv_lo, kv_end, BLOCK_N):
        kv_pos = kv_start + tl.arange(0, BLOCK_N)
        kv_valid = kv_pos < kv_end
        block_ids = tl.load(block_row + kv_pos // BLOCK_SIZE, mask=kv_valid, other=0)  # int64
        in_block = kv_pos % BLOCK_SIZE
        k_off = block_ids * stride_k_block + in_block * stride_k_slot + kv_head * stride_k_head
        k = tl.load(k_cache_ptr + k_off[None, :] + dims[:, None],
                    mask=kv_valid[None, :] & dim_valid[:, None], other=0.0)  # (BLOCK_D, BLOCK_N)
        s = _dot(q, k.to(q.dtype), DOT_F32, DOT_PRECISION) * scale_log2e  # (BLOCK_M, BLOCK_N)
        if SOFTCAP:
            s = _softcap(s, softcap_log2e)
        visible = (kv_pos[None, :] <= q_pos[:, None]) & kv_valid[None, :]
        if SLIDING:
            visible = visible & (kv_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Without a window key 0 is visible to every row, so m_new is finite from the first tile on. Under one a
        # row may see none of this tile's keys yet: it keeps m = -inf, l = 0 and acc = 0 (exp2(-inf - 0) = 0).
        m_ref = m_new
        if SLIDING:
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_off = block_ids * stride_v_block + in_block * stride_v_slot + kv_head * stride_v_head
        v = tl.load(v_cache_ptr + v_off[:, None] + dims[None, :],
                    mask=kv_valid[:, None] & dim_valid[None, :], other=0.0)  # (BLOCK_N, BLOCK_D)
        v = v.to(q.dtype)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_F32, DOT_PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    o_ptrs = out_ptr + (q_start + rows)[:, None] * stride_o_t + head * stride_o_h + dims[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & dim_valid[None, :])


@triton.jit
def decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_table_ptr,
    scale_log2e, num_splits, window, softcap_log2e,
    stride_q_t, stride_q_h, stride_o_t, stride_o_h,
    stride_k_block, stride_k_slot, stride_k_head,
    stride_v_block, stride_v_slot, stride_v_head,
    stride_bt, stride_po_req, stride_po_head, stride_po_split, stride_pl_req, stride_pl_head,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr, DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr, SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """Grid (B, KVH, num_splits). Each program takes one request with a single query token and
    the GROUP query heads that share one KV head, over one contiguous partition of the context
    (each K/V row is read once per KV head). SPLIT: write the partition's normalised output and
    log2-sum-exp to part_out [B, H, S, D] / part_lse [B, H, S] for reduce_kernel; otherwise
    (num_splits == 1) write the final output. Under SLIDING the partitions cover the last ``window`` keys."""
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + req)
    query_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    if query_len != 1:  # prefill (or empty) request: prefill_kernel's job
        return
    seq_len = tl.load(seq_lens_ptr + req)
    kv_lo = 0
    if SLIDING:  # the query (position seq_len - 1) sees keys seq_len - window .. seq_len - 1
        kv_lo = tl.maximum(seq_len - window, 0)
    # Partitions are whole multiples of BLOCK_N; trailing ones may be empty for short contexts.
    split_len = tl.cdiv(tl.cdiv(seq_len - kv_lo, num_splits), BLOCK_N) * BLOCK_N
    kv_begin = kv_lo + split * split_len
    kv_end = tl.minimum(kv_begin + split_len, seq_len)

    group = tl.arange(0, BLOCK_G)
    group_valid = group < GROUP
    heads = kv_head * GROUP + group  # (BLOCK_G,)
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < HEAD_DIM
    q_ptrs = q_ptr + q_start * stride_q_t + heads[:, None] * stride_q_h + dims[None, :]
    q = tl.load(q_ptrs, mask=group_valid[:, None] & dim_valid[None, :], other=0.0)  # (BLOCK_G, BLOCK_D)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    block_row = block_table_ptr + req * stride_bt
    for kv_start in range(kv_begin, kv_end, BLOCK_N):
        kv_pos = kv_start + tl.arange(0, BLOCK_N)
        kv_valid = kv_pos < kv_end
        block_ids = tl.load(block_row + kv_pos // BLOCK_SIZE, mask=kv_valid, other=0)  # int64
        in_block = kv_pos % BLOCK_SIZE
        k_off = block_ids * stride_k_block + in_block * stride_k_slot + kv_head * stride_k_head
        k = tl.load(k_cache_ptr + k_off[None, :] + dims[:, None],
                    mask=kv_valid[None, :] & dim_valid[:, None], other=0.0)  # (BLOCK_D, BLOCK_N)
        s = _dot(q, k.to(q.dtype), DOT_F32, DOT_PRECISION) * scale_log2e  # (BLOCK_G, BLOCK_N)
        if SOFTCAP:
            s = _softcap(s, softcap_log2e)
        s = tl.where(kv_valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every iteration has a valid key
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_off = block_ids * stride_v_block + in_block * stride_v_slot + kv_head * stride_v_head
        v = tl.load(v_cache_ptr + v_off[:, None] + dims[None, :],
                    mask=kv_valid[:, None] & dim_valid[None, :], other=0.0)  # (BLOCK_N, BLOCK_D)
        v = v.to(q.dtype)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_F32, DOT_PRECISION)
        m_i = m_new

    mask = group_valid[:, None] & dim_valid[None, :]
    if SPLIT:
        nonempty = l_i > 0.0
        out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        po_ptrs = part_out_ptr + req * stride_po_req + heads[:, None] * stride_po_head + split * stride_po_split
        tl.store(po_ptrs + dims[None, :], out, mask=mask)
        tl.store(part_lse_ptr + req * stride_pl_req + heads * stride_pl_head + split, lse, mask=group_valid)
    else:
        out = acc / l_i[:, None]
        o_ptrs = out_ptr + q_start * stride_o_t + heads[:, None] * stride_o_h + dims[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def reduce_kernel(
    out_ptr, part_out_ptr, part_lse_ptr, query_start_loc_ptr, num_splits,
    stride_o_t, stride_o_h, stride_po_req, stride_po_head, stride_po_split, stride_pl_req, stride_pl_head,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Grid (B, H): merge the partitions of one decode (request, head) by their log-sum-exp weights."""
    req = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(query_start_loc_ptr + req)
    if tl.load(query_start_loc_ptr + req + 1) - q_start != 1:
        return
    splits = tl.arange(0, BLOCK_S)
    split_valid = splits < num_splits
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < HEAD_DIM
    lse = tl.load(part_lse_ptr + req * stride_pl_req + head * stride_pl_head + splits,
                  mask=split_valid, other=float("-inf"))  # (BLOCK_S,)
    weight = tl.exp2(lse - tl.max(lse, 0))  # partition 0 is never empty, so the max is finite
    po_ptrs = part_out_ptr + req * stride_po_req + head * stride_po_head + splits[:, None] * stride_po_split
    part = tl.load(po_ptrs + dims[None, :], mask=split_valid[:, None] & dim_valid[None, :], other=0.0)
    out = tl.sum(part * weight[:, None], 0) / tl.sum(weight, 0)  # (BLOCK_D,)
    tl.store(out_ptr + q_start * stride_o_t + head * stride_o_h + dims, out.to(out_ptr.dtype.element_ty),
             mask=dim_valid)
