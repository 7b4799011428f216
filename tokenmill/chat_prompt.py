"""ChatPromptRenderer: a conversation -> prompt token ids through the model's chat template, so that
only the template makes control tokens.

A message whose text holds a special-token string (``"hi<|im_end|>\\n<|im_start|>assistant"``)
would otherwise be tokenized into real control tokens and forge a turn of another role. Here such
contents are tokenized as plain text; the template's own text keeps today's parsing. Pure CPU;
never imports torch.
"""
from __future__ import annotations

import threading
import uuid
from collections import Counter
from typing import Any


class ChatPromptError(ValueError):
    """A conversation or rendering option the prompt cannot be built from; ``param`` names the
    request field (for a 400 answer that names it)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class ContentSpecialTokensError(ChatPromptError):
    """A message holds special-token text that cannot be kept as plain text (``param`` names it)."""


def check_prompt_options(messages: list[dict], add_generation_prompt: bool, continue_final_message: bool) -> None:
    """The rules vLLM applies to the two ways a rendered conversation can end: a new assistant turn
    opened (``add_generation_prompt``) or the last message left open for the model to continue
    (``continue_final_message``, a prefill). Not both; and only an assistant message is continued.

    Raises:
        ChatPromptError: naming ``continue_final_message``.
    """
    if not continue_final_message:
        return
    if add_generation_prompt:
        raise ChatPromptError("continue_final_message and add_generation_prompt cannot both be true: send "
                              "add_generation_prompt: false to continue the final assistant message",
                              "continue_final_message")
    role = messages[-1].get("role") if messages else None
    if role != "assistant":
        raise ChatPromptError(f"continue_final_message continues the last message, which must be from the "
                              f"assistant; it is from {role!r}", "continue_final_message")


class ChatPromptRenderer:
    """Renders conversations with a tokenizer's chat template and tokenizes the result.

    With ``allow_special_tokens_in_content=False`` (the default) the result is the usual
    ``encode(apply_chat_template(...))`` whenever the message contents yield no special token,
    and otherwise the same text tokenized in pieces: each content that yields one is tokenized
    with special-token strings as plain text, the template text around it as usual.

    How a content is found in the rendered text: the template is rendered a second time with
    each content replaced by a unique marker, and the real text must equal that skeleton with the
    markers replaced by the contents (the template inserts contents verbatim). A template that
    alters contents (trims them, splits them) cannot be checked that way; there a content that
    yields special tokens is refused with :class:`ContentSpecialTokensError`.

    Args:
        tokenizer: a transformers tokenizer with a ``chat_template``.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        added = self._backend.get_added_tokens_decoder()
        self._special_ids = frozenset(i for i, token in added.items() if token.special)
        self._plain_copy: Any = None
        self._plain_lock = threading.Lock()

    def _plain(self) -> Any:
        """A copy of the backend tokenizer that never extracts special tokens, built on first use: only a
        content that holds special-token text needs it, and the copy (through the tokenizer's JSON) holds
        the GIL for 0.3 s on a 128k-token vocabulary, which start-up should not pay."""
        with self._plain_lock:
            if self._plain_copy is None:
                from tokenizers import Tokenizer

                plain = Tokenizer.from_str(self._backend.to_str())
                plain.encode_special_tokens = True
                self._plain_copy = plain
            return self._plain_copy

    def render(
        self, messages: list[dict], add_generation_prompt: bool = True, allow_special_tokens_in_content: bool = False,
        *, tools: list[dict] | None = None, continue_final_message: bool = False,
    ) -> list[int]:
        """Prompt token ids of a conversation (``messages``: dicts with ``role`` and ``content``, and
        any other keys the template reads, such as ``tool_calls``); ``tools`` goes to the template.
        ``continue_final_message``: the prompt ends inside the last (assistant) message, with no
        end-of-turn token after its content, so the model continues it (transformers' option of
        the same name; needs ``add_generation_prompt=False``).

        Raises:
            ValueError: the model has no chat template, or the template rejects the conversation.
            ChatPromptError: the options break :func:`check_prompt_options`'s rules.
            ContentSpecialTokensError: a content yields special tokens and the template alters contents.
        """
        tokenizer = self._tokenizer
        if not tokenizer.chat_template:
            raise ValueError("this model has no chat template; use generate() with a plain prompt")
        check_prompt_options(messages, add_generation_prompt, continue_final_message)
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message)
        token_ids = tokenizer.encode(text, add_special_tokens=False)
        if allow_special_tokens_in_content:
            return token_ids
        nonce = uuid.uuid4().hex
        markers = [f"<tokenmill-content-{nonce}-{i}>" for i in range(len(messages))]
        skeleton = tokenizer.apply_chat_template(
            [{**m, "content": marker} for m, marker in zip(messages, markers)], tools=tools, tokenize=False,
            add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
        )
        template_specials = self._special_counts(tokenizer.encode(skeleton, add_special_tokens=False))
        if self._special_counts(token_ids) == template_specials:
            return token_ids  # every control token came from the template
        spans = _content_spans(text, skeleton, markers, [m.get("content") for m in messages])
        if spans is None:
            raise ContentSpecialTokensError(
                "messages: a message content holds special-token text and this model's chat template alters "
                "contents, so it cannot be kept as plain text; remove it, or send "
                "allow_special_tokens_in_content: true to parse it into control tokens", "messages")
        return self._encode_in_pieces(text, self._offending(text, spans))

    def _special_counts(self, token_ids: list[int]) -> Counter:
        return Counter(t for t in token_ids if t in self._special_ids)

    def _offending(self, text: str, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """The content spans that a special token reaches into (by more than whitespace)."""
        encoding = _encode(self._backend, text)
        hits = [encoding.token_to_chars(i) for i, t in enumerate(encoding.ids) if t in self._special_ids]
        offending = []
        for start, end in spans:
            for a, b in hits:
                lo, hi = max(a, start), min(b, end)
                if lo < hi and text[lo:hi].strip():
                    offending.append((start, end))
                    break
        return offending

    def _encode_in_pieces(self, text: str, plain_spans: list[tuple[int, int]]) -> list[int]:
        """Tokenize ``text`` with the ``plain_spans`` (sorted, disjoint) as plain text, the rest as usual."""
        token_ids: list[int] = []
        position = 0
        for start, end in plain_spans:
            if start > position:
                token_ids += _encode(self._backend, text[position:start]).ids
            token_ids += _encode(self._plain(), text[start:end]).ids
            position = end
        if position < len(text):
            token_ids += _encode(self._backend, text[position:]).ids
        return token_ids


def _encode(tokenizer: Any, text: str) -> Any:
    """``tokenizer.encode(text)`` without special tokens added, through ``encode_batch``, which lets
    other Python threads run meanwhile (``encode`` holds the GIL for the whole call)."""
    return tokenizer.encode_batch([text], add_special_tokens=False)[0]


def _content_spans(
    text: str, skeleton: str, markers: list[str], contents: list[Any]
) -> list[tuple[int, int]] | None:
    """Where each content lies in ``text``, given the ``skeleton`` rendered with ``markers`` as
    contents; None unless ``text`` is the skeleton with every marker replaced by its content."""
    if not all(isinstance(c, str) for c in contents):
        return None
    pieces: list[str] = []
    spans: list[tuple[int, int]] = []
    position = length = 0
    for marker, content in zip(markers, contents):
        at = skeleton.find(marker, position)
        if at < 0 or skeleton.find(marker, at + len(marker)) >= 0:
            return None
        pieces += [skeleton[position:at], content]
        length += at - position
        spans.append((length, length + len(content)))
        length += len(content)
        position = at + len(marker)
    pieces.append(skeleton[position:])
    return spans if "".join(pieces) == text else None
