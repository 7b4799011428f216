"""ModelRunner: owns the model, the KV-cache tensors and the sampler; executes one SchedulerOutput.

Builds input_ids / positions / slot_mapping with vectorised numpy (a loop over requests, never
over tokens), computes logits only at sampled positions (plus prompt positions whose
log-probabilities were asked for), and returns plain Python results in a ModelRunnerOutput.
"""
from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch

from tokenmill.attention import build_attention_metadata
from tokenmill.attention.kv_quant import SCALE_DTYPE, QuantizedKVCache, storage_dtype
from tokenmill.config import ConfigError
from tokenmill.lora.mapping import build_lora_mapping
from tokenmill.outputs import Logprob, PositionLogprobs
from tokenmill.quantization.gguf_weight import dispatch_rows
from tokenmill.runner.cpu_threads import omp_spin_note
from tokenmill.runner.kv_cache_sizing import GIB, kv_bytes_per_token, num_blocks_for_budget
from tokenmill.runner.kv_pool import KVPool
from tokenmill.runner.verify_rows import verify_rows_layout
from tokenmill.sampling import Sampler, SamplingMetadata, SamplingRow
from tokenmill.sampling.grammar_mask import apply_token_bitmask_
from tokenmill.sampling.rejection_sampler import accept_sampled_prefix
from tokenmill.scheduler.output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class StepInputs:
    """One step's host inputs (``ModelRunner._prepare``). requests: the B scheduled requests; query_lens [B] and
    num_computed [B] (int64); input_ids [T] (a request's draft tokens after its own); block_table [B, max blocks]
    (0-padded); sample_rows: indices of the requests whose scheduled tokens reach the end of their sequence (they
    get a token); verify_rows: drafts verified as decode rows; lora_mapping: each token's adapter slot on the
    device, or None without LoRA."""

    scheduler_output: SchedulerOutput
    requests: list
    query_lens: np.ndarray
    num_computed: np.ndarray
    input_ids: np.ndarray
    block_table: np.ndarray
    sample_rows: list[int]
    verify_rows: bool = False
    lora_mapping: object = None


