"""The grouped expert step on the CUDA path: a segmented (grouped) GEMM in Triton over the step's (token, rank) pairs.

Three kernels, no host sync, a grid fixed by the shapes alone (so a decode step can be captured in a CUDA graph):
1. ``align_kernel`` (one program per expert): each pair's row in the expert-sorted order, token order kept within
   an expert (a stable counting sort: the pair's expert's first row + how many earlier pairs chose that expert).
2. ``gate_up_kernel`` (programs over row tiles of the expert segments × intermediate column tiles):
   gate | up = x_rows @ W_gate_up[e]^T, each rounded to the activation dtype, then silu(gate) * up rounded as
   ``SiluAndMul`` rounds it, into h [pairs, I] (sorted rows).
3. ``down_kernel`` (row tiles × hidden column tiles): h_rows @ W_down[e]^T into each pair's own (token, rank) slot.
The row tiles are an upper bound (``max_row_tiles``: pairs // BLOCK_M + min(experts, pairs)); a tile past the
active experts' tiles returns at once, and an expert that no token chose has no tile. Then
``combine_in_rank_order`` (the CPU path's own combine: float32, rank order) sums each token's k slots.

The algorithm is the grouped GEMM of MoE serving engines (tokens aligned to expert segments of BLOCK_M rows); the
code is our own. Weights are the experts' dense bf16 / fp16 / fp32 weights stacked [E, 2I, H] and [E, H, I]
(``experts.stack_expert_weights``); quantized experts are refused there. Products accumulate in float32
(``ieee`` for float32 inputs, so they can be checked tightly) and every rounding to the activation dtype is to
nearest even, as the torch layers round (by hand under the interpreter, whose bf16 casts truncate). Verified
under triton's interpreter only (tests/test_moe_triton.py) and compiled for sm_90 without a GPU; not yet run on a
GPU. Importing this module imports triton.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from tokenmill.layers.triton_dot import dot as _dot
from tokenmill.moe.experts import combine_in_rank_order, expert_counts

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _round(x, dtype, RTNE_BY_HAND: tl.constexpr):
    """float32 x rounded to ``dtype``, to nearest even. RTNE_BY_HAND (bf16 under triton's interpreter, which
    truncates at a float32 -> bfloat16 cast): the rounding is done on the bits first, so the cast is exact."""
    if RTNE_BY_HAND:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def align_kernel(expert_ids_ptr, row_ends_ptr, counts_ptr, sorted_slot_ptr, num_pairs, BLOCK: tl.constexpr):
    """Grid (E,): for expert e, sorted_slot[first_row_e + j] = the j-th pair (slot t * k + r, in slot order) that
    chose e. Each expert's rows are written by its own program only."""
    expert = tl.program_id(0)
    count = tl.load(counts_ptr + expert)
    if count == 0:
        return
    base = tl.load(row_ends_ptr + expert) - count
    for start in range(0, num_pairs, BLOCK):
        slots = start + tl.arange(0, BLOCK)
        ids = tl.load(expert_ids_ptr + slots, mask=slots < num_pairs, other=-1)
        hit = (ids == expert).to(tl.int64)
        position = base + tl.cumsum(hit, 0) - 1  # (BLOCK,) rows of the hits, in slot order
        tl.store(sorted_slot_ptr + position, slots.to(tl.int64), mask=hit != 0)
        base += tl.sum(hit, 0)


