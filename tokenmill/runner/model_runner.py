"""ModelRunner: owns the model, the KV-cache tensors and the sampler; executes one SchedulerOutput.

Builds input_ids / positions / slot_mapping with vectorised numpy (a loop over requests, never
over tokens), computes logits only at sampled positions (plus prompt positions whose
log-probabilities were asked for), and returns plain Python results in a ModelRunnerOutput.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from tokenmill.attention import build_attention_metadata
from tokenmill.config import ConfigError
from tokenmill.lora.mapping import build_lora_mapping
from tokenmill.outputs import Logprob, PositionLogprobs
from tokenmill.runner.kv_cache_sizing import GIB, kv_bytes_per_token, num_blocks_for_budget
from tokenmill.sampling import Sampler, SamplingMetadata, SamplingRow
from tokenmill.sampling.grammar_mask import apply_token_bitmask_
from tokenmill.scheduler.output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


class ModelRunner:
    """Runs the model over a flat batch of scheduled tokens.

    Args:
        loaded: a ``tokenmill.models.loader.LoadedModel``.
        block_size: tokens per KV block.
        num_kv_blocks: explicit pool size, or None to size from ``kv_cache_memory_gib``.
        kv_cache_memory_gib: KV pool budget in GiB.
        deterministic: run every layer on its batch-invariant kernel (tokenmill.runner.deterministic).
        device: where the KV tensors and the step's work live (the model must already be there).
        num_padding_blocks: extra KV blocks after the pool that are never handed out (the CUDA
            runner's padding block); ``num_kv_blocks`` excludes them.
        cpu_kernels: on a CPU device outside deterministic mode, run linears, RMSNorm, SiLU×up and
            decode attention in the compiled C kernels where they beat torch on this CPU (measured:
            ``tokenmill.runner.cpu_kernels``), and the LM head in the C GEMM (float32 logits);
            False (``--no-cpu-kernels``) puts every layer on its torch op.
        use_cpu_kernels: False leaves the layers' kernel settings untouched (the CUDA runner, whose
            Triton paths must stay in use even when it runs on CPU in tests).
        lora_manager: a ``tokenmill.lora.manager.LoRAManager`` (hooks installed on the model) when
            adapters are enabled; each step then places its adapters and sets the token -> slot mapping.

    Attributes:
        kernel_choice: one line saying which kernels run (for the startup log and status pages).
        kernel_plan: the ``cpu_kernels.KernelPlan`` applied in default CPU mode, else None.

    Raises:
        ValueError: deterministic mode asked for with a dtype or machine it cannot support.
    """

    def __init__(
        self,
        loaded,
        block_size: int,
        num_kv_blocks: int | None,
        kv_cache_memory_gib: float,
        deterministic: bool = False,
        device: torch.device | str = "cpu",
        num_padding_blocks: int = 0,
        cpu_kernels: bool = True,
        use_cpu_kernels: bool = True,
        lora_manager=None,
    ) -> None:
        self.loaded = loaded
        self.lora_manager = lora_manager
        self.model = loaded.model
        self.device = torch.device(device)
        self.deterministic = deterministic
        if deterministic:
            from tokenmill.runner.deterministic import check_deterministic_supported, enable_batch_invariant

            check_deterministic_supported(loaded.dtype, self.device)
            enable_batch_invariant(self.model)
        self.kernel_plan = None  # the measured CPU kernel plan (default mode on CPU), for status pages
        self.kernel_choice = "deterministic: batch-invariant C kernels" if deterministic else "torch ops"
        if deterministic:
            from tokenmill.layers import batch_invariant

            self.kernel_choice += f" ({batch_invariant.isa()} path)"
        elif self.device.type == "cpu" and use_cpu_kernels and self.model is not None:
            from tokenmill.runner.cpu_kernels import apply_plan, plan_cpu_kernels

            lm_head = getattr(self.model, "lm_head", None)
            plan = plan_cpu_kernels(self.model, loaded.dtype, enabled=cpu_kernels, lm_head=lm_head)
            apply_plan(self.model, plan, lm_head)
            self.kernel_plan = plan
            self.kernel_choice = plan.describe()
        if self.device.type == "cpu":
            logger.info("CPU kernels: %s", self.kernel_choice)
        self.block_size = block_size
        self.vocab_size = loaded.vocab_size
        self.kv_dtype = loaded.dtype
        self.bytes_per_token = kv_bytes_per_token(
            loaded.num_layers, loaded.num_kv_heads, loaded.head_dim, torch.empty(0, dtype=self.kv_dtype).element_size()
        )
        if num_kv_blocks is None:
            num_kv_blocks = num_blocks_for_budget(int(kv_cache_memory_gib * GIB), block_size, self.bytes_per_token)
        self.num_kv_blocks = num_kv_blocks
        # (layers, 2, num_blocks + padding blocks, block_size, kv_heads, head_dim)
        shape = (loaded.num_layers, 2, num_kv_blocks + num_padding_blocks, block_size, loaded.num_kv_heads,
                 loaded.head_dim)
        try:
            self.kv_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        except (RuntimeError, MemoryError) as exc:  # the allocator refused: the budget is larger than memory
            pool_gib = num_kv_blocks * block_size * self.bytes_per_token / GIB
            raise ConfigError(
                f"the KV pool of {num_kv_blocks} blocks ({pool_gib:.3g} GiB) cannot be allocated "
                f"({str(exc).splitlines()[0][:120]}); lower `kv_cache_memory` or `num_kv_blocks`"
            ) from None
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(loaded.num_layers)]
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%.3f GiB, %d bytes/token, %s)",
            num_kv_blocks, block_size, num_kv_blocks * block_size,
            self.kv_cache.numel() * self.kv_cache.element_size() / GIB, self.bytes_per_token, self.kv_dtype,
        )
        self.sampler = Sampler(self.vocab_size)

    @property
    def num_kv_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step. Shapes: T = total scheduled tokens, B = scheduled requests."""
        requests, query_lens, num_computed, input_ids, block_table = self._gather_inputs(scheduler_output)
        metadata, positions = build_attention_metadata(
            query_lens, num_computed, block_table, self.block_size, per_token=self.deterministic
        )
        if self.lora_manager is not None:  # adapters into their slots; each token's slot for the hooked layers
            slots = self.lora_manager.activate([r.lora_request for r in requests])
            self.lora_manager.slots.mapping = build_lora_mapping(slots, query_lens, self.device)
        hidden = self.model(torch.from_numpy(input_ids), torch.from_numpy(positions), self.kv_caches, metadata)

        # Requests whose scheduled tokens reach the end of their sequence get a new token.
        ends = num_computed + query_lens
        sample_rows = [i for i, r in enumerate(requests) if ends[i] >= r.num_tokens]
        last_token_idx = metadata.query_start_loc[1:] - 1  # (B,)
        sampled: list[int | None] = [None] * len(requests)
        logprobs_out: list[PositionLogprobs | None] | None = None
        if sample_rows:
            rows_t = torch.tensor(sample_rows, dtype=torch.int64)
            sampled, logprobs_out = self._sample(requests, sample_rows, hidden[last_token_idx[rows_t]],
                                                 scheduler_output.grammar_bitmask)
        prompt_logprobs = self._prompt_logprobs(
            requests, num_computed, query_lens, metadata.query_start_loc, hidden, input_ids
        )
        return ModelRunnerOutput(sampled_token_ids=sampled, logprobs=logprobs_out, prompt_logprobs=prompt_logprobs)

    def _gather_inputs(self, scheduler_output: SchedulerOutput):
        """Host-side inputs of a step (numpy): (requests, query_lens [B], num_computed [B],
        input_ids [T], block_table [B, max_blocks of this step], 0-padded)."""
        requests = scheduler_output.scheduled_requests
        num_reqs = len(requests)
        query_lens = np.asarray(scheduler_output.num_scheduled_tokens, dtype=np.int64)
        num_computed = np.fromiter((r.num_computed_tokens for r in requests), dtype=np.int64, count=num_reqs)
        num_tokens = int(query_lens.sum())

        input_ids = np.empty(num_tokens, dtype=np.int64)
        max_blocks = max(len(b) for b in scheduler_output.block_ids)
        block_table = np.zeros((num_reqs, max_blocks), dtype=np.int64)
        offset = 0
        for i, request in enumerate(requests):
            start = int(num_computed[i])
            input_ids[offset : offset + query_lens[i]] = request.all_token_ids[start : start + query_lens[i]]
            offset += int(query_lens[i])
            block_ids = scheduler_output.block_ids[i]
            block_table[i, : len(block_ids)] = block_ids
        return requests, query_lens, num_computed, input_ids, block_table

    def _to_host(self, tensors: list[torch.Tensor]) -> list[list]:
        """Python lists of ``tensors`` (the CUDA runner overrides this with one synchronisation)."""
        return [t.tolist() for t in tensors]

    def _sample(self, requests, sample_rows: list[int], hidden_rows: torch.Tensor, grammar_bitmask=None):
        """Logits and sampling for ``sample_rows`` (S request indices) from their hidden states
        ``hidden_rows`` [S, hidden]; ``grammar_bitmask`` (a GrammarBitmask or None) masks the
        constrained rows. Returns (sampled token per request or None, logprobs or None)."""
        num_reqs = len(requests)
        sampled: list[int | None] = [None] * num_reqs
        logprobs_out: list[PositionLogprobs | None] | None = None
        logits = self.model.compute_logits(hidden_rows)  # (S, V) float32
        exempt = self._apply_grammar_bitmask(logits, sample_rows, grammar_bitmask)
        rows = [
            SamplingRow(
                params=requests[i].sampling_params,
                prompt_token_ids=requests[i].prompt_token_ids,
                output_token_ids=requests[i].output_token_ids,
                generator=requests[i].generator,
                seed=requests[i].seed,
                stop_token_ids=requests[i].eos_token_ids | set(requests[i].sampling_params.stop_token_ids or ()),
                min_tokens_exempt=i in exempt,
            )
            for i in sample_rows
        ]
        result = self.sampler(logits, SamplingMetadata.build(rows, self.vocab_size, device=self.device))
        if result.logprobs is None:
            (token_ids,) = self._to_host([result.sampled_token_ids])
        else:
            token_ids, lp, ranks, top_ids, top_lps = self._to_host([
                result.sampled_token_ids, result.logprobs, result.sampled_ranks, result.top_logprob_ids,
                result.top_logprobs,
            ])
        for j, i in enumerate(sample_rows):
            sampled[i] = token_ids[j]
        if result.logprobs is not None:
            logprobs_out = [None] * num_reqs
            for j, i in enumerate(sample_rows):
                k = requests[i].sampling_params.logprobs
                if k is None:
                    continue
                entry = {token_ids[j]: Logprob(lp[j], ranks[j])}
                for rank, (tid, tlp) in enumerate(zip(top_ids[j][:k], top_lps[j][:k]), start=1):
                    entry.setdefault(tid, Logprob(tlp, rank))
                logprobs_out[i] = entry
        return sampled, logprobs_out

    def _apply_grammar_bitmask(self, logits: torch.Tensor, sample_rows: list[int], grammar_bitmask) -> set[int]:
        """Mask the constrained rows of ``logits`` [S, V] (waiting for the bitmask fill started before
        the forward). Returns the request indices whose constraint allows only end-of-sequence tokens."""
        if grammar_bitmask is None:
            return set()
        bitmask, only_stop, allows_none = grammar_bitmask.result()
        position = {i: j for j, i in enumerate(sample_rows)}
        keep = [k for k in range(len(grammar_bitmask.req_indices)) if not allows_none[k]]
        rows = torch.tensor([position[grammar_bitmask.req_indices[k]] for k in keep], dtype=torch.int64)
        mask = torch.from_numpy(bitmask[keep]) if len(keep) < len(bitmask) else torch.from_numpy(bitmask)
        apply_token_bitmask_(logits, mask.to(logits.device, non_blocking=True), rows.to(logits.device))
        return {grammar_bitmask.req_indices[k] for k in range(len(only_stop)) if only_stop[k]}

    def _prompt_logprobs(self, requests, num_computed, query_lens, query_start_loc, hidden, input_ids):
        """Score prompt tokens for requests that asked for prompt log-probabilities.

        ``query_start_loc`` [B + 1] on the host; ``hidden`` [T, hidden] on the runner's device.

        Hidden state at position p predicts token p + 1; entries are returned for prompt positions
        start+1 .. end (capped at the prompt), with the first prompt position's entry being None.
        """
        out: dict[str, tuple[int, list]] = {}
        for i, request in enumerate(requests):
            k = request.sampling_params.prompt_logprobs
            if k is None:
                continue
            start = int(num_computed[i])
            end = min(start + int(query_lens[i]), request.num_prompt_tokens)
            if start >= request.num_prompt_tokens:
                continue
            entries: list[PositionLogprobs | None] = [None] if start == 0 else []
            num_scored = end - start - (1 if end == request.num_prompt_tokens else 0)
            if num_scored > 0:
                tok0 = int(query_start_loc[i])
                logits = self.model.compute_logits(hidden[tok0 : tok0 + num_scored])  # (n, V)
                logprobs = torch.log_softmax(logits, dim=-1)
                target_list = request.prompt_token_ids[start + 1 : start + 1 + num_scored]
                targets = torch.tensor(target_list, device=hidden.device)
                target_lp = logprobs.gather(1, targets[:, None]).squeeze(1)
                ranks = (logprobs > target_lp[:, None]).sum(dim=1) + 1
                top_lp, top_ids = logprobs.topk(k, dim=-1)  # (n, k); k may be 0
                target_ids, target_lps, target_ranks, top_id_rows, top_lp_rows = self._to_host(
                    [targets, target_lp, ranks, top_ids, top_lp]
                )
                for j in range(num_scored):
                    entry = {target_ids[j]: Logprob(target_lps[j], target_ranks[j])}
                    for rank, (t, v) in enumerate(zip(top_id_rows[j], top_lp_rows[j]), start=1):
                        entry.setdefault(t, Logprob(v, rank))
                    entries.append(entry)
            # Position index in request.prompt_logprobs where these entries start.
            out[request.request_id] = (0 if start == 0 else start + 1, entries)
        return out
