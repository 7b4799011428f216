"""The gated delta rule of Gated DeltaNet: a token-by-token reference, a chunked form and a batched decode step.

Source: Yang, Kautz, Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta Rule" (2024).
Per head, with state S [Dk, Dv], log-decay g_t <= 0 and write strength beta_t in (0, 1):

    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T,    o_t = S_t^T q_t

The chunked form follows the chunkwise DeltaNet algorithm (Yang et al. 2024, "Parallelizing Linear
Transformers with the Delta Rule over Sequence Length"), with the decay folded in: inside a chunk the
per-token writes U solve one unit lower-triangular system, so nothing loops over tokens inside a chunk.
q and k arrive already normalised and scaled (the layer does that); every function computes in the
dtype of its inputs and never touches the caller's tensors in place except ``decode_step``'s state.
"""
from __future__ import annotations

import torch


def recurrent_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token reference of the gated delta rule (the specification; slow).

    Args:
        q, k: [L, H, Dk] (heads already expanded to the value heads).
        v: [L, H, Dv].
        g: [L, H] log-decay (<= 0). beta: [L, H] write strength.
        initial_state: [H, Dk, Dv], or None for zeros.
    Returns:
        (o [L, H, Dv], final state [H, Dk, Dv]).
    """
    length, num_heads, dk = k.shape
    dv = v.shape[-1]
    state = (torch.zeros(num_heads, dk, dv, dtype=v.dtype, device=v.device) if initial_state is None
             else initial_state.clone())
    out = torch.empty_like(v)
    for t in range(length):
        state = state * g[t].exp()[:, None, None]  # (H, Dk, Dv) decayed
        predicted = torch.einsum("hkv,hk->hv", state, k[t])  # (H, Dv) what the state recalls for k_t
        write = beta[t][:, None] * (v[t] - predicted)  # (H, Dv)
        state = state + k[t][:, :, None] * write[:, None, :]
        out[t] = torch.einsum("hkv,hk->hv", state, q[t])
    return out, state


def chunk_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor | None = None, chunk_size: int = 64, position: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked gated delta rule: same arguments and results as :func:`recurrent_gated_delta_rule`.

    ``position`` is the absolute position of the first token: chunks end at multiples of ``chunk_size`` in
    absolute positions (the first one may be shorter), so a prompt split at such a multiple (a prefill chunk, a
    state checkpoint at a block boundary) is chunked, and summed, as it would be unsplit.

    Within a chunk of C tokens, with cumulative log-decay c_i = g_1 + ... + g_i and the chunk's
    incoming state S0, the writes u_i solve (I + A) U = beta * (V - exp(c) * K S0) where
    A_ij = beta_i exp(c_i - c_j) k_i.k_j for j < i; then
    O = exp(c) * Q S0 + (tril(Q K^T) * exp(c_i - c_j)) U and S = exp(c_C) S0 + K^T (exp(c_C - c) * U).
    Work: O(L C (Dk + Dv) + L Dk Dv) per head; the Python loop runs over chunks only.

    Raises:
        ValueError: chunk_size < 1.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    length, num_heads, dk = k.shape
    dv = v.shape[-1]
    state = (torch.zeros(num_heads, dk, dv, dtype=v.dtype, device=v.device) if initial_state is None
             else initial_state.clone())
    out = torch.empty_like(v)
    first = chunk_size - position % chunk_size
    for start in range(0, length, chunk_size) if first == chunk_size else [0, *range(first, length, chunk_size)]:
        end = min(chunk_size * ((position + start) // chunk_size + 1) - position, length)
        qc, kc, vc = (x[start:end].transpose(0, 1) for x in (q, k, v))  # (H, C, D)
        bc = beta[start:end].transpose(0, 1)  # (H, C)
        cum = g[start:end].transpose(0, 1).cumsum(-1)  # (H, C)
        size = end - start
        diff = cum[:, :, None] - cum[:, None, :]  # (H, C, C) c_i - c_j
        ones = torch.ones(size, size, dtype=torch.bool, device=v.device)
        decay = diff.masked_fill(~ones.tril(), float("-inf")).exp()  # (H, C, C), zero above the diagonal
        strict = decay * ones.tril(-1)  # (H, C, C), zero on and above the diagonal
        a = bc[:, :, None] * strict * (kc @ kc.transpose(1, 2))  # (H, C, C) strictly lower
        eye = torch.eye(size, dtype=v.dtype, device=v.device)
        rhs = bc[:, :, None] * (vc - cum.exp()[:, :, None] * (kc @ state))  # (H, C, Dv)
        u = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)  # (H, C, Dv)
        out[start:end] = (cum.exp()[:, :, None] * (qc @ state)
                          + (decay * (qc @ kc.transpose(1, 2))) @ u).transpose(0, 1)
        last = cum[:, -1:]  # (H, 1)
        state = last.exp()[:, :, None] * state + kc.transpose(1, 2) @ ((last - cum).exp()[:, :, None] * u)
    return out, state


def decode_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
) -> torch.Tensor:
    """One token for each of B sequences at once, updating ``state`` in place.

    Args:
        q, k: [B, H, Dk]; v: [B, H, Dv]; g, beta: [B, H].
        state: [B, H, Dk, Dv] (a gathered copy of the sequences' slots), updated in place.
    Returns:
        o [B, H, Dv].
    """
    state.mul_(g.exp()[:, :, None, None])
    predicted = torch.einsum("bhkv,bhk->bhv", state, k)
    write = beta[:, :, None] * (v - predicted)  # (B, H, Dv)
    state.add_(k[:, :, :, None] * write[:, :, None, :])
    return torch.einsum("bhkv,bhk->bhv", state, q)
