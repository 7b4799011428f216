"""Adaptive verification: how many drafts each request verifies per step, so that drafting happens
only where it pays (``speculative_config.enable_adaptive_verification``, vLLM's field name).

Three pieces, pure Python and numpy (no torch, nothing from the engine):

- ``StepCostModel``: seconds per engine step by the number of scheduled tokens T, learned online
  (a median of each T's recent steps; a size not timed for a while is timed again by a step without
  drafts), interpolated where T was never seen, never decreasing in T.
- ``AcceptanceEstimate``: per request, an exponentially weighted estimate of the probability that
  the draft at position j is accepted given that the ones before it were; their running product is
  a draft slot's survival probability. A request whose first position stops paying is paused for a
  number of output tokens (doubling while retries keep failing), then starts again from the prior.
- ``plan_num_drafts``: ranks every (request, position) slot by survival probability and admits the
  best ones while (requests + expected accepted drafts) / predicted step time keeps growing.

The policy follows the description of vLLM's adaptive verification (slots ranked by the running
product of per-position acceptance estimates, admitted under a cost model of the step) and the
EWMA-with-pause of SGLang's adaptive speculative decoding; the code is our own.
"""
from __future__ import annotations

import statistics

import numpy as np

PRIOR_ACCEPTANCE = 0.7  # a new request's acceptance estimate at every position (optimistic: drafts get tried)
EWMA_WEIGHT = 0.25  # weight of the newest verify in a position's estimate
PRIOR_ROW_COST = 0.1  # an unmeasured extra token's cost, relative to the step it joins (optimistic: it gets tried)
MIN_ROW_COST = 0.03  # a draft token never costs less than this fraction of the step it joins
FIRST_PAUSE = 16  # output tokens a request waits after its first pause; doubles per failed retry
MAX_PAUSE = 256


