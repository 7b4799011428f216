"""IncrementalDetokenizer: one request's generated token ids -> final text, one engine step at a time.

Owns the request's output text and stop-string matching (``StopStringMatcher``). Per-step cost
depends on a small window of tokens and on the new text times the number of stop strings (plus one
copy of the held-back text, shorter than the longest stop string), never on the output length.
Pure CPU; never imports torch.
"""
from __future__ import annotations

import functools
from typing import Any

from tokenmill.sampling_params import SamplingParams

REPLACEMENT_CHAR = "\ufffd"  # what a lossy UTF-8 decode writes for bytes that form no character


class IncrementalDetokenizer:
    """Decodes one request's output tokens incrementally and watches for stop strings.

    What the text is: the joined deltas, and ``output_text`` after :meth:`finish`, equal
    ``tokenizer.decode(output_token_ids, skip_special_tokens=params.skip_special_tokens)``,
    cut before the first stop string (or after it with ``include_stop_str_in_output``). The
    output tokens are decoded on their own, not as a continuation of the prompt: for byte-level
    BPE (GPT-2, Llama-3, SmolLM2) that is the same string as ``decode(prompt + output)`` minus
    ``decode(prompt)``; for SentencePiece-style decoders (Metaspace, ``Strip``) it drops the
    first output token's leading space exactly as ``tokenizer.decode(output_ids)`` does.
    ``prompt_token_ids`` is therefore not used as decoding context; it is accepted so the
    engine can build the detokenizer from the request as it stands.

    How: the classic prefix/read-offset technique. ``_ids`` holds the tokens of the last
    emitted piece (the *prefix window*, ``_ids[:_num_prefix]``, whose text is ``_prefix_text``)
    followed by tokens not yet turned into text. Each step decodes only ``_ids`` and emits the
    text past ``_prefix_text`` once it does not end in U+FFFD (an incomplete UTF-8 character
    that later tokens may complete). ``tokenizers.decoders.DecodeStream`` does the same in Rust
    but cannot flush a trailing incomplete character when the request ends (the full decode
    shows U+FFFD there) and raises on decoders whose window text is not a prefix of the next.

    Stop strings: each step feeds only the new text to a ``StopStringMatcher``, which remembers,
    per stop string, how much of it the text so far ends with. The longest suffix that could begin
    a stop string is held back, so text once emitted is never withdrawn; :meth:`finish` releases
    it. As in vLLM, stop strings are searched only once more than ``params.min_tokens`` tokens
    exist: a match must end in text that arrived with a later update (stop token ids obey
    ``min_tokens`` the same way).

    Known limits: ``clean_up_tokenization_spaces`` (a WordPiece-era post-process that
    transformers skips for BPE) is not applied; an *invalid* run of byte-fallback tokens that
    begins with a valid character decodes differently in full (the ``ByteFallback`` decoder
    turns the whole run into U+FFFD); models do not produce these in practice. The token window
    only grows while tokens add no text (skipped special tokens, a trailing invalid byte).
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        # A transformers PreTrainedTokenizerFast wraps a tokenizers.Tokenizer; decode with the
        # Rust one directly (transformers' decode adds only the cleanup noted above).
        self._tokenizer = getattr(tokenizer, "backend_tokenizer", tokenizer)
        self._skip_special_tokens = params.skip_special_tokens
        self._stop = StopStringMatcher(params.stop or ())
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._num_tokens = 0  # output tokens received so far
        self._finished = False

        # Token window (see class docstring).
        self._ids: list[int] = []
        self._num_prefix = 0
        self._prefix_text = ""

        # Text. Decoded text = released text + _held (a possible beginning of a stop string).
        self._held = ""
        self._released: list[str] = []  # released (final) pieces, collapsed by output_text
        self._unsent: list[str] = []  # released pieces not yet returned by get_delta_text

    # ---- public API -------------------------------------------------------------------------

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append generated tokens; return the matched stop string if one was hit, else None.

        After a stop string is hit the request is finished: call neither update nor finish again.
        """
        assert not self._finished, "update() after the request finished"
        if not new_token_ids:
            return None
        self._num_tokens += len(new_token_ids)
        self._ids.extend(new_token_ids)
        new_text = self._decode_new_text(flush=False)
        return self._add_text(new_text) if new_text else None

    @property
    def output_text(self) -> str:
        """Final text so far: no held-back stop-string prefix, no incomplete UTF-8 character."""
        if len(self._released) > 1:
            self._released = ["".join(self._released)]
        return self._released[0] if self._released else ""

    def get_delta_text(self) -> str:
        """Final text released since the previous call (all of it on the first call)."""
        delta = "".join(self._unsent)
        self._unsent.clear()
        return delta

    def finish(self) -> None:
        """End the request for a reason other than a stop string (length, EOS, abort).

        Flushes a trailing incomplete character (as U+FFFD, like the full decode) and releases
        held-back text, so ``output_text`` becomes the full decode (still cut at a stop string
        should the flushed text complete one). Calling it again, or after a stop, does nothing.
        """
        if self._finished:
            return
        new_text = self._decode_new_text(flush=True)
        if new_text and self._add_text(new_text) is not None:
            return
        self._release(self._held)
        self._held = ""
        self._finished = True

    # ---- token ids -> text ------------------------------------------------------------------

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _decode_new_text(self, flush: bool) -> str:
        """Text of the unread tokens, or "" while it may end in an incomplete character.

        On success the unread tokens become the new prefix window. Cost: two decodes of the
        window, which holds the last emitted piece's tokens plus the unread ones.
        """
        if len(self._ids) == self._num_prefix:
            return ""
        text = self._decode(self._ids)
        if len(text) <= len(self._prefix_text):
            return ""  # e.g. a skipped special token: no text yet
        if text.endswith(REPLACEMENT_CHAR) and not flush:
            return ""  # wait: the next token may complete the character
        new_text = text[len(self._prefix_text) :]
        del self._ids[: self._num_prefix]
        self._num_prefix = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        return new_text

    # ---- stop strings and hold-back ---------------------------------------------------------

    def _add_text(self, new_text: str) -> str | None:
        """Append decoded text; release what is final; return the stop string if one is hit."""
        window = self._held + new_text
        num_old = len(self._held)
        match = self._stop.feed(new_text, report=self._num_tokens > self._min_tokens)
        if match is not None:
            stop, end_in_new = match
            end = num_old + end_in_new
            # The matcher's state never exceeds the held text, so no character of the stop string was released.
            assert end >= len(stop), (end, stop)
            self._release(window[: end if self._include_stop else end - len(stop)])
            self._held = ""
            self._finished = True
            return stop
        num_held = self._stop.num_held
        assert num_held <= len(window), (num_held, len(window))
        self._release(window[: len(window) - num_held])
        self._held = window[len(window) - num_held :] if num_held else ""
        return None

    def _release(self, text: str) -> None:
        if text:
            self._released.append(text)
            self._unsent.append(text)


