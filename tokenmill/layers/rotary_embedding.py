"""Rotary position embedding (rotate-half / NeoX style) with a cos/sin cache indexed by ``positions``.

Inverse frequencies and the attention scaling come from transformers' ``ROPE_INIT_FUNCTIONS``
(plus the plain formula for "default"), so every supported ``rope_type`` matches transformers:

- default, linear, llama3, yarn: static frequencies; the cache is exact for every position.
- dynamic (NTK): transformers re-derives the frequencies only once a sequence grows past
  ``max_position_embeddings``; below that it uses the unscaled frequencies. The cache here holds
  those unscaled frequencies for positions ``[0, max_position_embeddings)``, which equals
  transformers for every sequence that fits. Positions past the cache are not supported (a
  paged KV cache could not follow the rescaling anyway: cached keys keep their old rotation).
- longrope (Phi-3 128k, Phi-3.5): per-frequency ``short_factor`` or ``long_factor`` divide the inverse
  frequencies, and cos/sin are scaled by ``attention_factor`` (default sqrt(1 + ln(factor) / ln(original max)),
  factor = max_position_embeddings / original_max_position_embeddings) whichever set is used. transformers
  picks the set per forward from the sequence's current length (long once it passes
  ``original_max_position_embeddings``); in a paged KV cache that would leave the keys written while the
  sequence was short rotated by the other set. tokenmill picks once per engine, as llama.cpp does by its
  context size: long factors for every token when ``max_model_len`` > ``original_max_position_embeddings``,
  short factors otherwise (:meth:`RotaryEmbedding.set_max_model_len`; default: the model's
  max_position_embeddings). So tokenmill equals transformers for every sequence that stays on one side of
  the threshold in transformers (short: max_model_len <= original max; long: a prompt longer than the
  original max), and differs for a sequence that crosses it while decoding (transformers then mixes the sets).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import ctypes
from pathlib import Path

import torch
from torch import nn

from tokenmill.csrc_build import DEFAULT_FLAGS, CLibrary
from tokenmill.layers.triton_elementwise import triton_rotary

if TYPE_CHECKING:
    from transformers import PretrainedConfig

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")


def rope_parameters(config: PretrainedConfig) -> dict:
    """The config's RoPE dict (``rope_type``, ``rope_theta``, scaling fields), transformers-v5 style."""
    params = getattr(config, "rope_parameters", None)
    if not params:
        params = {"rope_type": "default", "rope_theta": getattr(config, "rope_theta", 10000.0)}
    return params


def longrope_original_max(config: PretrainedConfig) -> int | None:
    """``original_max_position_embeddings`` of a longrope config (the threshold between its short and long
    factors), or None for another rope_type."""
    params = rope_parameters(config)
    if params.get("rope_type", params.get("type")) != "longrope":
        return None
    original = params.get("original_max_position_embeddings", getattr(config, "original_max_position_embeddings", None))
    if original is None:
        raise ValueError("rope_type 'longrope' needs original_max_position_embeddings")
    return int(original)


