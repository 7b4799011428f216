"""KVCacheManager: the scheduler's only door into the KV cache (allocation, prefix hits, freeing).

Pure CPU bookkeeping; never imports torch. Prefix caching follows vLLM's automatic prefix
caching: full blocks are indexed by chained hashes; a hit reuses the longest cached prefix.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from tokenmill.kv_cache.block_hash import extend_block_hashes
from tokenmill.kv_cache.block_pool import BlockPool, KVCacheBlock
from tokenmill.kv_cache.offload_planner import LowerTiers, OffloadPlanner
from tokenmill.kv_cache.state_slots import StateSlotAllocator
from tokenmill.request import Request

if TYPE_CHECKING:
    from tokenmill.kv_events.collector import KVEventCollector


MAX_TRACKED_SESSIONS = 4096  # agent sessions whose hit counts are kept (least recently seen dropped first)


@dataclass
class SessionCounts:
    """Prefix-cache counts of one agent session's requests (tokens)."""

    queries: int = 0
    hits: int = 0
    requests: int = 0
    last_seen: float = 0.0  # the manager's clock


class KVCacheManager:
    """Per-request block lists over one BlockPool.

    Args:
        num_blocks: pool size.
        block_size: tokens per block.
        enable_caching: automatic prefix caching on/off.
        lower_tiers: KV tiers below the pool (host RAM, disk), or None. Prefix hits then continue
            into them and evicted cached blocks are written back to them (see OffloadPlanner).
        kv_events: where blocks entering and leaving the pool are reported (KV events), or None.
        state_slots: a hybrid (linear-attention) model's per-sequence state pool, consulted on admission and
            freed with the blocks (tokenmill/kv_cache/state_slots.py); its checkpoints, if any, follow the pool's
            evictions. None for attention-only models.
        session_ttl: seconds the cached blocks of a finished (or preempted) request with a ``session_id`` stay
            ahead of plain LRU eviction (an agent between turns, waiting on a tool); 0: off. When the pool needs
            them anyway they are evicted last, oldest first, to a lower tier if there is one.
        clock: seconds, monotonic (``time.monotonic``), for ``session_ttl``.
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_caching: bool = True, lower_tiers: LowerTiers | None = None,
        kv_events: KVEventCollector | None = None, state_slots: StateSlotAllocator | None = None,
        session_ttl: float = 0.0, clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.kv_events = kv_events
        self.offload = OffloadPlanner(lower_tiers) if lower_tiers is not None and enable_caching else None
        self.state_slots = state_slots
        checkpoints = None if state_slots is None else state_slots.checkpoints
        self.block_pool = BlockPool(num_blocks, enable_caching, [x for x in (self.offload, checkpoints) if x is not None],
                                    kv_events)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # leading blocks of each request already indexed
        # Set after a weight update without a prefix-cache flush (tokenmill/rl): blocks made with other
        # weights then never match. None while every cached block was made with the current weights.
        self.weight_key: str | None = None
        # Prefix-cache statistics, in tokens.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # Agent sessions: blocks kept between turns, and the prefix-cache counts of session requests.
        self.session_ttl = session_ttl if enable_caching else 0.0
        self.clock = clock
        self.sessions: OrderedDict[str, SessionCounts] = OrderedDict()
        self.session_queries = 0
        self.session_hits = 0

    def cached_blocks(self) -> list[tuple[int, int]]:
        """(block_id, block_hash) of every cached block, least recently used first (free ones, then those in use);
        between steps all of them hold valid data (what a closing engine writes to its disk tier)."""
        pool = self.block_pool
        free = [(b.block_id, b.block_hash) for b in pool.iter_free() if b.block_hash is not None]
        used = [(b.block_id, b.block_hash) for b in pool.blocks if b.ref_cnt > 0 and b.block_hash is not None]
        return free + used

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    def usage(self) -> float:
        return self.block_pool.usage()

    def _extra_keys(self, request: Request) -> tuple:
        return self.extra_keys(request.cache_salt, request.lora_digest, request.lora_request)

    def extra_keys(self, cache_salt: str | None = None, lora_digest: str | None = None, lora_request=None) -> tuple:
        """What a request's block hashes carry besides its tokens: cache_salt, the weight key and the
        adapter, so two adapters (or an adapter and the base model) never share KV, nor do two
        versions of the weights. Session files and KV transfers hash with the same keys.

        The adapter is keyed by its content digest when known (set by the engine), so blocks kept in
        the disk tier stay with their adapter across restarts whatever id or name it gets; else by id and name."""
        keys = (cache_salt,) if cache_salt else ()
        if self.weight_key is not None:
            keys += (self.weight_key,)
        if lora_digest is not None:
            keys += (f"lora:{lora_digest}",)
        elif lora_request is not None:
            keys += (f"lora:{lora_request.lora_int_id}:{lora_request.lora_name}",)
        return keys

    def _update_block_hashes(self, request: Request) -> None:
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, self._extra_keys(request))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of a request about to be admitted.

        Returns (blocks, num_computed_tokens). At least the last token is always left to compute
        so there are logits to sample from. Requests asking for prompt log-probabilities skip the
        cache (they need logits at every prompt position). With lower tiers, the hit continues into
        them; while some of its blocks are still on disk this returns ([], 0) and
        :meth:`is_loading` is True.
        """
        if not self.enable_caching or request.wants_prompt_logprobs:
            return [], 0
        self._update_block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        if self.offload is not None:  # called even with nothing left to find: it also ends a wait on loads
            more = self.offload.extend_hits(self.block_pool, request.request_id,
                                            request.block_hashes[len(hits) : max_hit_blocks], hits)
            if more is None:
                return [], 0
            if more and self.kv_events is not None:  # blocks promoted from a lower tier are in the pool now
                first = len(hits)
                self._report_stored(request, [first + j for j, b in enumerate(more)
                                              if b.block_hash == request.block_hashes[first + j]])
            hits += more
        if self.state_slots is not None and hits:  # hybrid model: linear layers resume only from a state checkpoint
            hits = hits[: self.state_slots.resumable_blocks(request.request_id, request.block_hashes, len(hits))]
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += len(hits) * self.block_size
        if request.session_id is not None:
            self._count_session(request.session_id, request.num_tokens, len(hits) * self.block_size)
        return hits, len(hits) * self.block_size

    def _count_session(self, session_id: str, queries: int, hits: int) -> None:
        counts = self.sessions.pop(session_id, None) or SessionCounts()
        counts.queries += queries
        counts.hits += hits
        counts.requests += 1
        counts.last_seen = self.clock()
        self.sessions[session_id] = counts  # most recently seen last
        if len(self.sessions) > MAX_TRACKED_SESSIONS:
            self.sessions.popitem(last=False)
        self.session_queries += queries
        self.session_hits += hits

    def session_snapshot(self, top: int = 20) -> dict:
        """Agent sessions for /debug/kv_cache: the TTL, blocks kept between turns (all sessions), sessions
        keeping some, their session requests' prefix-cache hit rate, and the ``top`` sessions by blocks kept."""
        pool = self.block_pool
        kept = pool.session_blocks
        rows = []
        for session_id, blocks in kept.most_common(top):
            counts = self.sessions.get(session_id, SessionCounts())
            rows.append({"session": session_id, "blocks_kept": blocks, "requests": counts.requests,
                         "hit_rate": counts.hits / counts.queries if counts.queries else None})
        return {"session_kv_ttl": self.session_ttl, "num_sessions_keeping_blocks": len(kept),
                "num_session_blocks": pool.num_session_blocks, "session_prefix_cache_queries": self.session_queries,
                "session_prefix_cache_hits": self.session_hits, "sessions": rows}

    def is_loading(self, request: Request) -> bool:
        """Whether the request waits for prefix blocks being read back from disk."""
        return self.offload is not None and self.offload.is_loading(request.request_id)

    def take_kv_transfers(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """This step's (blocks_to_offload, blocks_to_load) as (block_id, block_hash) lists."""
        return self.offload.take_transfers() if self.offload is not None else ([], [])

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: list[KVCacheBlock] | None = None,
        delay_cache_blocks: bool = False,
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens after the request's computed ones.

        ``new_computed_blocks`` are prefix hits from :meth:`get_computed_blocks` (first scheduling).
        Returns the newly allocated blocks, or None (nothing changed) if the pool cannot supply them.
        Full blocks covered by this step are indexed for prefix caching right away, unless
        ``delay_cache_blocks`` (their K/V arrives later, e.g. from a KV transfer: :meth:`cache_blocks`).
        """
        new_computed_blocks = new_computed_blocks or []
        if self.session_ttl:
            self.block_pool.expire_sessions(self.clock())
        req_blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        total = num_computed + num_new_tokens
        num_required = -(-total // self.block_size)
        num_new_blocks = max(0, num_required - len(req_blocks) - len(new_computed_blocks))
        # Hits sitting in the free list are counted as free but are about to be taken.
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        no_state_slot = self.state_slots is not None and not self.state_slots.can_hold(request.request_id)
        if no_state_slot or num_new_blocks > self.block_pool.num_free_blocks - num_evictable_hits:
            if not req_blocks:
                del self.req_to_blocks[request.request_id]
            return None
        if self.state_slots is not None:  # a prefix hit restores the linear layers' checkpoint into the slot
            self.state_slots.allocate(request.request_id, resume=bool(new_computed_blocks))
        self.block_pool.touch(new_computed_blocks)
        req_blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        if self.enable_caching and not delay_cache_blocks:
            self._cache_full_blocks(request, req_blocks, min(total, request.num_tokens))
            if self.state_slots is not None:  # hybrid model: state checkpoints this step's tokens cross
                self.state_slots.plan_saves(request.request_id, request.block_hashes, num_computed,
                                            min(total, request.num_tokens), self.block_size)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Index the request's full blocks among its first ``num_tokens`` tokens, now that their K/V is in."""
        if self.enable_caching and request.request_id in self.req_to_blocks:
            self._cache_full_blocks(request, self.req_to_blocks[request.request_id], num_tokens)

    def _cache_full_blocks(self, request: Request, req_blocks: list[KVCacheBlock], num_tokens: int) -> None:
        self._update_block_hashes(request)
        num_full = num_tokens // self.block_size
        start = self.num_cached_blocks.get(request.request_id, 0)
        stored: list[int] | None = [] if self.kv_events is not None else None
        for i in range(start, num_full):
            if self.block_pool.cache_block(req_blocks[i], request.block_hashes[i]) and stored is not None:
                stored.append(i)
        self.num_cached_blocks[request.request_id] = max(start, num_full)
        if stored:
            self._report_stored(request, stored)

    def _report_stored(self, request: Request, indices: list[int]) -> None:
        """One BlockStored (pool) per run of consecutive block indices of ``request`` just cached."""
        lora = request.lora_request
        lora_id, lora_name = (lora.lora_int_id, lora.lora_name) if lora is not None else (None, None)
        extra_keys, hashes, size = self._extra_keys(request), request.block_hashes, self.block_size
        run_start = 0
        for k in range(1, len(indices) + 1):
            if k < len(indices) and indices[k] == indices[k - 1] + 1:
                continue
            a, b = indices[run_start], indices[k - 1] + 1
            self.kv_events.block_stored(hashes[a:b], hashes[a - 1] if a > 0 else None,
                                        request.all_token_ids[a * size : b * size], extra_keys, lora_id, lora_name)
            run_start = k

    def cached_prefix_block_ids(self, block_hashes: list[int]) -> list[int]:
        """Block ids of the longest prefix of ``block_hashes`` held in the pool (not the lower tiers)."""
        out = []
        for block_hash in block_hashes:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            out.append(block.block_id)
        return out

    def import_prefix(self, token_ids: list[int], extra_keys: tuple = (), lora: tuple[int, str] | None = None
                      ) -> tuple[list[int], list[int]] | None:
        """Make the full blocks of ``token_ids`` (hashed with ``extra_keys``) prefix-cache entries whose
        K/V the caller copies in (``BlockPool.import_cached_blocks``): returns (block ids to fill, their
        indices in the chain); blocks already cached are not returned. None: not enough free blocks
        (nothing changed). ``lora``: (id, name) for the KV event. Between engine steps only.
        """
        hashes: list[int] = []
        extend_block_hashes(hashes, token_ids, self.block_size, extra_keys)
        fresh = [i for i, h in enumerate(hashes) if self.block_pool.get_cached_block(h) is None]
        blocks = self.block_pool.import_cached_blocks(hashes)
        if blocks is None:
            return None
        if self.kv_events is not None and fresh:
            lora_id, lora_name = lora if lora is not None else (None, None)
            for i in fresh:  # one event per block: its parent and tokens say where it sits
                self.kv_events.block_stored(hashes[i : i + 1], hashes[i - 1] if i > 0 else None,
                                            token_ids[i * self.block_size : (i + 1) * self.block_size], extra_keys,
                                            lora_id, lora_name)
        return [b.block_id for b in blocks], fresh

    def discard_unwritten(self, request: Request) -> None:
        """Unindex ``request``'s blocks past its computed tokens: the step that was to write them failed, but
        ``allocate_slots`` had already made the full ones prefix-cache entries. Its blocks stay allocated (free
        the request as usual); no later request can hit their K/V."""
        blocks = self.req_to_blocks.get(request.request_id)
        if not blocks:
            return
        first = request.num_computed_tokens // self.block_size
        self.block_pool.discard_cached(blocks[first:])
        if request.request_id in self.num_cached_blocks:
            self.num_cached_blocks[request.request_id] = min(self.num_cached_blocks[request.request_id], first)

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def free(self, request: Request) -> None:
        """Release a request's blocks; its tail blocks become evictable before its head blocks. A request with a
        ``session_id`` (``session_ttl`` > 0) leaves its cached blocks kept for ``session_ttl`` seconds."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        if self.session_ttl and request.session_id is not None:
            self.block_pool.free_blocks(list(reversed(blocks)), self.clock() + self.session_ttl, request.session_id)
        else:
            self.block_pool.free_blocks(list(reversed(blocks)))
        if self.state_slots is not None:
            self.state_slots.free(request.request_id)
        if self.offload is not None:
            self.offload.forget(request.request_id)

    def check_integrity(self, idle: bool = False) -> None:
        """Assert pool invariants and that every request's blocks are referenced; with ``idle`` (the engine has
        no request) also that no request holds a block or a state slot and every block is free."""
        self.block_pool.check_integrity()
        if self.state_slots is not None:
            self.state_slots.check_integrity()
        if idle:
            assert not self.req_to_blocks, f"idle, yet requests hold blocks: {sorted(self.req_to_blocks)[:5]}"
            pool = self.block_pool
            assert pool.num_free_blocks == pool.num_blocks, (
                f"idle, yet {pool.num_blocks - pool.num_free_blocks} of {pool.num_blocks} blocks are referenced")
            if self.state_slots is not None:
                assert self.state_slots.num_free_slots == self.state_slots.num_slots, "idle, yet state slots are held"
        for req_id, blocks in self.req_to_blocks.items():
            for block in blocks:
                assert block.ref_cnt > 0, f"{req_id} holds unreferenced {block}"
