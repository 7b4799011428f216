"""CudaModelRunner: the ModelRunner for a CUDA device (Triton attention, CUDA graphs, profiled KV sizing).

Differences from the CPU ModelRunner it extends: step inputs go through preallocated pinned
buffers with one non-blocking copy (``input_buffers``); attention runs in the Triton kernels on
device-side metadata, and RMSNorm, SiLU-and-multiply and RoPE in fused Triton kernels
(``layers/triton_elementwise.py``), MoE experts in the grouped expert kernels (``moe/triton_experts.py``);
decode-only steps run at padded batch sizes over static buffers
(``padded_decode``) and replay a CUDA graph per size (``cuda_graph``) unless ``enforce_eager``;
the KV pool is sized by a profiling forward (``gpu_memory``); sampled tokens come back in one
transfer. With a ``lora_manager`` the adapters run in the Triton shrink/expand kernels
(``lora/triton_ops.py``); a step whose requests use adapters runs eagerly (decode steps padded as
usual, no graph replay: the graphs are captured without LoRA), a step without any replays as
before. Hybrid linear-attention models (docs/hybrid_models.md) get their state pool from
:meth:`CudaModelRunner.allocate_state_cache` with one padding slot for padded decode rows, and
their decode graphs are captured then (the graphs read each row's slot from the decode buffers;
zeroing, checkpoint restores and checkpoint saves run eagerly around the replay); the linear layers
run fla-core's kernels when it is installed (``linear_attention/fla_ops.py``). It also runs on CPU
(no graphs, no profiling) so tests can drive the same code paths, with ``attention_backend="torch"``
or with Triton under ``TRITON_INTERPRET=1``.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from tokenmill.attention import build_attention_metadata, triton_attention
from tokenmill.config import CacheConfig, ConfigError, SchedulerConfig
from tokenmill.kv_cache.state_slots import state_bytes_per_sequence, state_pool_sizes
from tokenmill.linear_attention import fla_ops
from tokenmill.linear_attention.state_cache import LinearStateCache, scratch_metadata
from tokenmill.runner.cuda_graph import DecodeGraphs
from tokenmill.runner.gpu_memory import GRAPH_MEMORY_RESERVE, kv_cache_budget_bytes, profile_memory
from tokenmill.runner.input_buffers import StepBuffers, fetch_to_host
from tokenmill.runner.kv_cache_sizing import GIB, kv_bytes_per_token, num_blocks_for_budget
from tokenmill.runner.model_runner import ForwardOutput, ModelRunner, StepInputs
from tokenmill.runner.padded_decode import DecodeBuffers, choose_bucket, graph_batch_sizes, run_padded_decode
from tokenmill.sampling import Sampler, SamplingMetadata, SamplingRow
from tokenmill.sampling_params import MAX_LOGPROBS, SamplingParams

logger = logging.getLogger(__name__)

# Largest padded decode batch; bigger decode-only steps run through the general path.
MAX_GRAPH_BATCH_SIZE = 512
ATTENTION_BACKENDS = ("triton", "torch")


def enable_triton_kernels(model: torch.nn.Module) -> int:
    """Switch every layer of ``model`` that has a Triton path (its class declares ``use_triton``:
    Attention, RMSNorm, SiluAndMul, the RoPE of LlamaAttention, SparseMoeBlock) onto it, and let those
    that need it prepare their weights (``prepare_triton``: a MoE block stacks its experts'); returns how many.

    Raises:
        ValueError: from ``prepare_triton`` (e.g. quantized expert weights, which the kernels refuse).
    """
    count = 0
    for module in model.modules():
        if hasattr(type(module), "use_triton"):
            module.use_triton = True
            if hasattr(module, "prepare_triton"):
                module.prepare_triton()
            count += 1
    return count


class CudaModelRunner(ModelRunner):
    """Runs the model on a CUDA device (see the module docstring).

    Args:
        loaded: a ``LoadedModel`` whose weights are already on ``loaded.device``.
        cache: block_size, and num_kv_blocks (None: sized from ``gpu_memory_utilization`` on
            CUDA, from ``kv_cache_memory_gib`` on CPU).
        scheduler: max_num_seqs, max_num_batched_tokens and a resolved max_model_len (buffer sizes).
        gpu_memory_utilization: fraction of device memory for weights + activations + KV cache.
        enforce_eager: never capture CUDA graphs (decode steps still run padded, so tokens match).
        attention_backend: "triton" (always on CUDA) or "torch" (CPU tests: the reference backend).
        lora_manager: a ``LoRAManager`` whose hooks are on the model (adapters enabled), or None.

    Raises:
        ValueError: triton missing, an unknown backend, or no memory left for the KV cache.
    """

    def __init__(
        self,
        loaded,
        cache: CacheConfig,
        scheduler: SchedulerConfig,
        gpu_memory_utilization: float = 0.9,
        enforce_eager: bool = False,
        attention_backend: str = "triton",
        lora_manager=None,
    ) -> None:
        device = loaded.device
        if loaded.kv_planes == 1:
            from tokenmill.models.errors import UnsupportedModelError

            raise UnsupportedModelError(f"{type(loaded.model).__name__} (multi-head latent attention) runs on the CPU "
                                        "only: the CUDA runner has no latent-cache attention kernels yet")
        self.is_hybrid = bool(getattr(loaded.model, "is_hybrid", False))  # linear-attention layers: a state pool
        if attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {attention_backend!r}")
        if device.type == "cuda" and attention_backend != "triton":
            raise ValueError("on CUDA the attention backend is triton")
        if attention_backend == "triton":
            if not triton_attention.available():
                raise ValueError("the CUDA runner needs the `triton` package (pip install triton)")
            enable_triton_kernels(loaded.model)
            if lora_manager is not None:
                lora_manager.slots.use_triton = True  # always so on CUDA; also under the CPU interpreter
        if lora_manager is not None:
            lora_manager.slots.mapping = None  # the profiling step and the captured graphs run without LoRA
        if device.type == "cuda":
            torch.cuda.set_device(device)
        assert scheduler.max_model_len is not None, "max_model_len must be resolved before the runner is built"
        block_size = cache.block_size
        self.max_blocks_per_seq = -(-scheduler.max_model_len // block_size)
        self.step_buffers = None
        if attention_backend == "triton":
            self.step_buffers = StepBuffers(
                scheduler.max_num_batched_tokens, scheduler.max_num_seqs, self.max_blocks_per_seq, block_size, device
            )
        num_kv_blocks = cache.num_kv_blocks
        if num_kv_blocks is None and device.type == "cuda":
            num_kv_blocks = self._profile_num_blocks(
                loaded, block_size, scheduler, gpu_memory_utilization, enforce_eager, cache
            )
        # (None on CPU: sized from kv_cache_memory_gib.) The extra block after the pool is the
        # padding block of padded decode rows.
        super().__init__(loaded, block_size, num_kv_blocks, cache.kv_cache_memory_gib, device=device,
                         num_padding_blocks=1, use_cpu_kernels=False, lora_manager=lora_manager)
        self.verify_as_decode_rows = False  # drafts verify in one eager step (padded decode takes single tokens)
        self.kernel_choice = (f"{attention_backend} attention, "
                              + ("eager decode" if enforce_eager else "CUDA graphs for decode"))
        self.padding_block_id = self.num_kv_blocks
        max_decode = min(scheduler.max_num_seqs, scheduler.max_num_batched_tokens, MAX_GRAPH_BATCH_SIZE)
        self.decode_batch_sizes = graph_batch_sizes(max_decode)
        self.decode_buffers = DecodeBuffers(
            self.decode_batch_sizes[-1], self.max_blocks_per_seq, block_size, self.padding_block_id, device,
            reference_views=attention_backend == "torch",
        )
        self.graphs: DecodeGraphs | None = None
        # A hybrid model's graphs read its state pool, so they are captured once it exists (allocate_state_cache).
        self._graphs_pending = device.type == "cuda" and not enforce_eager
        if self._graphs_pending and not self.is_hybrid:
            self._capture_graphs()
        # Steps run so far on each path (tests and benchmarks read these).
        self.num_padded_decode_steps = 0
        self.num_general_steps = 0
        logger.info("decode steps padded to batch sizes %s, CUDA graphs %s", self.decode_batch_sizes,
                    "on" if self.graphs is not None else "pending (state pool)" if self._graphs_pending else "off")

    @torch.inference_mode()
    def _capture_graphs(self) -> None:
        """Capture the padded decode step of every bucket (``DecodeGraphs``)."""
        self._graphs_pending = False
        self.graphs = DecodeGraphs(self.model, self.kv_caches, self.decode_buffers, self.decode_batch_sizes)

    def release_kv(self) -> None:
        """As ``ModelRunner.release_kv``; the decode graphs (captured against the released memory) are dropped
        and captured again by ``restore_kv``."""
        self._graphs_pending = self._graphs_pending or self.graphs is not None
        self.graphs = None
        super().release_kv()

    def restore_kv(self) -> None:
        super().restore_kv()
        if self._graphs_pending and (not self.is_hybrid or self.state_cache is not None):
            with torch.inference_mode():
                self._capture_graphs()

    def allocate_state_cache(self, num_slots: int, checkpoints=None):
        """A hybrid model's linear-attention state pool: ``num_slots`` live slots plus one padding slot that padded
        decode rows read and write; every decode bucket's metadata reads the rows' slots from the decode buffers,
        and the decode graphs are captured now. Returns the pool's ``StateSlotAllocator``."""
        self.kv_pool.state = LinearStateCache(self.model, num_slots, self.loaded.dtype, self.device,
                                              num_padding_slots=1, checkpoints=checkpoints)
        self.decode_buffers.set_linear_state(self.state_cache.decode_metadata, self.state_cache.padding_slot)
        if self.device.type == "cuda":
            version = fla_ops.version()
            self.kernel_choice += (f", linear layers on fla-core {version}" if version is not None
                                   else ", linear layers on the torch reference (no fla-core)")
        if self._graphs_pending:
            self._capture_graphs()
        return self.state_cache.slots

    # ---- memory ------------------------------------------------------------------------
    @torch.inference_mode()
    def _profile_num_blocks(
        self, loaded, block_size: int, scheduler: SchedulerConfig, utilization: float, enforce_eager: bool,
        cache: CacheConfig,
    ) -> int:
        """KV blocks that fit after a dummy step at the largest shape (the padding block included) and, for a
        hybrid model, its linear-attention state pool (sized as the engine will size it, plus the padding slot)."""
        assert self.step_buffers is not None
        chunk = min(scheduler.max_num_batched_tokens, scheduler.max_model_len)
        num_reqs = min(-(-scheduler.max_num_batched_tokens // chunk), scheduler.max_num_seqs)
        query_lens = np.full(num_reqs, chunk, dtype=np.int64)
        query_lens[-1] = min(chunk, scheduler.max_num_batched_tokens - chunk * (num_reqs - 1))
        blocks_per_req = -(-chunk // block_size)
        block_table = np.arange(num_reqs * blocks_per_req, dtype=np.int64).reshape(num_reqs, blocks_per_req)
        temp_cache = torch.zeros(loaded.num_layers, 2, num_reqs * blocks_per_req, block_size, loaded.num_kv_heads,
                                 loaded.head_dim, dtype=loaded.dtype, device=loaded.device)
        temp_caches = [(temp_cache[i, 0], temp_cache[i, 1]) for i in range(loaded.num_layers)]
        num_rows = scheduler.max_num_seqs
        worst_case = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, repetition_penalty=1.1,
                                    logprobs=MAX_LOGPROBS).with_defaults({})
        rows = [SamplingRow(worst_case, prompt_token_ids=[0] * 16, output_token_ids=[0] * 16)] * num_rows
        sampler = Sampler(loaded.vocab_size)

        def dummy_step() -> None:
            staged = self.step_buffers.stage(
                np.zeros(int(query_lens.sum()), dtype=np.int64), query_lens, np.zeros(num_reqs, dtype=np.int64),
                block_table, np.arange(num_reqs, dtype=np.int64),
            )
            metadata = staged.metadata
            if self.is_hybrid:  # a throw-away state pool of one slot per request
                metadata = scratch_metadata(metadata, loaded.model, query_lens, loaded.dtype, loaded.device)
            hidden = loaded.model(staged.input_ids, staged.positions, temp_caches, metadata)
            logits = loaded.model.compute_logits(hidden[:1].expand(num_rows, -1))  # (max_num_seqs, V)
            sampler(logits, SamplingMetadata.build(rows, loaded.vocab_size, device=loaded.device))

        profile = profile_memory(dummy_step, loaded.device)
        temp_caches = temp_cache = None  # free the dummy cache (dummy_step closes over it, so not `del`)
        torch.cuda.empty_cache()
        reserve = 0 if enforce_eager else GRAPH_MEMORY_RESERVE
        budget = kv_cache_budget_bytes(profile, utilization, reserve)
        state_pool = self._state_pool_bytes(loaded, scheduler, cache) if self.is_hybrid else 0
        budget -= state_pool
        bytes_per_token = kv_bytes_per_token(loaded.num_layers, loaded.num_kv_heads, loaded.head_dim,
                                             loaded.dtype.itemsize)
        num_blocks = num_blocks_for_budget(budget, block_size, bytes_per_token) - 1  # minus the padding block
        if num_blocks < 1:
            raise ConfigError(f"`gpu_memory_utilization` {utilization} leaves no KV block after the padding block")
        logger.info(
            "GPU memory: %.2f GiB total x %.2f; weights %.2f GiB, peak with activations %.2f GiB, outside torch "
            "%.2f GiB, graph reserve %.2f GiB, linear-attention state pool %.2f GiB -> KV cache %.2f GiB",
            profile.total / GIB, utilization, profile.weights / GIB, profile.peak / GIB, profile.non_torch / GIB,
            reserve / GIB, state_pool / GIB, budget / GIB,
        )
        return num_blocks

    @staticmethod
    def _state_pool_bytes(loaded, scheduler: SchedulerConfig, cache: CacheConfig) -> int:
        """Bytes of the state pool the engine hook will allocate (``state_pool_sizes``: live slots and prefix-cache
        checkpoints) plus the padding slot."""
        per_seq = state_bytes_per_sequence(*loaded.model.linear_state_shapes(), loaded.dtype.itemsize)
        budget = cache.state_cache_memory_gib
        live, checkpoints = state_pool_sizes(None if budget is None else int(budget * GIB), per_seq,
                                             scheduler.max_num_seqs, cache.enable_prefix_caching)
        return (live + checkpoints + 1) * per_seq

    # ---- the step ----------------------------------------------------------------------
    def _to_host(self, tensors: list[torch.Tensor]) -> list[list]:
        return fetch_to_host(tensors)

    def _forward(self, step: StepInputs) -> ForwardOutput:
        """The forward of one step (the template's only device part). Decode-only steps of B <= the largest
        bucket rows replay (or run eagerly, e.g. when a request uses an adapter) the padded decode at the smallest
        bucket >= B; every other step runs eagerly on the staged step buffers (the reference attention backend of
        the CPU tests: on freshly built metadata)."""
        requests, query_lens, num_computed = step.requests, step.query_lens, step.num_computed
        num_reqs = len(requests)
        sample_idx = np.asarray(step.sample_rows, dtype=np.int64)
        bucket = choose_bucket(num_reqs, self.decode_batch_sizes) if bool((query_lens == 1).all()) else None
        state = self.state_cache  # hybrid models: the linear layers' state pool
        if bucket is not None:
            self.num_padded_decode_steps += 1
            state_slots = saves = None
            if state is not None:  # zeroed / restored slots before the graph, checkpoint saves after it
                state_slots, saves = state.begin_step(requests, query_lens, num_computed)
            self.decode_buffers.load(step.input_ids, num_computed, step.block_table, bucket, sample_idx,
                                     None if state_slots is None else state_slots.numpy())
            if self.graphs is not None and step.lora_mapping is None:
                hidden = self.graphs.replay(bucket)  # (bucket, hidden)
            else:
                hidden = run_padded_decode(self.model, self.kv_caches, self.decode_buffers, bucket)
            if saves:
                state.save_decode_checkpoints(saves, state_slots)
            return ForwardOutput(hidden, np.arange(num_reqs + 1, dtype=np.int64),
                                 self.decode_buffers.sample_idx[: len(step.sample_rows)])
        self.num_general_steps += 1
        if self.step_buffers is not None:
            staged = self.step_buffers.stage(step.input_ids, query_lens, num_computed, step.block_table, sample_idx)
            metadata = staged.metadata
            if state is not None:
                metadata = state.step_metadata(metadata, requests, query_lens, num_computed)
            hidden = self.model(staged.input_ids, staged.positions, self.kv_caches, metadata)  # (T, hidden)
            return ForwardOutput(hidden, np.concatenate(([0], np.cumsum(query_lens))).astype(np.int64),
                                 staged.sample_idx)
        metadata, positions = build_attention_metadata(query_lens, num_computed, step.block_table, self.block_size)
        if state is not None:
            metadata = state.step_metadata(metadata, requests, query_lens, num_computed)
        hidden = self.model(torch.from_numpy(step.input_ids), torch.from_numpy(positions), self.kv_caches, metadata)
        return ForwardOutput.packed(hidden, query_lens, step.sample_rows)
