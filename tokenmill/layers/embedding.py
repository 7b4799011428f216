"""Token embedding table with uninitialised storage (always overwritten by ``load_weights``)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.quantization.formats import QuantizedTensor
from tokenmill.quantization.gguf_weight import GGUFWeight


class VocabEmbedding(nn.Module):
    """Lookup table: forward(input_ids [T] int64) -> [T, embedding_dim].

    The weight is allocated with ``torch.empty`` (no random init) so that building a
    multi-billion-parameter model costs nothing before its weights are loaded. ``quant`` (set by
    ``load_quantized``): the table kept in a GGUF block format; looked-up rows are dequantized to
    ``quant_dtype`` (the model's dtype).
    """

    quant: GGUFWeight | None = None

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)

    def load_quantized(self, weight: QuantizedTensor) -> None:
        """Keep the table quantized ([num_embeddings, embedding_dim]); rows come out in the dense weight's dtype.

        Raises:
            ValueError: the shape does not match.
        """
        if weight.shape != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"quantized embedding {weight.shape} does not fit "
                             f"{self.num_embeddings}x{self.embedding_dim}")
        self.quant_dtype = self.weight.dtype
        self.weight = None
        self.quant = GGUFWeight([weight])
        # The blocks as GGUFWeight keeps them (repacked into the tiled layout where that is the default),
        # so a tied LM head reading the tiled copy does not leave the stored one alive beside it.
        self.register_buffer("qweight_0", self.quant.tensors()[0])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return self.quant.dequantize(self.quant_dtype, input_ids)
        return F.embedding(input_ids, self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"
