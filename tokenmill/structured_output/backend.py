"""The narrow interface every grammar library sits behind: compile a constraint, make a per-request
matcher, fill a batch's next-token bitmask, accept and roll back tokens.

No grammar code of our own lives here: the libraries (llguidance, xgrammar) own the grammar;
tokenmill owns the matcher handles, the batch bitmask and where they are used. Never imports torch.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

# Bits per bitmask word: token t is allowed iff bit (t % 32) of word (t // 32) is set.
BITS_PER_WORD = 32


class ConstraintError(ValueError):
    """A constraint that cannot be compiled exactly: invalid JSON schema, regex or grammar, or a
    schema feature the backend cannot enforce (refused rather than silently weakened).

    Attributes:
        kind: the constraint kind (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``,
            ``tool_calls``), so a caller can name the field the user sent.
        reason: why, in words.
    """

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(f"invalid {kind} constraint: {reason}")
        self.kind = kind
        self.reason = reason


class ConstraintTimeoutError(ConstraintError):
    """A constraint that did not compile within the caller's deadline (``StructuredOutputManager.compile``)."""


@dataclass(frozen=True)
class CompiledConstraint:
    """A compiled constraint, shared by every request using the same (backend, kind, spec).

    ``handle`` is the backend's own object (llguidance grammar text, xgrammar CompiledGrammar).
    """

    backend: str
    kind: str
    spec: str
    handle: object


class Matcher(ABC):
    """One sequence's position in its constraint. Not thread-safe; owned by one request.

    ``matcher`` is the library's own matcher object; both libraries name their rollback and reset
    the same, so those two delegate here.
    """

    def __init__(self, matcher: object) -> None:
        self.matcher = matcher

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False (state unchanged) if the constraint forbids it."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (speculative decoding's rejected drafts)."""
        if num_tokens:
            self.matcher.rollback(num_tokens)  # type: ignore[attr-defined]

    @abstractmethod
    def is_terminated(self) -> bool:
        """True when the output is complete: the constraint admits no further token (or the
        end-of-sequence token was accepted). The request then finishes with ``stop``."""

    def reset(self) -> None:
        """Back to the start of the constraint (nothing accepted)."""
        self.matcher.reset()  # type: ignore[attr-defined]


class StructuredOutputBackend(ABC):
    """One grammar library bound to one tokenizer and vocabulary.

    Args (of implementations): tokenizer (a transformers tokenizer), vocab_size (the model's
    logits width, which may exceed the tokenizer's), eos_token_ids (ids that end a sequence).
    """

    name: str

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    @property
    def num_words(self) -> int:
        """Bitmask words per row: ceil(vocab_size / 32)."""
        return (self.vocab_size + BITS_PER_WORD - 1) // BITS_PER_WORD

    def allocate_bitmask(self, num_rows: int) -> np.ndarray:
        """A [num_rows, num_words] int32 bitmask, all tokens allowed."""
        return np.full((num_rows, self.num_words), -1, dtype=np.int32)

    @abstractmethod
    def compile(self, kind: str, spec: str) -> CompiledConstraint:
        """Compile one constraint (``kind`` and ``spec`` as in ``StructuredOutputsParams``).

        Raises:
            ConstraintError: the spec is invalid or cannot be enforced exactly.
        """

    @abstractmethod
    def new_matcher(self, compiled: CompiledConstraint) -> Matcher:
        """A fresh matcher at the start of ``compiled``."""

    @abstractmethod
    def fill_bitmask(self, matchers: list[Matcher], bitmask: np.ndarray) -> None:
        """Write row i of ``bitmask`` [len(matchers), num_words] int32 with the tokens matcher i
        allows next. Releases the GIL while the library works, so it can overlap the forward."""
