"""LLM: the offline API (`LLM(model).generate(prompts, SamplingParams(...))` and `.chat(messages)`)."""
from __future__ import annotations

import gc
import itertools
import os
import weakref

from tqdm import tqdm

from tokenmill.config import (
    CacheConfig,
    EngineConfig,
    KVEventsConfig,
    LoRAConfig,
    SchedulerConfig,
    StructuredOutputsConfig,
    check_bool,
)
from tokenmill.engine.chat_prompt import ChatPromptRenderer
from tokenmill.engine.llm_engine import LLMEngine, PromptType
from tokenmill.lora import LoRARequest
from tokenmill.outputs import RequestOutput
from tokenmill.rl import engine_ops
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec_decode.config import SpeculativeConfig


class LLM:
    """Offline batch generation over an in-process engine.

    Args:
        model: local HF directory, GGUF file, or None for the embedded SmolLM2-135M-Instruct.
        dtype: "auto", "float32" or "bfloat16".
        kv_cache_memory: KV pool budget in GiB (ignored if num_kv_blocks is set).
        Others as in vLLM (max_num_seqs, max_num_batched_tokens, max_model_len, block_size,
        enable_prefix_caching, enable_chunked_prefill).
        deterministic: batch-invariant mode; each request's tokens and log-probabilities are
            bit-identical whatever else is batched with it (docs/deterministic.md).
        kv_offload_memory: host-RAM KV tier below the pool, in GiB (0: off).
        kv_offload_disk_path: directory of the disk KV tier (None: off); call ``close()`` (or use
            ``with LLM(...) as llm``) so cached blocks are written there for the next run.
        kv_offload_disk_size: most GiB the disk tier keeps (None: 16); needs kv_offload_disk_path.
        kv_offload_disk_drive_size: drive size in GiB for the DWPD estimate (default: the tier size).
        kv_cache_dtype: "auto" (the model's dtype), "int8" or "fp8_e4m3" ("fp8"): K/V in one byte with
            a scale per token and KV head, about twice the tokens of bf16 in the same memory (CPU;
            docs/kv_cache_dtype.md).
        state_checkpoint_interval: hybrid linear-attention models with prefix caching: a state
            checkpoint every this many blocks; a prefix hit resumes from the latest one (docs/hybrid_models.md).
        state_cache_memory: hybrid linear-attention models: GiB for the state pool (live slots, at most
            max_num_seqs, then prefix-cache checkpoints); None: max_num_seqs of each.
        device: "auto" (CUDA when available, else CPU), "cpu", "cuda" or "cuda:N".
        gpu_memory_utilization: on CUDA, the fraction of device memory for weights, activations
            and KV cache; the KV pool gets what a profiling forward pass leaves.
        enforce_eager: on CUDA, never capture or replay CUDA graphs.
        cpu_kernels: on CPU, use the compiled C kernels where they beat torch on this machine
            (measured once per machine); False runs every layer on torch's ops.
        structured_outputs_config: constrained decoding backend, ``{"backend": "auto" | "guidance" |
            "xgrammar"}`` (a dict, its JSON text or a ``StructuredOutputsConfig``); ``auto`` is llguidance.
        enable_lora: serve PEFT LoRA adapters (``generate(..., lora_request=LoRARequest(...))``); CPU, and CUDA through Triton kernels.
        max_loras: adapter slots: the most distinct adapters in one step (others wait their turn).
        max_lora_rank: the largest adapter rank accepted (slot weights are padded to it).
        max_cpu_loras: adapters kept loaded in host memory (LRU; default ``max_loras``).
        kv_events_config: KV cache events for a KV-aware router, vLLM's fields
            (``{"enable_kv_cache_events": True, "endpoint": "tcp://*:5557", ...}``; a dict, its JSON
            text or a ``KVEventsConfig``; docs/kv_events.md).
        speculative_config: speculative decoding, vLLM's fields (``{"method": "ngram",
            "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 5,
            "disable_by_batch_size": 8}``; a dict, its JSON text or a ``SpeculativeConfig``; None: off;
            docs/spec_decode.md). Outputs are the same as without it.
        quantization: "gguf" (a GGUF file's quantized weights run as stored; the default for GGUF
            models on CPU), "int8" (weight-only int8 for safetensors checkpoints), "none" (dense
            weights in ``dtype``); docs/quantization.md.
        kv_transfer_config: prefill/decode disaggregation, vLLM's fields (``{"kv_role": "kv_producer" |
            "kv_consumer" | "kv_both", "kv_connector": ..., "kv_ip", "kv_port"}``; a dict or its JSON
            text; None: off; docs/pd_disaggregation.md).
    """

    def __init__(
        self,
        model: str | None = None,
        dtype: str = "auto",
        max_num_seqs: int = 128,
        max_num_batched_tokens: int = 1024,
        max_model_len: int | None = None,
        kv_cache_memory: float = 2.0,
        num_kv_blocks: int | None = None,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        seed: int = 0,
        num_threads: int | None = None,
        deterministic: bool = False,
        kv_offload_memory: float = 0.0,
        kv_offload_disk_path: str | None = None,
        kv_offload_disk_size: float | None = None,
        kv_offload_disk_drive_size: float | None = None,
        kv_cache_dtype: str = "auto",
        device: str = "auto",
        gpu_memory_utilization: float = 0.9,
        enforce_eager: bool = False,
        cpu_kernels: bool = True,
        structured_outputs_config: dict | str | StructuredOutputsConfig | None = None,
        enable_lora: bool = False,
        max_loras: int = 1,
        max_lora_rank: int = 16,
        max_cpu_loras: int | None = None,
        kv_events_config: dict | str | KVEventsConfig | None = None,
        speculative_config: dict | str | SpeculativeConfig | None = None,
        quantization: str | None = None,
        kv_transfer_config: dict | str | None = None,
        state_checkpoint_interval: int = 8,
        state_cache_memory: float | None = None,
    ) -> None:
        config = build_engine_config(
            model=model, dtype=dtype, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
            kv_cache_memory=kv_cache_memory, num_kv_blocks=num_kv_blocks, block_size=block_size,
            enable_prefix_caching=enable_prefix_caching, enable_chunked_prefill=enable_chunked_prefill,
            seed=seed, num_threads=num_threads, deterministic=deterministic,
            kv_offload_memory=kv_offload_memory, kv_offload_disk_path=kv_offload_disk_path,
            kv_offload_disk_size=kv_offload_disk_size,
            kv_offload_disk_drive_size=kv_offload_disk_drive_size, kv_cache_dtype=kv_cache_dtype, device=device,
            gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager, cpu_kernels=cpu_kernels,
            structured_outputs_config=structured_outputs_config, enable_lora=enable_lora, max_loras=max_loras,
            max_lora_rank=max_lora_rank, max_cpu_loras=max_cpu_loras, kv_events_config=kv_events_config,
            speculative_config=speculative_config, quantization=quantization, kv_transfer_config=kv_transfer_config,
            state_checkpoint_interval=state_checkpoint_interval, state_cache_memory=state_cache_memory,
        )
        self.engine = LLMEngine(config)
        # The engine froze the heap out of the garbage collector (LLMEngine.__init__): once this LLM is
        # freed without close(), its engine's reference cycles must be collectable again.
        weakref.finalize(self, gc.unfreeze)
        self._counter = itertools.count()
        self._chat_renderer = ChatPromptRenderer(self.get_tokenizer())

    def get_tokenizer(self):
        return self.engine.get_tokenizer()

    def close(self) -> None:
        """Save cached KV blocks to the disk tier (if any) and release it; see ``LLMEngine.close``."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- RL rollouts: weights updated in place, sleep / wake up (tokenmill/rl, docs/rl.md) ----------
    def update_weights_from_disk(self, model_path: str, flush_cache: bool = True,
                                 weight_version: str | None = None) -> dict:
        """Copy a safetensors directory or GGUF file of the same architecture and shapes into the
        weights in place; the prefix cache (every tier) stops serving blocks of the old weights
        (flushed, or with ``flush_cache=False`` never matched). Returns ``weight_info()``.

        Raises:
            tokenmill.rl.WeightUpdateError (a ValueError): a missing path, another config, missing,
                unknown, misshaped or non-float tensors (all listed); nothing was changed.
        """
        return engine_ops.update_weights_from_disk(self.engine, model_path, flush_cache, weight_version)

    def update_weights_from_tensor(self, named_tensors, flush_cache: bool = True,
                                   weight_version: str | None = None) -> dict:
        """Replace named tensors (checkpoint names; ``{name: tensor}`` or pairs; any subset) in place,
        as :meth:`update_weights_from_disk`."""
        return engine_ops.update_weights_from_tensor(self.engine, named_tensors, flush_cache, weight_version)

    def reset_prefix_cache(self) -> None:
        """Forget every cached KV block: pool, RAM tier and this model's disk records."""
        engine_ops.flush_prefix_cache(self.engine, clear_disk=True)

    def sleep(self, level: int = 1) -> None:
        """Free the KV pool (level 1) and the weights too (level 2) until :meth:`wake_up`."""
        engine_ops.sleep(self.engine, level)

    def wake_up(self) -> None:
        """Restore what :meth:`sleep` freed; outputs are the same as before it."""
        engine_ops.wake_up(self.engine)

    def is_sleeping(self) -> bool:
        return self.engine.rl_state.sleep_level > 0

    def weight_info(self) -> dict:
        """Version, fingerprint, path, load time and update count of the served weights."""
        return engine_ops.weight_info(self.engine)

    def generate(
        self,
        prompts: PromptType | list[PromptType],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns finished RequestOutputs in input order.

        ``lora_request``: one adapter for every prompt, or a list with one entry (or None: the base
        model) per prompt; needs ``enable_lora``.

        Raises ValueError (before anything is queued) when a prompt, its parameters or its adapter are invalid.
        """
        engine_ops.check_awake(self.engine)
        if not isinstance(prompts, list) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt: text, dict, or a list of token ids
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(sampling_params)} sampling_params")
        if not isinstance(lora_request, list):
            lora_request = [lora_request] * len(prompts)
        if len(lora_request) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(lora_request)} lora_request entries")
        ids = [f"offline-{next(self._counter)}" for _ in prompts]
        added = []
        try:
            for request_id, prompt, params, lora in zip(ids, prompts, sampling_params, lora_request):
                self.engine.add_request(request_id, prompt, params, lora_request=lora)
                added.append(request_id)
        except Exception:
            self.engine.abort_request(added)
            raise
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        wanted = set(ids)
        bar = tqdm(total=len(ids), desc="generate", disable=not use_tqdm)
        while len(results) < len(ids):
            for output in self.engine.step():
                if output.finished and output.request_id in wanted:
                    results[output.request_id] = output
                    bar.update(1)
        bar.close()
        return [results[i] for i in ids]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
        add_generation_prompt: bool = True,
        allow_special_tokens_in_content: bool = False,
        tools: list[dict] | None = None,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate
        (``allow_special_tokens_in_content`` as in :meth:`apply_chat_template`). ``tools``: OpenAI
        tool dicts, rendered by the template or, when it has no tools section, as a Hermes system
        block; messages may hold assistant ``tool_calls`` and ``tool`` turns (see
        ``tokenmill.tool_calling``). Parse calls out of the text with ``tool_calling.extract_tool_calls``.
        ``lora_request`` as in :meth:`generate` (per conversation when a list)."""
        from tokenmill.tool_calling import conversation_for_template, template_supports_tools

        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        supports_tools = template_supports_tools(self.get_tokenizer().chat_template)
        prompts = []
        for conversation in conversations:
            conversation, template_tools = conversation_for_template(conversation, tools, supports_tools)
            prompts.append({"prompt_token_ids": self.apply_chat_template(
                conversation, add_generation_prompt, allow_special_tokens_in_content, tools=template_tools)})
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, allow_special_tokens_in_content: bool = False,
        tools: list[dict] | None = None,
    ) -> list[int]:
        """Token ids of a conversation rendered with the model's chat template.

        Special-token strings inside message contents stay plain text, so only the template makes
        control tokens; ``allow_special_tokens_in_content=True`` parses them into control tokens
        (tokenizing the rendered text as a whole). See ``engine/chat_prompt.py``. ``tools``
        (OpenAI tool dicts) go to the template's ``tools`` variable; for templates without one use
        ``tokenmill.tool_calling.conversation_for_template`` first.
        """
        return self._chat_renderer.render(messages, add_generation_prompt, allow_special_tokens_in_content,
                                          tools=tools)