def compute_inv_freq(config: PretrainedConfig, head_dim: int, long_factors: bool = False) -> tuple[torch.Tensor, float]:
    """Return (inv_freq [head_dim // 2] float32, attention_scaling) for the config's rope_type.

    ``long_factors``: for rope_type longrope, the inverse frequencies of its ``long_factor`` (else its
    ``short_factor``), as transformers computes them for a sequence longer (else not longer) than
    ``original_max_position_embeddings``; the attention scaling is the same either way. Ignored otherwise.

    A config read from a Llama 3.x GGUF carries ``rope_freq_factors`` (llama.cpp's ``rope_freqs`` tensor,
    head_dim // 2 floats, with rope_type "default"): the default inverse frequencies are divided by them,
    as llama.cpp does (``theta_i = pos * base^(-2i/d) / rope_freqs[i]``); for a llama3 rope_parameters
    dict this equals transformers' llama3 frequencies within float32 rounding.

    Raises:
        NotImplementedError: a rope_type outside SUPPORTED_ROPE_TYPES, partial rotary embeddings, or
            ``rope_freq_factors`` with another rope_type.
        ValueError: ``rope_freq_factors`` of the wrong length.
    """
    params = rope_parameters(config)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise NotImplementedError(f"rope_type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise NotImplementedError("partial_rotary_factor != 1.0 is not supported")
    factors = getattr(config, "rope_freq_factors", None)
    if factors is not None and rope_type != "default":
        raise NotImplementedError(f"rope_freq_factors with rope_type {rope_type!r} is not supported")
    if rope_type == "default":
        base = params["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim))
        if factors is not None:
            factors = torch.tensor(factors, dtype=torch.float32)
            if factors.shape != inv_freq.shape:
                raise ValueError(f"rope_freq_factors has {factors.numel()} entries; head_dim {head_dim} needs "
                                 f"{head_dim // 2}")
            inv_freq = inv_freq / factors
        return inv_freq, 1.0
    seq_len = None
    if rope_type == "longrope" and long_factors:
        seq_len = longrope_original_max(config) + 1  # transformers' rule: long factors past the original max
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # only here: importing transformers costs ~1 s

    as_transformers = getattr(config, "as_transformers", None)  # a cached plain config: its transformers class
    hf_config = as_transformers() if as_transformers is not None else config
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"), seq_len=seq_len)
    assert inv_freq.shape == (head_dim // 2,), f"inv_freq shape {tuple(inv_freq.shape)} for head_dim {head_dim}"
    return inv_freq.float(), float(attention_scaling)


class RotaryEmbedding(nn.Module):
    """Per-model cos/sin cache; one instance is shared by all layers.

    forward(positions [T] int64, dtype) -> (cos, sin), each [T, 1, head_dim // 2] in ``dtype``,
    ready to broadcast over heads in :func:`apply_rotary_emb`. The cache itself stays float32
    (``cos_sin_cache`` [rows_ready, head_dim]: cos half | sin half), computed the same way as
    transformers (``position * inv_freq`` in float32, then cos/sin times the attention scaling, then a
    cast to the activation dtype).

    The table's storage (``cos_sin_table`` [max_position_embeddings, head_dim]) is allocated at once and
    never moves (the lean decode step and CUDA graphs keep its address), but its rows are computed only
    when needed: :meth:`set_max_model_len` fills the first ``max_model_len`` rows (the engine calls it once
    its context length is final), and the first read of ``cos_sin_cache`` before that fills them all. A
    Llama 3.x table of 131072 positions costs 0.2 s of a cached start on a 2-core CPU (cos and sin of 4 M
    float32 values); an engine serving 32768 tokens computes a quarter of it.

    longrope: the cache holds one factor set, long when the context the engine serves (``max_model_len``,
    default max_position_embeddings) exceeds ``original_max_position_embeddings`` (see the module docstring);
    ``long_factors`` says which.

    Raises:
        NotImplementedError, ValueError: from :func:`compute_inv_freq`, at construction (an unsupported
            rope_type is refused before any weight is read).
    """

    def __init__(self, config: PretrainedConfig, head_dim: int) -> None:
        super().__init__()
        self.config = config
        self.head_dim = head_dim
        self.max_position_embeddings = int(config.max_position_embeddings)
        self.longrope_original_max = longrope_original_max(config)
        self.long_factors = (self.longrope_original_max is not None
                             and self.max_position_embeddings > self.longrope_original_max)
        self._inv_freq, self.attention_scaling = compute_inv_freq(config, head_dim, self.long_factors)
        self.rows_ready = 0  # rows [0, rows_ready) of cos_sin_table hold the current factor set's values
        table = torch.empty(self.max_position_embeddings, head_dim, dtype=torch.float32, device="cpu")
        self.register_buffer("cos_sin_table", table, persistent=False)  # (P, D) float32, filled by fill_rows

    @property
    def cos_sin_cache(self) -> torch.Tensor:
        """The filled rows, [rows_ready, head_dim] float32 (a view at the table's address); a read before any
        fill computes all max_position_embeddings rows."""
        if self.rows_ready == 0:
            self.fill_rows(self.max_position_embeddings)
        return self.cos_sin_table[: self.rows_ready]

    def fill_rows(self, rows: int) -> None:
        """Compute rows [0, rows) of the table for the current factor set, in place (same storage).

        Raises:
            ValueError: ``rows`` outside [1, max_position_embeddings].
        """
        if not 1 <= rows <= self.max_position_embeddings:
            raise ValueError(f"RoPE rows {rows} outside [1, {self.max_position_embeddings}]")
        t = torch.arange(rows, dtype=torch.int64, device="cpu").float()
        freqs = t[:, None] * self._inv_freq[None, :]  # (rows, D/2)
        table = torch.cat((freqs.cos() * self.attention_scaling, freqs.sin() * self.attention_scaling), dim=-1)
        self.cos_sin_table[:rows].copy_(table)
        self.rows_ready = rows

    def set_max_model_len(self, max_model_len: int) -> None:
        """Fit the table to the longest sequence the engine serves: its first ``max_model_len`` rows (positions
        past them are not read afterwards), and for longrope the long factors when ``max_model_len`` exceeds
        ``original_max_position_embeddings`` (llama.cpp's rule by context size), else the short ones. The
        table is rewritten in place (same storage: CUDA graphs and the lean decode step keep reading it).
        Call it before any request's keys are cached."""
        rows = min(int(max_model_len), self.max_position_embeddings)
        if self.longrope_original_max is not None:
            long_factors = max_model_len > self.longrope_original_max
            if long_factors != self.long_factors:
                self.long_factors = long_factors
                self._inv_freq, self.attention_scaling = compute_inv_freq(self.config, self.head_dim, long_factors)
                self.rows_ready = 0
        if self.rows_ready < rows:
            self.fill_rows(rows)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cos_sin = self.cos_sin_cache.index_select(0, positions).to(dtype)  # (T, D)
        cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)  # (T, 1, D/2) each
        return cos, sin


def set_rope_max_model_len(model: nn.Module, max_model_len: int) -> None:
    """:meth:`RotaryEmbedding.set_max_model_len` on every RoPE table of ``model`` (the engine calls it once its
    ``max_model_len`` is final, before serving)."""
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.set_max_model_len(max_model_len)


def apply_rotary_emb(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int, use_triton: bool = False
) -> torch.Tensor:
    """Rotate-half RoPE on a flat batch (``use_triton``: one fused Triton kernel, same rounding).

    x: [T, num_heads * head_dim] or [T, num_heads, head_dim]; cos/sin: [T, 1, head_dim // 2].
    Returns a new contiguous [T, num_heads, head_dim] tensor:
    ``[x1 * cos - x2 * sin, x2 * cos + x1 * sin]`` with x1/x2 the two halves of each head, i.e.
    transformers' ``x * cos + rotate_half(x) * sin`` with the same rounding.
    """
    if use_triton:
        return triton_rotary(x, cos, sin, head_dim)
    if _kernel_takes(x, cos, sin, head_dim):
        return rope_cpu(x, cos, sin, head_dim)
    x = x.view(x.shape[0], -1, head_dim)  # (T, H, D)
    x1, x2 = x.chunk(2, dim=-1)  # (T, H, D/2) each
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


# ---- the CPU kernel (csrc/rotary.c): the same bits as the torch expression above, in one pass
_ROPE_SOURCE = Path(__file__).parent / "csrc" / "rotary.c"


def _rope_setup(lib: ctypes.CDLL) -> None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    for name in ("rope_f32", "rope_bf16"):
        fn = getattr(lib, name)
        fn.argtypes = [p, i64, p, p, i64, p, i64, i64, i64, ctypes.c_int]
        fn.restype = None


# No FMA contraction: each product and sum rounds on its own, as torch's separate elementwise ops do.
rope_library = CLibrary(_ROPE_SOURCE, "rotary", _rope_setup, (*DEFAULT_FLAGS, "-ffp-contract=off"))


def _kernel_takes(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> bool:
    """Whether :func:`rope_cpu` takes these tensors (CPU, float32/bf16 throughout, unit inner strides,
    even head_dim) and the kernel is built."""
    return (x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
            and cos.dtype == x.dtype and sin.dtype == x.dtype and head_dim % 2 == 0
            and x.stride(-1) == 1 and cos.stride(-1) == 1 and sin.stride(-1) == 1
            and rope_library.available())


def rope_cpu(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int,
             lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """:func:`apply_rotary_emb` in one C pass over the rows (csrc/rotary.c), bit-identical to its torch path.

    x: [T, H * head_dim] (rows may be strided: a column slice of the fused QKV output) or [T, H, head_dim]
    with the heads contiguous in a row; cos/sin: [T, 1, head_dim // 2] (views into one cos|sin row are
    fine), x's dtype (float32 or bfloat16). Returns a new contiguous [T, H, head_dim] tensor.
    ``lib``: a given ISA path's build (tests compare them); default this process's.

    Raises:
        RuntimeError: the kernel is not built (see ``rope_library``).
    """
    lib = lib or rope_library.get()
    T = x.shape[0]
    if x.dim() == 3:
        assert x.stride(1) == head_dim and x.stride(2) == 1, "heads must be contiguous within a row"
        H = x.shape[1]
    else:
        assert x.stride(1) == 1 and x.shape[1] % head_dim == 0
        H = x.shape[1] // head_dim
    out = torch.empty(T, H, head_dim, dtype=x.dtype)
    if T == 0:
        return out
    cos2, sin2 = cos.reshape(T, -1), sin.reshape(T, -1)  # views: [T, D/2] each
    assert cos2.stride(0) == sin2.stride(0)
    fn = lib.rope_bf16 if x.dtype == torch.bfloat16 else lib.rope_f32
    fn(x.data_ptr(), x.stride(0), cos2.data_ptr(), sin2.data_ptr(), cos2.stride(0), out.data_ptr(), T, H, head_dim,
       torch.get_num_threads())
    return out
