"""Weight bytes for ``tokenmill plan``, tensor by tensor: what the engine holds, and what a batch-1 decode step reads.

Pure arithmetic on checkpoint tensor names and shapes (safetensors headers or a GGUF tensor index); no weights
are read and torch is not imported. Each tensor is held in one of three ways per ``--quantization``: in the run
dtype, in a fixed format (int8 blocks, GGUF blocks as stored) or in float32 whatever the dtype (DeepSeek's
router, ``MoEConfig.router_float32``). ``--quantization int8`` (``quantization/int8.py``) turns every decoder
``Linear`` whose in_features is a multiple of 32 into 34 bytes per 32 weights: every 2-D ``*.weight`` but the
embedding, the LM head and DeepSeek's ``kv_b_proj`` (a dense ``LatentProjection``), routers and shared-expert
gates included.

Mixture-of-experts (docs/moe.md): a routed expert tensor (``experts.{e}.*``; GGUF's stacked ``ffn_*_exps``) counts
k / E of itself per token, E the experts and k the experts per token. Active parameters follow the published
convention (everything but the unchosen experts, embeddings whole); the decode read counts what a batch-1 step
touches: the embedding table one row (unless tied: the LM head reads it whole), the rest as active.
"""
from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

INT8_BLOCK_BYTES, INT8_BLOCK_WEIGHTS = 34, 32  # Q8_0: 32 int8 codes + a float16 scale
_ROUTED_EXPERT = re.compile(r"\.experts\.\d+\.|\.ffn_\w+_exps\.")
_EMBEDDING = ("embed_tokens.weight", "token_embd.weight")
_LM_HEAD = ("lm_head.weight", "output.weight")
_DENSE_ONLY = ("kv_b_proj.weight",)  # not a Linear: int8 leaves it alone
_FLOAT32_ROUTER = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias", "ffn_gate_inp.weight", "exp_probs_b.bias")


@dataclass(frozen=True)
class TensorInfo:
    """One stored tensor: checkpoint name, shape, stored bytes, and whether ``--quantization gguf`` keeps its
    blocks (``gguf_loader.kept_quantized_names``; always False for safetensors)."""

    name: str
    shape: Sequence[int]
    nbytes: int
    gguf_kept: bool = False


@dataclass(frozen=True)
class WeightCensus:
    """Parameters of a set of weights and their bytes per ``--quantization`` ("none", "int8", "gguf"): held as
    ``<q>_dtype_params`` × bytes(run dtype) + ``<q>_fixed_bytes``."""

    params: int = 0
    none_dtype_params: int = 0
    none_fixed_bytes: int = 0
    int8_dtype_params: int = 0
    int8_fixed_bytes: int = 0
    gguf_dtype_params: int = 0
    gguf_fixed_bytes: int = 0

    def nbytes(self, dtype_bytes: int, quantization: str) -> int:
        """Bytes in a run dtype of ``dtype_bytes`` under ``quantization`` ("none", "int8" or "gguf")."""
        return (getattr(self, f"{quantization}_dtype_params") * dtype_bytes
                + getattr(self, f"{quantization}_fixed_bytes"))


@dataclass(frozen=True)
class MoESizes:
    """A model's MoE facts as its engine class reads them (``MoECausalLM.moe_config`` / ``moe_layers``)."""

    num_experts: int
    num_experts_per_tok: int
    router_float32: bool


def int8_quantized(name: str, shape: Sequence[int]) -> bool:
    """Whether ``--quantization int8`` keeps this safetensors tensor in int8 blocks (module docstring)."""
    return (len(shape) == 2 and name.endswith(".weight") and not name.endswith(_EMBEDDING + _LM_HEAD + _DENSE_ONLY)
            and shape[1] % INT8_BLOCK_WEIGHTS == 0)


def census(tensors: Iterable[TensorInfo], *, int8_allowed: bool, moe: MoESizes | None, tied: bool,
           vocab_size: int) -> tuple[WeightCensus, WeightCensus, int]:
    """(held, read by a batch-1 decode step, active parameters) of ``tensors`` (module docstring).

    ``int8_allowed``: a safetensors checkpoint (int8 is refused for GGUF files). ``tied``: the LM head is the
    embedding table. The fractions k / E and 1 / vocab are exact for equal-width experts and block-aligned rows.
    """
    held = [0] * 7
    read = [0] * 7
    active = 0
    for t in tensors:
        p = math.prod(t.shape)
        f32 = moe is not None and moe.router_float32 and t.name.endswith(_FLOAT32_ROUTER)
        int8 = int8_allowed and int8_quantized(t.name, t.shape)
        dense = (0, 4 * p) if f32 else (p, 0)
        row = [p, *dense,
               *((0, p // INT8_BLOCK_WEIGHTS * INT8_BLOCK_BYTES) if int8 else dense),
               *((0, t.nbytes) if t.gguf_kept else dense)]
        held = [a + b for a, b in zip(held, row)]
        if moe is not None and _ROUTED_EXPERT.search(t.name):
            num, den = moe.num_experts_per_tok, moe.num_experts
        else:
            num, den = 1, 1
        active += p * num // den
        if t.name.endswith(_EMBEDDING) and not tied:
            den *= vocab_size  # one row per token
        read = [a + b * num // den for a, b in zip(read, row)]
    return WeightCensus(*held), WeightCensus(*read), active