def build_engine_config(
    model: str | None = None,
    dtype: str = "auto",
    max_num_seqs: int = 128,
    max_num_batched_tokens: int = 1024,
    max_model_len: int | None = None,
    kv_cache_memory: float = 2.0,
    num_kv_blocks: int | None = None,
    block_size: int = 16,
    enable_prefix_caching: bool = True,
    enable_chunked_prefill: bool = True,
    seed: int = 0,
    num_threads: int | None = None,
    deterministic: bool = False,
    kv_offload_memory: float = 0.0,
    kv_offload_disk_path: str | None = None,
    kv_offload_disk_size: float | None = None,
    kv_offload_disk_drive_size: float | None = None,
    kv_cache_dtype: str = "auto",
    device: str = "auto",
    gpu_memory_utilization: float = 0.9,
    enforce_eager: bool = False,
    cpu_kernels: bool = True,
    structured_outputs_config: dict | str | StructuredOutputsConfig | None = None,
    enable_lora: bool = False,
    max_loras: int = 1,
    max_lora_rank: int = 16,
    max_cpu_loras: int | None = None,
    kv_events_config: dict | str | KVEventsConfig | None = None,
    speculative_config: dict | str | SpeculativeConfig | None = None,
    quantization: str | None = None,
    kv_transfer_config: dict | str | None = None,
    state_checkpoint_interval: int = 8,
    state_cache_memory: float | None = None,
) -> EngineConfig:
    """The EngineConfig for ``LLM(**kwargs)`` (same keyword names), without loading anything.

    Raises:
        ValueError: a setting out of range, naming the field.
    """
    check_bool("enable_lora", enable_lora)
    return EngineConfig(
        model=model,
        dtype=dtype,
        seed=seed,
        num_threads=num_threads,
        deterministic=deterministic,
        device=device,
        gpu_memory_utilization=gpu_memory_utilization,
        enforce_eager=enforce_eager,
        cpu_kernels=cpu_kernels,
        structured_outputs_config=StructuredOutputsConfig.from_value(structured_outputs_config),
        lora=LoRAConfig(max_loras, max_lora_rank, max_cpu_loras) if enable_lora else None,
        kv_events_config=KVEventsConfig.from_value(kv_events_config),
        speculative_config=SpeculativeConfig.from_value(speculative_config),
        quantization=quantization,
        kv_transfer_config=_kv_transfer_config(kv_transfer_config),
        cache=CacheConfig(
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            kv_cache_memory_gib=kv_cache_memory,
            enable_prefix_caching=enable_prefix_caching,
            kv_offload_memory_gib=kv_offload_memory,
            kv_offload_disk_path=(  # a str or PathLike; anything else is left for CacheConfig to refuse
                os.fspath(kv_offload_disk_path) if isinstance(kv_offload_disk_path, os.PathLike)
                else kv_offload_disk_path
            ),
            kv_offload_disk_size_gib=kv_offload_disk_size,
            kv_offload_disk_drive_size_gib=kv_offload_disk_drive_size,
            kv_cache_dtype=kv_cache_dtype,
            state_checkpoint_interval=state_checkpoint_interval,
            state_cache_memory_gib=state_cache_memory,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=enable_chunked_prefill,
        ),
    )


def _kv_transfer_config(value):
    from tokenmill.kv_transfer.config import kv_transfer_config

    return kv_transfer_config(value)
