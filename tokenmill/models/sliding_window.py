"""Which decoder layers attend through a sliding window, read from a transformers config as transformers reads it.

A layer with window ``w`` lets the query at position p attend to keys p - w < j <= p (transformers'
``sliding_window_overlay``: ``kv_idx > q_idx - sliding_window``, on top of the causal mask), so it sees its last
``w`` keys, itself included. Each model class says how its architecture picks the layers (``SlidingLayers``).
Keys below a window stay in the paged KV cache: their blocks are not freed (docs/models.md).
"""
from __future__ import annotations

from typing import Literal, TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PretrainedConfig


# "none": the architecture has no sliding window (transformers' Llama ignores a ``sliding_window`` key);
# "all": every layer gets ``config.sliding_window`` when it is set (Mistral, Phi-3);
# "layer_types": the layers whose ``config.layer_types`` entry is "sliding_attention" (Qwen2, Qwen3, whose
# configs derive layer_types from use_sliding_window / max_window_layers; Gemma 2 and 3).
SlidingLayers = Literal["none", "all", "layer_types"]


def layer_sliding_windows(config: PretrainedConfig, layers: SlidingLayers) -> tuple[int | None, ...]:
    """The sliding window of each of the config's ``num_hidden_layers`` layers (None: full causal attention).

    Raises:
        ValueError: ``sliding_window`` is not a positive integer, or ``layer_types`` does not have one entry per
            layer (both named).
    """
    num_layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if layers == "none" or window is None or getattr(config, "use_sliding_window", True) is False:
        return (None,) * num_layers
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"config sliding_window must be a positive integer or null, got {window!r}")
    if layers == "all":
        return (window,) * num_layers
    layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * num_layers)
    if len(layer_types) != num_layers:
        raise ValueError(f"config layer_types has {len(layer_types)} entries for {num_layers} layers")
    return tuple(window if t == "sliding_attention" else None for t in layer_types)
