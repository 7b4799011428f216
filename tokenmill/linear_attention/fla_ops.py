"""The gated delta rule through fla-core's Triton kernels (flash-linear-attention), for the CUDA backend.

When the Gated DeltaNet state lives on a CUDA device and the ``fla-core`` package imports (``pip install
'tokenmill[fla]'``), the layers call two of its kernels instead of the torch functions of ``gated_delta_rule``,
which stay the specification (and the fallback without fla, logged once by the engine hook):

- prefill: ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` over all of a step's multi-token requests at once
  (variable-length batch, ``cu_seqlens``), each starting from its state slot; the final states are written back
  into the slots (:func:`prefill`). A request whose chunk crosses a prefix-cache state checkpoint is split there,
  its later pieces going into later calls ("rounds"), so the checkpoint gets the state at that token.
- decode: ``fused_recurrent_gated_delta_rule``, one token per row, reading the rows' slots and writing them back
  (:func:`recurrent_step`): fixed shapes and no host synchronisation, so a CUDA graph captures it.

Conventions, ours -> fla's (the tests hold both kernels to the torch reference under this calling convention):
our flat token layout [T, H, D] is fla's [B=1, T, H, D] (varlen) or, for decode, [B, T=1, H, D]; q and k arrive
L2-normalised with q already scaled by Dk^-0.5, so fla gets ``scale=1.0`` and no in-kernel L2 norm; g is the
log-decay (<= 0) and beta the post-sigmoid write strength, both [.., Hv], so no in-kernel gate or sigmoid; q and
k keep their Hk key heads, fla's value head h reading key head h // (Hv // Hk) as the layer's
``repeat_interleave`` does; states are [N, Hv, Dk, Dv] float32 (fla's default key-first layout), as in the pool.
fla's chunks start at each sequence's first token, not at absolute multiples of 64 as in the torch chunked
form, so prefill sums round differently from the CPU path (same math; deterministic mode is CPU-only).
"""
from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

logger = logging.getLogger(__name__)

# Tests set this to run the fla kernels on CPU tensors under TRITON_INTERPRET=1 (the CUDA path's calling
# convention, checked without a GPU). Never set in serving.
FORCE_ON_CPU = False

_ops = None  # fla.ops.gated_delta_rule once imported; False when it cannot be


def available() -> bool:
    """Whether fla-core's gated delta rule kernels import (cached; imports fla on the first call)."""
    global _ops
    if _ops is None:
        _ops = False
        if importlib.util.find_spec("fla") is not None:
            try:
                import fla.ops.gated_delta_rule as ops

                _ops = ops
            except Exception as exc:  # noqa: BLE001 - a broken install falls back to the torch reference
                logger.warning("fla-core is installed but its gated delta rule kernels do not import (%s: %s); "
                               "the linear layers use the torch reference", type(exc).__name__, exc)
    return _ops is not False


def version() -> str | None:
    """fla-core's version, or None when it is not available."""
    if not available():
        return None
    import fla

    return getattr(fla, "__version__", "unknown")


def wanted(state: torch.Tensor) -> bool:
    """Whether the layers should run fla's kernels for a state pool on ``state``'s device: CUDA (or a test's
    ``FORCE_ON_CPU``) and fla importable."""
    return (state.is_cuda or FORCE_ON_CPU) and available()


def chunk_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 initial_state: torch.Tensor, cu_seqlens: torch.Tensor, cu_seqlens_cpu: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """N sequences of a flat batch through fla's chunked kernel, each from its own initial state.

    Args:
        q, k: [T, Hk, Dk] (L2-normalised; q scaled by Dk^-0.5). v: [T, Hv, Dv], Hv a multiple of Hk.
        g: [T, Hv] log-decay (<= 0). beta: [T, Hv] write strength in (0, 1).
        initial_state: [N, Hv, Dk, Dv] float32.
        cu_seqlens: [N + 1] int64 on the device: sequence n is tokens cu_seqlens[n]:cu_seqlens[n + 1].
        cu_seqlens_cpu: the same on the host (spares fla a device-to-host copy), or None.
    Returns:
        (o [T, Hv, Dv] in q's dtype, final state [N, Hv, Dk, Dv] float32).
    """
    assert available(), "fla-core is not available"
    o, final = _ops.chunk_gated_delta_rule(
        q=q.unsqueeze(0), k=k.unsqueeze(0), v=v.unsqueeze(0), g=g.unsqueeze(0), beta=beta.unsqueeze(0), scale=1.0,
        initial_state=initial_state, output_final_state=True, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)
    return o[0], final


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """One token for each of B sequences through fla's fused recurrent kernel, updating their pool slots.

    The rows' states are gathered from ``state`` (fla's kernel takes the initial states as one [B, ...] tensor and
    returns new final states) and written back with ``index_copy_``: fixed shapes, no host synchronisation, so
    it can be captured in a CUDA graph (padding rows may share one padding slot; what it holds is never read).

    Args:
        q, k: [B, Hk, Dk] (L2-normalised; q scaled by Dk^-0.5). v: [B, Hv, Dv]. g, beta: [B, Hv].
        state: the pool [S, Hv, Dk, Dv] float32, updated in place at rows ``slots``.
        slots: [B] int64 on the device, each row's slot.
    Returns:
        o [B, Hv, Dv] in q's dtype.
    """
    assert available(), "fla-core is not available"
    initial = state.index_select(0, slots)  # (B, Hv, Dk, Dv)
    o, final = _ops.fused_recurrent_gated_delta_rule(
        q=q.unsqueeze(1), k=k.unsqueeze(1), v=v.unsqueeze(1), g=g.unsqueeze(1), beta=beta.unsqueeze(1), scale=1.0,
        initial_state=initial, output_final_state=True)
    state.index_copy_(0, slots, final)
    return o[:, 0]


