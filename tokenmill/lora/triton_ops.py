"""Batched LoRA on the CUDA path: Punica's SGMV split into a Triton "shrink" and "expand" kernel.

The algorithm is Punica's segmented gather matrix-vector product (Chen et al. 2023, "Punica:
Multi-Tenant LoRA Serving", SGMV; also S-LoRA, Sheng et al. 2023): tokens grouped by adapter slot
(``LoRAMapping`` segments), per segment ``h = x @ A_slot.T`` (shrink: in -> R*n) then
``y += h @ B_slot.T`` (expand: R*n -> out), both reading the stacked slot weights in place and the
rows of x and y through ``token_indices`` (gather / scatter inside the kernels, base-model tokens
never touched). The code is our own. Layouts are ``slots.py``'s: A [S, R, n, in], block-diagonal
scale-folded B [S, out, R, n]; each slot's rank r comes from a device tensor, so a slot's columns
at or beyond r * n are neither computed nor read. Grids are sized from the host-side segments: no
host sync. Accumulation is float32 in both kernels; ``ops.add_lora`` stays the CPU path and
``ops.add_lora_reference`` the specification. Importing this module imports triton.
"""
from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from tokenmill.layers.triton_dot import dot as _dot
from tokenmill.lora.mapping import LoRAMapping

