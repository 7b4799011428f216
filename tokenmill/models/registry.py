"""Maps a Hugging Face ``architectures`` name to the tokenmill model class that implements it."""
from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from tokenmill.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from tokenmill.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from tokenmill.models.llama import LlamaForCausalLM, MistralForCausalLM
from tokenmill.models.mixtral import MixtralForCausalLM
from tokenmill.models.olmoe import OlmoeForCausalLM
from tokenmill.models.phi3 import Phi3ForCausalLM
from tokenmill.models.qwen2 import Qwen2ForCausalLM
from tokenmill.models.qwen3 import Qwen3ForCausalLM
from tokenmill.models.qwen_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from tokenmill.models.qwen3_next import Qwen3_5ForCausalLM, Qwen3NextForCausalLM

if TYPE_CHECKING:
    from transformers import PretrainedConfig

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,  # text only (Gemma3TextConfig)
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,  # hybrid Gated DeltaNet (docs/hybrid_models.md)
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    # mixture of experts (docs/moe.md)
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
    # mixture of experts with multi-head latent attention (docs/moe.md)
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
}


def supported_architectures() -> list[str]:
    """Architecture names accepted in config.json ``architectures``."""
    return sorted(MODEL_REGISTRY)


def get_model_class(config: PretrainedConfig) -> type[nn.Module]:
    """Pick the model class for ``config.architectures`` (the first supported entry wins).

    Raises:
        ValueError: no ``architectures`` in the config, or none of them supported.
    """
    architectures = list(getattr(config, "architectures", None) or [])
    if not architectures:
        raise ValueError(
            f"config has no 'architectures' field; cannot choose a model class (supported: {supported_architectures()})"
        )
    for name in architectures:
        if name in MODEL_REGISTRY:
            return MODEL_REGISTRY[name]
    raise ValueError(f"unsupported architectures {architectures}; tokenmill supports {supported_architectures()}")