@dataclass(frozen=True)
class PrefillRound:
    """One varlen kernel call of a step's prefill: segments of m requests (host numpy).

    token_idx: [n] the flat token indices of the segments, segment after segment.
    cu_seqlens: [m + 1] int64, segment boundaries in ``token_idx``.
    reqs: [m] each segment's request (index into the step's requests).
    saves: (segment row, checkpoint slot): the state after that segment is a prefix-cache checkpoint.
    """

    token_idx: np.ndarray
    cu_seqlens: np.ndarray
    reqs: np.ndarray
    saves: list[tuple[int, int]]


def plan_prefill_rounds(query_start_loc: np.ndarray, prefill_reqs: list[int],
                        saves: dict[int, list[tuple[int, int]]]) -> list[PrefillRound]:
    """Split a step's multi-token requests into kernel calls. A request with no checkpoint inside its chunk is
    one segment (all such requests go into the first call); one whose chunk is cut by checkpoints (``saves``:
    request -> ascending [(k, checkpoint slot)], the state after its first k tokens) is one segment per piece,
    its j-th piece in call j, so each piece starts from the state the previous call left in the slot.

    Args:
        query_start_loc: [B + 1] host, the step's flat layout.
        prefill_reqs: requests with more than one token this step.
        saves: as ``LinearStateMetadata.saves``.
    Returns:
        the calls in order (empty when there are no multi-token requests).
    """
    pieces: list[list[tuple[int, int, int | None]]] = []  # per request: (start, stop, checkpoint slot or None)
    for r in prefill_reqs:
        start, end = int(query_start_loc[r]), int(query_start_loc[r + 1])
        segs, pos = [], start
        for num, ckpt in [*saves.get(r, ()), (end - start, None)]:
            stop = start + num
            if stop > pos:
                segs.append((pos, stop, ckpt))
            pos = stop
        pieces.append(segs)
    rounds = []
    for j in range(max((len(s) for s in pieces), default=0)):
        rows = [(r, segs[j]) for r, segs in zip(prefill_reqs, pieces) if j < len(segs)]
        lengths = np.array([stop - start for _, (start, stop, _) in rows], dtype=np.int64)
        rounds.append(PrefillRound(
            token_idx=np.concatenate([np.arange(start, stop, dtype=np.int64) for _, (start, stop, _) in rows]),
            cu_seqlens=np.concatenate(([0], np.cumsum(lengths))).astype(np.int64),
            reqs=np.array([r for r, _ in rows], dtype=np.int64),
            saves=[(i, ckpt) for i, (_, (_, _, ckpt)) in enumerate(rows) if ckpt is not None],
        ))
    return rounds


Kernel = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, meta,
            rec_state: torch.Tensor, ckpt_rec: torch.Tensor | None, core: torch.Tensor,
            kernel: Kernel = chunk_varlen) -> None:
    """The multi-token requests of a step (``meta``: a ``LinearStateMetadata``) through ``kernel`` (fla's chunked
    kernel; tests pass the torch reference with the same signature): their outputs go into ``core``, their final
    states into their slots of ``rec_state``, the states at checkpoints into ``ckpt_rec``.

    Args:
        q, k: [T, Hk, Dk]; v: [T, Hv, Dv]; g, beta: [T, Hv] (the whole step's tokens).
        rec_state: this layer's pool [S, Hv, Dk, Dv] float32; ckpt_rec: its checkpoints [C, Hv, Dk, Dv] or None.
        core: [T, Hv, Dv] float32, written at the prefill tokens.
    """
    device = core.device
    for rnd in plan_prefill_rounds(meta.query_start_loc, meta.prefill_reqs, meta.saves):
        idx = torch.from_numpy(rnd.token_idx).to(device)
        slots = meta.slot_ids[torch.from_numpy(rnd.reqs).to(device)]  # (m,)
        cu_cpu = torch.from_numpy(rnd.cu_seqlens)
        o, final = kernel(q[idx], k[idx], v[idx], g[idx], beta[idx], rec_state[slots], cu_cpu.to(device), cu_cpu)
        core[idx] = o.to(core.dtype)
        rec_state[slots] = final
        for row, ckpt in rnd.saves:
            ckpt_rec[ckpt] = final[row]


def reference_chunk_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           initial_state: torch.Tensor, cu_seqlens: torch.Tensor,
                           cu_seqlens_cpu: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`chunk_varlen`'s contract on the torch chunked form (the specification), one sequence at a time."""
    from tokenmill.linear_attention.gated_delta_rule import chunk_gated_delta_rule

    bounds = (cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens).tolist()
    rep = v.shape[1] // k.shape[1]
    out = torch.empty_like(v)
    finals = []
    for n in range(len(bounds) - 1):
        a, b = bounds[n], bounds[n + 1]
        o, state = chunk_gated_delta_rule(q[a:b].repeat_interleave(rep, 1), k[a:b].repeat_interleave(rep, 1), v[a:b],
                                          g[a:b], beta[a:b], initial_state[n])
        out[a:b] = o
        finals.append(state)
    return out, torch.stack(finals) if finals else initial_state.clone()