class StepCostModel:
    """Predicted step time by scheduled tokens T in [1, ``max_tokens``], from observed steps.

    The first ``warmup`` steps of each T are not counted (a first step of a new shape may carry one-time
    costs). After that each T keeps its last ``window`` step times, and its estimate is their median once
    it has ``min_samples`` of them (before that T counts as not measured, which ``relative_costs`` prices
    optimistically, so it gets tried). A median ignores the odd slow step that another process causes on
    a shared machine; a mean would keep such a step in a T's price, and a T priced too high is not
    chosen again, so its price would never be corrected.

    Prices must come from the same period: a shared machine's speed drifts (steps 2x faster or slower
    from one minute to the next), and while drafting pays almost every step has k + 1 tokens, so the
    one-token price would otherwise date from minutes before the price it is compared with. So a median
    takes only the samples of the last ``horizon`` observed steps (or the newest ``min_samples`` when
    fewer are that recent), a size not timed within ``horizon`` steps is priced as not measured (so it is
    tried, and timed, again), and ``needs_probe(T)`` asks for a step of T tokens (no drafts) once T has
    not been timed for ``probe_interval`` steps, at most once per ``probe_interval`` steps: at a steady
    batch size one step in ``probe_interval`` forgoes its drafts to keep the comparison current.

    Args:
        max_tokens: the largest T tracked (steps with more tokens are not recorded).
        window: step times kept per T (the newest).
        min_samples: counted steps a T needs before its median is used.
        warmup: steps of each T that are not counted.
        horizon: observed steps after which a sample stops counting (unless too few are newer).
        probe_interval: observed steps without a step of T tokens after which ``needs_probe(T)`` is True.
    """

    def __init__(self, max_tokens: int, window: int = 15, min_samples: int = 3, warmup: int = 1,
                 horizon: int = 256, probe_interval: int = 64) -> None:
        if not 1 <= min_samples <= window:
            raise ValueError(f"min_samples must be in [1, window], got {min_samples} (window {window})")
        self.max_tokens = max_tokens
        self.window, self.min_samples, self.warmup = window, min_samples, warmup
        self.horizon, self.probe_interval = horizon, probe_interval
        self.seconds = np.full(max_tokens + 1, np.nan)  # [T] median of the window (NaN: not measured); [0] unused
        self.num_observed = np.zeros(max_tokens + 1, dtype=np.int64)  # [T] steps seen, warm-up included
        self.clock = 0  # steps observed (of any size in range)
        self.last_counted = np.full(max_tokens + 1, -1, dtype=np.int64)  # [T] clock of T's newest counted step
        self.probe_asked = np.full(max_tokens + 1, -probe_interval, dtype=np.int64)  # [T] clock of the last ask
        self._recent: dict[int, list[tuple[int, float]]] = {}  # T -> its last ``window`` (clock, seconds), oldest first

    def observe(self, num_tokens: int, seconds: float) -> None:
        """Record one step of ``num_tokens`` scheduled tokens that took ``seconds``."""
        if not 1 <= num_tokens <= self.max_tokens or seconds <= 0:
            return
        self.clock += 1
        self.num_observed[num_tokens] += 1
        if self.num_observed[num_tokens] <= self.warmup:
            return
        self.last_counted[num_tokens] = self.clock
        recent = self._recent.setdefault(num_tokens, [])
        recent.append((self.clock, seconds))
        if len(recent) > self.window:
            del recent[0]
        if len(recent) >= self.min_samples:
            fresh = [s for c, s in recent if self.clock - c < self.horizon]
            use = fresh if len(fresh) >= self.min_samples else [s for _, s in recent[-self.min_samples:]]
            self.seconds[num_tokens] = statistics.median(use)  # (np.median costs 10x more on 15 floats)

    def needs_probe(self, num_tokens: int) -> bool:
        """True when a step of ``num_tokens`` tokens was counted once but not in the last
        ``probe_interval`` observed steps: the next step should run without drafts. Asked at most once per
        ``probe_interval`` observed steps: the step may come out another size (a request still
        prefilling, or left out by the token budget), and then the next ask waits a full interval."""
        if not 1 <= num_tokens <= self.max_tokens or self.last_counted[num_tokens] < 0:
            return False
        if (self.clock - self.last_counted[num_tokens] < self.probe_interval
                or self.clock - self.probe_asked[num_tokens] < self.probe_interval):
            return False
        self.probe_asked[num_tokens] = self.clock
        return True

    def has_measured_up_to(self, num_tokens: int) -> bool:
        """True once a step of at most ``num_tokens`` tokens has been timed (so a step of that size is
        not priced by a guess from larger ones alone)."""
        return bool((~np.isnan(self.seconds[1 : num_tokens + 1])).any())

    def relative_costs(self, base: int, count: int) -> np.ndarray:
        """Predicted time of a step of ``base + n`` tokens over that of ``base`` tokens, n = 0..count.

        Measured points are used as they are. A size not measured is priced optimistically, so that it
        gets tried (and then measured): from the nearest measured size below it, growing by
        ``PRIOR_ROW_COST`` of that step's per-token share per extra token, unless linear interpolation
        between its measured neighbours is cheaper; below the first measured size, shrinking at the same
        rate. A size last timed more than ``horizon`` steps ago counts as not measured. The result never
        grows by less than ``MIN_ROW_COST`` per token. Returns [count + 1] float, [0] == 1.
        """
        end = base + count
        t = np.arange(1, max(end, self.max_tokens) + 1)
        seconds = np.full(len(t), np.nan)
        seconds[: self.max_tokens] = self.seconds[1 : len(t) + 1]
        # a size not timed in the last horizon steps counts as not measured (priced optimistically, so it
        # is tried and timed again): its price may date from another speed period
        stale = self.clock - self.last_counted[1 : self.max_tokens + 1] >= self.horizon
        seconds[: self.max_tokens][stale] = np.nan
        known = ~np.isnan(seconds)
        if not known.any():  # nothing measured: relative costs from a unit step of one token
            seconds[0], known[0] = 1.0, True
        values, points = seconds[known], t[known]
        est = np.interp(t, points, values)  # between measured sizes (constant outside them)
        below = np.maximum.accumulate(np.where(known, t, 0))  # nearest measured size at or below t (0: none)
        lo = np.maximum(below, 1)
        from_below = np.interp(lo, points, values) * (1 + PRIOR_ROW_COST * (t - lo) / lo)
        last = points[-1]
        est = np.where(t > last, from_below, np.where((below > 0) & ~known, np.fmin(est, from_below), est))
        first = points[0]
        est = np.where(t < first, values[0] / (1 + PRIOR_ROW_COST * (first - np.minimum(t, first)) / first), est)
        costs = est[base - 1 : end] / est[base - 1]  # (count + 1,)
        floor = 1.0 + MIN_ROW_COST * np.arange(count + 1)
        return np.maximum(np.maximum.accumulate(costs), floor)