_MAX_SPLIT_K = 8


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, h_ptr, token_ptr, seg_ptr, rank_ptr,
    num_segments, in_features, k_per_split, stride_x_t, stride_a_s, stride_h_split, stride_h_t,
    NUM_SLICES: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Grid (row tiles of the longest segment, column tiles * SPLIT_K, segments):
    h[split, p, c] = sum over k in the split's range of x[token_indices[p], k] * A_slot[c, k],
    for mapping rows p of the segment and columns c < rank_slot * n."""
    seg = tl.program_id(2)
    slot = tl.load(seg_ptr + seg)
    start = tl.load(seg_ptr + num_segments + seg)
    end = tl.load(seg_ptr + 2 * num_segments + seg)
    m0 = start + tl.program_id(0) * BLOCK_M
    if m0 >= end:
        return
    width = tl.load(rank_ptr + slot) * NUM_SLICES
    n_tile = tl.program_id(1) // SPLIT_K
    split = tl.program_id(1) % SPLIT_K
    if n_tile * BLOCK_N >= width:
        return
    rows = m0 + tl.arange(0, BLOCK_M)  # (BLOCK_M,) positions in the mapping
    row_ok = rows < end
    tokens = tl.load(token_ptr + rows, mask=row_ok, other=0)  # (BLOCK_M,) positions in the batch
    cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,) rank-major: k * n + slice
    col_ok = cols < width
    a_base = a_ptr + slot * stride_a_s
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, in_features)
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_end
        x = tl.load(x_ptr + tokens[:, None] * stride_x_t + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)  # (BLOCK_M, BLOCK_K)
        a = tl.load(a_base + cols[None, :] * in_features + ks[:, None], mask=k_ok[:, None] & col_ok[None, :],
                    other=0.0)  # (BLOCK_K, BLOCK_N) = A[cols, ks].T
        acc += _dot(x, a, DOT_F32, DOT_PRECISION)
    h = h_ptr + split * stride_h_split + rows[:, None] * stride_h_t + cols[None, :]
    tl.store(h, acc, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _expand_kernel(
    h_ptr, b_ptr, y_ptr, token_ptr, seg_ptr, rank_ptr,
    num_segments, out_features, stride_h_split, stride_h_t, stride_b_s, stride_b_o, stride_y_t,
    NUM_SLICES: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Grid (row tiles of the longest segment, output column tiles, segments):
    y[token_indices[p], o] += sum over c < rank_slot * n of (sum over splits of h[split, p, c]) * B_slot[o, c],
    rounded to y's dtype once."""
    seg = tl.program_id(2)
    slot = tl.load(seg_ptr + seg)
    start = tl.load(seg_ptr + num_segments + seg)
    end = tl.load(seg_ptr + 2 * num_segments + seg)
    m0 = start + tl.program_id(0) * BLOCK_M
    if m0 >= end:
        return
    width = tl.load(rank_ptr + slot) * NUM_SLICES
    if width == 0:  # an empty slot adds nothing
        return
    rows = m0 + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    tokens = tl.load(token_ptr + rows, mask=row_ok, other=0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,) output features
    col_ok = cols < out_features
    b_base = b_ptr + slot * stride_b_s
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, width, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < width
        h_mask = row_ok[:, None] & k_ok[None, :]
        h = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
        for split in tl.static_range(SPLIT_K):  # the shrink's partial sums, in a fixed order
            h += tl.load(h_ptr + split * stride_h_split + rows[:, None] * stride_h_t + ks[None, :], mask=h_mask,
                         other=0.0)
        b = tl.load(b_base + cols[None, :] * stride_b_o + ks[:, None], mask=k_ok[:, None] & col_ok[None, :],
                    other=0.0)  # (BLOCK_K, BLOCK_N) = B[cols, ks].T
        acc += _dot(h, b, DOT_F32, DOT_PRECISION)
    y = y_ptr + tokens[:, None] * stride_y_t + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    old = tl.load(y, mask=mask, other=0.0)
    tl.store(y, (old.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)


# ---- host side --------------------------------------------------------------------------------
def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _pow2(n: int, minimum: int = 16) -> int:
    """Power-of-two tile extent covering n; tl.dot needs at least 16."""
    return max(minimum, 1 << max(0, n - 1).bit_length())


def _dot_config(dtype: torch.dtype) -> tuple[bool, str]:
    """(DOT_F32, DOT_PRECISION): float32 uses exact (not tf32) products so it can be checked tightly."""
    return _interpreted(), "ieee" if dtype == torch.float32 else "tf32"


def _block_m(max_segment_len: int) -> int:
    return 16 if _interpreted() else min(64, _pow2(max_segment_len))


def _device_ranks(ranks: torch.Tensor | Sequence[int], device: torch.device) -> torch.Tensor:
    if isinstance(ranks, torch.Tensor):
        assert ranks.device == device, (ranks.device, device)
        return ranks
    return torch.tensor(list(ranks), dtype=torch.int32, device=device)


def _default_split_k(in_features: int, block_k: int, num_programs: int) -> int:
    """Split the shrink's reduction over ``in`` when the other grid axes leave the GPU idle (decode)."""
    if _interpreted():
        return 1
    return max(1, min(_MAX_SPLIT_K, -(-in_features // (4 * block_k)), 128 // max(1, num_programs)))


def lora_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    ranks: torch.Tensor | Sequence[int],
    mapping: LoRAMapping,
    split_k: int | None = None,
) -> torch.Tensor:
    """Shrink: each mapped token's input times its slot's A, over all output slices at once.

    Args:
        x: [T, in] the projection's input (row stride free, contiguous last dimension).
        lora_a: [S, R, n, in] contiguous stacked A of every slot (x's dtype).
        ranks: [S] each slot's rank (int32 on x's device; a sequence is copied there).
        mapping: the step's tokens with an adapter, grouped by slot.
        split_k: partial sums over ``in`` (None: chosen from the grid size; 1 under the interpreter).

    Returns:
        h: [split_k, N, R * n] float32 partial sums, ``h.sum(0)[p] = x[token_indices[p]] @ A_slot.T``
        for the columns below rank_slot * n (rank-major: column k * n + i is rank k of slice i);
        columns at or beyond that are left unwritten (the expand never reads them).
    """
    assert x.dim() == 2 and x.stride(1) == 1 and lora_a.is_contiguous() and x.dtype == lora_a.dtype
    num_slots, max_rank, num_slices, in_features = lora_a.shape
    assert x.shape[1] == in_features, (tuple(x.shape), tuple(lora_a.shape))
    width = max_rank * num_slices
    block_m, block_n = _block_m(mapping.max_segment_len), _pow2(min(width, 64))
    block_k = min(_pow2(in_features), 128 if _interpreted() else 64)
    grid_m, grid_n, num_segments = -(-mapping.max_segment_len // block_m), -(-width // block_n), len(mapping.segments)
    if split_k is None:
        split_k = _default_split_k(in_features, block_k, grid_m * grid_n * num_segments)
    k_per_split = -(-in_features // (block_k * split_k)) * block_k  # a multiple of BLOCK_K
    h = torch.empty(split_k, mapping.num_lora_tokens, width, dtype=torch.float32, device=x.device)
    if grid_m == 0:
        return h
    dot_f32, precision = _dot_config(x.dtype)
    _shrink_kernel[(grid_m, grid_n * split_k, num_segments)](
        x, lora_a, h, mapping.token_indices, mapping.device_segment_table(), _device_ranks(ranks, x.device),
        num_segments, in_features, k_per_split, x.stride(0), lora_a.stride(0), h.stride(0), h.stride(1),
        NUM_SLICES=num_slices, SPLIT_K=split_k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_F32=dot_f32, DOT_PRECISION=precision, num_warps=4,
    )
    return h


def lora_expand(
    y: torch.Tensor,
    h: torch.Tensor,
    lora_b: torch.Tensor,
    ranks: torch.Tensor | Sequence[int],
    mapping: LoRAMapping,
) -> None:
    """Expand: y[token_indices[p]] += h[p] @ B_slot.T for every mapped row p, in place.

    Args:
        y: [T, out] the projection's output (row stride free, contiguous last dimension); rows of
            tokens absent from the mapping are neither read nor written.
        h: [split_k, N, R * n] float32 from ``lora_shrink`` (its partial sums are added in order).
        lora_b: [S, out, R, n] contiguous stacked block-diagonal B, scales folded in (y's dtype).
        ranks: [S] each slot's rank, as given to ``lora_shrink``.
        mapping: the mapping ``h`` was computed for.
    """
    assert y.dim() == 2 and y.stride(1) == 1 and lora_b.is_contiguous() and y.dtype == lora_b.dtype
    num_slots, out_features, max_rank, num_slices = lora_b.shape
    width = max_rank * num_slices
    assert y.shape[1] == out_features and h.shape[1:] == (mapping.num_lora_tokens, width), (y.shape, h.shape)
    block_m = _block_m(mapping.max_segment_len)
    block_n = min(_pow2(out_features), 128 if _interpreted() else 64)
    block_k = _pow2(min(width, 64))
    grid_m, num_segments = -(-mapping.max_segment_len // block_m), len(mapping.segments)
    if grid_m == 0:
        return
    dot_f32, precision = _dot_config(y.dtype)
    _expand_kernel[(grid_m, -(-out_features // block_n), num_segments)](
        h, lora_b, y, mapping.token_indices, mapping.device_segment_table(), _device_ranks(ranks, y.device),
        num_segments, out_features, h.stride(0), h.stride(1), lora_b.stride(0), lora_b.stride(1), y.stride(0),
        NUM_SLICES=num_slices, SPLIT_K=h.shape[0], BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_F32=dot_f32, DOT_PRECISION=precision, num_warps=4,
    )


def add_lora_triton(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    ranks: torch.Tensor | Sequence[int],
    mapping: LoRAMapping,
    split_k: int | None = None,
) -> None:
    """y += the delta of each token's adapter, in place: ``ops.add_lora``'s contract on the Triton kernels.

    Args:
        y: [T, out] the base projection's output; x: [T, in] its input (same dtype as the weights).
        lora_a / lora_b: [S, R, n, in] / [S, out, R, n] one module's stacked slot weights (``slots.py``).
        ranks: [S] each slot's rank (int32 on the device; a sequence is copied there).
        mapping: the step's tokens with an adapter, grouped by slot (``single_slot`` needs no
            special case: token_indices is then 0..T-1).
        split_k: see ``lora_shrink``.
    """
    if mapping.max_segment_len == 0:
        return
    ranks = _device_ranks(ranks, x.device)
    h = lora_shrink(x, lora_a, ranks, mapping, split_k)  # (split_k, N, R * n)
    lora_expand(y, h, lora_b, ranks, mapping)
