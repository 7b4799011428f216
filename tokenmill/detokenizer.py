"""IncrementalDetokenizer: one request's generated token ids -> final text, one engine step at a time.

Owns the request's output text and stop-string matching. Per-step cost depends on a small
window of tokens and on the stop strings' lengths, never on the output length. Pure CPU;
never imports torch.
"""
from __future__ import annotations

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

    Stop strings: each step searches only the new text plus the last ``max_stop_len - 1``
    characters before it. The longest suffix that could begin a stop string is held back, so
    text once emitted is never withdrawn; :meth:`finish` releases it. As in vLLM, stop strings
    are searched only once more than ``params.min_tokens`` tokens exist: a match must end in
    text that arrived with a later update (stop token ids obey ``min_tokens`` the same way).

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
        self._stop: tuple[str, ...] = tuple(params.stop or ())
        self._include_stop = params.include_stop_str_in_output
        self._tail_len = max((len(s) for s in self._stop), default=1) - 1
        self._min_tokens = params.min_tokens
        self._num_tokens = 0  # output tokens received so far
        self._finished = False

        # Token window (see class docstring).
        self._ids: list[int] = []
        self._num_prefix = 0
        self._prefix_text = ""

        # Text. Decoded text = released text + held text; held text is a suffix of _tail.
        self._tail = ""  # last _tail_len characters of the decoded text
        self._num_held = 0  # characters at the end of _tail not released yet
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
        self._release(self._tail[len(self._tail) - self._num_held :])
        self._num_held = 0
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
        window = self._tail + new_text
        num_old = len(self._tail)
        release_from = num_old - self._num_held  # window index of the first unreleased char

        match = self._find_stop(window, num_old) if self._num_tokens > self._min_tokens else None
        if match is not None:
            stop, start = match
            end = start + len(stop) if self._include_stop else start
            # Hold-back guarantees no character of a stop string was released before.
            assert end >= release_from, (end, release_from)
            self._release(window[release_from:end])
            self._finished = True
            return stop

        num_held = self._held_suffix_len(window)
        release_to = len(window) - num_held
        assert release_to >= release_from, (release_to, release_from)
        self._release(window[release_from:release_to])
        self._num_held = num_held
        self._tail = window[max(0, len(window) - self._tail_len) :] if self._tail_len else ""
        return None

    def _find_stop(self, window: str, num_old: int) -> tuple[str, int] | None:
        """The stop string that completes first in ``window`` (ties: the one starting first).

        Only matches ending in the new text (past ``num_old``) count; earlier ones would have
        stopped an earlier step. Cost: O(len(window)) per stop string.
        """
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stop:
            start = window.find(stop, max(0, num_old - len(stop) + 1))
            if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        return None if best is None else (best[2], best[1])

    def _held_suffix_len(self, window: str) -> int:
        """Length of the longest suffix of ``window`` that is a proper prefix of a stop string."""
        held = 0
        for stop in self._stop:
            for k in range(min(len(stop) - 1, len(window)), held, -1):
                if window.endswith(stop[:k]):
                    held = k
                    break
        return held

    def _release(self, text: str) -> None:
        if text:
            self._released.append(text)
            self._unsent.append(text)