@triton.jit
def gate_up_kernel(
    x_ptr, w_ptr, h_ptr, sorted_slot_ptr, tile_expert_ptr, counts_ptr, row_ends_ptr, tile_ends_ptr,
    num_experts, hidden, intermediate, top_k, stride_x, stride_we, stride_wn, stride_h,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr, RTNE_BY_HAND: tl.constexpr,
):
    """Grid (row tiles, intermediate tiles): h[row, c] = silu(gate) * up of the row's token under its expert,
    gate = x @ W[e, c]^T and up = x @ W[e, I + c]^T, each rounded to h's dtype before the activation."""
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile)
    if expert >= num_experts:  # past the active experts' tiles
        return
    count = tl.load(counts_ptr + expert)
    row_end = tl.load(row_ends_ptr + expert)
    first_tile = tl.load(tile_ends_ptr + expert) - (count + BLOCK_M - 1) // BLOCK_M
    rows = row_end - count + (tile - first_tile) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,) sorted rows
    row_ok = rows < row_end
    tokens = tl.load(sorted_slot_ptr + rows, mask=row_ok, other=0) // top_k  # (BLOCK_M,) rows of x
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,) intermediate features
    col_ok = cols < intermediate
    w = w_ptr + expert * stride_we
    gate_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        x = tl.load(x_ptr + tokens[:, None] * stride_x + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)  # (BLOCK_M, BLOCK_K)
        w_mask = k_ok[:, None] & col_ok[None, :]
        w_gate = tl.load(w + cols[None, :] * stride_wn + ks[:, None], mask=w_mask, other=0.0)  # (BLOCK_K, BLOCK_N)
        w_up = tl.load(w + (cols[None, :] + intermediate) * stride_wn + ks[:, None], mask=w_mask, other=0.0)
        gate_acc += _dot(x, w_gate, DOT_F32, DOT_PRECISION)
        up_acc += _dot(x, w_up, DOT_F32, DOT_PRECISION)
    dtype = h_ptr.dtype.element_ty
    gate = _round(gate_acc, dtype, RTNE_BY_HAND).to(tl.float32)  # gate_up's output, rounded as a Linear's
    up = _round(up_acc, dtype, RTNE_BY_HAND).to(tl.float32)
    act = _round(gate / (1.0 + tl.exp(-gate)), dtype, RTNE_BY_HAND).to(tl.float32)  # SiluAndMul's rounding
    tl.store(h_ptr + rows[:, None] * stride_h + cols[None, :], _round(act * up, dtype, RTNE_BY_HAND),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def down_kernel(
    h_ptr, w_ptr, out_ptr, sorted_slot_ptr, tile_expert_ptr, counts_ptr, row_ends_ptr, tile_ends_ptr,
    num_experts, hidden, intermediate, stride_h, stride_we, stride_wn, stride_out,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr, RTNE_BY_HAND: tl.constexpr,
):
    """Grid (row tiles, hidden tiles): out[slot of row, c] = h[row] @ W_down[e, c]^T, rounded to out's dtype."""
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile)
    if expert >= num_experts:
        return
    count = tl.load(counts_ptr + expert)
    row_end = tl.load(row_ends_ptr + expert)
    first_tile = tl.load(tile_ends_ptr + expert) - (count + BLOCK_M - 1) // BLOCK_M
    rows = row_end - count + (tile - first_tile) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < row_end
    slots = tl.load(sorted_slot_ptr + rows, mask=row_ok, other=0)  # (BLOCK_M,) (token, rank) slots
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,) hidden features
    col_ok = cols < hidden
    w = w_ptr + expert * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, intermediate, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < intermediate
        h = tl.load(h_ptr + rows[:, None] * stride_h + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)  # (BLOCK_M, BLOCK_K)
        w_down = tl.load(w + cols[None, :] * stride_wn + ks[:, None], mask=k_ok[:, None] & col_ok[None, :],
                         other=0.0)  # (BLOCK_K, BLOCK_N) = W_down[e, cols, ks].T
        acc += _dot(h, w_down, DOT_F32, DOT_PRECISION)
    out = _round(acc, out_ptr.dtype.element_ty, RTNE_BY_HAND)
    tl.store(out_ptr + slots[:, None] * stride_out + cols[None, :], out, mask=row_ok[:, None] & col_ok[None, :])


# ---- host side --------------------------------------------------------------------------------
def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _pow2(n: int, minimum: int = 16) -> int:
    """Power-of-two tile extent covering n (at least ``minimum``: tl.dot needs 16)."""
    return max(minimum, 1 << max(0, n - 1).bit_length())


