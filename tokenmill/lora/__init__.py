"""Multi-LoRA serving: many PEFT adapters over one base model, mixed with base-model requests in one batch.

``adapter.py`` (PEFT loading and validation, mapped onto the fused
projections), ``slots.py`` (device slots: stacked, rank-padded A/B per module; the Linear hook),
``manager.py`` (host LRU, slot LRU, counters), ``mapping.py`` (per-step token -> slot segments),
``ops.py`` (batched shrink/expand and its per-token reference), ``triton_ops.py`` (the same on
CUDA as Triton kernels), ``step_adapters.py`` (the
scheduler's per-step adapter limit, pure Python). Never imports the engine or the server; this
``__init__`` stays torch-free so the scheduler and the KV cache manager can import from the package.
``LoRARequest`` (which adapter a request runs with) lives below the core types, in ``tokenmill/lora_request.py``;
it is re-exported here.
"""
from tokenmill.lora_request import LoRARequest

__all__ = ["LoRARequest"]
