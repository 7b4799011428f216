"""The draft-model proposer: a smaller model with the same vocabulary drafts k tokens per request
greedily, over its own paged KV cache, in the same engine.

The draft keeps, per request, how many leading tokens of the request its cache holds. Before each
proposal it catches up on what it has not seen (the prompt the first time; afterwards the tokens
the target produced, minus the drafts it had proposed itself and which were accepted), then runs
k - 1 more single-token steps, batched over requests. Its drafts are its argmax, so as a proposal
distribution q is one-hot and the verify step's exact rule (``rejection_sampler``) applies
unchanged. Torch and the model code are used here; the engine never sees the draft's tensors.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np
import torch

from tokenmill.attention import build_attention_metadata
from tokenmill.config import ConfigError
from tokenmill.spec_decode.config import SpeculativeConfig
from tokenmill.spec_decode.speculator import Speculator

if TYPE_CHECKING:
    from tokenmill.request import Request

logger = logging.getLogger(__name__)


class DraftKVPool:
    """The draft's paged KV: a tensor [layers, planes, num_blocks, block_size, kv_heads, head_dim], a free
    list of block ids (O(1) take / give back) and each request's blocks and cached token count."""

    def __init__(self, loaded, num_blocks: int, block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        # planes: 2 (K, V), or 1 for latent attention (DeepSeek), whose layers read the one latent as both
        planes = loaded.kv_planes
        shape = (loaded.num_layers, planes, num_blocks, block_size, loaded.num_kv_heads, loaded.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=loaded.dtype, device=device)
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, planes - 1]) for i in range(loaded.num_layers)]
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.blocks: dict[str, list[int]] = {}
        self.num_cached: dict[str, int] = {}  # leading tokens of the request whose draft K/V is in the pool
        self.proposed: dict[str, list[int]] = {}  # drafts written after them at the last proposal

    def reserve(self, request_id: str, num_tokens: int) -> bool:
        """Blocks for positions [0, num_tokens); False (nothing taken) when the pool is short."""
        blocks = self.blocks.setdefault(request_id, [])
        need = -(-num_tokens // self.block_size) - len(blocks)
        if need > len(self.free):
            return False
        for _ in range(need):
            blocks.append(self.free.pop())
        return True

    def release(self, request_id: str) -> None:
        self.free.extend(self.blocks.pop(request_id, []))
        self.num_cached.pop(request_id, None)
        self.proposed.pop(request_id, None)


class DraftModelSpeculator(Speculator):
    """Proposes with a draft model (``speculative_config.model``) next to the target.

    Args:
        config: the speculative config (method ``draft_model``).
        max_model_len: as ``Speculator``.
        target: the target's ``LoadedModel``: the draft must have its vocabulary size.
        num_kv_blocks: draft pool size in blocks of ``block_size`` tokens.
        block_size: tokens per draft KV block.
        valid_draft_prefix: as ``Speculator``.
        cpu_kernels: give the draft the CPU kernel plan (measured once per machine and model shape,
            ``runner.cpu_kernels``) and the lean decode step, as the CPU runner gives the target in
            default mode; False (deterministic mode, ``--no-cpu-kernels``, CUDA): torch ops.

    Raises:
        ConfigError: naming ``speculative_config`` when the draft's vocabulary differs from the target's.
    """

    def __init__(self, config: SpeculativeConfig, max_model_len: int, target, num_kv_blocks: int, block_size: int,
                 valid_draft_prefix=None, cpu_kernels: bool = False) -> None:
        from tokenmill.models.loader import load_model

        super().__init__(config, max_model_len, valid_draft_prefix)
        self.device = target.device
        self.loaded = load_model(config.model, "float32" if target.dtype == torch.float32 else "bfloat16",
                                 device=self.device)
        if self.loaded.vocab_size != target.vocab_size:
            raise ConfigError(f"`speculative_config` model has a vocabulary of {self.loaded.vocab_size} tokens, the "
                              f"target {target.vocab_size}: a draft model must share the target's tokenizer")
        self.model = self.loaded.model
        if cpu_kernels and self.device.type == "cpu":  # the drafts' prefill and decode steps in C where it pays
            from tokenmill.runner.cpu_kernels import apply_plan, plan_cpu_kernels
            from tokenmill.runner.lean_decode import install_lean_decode

            lm_head = getattr(self.model, "lm_head", None)
            plan = plan_cpu_kernels(self.model, self.loaded.dtype, lm_head=lm_head)
            apply_plan(self.model, plan, lm_head)
            if plan.isa is not None:
                install_lean_decode(self.model, self.loaded.dtype, block_size)
        self.max_positions = min(max_model_len, self.loaded.max_position_embeddings)
        self.pool = DraftKVPool(self.loaded, num_kv_blocks, block_size, self.device)
        logger.info("draft model %s: %d KV blocks x %d tokens", self.loaded.model_path, num_kv_blocks, block_size)

    proposals_are_free = False  # each draft is a forward of the draft model: plan, then propose

    def forget_others(self, running: list[Request]) -> None:
        super().forget_others(running)
        alive = {r.request_id for r in running}
        for request_id in [r for r in self.pool.blocks if r not in alive]:
            self.pool.release(request_id)

    @torch.inference_mode()
    def propose_drafts(self, requests: list[Request], limits: list[int]) -> list[list[int]]:
        """Greedy drafts of the draft model: [len(requests)] lists of up to ``limits[i]`` tokens."""
        pool = self.pool
        drafts: list[list[int]] = [[] for _ in requests]
        active, num_done, feed = [], [], []  # request index, tokens in the draft's cache, tokens to feed
        for i, (request, k) in enumerate(zip(requests, limits)):
            rid, tokens = request.request_id, request.all_token_ids
            k = min(k, self.max_positions - request.num_tokens)
            if k <= 0 or not pool.reserve(rid, request.num_tokens + k - 1):
                pool.release(rid)
                continue
            done = pool.num_cached.get(rid, 0)
            proposed = pool.proposed.get(rid, [])
            for token in proposed:  # its own accepted drafts are in its cache already
                if done < request.num_tokens - 1 and tokens[done] == token:
                    done += 1
                else:
                    break
            active.append(i)
            num_done.append(done)
            feed.append(tokens[done:])
            limits[i] = k
        step = 0
        while active:
            logits = self._forward([requests[i].request_id for i in active], num_done, feed)  # (len(active), V)
            tokens = logits.argmax(dim=-1).tolist()
            still, still_done, still_feed = [], [], []
            for i, done, fed, token in zip(active, num_done, feed, tokens):
                drafts[i].append(token)
                if step == 0:
                    pool.num_cached[requests[i].request_id] = requests[i].num_tokens
                if len(drafts[i]) < limits[i]:
                    still.append(i)
                    still_done.append(done + len(fed))
                    still_feed.append([token])
            active, num_done, feed = still, still_done, still_feed
            step += 1
        for request, d in zip(requests, drafts):
            if d:
                pool.proposed[request.request_id] = d[:-1]  # the last draft's K/V was never written
        return drafts

    def _forward(self, request_ids: list[str], num_done: list[int], feed: list[list[int]]) -> torch.Tensor:
        """One draft forward: request j feeds ``feed[j]`` after its ``num_done[j]`` cached tokens.
        Returns the logits at each request's last fed token, [len(request_ids), V] float32."""
        pool = self.pool
        query_lens = np.fromiter((len(f) for f in feed), dtype=np.int64, count=len(feed))
        block_table = np.zeros((len(request_ids), max(len(pool.blocks[r]) for r in request_ids)), dtype=np.int64)
        for j, rid in enumerate(request_ids):
            block_table[j, : len(pool.blocks[rid])] = pool.blocks[rid]
        metadata, positions = build_attention_metadata(query_lens, np.asarray(num_done, dtype=np.int64), block_table,
                                                       pool.block_size)
        input_ids = torch.tensor([t for f in feed for t in f], dtype=torch.int64, device=self.device)
        hidden = self.model(input_ids, torch.from_numpy(positions).to(self.device), pool.kv_caches, metadata)
        last = torch.from_numpy(np.cumsum(query_lens) - 1).to(self.device)
        return self.model.compute_logits(hidden[last])