def choose_block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per tile: 16 under the interpreter; on a GPU the mean rows per expert, as a power of two in [16, 64]."""
    if _interpreted():
        return 16
    return min(64, _pow2(-(-num_pairs // num_experts)))


def max_row_tiles(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound on the row tiles of any routing of ``num_pairs`` pairs: an expert with n rows takes
    ceil(n / block_m) <= n // block_m + 1 tiles, at most min(experts, pairs) experts are active, and no tile is
    empty. Depends on the shapes only, so a captured graph's grid fits every routing."""
    return min(num_pairs, num_pairs // block_m + min(num_experts, num_pairs))


def triton_grouped_expert_step(x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor,
                               w_gate_up: torch.Tensor, w_down: torch.Tensor,
                               counts: torch.Tensor | None = None) -> torch.Tensor:
    """``experts.grouped_expert_step``'s contract on the Triton kernels (module docstring): no host sync.

    Args:
        x: [T, hidden] activations (bf16 / fp16 / fp32; contiguous last dimension).
        weights: [T, k] float32 routing weights in rank order; expert_ids: [T, k] int64.
        w_gate_up: [E, 2I, hidden] stacked gate | up weights; w_down: [E, hidden, I]; both contiguous, x's dtype.
        counts: ``expert_counts(expert_ids, E)`` when the caller has it.

    Returns:
        [T, hidden] in x's dtype: each token's k expert outputs summed, weighted, in rank order in float32.

    Raises:
        ValueError: a dtype other than bf16 / fp16 / fp32, mixed dtypes, or shapes that do not fit together.
    """
    num_tokens, top_k = expert_ids.shape
    num_experts, two_i, hidden = w_gate_up.shape
    intermediate = two_i // 2
    if x.dtype not in DTYPES or w_gate_up.dtype != x.dtype or w_down.dtype != x.dtype:
        raise ValueError(f"the Triton grouped expert kernel takes bf16 / fp16 / fp32 activations and weights of "
                         f"one dtype, got x {x.dtype}, w_gate_up {w_gate_up.dtype}, w_down {w_down.dtype}")
    if (x.dim() != 2 or x.shape[1] != hidden or two_i % 2 or tuple(w_down.shape) != (num_experts, hidden,
                                                                                      intermediate)
            or tuple(weights.shape) != (num_tokens, top_k) or x.shape[0] != num_tokens):
        raise ValueError(f"shapes do not fit: x {tuple(x.shape)}, weights {tuple(weights.shape)}, expert_ids "
                         f"{tuple(expert_ids.shape)}, w_gate_up {tuple(w_gate_up.shape)}, w_down {tuple(w_down.shape)}")
    assert w_gate_up.is_contiguous() and w_down.is_contiguous()
    if num_tokens == 0:
        return torch.empty_like(x)
    if x.stride(1) != 1:
        x = x.contiguous()
    num_pairs = num_tokens * top_k
    flat = expert_ids.reshape(-1).contiguous()  # (P,) slot s = t * k + r
    if counts is None:
        counts = expert_counts(expert_ids, num_experts)
    row_ends = torch.cumsum(counts, 0)  # (E,) end of each expert's rows in the sorted order
    block_m = choose_block_m(num_pairs, num_experts)
    tile_ends = torch.cumsum((counts + block_m - 1) // block_m, 0)  # (E,)
    num_tiles = max_row_tiles(num_pairs, num_experts, block_m)
    tile_expert = torch.searchsorted(tile_ends, torch.arange(num_tiles, device=x.device), right=True)  # (tiles,)
    sorted_slot = torch.empty(num_pairs, dtype=torch.int64, device=x.device)  # (P,) slots grouped by expert
    align_kernel[(num_experts,)](flat, row_ends, counts, sorted_slot, num_pairs,
                                 BLOCK=min(1024, _pow2(num_pairs)), num_warps=4)
    dot_f32, precision = _interpreted(), "ieee" if x.dtype == torch.float32 else "tf32"
    rtne_by_hand = _interpreted() and x.dtype == torch.bfloat16
    limit = 128 if _interpreted() else 64
    h = torch.empty(num_pairs, intermediate, dtype=x.dtype, device=x.device)  # (P, I) sorted rows
    block_n, block_k = min(_pow2(intermediate), limit), min(_pow2(hidden), limit)
    gate_up_kernel[(num_tiles, triton.cdiv(intermediate, block_n))](
        x, w_gate_up, h, sorted_slot, tile_expert, counts, row_ends, tile_ends,
        num_experts, hidden, intermediate, top_k, x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), h.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_F32=dot_f32, DOT_PRECISION=precision,
        RTNE_BY_HAND=rtne_by_hand, num_warps=4,
    )
    slots = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)  # (P, hidden) slot order
    block_n, block_k = min(_pow2(hidden), limit), min(_pow2(intermediate), limit)
    down_kernel[(num_tiles, triton.cdiv(hidden, block_n))](
        h, w_down, slots, sorted_slot, tile_expert, counts, row_ends, tile_ends,
        num_experts, hidden, intermediate, h.stride(0), w_down.stride(0), w_down.stride(1), slots.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_F32=dot_f32, DOT_PRECISION=precision,
        RTNE_BY_HAND=rtne_by_hand, num_warps=4,
    )
    return combine_in_rank_order(slots.view(num_tokens, top_k, hidden), weights, x.dtype)
