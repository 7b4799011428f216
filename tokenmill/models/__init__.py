"""Model implementations (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2, Gemma 3 text) and the loaders that
fill them from local files.

Models take a flat token batch plus the paged KV cache; loading never touches the network.
"""
from tokenmill.models.default_model import default_model_path
from tokenmill.models.errors import UnsupportedModelError
from tokenmill.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from tokenmill.models.llama import LlamaForCausalLM, MistralForCausalLM
from tokenmill.models.loader import LoadedModel, load_model
from tokenmill.models.phi3 import Phi3ForCausalLM
from tokenmill.models.qwen2 import Qwen2ForCausalLM
from tokenmill.models.qwen3 import Qwen3ForCausalLM
from tokenmill.models.registry import MODEL_REGISTRY, get_model_class, supported_architectures

__all__ = [
    "MODEL_REGISTRY",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "LlamaForCausalLM",
    "LoadedModel",
    "MistralForCausalLM",
    "Phi3ForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "UnsupportedModelError",
    "default_model_path",
    "get_model_class",
    "load_model",
    "supported_architectures",
]
