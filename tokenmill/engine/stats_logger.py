"""StatsLogger: a periodic one-line log of engine throughput, queue sizes, KV usage and prefix-cache hit rate.

Logs at INFO on the ``tokenmill.engine`` logger; whether the line is shown is the caller's logging setup
(`tokenmill chat` and `generate` hide INFO unless asked, `serve` shows it).
"""
from __future__ import annotations

import logging
import time

from tokenmill import envs

logger = logging.getLogger("tokenmill.engine")


class StatsLogger:
    """Accumulates per-step token counts and logs them every ``interval_s`` seconds (when busy).

    Args:
        interval_s: seconds between lines; None reads ``envs.stats_interval_s()`` ($TOKENMILL_STATS_INTERVAL_S,
            default 10).
    """

    def __init__(self, interval_s: float | None = None) -> None:
        self.interval_s = envs.stats_interval_s() if interval_s is None else interval_s
        self._last_log = time.monotonic()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._last_queries = 0
        self._last_hits = 0
        self._last_spec = (0, 0, 0)  # speculative decoding: drafts, draft tokens, accepted tokens

    def record_step(self, num_prompt_tokens: int, num_generation_tokens: int) -> None:
        """Add one step's prompt and generated token counts."""
        self._prompt_tokens += num_prompt_tokens
        self._generation_tokens += num_generation_tokens

    def maybe_log(self, scheduler, kv_cache_manager, kv_store=None, spec_stats=None) -> None:
        """Log the stats line if ``interval_s`` has passed since the last one, then start a new interval.
        ``spec_stats`` (a ``SpecDecodingStats``, with speculative decoding) adds the interval's draft
        acceptance rate."""
        now = time.monotonic()
        elapsed = now - self._last_log
        if elapsed < self.interval_s:
            return
        queries = kv_cache_manager.prefix_cache_queries - self._last_queries
        hits = kv_cache_manager.prefix_cache_hits - self._last_hits
        logger.info(
            "prompt throughput: %.1f tok/s, generation throughput: %.1f tok/s, running: %d, waiting: %d, "
            "KV cache usage: %.1f%%, prefix cache hit rate: %.1f%% (%d/%d tokens)%s",
            self._prompt_tokens / elapsed, self._generation_tokens / elapsed, scheduler.num_running,
            scheduler.num_waiting, 100 * kv_cache_manager.usage(), 100 * hits / queries if queries else 0.0,
            hits, queries, offload_summary(kv_store) if kv_store is not None else "",
        )
        if spec_stats is not None:
            drafts = spec_stats.num_drafts - self._last_spec[0]
            draft_tokens = spec_stats.num_draft_tokens - self._last_spec[1]
            accepted = spec_stats.num_accepted_tokens - self._last_spec[2]
            logger.info(
                "speculative decoding: draft acceptance rate: %.1f%% (%d/%d tokens), mean acceptance length: %.2f, "
                "accepted per position: %s", 100 * accepted / draft_tokens if draft_tokens else 0.0, accepted,
                draft_tokens, 1 + accepted / drafts if drafts else 1.0, spec_stats.num_accepted_tokens_per_pos,
            )
            self._last_spec = (spec_stats.num_drafts, spec_stats.num_draft_tokens, spec_stats.num_accepted_tokens)
        self._last_log = now
        self._prompt_tokens = self._generation_tokens = 0
        self._last_queries, self._last_hits = kv_cache_manager.prefix_cache_queries, kv_cache_manager.prefix_cache_hits


def offload_summary(kv_store) -> str:
    """Cumulative per-tier counters of the lower KV tiers, for the stats line."""
    parts = [
        f"{name} {stats['hits']} hit blocks, {stats['bytes_written'] / 2**20:.1f} MiB written, "
        f"{stats['bytes_read'] / 2**20:.1f} MiB read"
        for name, stats in kv_store.tier_stats().items()
    ]
    dwpd = kv_store.dwpd()
    return ", KV offload: " + "; ".join(parts) + (f"; disk DWPD {dwpd:.3g}" if dwpd is not None else "")
