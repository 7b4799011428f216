"""tokenmill: a readable LLM inference and serving engine.

Offline use: ``from tokenmill import LLM, SamplingParams``.
"""
from tokenmill.runner.cpu_threads import prefer_short_omp_spins

prefer_short_omp_spins()  # before anything loads torch's OpenMP runtime (runner/cpu_threads.py; opt out: envs.py)

from tokenmill.lora import LoRARequest  # noqa: E402
from tokenmill.outputs import CompletionOutput, RequestOutput  # noqa: E402
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "LoRARequest"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":  # imported lazily: pulls in torch and transformers
        from tokenmill.engine.llm import LLM

        return LLM
    raise AttributeError(name)
