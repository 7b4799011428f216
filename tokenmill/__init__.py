"""tokenmill: a readable LLM inference and serving engine.

Offline use: ``from tokenmill import LLM, SamplingParams``.
"""
from tokenmill.sampling_params import SamplingParams
from tokenmill.outputs import CompletionOutput, RequestOutput

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":  # imported lazily: pulls in torch and transformers
        from tokenmill.engine.llm import LLM

        return LLM
    raise AttributeError(name)