@functools.lru_cache(maxsize=256)
def _prefix_table(stop: str) -> tuple[int, ...]:
    """KMP failure table of ``stop``: entry i is the length of the longest proper prefix of
    ``stop[: i + 1]`` that is also its suffix. O(len(stop)); cached, as every sequence of a request
    (and many requests) share their stop strings."""
    table = [0] * len(stop)
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = table[k - 1]
        if stop[i] == stop[k]:
            k += 1
        table[i] = k
    return tuple(table)


class StopStringMatcher:
    """Finds stop strings in text that arrives in pieces, looking at each character once.

    One Knuth-Morris-Pratt automaton per stop string: its state is how many leading characters
    of the stop string the text so far ends with. :meth:`feed` advances every automaton over the
    new text only (amortised O(len(new text)) per stop string, whatever the stop strings' lengths
    or the text before), skipping to the next occurrence of a stop string's first character with
    ``str.find`` while the automaton is at its start. ``num_held`` (the largest state) is how much
    of the text's end may still begin a stop string.

    Args:
        stops: the stop strings (non-empty; ``SamplingParams`` refuses empty ones).
    """

    def __init__(self, stops: tuple[str, ...] | list[str]) -> None:
        assert all(stops), "stop strings must not be empty"
        self.stops = tuple(stops)
        self._tables = [_prefix_table(stop) for stop in self.stops]
        self._states = [0] * len(self.stops)

    @property
    def num_held(self) -> int:
        """Length of the longest suffix of the text fed so far that is a proper prefix of a stop string."""
        return max(self._states, default=0)

    def feed(self, text: str, report: bool = True) -> tuple[str, int] | None:
        """Advance over ``text``. With ``report``, return ``(stop, end)`` for the stop string that
        completes first (``end``: its end as an index into ``text``; ties: the longer one, which
        starts first), else None. Without ``report`` completed matches are passed over (the text
        before ``min_tokens``), and the automata go on as if they had not matched.
        After a reported match the matcher is spent: feed it no more."""
        best: tuple[int, int, str] | None = None  # (end, -len(stop), stop)
        for i, (stop, table) in enumerate(zip(self.stops, self._tables)):
            state, end = self._advance(stop, table, self._states[i], text, report)
            self._states[i] = state
            if end is not None and (best is None or (end, -len(stop)) < best[:2]):
                best = (end, -len(stop), stop)
        return None if best is None else (best[2], best[0])

    @staticmethod
    def _advance(stop: str, table: tuple[int, ...], state: int, text: str, report: bool) -> tuple[int, int | None]:
        """One automaton over ``text``: (new state, end of the first match in ``text`` if ``report`` and
        one completes, else None)."""
        first, length = stop[0], len(stop)
        j, n = 0, len(text)
        while j < n:
            if state == 0:
                j = text.find(first, j)  # nothing to carry: jump to the next possible start
                if j < 0:
                    break
            char = text[j]
            while state and char != stop[state]:
                state = table[state - 1]
            if char == stop[state]:
                state += 1
            j += 1
            if state == length:
                if report:
                    return state, j
                state = table[length - 1]
        return state, None