@dataclasses.dataclass
class ForwardOutput:
    """What the forward gives the sampler. hidden: [rows, hidden] on the device (rows = T, or a padded decode
    bucket); query_start_loc: [B + 1] host int64, request i's first row of ``hidden`` (each request's rows are
    consecutive); sample_hidden_idx: [S] int64 on the device, the row of ``hidden`` that each of ``sample_rows``
    samples from (its last)."""

    hidden: torch.Tensor
    query_start_loc: np.ndarray
    sample_hidden_idx: torch.Tensor

    @classmethod
    def packed(cls, hidden: torch.Tensor, query_lens: np.ndarray, sample_rows: list[int]) -> ForwardOutput:
        """The output of a forward whose rows are the step's tokens, request after request."""
        query_start_loc = np.concatenate(([0], np.cumsum(query_lens))).astype(np.int64)
        last = query_start_loc[1:] - 1
        idx = torch.from_numpy(last[np.asarray(sample_rows, dtype=np.int64)]).to(hidden.device)
        return cls(hidden, query_start_loc, idx)


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
        kv_cache_dtype: str = "auto",
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
            if (note := omp_spin_note()) is not None:
                logger.info("OpenMP: %s", note)
        self.block_size = block_size
        self.vocab_size = loaded.vocab_size
        self.kv_dtype = storage_dtype(kv_cache_dtype) or loaded.dtype  # int8 / fp8 codes, or the model's dtype
        if loaded.kv_planes == 1 and self.kv_dtype != loaded.dtype:
            raise ConfigError(f"`kv_cache_dtype` {kv_cache_dtype!r} is not supported with multi-head latent "
                              "attention (DeepSeek-V2/V3): its cache holds the latent in the model's dtype; use 'auto'")
        self.bytes_per_token = kv_bytes_per_token(
            loaded.num_layers, loaded.num_kv_heads, loaded.head_dim, torch.empty(0, dtype=self.kv_dtype).element_size(),
            loaded.kv_planes,
        )
        if self.kv_dtype != loaded.dtype:  # plus a float16 scale per token, KV head, K and V, layer
            self.bytes_per_token += 2 * loaded.num_layers * loaded.num_kv_heads * SCALE_DTYPE.itemsize
        if num_kv_blocks is None:
            num_kv_blocks = num_blocks_for_budget(int(kv_cache_memory_gib * GIB), block_size, self.bytes_per_token)
        self.num_kv_blocks = num_kv_blocks
        try:
            self.kv_pool = KVPool(loaded.num_layers, num_kv_blocks + num_padding_blocks, block_size,
                                  loaded.num_kv_heads, loaded.head_dim, self.kv_dtype, self.device,
                                  SCALE_DTYPE if self.kv_dtype != loaded.dtype else None, loaded.kv_planes)
        except (RuntimeError, MemoryError) as exc:  # the allocator refused: the budget is larger than memory
            pool_gib = num_kv_blocks * block_size * self.bytes_per_token / GIB
            raise ConfigError(
                f"the KV pool of {num_kv_blocks} blocks ({pool_gib:.3g} GiB) cannot be allocated "
                f"({str(exc).splitlines()[0][:120]}); lower `kv_cache_memory` or `num_kv_blocks`"
            ) from None
        # the pool's tensors, for the forward only: every block copy goes through self.kv_pool
        # (layers, planes, num_blocks + padding blocks, block_size, kv_heads, head_dim); scales without head_dim;
        # planes 1 for latent attention, whose layers get the one latent plane as both K and V
        self.kv_cache, self.kv_scales = self.kv_pool.kv, self.kv_pool.scales
        self.kv_caches = [self.kv_pool.layer_planes(self.kv_cache, i) for i in range(loaded.num_layers)]
        if self.kv_scales is not None:
            self.kv_caches = [tuple(QuantizedKVCache(c, s) for c, s in zip(self.kv_caches[i],
                                                                           self.kv_pool.layer_planes(self.kv_scales, i)))
                              for i in range(loaded.num_layers)]
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%.3f GiB, %d bytes/token, %s)",
            num_kv_blocks, block_size, num_kv_blocks * block_size,
            self.kv_cache.numel() * self.kv_cache.element_size() / GIB, self.bytes_per_token, self.kv_dtype,
        )
        if (self.kernel_plan is not None and self.kernel_plan.isa is not None and lora_manager is None
                and self.kv_dtype == loaded.dtype):  # decode and mixed steps in one C call (runner/lean_decode.py)
            from tokenmill.runner.cpu_kernels import ROW_LADDER, apply_plan
            from tokenmill.runner.lean_decode import install_lean_decode

            why_not = install_lean_decode(self.model, loaded.dtype, block_size)
            if why_not is None:
                # The torch path (steps the lean step refuses) on the kernels the lean step calls at every row
                # count: which of the two runs a step never changes its bits.
                every = (True,) * len(ROW_LADDER)
                self.kernel_plan = dataclasses.replace(self.kernel_plan, rms_norm=every, silu_and_mul=every,
                                                       paged_decode=True)
                apply_plan(self.model, self.kernel_plan, getattr(self.model, "lm_head", None))
                self.kernel_choice = self.kernel_plan.describe() + ", lean decode step"
            logger.info("lean decode step: %s", why_not or "on")
        self.sampler = Sampler(self.vocab_size)
        self.verify_as_decode_rows = True  # verify steps of decoding requests as decode rows (runner.verify_rows)

    def release_kv(self) -> None:
        """Give the KV pool's memory back (the engine sleeps: ``tokenmill.rl``); every view stays valid. The
        CUDA runner also drops its decode graphs, captured against the released memory."""
        self.kv_pool.release()

    def restore_kv(self) -> None:
        """Bring the KV pool back, zeroed (wake up); the CUDA runner captures its decode graphs again."""
        self.kv_pool.restore()

    @property
    def state_cache(self):
        """A hybrid model's linear-attention state pool (``LinearStateCache``), held by the KV pool; None for other
        models or before ``allocate_state_cache``."""
        return self.kv_pool.state

    def allocate_state_cache(self, num_slots: int, checkpoints=None):
        """Allocate a hybrid model's linear-attention state pool (``num_slots`` sequences, and the slots of
        ``checkpoints``, a ``StateCheckpoints`` or None) beside the KV pool; returns its ``StateSlotAllocator`` for
        the KV cache manager (docs/hybrid_models.md)."""
        from tokenmill.linear_attention.state_cache import LinearStateCache

        self.kv_pool.state = LinearStateCache(self.model, num_slots, self.loaded.dtype, self.device,
                                            checkpoints=checkpoints)
        return self.state_cache.slots

    @property
    def num_kv_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step, the same template on every device: prepare the host inputs (and the step's adapters),
        run the forward (``_forward``, the only part a device runner overrides), then sample the rows that
        reach the end of their sequence, or verify their drafts. Shapes: T = total scheduled tokens,
        B = scheduled requests."""
        step = self._prepare(scheduler_output)
        with dispatch_rows(len(step.requests) if step.verify_rows else None):
            forward = self._forward(step)
            return self._sample_or_verify(step, forward)

    def _prepare(self, scheduler_output: SchedulerOutput) -> StepInputs:
        """The step's host inputs (``_gather_inputs``), the requests to sample, whether drafts are verified as
        decode rows, and the adapters put into their slots with each token's slot mapped."""
        requests, query_lens, num_computed, input_ids, block_table = self._gather_inputs(scheduler_output)
        ends = num_computed + query_lens
        sample_rows = [i for i, r in enumerate(requests) if ends[i] >= r.num_tokens]
        lora_mapping = None
        if self.lora_manager is not None:  # adapters into their slots; each token's slot for the hooked layers
            slots = self.lora_manager.activate([r.lora_request for r in requests])
            lora_mapping = build_lora_mapping(slots, query_lens, self.device)
            self.lora_manager.slots.mapping = lora_mapping
        return StepInputs(scheduler_output, requests, query_lens, num_computed, input_ids, block_table, sample_rows,
                          self._verify_as_decode_rows(scheduler_output, requests, num_computed), lora_mapping)

    def _forward(self, step: StepInputs) -> ForwardOutput:
        """The model over the step's tokens (``step.verify_rows``: drafts verified as decode rows, every product
        choosing its kernel as the plain decode step of these requests would)."""
        requests, query_lens, num_computed = step.requests, step.query_lens, step.num_computed
        if step.verify_rows:
            metadata, positions = build_attention_metadata(
                *verify_rows_layout(query_lens, num_computed, step.block_table), self.block_size)
            metadata = dataclasses.replace(metadata, dispatch_rows=len(requests))
        else:
            metadata, positions = build_attention_metadata(
                query_lens, num_computed, step.block_table, self.block_size, per_token=self.deterministic
            )
        if self.state_cache is not None:  # hybrid model: each request's linear-attention state slot
            metadata = self.state_cache.step_metadata(metadata, requests, query_lens, num_computed)
        hidden = self.model(torch.from_numpy(step.input_ids), torch.from_numpy(positions), self.kv_caches, metadata)
        return ForwardOutput.packed(hidden, query_lens, step.sample_rows)

    def _sample_or_verify(self, step: StepInputs, forward: ForwardOutput) -> ModelRunnerOutput:
        """Prompt log-probabilities where asked, then a token for each sampling request, or drafts verified."""
        scheduler_output, requests, hidden = step.scheduler_output, step.requests, forward.hidden
        prompt_logprobs = self._prompt_logprobs(requests, step.num_computed, step.query_lens,
                                                forward.query_start_loc, hidden, step.input_ids)
        if scheduler_output.scheduled_spec_decode_tokens and step.sample_rows:  # verify drafts
            return self._verify(scheduler_output, step.sample_rows, forward.query_start_loc[1:] - 1, hidden,
                                prompt_logprobs)
        sampled: list[int | None] = [None] * len(requests)
        logprobs_out: list[PositionLogprobs | None] | None = None
        if step.sample_rows:
            sampled, logprobs_out = self._sample(requests, step.sample_rows,
                                                 hidden.index_select(0, forward.sample_hidden_idx),
                                                 scheduler_output.grammar_bitmask)
        return ModelRunnerOutput(sampled_token_ids=sampled, logprobs=logprobs_out, prompt_logprobs=prompt_logprobs)

    def _verify_as_decode_rows(self, scheduler_output: SchedulerOutput, requests, num_computed: np.ndarray) -> bool:
        """True when this step verifies drafts and every request is decoding (its scheduled tokens are its
        last sampled token and its drafts): then each token runs as a decode row of its own
        (``verify_rows_layout``), through the decode path (the lean decode step where installed) and the
        same per-row kernels as plain decoding, instead of as a short prefill. Not in deterministic mode
        (its per-token attention is already exact) nor for hybrid models (their state advances per request)."""
        if (not scheduler_output.scheduled_spec_decode_tokens or not self.verify_as_decode_rows
                or self.deterministic or self.state_cache is not None):
            return False
        return all(int(c) == r.num_tokens - 1 for c, r in zip(num_computed, requests))

    def _verify(self, scheduler_output: SchedulerOutput, sample_rows: list[int], last_token_idx: np.ndarray,
                hidden: torch.Tensor, prompt_logprobs: dict) -> ModelRunnerOutput:
        """Speculative decoding's verify: logits at every draft position and the bonus position of
        each sampling request (m_i drafts: its last m_i + 1 scheduled tokens), each row sampled as plain
        decoding would sample that position given the drafts before it; the drafts accepted are the
        longest prefix equal to those samples (``sampling.rejection_sampler.accept_sampled_prefix``).

        ``last_token_idx`` [B] (host) is each request's last row in ``hidden`` [T, hidden]."""
        requests = scheduler_output.scheduled_requests
        spec = scheduler_output.scheduled_spec_decode_tokens
        drafts = [spec.get(requests[i].request_id, []) for i in sample_rows]
        counts = np.fromiter((len(d) + 1 for d in drafts), dtype=np.int64, count=len(drafts))  # (S,)
        row_req = np.repeat(np.asarray(sample_rows, dtype=np.int64), counts)  # (R,) request of each row
        starts = np.cumsum(counts) - counts
        offset = np.arange(int(counts.sum())) - np.repeat(starts, counts)  # (R,) position within the request
        hidden_idx = last_token_idx[row_req] - np.repeat(counts - 1, counts) + offset
        prefixes = [d[:j] for d in drafts for j in range(len(d) + 1)]
        hidden_rows = hidden.index_select(0, torch.from_numpy(hidden_idx).to(hidden.device))  # (R, hidden)
        tokens, entries = self._sample_rows(requests, row_req.tolist(), hidden_rows, scheduler_output.grammar_bitmask,
                                            prefixes)
        sampled: list[int | None] = [None] * len(requests)
        logprobs_out = [None] * len(requests) if entries is not None else None
        extra, extra_logprobs = {}, {}
        for k, i in enumerate(sample_rows):
            start, m = int(starts[k]), len(drafts[k])
            num_accepted = accept_sampled_prefix(tokens[start : start + m + 1], drafts[k])
            sampled[i] = tokens[start]
            if entries is not None:
                logprobs_out[i] = entries[start]
            if m:
                extra[i] = tokens[start + 1 : start + 1 + num_accepted]
                extra_logprobs[i] = (entries[start + 1 : start + 1 + num_accepted] if entries is not None
                                     else [None] * num_accepted)
        return ModelRunnerOutput(sampled_token_ids=sampled, logprobs=logprobs_out, prompt_logprobs=prompt_logprobs,
                                 extra_sampled_token_ids=extra, extra_logprobs=extra_logprobs)

    def _gather_inputs(self, scheduler_output: SchedulerOutput):
        """Host-side inputs of a step (numpy): (requests, query_lens [B], num_computed [B],
        input_ids [T] (a request's draft tokens after its own), block_table [B, max_blocks of this step],
        0-padded)."""
        requests = scheduler_output.scheduled_requests
        num_reqs = len(requests)
        query_lens = np.asarray(scheduler_output.num_scheduled_tokens, dtype=np.int64)
        num_computed = np.fromiter((r.num_computed_tokens for r in requests), dtype=np.int64, count=num_reqs)
        num_tokens = int(query_lens.sum())

        input_ids = np.empty(num_tokens, dtype=np.int64)
        max_blocks = max(len(b) for b in scheduler_output.block_ids)
        block_table = np.zeros((num_reqs, max_blocks), dtype=np.int64)
        spec = scheduler_output.scheduled_spec_decode_tokens
        offset = 0
        for i, request in enumerate(requests):
            start = int(num_computed[i])
            drafts = spec.get(request.request_id) if spec else None
            if drafts:  # the last sampled token, then the drafts to verify
                input_ids[offset : offset + query_lens[i]] = request.all_token_ids[start:] + drafts
            else:
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
        token_ids, entries = self._sample_rows(requests, sample_rows, hidden_rows, grammar_bitmask)
        for j, i in enumerate(sample_rows):
            sampled[i] = token_ids[j]
        logprobs_out: list[PositionLogprobs | None] | None = None
        if entries is not None:
            logprobs_out = [None] * num_reqs
            for j, i in enumerate(sample_rows):
                logprobs_out[i] = entries[j]
        return sampled, logprobs_out

    def _sample_rows(self, requests, row_req: list[int], hidden_rows: torch.Tensor, grammar_bitmask=None,
                     draft_prefixes: list[list[int]] | None = None):
        """Sample one token per row: row j belongs to request ``row_req[j]`` and has hidden state
        ``hidden_rows[j]`` ([R, hidden]). A request fills one row, or (verifying drafts) consecutive
        rows, row j then following the drafts ``draft_prefixes[j]``: its penalties, ``min_tokens`` and
        seeded noise are those of that position, as if the drafts had been sampled.
        Returns (token id per row [R], logprobs entry per row (None where not asked) or None)."""
        logits = self.model.compute_logits(hidden_rows)  # (R, V) float32
        exempt = self._apply_grammar_bitmask(logits, row_req, grammar_bitmask)
        rows = []
        for j, i in enumerate(row_req):
            request = requests[i]
            prefix = draft_prefixes[j] if draft_prefixes is not None else []
            rows.append(SamplingRow(
                params=request.sampling_params,
                prompt_token_ids=request.prompt_token_ids,
                output_token_ids=request.output_token_ids + prefix if prefix else request.output_token_ids,
                seed=request.seed,
                stop_token_ids=request.stop_token_ids,
                min_tokens_exempt=j in exempt,
            ))
        result = self.sampler(logits, SamplingMetadata.build(rows, self.vocab_size, device=self.device))
        if result.logprobs is None:
            (token_ids,) = self._to_host([result.sampled_token_ids])
            return token_ids, None
        token_ids, lp, ranks, top_ids, top_lps = self._to_host([
            result.sampled_token_ids, result.logprobs, result.sampled_ranks, result.top_logprob_ids,
            result.top_logprobs,
        ])
        entries: list[PositionLogprobs | None] = []
        for j, i in enumerate(row_req):
            k = requests[i].sampling_params.logprobs
            if k is None:
                entries.append(None)
                continue
            entry = {token_ids[j]: Logprob(lp[j], ranks[j])}
            for rank, (tid, tlp) in enumerate(zip(top_ids[j][:k], top_lps[j][:k]), start=1):
                entry.setdefault(tid, Logprob(tlp, rank))
            entries.append(entry)
        return token_ids, entries

    def _apply_grammar_bitmask(self, logits: torch.Tensor, row_req: list[int], grammar_bitmask) -> set[int]:
        """Mask the constrained rows of ``logits`` [R, V] (waiting for the bitmask fill started before
        the forward); ``row_req[j]`` is row j's request index, a request's rows consecutive (several
        when it verifies drafts: one mask per position). Returns the rows whose constraint allows only
        end-of-sequence tokens."""
        if grammar_bitmask is None:
            return set()
        bitmask, only_stop, allows_none = grammar_bitmask.result()
        first_row: dict[int, int] = {}
        for j, i in enumerate(row_req):
            first_row.setdefault(i, j)
        num_rows = grammar_bitmask.num_rows or [1] * len(grammar_bitmask.req_indices)
        logit_rows = [first_row[i] + t for i, n in zip(grammar_bitmask.req_indices, num_rows) for t in range(n)]
        keep = [k for k in range(len(logit_rows)) if not allows_none[k]]
        rows = torch.tensor([logit_rows[k] for k in keep], dtype=torch.int64)
        mask = torch.from_numpy(bitmask[keep]) if len(keep) < len(bitmask) else torch.from_numpy(bitmask)
        apply_token_bitmask_(logits, mask.to(logits.device, non_blocking=True), rows.to(logits.device))
        return {logit_rows[k] for k in range(len(logit_rows)) if only_stop[k]}

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