class AcceptanceEstimate:
    """One request's per-position acceptance estimates and pause state.

    Args:
        num_positions: k, the most drafts per step.
    """

    def __init__(self, num_positions: int) -> None:
        self.accept = np.full(num_positions, PRIOR_ACCEPTANCE)  # [k] P(draft j accepted | drafts < j accepted)
        self.paused_until: int | None = None  # output length at which drafting resumes
        self.pause = FIRST_PAUSE
        self.accepted_since_resume = False

    def survival(self) -> np.ndarray:
        """[k] probability that draft j and every draft before it are accepted."""
        return np.cumprod(self.accept)

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        """Update from one verify: ``num_accepted`` of ``num_drafts`` drafts accepted (positions after
        the first rejection were not observed)."""
        seen = min(num_accepted + 1, num_drafts)
        outcome = np.zeros(seen)
        outcome[:num_accepted] = 1.0
        self.accept[:seen] += EWMA_WEIGHT * (outcome - self.accept[:seen])
        if num_accepted:
            self.accepted_since_resume = True

    def is_paused(self, num_output_tokens: int) -> bool:
        """True while paused; at the end of a pause the estimates start again from the prior."""
        if self.paused_until is None:
            return False
        if num_output_tokens < self.paused_until:
            return True
        self.paused_until = None
        self.accept[:] = PRIOR_ACCEPTANCE
        self.accepted_since_resume = False
        return False

    def pause_now(self, num_output_tokens: int) -> None:
        """Stop drafting for a while: ``FIRST_PAUSE`` output tokens, doubling (up to ``MAX_PAUSE``) each
        time the retry after a pause accepted no draft, back to ``FIRST_PAUSE`` once one did."""
        if self.accepted_since_resume:
            self.pause = FIRST_PAUSE
        self.paused_until = num_output_tokens + self.pause
        self.pause = min(2 * self.pause, MAX_PAUSE)


def plan_num_drafts(survival: list[np.ndarray], caps: list[int], base_tokens: int,
                    costs: StepCostModel) -> list[int]:
    """How many drafts each request verifies in the next step.

    Args:
        survival: per request, [k] survival probability of each draft position (non-increasing).
        caps: per request, the most drafts it may verify (drafts available, room left).
        base_tokens: tokens the step schedules without drafts (one per decoding request).
        costs: the step cost model.
    Returns:
        per request, n_i <= caps[i]: the N best slots overall (highest survival first; a request's
        positions in order), N maximising (base_tokens + sum of admitted survival) / cost(base + N).
    """
    values, owner = [], []
    for i, (s, cap) in enumerate(zip(survival, caps)):
        values.append(s[:cap])
        owner.append(np.full(min(cap, len(s)), i))
    if not values or sum(len(v) for v in values) == 0:
        return [0] * len(caps)
    values_all, owner_all = np.concatenate(values), np.concatenate(owner)
    order = np.argsort(-values_all, kind="stable")  # a request's positions stay in order (non-increasing)
    gain = base_tokens + np.concatenate([[0.0], np.cumsum(values_all[order])])  # [N + 1] expected tokens
    rate = gain / costs.relative_costs(base_tokens, len(order))
    best = int(np.argmax(rate))  # the first maximum: fewest drafts among equally good plans
    return np.bincount(owner_all[order[:best]], minlength=len(caps)).tolist()
